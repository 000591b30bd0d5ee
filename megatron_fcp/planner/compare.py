"""Schedules side by side: TE p2p, TE a2a+p2p and FCP's best plan on one topology and shape
(:func:`compare`), or on a packed batch of documents, forward and backward (:func:`compare_packed`),
or on a sliding-window layer: what TE runs there (a2a, all_gather), a halo ring and FCP, forward and
backward (:func:`compare_window`).

The comparison the CLI (``megatron-fcp simulate``) and the benchmarks report. Pure, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from megatron_fcp.contract.blocks import gc_paused
from megatron_fcp.contract.head_parallel import stage_plan
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.placement import DEFAULT_BLOCK_TOKENS, Placement, recv_lower_bound
from megatron_fcp.planner.placing import place_batch
from megatron_fcp.contract.plan import check_cp_ranks
from megatron_fcp.cost.backward import simulate_backward_waves, simulate_plan_backward
from megatron_fcp.cost.floors import intra_ingress
from megatron_fcp.cost.head_parallel import check_pass, simulate_te, stage_shape
from megatron_fcp.cost.head_parallel_packed import packed_a2a_messages, packed_stage_plan
from megatron_fcp.cost.model import (
    BACKWARD_FLOP_RATIO,
    AttentionShape,
    ComputeModel,
    SimResult,
    pad_for_zigzag,
    pick_best,
    simulate_plan,
)
from megatron_fcp.cost.te import (
    lower_bound,
    simulate_halo_ring,
    simulate_te_a2a,
    simulate_te_a2a_p2p,
    simulate_te_a2a_p2p_thd,
    simulate_te_all_gather,
    simulate_te_p2p,
    simulate_te_p2p_thd,
    te_refuses_window,
)
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.choose import head_parallel_candidates, lower_bound_all
from megatron_fcp.planner.rounds import plan_delta
from megatron_fcp.topology import Topology, load_topology

if TYPE_CHECKING:
    from megatron_fcp.contract.head_parallel_packed import PackedHeadParallelPlan
    from megatron_fcp.contract.plan import Plan

__all__ = ["compare", "compare_head_parallel", "compare_packed", "packed_need_stats", "packed_lower_bound_all",
           "compare_window", "WINDOW_SCHEDULES"]

WINDOW_SCHEDULES = ("te-a2a", "te-all-gather", "halo-ring", "fcp", "te-p2p", "te-a2a-p2p")
"""Schedules :func:`compare_window` reports, in order (TE's p2p and a2a+p2p as refused)."""


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
    pass_: str = "fwd",
    head_parallel: "int | str" = 1,
) -> dict:
    """Side-by-side ``te-p2p`` / ``te-a2a-p2p`` / ``fcp`` for the CLI and benchmarks.

    ``pass_`` (``fwd``, ``bwd``, ``fwd+bwd``) and ``head_parallel`` (a degree or ``"auto"``): with
    the defaults (forward, degree 1) this is the KV-distribution comparison below; otherwise
    :func:`compare_head_parallel` (every schedule for the pass, FCP's degree, graph and block size
    chosen on the cost model, the lower bound over every family compared).

    ``parts_per_chunk="auto"`` tries 1, 2, 4, 8, 16 sub-blocks per chunk (blocks no smaller than
    ``min_block_tokens``; a count that does not divide the chunk gives parts of floor/ceil size);
    ``graph="auto"`` tries every builder. The fcp plan kept is the best by ``objective`` (see
    :func:`pick_best`): ``"total"`` (overlapped time, ties within 0.1% broken by communication
    time) or ``"comm"`` (communication time alone). Returns
    ``{"lower_bound_s", "lower_bound", "seq_len", "padded_seq_len", "schedules": {name: dict},
    "results": {name: SimResult}, "plan"}``; an inapplicable baseline appears as
    ``{"error": reason}``. A ``seq_len`` that ``2*cp`` does not divide is padded up to a multiple
    of ``2*cp`` (as Megatron pads) for every schedule, and ``padded_seq_len`` says to what
    (None when no padding was needed).
    """
    if pass_ != "fwd" or head_parallel != 1:
        return compare_head_parallel(topology, cp_ranks, shape, graph=graph, parts_per_chunk=parts_per_chunk,
                                     causal=causal, compute_model=compute_model, min_block_tokens=min_block_tokens,
                                     objective=objective, round_overhead_s=round_overhead_s, pass_=pass_,
                                     head_parallel=head_parallel)
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
    for p in choices:  # parts that do not divide the chunk are of floor/ceil size (Note [Sub-block sizes])
        if p > chunk_tokens:
            continue
        plan = build_plan(topo, ranks, graph, causal=causal, parts_per_chunk=p, seq_len=shape.seq_len,
                          heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                          dtype_bytes=shape.dtype_bytes, objective=objective)
        r = simulate_plan(plan, topo, shape, compute_model=cm, name="fcp", round_overhead_s=round_overhead_s)
        candidates.append((r, plan))
    if not candidates:
        raise ValueError(f"parts_per_chunk: {parts_per_chunk} is more than the {chunk_tokens} tokens of a chunk; "
                         f"use at most {chunk_tokens}")
    best = pick_best(candidates, objective)
    results["fcp"], plan = best
    results["fcp"].meta.update(graph=plan.name, parts_per_chunk=plan.parts_per_chunk)
    for k, r in results.items():
        d = r.to_dict()
        d["comm_vs_lower_bound"] = r.comm_s / lb["lower_bound_s"] if lb["lower_bound_s"] > 0 else 1.0
        schedules[k] = d
    schedules["fcp"]["backward_kv"] = backward_kv_costs(plan, topo, shape, results["fcp"], compute_model=cm,
                                                        round_overhead_s=round_overhead_s)
    order = ["te-p2p", "te-a2a-p2p", "fcp"]
    return {"lower_bound_s": lb["lower_bound_s"], "lower_bound": lb, "seq_len": asked_seq_len,
            "padded_seq_len": shape.seq_len if padded else None,
            "schedules": {k: schedules[k] for k in order if k in schedules},
            "results": results, "plan": plan}


