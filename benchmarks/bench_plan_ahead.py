"""Planning a packed batch ahead (Note [Planning a packed batch ahead] in
:mod:`megatron_fcp.patches.runtime`): how much of a packed batch's per-batch planning the step
still waits for, planned on the spot against planned in the background while the step before runs.

Writes ``benchmarks/results/plan_ahead.json`` (committed)::

    OMP_NUM_THREADS=1 python benchmarks/bench_plan_ahead.py [--out ...] [--batches N]

The runtime is the plugin's for a packed run (``setup_fcp`` on a dgx-h100 layout, cp = 64 and 256,
GQA 64:8, head size 128, ``--fcp-head-parallel auto``: each batch chooses its degree), without
process groups: planning needs none. A batch is 512 documents of lognormal lengths (log-mean 8.0,
log-sigma 1.2, a new seed per batch, so nothing is cached), as in ``bench_packed_scale.py``'s
planning rows. The *step* is CPU matrix products for a set time: like a GPU step's CUDA kernels and
NCCL waits it releases the GIL (one core each for it and the planning thread; ``OMP_NUM_THREADS=1``).
*Exposed* is what rank 0's lookups of the next batch (``packed_placement``, ``packed_degree``,
the plans ``packed_attention`` asks for and the backward programs its executor compiles,
``packed_programs``) take after the step: all of the planning on the spot; with ``prefetch_packed``
issued before the step, only what the step did not cover. The two modes' plans
are compared (degree, placement, plan rounds) and must be equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fcp.config import FCPConfig  # noqa: E402
from megatron_fcp.patches.runtime import reset_fcp, setup_fcp  # noqa: E402
from megatron_fcp.planner.megatron_layout import MegatronLayout  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 128


def _batch(seed: int, docs: int = 512) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(np.maximum(1, rng.lognormal(8.0, 1.2, docs).astype(int)).tolist())


def _runtime(cp: int):
    reset_fcp()
    return setup_fcp(FCPConfig(enabled=True, topology=f"dgx-h100:{cp // 8}"), layout=MegatronLayout(world=cp, cp=cp),
                     groups={}, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def _lookups(rt, ranks: tuple[int, ...], docs: tuple[int, ...]) -> tuple:
    """What rank 0's step asks for one packed batch: ``shard_packed_batch``'s placement, then
    ``packed_attention``'s degree and plans and its executor's backward programs
    (``packed_programs``, the ones ``build_executor`` compiles)."""
    placement = rt.packed_placement(docs, cp_ranks=ranks)
    degree = rt.packed_degree(ranks, docs)
    programs = rt.packed_programs(ranks, docs, rank=0)
    if degree > 1:
        plan = rt.packed_head_parallel(ranks, docs, causal=True, heads=HEADS, kv_heads=KV_HEADS).kv_plan
    else:
        plan = rt.packed_plan(ranks, docs)
    return (degree, placement.blocks, None if plan is None else plan.rounds,
            tuple((p.mode, len(p.waves or ()), len(p.steps or ())) for p in programs))


def _step(seconds: float, a: torch.Tensor) -> float:
    """Matrix products (the GIL released inside each) for about ``seconds``; returns the time taken."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
    return time.perf_counter() - t0


def run(cp: int, step_s: float, batches: int) -> dict:
    ranks = tuple(range(cp))
    a = torch.randn(768, 768)
    out = {"cp": cp, "documents": 512, "step_s": step_s, "batches": batches}
    got = {}
    for mode in ("on the spot", "ahead"):
        rt = _runtime(cp)
        exposed, plans = [], []
        _lookups(rt, ranks, _batch(1000))                 # the first batch: planned before the loop
        for i in range(batches):
            nxt = _batch(1001 + i)
            if mode == "ahead":
                rt.prefetch_packed(ranks, nxt, rank=0)
            _step(step_s, a)
            t0 = time.perf_counter()
            plans.append(_lookups(rt, ranks, nxt))
            exposed.append(time.perf_counter() - t0)
            print(f"cp={cp} step {step_s:.1f} s {mode}: batch {i} exposed {exposed[-1]:.3f} s", flush=True)
        got[mode] = plans
        out[mode] = {"exposed_s": exposed, "exposed_median_s": statistics.median(exposed)}
        reset_fcp()
    out["same_plans"] = got["on the spot"] == got["ahead"]
    if not out["same_plans"]:
        raise SystemExit(f"cp = {cp}: the plans made ahead differ from those made on the spot (a bug)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "plan_ahead.json"))
    ap.add_argument("--batches", type=int, default=3, help="batches per configuration (default 3)")
    args = ap.parse_args()
    if args.batches < 1:
        ap.error(f"--batches must be at least 1, got {args.batches}")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = [run(64, s, args.batches) for s in (0.25, 1.0)] + [run(256, s, args.batches) for s in (4.0, 12.0)]
    res = {"command": "OMP_NUM_THREADS=1 python benchmarks/bench_plan_ahead.py"
           + (f" --batches {args.batches}" if args.batches != 3 else ""),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "rows": rows, "wall_s": time.perf_counter() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    for r in rows:
        print(f"cp={r['cp']} step {r['step_s']} s: exposed planning on the spot {r['on the spot']['exposed_median_s']:.3f} s, "
              f"ahead {r['ahead']['exposed_median_s']:.3f} s (median of {r['batches']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
