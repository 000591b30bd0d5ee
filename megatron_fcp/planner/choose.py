"""Choosing the head-parallel degree, the KV-stage graph and the block size on the cost model.
Pure, no torch.

:func:`choose_schedule` is what the Megatron runtime calls (topology, CP ranks, an AttentionShape,
the flags it was given as constraints, the backward it will run); :func:`choose_head_parallel`
(the benchmarks') and :func:`build_head_parallel_plan` (``degree``, ``graph`` and
``parts_per_chunk`` fixed or ``"auto"``) return the plan alone.

Note [Choosing the head-parallel degree]
----------------------------------------
Candidates: every degree ``a`` whose head groups fit inside nodes and whose head counts split
(:func:`~megatron_fcp.planner.head_parallel.head_parallel_degrees`; ``a = 1`` is plain FCP),
times every graph of :data:`~megatron_fcp.planner.builders.AUTO_CANDIDATES` for the KV stage (one
candidate when ``a`` is the whole group: nothing left to distribute). Each is timed forward and
backward (:func:`~megatron_fcp.cost.head_parallel.simulate_head_parallel`; the backward in
one pass from kept KV, or, given a :class:`~megatron_fcp.schedule.program.WaveBackward` as the
Megatron runtime passes, wave by wave with KV kept or re-sent as the executor will run it) and the best by
``objective`` is kept (:func:`~megatron_fcp.cost.model.pick_best`: least total, ties within 0.1%
broken by communication). Then, for ``a = 1``, sub-blocks of 2, 4 and 8 parts per chunk (no smaller
than ``min_block_tokens``; a part count that does not divide the chunk cuts it into parts of
floor/ceil size, Note [Sub-block sizes] in :mod:`megatron_fcp.contract.blocks`, so sequence lengths
that are only a multiple of ``2 * cp`` are not held to whole chunks) are tried on the winning
graph; for ``a > 1`` (placements move whole chunks) the best graph of each degree is tried with its
chunks staggered over 2, 4 and 8 rounds (``stagger``), which pipelines them through relays as
sub-blocks do. The search contains Transformer Engine's schedules: ``a = 1`` with ``ring`` is
``p2p``, ``a`` = ranks per node with ``ring`` is ``a2a+p2p`` (the same prediction, tested),
``a = cp`` is ``a2a``; so the choice is never predicted slower than them beyond the difference of
their own models (the ring over groups prunes relays past the last reader; TE's ring sends every
block all the way round).

Note [Pruning the search]
-------------------------
:func:`choose_schedule` (the runtime's choice, made on every rank at every job start) finds the
same best candidate and runner-up as the full search without pricing every candidate's backward,
the expensive part (waves are packed, chains stepped), and without compiling most of them. Each
candidate has a *floor*, a lower bound on its predicted total (Note [Backward floors] in
:mod:`megatron_fcp.cost.floors`), refined in steps, each only once the candidate's floor is the
least left (a heap):

1. its degree's (before any plan of the degree is compiled: all-to-alls exact, the stage's KV
   floor, each rank's compute with one kernel launch per owner it reads);
2. its graph's (``a = 1``: the degree's with the graph's own KV floor,
   :func:`~megatron_fcp.cost.floors.graph_kv_floor`, which holds a ring or a leader tree to one
   NIC per node; the graph is built, no plan compiled);
3. compiled: its forward priced exactly, its backward's compute and (waves) dK/dV reduction floors;
4. tight: a chain's backward program compiled and the sum of its steps' busiest compute
   (:func:`~megatron_fcp.cost.backward.chain_compute_floor`; staggered rings compute unevenly per step);
5. packed (a backward in waves): its waves packed and the wave loop's floor
   (:func:`~megatron_fcp.cost.backward.wave_backward_floor`, Note [Wave timeline floor] in
   :mod:`megatron_fcp.cost.timeline`), which sees a wave waiting on one sender's queue;
6. priced.

A candidate is dropped at any step where its floor exceeds ``(1 + 0.1%)`` times the second-best
total priced so far, above which :func:`~megatron_fcp.cost.model.pick_best` can make it neither
the choice nor the runner-up (its tie is 0.1%; totals only fall as the search goes on, so a
candidate left out stays out). One more condition keeps the answer exact: staggers and sub-blocks
are built on their degree's best graph, so a candidate that may be that graph (its floor within
the tie of its degree's best priced total) is kept while any follow-up on any graph that may be
the base is not ruled out by its own floor (the graph's floor first, then compiled). When none of
a degree's candidates is priced yet and the one at hand is a chain whose program is compiled, it
is priced (cheap) rather than compiling every graph's follow-ups: its total bounds which graphs
may still be the base. Pricing more than needed never changes the answer. The search prices with
``one_pass=False`` (:class:`~megatron_fcp.cost.head_parallel.HeadParallelPricing`): the one-pass
backward that is otherwise reported beside the executor's is not priced. ``plan.auto`` then lists
the candidates priced, in the full search's order. :func:`head_parallel_candidates` (the
benchmarks') prices every candidate unless asked to prune.

Note [Sharing the search]
-------------------------
Every rank of a job makes the same choice (it is a pure function of flags, topology and shapes),
so at scale every rank repeating the whole search is the same work done once per rank. With a
:class:`SearchShare` (the Megatron runtime passes one over the job's ranks, Note [The runtime runs
the planner's choice] in :mod:`megatron_fcp.patches.schedule`), :func:`choose_schedule` splits the
search over the ranks in rounds, each ended by one gather (JSON writes a float as its shortest
round-tripping ``repr``, so every rank holds the same bits, plans the next round alike and
decides alike). A round's compile jobs are dealt in turn from where the last round's left off,
first to the ranks holding no compiled candidate still to pack or price (:func:`_deal_cheap`:
those may have dear work next); a job on a
compiled candidate goes to the rank that compiled it, except that a rank owning several
candidates to pack in one round keeps the first and hands the others to ranks owning none, which
compile them again (:func:`_deal_dear`: compiling is a fraction of packing; a candidate to price
stays where its waves were packed). Each round runs only the cheapest kind of
work left, since cheap results tighten the bounds that decide whether dear work is needed:

1. compile (and price the forward of) every base candidate; price the backward where it is cheap
   (a chain, or no KV stage), else send the floor; with it, each degree's follow-up floor (the
   degree's, for ``a = 1`` with the graph's KV floor: :func:`_follow_up_floor`);
2. compile the follow-ups (staggers, sub-blocks) of every degree whose best graph is known (no
   graph not priced has a floor within the tie of its best), unless their follow-up floor rules
   them out; chains among them are priced at once;
3. else, for a degree whose best graph is not known, compile the follow-ups on every graph that
   may be it (*probes*): if none of their floors is below the bound, which graph is best does not
   matter; a probe with sub-blocks that its floor does not rule out is not packed: the graphs that
   may be the best are priced instead (step 5), since packing sub-blocks costs more than pricing
   whole chunks, and once the best graph is known the probes on the others are out;
4. else pack the waves of every candidate that may still be chosen or be the runner-up (floor at
   most ``(1 + 0.1%)`` times the second-best total priced), or may be the best graph of a degree
   whose follow-ups may win, for its packed floor -- base candidates in a round of their own
   first, since a base whose packed floor shows it cannot be its degree's best graph takes its
   probes out of the search (a base has whole chunks: cheaper to pack than sub-blocks)
   (:meth:`~megatron_fcp.cost.head_parallel.HeadParallelPricing.packed_floor`, Note [Wave
   timeline floor] in :mod:`megatron_fcp.cost.timeline`);
5. else price those whose packed floor still does not rule them out.

The rounds repeat until a round has no job. The rules are the pruned search's (totals only fall
as more are priced, so a candidate left out stays out, and a follow-up is a candidate only once
its graph is known to be its degree's best): the choice and the runner-up are the full search's.
The busiest rank pays for about one candidate's dear work; at cp = 64 the ring's chains priced
first usually leave no wave candidate to price at all. ``plan.auto`` lists every candidate priced.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from megatron_fcp.contract.blocks import gc_paused
from megatron_fcp.contract.head_parallel import HeadParallelPlan, head_parallel_degrees, stage_plan
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.plan import check_cp_ranks
from megatron_fcp.cost.floors import graph_kv_floor, intra_ingress, member_nic_ingress
from megatron_fcp.cost.head_parallel import HeadParallelPricing, a2a_messages, check_pass, stage_shape
from megatron_fcp.cost.head_parallel import degree_floor as head_parallel_degree_floor
from megatron_fcp.cost.model import AttentionShape, ComputeModel, SimResult, pad_for_zigzag, pick_best
from megatron_fcp.cost.te import lower_bound
from megatron_fcp.planner.builders import AUTO_CANDIDATES, get_builder
from megatron_fcp.planner.head_parallel import compile_head_parallel
from megatron_fcp.schedule.program import WaveBackward
from megatron_fcp.topology import Topology, load_topology

__all__ = ["lower_bound_all", "build_head_parallel_plan", "choose_head_parallel", "head_parallel_candidates", "ScheduleChoice",
           "SearchShare", "choose_schedule"]


def _label(hp: HeadParallelPlan, graph: str, parts: int, stagger: int = 1) -> str:
    return f"a={hp.degree} graph={graph} parts={parts}" + (f" stagger={stagger}" if stagger > 1 else "")


def head_parallel_candidates(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    degree: "int | str" = "auto",
    graph: str = "auto",
    parts_per_chunk: "int | str" = "auto",
    causal: bool = True,
    compute_model: ComputeModel | None = None,
    objective: str = "total",
    pass_: str = "fwd+bwd",
    round_overhead_s: float = 0.0,
    min_block_tokens: int = 256,
    grad_dtype_bytes: int | None = None,
    backward: WaveBackward | None = None,
    prune: bool = False,
    window: tuple[int, int] | None = None,
    share: "SearchShare | None" = None,
) -> list[tuple[SimResult, HeadParallelPlan | None]]:
    """Every candidate of Note [Choosing the head-parallel degree] as ``(SimResult, plan)``, the
    sub-block candidates of the best ``a = 1`` plan last. ``meta`` of each: ``label``, ``builder``
    (the KV-stage graph's builder name), ``stagger``. ``grad_dtype_bytes``: the dK/dV partials'
    bytes per element (default ``shape.dtype_bytes``: the executor sends them in the input dtype).
    ``backward``: how the backward is timed
    (:func:`~megatron_fcp.cost.head_parallel.simulate_head_parallel`; None: one pass).
    ``prune`` (``objective="total"`` only): leave out the candidates that a floor proves can be
    neither the best nor the runner-up (Note [Pruning the search]); the search's answer is the
    same, the list shorter. ``window`` (a sliding window, Megatron's ``(left, right)``): need sets,
    work and floors follow it; only degree 1 is planned under a window. ``share``: this process's
    part of the full search split over several (Note [Sharing the search]); the candidates come
    back without their plans (None), which the caller compiles for the one it picks."""
    check_pass(pass_)
    mask = Mask.of(causal, window)
    if objective not in ("comm", "total"):
        raise ValueError(f"objective: must be 'comm' or 'total', got {objective!r}")
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cp = len(ranks)
    padded, _ = pad_for_zigzag(shape, cp)
    valid = head_parallel_degrees(topo, ranks, shape.heads, shape.kv_heads)
    if mask.windowed:
        valid = [1]  # head-parallel stages under a window are not planned (compile_head_parallel)
    if degree == "auto":  # sub-blocks asked for: only a = 1 cuts chunks (placements move whole chunks)
        degrees = [1] if isinstance(parts_per_chunk, int) and parts_per_chunk > 1 else valid
    else:
        if not isinstance(degree, int) or degree not in valid:
            raise ValueError(f"head_parallel: degree {degree!r} does not fit this CP group and head counts; "
                             f"use auto or one of {valid}")
        degrees = [degree]
    graphs = list(AUTO_CANDIDATES) if graph == "auto" else [graph]
    fixed_parts = parts_per_chunk if parts_per_chunk != "auto" else 1
    if not isinstance(fixed_parts, int) or fixed_parts < 1:
        raise ValueError(f"parts_per_chunk: must be an integer >= 1 or auto, got {parts_per_chunk!r}")
    kw = dict(pass_=pass_, causal=mask if mask.windowed else causal, compute_model=compute_model,
              round_overhead_s=round_overhead_s, grad_dtype_bytes=grad_dtype_bytes, backward=backward)
    if share is not None and share.size > 1:
        return _shared_search(topo, ranks, padded, degrees, graphs, fixed_parts, parts_per_chunk == "auto",
                              min_block_tokens, causal, objective, kw, mask.window, share, prune and objective == "total")
    return _search(topo, ranks, padded, degrees, graphs, fixed_parts, parts_per_chunk == "auto", min_block_tokens,
                   causal, objective, kw, prune and objective == "total", mask.window)


@dataclass(frozen=True)
class SearchShare:
    """One process's part of a search split over ``size`` processes (Note [Sharing the search]):
    ``rank`` in ``0 .. size - 1`` and ``gather(obj) -> [every rank's obj, in rank order]``, a
    collective every rank calls with the same sequence of calls (obj: JSON-serialisable)."""

    rank: int
    size: int
    gather: Callable[[Any], list]

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise ValueError(f"SearchShare: rank must be in 0..size-1 and size >= 1, got rank {self.rank!r} "
                             f"of size {self.size!r}")


_SHARED_META = ("label", "builder", "stagger", "graph", "head_parallel", "parts_per_chunk", "fwd_total_s",
                "bwd_total_s", "backward_kv", "backward_form")


def _shared_search(topo: Topology, ranks: tuple, padded: AttentionShape, degrees: list[int], graphs: list[str],
                   fixed_parts: int, parts_auto: bool, min_block_tokens: int, causal: bool, objective: str, kw: dict,
                   window: tuple[int, int], share: SearchShare, prune: bool) -> list[tuple[SimResult, None]]:
    """The candidates of the full search that no floor rules out (all with ``prune`` False),
    priced a share per rank in gathered rounds, cheap work first (Note [Sharing the search]), in
    the full search's order, without plans. A candidate is ``(degree, graph, option, value)``:
    option ``"base"`` for a degree's graphs, ``"stagger"`` or ``"parts_per_chunk"`` for a follow-up
    on ``graph``, a *probe* until ``graph`` is known to be its degree's best."""
    cp = len(ranks)
    chunk = padded.seq_len // (2 * cp)
    order = _base_order(ranks, degrees, graphs)
    dkw = {k: kw[k] for k in ("pass_", "causal", "compute_model", "round_overhead_s", "backward")}
    # the shared state, the same on every rank after each gather
    priced: dict[tuple, SimResult] = {}
    floors: dict[tuple, float] = {}      # compiled, not priced: its tightest floor
    packed: set[tuple] = set()           # compiled in waves, floor packed (HeadParallelPricing.packed_floor)
    kv_stage: dict[tuple, bool] = {}     # compiled: the candidate has a KV stage (a > 1 follow-ups build on those)
    owner: dict[tuple, int] = {}         # the rank holding a compiled candidate's forward pricing
    kept: dict[tuple, HeadParallelPricing] = {}   # this rank's compiled candidates not priced yet
    dealt = [0]   # compile jobs dealt so far: each round's go on to the ranks the last one left idle

    def ups(a: int) -> list[tuple[str, int]]:
        return _follow_ups(a, cp, parts_auto, chunk, min_block_tokens)

    def shape_of(cid: tuple) -> tuple[int, int]:   # (parts per chunk, stagger) of a candidate
        a, _, opt, v = cid
        if opt == "base":
            return (fixed_parts if a == 1 else 1), 1
        return (v, 1) if opt == "parts_per_chunk" else (1, v)

    def compile_(cid: tuple) -> HeadParallelPricing:
        a, g, opt, v = cid
        opts = {"parts_per_chunk": shape_of(cid)[0]} if opt == "base" else {opt: v}
        return HeadParallelPricing(compile_head_parallel(topo, ranks, padded, a, g, causal=causal, window=window,
                                                         **opts), topo, padded, one_pass=False, **kw)

    def summary(cid: tuple, pr: HeadParallelPricing) -> list:
        res = pr.result()
        parts, stagger = shape_of(cid)
        res.meta.update(label=_label(pr.hp, res.meta["graph"], parts, stagger), builder=cid[1], stagger=stagger)
        return [list(cid), res.total_s, res.comm_s, res.compute_s, res.bytes, res.rounds, pr.hp.kv_plan is not None,
                {m: res.meta.get(m) for m in _SHARED_META}]

    def take(parts: list) -> None:
        for r, part in enumerate(parts):
            for entry in part:
                if entry[0] == "follow-up floor":   # [tag, degree, graph, floor]
                    follow_up_floors[(entry[1], entry[2])] = entry[3]
                    continue
                cid = tuple(entry[0])
                if len(entry) == 4:       # [candidate, floor, KV stage, packed]: compiled, not priced
                    floors[cid], kv_stage[cid], owner[cid] = entry[1], entry[2], r
                    if entry[3]:
                        packed.add(cid)
                    continue
                _, total, comm, compute, nbytes, rounds, stage, meta = entry
                priced[cid] = SimResult("fcp", comm, compute, total, nbytes, rounds, meta=dict(meta))
                kv_stage[cid] = stage
                floors.pop(cid, None)

    def bases(a: int) -> list[tuple]:  # the graphs a degree's follow-ups may build on
        return [(a, g, "base", 0) for x, g in order if x == a and (a == 1 or kv_stage.get((a, g, "base", 0)))]

    def base_bound(a: int) -> float:   # a base candidate above this cannot be its degree's best graph
        t = [priced[c].total_s for c in bases(a) if c in priced]
        return min(t) * (1 + _TIE) if prune and t else math.inf

    def base_graph(a: int) -> str | None:   # the degree's best graph, once no other can be
        if any(c in floors and floors[c] <= base_bound(a) for c in bases(a)):
            return None
        best = [(priced[c], None) for c in bases(a) if c in priced]
        return pick_best(best, objective)[0].meta["builder"] if best else None

    def real() -> list[tuple]:  # the full search's candidates compiled so far: bases, follow-ups on the best graph
        base = {a: base_graph(a) for a in degrees if ups(a)}
        return [c for c in list(priced) + list(floors) if c[2] == "base" or c[1] == base.get(c[0])]

    def second_best() -> float:   # Note [Pruning the search]: no candidate above this can be chosen or runner-up
        t = sorted(priced[c].total_s for c in real() if c in priced)[:2]
        return t[1] * (1 + _TIE) if prune and len(t) == 2 else math.inf

    follow_up_floors: dict[tuple[int, str], float] = {}   # gathered in round 1 (_follow_up_floor)

    def follow_up_floor(a: int, g: str) -> float:
        return follow_up_floors[(a, g)]

    def jobs() -> list[tuple[str, tuple]]:
        """This round's work, cheapest kind first: follow-ups on known best graphs compiled; else
        follow-ups on every graph that may be the best compiled (probes: their floors say whether
        the best graph matters); else the candidates that may still win, or be the best graph
        that follow-ups which may win build on: their waves packed for a tighter floor, then
        priced."""
        if not priced and not floors:
            return [("compile", (a, g, "base", 0)) for (a, g) in order]
        bound = second_best()
        known, probes, packs, price = [], [], [], []
        for a in sorted(degrees, key=lambda a: a == 1):
            if not ups(a):
                continue
            g = base_graph(a)
            if g is not None:
                if not prune or bound == math.inf or follow_up_floor(a, g) <= bound:
                    known += [("compile", c) for f in ups(a) if (c := (a, g, *f)) not in priced and c not in floors]
                continue
            may = [c for c in bases(a) if (priced[c].total_s if c in priced else floors[c]) <= base_bound(a)]
            need = False
            for c in (c for c in may if bound == math.inf or follow_up_floor(a, c[1]) <= bound):   # its follow-ups may win
                for f in ups(a):
                    p = (a, c[1], *f)
                    if p not in priced and p not in floors:
                        probes.append(("compile", p))
                    elif (priced[p].total_s if p in priced else floors[p]) <= bound:
                        if p in floors and p not in packed and p[2] != "parts_per_chunk":
                            packs.append(p)       # its waves' floor may still rule it out
                        else:   # sub-blocks: dearer to pack than the bases are to price, which settle the graph
                            need = True
            if need:
                price += [("price", c) for c in may if c in floors]
        price += [("price", c) for c in real() if c in floors and floors[c] <= bound]
        price = list(dict.fromkeys(price))
        packs = list(dict.fromkeys(packs + [c for _, c in price if c not in packed]))
        bases_first = [c for c in packs if c[2] == "base"]   # a base's packed floor may make its probes moot
        return known or probes or [("pack", c) for c in (bases_first or packs)] or price

    while todo := jobs():
        bound = second_best()
        cheap = [j for j in todo if j[0] == "compile"]
        takers = _deal_cheap(len(cheap), share.size, dealt[0], {owner[c] for c in floors})
        dealt[0] += len(cheap)
        out = []
        for (_, cid), r in zip(cheap, takers):
            if r != share.rank:
                continue
            pr = compile_(cid)
            if prune and cid[2] == "base" and ups(cid[0]):   # computed once, by the rank compiling the graph
                out.append(["follow-up floor", cid[0], cid[1],
                            _follow_up_floor(topo, ranks, padded, cid[0], cid[1], causal, dkw)])
            # cheap: priced now (a chain's steps can be many: not where its floor rules it out)
            if not prune or pr.hp.kv_plan is None or (pr.chain() and pr.tight_floor() <= bound):
                out.append(summary(cid, pr))
            else:
                kept[cid] = pr
                out.append([list(cid), pr.tight_floor(), True, not pr.packs()])
        dear = [j for j in todo if j[0] != "compile"]
        owners = [owner[c] for _, c in dear]    # a priced candidate's waves are packed on its owner: it stays there
        doers = _deal_dear(owners, share.size, dealt[0]) if dear and dear[0][0] == "pack" else owners
        for (kind, cid), r in zip(dear, doers):
            if r != share.rank:
                if owner[cid] == share.rank and r != owner[cid]:
                    kept.pop(cid, None)                  # moved to an idle rank, which compiles it again
                continue
            pr = kept[cid] if cid in kept else compile_(cid)   # moved here: compiled again
            if kind == "pack":
                kept[cid] = pr
                out.append([list(cid), pr.packed_floor(), True, True])
            else:
                kept.pop(cid, None)
                out.append(summary(cid, pr))
        take(share.gather(out))
    place = {(a, g, "base", 0): k for (a, g), k in order.items()}   # the full search's order
    for a in degrees:
        g = base_graph(a) if ups(a) else None
        for k, opt, v in (_follow_up_slots(len(order), degrees, a, ups(a)) if g is not None else ()):
            place[(a, g, opt, v)] = k
    return [(priced[c], None) for c in sorted((c for c in priced if c in place), key=place.get)]


def _deal_cheap(n: int, size: int, start: int, holders: set[int]) -> list[int]:
    """The rank that compiles each of a round's ``n`` compile jobs: in turn from ``start`` (each
    round begins where the last one's compile jobs left off), first over the ranks that hold no
    compiled candidate still to pack or price (``holders``: their dear work may come next), then
    over all ranks in the same turn. The same on every rank."""
    turn = [(start + i) % size for i in range(size)]
    free = [r for r in turn if r not in holders]
    return [free[i] if i < len(free) else turn[(i - len(free)) % size] for i in range(n)]


def _deal_dear(owners: list[int], size: int, start: int) -> list[int]:
    """The rank that packs each candidate of a pack round (``owners``: the rank that compiled
    each): a rank's first stays with it; its further ones go, in turn, to the ranks that own none
    this round (counted from ``start``: each round begins where the compile jobs left off), which
    compile the candidate again (a fraction of packing it) and own it from then on; once every
    such rank has one, to the owner. The same on every rank."""
    busy = set(owners)
    idle = [r for r in ((start + i) % size for i in range(size)) if r not in busy]
    seen: set[int] = set()
    out = []
    for o in owners:
        if o in seen and idle:
            out.append(idle.pop(0))
        else:
            seen.add(o)
            out.append(o)
    return out


def _follow_up_floor(topo: Topology, ranks: tuple, padded: AttentionShape, a: int, g: str, causal: bool,
                     dkw: dict) -> float:
    """A floor on every follow-up of degree ``a`` on graph ``g`` (any stagger or sub-blocks) before
    any is compiled: the degree's (:func:`~megatron_fcp.cost.head_parallel.degree_floor`), for
    ``a = 1`` with the graph's own KV floor (:func:`~megatron_fcp.cost.floors.graph_kv_floor`: a
    graph entering each node at one rank is held to its NIC)."""
    kv_s = None
    if a == 1 and len(ranks) > 1:
        kv_s = graph_kv_floor(get_builder(g).build(topo, ranks), topo, padded.seq_len, causal, padded.kv_bytes(1))
    return head_parallel_degree_floor(topo, ranks, padded, a, kv_s=kv_s, **dkw)


def _search(topo: Topology, ranks: tuple, padded: AttentionShape, degrees: list[int], graphs: list[str],
            fixed_parts: int, parts_auto: bool, min_block_tokens: int, causal: bool, objective: str, kw: dict,
            prune: bool, window: tuple[int, int] = (-1, -1)) -> list[tuple[SimResult, HeadParallelPlan]]:
    """The candidates of Note [Choosing the head-parallel degree] in their order (every degree's
    graphs, then every degree's staggers, then ``a = 1``'s sub-blocks); ``prune``: only those a
    floor does not rule out (Note [Pruning the search])."""
    cp = len(ranks)

    def whole(a: int) -> bool:
        return a == cp or len(ranks) // a == 1

    def pricing(a: int, g: str, **opts) -> HeadParallelPricing:
        hp = compile_head_parallel(topo, ranks, padded, a, g, causal=causal, window=window, **opts)
        return HeadParallelPricing(hp, topo, padded, one_pass=not prune, **kw)

    done: dict[int, tuple[SimResult, HeadParallelPlan]] = {}   # order in the full search -> candidate
    degree_floor: dict[int, float] = {}

    def keep(order: int, pr: HeadParallelPricing, builder: str, parts: int, stagger: int) -> None:
        res = pr.result()
        res.meta.update(label=_label(pr.hp, res.meta["graph"], parts, stagger), builder=builder, stagger=stagger)
        done[order] = (res, pr.hp)

    def second_best() -> float:   # no candidate above (1 + 0.1%) of this can be chosen or be the runner-up
        t = sorted(r.total_s for r, _ in done.values())[:2]
        return t[1] * (1 + _TIE) if prune and len(t) == 2 else math.inf

    def best_of(a: int) -> float:  # ... nor be within pick_best's tie of its degree's best (the stagger base)
        t = [r.total_s for r, hp in done.values() if hp.degree == a]
        return min(t) * (1 + _TIE) if prune and t else math.inf

    chunk = padded.seq_len // (2 * cp)

    def follow_ups(a: int) -> list[tuple[str, int]]:  # candidates built later on this degree's best graph
        return _follow_ups(a, cp, parts_auto, chunk, min_block_tokens)

    later: dict[tuple[int, str, str, int], HeadParallelPricing] = {}
    settled: set[int] = set()     # degrees none of whose follow-ups can win, whatever their base graph

    def follow_up(a: int, g: str, opt: str, v: int) -> HeadParallelPricing:
        if (a, g, opt, v) not in later:
            later[(a, g, opt, v)] = pricing(a, g, **{opt: v})
        return later[(a, g, opt, v)]

    def below(pr: HeadParallelPricing, packed: bool = False) -> bool:
        """Not ruled out: its floor, then its tighter floor (``packed``: then its waves' floor)."""
        return pr.floor() <= second_best() and pr.tight_floor() <= second_best() and \
            (not packed or pr.packed_floor() <= second_best())

    def can_be_base(a: int, g: str) -> bool:  # within pick_best's tie of the degree's best priced so far
        k = order[(a, g)]
        lo = done[k][0].total_s if k in done else priced[k].known_floor() if k in priced else floors.get(k, 0.0)
        return lo <= best_of(a)

    graph_floors: dict[tuple[int, str], float] = {}

    def graph_floor(a: int, g: str) -> float:
        """A floor on every plan of degree ``a`` with KV-stage graph ``g`` (any sub-blocks or
        stagger), before any is compiled: the degree's, for ``a = 1`` with the graph's own KV floor
        (:func:`~megatron_fcp.cost.floors.graph_kv_floor`: a graph entering each node at one
        rank is held to its NIC)."""
        if (a, g) not in graph_floors:
            graph_floors[(a, g)] = _follow_up_floor(topo, ranks, padded, a, g, causal, dkw) \
                if a == 1 and len(ranks) > 1 else degree_floor[a]
        return graph_floors[(a, g)]

    def base_matters(a: int) -> bool:
        """Whether the follow-ups of degree ``a`` need its exact best graph: some follow-up on
        some graph is not ruled out by its floor (once none is, that stays so)."""
        if a in settled or not follow_ups(a):
            return False
        if degree_floor[a] <= second_best():
            for x, g in order:
                if x == a and can_be_base(a, g) and graph_floor(a, g) <= second_best() and \
                        any(below(follow_up(a, g, *f)) for f in follow_ups(a)):
                    return True
        settled.add(a)
        return False

    # Every degree's graphs, most promising first: a degree is compiled only once its floor is the
    # least left, a candidate's backward priced only once its floor (its forward priced) is.
    order = _base_order(ranks, degrees, graphs)
    n = len(order)
    dkw = {k: kw[k] for k in ("pass_", "causal", "compute_model", "round_overhead_s", "backward")}
    heap: list[tuple[float, int, int, str]] = []               # (floor, order, degree, graph or "" = the degree)
    for a in dict.fromkeys(a for a, _ in order):
        degree_floor[a] = head_parallel_degree_floor(topo, ranks, padded, a, **dkw) if prune else 0.0
        heap.append((degree_floor[a], min(v for (x, _), v in order.items() if x == a), a, ""))
    heapq.heapify(heap)
    priced: dict[int, HeadParallelPricing] = {}
    floors: dict[int, float] = {}     # a candidate not compiled yet: its graph's floor
    step: dict[int, int] = {}         # how far its floor is refined: 0 its graph's, 1 compiled, 2 tight
    while heap:
        f, i, a, g = heapq.heappop(heap)
        if not g:  # a degree: its graphs' floors (a = 1: each graph's own), unless none can win
            if f > second_best():
                continue
            for (x, name), k in order.items():
                if x == a:
                    floors[k] = max(f, graph_floor(a, name)) if prune else 0.0
                    step[k] = 0
                    heapq.heappush(heap, (floors[k], k, a, name))
            continue
        if prune and f > second_best():
            # it cannot win, but it may be its degree's best graph, on which the follow-ups are built.
            # A chain whose program is compiled is cheap to price, and bounds its degree's best
            # graph: when none of its degree is priced it is, rather than compiling the follow-ups of
            # every graph to see whether the base matters
            cheap = step[i] == 2 and priced[i].chain() and math.isinf(best_of(a))
            if f > best_of(a) or not (cheap or base_matters(a)):
                continue
            if cheap:
                keep(i, priced.pop(i), g, fixed_parts if a == 1 else 1, 1)
                continue
        if step[i] == 0:    # compile it and price its forward
            priced[i] = pricing(a, g, parts_per_chunk=fixed_parts if a == 1 else 1)
            step[i] = 1
            if prune:
                heapq.heappush(heap, (priced[i].floor(), i, a, g))
                continue
        if prune and step[i] == 1:   # its tighter floor, in its place in the order
            step[i] = 2
            heapq.heappush(heap, (priced[i].tight_floor(), i, a, g))
            continue
        if prune and step[i] == 2 and priced[i].packs():   # waves: packed, their loop's floor
            step[i] = 3
            heapq.heappush(heap, (priced[i].packed_floor(), i, a, g))
            continue
        keep(i, priced.pop(i), g, fixed_parts if a == 1 else 1, 1)
    # then each degree's follow-ups on its best graph: a > 1 staggered, a = 1 cut into sub-blocks
    # (p need not divide the chunk: parts of floor/ceil size, Note [Sub-block sizes])
    for a in sorted(degrees, key=lambda a: a == 1):
        mine = [done[k] for k in sorted(done) if done[k][1].degree == a and (a == 1 or done[k][1].kv_plan is not None)]
        if not mine or not follow_ups(a) or (prune and (a in settled or degree_floor[a] > second_best())):
            continue
        best_res, _ = pick_best(mine, objective)
        for k, opt, v in _follow_up_slots(n, degrees, a, follow_ups(a)):
            pr = follow_up(a, best_res.meta["builder"], opt, v)
            if not prune or below(pr, packed=True):
                keep(k, pr, best_res.meta["builder"], v if opt == "parts_per_chunk" else 1, v if opt == "stagger" else 1)
    return [done[k] for k in sorted(done)]


def _base_order(ranks: tuple, degrees: list[int], graphs: list[str]) -> dict[tuple[int, str], int]:
    """(degree, graph) -> its place in the full search's order: every degree's graphs (one graph
    where the degree is the whole group: no KV stage)."""
    cp, order = len(ranks), {}
    for a in degrees:
        for g in (graphs[:1] if a == cp or cp // a == 1 else graphs):
            if cp == 1 and g != "ring":
                continue
            order[(a, g)] = len(order)
    return order


def _follow_ups(a: int, cp: int, parts_auto: bool, chunk: int, min_block_tokens: int) -> list[tuple[str, int]]:
    """Degree ``a``'s follow-ups, built on its best graph: ``a > 1`` staggered over 2, 4, 8 rounds
    (at most ``2 * a``; none where the degree is the whole group), ``a = 1`` cut into 2, 4, 8
    sub-blocks of at least ``min_block_tokens``; none unless the parts are chosen."""
    if not parts_auto or (a > 1 and (a == cp or cp // a == 1)):
        return []
    if a > 1:
        return [("stagger", st) for st in (2, 4, 8) if st <= 2 * a]
    return [("parts_per_chunk", p) for p in (2, 4, 8) if chunk // p >= min_block_tokens]


def _follow_up_slots(n: int, degrees: list[int], a: int, follow_ups: list[tuple[str, int]]) -> list[tuple[int, str, int]]:
    """``(place in the order, option, value)`` of degree ``a``'s follow-ups after the ``n`` base
    candidates: each degree > 1 three slots (staggers 2, 4, 8) in degree order, then ``a = 1``'s
    (sub-blocks 2, 4, 8)."""
    slot = n + (3 * len(degrees) if a == 1 else 3 * degrees.index(a))
    if a == 1:
        return [(slot + (2, 4, 8).index(v), opt, v) for opt, v in follow_ups]
    return [(slot + j, "stagger", st) for j, st in enumerate((2, 4, 8)) if ("stagger", st) in follow_ups]


_TIE = 1e-3
""":func:`~megatron_fcp.cost.model.pick_best`'s tie: totals within this fraction of the least are
compared by communication."""


def build_head_parallel_plan(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    degree: "int | str" = "auto",
    graph: str = "auto",
    parts_per_chunk: "int | str" = "auto",
    causal: bool = True,
    compute_model: ComputeModel | None = None,
    objective: str = "total",
    pass_: str = "fwd+bwd",
    round_overhead_s: float = 0.0,
    min_block_tokens: int = 256,
    grad_dtype_bytes: int | None = None,
    backward: WaveBackward | None = None,
) -> HeadParallelPlan:
    """A verified :class:`HeadParallelPlan` for the CP group ``cp_ranks`` on ``topology``.

    ``degree``: an int (must fit: :func:`head_parallel_degrees`) or ``"auto"``; ``graph``: the KV
    stage's builder name or ``"auto"``; ``parts_per_chunk``: sub-blocks for ``a = 1`` or ``"auto"``.
    With everything fixed the plan is compiled directly; otherwise every candidate is timed for
    ``pass_`` and the best by ``objective`` is returned, with ``auto`` recording each candidate's
    predicted seconds (Note [Choosing the head-parallel degree]). ``shape.seq_len`` is padded to a
    multiple of ``2 * cp`` as Megatron pads. ``backward``: price the backward as the executor runs
    it (a :class:`~megatron_fcp.schedule.program.WaveBackward`) instead of in one pass (None)."""
    if degree != "auto" and graph != "auto" and parts_per_chunk != "auto":
        topo = load_topology(topology)
        padded, _ = pad_for_zigzag(shape, len(check_cp_ranks(topo, cp_ranks)))
        return compile_head_parallel(topo, cp_ranks, padded, degree, graph, causal=causal,
                                     parts_per_chunk=parts_per_chunk)
    cands = head_parallel_candidates(topology, cp_ranks, shape, degree=degree, graph=graph,
                                     parts_per_chunk=parts_per_chunk, causal=causal, compute_model=compute_model,
                                     objective=objective, pass_=pass_, round_overhead_s=round_overhead_s,
                                     min_block_tokens=min_block_tokens, grad_dtype_bytes=grad_dtype_bytes,
                                     backward=backward)
    _, best = pick_best(cands, objective)
    metric = "total_s" if objective == "total" else "comm_s"
    return _with_auto(best, tuple((r.meta["label"], getattr(r, metric)) for r, _ in cands))


def choose_head_parallel(topology: "Topology | str", cp_ranks: Sequence[int], shape: AttentionShape,
                         causal: bool = True, grad_dtype_bytes: int | None = None,
                         backward: WaveBackward | None = None) -> HeadParallelPlan:
    """Degree, graph and block size chosen by predicted forward+backward time at the default
    compute model (Note [Choosing the head-parallel degree]). ``grad_dtype_bytes``: the dK/dV
    partials' bytes per element (default ``shape.dtype_bytes``: the executor returns them in the
    input dtype, as TE's ring returns dKV). ``backward``: None
    prices the one-pass backward from kept KV (the benchmarks' model); the Megatron runtime calls
    :func:`choose_schedule` with the backward it will run."""
    return build_head_parallel_plan(topology, cp_ranks, shape, causal=causal, grad_dtype_bytes=grad_dtype_bytes,
                                    backward=backward)


@dataclass(frozen=True)
class ScheduleChoice:
    """What :func:`choose_schedule` chose: ``plan`` (over the CP ranks it was asked for; ``auto``:
    the predicted seconds of every candidate priced, Note [Pruning the search]), its head-parallel ``degree``, the KV-stage ``graph`` (a
    builder name; for ``a = cp`` there is no stage and it is unused), ``parts`` per zigzag chunk
    (``a = 1``), ``stagger`` (``a > 1``), the predicted ``total_s`` = ``fwd_s`` + ``bwd_s`` and the
    ``backward_kv`` mode they were priced with (None: the one-pass model), ``seq_len`` (padded as
    Megatron pads), ``runner_up``: the best other candidate as ``(label, total_s)``, or None, and
    ``backward_form``: ``"chain"`` where the KV stage is a ring whose backward streams (Note
    [Streaming chain backward] in schedule/chains.py), ``"waves"`` otherwise (None: one pass)."""

    plan: HeadParallelPlan
    degree: int
    graph: str
    parts: int
    stagger: int
    label: str
    total_s: float
    fwd_s: float
    bwd_s: float
    backward_kv: str | None
    seq_len: int
    runner_up: tuple[str, float] | None = None
    backward_form: str | None = None   # "chain" (a ring's streaming backward) or "waves"; None: one pass

    def describe(self) -> str:
        """One line: the choice, its predicted time and the runner-up's."""
        form = "streamed hop by hop" if self.backward_form == "chain" else "in waves"
        kv = f", backward {self.backward_kv} {form}" if self.backward_kv else ""
        up = f"; runner-up {self.runner_up[0]} {self.runner_up[1] * 1e3:.4g} ms" if self.runner_up else ""
        return (f"{self.label}: predicted fwd+bwd {self.total_s * 1e3:.4g} ms (fwd {self.fwd_s * 1e3:.4g} + bwd "
                f"{self.bwd_s * 1e3:.4g}{kv}){up}")


def choose_schedule(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    degree: "int | str" = "auto",
    graph: str = "auto",
    parts_per_chunk: "int | str" = "auto",
    causal: bool = True,
    grad_dtype_bytes: int | None = None,
    backward: WaveBackward | None = None,
    compute_model: ComputeModel | None = None,
    window: tuple[int, int] | None = None,
    share: SearchShare | None = None,
) -> ScheduleChoice:
    """The Megatron runtime's entry point: :func:`head_parallel_candidates` under the given
    constraints (``degree``, ``graph``, ``parts_per_chunk``: fixed values or ``"auto"``), timed
    forward + backward (``backward``: as the executor will run it), the best by predicted total
    (:func:`~megatron_fcp.cost.model.pick_best`), as a :class:`ScheduleChoice`; candidates a
    floor rules out are not priced (Note [Pruning the search]). The same plan as
    :func:`build_head_parallel_plan` with the same arguments. Pure: every rank gets the same answer.
    Raises ValueError when a fixed ``degree`` does not fit the topology and head counts.
    ``window``: a sliding-window layer's ``(left, right)``: its own plan (degree 1, need sets and work
    of the window; Note [Windowed need sets]). ``share``: this process's part of the search split
    over several that all call this with the same arguments (Note [Sharing the search]): the same
    answer, every candidate priced by one of them."""
    with gc_paused():   # its waves, timelines and floors are short-lived objects: no collector sweeps over them
        cands = head_parallel_candidates(topology, cp_ranks, shape, degree=degree, graph=graph,
                                         parts_per_chunk=parts_per_chunk, causal=causal, compute_model=compute_model,
                                         grad_dtype_bytes=grad_dtype_bytes, backward=backward, prune=True,
                                         window=window, share=share)
        res, hp = pick_best(cands, "total")
        if hp is None:  # a shared search: the winner's plan, compiled as its pricing compiled it
            topo = load_topology(topology)
            hp = compile_head_parallel(topo, check_cp_ranks(topo, cp_ranks), pad_for_zigzag(shape, len(cp_ranks))[0],
                                       res.meta["head_parallel"], res.meta["builder"], causal=causal,
                                       window=Mask.of(causal, window).window,
                                       **({"parts_per_chunk": res.meta["parts_per_chunk"]}
                                          if res.meta["head_parallel"] == 1 else {"stagger": res.meta["stagger"]}))
    others = [c for c in cands if c[0] is not res]
    up = pick_best(others, "total")[0] if others else None
    return ScheduleChoice(
        plan=_with_auto(hp, tuple((r.meta["label"], r.total_s) for r, _ in cands)), degree=hp.degree,
        graph=res.meta["builder"], parts=res.meta["parts_per_chunk"], stagger=res.meta["stagger"],
        label=res.meta["label"], total_s=res.total_s, fwd_s=res.meta["fwd_total_s"], bwd_s=res.meta["bwd_total_s"],
        backward_kv=res.meta.get("backward_kv") if backward is not None and hp.kv_plan is not None else None,
        seq_len=pad_for_zigzag(shape, hp.cp)[0].seq_len,
        runner_up=None if up is None else (up.meta["label"], up.total_s),
        backward_form=res.meta.get("backward_form") if backward is not None and hp.kv_plan is not None else None)


def _with_auto(hp: HeadParallelPlan, auto: tuple) -> HeadParallelPlan:
    return replace(hp, auto=auto)


def _ingress(topo: Topology, r: int, multi_node: bool) -> float:
    return topo.gpu_ingress_bandwidth(r) if multi_node else intra_ingress(topo, r)


def _stage_bound(topo: Topology, hp: HeadParallelPlan, shape: AttentionShape, causal: bool,
                 elem_bytes: int) -> float:
    """Need-set bound of the KV stage (all ``a`` stages at once), ``elem_bytes`` per K/V element."""
    sp = stage_plan(hp, shape.seq_len, causal)
    pl = sp.placement
    sshape = stage_shape(hp, shape)
    per_tok = sshape.kv_token_elems * elem_bytes
    need = pl.need_matrix()                                           # [cp, blocks]
    tok = pl.block_tokens().astype(np.float64)
    owner = pl.block_owners()
    node_of = np.array([topo.node_of(r) for r in sp.ranks])
    multi = len(set(node_of.tolist())) > 1
    recv = (need * tok[None, :]).sum(axis=1) * per_tok
    t = max(float(recv[i]) / _ingress(topo, r, multi) for i, r in enumerate(sp.ranks))
    if multi:
        for x in set(node_of.tolist()):
            into = (need[node_of == x].any(axis=0) & (node_of[owner] != x))
            b_in = member_nic_ingress(topo, [r for r, m in zip(sp.ranks, node_of == x) if m])
            t = max(t, float((into * tok).sum()) * per_tok / b_in)
    return t


def lower_bound_all(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    causal: bool = True,
    pass_: str = "fwd",
    grad_dtype_bytes: int | None = None,
) -> dict:
    """Lower bound over every family compared (KV distribution and head-parallel of every degree);
    see Note [Lower bound over schedule families]. Returns ``lower_bound_s``, ``degree`` (the family
    attaining it), ``per_degree`` (each family's bound) and the KV-only bound's ingredients
    (``S``, ``N``, ``n``, ``B_gpu``, ``B_out``, ``causal``) as :func:`lower_bound`."""
    check_pass(pass_)
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    shape, _ = pad_for_zigzag(shape, len(ranks))
    kv_only = lower_bound(topo, ranks, shape, causal=causal)
    grad_dtype_bytes = grad_dtype_bytes or shape.dtype_bytes  # the least any compared schedule sends
    grad_ratio = grad_dtype_bytes / shape.dtype_bytes
    per_degree: dict[int, float] = {}
    for a in head_parallel_degrees(topo, ranks, shape.heads, shape.kv_heads):
        if a == 1:
            f = kv_only["lower_bound_s"]
            t = {"fwd": f, "bwd": f * grad_ratio, "fwd+bwd": f * (1 + grad_ratio)}[pass_]
        else:
            hp = compile_head_parallel(topo, ranks, shape, a, "full", causal=causal)
            b = min(intra_ingress(topo, r) for r in ranks)  # head groups sit inside nodes: NVLink/PCIe
            t_big = (a - 1) * a2a_messages(hp, shape, "qkv")[0][2] / b
            t_small = (a - 1) * a2a_messages(hp, shape, "q")[0][2] / b
            stage_f = _stage_bound(topo, hp, shape, causal, shape.dtype_bytes) if hp.kv_plan is not None else 0.0
            stage_b = _stage_bound(topo, hp, shape, causal, grad_dtype_bytes) if hp.kv_plan is not None else 0.0
            # Q's part of the first all-to-all may hide behind the stage, dQ's part of the last one
            # behind the stage's last sums (Notes [Q's all-to-all behind the KV stage], [dQ's all-to-all
            # ahead of dK|dV's])
            t_kv = t_big - t_small if hp.kv_plan is not None else t_big
            t = {"fwd": t_kv + stage_f + t_small, "bwd": t_small + stage_b + t_kv,
                 "fwd+bwd": 2 * t_kv + 2 * t_small + stage_f + stage_b}[pass_]
        per_degree[a] = t
    best = min(per_degree, key=per_degree.get)
    return {**kv_only, "lower_bound_s": per_degree[best], "degree": best, "per_degree": per_degree,
            "kv_only_s": per_degree.get(1), "pass": pass_}