def compare_head_parallel(
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
    pass_: str = "fwd+bwd",
    head_parallel: "int | str" = "auto",
) -> dict:
    """:func:`compare` for any pass, FCP with the head-parallel stage (Note [Choosing the
    head-parallel degree]). The structure of :func:`compare`; every schedule adds ``pass``, and
    ``fwd_total_s`` / ``bwd_total_s`` (and comm) for the passes it ran; ``fcp`` adds
    ``head_parallel`` (the degree), ``kv_replication``, ``label``, ``rounds`` and ``delta``
    (Note [Optimal rounds]); ``lower_bound`` is :func:`lower_bound_all`'s. ``plan`` is FCP's merged
    stage plan (:func:`stage_plan`), ``head_parallel_plan`` the :class:`HeadParallelPlan`."""
    check_pass(pass_)
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, range(topo.world) if cp_ranks is None else cp_ranks)
    asked_seq_len = shape.seq_len
    shape, padded = pad_for_zigzag(shape, len(ranks))
    cm = compute_model or ComputeModel()
    kw = dict(causal=causal, compute_model=cm, round_overhead_s=round_overhead_s, pass_=pass_)
    lb = lower_bound_all(topo, ranks, shape, causal=causal, pass_=pass_)
    results: dict[str, SimResult] = {}
    schedules: dict[str, dict] = {}
    for name in ("te-p2p", "te-a2a-p2p"):
        try:
            results[name] = simulate_te(name, topo, ranks, shape, **kw)
        except ValueError as e:
            schedules[name] = {"error": str(e), "pass": pass_}
    cands = head_parallel_candidates(topo, ranks, shape, degree=head_parallel, graph=graph,
                                     parts_per_chunk=parts_per_chunk, min_block_tokens=min_block_tokens,
                                     objective=objective, **kw)
    results["fcp"], hp = pick_best(cands, objective)
    plan = stage_plan(hp, shape.seq_len, causal)
    results["fcp"].meta.update(delta=plan_delta(plan), rounds=len(plan.rounds))
    for k, r in results.items():
        d = r.to_dict()
        d["rounds"] = r.rounds if k != "fcp" else len(plan.rounds)
        d["comm_vs_lower_bound"] = r.comm_s / lb["lower_bound_s"] if lb["lower_bound_s"] > 0 else 1.0
        schedules[k] = d
    order = ["te-p2p", "te-a2a-p2p", "fcp"]
    return {"lower_bound_s": lb["lower_bound_s"], "lower_bound": lb, "seq_len": asked_seq_len,
            "padded_seq_len": shape.seq_len if padded else None, "pass": pass_,
            "schedules": {k: schedules[k] for k in order if k in schedules},
            "results": results, "plan": plan, "head_parallel_plan": hp}


