"""The head-parallel stage: a CP group factorised into head-parallel groups and a KV stage. Pure, no ``torch``.

Note [Head-parallel stage]
--------------------------
A CP group of ``cp`` ranks (zigzag layout: CP index ``i`` holds global chunks ``i`` and
``2cp-1-i`` of ``2cp``) is cut into ``G = cp / a`` *head groups* of ``a`` ranks each (usually the
ranks of one node). Forward:

1. **all-to-all inside each head group** (Ulysses): member ``j`` of a group receives, for head
   shard ``j`` (query heads ``[j*h/a, (j+1)*h/a)``, KV heads likewise after replication), the Q, K
   and V of every member's sequence shard. Afterwards the group's ``a`` members hold the same
   tokens (the union of the members' zigzag chunks: ``2a`` chunks, member order, chunk 0 before 1)
   for ``1/a`` of the heads each.
2. **KV stage**: the ranks with the same member index ``j`` in every group (``G`` ranks,
   :meth:`HeadParallelPlan.kv_stage_ranks`) run an ordinary FCP plan over a *placement*: virtual
   rank ``g`` (head group ``g``) holds the ``2a`` chunks of its members as blocks, so need sets,
   multicast and verification are the existing ones (:attr:`HeadParallelPlan.kv_plan`, built over
   virtual ranks ``0..G-1``; :meth:`HeadParallelPlan.kv_plan_for` relabels it onto stage ``j``'s
   global ranks). A ring over the groups is Transformer Engine's ``a2a+p2p``; ``a = cp`` is TE's
   ``a2a`` (no KV stage, ``G = 1``); ``a = 1`` is plain FCP.
3. **all-to-all back** of the output (and LSE) so every rank holds all heads of its own shard.

Backward mirrors it: dO all-to-all in, the KV stage's backward (dK/dV reduced along the reversed
trees), dQ/dK/dV all-to-all back.

GQA: the KV heads are split over the ``a`` members too. When ``h_kv`` is not a multiple of ``a``
each KV head is repeated ``kv_replication = a / gcd(h_kv, a)`` times first (``repeat_interleave``
on the head dim, which keeps query head ``i`` on original KV head ``i // (h / h_kv)``); the extra
bytes are ``kv_replication - 1`` times the KV all-to-all. That needs ``h % a == 0`` and the query
heads per KV head ``h / h_kv`` to be a multiple of ``kv_replication``; otherwise
:func:`check_head_parallel` refuses with the fix.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Sequence

from megatron_fcp.contract.blocks import Block, PlanError, Transfer, zigzag_chunk_index
from megatron_fcp.contract.placement import Placement, Span
from megatron_fcp.contract.plan import Plan, check_cp_ranks
from megatron_fcp.topology import Topology, load_topology

__all__ = ["HeadGroups", "HeadParallelPlan", "kv_replication", "check_head_parallel", "group_placement", "relabel_plan",
           "consecutive_head_groups", "stage_plan", "stage_placement", "head_parallel_degrees",
           "topology_head_groups", "head_groups_for", "LOCAL_STAGE"]

LOCAL_STAGE = "a2a"
"""The graph name of a head-parallel stage with one head group (``a = cp``, no KV stage): its stage
plan is ``hp{a}-a2a``, without rounds."""


def kv_replication(kv_heads: int, degree: int) -> int:
    """How many times each KV head is repeated so that the KV heads split evenly over ``degree``."""
    return degree // math.gcd(kv_heads, degree)


def check_head_parallel(heads: int, kv_heads: int, degree: int, cp: int) -> int:
    """Check a head-parallel degree against the head counts and CP size; return ``kv_replication``.

    Raises ValueError naming the fix (before any communication)."""
    if degree < 1 or cp % degree != 0:
        raise ValueError(f"head-parallel degree {degree} must divide the CP size {cp}; "
                         f"use one of {[a for a in range(1, cp + 1) if cp % a == 0]}")
    if heads % kv_heads != 0:
        raise ValueError(f"query heads {heads} must be a multiple of KV heads {kv_heads}")
    if heads % degree != 0:
        raise ValueError(f"head-parallel degree {degree} must divide the query heads {heads}; "
                         f"pick a degree dividing both {heads} and the CP size {cp}")
    rep = kv_replication(kv_heads, degree)
    if (heads // kv_heads) % rep != 0:
        raise ValueError(f"head-parallel degree {degree} with {heads} query and {kv_heads} KV heads would repeat "
                         f"each KV head {rep} times, which does not divide the {heads // kv_heads} query heads per "
                         f"KV head; pick a degree dividing {kv_heads} or a smaller one")
    return rep


def consecutive_head_groups(ranks: Sequence[int], degree: int) -> tuple[tuple[int, ...], ...]:
    """Head groups of ``degree`` consecutive CP ranks (CP order): the default, one node's ranks
    when CP ranks fill nodes in order."""
    ranks = tuple(ranks)
    if degree < 1 or len(ranks) % degree:
        raise ValueError(f"head-parallel degree {degree} must divide the CP size {len(ranks)}")
    return tuple(ranks[g * degree:(g + 1) * degree] for g in range(len(ranks) // degree))


def group_placement(ranks: Sequence[int], head_groups: Sequence[Sequence[int]], seq_len: int,
                    causal: bool = True) -> Placement:
    """The KV stage's placement: virtual rank ``g`` holds the zigzag chunks of head group ``g``'s
    members (member order; each member's chunk 0, then chunk 1) as spans of one document of
    ``seq_len`` tokens (a multiple of ``2 * cp``)."""
    ranks = tuple(ranks)
    cp = len(ranks)
    if seq_len <= 0 or seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be a positive multiple of 2*cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    index = {r: i for i, r in enumerate(ranks)}
    blocks = []
    for group in head_groups:
        spans = []
        for member in group:
            for c in (0, 1):
                gc = zigzag_chunk_index(index[member], c, cp)
                spans.append(Span(0, gc * chunk, (gc + 1) * chunk))
        blocks.append(tuple(spans))
    return Placement((seq_len,), tuple(blocks), causal)


def relabel_plan(plan: Plan, ranks: Sequence[int]) -> Plan:
    """The same schedule with CP index ``i`` of ``plan`` renamed to global rank ``ranks[i]``
    (``plan`` itself when that renames nothing: a zigzag plan over ranks ``0..cp-1``); a plan whose
    backward walks another (Note [A backward on another graph] in :mod:`megatron_fcp.contract.plan`)
    has both renamed."""
    ranks = tuple(ranks)
    if len(ranks) != plan.cp:
        raise PlanError(f"relabel: {len(ranks)} ranks for a plan over {plan.cp}")
    if ranks == tuple(plan.ranks):
        return plan
    backward = None if plan.backward is None else relabel_plan(plan.backward, ranks)
    if plan.table is not None and plan.__dict__.get("_rounds") is None:
        return replace(plan, ranks=ranks, rounds=None, backward=backward)   # a table names CP indices
    to = {old: new for old, new in zip(plan.ranks, ranks)}

    renamed: dict[Block, Block] = {}

    def blk(b: Block) -> Block:  # one new Block per distinct block, not per transfer
        out = renamed.get(b)
        if out is None:
            out = renamed[b] = Block(to[b.owner], b.chunk, b.part)
        return out

    rounds = tuple(tuple(Transfer(to[t.src], to[t.dst], blk(t.block)) for t in rnd) for rnd in plan.rounds)
    return replace(plan, ranks=ranks, rounds=rounds, backward=backward)


class HeadGroups:
    """What a head-parallel plan (zigzag or packed) says of its groups: ``ranks`` (the CP group in
    CP order), ``head_groups`` (``cp / a`` tuples of ``a`` global ranks), ``kv_plan`` and the
    per-member cache ``_stage_plans`` are its fields."""

    ranks: tuple[int, ...]
    head_groups: tuple[tuple[int, ...], ...]
    kv_plan: "Plan | None"
    _stage_plans: dict

    @property
    def cp(self) -> int:
        return len(self.ranks)

    @property
    def num_groups(self) -> int:
        return len(self.head_groups)

    def position(self, rank: int) -> tuple[int, int]:
        """``(g, j)``: the head group of global ``rank`` and its member index there."""
        for g, group in enumerate(self.head_groups):
            if rank in group:
                return g, group.index(rank)
        raise PlanError(f"rank {rank} is not in the CP group {self.ranks}")

    def kv_stage_ranks(self, member: int) -> tuple[int, ...]:
        """Global ranks of the KV stage for head shard ``member``: member ``member`` of each group."""
        return tuple(group[member] for group in self.head_groups)

    def kv_plan_for(self, member: int) -> "Plan | None":
        """``kv_plan`` on the global ranks of head shard ``member``'s KV stage; the same object on
        every call (the executor caches its backward waves and KV decision per plan object)."""
        if self.kv_plan is None:
            return None
        plan = self._stage_plans.get(member)
        if plan is None:
            plan = self._stage_plans[member] = relabel_plan(self.kv_plan, self.kv_stage_ranks(member))
        return plan


@dataclass(frozen=True)
class HeadParallelPlan(HeadGroups):
    """A CP group as head-parallel groups plus a KV-stage plan (Note [Head-parallel stage]).

    ranks: the CP group's global ranks in CP (zigzag) order.
    degree: ``a``, ranks per head group (1: no head-parallel stage).
    head_groups: ``cp / a`` tuples of ``a`` global ranks; member ``j`` of each takes head shard ``j``.
    kv_plan: the KV stage's plan over virtual ranks ``0..G-1`` (one per head group), over
        :func:`group_placement`; ``None`` when ``G == 1`` (pure all-to-all, TE's ``a2a``).
    kv_replication: times each KV head is repeated before the split (:func:`kv_replication`).
    auto: when chosen by the planner (``choose_head_parallel``), every candidate's predicted
        seconds as ``(label, seconds)``, label ``"a=DEGREE graph=NAME parts=P"``; None otherwise.
    """

    ranks: tuple[int, ...]
    degree: int
    head_groups: tuple[tuple[int, ...], ...]
    kv_plan: Plan | None
    kv_replication: int = 1
    auto: tuple[tuple[str, float], ...] | None = field(default=None, compare=False)
    #: member -> kv_plan_for(member): one Plan object per stage, so the executor's per-plan caches
    #: (backward waves, backward KV decision) hit on every later call instead of re-planning.
    _stage_plans: dict[int, Plan] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cp = len(self.ranks)
        members = [r for g in self.head_groups for r in g]
        if self.degree < 1 or cp % self.degree or sorted(members) != sorted(self.ranks) \
                or any(len(g) != self.degree for g in self.head_groups):
            raise PlanError(f"head groups {self.head_groups} must split the CP ranks {self.ranks} into groups "
                            f"of {self.degree}")
        groups = len(self.head_groups)
        if (self.kv_plan is None) != (groups == 1):
            raise PlanError("a head-parallel plan has a KV-stage plan exactly when there is more than one head group")
        if self.kv_plan is not None and self.kv_plan.ranks != tuple(range(groups)):
            raise PlanError(f"the KV-stage plan must run over virtual ranks 0..{groups - 1}, got {self.kv_plan.ranks}")

    def verify(self) -> "HeadParallelPlan":
        """Prove the stage: the head groups partition the CP ranks into groups of ``degree``
        (checked at construction, again here), the KV-stage plan is verified, and over a placement
        every virtual rank holds its group's ``2 * degree`` chunks (``2 * degree`` blocks). Raises
        :class:`PlanError`; returns ``self``."""
        self.__post_init__()
        if self.kv_plan is None:
            return self
        self.kv_plan.verify()
        pl = self.kv_plan.placement
        if pl is not None and any(len(b) != 2 * self.degree for b in pl.blocks):
            raise PlanError(f"the KV-stage placement must give each head group its {2 * self.degree} chunks, "
                            f"got {[len(b) for b in pl.blocks]}")
        if pl is None and self.degree != 1:
            raise PlanError(f"a KV stage of degree {self.degree} runs over group_placement, not the zigzag layout")
        return self


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
    name = hp.kv_plan.name if hp.kv_plan is not None else LOCAL_STAGE
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


def head_groups_for(topology: "Topology | str", cp_ranks: Sequence[int], degree: int) -> tuple[tuple[int, ...], ...]:
    """The head groups a CP group runs with: the planner's (:func:`topology_head_groups`, inside
    nodes) wherever ``degree`` fits every node's CP ranks; else (an explicit degree that crosses
    nodes, which the planner does not price) ``degree`` consecutive CP ranks. The runtime builds
    its stages and process groups with this, so it runs the groups the planner timed."""
    try:
        return topology_head_groups(topology, cp_ranks, degree)
    except ValueError:
        return consecutive_head_groups(cp_ranks, degree)
