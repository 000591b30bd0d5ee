"""Run a function on N local gloo processes and collect what each returns.

Used by the tests, ``megatron-fcp demo`` and the benchmarks: one process group per call, a
``file://`` rendezvous (no port races), ``OMP_NUM_THREADS=1`` so N processes share 2 cores fairly,
and a bounded wait: a rank that raises reports its traceback, and a group that does not finish
within ``timeout_s`` is killed and reported instead of hanging the caller.

Fault drills (``keep_going=True``): a rank that dies (e.g. SIGKILL in the middle of attention) or
raises does not stop the others; every surviving rank runs to its own end and reports, and the
caller gets one :class:`RankOutcome` per rank (with the process id, to check nothing is left).
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A rank of a :func:`run_gloo` group raised or timed out; the message holds its traceback."""


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickle here with plain pickle: torch tensors then travel as bytes. Through the queue's
        # own pickler they would travel as shared-memory handles that die with this process.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))


@dataclass
class RankOutcome:
    """How one rank of a ``keep_going`` run ended: ``ok`` with ``value``, raised (``error`` holds
    the traceback), or died without reporting (``ok is None``, ``exitcode`` e.g. -9 for SIGKILL)."""

    rank: int
    ok: bool | None
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    pid: int | None = None
    seconds: float = 0.0  # from start until the parent saw the report or the exit


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
             keep_going: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank.

    ``fn`` must be importable (module-level) since processes are started with ``spawn``. The
    default process group is initialised before ``fn`` runs and destroyed after. Results may hold
    tensors (they are copied back by value). ``keep_going``: return a :class:`RankOutcome` per
    rank instead of raising at the first failure (see the module docstring); ranks still running
    at ``timeout_s`` are killed and reported as such.
    """
    if keep_going:
        return _run_keep_going(fn, world_size, args, timeout_s)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fcp-gloo-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        failures: list[str] = []
        try:
            while len(outputs) + len(failures) < world_size:
                try:
                    rank, ok, payload = results.get(timeout=timeout_s)
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise WorkerError(
                        f"ranks {missing} did not finish within {timeout_s:.0f} s"
                        + ("; failures:\n" + "\n".join(failures) if failures else "")
                    ) from None
                if ok:
                    outputs[rank] = pickle.loads(payload)
                else:
                    failures.append(f"--- rank {rank} ---\n{payload}")
                    break  # the others may now wait forever on the failed rank
        finally:
            for p in procs:
                p.join(timeout=5 if not failures else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if failures:
        raise WorkerError("a rank failed:\n" + "\n".join(failures))
    return [outputs[r] for r in range(world_size)]


def _run_keep_going(fn: Callable, world_size: int, args: tuple, timeout_s: float) -> list[RankOutcome]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fcp-gloo-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results), daemon=True)
                 for r in range(world_size)]
        start = time.monotonic()
        for p in procs:
            p.start()
        outcomes: dict[int, RankOutcome] = {}
        exited_at: dict[int, float] = {}
        try:
            while len(outcomes) < world_size and time.monotonic() - start < timeout_s:
                try:
                    rank, ok, payload = results.get(timeout=0.2)
                except queue.Empty:
                    now = time.monotonic()
                    for r, p in enumerate(procs):  # died without a report (after a grace for the queue)
                        if r not in outcomes and p.exitcode is not None:
                            if now - exited_at.setdefault(r, now) > 2.0:
                                outcomes[r] = RankOutcome(r, None, exitcode=p.exitcode, pid=p.pid,
                                                          seconds=exited_at[r] - start)
                    continue
                seconds = time.monotonic() - start
                if ok:
                    outcomes[rank] = RankOutcome(rank, True, value=pickle.loads(payload), pid=procs[rank].pid,
                                                 seconds=seconds)
                else:
                    outcomes[rank] = RankOutcome(rank, False, error=payload, pid=procs[rank].pid, seconds=seconds)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    for r, p in enumerate(procs):
        if r not in outcomes:
            outcomes[r] = RankOutcome(r, None, error=f"did not finish within {timeout_s:.0f} s (killed)",
                                      exitcode=p.exitcode, pid=p.pid, seconds=timeout_s)
        else:
            outcomes[r].exitcode = p.exitcode
    return [outcomes[r] for r in range(world_size)]
