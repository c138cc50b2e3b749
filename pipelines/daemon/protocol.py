"""How a command talks to its daemon: the socket's name and length-prefixed JSON messages.

The daemon listens on an abstract Unix socket (Linux): nothing on disk to go stale, and the
name is free again the moment the daemon exits. Anyone on the machine could connect to an
abstract name, so the daemon answers only peers of its own user (`peer_uid`).

Standard library only: the `lmpipe` client imports this before anything else.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 16 << 20  # an environment of a few hundred variables is a few KB


class DaemonGone(ConnectionError):
    """The other end closed the connection before a whole message arrived."""


def socket_name(key: str) -> str:
    """The abstract socket name of the daemon for `key` (one per user and key)."""
    return f"\0lmpipe-{os.getuid()}-{key}"


def connect(key: str) -> socket.socket:
    """Connect to the daemon for `key`.

    Raises:
        ConnectionRefusedError: no daemon listens under that name.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_name(key))
    except OSError:
        sock.close()
        raise
    return sock


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one message, and `fds` with its first byte (SCM_RIGHTS)."""
    body = json.dumps(message).encode()
    data = _HEADER.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        data = data[sent:]
    sock.sendall(data)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """Receive one message and the descriptors sent with it.

    Raises:
        DaemonGone: the connection closed first.
    """
    fds: list[int] = []
    head = b""
    while len(head) < _HEADER.size:
        if max_fds and not fds:
            chunk, got, _, _ = socket.recv_fds(sock, _HEADER.size - len(head), max_fds)
            fds.extend(got)
        else:
            chunk = sock.recv(_HEADER.size - len(head))
        if not chunk:
            raise DaemonGone("the connection closed")
        head += chunk
    (size,) = _HEADER.unpack(head)
    if size > MAX_MESSAGE:
        raise DaemonGone(f"a message of {size} bytes (at most {MAX_MESSAGE})")
    body = bytearray()
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            raise DaemonGone("the connection closed")
        body += chunk
    return json.loads(body), fds


def ask(key: str, message: dict[str, Any]) -> dict[str, Any]:
    """Send `message` to the daemon for `key` and return its one answer."""
    with connect(key) as sock:
        send(sock, message)
        return receive(sock)[0]


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])