def backward_kv_costs(plan, topology: "Topology | str", shape: AttentionShape, forward: SimResult, *,
                      compute_model: ComputeModel | None = None, round_overhead_s: float = 0.0) -> dict:
    """Memory against time of the two backward KV modes of one FCP plan (Note [Backward KV modes] in
    :mod:`megatron_fcp.schedule.program`), as the executor runs them: wave by wave
    (:func:`~megatron_fcp.cost.backward.simulate_backward_waves`). Per mode the backward and
    forward+backward seconds, the most received KV any rank holds between the passes
    (``held_kv_bytes_max``) and within backward (``backward_held_kv_bytes_max``); beside them the
    one-pass backward (the whole plan reversed at once, :func:`simulate_plan_backward`: what keep
    cost before backward ran in waves) and what Transformer Engine's ring holds (between the passes
    its last received shard; one more KV pair the size of a rank's shard in flight). A ring plan's
    backward streams (Note [Streaming chain backward] in :mod:`megatron_fcp.schedule.chains`)."""
    out: dict = {}
    for mode in ("keep", "resend"):
        bwd = simulate_backward_waves(plan, topology, shape, compute_model=compute_model, backward_kv=mode,
                                      round_overhead_s=round_overhead_s)
        one = simulate_plan_backward(plan, topology, shape, compute_model=compute_model, backward_kv=mode,
                                     round_overhead_s=round_overhead_s)
        out[mode] = {"bwd_s": bwd["bwd_s"], "fwd_bwd_s": forward.total_s + bwd["bwd_s"],
                     "held_kv_bytes_max": max(one.meta["held_kv_bytes"], default=0.0),
                     "backward_held_kv_bytes_max": bwd["held_kv_bytes_max"],
                     "resend_s": bwd["resend_s"], "waves": bwd["waves"],
                     "one_pass_bwd_s": one.total_s, "one_pass_fwd_bwd_s": forward.total_s + one.total_s}
    shard = shape.kv_bytes(shape.seq_len / max(plan.cp, 1)) if plan.placement is None else \
        max((plan.placement.tokens(i) for i in range(plan.cp)), default=0) * shape.kv_bytes(1)
    out["ring_held_kv_bytes"] = 0.0
    out["ring_in_flight_kv_bytes"] = shard
    out["resend_vs_keep"] = out["resend"]["fwd_bwd_s"] / out["keep"]["fwd_bwd_s"] if out["keep"]["fwd_bwd_s"] else 1.0
    one_keep = out["keep"]["one_pass_fwd_bwd_s"]
    out["resend_vs_one_pass_keep"] = out["resend"]["fwd_bwd_s"] / one_keep if one_keep else 1.0
    return out


