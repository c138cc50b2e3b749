"""The command daemon: stage commands run in forks of a process that imported Prefect once.

`client` is the `lmpipe` entry point (standard library only), `server` the daemon, `child`
what its forks do first, `protocol` the socket between them. docs/cli.md, "The command
daemon", says what a user sees.
"""
