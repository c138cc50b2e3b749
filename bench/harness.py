"""The harness the benchmark scripts share: an arm per subprocess, rounds, timing, machine, JSON.

Every compared arm of a benchmark runs in a fresh subprocess of its own script, so that no arm
inherits another's imports, threads or memory:

- `launch_child` runs `script --child SPEC` (bench/pretrain_throughput.py,
  bench/pretrain_gpu.py): the arm writes its result JSON into its own run directory, and a
  failed arm gives its exit code and the tail of its log instead;
- `run_phase` runs `script --phase NAME --OPTION VALUE ...` (bench/tokenizer_encode.py,
  bench/examples_throughput.py): the phase prints one JSON line, and the summed RSS of its
  process tree is sampled every 0.1 s (`TreeRss`); `phase_rounds` runs compared phases
  interleaved, round after round, and `fastest` or `median_run` keeps one run of each.

Around them: `CpuWatch` (the cores that processes outside a benchmark keep busy), time
accumulators, the machine's description and the results' JSON.

Only the standard library is imported at the top: bench/pretrain_gpu.py imports this module on
a GPU machine that has little beyond torch (psutil is imported where it is used).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"  # the real texts the benchmarks' corpora come from
CORES = os.cpu_count() or 1


# -- one arm per subprocess: `script --child SPEC` --------------------------------------------


def fresh_dir(path: Path) -> Path:
    """Remove `path` with everything in it, make it again empty, and return it."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def spawn_child(
    script: str | Path,
    spec: dict[str, Any],
    log_path: Path,
    env: dict[str, str],
    timeout_s: float,
    catch_timeout: bool = False,
) -> int:
    """Run `script --child SPEC` with its output in `log_path`; return its exit code.

    A child that runs past `timeout_s` raises `subprocess.TimeoutExpired`, or, with
    `catch_timeout`, gives exit code -1.
    """
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, str(script), "--child", json.dumps(spec)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            if not catch_timeout:
                raise
            return -1
    return proc.returncode


def launch_child(
    script: str | Path,
    spec: dict[str, Any],
    run_dir: Path,
    env: dict[str, str],
    timeout_s: float,
    tail_lines: int = 15,
    catch_timeout: bool = False,
) -> dict[str, Any]:
    """Run one arm as `script --child SPEC` in the emptied `run_dir`; return its result.

    The child reads `run_dir` and `result` (the path of its result JSON) from its spec, and its
    output goes to `run_dir/log.txt`. A failed child gives `{"error": "exit CODE: ..."}` with
    the last `tail_lines` lines of its log instead of a result.
    """
    fresh_dir(run_dir)
    spec = spec | {"run_dir": str(run_dir), "result": str(run_dir / "result.json")}
    log_path = run_dir / "log.txt"
    code = spawn_child(script, spec, log_path, env, timeout_s, catch_timeout)
    if code != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-tail_lines:]
        return {"error": f"exit {code}: " + "\n".join(tail)}
    result: dict[str, Any] = json.loads(Path(spec["result"]).read_text())
    return result


def time_lmpipe(
    root: Path, args: list[str], env: dict[str, str], entry: str = "pipelines.cli.main"
) -> tuple[float, str]:
    """Run one `lmpipe` command from checkout `root` in a new process; its wall time and output.

    `entry` is the module run: the CLI itself (default, the command in this process), or
    `pipelines.daemon.client`, what the `lmpipe` entry point runs (a daemon's fork, unless
    `LMPIPE_DAEMON=0`).

    Raises:
        SystemExit: the command failed (its exit code and stderr).
    """
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", entry, *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"lmpipe {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return wall, done.stdout + done.stderr


# -- one measurement per subprocess: `script --phase NAME` ------------------------------------


def add_folder_args(parser: argparse.ArgumentParser) -> None:
    """Add `--out` (where the results go) and `--work` (the phases' shared workspace)."""
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("bench/results/tokenizer_work"))


def phase_entry(args: argparse.Namespace, phases: dict[str, Callable[..., Any]]) -> bool:
    """Resolve `args.work`; in a `--phase` process run the phase and print its JSON line.

    Returns whether this process was a phase (and so has nothing more to do).
    """
    args.work = args.work.resolve()
    if not args.phase:
        return False
    print(json.dumps(phases[args.phase](args), default=str), flush=True)
    return True