def _packed_entry(fwd: SimResult, bwd: SimResult, lb_s: float) -> dict:
    """One schedule of :func:`compare_packed`: forward at the top level (as :func:`compare`), then
    ``fwd``, ``bwd`` and ``fwd_bwd`` sub-dicts (comm/compute/total seconds, bytes, inter-node bytes)."""
    d = fwd.to_dict()
    d["comm_vs_lower_bound"] = fwd.comm_s / lb_s if lb_s > 0 else 1.0
    part = lambda r: {"comm_s": r.comm_s, "compute_s": r.compute_s, "total_s": r.total_s,  # noqa: E731
                      "bytes": r.bytes, "inter_node_bytes": r.inter_node_bytes, "rounds": r.rounds}
    d["fwd"], d["bwd"] = part(fwd), part(bwd)
    d["fwd_bwd"] = {k: d["fwd"][k] + d["bwd"][k] for k in d["fwd"]}
    return d


def packed_need_stats(plan, topology: "Topology | str", shape: AttentionShape) -> dict:
    """What a plan over a placement must move, and how evenly: exact need-set bytes (each block to
    each rank that needs it), node need bytes (each block once to each *other* node holding a rank
    that needs it), per-rank need bytes and work (max/mean), Δ (the most blocks any rank sends or
    receives in the plan) and the need-set lower bound on the forward exchange; the busiest rank's
    and node's received bytes beside the least any placement with work <= 1.05 x the mean must
    receive (``recv_bound_bytes``, ``node_recv_bound_bytes``: Note [Busiest receiver lower bound]
    in :mod:`megatron_fcp.contract.placement`; 0 under a window)."""
    topo = load_topology(topology)
    pl = plan.placement
    need = pl.need_matrix()                                             # [cp, n_blocks]
    kv_tok = shape.kv_bytes(1)
    tok = pl.block_tokens().astype(np.float64)
    owner = pl.block_owners()
    node_of = np.array([topo.node_of(r) for r in plan.ranks], dtype=np.int64)
    recv = (need * tok[None, :]).sum(axis=1) * kv_tok                   # bytes each rank needs
    node_ids = np.unique(node_of)
    node_need = np.stack([need[node_of == x].any(axis=0) & (node_of[owner] != x) for x in node_ids])
    node_bytes = (node_need * tok[None, :]).sum(axis=1) * kv_tok        # bytes entering each node
    sends = np.zeros(plan.cp, dtype=np.int64)
    recvs = np.zeros(plan.cp, dtype=np.int64)
    pos = {r: i for i, r in enumerate(plan.ranks)}
    for _, t in plan.transfers():
        sends[pos[t.src]] += 1
        recvs[pos[t.dst]] += 1
    work = pl.work()
    mean = lambda x: float(x.mean()) if len(x) and x.mean() > 0 else 0.0  # noqa: E731
    b_gpu = min(topo.gpu_ingress_bandwidth(r) for r in plan.ranks) if len(node_ids) > 1 else \
        min(intra_ingress(topo, r) for r in plan.ranks)
    b_out = topo.node_ingress_bandwidth() if len(node_ids) > 1 else float("inf")
    lb = max(float(recv.max()) / b_gpu if plan.cp else 0.0,
             float(node_bytes.max()) / b_out if len(node_ids) > 1 else 0.0)
    delta = int(max(sends.max(), recvs.max())) if plan.cp else 0
    # Note [Busiest receiver lower bound] (a window only shrinks needs: no bound, 0)
    per_node = int(np.bincount(np.searchsorted(node_ids, node_of)).max())
    bound = (lambda g: 0 if pl.mask.windowed else recv_lower_bound(pl.doc_lengths, plan.cp, causal=pl.causal,
                                                                   ranks_per_group=g) * kv_tok)  # noqa: E731
    rank_lb, node_lb = bound(1), bound(per_node) if len(node_ids) > 1 else 0.0
    return {
        "recv_max_bytes": float(recv.max()) if plan.cp else 0.0,
        "recv_bound_bytes": float(rank_lb),
        # None: a bound of 0 (no placement must receive anything) under a busiest receiver that does
        "recv_max_over_bound": float(recv.max()) / rank_lb if rank_lb else (None if recv.max() else 1.0),
        "node_recv_max_bytes": float(node_bytes.max()) if len(node_ids) > 1 else 0.0,
        "node_recv_bound_bytes": float(node_lb),
        "node_recv_max_over_bound": float(node_bytes.max()) / node_lb if node_lb else
        (None if len(node_ids) > 1 and node_bytes.max() else 1.0),
        "exact_need_bytes": float(recv.sum()),
        "node_need_bytes": float(node_bytes.sum()),
        "recv_max_over_mean": float(recv.max()) / mean(recv) if mean(recv) else 1.0,
        "work_max_over_mean": float(work.max()) / mean(work) if mean(work) else 1.0,
        "delta": delta,
        "lower_bound_s": lb,
        "B_gpu": b_gpu,
        "B_out": b_out,
    }


