"""Head-parallel plans for a given degree and graph: head groups from the topology, the KV stage
compiled with the ordinary builders, and the *stage plan* the cost model times. Pure, no torch.

See Note [Head-parallel stage] in :mod:`megatron_fcp.contract.head_parallel` for the schedule.

Note [Head groups from the topology]
------------------------------------
A head group should sit inside one node (its all-to-all then runs on NVLink/PCIe, never on the
NIC). The CP ranks of every node, in rail (local rank) order, are cut into consecutive runs of
``a`` ranks; ``a`` must divide every node's CP rank count (:func:`head_parallel_degrees`), so a CP
group spread unevenly over nodes (e.g. 8 + 4 ranks) still gets head groups (``a`` in 1, 2, 4).
Member ``j`` of every group is then the ``j``-th rank of its run: on DGX nodes with ``a = 8`` the KV
stage of head shard ``j`` is exactly rail ``j`` (local rank ``j`` of every node). Groups are listed
node by node, in the order the nodes first appear in CP order (the order of TE's ``a2a+p2p`` ring).

Note [The stage plan]
---------------------
The ``a`` KV stages run at once on disjoint ranks and share the topology's resources (two stages'
rail hops may share a single uplink). To time them together, :func:`stage_plan` merges them into one
ordinary :class:`~megatron_fcp.contract.plan.Plan` over a placement with ``a`` *documents*, one per
head shard: rank (group ``g``, member ``j``) holds group ``g``'s ``2a`` zigzag chunks as spans of
document ``j``. Document need sets keep every stage to itself, so the merged plan verifies with the
ordinary :meth:`Plan.verify` and the cost model times it with every stage contending for the same
links. The attention shape of a stage is ``h/a`` query heads and ``h_kv * kv_replication / a`` KV
heads. For ``a = 1`` the stage plan is the ordinary zigzag plan (sub-blocks allowed).

Note [Pruning the packed degree choice]
---------------------------------------
:func:`choose_packed_head_parallel` prices every candidate degree of a packed batch as the executor
runs it, and most of that is the backward's wave timeline, an event simulation of every message
(at cp = 256, 512 documents: 2-3 s for ``a = 1`` and ``a = 2``, which are not chosen). Each
degree is priced up to floors that cost more as they tighten
(:class:`~megatron_fcp.cost.head_parallel_packed.PackedAsRun`): its forward exactly and its
backward as its busiest rank's gradient jobs back to back (``compute_floor``: no waves needed),
then its backward by :func:`~megatron_fcp.cost.timeline.wave_timeline_floor` (``floor``: the waves
packed, not simulated), then simulated. The degree of least floor goes one step further each
turn; once the least floor left is above the least time so far (by more than 1e-9, so that
rounding never drops a tie, which goes to the smaller degree) the search ends: every degree not
simulated has a time at least its floor, so it cannot be the choice. The choice is the one the
full search makes (tested); the times returned are those of the degrees simulated. The jobs'
floor was added 2026-12-06 (seventh pass): at cp = 256 with 512 documents it leaves ``a = 1`` out
before its waves are packed (42.9 ms against ``a = 8``'s 41.3), a quarter of the choice's time. Measured 2026-12-06 (1M-token
lognormal mixes, 64:8): the floors sit within 0-13% of the as-run times, and at cp = 256
``a = 1`` and ``a = 2`` sit 1.2-1.6x above ``a = 8``'s time, so their timelines are never run.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from megatron_fcp.contract.blocks import PlanError, check_parts, gc_paused
from megatron_fcp.contract.head_parallel import (
    HeadParallelPlan,
    check_head_parallel,
    group_placement,
    head_groups_for,
    head_parallel_degrees,
    relabel_plan,
    topology_head_groups,
)
from megatron_fcp.contract.head_parallel_packed import PackedHeadParallelPlan
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.placement import DEFAULT_BLOCK_TOKENS
from megatron_fcp.planner.placing import PACKED_BALANCE, layout_graphs, place_batch, place_batch_groups
from megatron_fcp.schedule.waves import RING_BUDGET
from megatron_fcp.contract.plan import Plan, check_cp_ranks
from megatron_fcp.cost.head_parallel_packed import PackedAsRun
from megatron_fcp.cost.model import AttentionShape, ComputeModel, pad_for_zigzag
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.builders import get_builder
from megatron_fcp.planner.compile import compile_plan
from megatron_fcp.topology import Topology, load_topology

BALANCE_MAX_GROUPS = 64
"""Up to this many head groups the KV stage's leaf edges are balanced over rounds
(:func:`~megatron_fcp.planner.compile.compile_plan`'s ``balance``; O(transfers x rounds)); larger
stages keep plain waves, which keeps a 1,024-rank head-parallel plan within the planning budget."""

__all__ = ["compile_head_parallel", "compile_packed_head_parallel", "packed_degree_plan", "choose_packed_head_parallel"]


@gc_paused()
def compile_head_parallel(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    degree: int,
    graph: str = "hierarchical",
    *,
    causal: bool = True,
    parts_per_chunk: int = 1,
    head_groups: Sequence[Sequence[int]] | None = None,
    stagger: int = 1,
    window: tuple[int, int] | None = None,
) -> HeadParallelPlan:
    """A verified :class:`HeadParallelPlan` for ``degree`` and the KV-stage ``graph`` (a builder name).

    The KV stage's graph is built over stage 0's global ranks (member 0 of every group: the builder
    sees the real nodes and rails) and compiled over :func:`group_placement` of ``shape.seq_len``
    (padded as Megatron pads); the plan is then renamed onto virtual ranks ``0..G-1``. ``degree = 1``
    gives the ordinary zigzag plan (``parts_per_chunk`` sub-blocks) on virtual ranks; placements take
    whole chunks, so ``parts_per_chunk`` must be 1 for ``degree > 1``; instead ``stagger`` > 1 starts
    a group's ``b``-th chunk ``b mod stagger`` rounds late (``compile_plan(stagger_blocks=...)``), so
    its chunks pipeline through relays as sub-blocks do. ``window`` (a sliding window, Megatron's
    ``(left, right)``): only ``degree = 1`` (the windowed zigzag plan of ``shape.seq_len``, padded).
    """
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cp = len(ranks)
    rep = check_head_parallel(shape.heads, shape.kv_heads, degree, cp)
    if head_groups is not None:
        groups = tuple(tuple(g) for g in head_groups)
    elif degree == 1:
        groups = tuple((r,) for r in ranks)  # CP order: the zigzag plan is by CP index
    else:
        groups = topology_head_groups(topo, ranks, degree)
    shape, _ = pad_for_zigzag(shape, cp)
    mask = Mask.of(causal, window)
    if mask.windowed and degree != 1:
        raise PlanError(f"head-parallel degree {degree} under the {mask.describe()} mask: windowed layers are "
                        "planned with degree 1 (KV distribution) only; use degree 1")
    G = len(groups)
    if degree == 1:
        if [g[0] for g in groups] != list(ranks):
            raise PlanError("degree 1: head groups must list the CP ranks in CP order")
        check_parts(shape.seq_len // (2 * cp), parts_per_chunk)  # uneven parts are fine (Note [Sub-block sizes])
        plan = build_plan(topo, ranks, graph, causal=causal, parts_per_chunk=parts_per_chunk, window=mask.window,
                          seq_len=shape.seq_len)
        kv = relabel_plan(plan, range(G))
    elif parts_per_chunk != 1 or (stagger != 1 and G == 1):
        raise PlanError(f"parts_per_chunk: a head-parallel KV stage (degree {degree}) moves whole chunks; got "
                        f"{parts_per_chunk}")
    elif G == 1:
        kv = None
    else:
        stage0 = [g[0] for g in groups]
        placement = group_placement(ranks, groups, shape.seq_len, causal)
        plan = compile_plan(get_builder(graph).build(topo, stage0), causal, 1, placement=placement,
                            balance=G <= BALANCE_MAX_GROUPS, stagger_blocks=stagger)
        kv = relabel_plan(plan, range(G))
    hp = HeadParallelPlan(ranks, degree, groups, kv, rep)
    return hp.verify()


@gc_paused()
def compile_packed_head_parallel(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    doc_lengths: Sequence[int],
    heads: int,
    kv_heads: int,
    degree: int,
    graph: str = "hierarchical",
    *,
    causal: bool = True,
    head_groups: Sequence[Sequence[int]] | None = None,
    block_tokens: int | None = None,
    head_dim: int | None = None,
    dtype_bytes: int = 2,
    placement_balance: str = PACKED_BALANCE,
    layout: str = "fcp",
) -> PackedHeadParallelPlan:
    """A verified :class:`PackedHeadParallelPlan` of one packed batch (Note [Head-parallel stage on
    packed batches] in :mod:`megatron_fcp.contract.head_parallel_packed`).

    The documents are placed over the head groups (default
    :func:`~megatron_fcp.contract.head_parallel.head_groups_for`: inside nodes where ``degree``
    fits them, as the runtime's groups) with
    :func:`~megatron_fcp.planner.placing.place_batch_groups` (``block_tokens``: its block size,
    default the placement's), split among each group's members, and the KV stage is built
    with ``graph`` (a builder name or ``"auto"``) over member 0's ranks and the group placement,
    then renamed onto virtual ranks ``0..G-1``. ``heads`` / ``kv_heads``: the attention's (per
    tensor-parallel rank); ValueError naming the fix when ``degree`` does not fit them or the CP
    size. ``degree`` must be >= 2 (degree 1 is the plain packed plan). ``placement_balance``:
    what the placement balances (``place_packed``'s ``balance``; Note [Layer work]). ``layout``:
    ``fcp`` or ``thd`` (TE's per-document zigzag over the groups,
    :func:`~megatron_fcp.planner.placing.place_batch_groups`; the KV stage's forward is then on
    ``graph`` and its backward on TE's ring, :func:`~megatron_fcp.planner.placing.layout_graphs`)."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    if degree < 2:
        raise ValueError(f"compile_packed_head_parallel: degree {degree}; degree 1 is the plain packed plan "
                         "(build_plan(..., placement=place_packed(...)))")
    rep = check_head_parallel(heads, kv_heads, degree, len(ranks))
    groups = tuple(tuple(g) for g in head_groups) if head_groups is not None \
        else head_groups_for(topo, ranks, degree)
    place_kw = {"causal": causal, "balance": placement_balance, "layout": layout}
    if block_tokens is not None:
        place_kw["block_tokens"] = block_tokens
    group_pl, member_pl = place_batch_groups(topo, ranks, groups, doc_lengths, **place_kw)
    kv = None
    if len(groups) > 1:
        stage0 = tuple(g[0] for g in groups)
        forward, backward = layout_graphs(layout, graph)
        plan = build_plan(topo, stage0, forward, causal=causal, placement=group_pl, heads=heads // degree,
                          kv_heads=kv_heads * rep // degree, head_dim=head_dim, dtype_bytes=dtype_bytes,
                          backward_graph=backward)
        kv = relabel_plan(plan, range(len(groups)))
    return PackedHeadParallelPlan(ranks, degree, groups, group_pl, member_pl, kv, rep).verify()


@gc_paused()
def packed_degree_plan(topology: "Topology | str", cp_ranks: Sequence[int], doc_lengths: Sequence[int],
                       shape: AttentionShape, degree: int, *, graph: str = "hierarchical", causal: bool = True,
                       block_tokens: int = DEFAULT_BLOCK_TOKENS,
                       placement_balance: str = PACKED_BALANCE, layout: str = "fcp") -> "Plan | PackedHeadParallelPlan":
    """The plan a packed batch runs at head-parallel ``degree`` and ``layout``, as the choices
    (:func:`choose_packed_head_parallel`,
    :func:`~megatron_fcp.planner.packed_choice.choose_packed_plan`) price it and the runtime runs it:
    ``1``, the plain plan over :func:`~megatron_fcp.planner.placing.place_batch`; else
    :func:`compile_packed_head_parallel`; the KV plan built with
    :func:`~megatron_fcp.planner.placing.layout_graphs` of ``graph`` (TE's layout: the backward on
    TE's ring)."""
    topo = load_topology(topology)
    if degree == 1:
        pl = place_batch(topo, cp_ranks, doc_lengths, block_tokens=block_tokens, causal=causal,
                         balance=placement_balance, layout=layout)
        forward, backward = layout_graphs(layout, graph)
        return build_plan(topo, cp_ranks, forward, causal=causal, placement=pl, heads=shape.heads,
                          kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype_bytes=shape.dtype_bytes,
                          backward_graph=backward)
    return compile_packed_head_parallel(topo, cp_ranks, doc_lengths, shape.heads, shape.kv_heads, degree, graph,
                                        causal=causal, block_tokens=block_tokens, head_dim=shape.head_dim,
                                        dtype_bytes=shape.dtype_bytes, placement_balance=placement_balance,
                                        layout=layout)


@gc_paused()
def choose_packed_head_parallel(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    doc_lengths: Sequence[int],
    shape: AttentionShape,
    *,
    degrees: Sequence[int] | None = None,
    graph: str = "hierarchical",
    causal: bool = True,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    compute_model: ComputeModel | None = None,
    plans: dict | None = None,
    placement_balance: str = PACKED_BALANCE,
    backward_kv: str = "auto",
    kv_memory_budget: int = RING_BUDGET,
    prune: bool = True,
    buffered_sends: bool = False,
    held_routes: bool = False,
) -> tuple[int, dict[int, float]]:
    """The head-parallel degree of least predicted forward + backward time on one packed batch, and
    every candidate's seconds (``{degree: seconds}``), priced as the executor runs them
    (:func:`~megatron_fcp.cost.head_parallel_packed.packed_as_run`: the backward in waves under
    ``backward_kv`` and ``kv_memory_budget``, the runtime's ``--fcp-backward-kv`` and
    ``--fcp-kv-memory-budget``; ``a = 1``: the plain packed plan over ``place_batch``). Ranking by
    the one-pass backward instead (before 2026-12-03) picked degrees whose waves then cost up to
    1.3x the one-pass price (docs/planner.md, "Layer balance"). ``degrees`` (default:
    every degree whose head groups fit inside nodes and split ``shape``'s heads,
    :func:`~megatron_fcp.contract.head_parallel.head_parallel_degrees`); ties go to the smaller
    degree. ``shape.seq_len`` is not read (the documents set it). The KV stage of every degree is
    built with ``graph``. ``plans``: a dict this fills with each degree's compiled plan (``a = 1``
    the :class:`~megatron_fcp.contract.plan.Plan`, else the
    :class:`~megatron_fcp.contract.head_parallel_packed.PackedHeadParallelPlan`), so a caller can
    run the chosen one without compiling it again. ``placement_balance``: what every degree's
    placement balances (``place_packed``'s ``balance``; Note [Layer work]). ``prune`` (default):
    a degree whose floor rules it out is not simulated and has no time in the dict (Note [Pruning
    the packed degree choice]; the same choice either way). ``buffered_sends``, ``held_routes``: the
    transport's timeline rules (:class:`~megatron_fcp.cost.head_parallel_packed.PackedAsRun`; the
    emulated cluster's gloo over TCP sets both, the GPU runtime neither)."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cands = list(degrees) if degrees is not None else head_parallel_degrees(topo, ranks, shape.heads, shape.kv_heads)
    if not cands:
        raise ValueError("choose_packed_head_parallel: no candidate degree")
    priced: dict[int, PackedAsRun] = {}
    for a in sorted(set(cands)):
        plan = packed_degree_plan(topo, ranks, doc_lengths, shape, a, graph=graph, causal=causal,
                                  block_tokens=block_tokens, placement_balance=placement_balance)
        priced[a] = PackedAsRun(plan, topo, shape, compute_model=compute_model, backward_kv=backward_kv,
                                kv_memory_budget=kv_memory_budget, buffered_sends=buffered_sends,
                                held_routes=held_routes)
        if plans is not None:
            plans[a] = plan
    # Note [Pruning the packed degree choice]: least floor first, each floor tightened or the degree
    # simulated in its turn; what cannot win is left out
    heap = [(p.compute_floor() if prune else 0.0, a, 1) for a, p in priced.items()]
    heapq.heapify(heap)
    times: dict[int, float] = {}
    while heap:
        floor, a, step = heapq.heappop(heap)
        if times and floor > min(times.values()) * (1 + 1e-9):
            break                     # every floor left is at least this one
        if step == 1 and prune:       # its jobs' floor: now its waves' (packed here; a chain's is 0)
            heapq.heappush(heap, (max(floor, priced[a].floor()), a, 2))
            continue
        times[a] = priced[a].result()["total_s"]
    best = min(times, key=lambda a: (times[a], a))
    return best, dict(sorted(times.items()))
