"""Schedules side by side: TE p2p, TE a2a+p2p and FCP's best plan on one topology and shape.

The comparison the CLI (``megatron-fcp simulate``) and the benchmarks report. Pure, no torch.
"""

from __future__ import annotations

from typing import Sequence

from megatron_fcp.planning.baselines import lower_bound, simulate_te_a2a_p2p, simulate_te_p2p
from megatron_fcp.planning.build import build_plan
from megatron_fcp.planning.cost import (
    AttentionShape,
    ComputeModel,
    SimResult,
    pad_for_zigzag,
    pick_best,
    simulate_plan,
)
from megatron_fcp.planning.graph import check_cp_ranks
from megatron_fcp.topology import Topology, load_topology

__all__ = ["compare"]


def compare(
    topology: "Topology | str",
    cp_ranks: Sequence[int] | None,
    shape: AttentionShape,
    *,
    graph: str = "auto",
    parts_per_chunk: "int | str" = "auto",
    causal: bool = True,
    compute_model: ComputeModel | None = None,
    min_block_tokens: int = 256,
    objective: str = "total",
    round_overhead_s: float = 0.0,
) -> dict:
    """Side-by-side ``te-p2p`` / ``te-a2a-p2p`` / ``fcp`` for the CLI and benchmarks.

    ``parts_per_chunk="auto"`` tries 1, 2, 4, 8, 16 sub-blocks per chunk (blocks no smaller than
    ``min_block_tokens``); ``graph="auto"`` tries every builder. The fcp plan kept is the best by
    ``objective`` (see :func:`pick_best`): ``"total"`` (overlapped time, ties within 0.1% broken
    by communication time) or ``"comm"`` (communication time alone). Returns
    ``{"lower_bound_s", "lower_bound", "seq_len", "padded_seq_len", "schedules": {name: dict},
    "results": {name: SimResult}, "plan"}``; an inapplicable baseline appears as
    ``{"error": reason}``. A ``seq_len`` that ``2*cp`` does not divide is padded up to a multiple
    of ``2*cp`` (as Megatron pads) for every schedule, and ``padded_seq_len`` says to what
    (None when no padding was needed).
    """
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, range(topo.world) if cp_ranks is None else cp_ranks)
    cp = len(ranks)
    asked_seq_len = shape.seq_len
    shape, padded = pad_for_zigzag(shape, cp)
    cm = compute_model or ComputeModel()
    lb = lower_bound(topo, ranks, shape, causal=causal)
    results: dict[str, SimResult] = {}
    schedules: dict[str, dict] = {}
    results["te-p2p"] = simulate_te_p2p(topo, ranks, shape, causal=causal, compute_model=cm,
                                        round_overhead_s=round_overhead_s)
    try:
        results["te-a2a-p2p"] = simulate_te_a2a_p2p(topo, ranks, shape, causal=causal, compute_model=cm,
                                                    round_overhead_s=round_overhead_s)
    except ValueError as e:
        schedules["te-a2a-p2p"] = {"error": str(e)}
    chunk_tokens = shape.seq_len // (2 * cp)
    if parts_per_chunk == "auto":
        choices = [p for p in (1, 2, 4, 8, 16) if p == 1 or chunk_tokens // p >= min_block_tokens]
    else:
        choices = [int(parts_per_chunk)]
    if objective not in ("comm", "total"):
        raise ValueError(f"objective: must be 'comm' or 'total', got {objective!r}")
    candidates = []
    for p in choices:
        if chunk_tokens % p:
            continue
        plan = build_plan(topo, ranks, graph, causal=causal, parts_per_chunk=p, seq_len=shape.seq_len,
                          heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                          dtype_bytes=shape.dtype_bytes, objective=objective)
        r = simulate_plan(plan, topo, shape, compute_model=cm, name="fcp", round_overhead_s=round_overhead_s)
        candidates.append((r, plan))
    if not candidates:
        raise ValueError(f"parts_per_chunk: {parts_per_chunk} does not divide the {chunk_tokens}-token chunks")
    best = pick_best(candidates, objective)
    results["fcp"], plan = best
    results["fcp"].meta.update(graph=plan.name, parts_per_chunk=plan.parts_per_chunk)
    for k, r in results.items():
        d = r.to_dict()
        d["comm_vs_lower_bound"] = r.comm_s / lb["lower_bound_s"] if lb["lower_bound_s"] > 0 else 1.0
        schedules[k] = d
    order = ["te-p2p", "te-a2a-p2p", "fcp"]
    return {"lower_bound_s": lb["lower_bound_s"], "lower_bound": lb, "seq_len": asked_seq_len,
            "padded_seq_len": shape.seq_len if padded else None,
            "schedules": {k: schedules[k] for k in order if k in schedules},
            "results": results, "plan": plan}