def packed_lower_bound_all(plans: "Mapping[int, Plan | PackedHeadParallelPlan]", topology: "Topology | str",
                           shape: AttentionShape, *, grad_dtype_bytes: int | None = None,
                           pass_: str = "fwd+bwd") -> dict:
    """Lower bound on a packed batch's communication over every head-parallel degree, each over the
    placement its plan holds (Note [Packed lower bound over degrees]); ``pass_``: ``"fwd"``,
    ``"bwd"`` or ``"fwd+bwd"`` (default), as :func:`~megatron_fcp.planner.choose.lower_bound_all`.

    ``plans``: ``{degree: plan}`` as :func:`~megatron_fcp.planner.head_parallel.choose_packed_head_parallel`
    fills them (``1``: the plain :class:`~megatron_fcp.contract.plan.Plan` over ``place_batch``,
    else a :class:`~megatron_fcp.contract.head_parallel_packed.PackedHeadParallelPlan`); only their
    placements and head groups are read. Returns ``lower_bound_s`` (the least degree's),
    ``degree`` (the one attaining it) and ``per_degree``.

    Note [Packed lower bound over degrees]
    --------------------------------------
    Degree 1 moves each block's KV once to every rank that needs it and its dK/dV back: twice the
    need-set bound of the forward exchange (:func:`packed_need_stats`; dK/dV at
    ``grad_dtype_bytes`` per element, default the KV's). Degree ``a > 1`` adds its four
    all-to-alls (Q|K|V and O in forward, dO and dQ|dK|dV in backward), whose sizes the member
    placement fixes (:func:`~megatron_fcp.cost.head_parallel_packed.packed_a2a_messages`): each
    is at least its busiest receiver's bytes over the slowest intra-node ingress (head groups sit
    inside nodes), and none can hide behind the stage it feeds or drains, as in
    :func:`~megatron_fcp.planner.choose.lower_bound_all`'s ``fwd+bwd``; plus the KV stage's own
    need-set bound both ways, on every copy at once (the merged stage plan, so copies that share a
    node's NICs are charged together) with the stage's heads. Compute is not in it: a caller
    takes the maximum with its compute bound, as for degree 1."""
    check_pass(pass_)
    if not plans:
        raise ValueError("packed_lower_bound_all: no plans; pass {degree: plan} for at least one degree "
                         "(packed_degree_plan builds them)")
    topo = load_topology(topology)
    ratio = (grad_dtype_bytes or shape.dtype_bytes) / shape.dtype_bytes
    kv_times = {"fwd": 1.0, "bwd": ratio, "fwd+bwd": 1.0 + ratio}[pass_]   # the need sets' bytes, each way
    a2as = {"fwd": ("qkv-in", "o-out"), "bwd": ("o-in", "qkv-out"),
            "fwd+bwd": ("qkv-in", "o-out", "o-in", "qkv-out")}[pass_]
    per_degree: dict[int, float] = {}
    for a, plan in sorted(plans.items()):
        if a == 1:
            per_degree[a] = packed_need_stats(plan, topo, shape)["lower_bound_s"] * kv_times
            continue
        b_intra = min(intra_ingress(topo, r) for r in plan.ranks)
        a2a = 0.0
        for which in a2as:
            recv: dict[int, float] = {}
            for _, dst, nbytes in packed_a2a_messages(plan, shape, which):
                recv[dst] = recv.get(dst, 0.0) + nbytes
            a2a += max(recv.values(), default=0.0) / b_intra
        stage = 0.0
        if plan.kv_plan is not None:
            stage = packed_need_stats(packed_stage_plan(plan), topo, stage_shape(plan, shape))["lower_bound_s"]
        per_degree[a] = a2a + stage * kv_times
    best = min(per_degree, key=per_degree.get)
    return {"lower_bound_s": per_degree[best], "degree": best, "per_degree": per_degree, "pass": pass_}


