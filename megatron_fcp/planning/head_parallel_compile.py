"""Head-parallel plans for a given degree and graph: head groups from the topology, the KV stage
compiled with the ordinary builders, and the *stage plan* the cost model times. Pure, no torch.

See Note [Head-parallel stage] in :mod:`megatron_fcp.planning.head_parallel` for the schedule.

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
ordinary :class:`~megatron_fcp.planning.plan.Plan` over a placement with ``a`` *documents*, one per
head shard: rank (group ``g``, member ``j``) holds group ``g``'s ``2a`` zigzag chunks as spans of
document ``j``. Document need sets keep every stage to itself, so the merged plan verifies with the
ordinary :meth:`Plan.verify` and the cost model times it with every stage contending for the same
links. The attention shape of a stage is ``h/a`` query heads and ``h_kv * kv_replication / a`` KV
heads. For ``a = 1`` the stage plan is the ordinary zigzag plan (sub-blocks allowed).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Sequence

from megatron_fcp.planning.blocks import Block, PlanError, Transfer, check_parts
from megatron_fcp.planning.build import build_plan
from megatron_fcp.planning.builders import get_builder
from megatron_fcp.planning.compile import compile_plan
from megatron_fcp.planning.cost import AttentionShape, pad_for_zigzag
from megatron_fcp.planning.graph import check_cp_ranks
from megatron_fcp.planning.head_parallel import (
    HeadParallelPlan,
    check_head_parallel,
    group_placement,
    relabel_plan,
)
from megatron_fcp.planning.placement import Placement, Span
from megatron_fcp.planning.plan import Plan
from megatron_fcp.topology import Topology, load_topology

BALANCE_MAX_GROUPS = 64
"""Up to this many head groups the KV stage's leaf edges are balanced over rounds
(:func:`~megatron_fcp.planning.compile.compile_plan`'s ``balance``; O(transfers x rounds)); larger
stages keep plain waves, which keeps a 1,024-rank head-parallel plan within the planning budget."""

__all__ = ["head_parallel_degrees", "topology_head_groups", "compile_head_parallel", "stage_plan", "stage_placement",
           "stage_shape"]


def _node_runs(topo: Topology, ranks: Sequence[int]) -> list[list[int]]:
    """CP ranks per node (nodes in order of first appearance in CP order), each in rail order."""
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(topo.node_of(r), []).append(r)
    for lst in groups.values():
        lst.sort(key=topo.local_rank_of)
    return list(groups.values())


def head_parallel_degrees(topology: "Topology | str", cp_ranks: Sequence[int], heads: int | None = None,
                          kv_heads: int | None = None) -> list[int]:
    """Degrees ``a`` whose head groups fit inside nodes (``a`` divides every node's CP rank count),
    and, when head counts are given, that :func:`check_head_parallel` accepts (ascending)."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    g = math.gcd(*[len(run) for run in _node_runs(topo, ranks)])
    out = []
    for a in range(1, g + 1):
        if g % a:
            continue
        if heads is not None:
            try:
                check_head_parallel(heads, kv_heads or heads, a, len(ranks))
            except ValueError:
                continue
        out.append(a)
    return out


def topology_head_groups(topology: "Topology | str", cp_ranks: Sequence[int], degree: int) -> tuple[tuple[int, ...], ...]:
    """Head groups of ``degree`` ranks inside nodes; see Note [Head groups from the topology]."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    runs = _node_runs(topo, ranks)
    bad = [len(r) for r in runs if len(r) % degree] if degree >= 1 else [0]
    if bad:
        raise ValueError(f"head-parallel degree {degree} must divide every node's CP rank count "
                         f"{[len(r) for r in runs]}; use one of {head_parallel_degrees(topo, ranks)}")
    return tuple(tuple(run[k:k + degree]) for run in runs for k in range(0, len(run), degree))


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
) -> HeadParallelPlan:
    """A verified :class:`HeadParallelPlan` for ``degree`` and the KV-stage ``graph`` (a builder name).

    The KV stage's graph is built over stage 0's global ranks (member 0 of every group: the builder
    sees the real nodes and rails) and compiled over :func:`group_placement` of ``shape.seq_len``
    (padded as Megatron pads); the plan is then renamed onto virtual ranks ``0..G-1``. ``degree = 1``
    gives the ordinary zigzag plan (``parts_per_chunk`` sub-blocks) on virtual ranks; placements take
    whole chunks, so ``parts_per_chunk`` must be 1 for ``degree > 1``; instead ``stagger`` > 1 starts
    a group's ``b``-th chunk ``b mod stagger`` rounds late (``compile_plan(stagger_blocks=...)``), so
    its chunks pipeline through relays as sub-blocks do.
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
    G = len(groups)
    if degree == 1:
        if [g[0] for g in groups] != list(ranks):
            raise PlanError("degree 1: head groups must list the CP ranks in CP order")
        check_parts(shape.seq_len // (2 * cp), parts_per_chunk)  # uneven parts are fine (Note [Sub-block sizes])
        plan = build_plan(topo, ranks, graph, causal=causal, parts_per_chunk=parts_per_chunk)
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


def stage_shape(hp: HeadParallelPlan, shape: AttentionShape) -> AttentionShape:
    """The attention shape one KV stage works on: ``h/a`` query heads, ``h_kv * rep / a`` KV heads."""
    a = hp.degree
    return AttentionShape(shape.seq_len, shape.heads // a, shape.kv_heads * hp.kv_replication // a,
                          shape.head_dim, shape.dtype_bytes)


def stage_plan(hp: HeadParallelPlan, seq_len: int, causal: bool = True) -> Plan:
    """Every KV stage of ``hp`` merged into one verified Plan on ``hp.ranks``; see Note [The stage plan].

    ``seq_len`` must be a multiple of ``2 * cp`` (pad first) and, for ``degree > 1``, the length the
    KV plan was compiled for."""
    a = hp.degree
    if a == 1:
        return relabel_plan(hp.kv_plan, hp.kv_stage_ranks(0)).verify()  # the ordinary zigzag plan
    placement = stage_placement(hp, seq_len, hp.kv_plan.causal if hp.kv_plan else causal)
    rounds: tuple[tuple[Transfer, ...], ...] = ()
    if hp.kv_plan is not None:
        if hp.kv_plan.placement is not None and hp.kv_plan.placement.doc_lengths != (seq_len,):
            raise PlanError(f"stage_plan: the KV plan was compiled for {hp.kv_plan.placement.doc_lengths[0]} tokens, "
                            f"not {seq_len}")
        groups = hp.head_groups
        rounds = tuple(tuple(Transfer(groups[t.src][j], groups[t.dst][j], Block(groups[t.block.owner][j],
                                                                                 t.block.chunk, 0))
                             for t in rnd for j in range(a)) for rnd in hp.kv_plan.rounds)
    name = hp.kv_plan.name if hp.kv_plan is not None else "a2a"
    return Plan(hp.ranks, rounds, placement.causal, 1, name=f"hp{a}-{name}", placement=placement).verify()


def stage_placement(hp: HeadParallelPlan, seq_len: int, causal: bool = True) -> Placement:
    """The stage plan's placement (Note [The stage plan]; ``degree > 1``): on ``hp.ranks``, rank
    (group ``g``, member ``j``) holds group ``g``'s zigzag chunks as spans of document ``j``. Needs
    only the head groups (``hp.kv_plan`` may be None). Memoised: every candidate of one degree
    shares one placement object, and with it the placement's cached need matrix and block pairs."""
    return _stage_placement(tuple(hp.ranks), tuple(map(tuple, hp.head_groups)), hp.degree, seq_len, causal)


@functools.lru_cache(maxsize=32)
def _stage_placement(ranks: tuple, head_groups: tuple, degree: int, seq_len: int, causal: bool) -> Placement:
    hp = SimpleNamespace(ranks=ranks, head_groups=head_groups, degree=degree)
    base = group_placement(hp.ranks, hp.head_groups, seq_len, causal)
    pos = {r: (g, j) for g, group in enumerate(hp.head_groups) for j, r in enumerate(group)}
    blocks = tuple(tuple(Span(pos[r][1], s.start, s.end) for s in base.blocks[pos[r][0]]) for r in hp.ranks)
    return Placement((seq_len,) * hp.degree, blocks, base.causal)
