"""Run a function on N local gloo processes and collect what each returns.

Used by the tests, ``megatron-fcp demo`` and the benchmarks: one process group per call, a
``file://`` rendezvous (no port races), ``OMP_NUM_THREADS=1`` so N processes share 2 cores fairly,
and a bounded wait: a rank that raises reports its traceback, and a group that does not finish
within ``timeout_s`` is killed and reported instead of hanging the caller.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import traceback
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


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank.

    ``fn`` must be importable (module-level) since processes are started with ``spawn``. The
    default process group is initialised before ``fn`` runs and destroyed after. Results may hold
    tensors (they are copied back by value).
    """
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