@gc_paused()
def compare_packed(
    topology: "Topology | str",
    cp_ranks: Sequence[int] | None,
    doc_lengths: Sequence[int],
    shape: AttentionShape,
    *,
    graph: str = "auto",
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    causal: bool = True,
    compute_model: ComputeModel | None = None,
    objective: str = "total",
    round_overhead_s: float = 0.0,
    backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
    placement: Placement | None = None,
) -> dict:
    """Side-by-side ``te-p2p`` / ``te-a2a-p2p`` (THD, padded) / ``fcp`` (place_packed + plan) on a
    packed batch, forward and backward; see Note [Transformer Engine on a packed batch] in
    :mod:`megatron_fcp.cost.backward`. ``shape.seq_len`` is not used (the documents set it).

    Returns the structure of :func:`compare` (``lower_bound_s``, ``lower_bound``, ``seq_len``,
    ``padded_seq_len`` = TE's padded THD tokens, ``schedules``, ``results``, ``plan``) plus
    ``placement``. Each schedule has the forward numbers at the top level and ``fwd`` / ``bwd`` /
    ``fwd_bwd`` sub-dicts; the TE schedules add ``padding_overhead`` and ``work_max_over_mean``;
    ``fcp`` adds ``graph``, ``delta``, ``rounds_over_delta``, ``exact_need_bytes``,
    ``bytes_over_exact``, ``node_need_bytes``, ``inter_node_over_need``, ``work_max_over_mean`` and
    ``recv_max_over_mean``, and the busiest rank's / node's received bytes against their lower
    bounds (``recv_max_bytes``, ``recv_bound_bytes``, ``recv_max_over_bound`` and the ``node_``
    three; :func:`packed_need_stats`). ``results[name]`` is ``{"fwd": SimResult, "bwd": SimResult}``.
    """
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, range(topo.world) if cp_ranks is None else cp_ranks)
    cp = len(ranks)
    cm = compute_model or ComputeModel()
    pl = placement or place_batch(topo, ranks, doc_lengths, block_tokens=block_tokens, causal=causal)
    if tuple(pl.doc_lengths) != tuple(int(x) for x in doc_lengths) or pl.cp != cp:
        raise ValueError("placement: does not hold these documents on this CP group")
    kw = dict(causal=causal, compute_model=cm, backward_flop_ratio=backward_flop_ratio,
              round_overhead_s=round_overhead_s)
    results: dict[str, dict] = {}
    schedules: dict[str, dict] = {}
    results["te-p2p"] = {d: simulate_te_p2p_thd(topo, ranks, doc_lengths, shape, backward=d == "bwd", **kw)
                         for d in ("fwd", "bwd")}
    try:
        results["te-a2a-p2p"] = {d: simulate_te_a2a_p2p_thd(topo, ranks, doc_lengths, shape, backward=d == "bwd",
                                                            **kw) for d in ("fwd", "bwd")}
    except ValueError as e:
        schedules["te-a2a-p2p"] = {"error": str(e)}
    plan = build_plan(topo, ranks, graph, causal=causal, seq_len=pl.total_tokens, heads=shape.heads,
                      kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype_bytes=shape.dtype_bytes,
                      objective=objective, placement=pl)
    results["fcp"] = {
        "fwd": simulate_plan(plan, topo, shape, compute_model=cm, name="fcp", round_overhead_s=round_overhead_s),
        "bwd": simulate_plan_backward(plan, topo, shape, compute_model=cm, backward_flop_ratio=backward_flop_ratio,
                                      round_overhead_s=round_overhead_s),
    }
    stats = packed_need_stats(plan, topo, shape)
    lb_s = stats["lower_bound_s"]
    for k, r in results.items():
        d = _packed_entry(r["fwd"], r["bwd"], lb_s)
        if k == "fcp":
            d.update(graph=plan.name, delta=stats["delta"],
                     rounds_over_delta=len(plan.rounds) / stats["delta"] if stats["delta"] else 0.0,
                     exact_need_bytes=stats["exact_need_bytes"],
                     bytes_over_exact=d["bytes"] / stats["exact_need_bytes"] if stats["exact_need_bytes"] else 1.0,
                     node_need_bytes=stats["node_need_bytes"],
                     inter_node_over_need=d["inter_node_bytes"] / stats["node_need_bytes"]
                     if stats["node_need_bytes"] else 1.0,
                     work_max_over_mean=stats["work_max_over_mean"], recv_max_over_mean=stats["recv_max_over_mean"],
                     **{k: stats[k] for k in ("recv_max_bytes", "recv_bound_bytes", "recv_max_over_bound",
                                              "node_recv_max_bytes", "node_recv_bound_bytes",
                                              "node_recv_max_over_bound")})
        schedules[k] = d
    order = ["te-p2p", "te-a2a-p2p", "fcp"]
    return {"lower_bound_s": lb_s, "lower_bound": {k: stats[k] for k in ("lower_bound_s", "B_gpu", "B_out")},
            "seq_len": pl.total_tokens, "padded_seq_len": results["te-p2p"]["fwd"].meta["padded_tokens"],
            "schedules": {k: schedules[k] for k in order if k in schedules},
            "results": results, "plan": plan, "placement": pl}


