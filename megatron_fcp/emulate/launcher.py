"""Start one worker process per rank inside its namespace, follow rank 0's progress, always reap.

Each rank runs ``ip netns exec <its namespace> <python> -m megatron_fcp.emulate.worker JOB OUT``
(``ip netns exec`` execs the program, so the process id we hold is the worker's). Environment:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` (rank 0's address: gloo's rendezvous),
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME=eth0``, ``OMP_NUM_THREADS=1`` and a ``PYTHONPATH`` that
finds this very package. Rank 0's stdout is read line by line (``@progress`` lines go to the
caller's callback); every rank's output also goes to a log file whose tail is reported on failure.

The launcher kills exactly the processes it started (SIGTERM, then SIGKILL after 5 s) when a rank
fails, on timeout, and on any exception including Ctrl-C; :func:`run_ranks` returns only when none
of them is left.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from megatron_fcp.emulate.spec import ClusterSpec, address_plan

__all__ = ["LaunchError", "run_ranks", "rank_env"]

_PKG_ROOT = str(Path(__file__).resolve().parents[2])


class LaunchError(RuntimeError):
    """A rank failed or the run timed out; the message holds the ranks' log tails."""


def rank_env(spec: ClusterSpec, rank: int, port: int) -> dict[str, str]:
    """The environment of ``rank``'s worker (module docstring)."""
    addrs = address_plan(spec)
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env.update(RANK=str(rank), WORLD_SIZE=str(spec.world), LOCAL_RANK=str(addrs[rank].local),
               MASTER_ADDR=addrs[0].ip, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=addrs[rank].gloo_ifname,
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=_PKG_ROOT + (os.pathsep + path if path else ""))
    return env


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_ranks(spec: ClusterSpec, job_path: str, out_path: str, logdir: str, timeout_s: float,
              on_progress: Callable[[str], None] | None = None) -> None:
    """Run the job on every rank of ``spec`` (whose namespaces exist); raise :class:`LaunchError` on failure."""
    port = random.randint(20000, 40000)
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    reader = None
    try:
        for a in address_plan(spec):
            log = Path(logdir) / f"rank{a.rank}.log"
            logs.append(log)
            cmd = ["ip", "netns", "exec", a.netns, sys.executable, "-m", "megatron_fcp.emulate.worker",
                   job_path, out_path]
            with open(log, "w") as lf:
                if a.rank == 0:
                    p = subprocess.Popen(cmd, env=rank_env(spec, a.rank, port), stdout=subprocess.PIPE,
                                         stderr=lf, text=True, stdin=subprocess.DEVNULL)
                else:
                    p = subprocess.Popen(cmd, env=rank_env(spec, a.rank, port), stdout=lf,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            procs.append(p)
        reader = threading.Thread(target=_follow, args=(procs[0], logs[0], on_progress), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                raise LaunchError(_failure(f"rank {bad[0][0]} exited with code {bad[0][1]}", logs,
                                           {r for r, _ in bad}))
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise LaunchError(_failure(f"timed out after {timeout_s:.0f} s", logs))
            time.sleep(0.1)
    finally:
        _reap(procs)
        if reader is not None:
            reader.join(timeout=2)


def _follow(proc: subprocess.Popen, log: Path, on_progress) -> None:
    """Copy rank 0's stdout to its log; hand ``@progress`` lines to the callback."""
    with open(log, "a") as lf:
        for line in proc.stdout:
            lf.write(line)
            lf.flush()
            if line.startswith("@progress") and on_progress is not None:
                on_progress(line.strip())


def _failure(what: str, logs: list[Path], failed: set[int] = frozenset()) -> str:
    """The message of a failed run: rank 0's log tail, and that of every rank that raised or
    exited non-zero (a native abort leaves no traceback: its tail still says where it was)."""
    parts = [f"emulated run failed: {what}"]
    for r, log in enumerate(logs):
        t = _tail(log).strip()
        if r in failed or (t and ("Error" in t or "Traceback" in t or r == 0)):
            parts.append(f"--- rank {r} ({log}) ---\n{t or '(empty log)'}")
    return "\n".join(parts)


def _reap(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    end = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.05, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
