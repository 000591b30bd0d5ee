"""``build_plan``: a topology, a CP group and a graph name in, one verified Plan out. Pure, no torch.

For a named graph the builder's CommGraph is compiled (:func:`~megatron_fcp.planner.compile.compile_plan`).
For ``"auto"`` every builder of :data:`~megatron_fcp.planner.builders.AUTO_CANDIDATES` (for a packed
batch :data:`~megatron_fcp.planner.builders.PACKED_AUTO_CANDIDATES`, which adds ``entry``) is compiled
and timed on the cost model (:func:`~megatron_fcp.cost.model.simulate_plan`), and the best is
kept (:func:`~megatron_fcp.cost.model.pick_best`). Auto works for every CP size and sequence
length: a length that ``2*cp`` does not divide is padded as Megatron pads.

Note [Pruning auto]
-------------------
Each builder's graph has a floor on the predicted time of any plan compiled from it
(:func:`~megatron_fcp.cost.floors.graph_kv_floor`: the need-set bound, and per node the KV it
needs over the NICs the graph enters it through); the ``full`` builder's trees are stars, so its
messages are known before it is compiled and its floor is also their most loaded resource
(:func:`~megatron_fcp.cost.floors.star_kv_floor`, within 2% of its plan's communication on 72
packed and zigzag cases; added 2026-12-06: at cp = 256 with 512 documents ``full`` took 0.1 s to
compile and came out 3x ``hierarchical``'s communication). Over a placement, builders whose trees
follow fixed paths (``ring``: a chain to the farthest reader; ``spanning``: the tree's paths) know
every edge's load before compiling too
(:meth:`~megatron_fcp.planner.builders.GraphBuilder.edge_loads`, equal to the compiled plan's edge
by edge, tested), and their floor is also the most loaded resource under those loads
(:func:`~megatron_fcp.cost.floors.edge_kv_floor`; added 2026-12-07: at cp = 256 with ``a = 8`` the
KV stage compiled ``ring`` and ``spanning`` at 13.8 and 45 ms of communication against a best of
1.8, 0.09 s of the degree choice). A packed candidate that its floor does not rule out once
another is priced is held to one more before it is compiled: its trees (the compile's first step,
kept on the placement for the compile) give every edge's load, and so the most loaded resource
(:func:`_trees_floor`; 2026-12-07: ``entry`` at cp = 256, ``a = 1``, 12.45 against its 12.46 ms,
where the need-set floor said 2.8 and ``hierarchical`` had 4.6). Candidates are compiled and timed in
increasing floor; one whose floor is above the best communication so far (``comm``), or above
the best total so far by more than :func:`~megatron_fcp.cost.model.pick_best`'s 0.1% tie
(``total``), cannot be chosen and is neither compiled nor timed (a 1,024-rank ``leader`` plan
funnels each node through one NIC). A packed batch's floors are over its placement, and the
bar is the best so far and its :data:`PACKED_TIE`: a candidate above it cannot enter the tie that
:func:`_least_crossing` breaks by inter-node bytes (a 256-rank packed ``ring`` relays every block
through one rank per node). This applies above :data:`PRUNE_AUTO_MIN_CP` ranks (a packed batch,
planned per batch: :data:`PRUNE_PACKED_AUTO_MIN_CP`), where ``plan.auto`` lists the candidates
timed; smaller groups time every candidate.

*Twins.* A packed candidate whose trees are an earlier candidate's (in candidate order), on a
graph the compiler reads nothing else of that differs
(:func:`~megatron_fcp.planner.compile.compiles_alike`), would compile to that candidate's plan
under another name: the same time, and a tie :func:`_least_crossing` gives to the earlier one. It
is not compiled; ``plan.auto`` records it at its twin's time, which is what compiling it gives
(tested). 2026-12-07: over one rank per node (``a = 8``'s KV stage) ``full``, ``hierarchical``,
``leader`` and ``entry`` all send each block straight to its readers; compiling the three twins
took 24 of ``a = 8``'s 56 ms at cp = 256 (512 documents) and 10 of 24 ms at cp = 64.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import numpy as np

from megatron_fcp.contract.blocks import PlanError, gc_paused
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.plan import AutoChoice, Plan, check_cp_ranks, plan_mask
from megatron_fcp.cost.floors import edge_kv_floor, graph_kv_floor, star_kv_floor
from megatron_fcp.cost.model import AttentionShape, pad_for_zigzag, pick_best, simulate_plan, zigzag_padded_len
from megatron_fcp.planner.builders import AUTO_CANDIDATES, PACKED_AUTO_CANDIDATES, GraphBuilder, get_builder
from megatron_fcp.planner.compile import compile_plan, compiles_alike, placement_trees
from megatron_fcp.planner.graph import CommGraph
from megatron_fcp.topology import Topology, load_topology

__all__ = ["build_plan", "join_backward", "NOMINAL_SHAPE", "PACKED_TIE"]

NOMINAL_SHAPE = AttentionShape(131072, 32, 8, 128, 2)
"""The shape ``auto`` times candidates on when the caller gives none (128K tokens, GQA 32:8, d=128, bf16)."""

PACKED_TIE = 0.01
"""For a packed batch, candidates predicted within this fraction of the best are a tie (Note in
:func:`_least_crossing`)."""


@gc_paused()
def build_plan(
    topology,
    cp_ranks,
    graph="auto",
    *,
    causal=True,
    parts_per_chunk=1,
    seq_len=None,
    heads=None,
    kv_heads=None,
    head_dim=None,
    dtype_bytes=2,
    objective=None,
    placement=None,
    window=None,
    backward_graph=None,
) -> Plan:
    """Verified plan for the CP group ``cp_ranks`` (global ranks, CP order) on ``topology``.

    ``topology``: a Topology, ``"PRESET:NODES"`` or a YAML path. ``graph``: a name of
    :data:`~megatron_fcp.planner.builders.BUILDERS`, a
    :class:`~megatron_fcp.planner.builders.GraphBuilder`, or ``"auto"``: compile every candidate
    and keep the one with the least predicted time by ``objective`` (``"total"``: overlapped time,
    ties broken by communication; ``"comm"``: communication alone). Without ``objective`` auto uses
    ``"total"`` when ``seq_len``, ``heads`` and ``head_dim`` are given, else ``"comm"``. Missing
    shape fields come from :data:`NOMINAL_SHAPE`. ``plan.auto`` records every candidate's time.
    ``placement``: plan a packed batch (:func:`~megatron_fcp.contract.placement.place_packed`,
    CP order = ``cp_ranks``) instead of Megatron's zigzag split; block sizes then come from it.
    ``window``: a sliding window ``(left, right)`` (Megatron's ``window_size``; default the
    placement's, or none): every block moves only to the ranks its window reaches (Note [Windowed
    need sets]); a windowed zigzag plan needs ``seq_len`` (padded to a multiple of ``2*cp`` as
    Megatron pads; the plan records the padded length).
    ``backward_graph``: a builder name the backward walks instead of the forward's graph (Note [A
    backward on another graph] in :mod:`megatron_fcp.contract.plan`): the forward is chosen as
    above, and where its graph is another, the plan on ``backward_graph`` is joined to it
    (:func:`join_backward`), kept only where its forward is predicted no slower (to 1e-9) than
    that plan's own (same backward, so never slower in all); else that plan alone. None: the
    forward's.
    """
    plan = _build_forward(topology, cp_ranks, graph, causal=causal, parts_per_chunk=parts_per_chunk,
                          seq_len=seq_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                          dtype_bytes=dtype_bytes, objective=objective, placement=placement, window=window)
    if backward_graph is None or backward_graph == plan.name:
        return plan
    back = _build_forward(topology, cp_ranks, backward_graph, causal=causal, parts_per_chunk=parts_per_chunk,
                          seq_len=seq_len, placement=placement, window=window)
    joined = join_backward(plan, back)
    topo = topology if isinstance(topology, Topology) else load_topology(topology)
    shape = _priced_shape(seq_len, heads, kv_heads, head_dim, dtype_bytes)
    mine, theirs = (simulate_plan(p, topo, shape).total_s for p in (joined, back))
    return joined if mine <= theirs * (1 + 1e-9) else back


def join_backward(forward: Plan, backward: Plan) -> Plan:
    """``forward`` with its backward walking ``backward`` (Note [A backward on another graph] in
    :mod:`megatron_fcp.contract.plan`). The deliveries of ``backward``'s first round that
    ``forward`` does not make (a ring's first hops past ranks that do not read them, which a chain
    backward keeps from the forward) are added to ``forward``'s first round, as ``backward`` makes
    them (each from its owner), and the result is verified again."""
    missing = set(forward.undelivered_first_round(backward))
    if missing:
        extra = tuple(t for t in backward.rounds[0] if (t.dst, t.block) in missing)
        rounds = forward.rounds
        forward = replace(forward, rounds=(rounds[0] + extra,) + rounds[1:], table=None).verify(
            forward.max_sends, forward.max_recvs)
    return forward.with_backward(backward)


def _build_forward(topology, cp_ranks, graph, *, causal, parts_per_chunk, seq_len=None, heads=None, kv_heads=None,
                   head_dim=None, dtype_bytes=2, objective=None, placement=None, window=None) -> Plan:
    """:func:`build_plan` without ``backward_graph``: the plan on ``graph`` (or ``auto``'s choice)."""
    topo = topology if isinstance(topology, Topology) else load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    if not isinstance(parts_per_chunk, int) or parts_per_chunk < 1:
        raise PlanError(f"parts_per_chunk: must be an integer >= 1, got {parts_per_chunk!r}")
    mask = plan_mask(causal, window, placement)
    plan_seq = None
    if mask.windowed and placement is None:
        if seq_len is None:
            raise PlanError(f"build_plan: a zigzag plan under the {mask.describe()} mask needs seq_len (its need "
                            "sets depend on the sequence length in tokens); pass seq_len=")
        plan_seq = zigzag_padded_len(int(seq_len), len(ranks))
    win = dict(window=mask.window, seq_len=plan_seq)
    if graph != "auto":
        return compile_plan(_graph(topo, ranks, graph), causal, parts_per_chunk, placement=placement, **win)

    if objective is None:
        objective = "total" if seq_len is not None and heads is not None and head_dim is not None else "comm"
    if objective not in ("comm", "total"):
        raise ValueError(f"objective: must be 'comm' or 'total', got {objective!r}")
    shape = _priced_shape(seq_len, heads, kv_heads, head_dim, dtype_bytes)
    candidates = []
    names = [n for n in (AUTO_CANDIDATES if placement is None else PACKED_AUTO_CANDIDATES)
             if len(ranks) > 1 or n == "ring"]
    graphs = {name: _graph(topo, ranks, name) for name in names}
    prune = len(ranks) > (PRUNE_AUTO_MIN_CP if placement is None else PRUNE_PACKED_AUTO_MIN_CP)
    floors = {name: _floor(graphs[name], topo, shape, mask, placement) if prune else 0.0 for name in names}
    priced = {}
    twins: dict[str, str] = {}     # a candidate not compiled -> the earlier one whose plan it would be
    for name in sorted(names, key=lambda n: (floors[n], names.index(n))):  # Note [Pruning auto]
        if prune and priced and floors[name] > _bar(priced.values(), objective, placement is not None):
            continue
        if prune and priced and placement is not None \
                and _trees_floor(graphs[name], topo, shape, placement) > _bar(priced.values(), objective, True):
            continue
        twin = next((n for n in names[:names.index(name)] if n in priced
                     and compiles_alike(graphs[n], graphs[name], placement)), None) \
            if prune and placement is not None else None
        if twin is not None:          # the same plan as an earlier candidate's: the tie goes to that one
            twins[name] = twin
            continue
        plan = compile_plan(graphs[name], causal, parts_per_chunk, placement=placement, **win)
        priced[name] = (simulate_plan(plan, topo, shape, compute=objective == "total"), plan)
    candidates = [priced[n] for n in names if n in priced]
    _, best = pick_best(candidates, objective) if placement is None else _least_crossing(candidates, objective)
    metric = "total_s" if objective == "total" else "comm_s"
    timed = [(priced[n][1].name, getattr(priced[n][0], metric)) if n in priced
             else (n, getattr(priced[twins[n]][0], metric)) for n in names if n in priced or n in twins]
    return best.with_auto(AutoChoice(metric, tuple(timed)))


def _priced_shape(seq_len, heads, kv_heads, head_dim, dtype_bytes) -> AttentionShape:
    """The shape candidates are timed on: the fields given, the rest :data:`NOMINAL_SHAPE`'s."""
    n = NOMINAL_SHAPE
    return AttentionShape(seq_len or n.seq_len, heads or n.heads, kv_heads or heads or n.kv_heads,
                          head_dim or n.head_dim, dtype_bytes)


def _graph(topo: Topology, ranks: tuple[int, ...], graph: "str | GraphBuilder") -> CommGraph:
    """The builder's CommGraph over ``ranks``. A graph named by its builder reads only the topology
    and the CP group, so it is built once per topology object and group and shared by every plan
    compiled from it (the runtime plans each packed batch over the same ones: at cp = 256 the six
    packed ``auto`` candidates' graphs took 48 ms of a batch's plan, 2026-12-06). A CommGraph is not
    changed once built (its networkx graph, edge list and set are caches of its edges). A builder
    instance (its own settings) is built each time."""
    if not isinstance(graph, str):
        return get_builder(graph).build(topo, ranks)
    key = (id(topo), graph, ranks)
    hit = _GRAPHS.get(key)
    if hit is not None and hit[0]() is topo:
        return hit[1]
    cg = get_builder(graph).build(topo, ranks)
    if len(_GRAPHS) > 64:
        _GRAPHS.clear()
    _GRAPHS[key] = (weakref.ref(topo), cg)
    return cg


_GRAPHS: dict[tuple, tuple[weakref.ref, CommGraph]] = {}   # (id(topology), name, ranks) -> (topology ref, graph)


PRUNE_AUTO_MIN_CP = 64
"""Above this many ranks ``auto`` leaves out builders a floor rules out (Note [Pruning auto]); up to
it every candidate is timed and recorded in ``plan.auto`` (cheap, and what the CLI compares)."""


PRUNE_PACKED_AUTO_MIN_CP = 4
"""The same for a packed batch, whose plan is built per batch (Note [Pruning auto]); lowered from 16
2026-12-07: at cp = 64 the KV stages of ``a = 4`` and ``a = 8`` (16 and 8 groups) compiled all six
candidates where the floors leave two to four."""


def _floor(cg, topo: Topology, shape: AttentionShape, causal: "bool | Mask", placement=None) -> float:
    """A floor on the predicted time (comm or total) of any plan compiled from ``cg`` over
    ``placement`` (None: the zigzag split of ``shape.seq_len``) (Note [Pruning auto]); 0 when the
    graph's owners carry relative KV sizes."""
    if cg.meta.get("kv_sizes"):
        return 0.0
    padded = shape if placement is not None else pad_for_zigzag(shape, len(cg.ranks))[0]
    seq_len, kv_tok = (0 if placement is not None else padded.seq_len), padded.kv_bytes(1)
    floor = graph_kv_floor(cg, topo, seq_len, causal, kv_tok, placement)
    if cg.builder is not None and cg.builder.sends_direct():   # its messages are known here
        floor = max(floor, star_kv_floor(topo, cg.ranks, placement, seq_len, causal, kv_tok))
    elif cg.builder is not None and placement is not None:     # or each edge's load, on fixed paths
        loads = cg.builder.edge_loads(cg, placement.block_owners(), placement.need_matrix(),
                                      placement.block_tokens().astype(np.float64))
        if loads is not None:
            floor = max(floor, edge_kv_floor(topo, cg.ranks, *loads, kv_tok))
    return floor * (1 - 1e-9)


def _trees_floor(cg, topo: Topology, shape: AttentionShape, placement) -> float:
    """A packed candidate's floor from its trees (Note [Pruning auto]): the compiler's first step,
    :func:`~megatron_fcp.planner.compile.placement_trees` (kept for its compile), gives every edge's
    tokens, and the rounds take at least the most loaded resource under them. Tighter than
    :func:`_floor` for a graph that relays (``entry``, ``hierarchical``), at the cost of the trees;
    0 when the graph's owners carry relative KV sizes."""
    if cg.meta.get("kv_sizes"):
        return 0.0
    _, cols = placement_trees(cg, placement)
    if not cols.num_edges:
        return 0.0
    pos = np.full(max(cg.ranks) + 1, -1, dtype=np.int64)
    pos[list(cg.ranks)] = np.arange(len(cg.ranks))
    tokens = placement.tokens_of(pos[cols.owner], cols.chunk)[cols.tree_of]                # [edges]
    return edge_kv_floor(topo, cg.ranks, pos[cols.u], pos[cols.v], tokens, shape.kv_bytes(1)) * (1 - 1e-9)


def _bar(priced, objective: str, packed: bool = False) -> float:
    """Above this floor a candidate cannot be the choice: for a zigzag plan
    (:func:`~megatron_fcp.cost.model.pick_best`) the least communication so far, or the least
    total so far and its 0.1% tie; for a packed batch (:func:`_least_crossing`) the least of the
    metric so far and its :data:`PACKED_TIE`."""
    metric = "comm_s" if objective == "comm" else "total_s"
    least = min(getattr(r, metric) for r, _ in priced)
    if packed:
        return least * (1 + PACKED_TIE)
    return least if objective == "comm" else least * (1 + 1e-3)


def _least_crossing(candidates, objective: str):
    """Packed batches: among the candidates within :data:`PACKED_TIE` of the best predicted time,
    the one that moves the fewest bytes across nodes (then the fastest, then the fewest bytes in
    all: the backward returns a partial along every transfer, so of two forwards that tie, the one
    with fewer relays has the cheaper backward).

    Under ``"total"`` the communication times must tie too. A need-driven packed plan moves little, so builders often land within a fraction of a percent of
    each other in the model (``full`` sends every block straight from its owner, ``entry`` crosses to
    each other node once and relays inside it). A gap that small is below what the model resolves;
    the inter-node bytes are not: they are what a shared fabric and other jobs feel. Fixed-length
    plans keep :func:`~megatron_fcp.cost.model.pick_best` unchanged.
    """
    metric = "total_s" if objective == "total" else "comm_s"
    best = min(getattr(r, metric) for r, _ in candidates)
    close = [c for c in candidates if getattr(c[0], metric) <= best * (1 + PACKED_TIE)]
    least_comm = min(r.comm_s for r, _ in close)  # under "total", compute may hide very different comm
    close = [c for c in close if c[0].comm_s <= least_comm * (1 + PACKED_TIE)]
    return min(close, key=lambda c: (c[0].inter_node_bytes, getattr(c[0], metric), c[0].comm_s, c[0].bytes))