def compare_window(
    topology: "Topology | str",
    cp_ranks: Sequence[int] | None,
    shape: AttentionShape,
    *,
    window,
    causal: bool = True,
    graph: str = "auto",
    parts_per_chunk: "int | str" = "auto",
    compute_model: ComputeModel | None = None,
    min_block_tokens: int = 256,
    objective: str = "total",
    round_overhead_s: float = 0.0,
    backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
) -> dict:
    """One sliding-window layer (Megatron's ``window_size=(left, right)``), forward and backward:
    what Transformer Engine runs there (``te-a2a`` where heads divide by cp, ``te-all-gather``),
    the halo ring, and FCP's plan (``build_plan`` under the window: ``graph`` and, for
    ``parts_per_chunk="auto"``, 1, 2, 4 sub-blocks of at least ``min_block_tokens``, the best by
    forward + one-pass backward :func:`~megatron_fcp.cost.backward.simulate_plan_backward`, ties
    within 0.1% broken by bytes); see
    Note [Transformer Engine under a sliding window] in :mod:`megatron_fcp.cost.te`.

    Returns ``{"window", "mask", "seq_len", "padded_seq_len", "lower_bound_s", "lower_bound",
    "exact_need_bytes", "schedules", "results", "plan", "best_te", "fcp_vs_best_te",
    "a2a_bytes_over_fcp"}``: ``schedules[name]`` as :func:`compare_packed`'s (forward at the top,
    ``fwd``/``bwd``/``fwd_bwd``), ``{"error": reason}`` where TE cannot run it (heads), or
    ``{"refused": reason}`` for ``te-p2p`` / ``te-a2a-p2p`` (TE refuses windows there). ``best_te``:
    the TE schedule with the least forward + backward time; ``fcp_vs_best_te``: its time over
    FCP's (> 1: FCP is faster); ``a2a_bytes_over_fcp``: te-a2a's forward bytes over FCP's.
    """
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, range(topo.world) if cp_ranks is None else cp_ranks)
    cp = len(ranks)
    mask = Mask.of(causal, window)
    asked = shape.seq_len
    shape, padded = pad_for_zigzag(shape, cp)
    cm = compute_model or ComputeModel()
    kw = dict(causal=causal, window=mask.window, compute_model=cm, round_overhead_s=round_overhead_s)
    lb = lower_bound(topo, ranks, shape, causal=causal, window=mask.window)
    results: dict[str, dict] = {}
    schedules: dict[str, dict] = {}
    for name, fn in (("te-a2a", simulate_te_a2a), ("te-all-gather", simulate_te_all_gather)):
        try:
            results[name] = {d: fn(topo, ranks, shape, backward=d == "bwd", backward_flop_ratio=backward_flop_ratio,
                                   **kw) for d in ("fwd", "bwd")}
        except ValueError as e:
            schedules[name] = {"error": str(e)}
    results["halo-ring"] = {d: simulate_halo_ring(topo, ranks, shape, backward=d == "bwd", **kw)
                            for d in ("fwd", "bwd")}
    chunk_tokens = shape.seq_len // (2 * cp)
    choices = [p for p in (1, 2, 4) if p == 1 or chunk_tokens // p >= min_block_tokens] \
        if parts_per_chunk == "auto" else [int(parts_per_chunk)]
    tried = []
    for p in choices:
        if p > chunk_tokens:
            continue
        plan = build_plan(topo, ranks, graph, causal=causal, window=mask.window, parts_per_chunk=p,
                          seq_len=shape.seq_len, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                          dtype_bytes=shape.dtype_bytes, objective=objective)
        fwd = simulate_plan(plan, topo, shape, compute_model=cm, name="fcp", round_overhead_s=round_overhead_s)
        bwd = simulate_plan_backward(plan, topo, shape, compute_model=cm, backward_flop_ratio=backward_flop_ratio,
                                     round_overhead_s=round_overhead_s)
        tried.append(({"fwd": fwd, "bwd": bwd}, plan))
    if not tried:
        raise ValueError(f"parts_per_chunk: {parts_per_chunk} is more than the {chunk_tokens} tokens of a chunk")
    step = lambda c: c[0]["fwd"].total_s + c[0]["bwd"].total_s  # noqa: E731
    fastest = min(step(c) for c in tried)  # within 0.1% of it (compute hides the KV), the fewest bytes
    results["fcp"], plan = min((c for c in tried if step(c) <= fastest * (1 + 1e-3)),
                               key=lambda c: (c[0]["fwd"].bytes, step(c)))
    for name, comm in (("te-p2p", "p2p"), ("te-a2a-p2p", "a2a+p2p")):
        try:
            te_refuses_window(comm, causal, mask.window)
        except ValueError as e:
            schedules[name] = {"refused": str(e)}
    need = plan.need_matrix()
    tokens = np.array([plan.block_tokens(b) for b in plan.blocks()], dtype=np.float64)
    exact = float((need * tokens[None, :]).sum()) * shape.kv_bytes(1)
    for k, r in results.items():
        schedules[k] = _packed_entry(r["fwd"], r["bwd"], lb["lower_bound_s"])
    schedules["fcp"].update(graph=plan.name, parts_per_chunk=plan.parts_per_chunk, exact_need_bytes=exact,
                            bytes_over_exact=schedules["fcp"]["bytes"] / exact if exact else 1.0)
    te = [k for k in ("te-a2a", "te-all-gather") if k in results]
    best_te = min(te, key=lambda k: schedules[k]["fwd_bwd"]["total_s"])
    fcp_s = schedules["fcp"]["fwd_bwd"]["total_s"]
    fcp_b = schedules["fcp"]["bytes"]
    return {"window": mask.window, "mask": mask.describe(), "seq_len": asked,
            "padded_seq_len": shape.seq_len if padded else None, "lower_bound_s": lb["lower_bound_s"],
            "lower_bound": lb, "exact_need_bytes": exact,
            "schedules": {k: schedules[k] for k in WINDOW_SCHEDULES if k in schedules}, "results": results,
            "plan": plan, "best_te": best_te,
            "fcp_vs_best_te": schedules[best_te]["fwd_bwd"]["total_s"] / fcp_s if fcp_s else float("inf"),
            "a2a_bytes_over_fcp": (schedules["te-a2a"]["bytes"] / fcp_b if fcp_b else float("inf"))
            if "te-a2a" in results else None}