class TreeRss(threading.Thread):
    """Samples, every 0.1 s until it exits, the summed RSS of a process and all its children."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        """Watch `process`; `start()` begins sampling, `peak` holds the highest sum in bytes."""
        import psutil

        super().__init__(daemon=True)
        self.process = process
        self.root = psutil.Process(process.pid)
        self.peak = 0

    def run(self) -> None:
        """Sample until the process exits."""
        import psutil

        while self.process.poll() is None:
            total = 0
            with contextlib.suppress(psutil.Error):
                for proc in [self.root, *self.root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        total += proc.memory_info().rss
            self.peak = max(self.peak, total)
            time.sleep(0.1)


def run_phase(name: str, args: argparse.Namespace, script: str, **extra: Any) -> dict[str, Any]:
    """Run one phase of `script` in a fresh process; return its JSON line and peak RSS.

    The phase gets `--work` and `--vocab` from `args`, and `--KEY VALUE` for each of `extra`.
    """
    argv = [sys.executable, script, "--phase", name, "--work", str(args.work)]
    argv += ["--vocab", str(args.vocab)]
    for key, value in extra.items():
        argv += [f"--{key}", str(value)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    sampler = TreeRss(process)
    sampler.start()
    out, _ = process.communicate()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"phase {name} {extra} failed with exit code {process.returncode}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result |= {"phase": name, **extra, "peak_rss_mib": round(sampler.peak / 2**20)}
    print(json.dumps(result, default=str), flush=True)
    return result


def phase_rounds(
    args: argparse.Namespace, script: str, phases: Iterable[tuple[str, dict[str, Any]]]
) -> list[list[dict[str, Any]]]:
    """Run each (phase, options) `args.repeat` times, interleaved; return each one's runs.

    Interleaving puts the compared runs under the same background load: each round runs every
    phase once, in the order given.
    """
    phases = list(phases)
    runs: list[list[dict[str, Any]]] = [[] for _ in phases]
    for _ in range(args.repeat):
        for slot, (name, extra) in enumerate(phases):
            runs[slot].append(run_phase(name, args, script, **extra))
    return runs


def fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Keep the fastest of a phase's runs, with every run's time and the highest peak memory."""
    kept = dict(min(runs, key=lambda r: r["elapsed_s"]))
    kept["all_elapsed_s"] = [round(r["elapsed_s"], 2) for r in runs]
    kept["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    return kept


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Keep the median of a phase's runs (the upper one of an even count), with every time."""
    kept = dict(upper_median(runs, key=lambda r: r["elapsed_s"]))
    kept["all_elapsed_s"] = [round(r["elapsed_s"], 4) for r in runs]
    return kept


# -- timing ------------------------------------------------------------------------------------


def upper_median(values: Iterable[Any], key: Callable[[Any], Any] | None = None) -> Any:
    """Return the middle of `values` sorted (by `key`); of an even count, the upper one."""
    ordered = sorted(values, key=key)
    return ordered[len(ordered) // 2]


def add_time(totals: dict[str, float], name: str, seconds: float) -> None:
    """Add `seconds` to `totals[name]` (from 0)."""
    totals[name] = totals.get(name, 0.0) + seconds


def timed_calls(fn: Callable[..., Any], totals: dict[str, float], name: str) -> Callable[..., Any]:
    """Wrap `fn` so that each call adds its wall time to `totals[name]`."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        add_time(totals, name, time.perf_counter() - start)
        return result

    return timed


class CpuWatch(threading.Thread):
    """Samples, every second, how many cores processes outside this benchmark keep busy.

    Others = the machine's busy cores minus this process tree's (live processes plus reaped
    children). The load average cannot tell: it counts the benchmark's own threads.
    Timestamps are `time.perf_counter` (CLOCK_MONOTONIC), comparable with the children's.
    """

    def __init__(self) -> None:
        """Start empty; `start()` begins sampling."""
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []  # (time, others' busy cores)
        self._stop_flag = threading.Event()

    @staticmethod
    def _busy_and_own() -> tuple[float, float]:
        import psutil

        cpu = psutil.cpu_times()
        busy = cpu.user + cpu.nice + cpu.system + cpu.irq + cpu.softirq + cpu.steal
        me = psutil.Process()
        times = me.cpu_times()
        own = times.user + times.system + times.children_user + times.children_system
        for child in me.children(recursive=True):
            try:
                times = child.cpu_times()
            except psutil.Error:
                continue
            own += times.user + times.system
        return busy, own

    def run(self) -> None:
        """Sample until stopped."""
        last, then = self._busy_and_own(), time.perf_counter()
        while not self._stop_flag.wait(1.0):
            now, (busy, own) = time.perf_counter(), self._busy_and_own()
            others = max(0.0, (busy - last[0]) - (own - last[1])) / (now - then)
            self.samples.append((now, others))
            last, then = (busy, own), now

    def finish(self) -> None:
        """Stop sampling."""
        self._stop_flag.set()
        self.join()


# -- the machine and the results ---------------------------------------------------------------


def cpu_model() -> str:
    """Return the CPU's model name (from /proc/cpuinfo where there is one)."""
    info = Path("/proc/cpuinfo").read_text().splitlines()
    names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    return names[0] if names else platform.processor()


def memory_gib(ndigits: int | None = None) -> float:
    """Return the machine's memory in GiB, rounded to `ndigits` (None: a whole number)."""
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, ndigits)


def version_of(name: str, optional: bool = False) -> str:
    """Return library `name`'s version; an `optional` one that fails to import: `missing (why)`."""
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        if not optional:
            raise
        return f"missing ({err})"
    return str(module.__version__)


def machine(*libraries: str) -> dict[str, Any]:
    """Describe the machine: CPU, cores, memory, Python and the versions of `libraries`."""
    versions = {name: version_of(name) for name in libraries}  # first: a missing one raises
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": memory_gib(1),
        "python": platform.python_version(),
        **versions,
    }


def write_json(
    path: Path,
    data: Any,
    indent: int = 1,
    newline: bool = False,
    default: Callable[[Any], Any] | None = None,
) -> None:
    """Write `data` to `path` as indented JSON (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=default) + ("\n" if newline else ""))
