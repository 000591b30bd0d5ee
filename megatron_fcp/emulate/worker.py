"""One rank of an emulated run: ``python -m megatron_fcp.emulate.worker JOB.pkl OUT.json``.

Started by :mod:`megatron_fcp.emulate.launcher` inside the rank's namespace with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (rank 0's address) and ``GLOO_SOCKET_IFNAME``.

The job (a pickled dict from :mod:`megatron_fcp.emulate.bench`): ``workloads`` (available ones),
``repeats``, ``component_repeats``, ``warmup``, ``compute`` (``"sleep"``: the emulated GPU stream,
``"blocking-sleep"`` or ``"cpu"``; Note [The emulated GPU stream]), ``flops``
(emulated FLOP/s), ``timeout_s``. Order of the timed runs, alternating so that drift on the shared
machine hits every workload alike::

    link probe: isolated messages on each kind of link (Note [Link probe] in probe.py), job["probe"]
    warm-up: each workload once (connections, allocator), not timed
    for rep in 0 .. repeats-1:
        for each workload: overlapped
        if rep < component_repeats: for each workload: communication only, then compute only

A run's time is the slowest rank's (all ranks leave a barrier, time forward + backward, and the
maximum is all-reduced). Rank 0 prints one progress line per timed run (``@progress done total
workload mode``) and writes ``{"times": {workload: {mode: [seconds...]}}, "modelled_compute_s":
{workload: seconds}, "link_probe": [...]}`` to OUT.json.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
import time

import torch
import torch.distributed as dist

from megatron_fcp.attention.comm import GlooTransport
from megatron_fcp.emulate.probe import run_probe
from megatron_fcp.emulate.runners import NullTransport, make_runner
from megatron_fcp.emulate.sleep_kernel import SleepKernel, VirtualStream

MODES = ("overlap", "comm", "compute")


def _kernels(job: dict):
    """(kernel for overlapped and compute-only runs, kernel for communication-only runs)."""
    zero = SleepKernel(0.0)
    if job["compute"] == "cpu":
        from megatron_fcp.attention.fused import CpuFlashKernel

        return ("cpu-flash" if CpuFlashKernel.available() else "math"), zero
    stream = VirtualStream() if job["compute"] == "sleep" else None  # "blocking-sleep": sleep in the call
    return SleepKernel(job["flops"], stream=stream, compute_model=job.get("compute_model")), zero


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item())


def run(job: dict) -> dict:
    rank = dist.get_rank()
    group = dist.group.WORLD
    gloo = GlooTransport(group, job["timeout_s"])
    null = NullTransport()
    kernel, zero = _kernels(job)
    probe = run_probe(job["probe"]) if job.get("probe") else []
    runners = {w.name: make_runner(w, rank, group) for w in job["workloads"]}
    names = list(runners)
    plan = [("warmup", n) for n in names for _ in range(job["warmup"])]
    for rep in range(job["repeats"]):
        plan += [("overlap", n) for n in names]
        if rep < job["component_repeats"]:
            plan += [(m, n) for m in ("comm", "compute") for n in names]
    times = {n: {m: [] for m in MODES} for n in names}
    modelled = {}
    timed = [p for p in plan if p[0] != "warmup"]
    done = 0
    for mode, name in plan:
        k = zero if mode == "comm" else kernel
        tr = null if mode == "compute" else gloo
        if isinstance(k, SleepKernel):
            k.reset()
        dt = _timed(lambda: runners[name].run(k, tr))
        if mode == "warmup":
            continue
        times[name][mode].append(dt)
        if mode == "overlap" and isinstance(k, SleepKernel):
            modelled[name] = k.modelled_s
        done += 1
        if rank == 0:
            print(f"@progress {done} {len(timed)} {name} {mode} {dt:.4f}", flush=True)
    return {"times": times, "modelled_compute_s": modelled, "link_probe": probe}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_path, out_path = argv
    torch.set_num_threads(1)
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    dist.init_process_group("gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=job["timeout_s"]))
    try:
        result = run(job)
        if dist.get_rank() == 0:
            tmp = out_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
