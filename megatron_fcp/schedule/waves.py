"""Waves of a plan's block deliveries for the wave-by-wave backward (Note [Backward waves] in
:mod:`megatron_fcp.attention.backward_waves`). Pure data, no ``torch``: the executor and the cost
model (:mod:`megatron_fcp.cost.backward`) split a plan the same way.

A *delivery* is one rank computing one block's gradient: a block it needs, or one of its own. A
wave is a set of deliveries and the plan transfers that bring them: for a received block, the path
of the plan's transfers from its owner to the reader (relays included). A block may go to some of
its readers in one wave and to others later (its reduction tree is then cut into subtrees, one per
wave; the owner adds their sums in wave order).

:func:`plan_waves` packs deliveries greedily, wave after wave, blocks in the order the plan first
sends them and readers in plan order. A delivery joins the wave while

* every rank on its path receives at most ``budget`` bytes in the wave (default
  :func:`wave_budget`, the largest shard's K and V: two waves alive at once hold two shards,
  the two KV buffers Transformer Engine's ring backward allocates beside its saved KV), and
* the reader's gradient work in the wave (query-key pairs) stays within the largest single
  delivery's (so every rank computes about the same per wave: with sub-blocks, ranks whose
  queries see a block fully take fewer blocks per wave than ranks that see half of it).

A relay on the path that needs the block computes it there too when its work allows. The first
delivery of a wave always fits (a block larger than the budget forms a wave of its own). Local
blocks fill each rank's spare work. :func:`restrict` is the plan cut to one wave.

Note [Balanced waves]
---------------------
Waves run in turn, so the backward's compute is about the *makespan* sum over waves of the busiest
rank's work in the wave, not the busiest rank's total. A tight work cap keeps ranks in step but, on
a packed batch (blocks of very different work), strands a few ranks' last deliveries in nearly
empty waves; where every rank's need set fits the byte budget anyway, the cap alone creates waves.
With fine sub-blocks it starves the communication instead: at 8 parts per chunk a rank takes one
or two small blocks per wave against a budget of eight, and every wave pays its reduction's rounds
(a 1x cap on fine sub-blocks gives one wave per block or two). So :func:`plan_waves` packs with the cap at 1x, 2x, 4x and
unbounded times the largest delivery (:data:`WAVE_CAP_SCALES`) and keeps the least *pace*: the sum
over waves of the larger of the busiest rank's work and the most bytes a rank receives in the wave,
each relative to the whole backward's (1.0: every wave as balanced as the one pass); among paces
within 1% (:data:`WAVE_TIE`), the fewest waves. The byte budget binds every candidate alike, so no
candidate holds more received KV than another; which cap wins depends on the plan (fine sub-blocks
and packed batches loosen it, zigzag plans with whole chunks keep the tight one). A cap that never
turned a job away packs exactly as every larger one (each comparison with the cap came out the
same), so the caps are tried in increasing order and the first such packing stands for the rest. The choice reads
only the plan and
block sizes, so every rank and the cost model make it alike.

*Spread over the waves the bytes need.* Where a rank's need set is many times the budget, the
waves are as many as that rank's bytes need, while a delivery is coarse (a rank's every query of a
document against one block: at cp = 256, GQA 64:8, a = 8, 32K-token documents, one delivery is 14%
of the busiest rank's work and its need set 23 budgets). Every cap of at least one delivery then
lets ranks with little to receive do their work in the first waves at several times the per-wave
share, and the waves after them run the needy ranks' deliveries, so the sum over waves of the
busiest rank's work is 2.3x its total. :func:`_spread_scale` gives one more cap, the busiest rank's
work over the waves the most received bytes need at the budget, below one delivery; the packing
it gives is run when its pace is below the others' best by :data:`WAVE_SPREAD_MARGIN` (its extra
waves each pay a reduction's latency, which the pace does not count). In that cell it took pace
from 2.40 to 1.88 and the backward, as :func:`~megatron_fcp.cost.timeline.wave_timeline` prices
it, from 52.0 to 37.0 ms; on the emulated packed batch (2x4, 8K tokens) its pace was 1.1% below
the capped packing's and its priced step 3% longer, so a packing with more waves must win by more
than a tie.

Whether the waves re-send KV or start from what the forward kept is :func:`choose_backward_kv`'s
(Note [Backward KV modes] in :mod:`megatron_fcp.schedule.program`); it reads only the plan, so
the planner decides it as every rank does; :func:`~megatron_fcp.schedule.program.compile_backward`
makes that and every other backward decision once (Note [Backward program]).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, Collection, Hashable, Mapping, Sequence

import numpy as np

from megatron_fcp.contract.blocks import Block, Transfer
from megatron_fcp.contract.needs import block_pairs
from megatron_fcp.contract.plan import Plan

__all__ = ["Wave", "plan_waves", "wave_budget", "restrict", "first_fetch", "leading_own_jobs", "loop_jobs",
           "block_work",
           "BACKWARD_KV_MODES",
           "RING_BUDGET", "kept_bytes_per_rank", "choose_backward_kv"]


@dataclass(frozen=True)
class Wave:
    """Deliveries handled together in backward and the plan transfers that carry them."""

    transfers: tuple[tuple[int, Transfer], ...]   # (plan round, transfer), in plan order
    computes: frozenset                           # (block, rank): rank computes block's gradient here
    rounds: tuple[int, ...] = field(init=False)   # ascending plan rounds with a transfer of the wave
    _tset: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rounds", tuple(sorted({r for r, _ in self.transfers})))
        object.__setattr__(self, "_tset", frozenset(self.transfers))

    def has(self, round_index: int, t: Transfer) -> bool:
        """Whether the wave carries transfer ``t`` of plan round ``round_index``."""
        return (round_index, t) in self._tset


def leading_own_jobs(n_own: int, n_waves: int) -> int:
    """How many of a rank's ``n_own`` own jobs in the first wave run first, while the first wave's KV
    arrives (Note [Backward waves] in :mod:`megatron_fcp.attention.backward_waves`); the rest run
    last, while the last reduction returns. With several waves all run first (later waves' jobs
    hide the reductions); a single wave's reduction has nothing after it but what is left of the
    own jobs, so half of them (rounded up) run first and half last: the wave's reduction then
    overlaps the second half instead of running alone at the end."""
    return n_own if n_waves > 1 else (n_own + 1) // 2


def loop_jobs(plan: Plan, waves: Sequence[Wave]
              ) -> tuple[dict[int, list[list[Block]]], dict[int, int], dict[int, list[Block]]]:
    """Each rank's gradient jobs as the wave loop runs them, one kernel call each (the executor's
    :func:`~megatron_fcp.attention.backward_waves.run_backward_waves` runs these, the cost model's
    :func:`~megatron_fcp.cost.timeline.wave_timeline` prices them: Note [One launch per owner and
    stage] in :mod:`megatron_fcp.schedule.launches`): per wave, the received blocks in plan order
    then its own (wave 0: its own first); how many of wave 0's own jobs run first, while wave 0's
    KV arrives (:func:`leading_own_jobs`), and the rest, run after the last wave. Memoised per
    waves object (the program's)."""
    hit = _JOBS.get(id(waves))
    if hit is not None and hit[0] is waves and hit[1] is plan:
        return hit[2]
    ranks, W = list(plan.ranks), len(waves)
    jobs: dict[int, list[list[Block]]] = {x: [] for x in ranks}
    n_own = dict.fromkeys(ranks, 0)
    last: dict[int, list[Block]] = {x: [] for x in ranks}
    for w, wave in enumerate(waves):
        got: dict[int, list[Block]] = {}
        for _, t in wave.transfers:
            if (t.block, t.dst) in wave.computes:
                got.setdefault(t.dst, []).append(t.block)
        for x in ranks:
            own = [b for b in plan.local_blocks(x) if (b, x) in wave.computes]
            if w == 0:
                n_own[x] = leading_own_jobs(len(own), W)
                own, last[x] = own[:n_own[x]], own[n_own[x]:]
            jobs[x].append(own + got.get(x, []) if w == 0 else got.get(x, []) + own)
    if len(_JOBS) > 256:
        _JOBS.clear()
    _JOBS[id(waves)] = (waves, plan, (jobs, n_own, last))
    return jobs, n_own, last


_JOBS: dict[int, tuple] = {}


def wave_budget(plan: Plan, block_bytes: Callable[[Block], int]) -> int:
    """The largest shard's K and V bytes: the two waves alive at once (w computing, w+1 arriving)
    then hold what Transformer Engine's ring backward allocates for the same purpose, two buffers of
    one shard's KV (and dKV) beside the KV it saved (``AttnFuncWithCPAndKVP2P.backward``:
    ``p2p_comm_buffers``, read 2026-12-03). Before 2026-12-03 a wave held half a shard, which
    counted one of those buffers: the waves re-sent twice as often as that memory allows (packed
    cp = 256, 64:8, 32K median: backward 37.6 -> 31.2 ms at one shard; docs/planner.md, "Waves of
    a shard"). The one wave rule of the executor, the cost model and the emulator; the chains'
    sub-rounds use the same (:func:`~megatron_fcp.schedule.chains.chain_budget`)."""
    return max(sum(block_bytes(b) for b in plan.local_blocks(r)) for r in plan.ranks)


def block_work(plan: Plan) -> Callable[[int, Block], float]:
    """Query-key pairs of a rank's queries against a block (relative: zigzag at 64 tokens per
    sub-block), read from :func:`work_matrix`."""
    pos = {r: i for i, r in enumerate(plan.ranks)}
    rows = work_matrix(plan).tolist()                                   # [cp][blocks]
    col = _block_column(plan)
    return lambda rank, b: rows[pos[rank]][col(b)]


def work_matrix(plan: Plan) -> np.ndarray:
    """``[cp, n_blocks]`` float64, read-only: :func:`block_work` of every CP rank (CP order) against
    every block of ``plan.blocks()`` (columns ``offset[owner] + chunk * P + part``), one vectorised
    table per plan object: a placement's exact pairs
    (:meth:`~megatron_fcp.contract.placement.Placement.pair_matrix`), or a zigzag plan's relative
    pairs (:func:`zigzag_pairs`)."""
    hit = _WORK.get(id(plan))
    if hit is not None and hit[0]() is plan:
        return hit[1]
    if plan.placement is not None:
        out = plan.placement.pair_matrix().astype(np.float64)
    else:  # relative work: 64 tokens per sub-block; a windowed plan's own length (its window is in tokens)
        out = _zigzag_rows(plan, plan.seq_len if plan.mask.windowed else 2 * plan.cp * plan.parts_per_chunk * 64
                           ).astype(np.float64)
    out.flags.writeable = False
    if len(_WORK) > 256:
        _WORK.clear()
    _WORK[id(plan)] = (weakref.ref(plan), out)
    return out


_WORK: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def _block_column(plan: Plan) -> Callable[[Block], int]:
    """A block's column in :func:`work_matrix` (its place in ``plan.blocks()``)."""
    offset, P = {}, plan.parts_per_chunk
    at = 0
    for r in plan.ranks:
        offset[r] = at
        at += len(plan.local_blocks(r))
    return lambda b: offset[b.owner] + b.chunk * P + b.part


def zigzag_pairs(plan: Plan, seq_len: int) -> Callable[[int, Block], int]:
    """``pairs(rank, block)``: :func:`~megatron_fcp.contract.needs.block_pairs` of a zigzag plan's
    rank against one of its blocks for a ``seq_len``-token sequence under the plan's mask, read from
    one vectorised ``[cp, blocks]`` table (the same integers as the call per pair), built once per
    plan object and length."""
    key = (id(plan), seq_len)
    hit = _PAIRS.get(key)
    if hit is not None and hit[0]() is plan:
        return hit[1]
    pos = {r: i for i, r in enumerate(plan.ranks)}
    P = plan.parts_per_chunk
    rows = _zigzag_rows(plan, seq_len).tolist()                         # [cp][blocks]

    def pairs(rank: int, b: Block) -> int:   # plan.blocks() order: owner, chunk, part
        return rows[pos[rank]][(2 * pos[b.owner] + b.chunk) * P + b.part]

    if len(_PAIRS) > 256:
        _PAIRS.clear()
    _PAIRS[key] = (weakref.ref(plan), pairs)
    return pairs


_PAIRS: dict[tuple, tuple[weakref.ref, Callable[[int, Block], int]]] = {}


def _zigzag_rows(plan: Plan, seq_len: int) -> np.ndarray:
    """int64 ``[cp, blocks]``: block_pairs of every CP rank against every block of a zigzag plan."""
    pos = {r: i for i, r in enumerate(plan.ranks)}
    o, c, p = (np.array([f(b) for b in plan.blocks()], dtype=np.int64)[None, :]
               for f in (lambda b: pos[b.owner], lambda b: b.chunk, lambda b: b.part))
    return block_pairs(plan.cp, seq_len, plan.parts_per_chunk, np.arange(plan.cp)[:, None], o, c, p, plan.mask)


def plan_waves(plan: Plan, block_bytes: Callable[[Block], int], budget: int | None = None, *,
               cache_key: Hashable = None) -> tuple[Wave, ...]:
    """Split the plan's deliveries into waves (module docstring, Note [Balanced waves]). cache_key:
    what ``block_bytes`` depends on besides the plan; with it the waves are computed once per plan
    object and key."""
    key = (id(plan), budget, cache_key)
    hit = _WAVES.get(key)
    if cache_key is not None and hit is not None and hit[0]() is plan:
        return hit[1]
    if budget is None:
        budget = wave_budget(plan, block_bytes)
    inp = _PackInput(plan, block_bytes)
    cands: list[tuple[float, list]] = []      # (pace, raw packing): Waves are built for the winner only
    for k in WAVE_CAP_SCALES:                  # a cap that never turned work away: the larger ones pack alike
        raw, pace, capped = _pack_raw(inp, budget, k)
        cands.append((pace, raw))
        if not capped:
            cands += [(pace, raw)] * (len(WAVE_CAP_SCALES) - len(cands))
            break
    best = min(m for m, _ in cands)  # Note [Balanced waves]: least pace; near ties, fewest waves
    chosen = min((c for c in cands if c[0] <= best * (1 + WAVE_TIE)), key=lambda c: (len(c[1]), c[0]))[1]
    spread = _spread_scale(inp, budget)
    if spread is not None:           # Note [Balanced waves], "Spread over the waves the bytes need"
        spread_raw, pace, _ = _pack_raw(inp, budget, spread)
        if pace < best * (1 - WAVE_SPREAD_MARGIN):
            chosen = spread_raw
    waves = _waves(inp, chosen)
    if cache_key is not None:
        if len(_WAVES) > 1024:
            _WAVES.clear()
        _WAVES[key] = (weakref.ref(plan), waves)
    return waves


def _spread_scale(inp: "_PackInput", budget: int) -> float | None:
    """The work cap, in units of the largest single delivery, that spreads the busiest rank's work
    evenly over the waves the most bytes a rank receives need at ``budget`` per wave; None when
    that is not below one delivery (the caps of :data:`WAVE_CAP_SCALES` cover it)."""
    if inp.top <= 0:
        return None
    scale = inp.work_all / (-(-inp.bytes_all // max(budget, 1)) * inp.top)
    return scale if scale < WAVE_CAP_SCALES[0] else None


def _makespan(waves: tuple[Wave, ...], work: Callable[[int, Block], float]) -> float:
    """Sum over waves of the busiest rank's gradient work in it (the waves' compute, run in turn)."""
    total = 0.0
    for wave in waves:
        comp: dict[int, float] = {}
        for b, x in wave.computes:
            comp[x] = comp.get(x, 0.0) + work(x, b)
        total += max(comp.values(), default=0.0)
    return total


class _PackInput:
    """What every packing of one plan reads, numbered once (the four work caps of
    :func:`plan_waves` share it): blocks by their column in :func:`work_matrix` (``plan.blocks()``
    order), the blocks with readers in the order the plan first sends them (``order``), each
    (block, reader)'s arriving transfer (its index in plan order and its sender), readers in plan
    order, each rank's needs (flags, counts, and least work / fewest bytes first) and own blocks,
    block bytes and the work of every delivery (flat tables indexed ``block * span + rank``); and
    what a pace is relative to (Note [Balanced waves]): the busiest rank's total work, the most
    bytes a rank receives. The (block, reader) tables come from the plan's transfer columns (numpy),
    not from a Python loop over every transfer."""

    def __init__(self, plan: Plan, block_bytes: Callable[[Block], int]):
        self.plan = plan
        ranks = list(plan.ranks)
        self.span = R = max(ranks) + 1                             # (block i, rank x) is the key i * R + x
        self.blocks = blocks = list(plan.blocks())                 # block number = its work_matrix column
        col = _block_column(plan)
        _, src, dst, owner, chunk, part = plan.transfer_columns()     # [T] each, plan order
        at = np.zeros(R, dtype=np.int64)                           # global rank -> its first column
        at[ranks] = [col(plan.local_blocks(x)[0]) if plan.local_blocks(x) else 0 for x in ranks]
        c = at[owner] + chunk * plan.parts_per_chunk + part        # [T]: each transfer's block number
        key = c * R + dst
        _, first = np.unique(key, return_index=True)               # each (block, reader)'s arriving transfer
        first.sort()                                               # plan order
        fk, fc, fd, fs = key[first].tolist(), c[first].tolist(), dst[first].tolist(), src[first].tolist()
        self.arrive: dict[int, int] = dict(zip(fk, first.tolist()))   # (block, reader) -> its transfer's index
        self.sender: dict[int, int] = dict(zip(fk, fs))              # (block, reader) -> that transfer's sender
        self.readers: dict[int, list[int]] = {}                      # block -> its readers, plan order
        for i, x in zip(fc, fd):
            self.readers.setdefault(i, []).append(x)
        self.order = list(self.readers)                            # blocks with readers, by first send
        self.transfers = list(plan.transfers())                    # plan order: (round, transfer)
        self.size_of = size_of = [block_bytes(b) for b in blocks]
        sizes = np.array(size_of, dtype=np.int64)
        got = np.zeros(R, dtype=np.int64)                          # bytes each rank receives in all
        np.add.at(got, dst, sizes[c])
        self.needs = {x: [col(b) for b in plan.needs(x)] for x in ranks}
        self.own = {x: [col(b) for b in plan.local_blocks(x)] for x in ranks}
        self.owner = [b.owner for b in blocks]
        # work[i * R + x]: rank x's work on block number i, one gather of the plan's work matrix
        table = np.zeros((len(blocks), R))                                       # [blocks, R]
        table[:, ranks] = work_matrix(plan).T
        self.work = table.ravel().tolist()
        flags = np.zeros((len(blocks), R), dtype=np.uint8)                       # [blocks, R]: x needs i
        for x in ranks:
            flags[self.needs[x], x] = 1
        self.need_flags = flags.ravel().tobytes()
        self.n_needs = [0] * R
        # per rank: its needs, least work first and fewest bytes first (only the least still left
        # is ever read, so the order among equals does not matter)
        self.lightest: list[list[int]] = [[] for _ in range(R)]
        self.smallest: list[list[int]] = [[] for _ in range(R)]
        for x in ranks:
            ids = np.array(self.needs[x], dtype=np.int64)
            self.n_needs[x] = len(ids)
            self.lightest[x] = ids[np.argsort(table[ids, x], kind="stable")].tolist()
            self.smallest[x] = ids[np.argsort(sizes[ids], kind="stable")].tolist()
        w = self.work
        self.top = max([w[i * R + x] for x in ranks for i in self.needs[x]]
                       + [w[i * R + x] for x in ranks for i in self.own[x]] + [0.0])
        total = [sum(w[i * R + x] for i in self.needs[x]) + sum(w[i * R + x] for i in self.own[x]) for x in ranks]
        self.work_all = max(total, default=0.0) or 1.0
        self.bytes_all = int(got[ranks].max(initial=0)) or 1


def _pack(inp: _PackInput, budget: int, scale: float) -> tuple[tuple[Wave, ...], float, bool]:
    """:func:`_pack_raw`'s packing as waves, with its pace and whether the cap turned work away."""
    raw, pace, capped = _pack_raw(inp, budget, scale)
    return _waves(inp, raw), pace, capped


def _waves(inp: _PackInput, raw: list[tuple[list[int], list[tuple[int, int]]]]) -> tuple[Wave, ...]:
    """The waves of a raw packing: per wave, its transfers (indices into ``inp.transfers``, in plan
    order) and its computes ``(block number, rank)``."""
    blocks, transfers = inp.blocks, inp.transfers
    return tuple(Wave(tuple(transfers[k] for k in carried), frozenset((blocks[i], x) for i, x in computes))
                 for carried, computes in raw)


def _pack_raw(inp: _PackInput, budget: int, scale: float) -> tuple[list[tuple[list[int], list[tuple[int, int]]]],
                                                                    float, bool]:
    """Greedy packing (module docstring) with a rank's work per wave capped at ``scale`` times the
    largest single delivery's (a rank's first delivery of a wave always fits), and its *pace*: the
    sum over waves of the larger of the busiest rank's work and the most bytes a rank receives in
    the wave, each relative to the whole backward's (``inp.work_all``, ``inp.bytes_all``): 1.0 when
    every wave is as balanced as the one pass (Note [Balanced waves]); and whether the cap ever
    turned work away (if not, any larger cap packs the same waves). The bookkeeping is on block
    numbers and ranks (``inp``: flat tables indexed ``block * span + rank``, lists indexed by
    rank); a wave comes out as its carried transfers' indices (sorted: plan order) and its computes
    ``(block number, rank)`` (:func:`_waves` turns them into :class:`Wave`)."""
    W, owner, size, sender, R, arrive = inp.work, inp.owner, inp.size_of, inp.sender, inp.span, inp.arrive
    ranks = list(inp.plan.ranks)
    left = bytearray(inp.need_flags)                              # left[i * R + x]: x still has to do i
    n_left = list(inp.n_needs)                                    # per rank: deliveries still to do
    local = {x: [i for i in ids] for x, ids in inp.own.items()}   # own block numbers still to do
    order = inp.order
    pending = {i: list(inp.readers[i]) for i in order}            # readers still to serve (a superset)
    cap = inp.top * scale
    lightest = inp.lightest                                       # per rank: its needs, least work first
    first_left = [0] * R                                          # lightest[x][:k] are all done
    smallest = inp.smallest                                       # per rank: its needs, fewest bytes first
    first_small = [0] * R                                         # smallest[x][:k] are all done
    mins = [0.0] * R                                              # per wave: least work x has left
    mins_at = [-1] * R                                            # the wave mins[x] was read in
    raw: list[tuple[list[int], list[tuple[int, int]]]] = []
    pace = 0.0
    capped = False                                                # the cap turned a job away
    while sum(n_left) or any(local.values()):
        wave_no = len(raw)
        load = [0] * R                                            # bytes each rank receives in the wave
        comp = [0.0] * R                                          # work each rank does in the wave
        carried: dict[int, int] = {}                              # (block, rank) -> the transfer bringing it
        computes: list[tuple[int, int]] = []
        hungry = {x for x in ranks if n_left[x]}                  # ranks that may still take work
        for i in order:
            if not hungry:
                break
            readers = pending[i]
            if not readers:
                continue
            o, n_i, base = owner[i], size[i], i * R
            for x in readers:
                if x not in hungry or not left[base + x]:
                    continue
                w = W[base + x]
                if comp[x] and comp[x] + w > cap:
                    capped = True
                    continue
                path, y, fits = [], x, True          # the ranks the block still has to reach, reader first
                while y != o and base + y not in carried:
                    if computes and load[y] + n_i > budget:
                        fits = False
                        break
                    path.append(y)
                    y = sender[base + y]
                if not fits:
                    continue
                for d in path:
                    load[d] += n_i
                    carried[base + d] = arrive[base + d]
                computes.append((i, x))
                comp[x] += w
                left[base + x] = 0
                n_left[x] -= 1
                for d in path[1:]:                               # relays that need it compute it too
                    if left[base + d]:
                        wd = W[base + d]
                        if comp[d] + wd <= cap:
                            computes.append((i, d))
                            comp[d] += wd
                            left[base + d] = 0
                            n_left[d] -= 1
                        else:
                            capped = True
                for d in path:                                   # full: no delivery of theirs fits any more
                    if not n_left[d] or load[d] >= budget:
                        hungry.discard(d)
                        continue
                    lst, k = smallest[d], first_small[d]         # its smallest delivery left no longer fits:
                    while not left[lst[k] * R + d]:              # it cannot read again in this wave, whatever
                        k += 1                                   # the cap (load only grows), so the cap's
                    first_small[d] = k                           # comparisons for it change nothing
                    if load[d] + size[lst[k]] > budget:
                        hungry.discard(d)
                    elif comp[d]:
                        if mins_at[d] != wave_no:                # least work d still has to do (read once a wave)
                            lst, k = lightest[d], first_left[d]
                            while k < len(lst) and not left[lst[k] * R + d]:
                                k += 1
                            first_left[d] = k
                            mins[d] = W[lst[k] * R + d] if k < len(lst) else 0.0
                            mins_at[d] = wave_no
                        if comp[d] + mins[d] > cap:
                            hungry.discard(d)
                            capped = True
            pending[i] = [x for x in readers if left[base + x]]
        for x in ranks:                                          # own blocks fill spare work
            mine = local[x]
            while mine and (not comp[x] or comp[x] + W[mine[0] * R + x] <= cap):
                i = mine.pop(0)
                computes.append((i, x))
                comp[x] += W[i * R + x]
            capped = capped or bool(mine)
        raw.append((sorted(carried.values()), computes))
        # load: the bytes each rank receives in the wave (every carried transfer once)
        pace += max(max(comp) / inp.work_all, max(load) / inp.bytes_all)
    return raw, pace, capped


_WAVES: dict[tuple, tuple[weakref.ref, tuple[Wave, ...]]] = {}

WAVE_CAP_SCALES = (1.0, 2.0, 4.0, float("inf"))
"""Work caps :func:`plan_waves` tries, in units of the largest single delivery (Note [Balanced waves])."""
WAVE_TIE = 0.01
"""Makespans within this fraction tie; the packing with fewer waves wins."""
WAVE_SPREAD_MARGIN = 0.05
"""How much less pace the spread packing must have than the capped ones' best to be run (Note
[Balanced waves], "Spread over the waves the bytes need")."""


def restrict(plan: Plan, wave: Wave) -> Plan:
    """The plan's rounds that carry ``wave``, with only its transfers in plan order (not a complete
    plan: it delivers only this wave; for the cost model). ``wave.transfers`` is in plan order
    (:func:`plan_waves` sorts it by round and place in the round), so it is grouped by round."""
    rounds: dict[int, list[Transfer]] = {}
    for r, t in wave.transfers:
        rounds.setdefault(r, []).append(t)
    return replace(plan, rounds=tuple(tuple(rounds[r]) for r in wave.rounds), name=f"{plan.name}/wave")


def first_fetch(wave: Wave, kept: Mapping[int, Collection[Block]]) -> Wave:
    """The part of the first wave that is re-sent when some ranks kept theirs from the forward
    (``kept``: rank -> the blocks it kept; Note [Backward waves], "The first wave"). A transfer goes
    again when its receiver computes the block in the wave and did not keep it, or forwards it on
    a transfer that goes again (a relay that kept a block sends it from what it kept). Same
    computes as ``wave``; reads only the wave, so every rank and the cost model cut it alike."""
    wanted: set[tuple[Block, int]] = set()        # (block, rank): the rank must hold it again
    again: list[tuple[int, Transfer]] = []
    for r, t in reversed(wave.transfers):
        b, d = t.block, t.dst
        if b in kept.get(d, ()) or ((b, d) not in wave.computes and (b, d) not in wanted):
            continue
        again.append((r, t))
        if t.src != b.owner:
            wanted.add((b, t.src))
    return Wave(tuple(reversed(again)), wave.computes)


# ---- keep or resend (Note [Backward KV modes] in megatron_fcp.schedule.program) ----------------
BACKWARD_KV_MODES = ("auto", "keep", "resend")
RING_BUDGET = -1
"""``kv_memory_budget`` value meaning "what the ring holds": one KV pair the size of the rank's shard."""


def kept_bytes_per_rank(plan: Plan, block_bytes: Callable[[Block], int]) -> dict[int, int]:
    """Bytes of received KV each rank would save for backward under ``keep`` (its need set)."""
    return {r: sum(block_bytes(b) for b in plan.needs(r)) for r in plan.ranks}


def choose_backward_kv(mode: str, plan: Plan, block_bytes: Callable[[Block], int], budget: int = RING_BUDGET,
                       *, cache_key: Hashable = None) -> str:
    """``"keep"`` or ``"resend"`` for ``mode`` (Note [Backward KV modes] in
    :mod:`megatron_fcp.schedule.program`); the same answer on every rank.

    block_bytes: bytes of one block's K and V. budget: bytes per rank, or :data:`RING_BUDGET`
    (each rank's own KV bytes). cache_key: what ``block_bytes`` depends on besides the plan (e.g.
    the shard's shape and dtype); with it the answer is computed once per plan object and key
    (every layer of a model calls this with the same settled plan).
    """
    if mode not in BACKWARD_KV_MODES:
        raise ValueError(f"backward_kv must be one of {BACKWARD_KV_MODES}, got {mode!r} (--fcp-backward-kv)")
    if mode != "auto":
        return mode
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < RING_BUDGET:
        raise ValueError(f"kv_memory_budget must be bytes >= 0 or {RING_BUDGET} (the ring's), got {budget!r} "
                         "(--fcp-kv-memory-budget)")
    key = (id(plan), budget, cache_key)
    hit = _DECISIONS.get(key)
    if cache_key is not None and hit is not None and hit[0]() is plan:
        return hit[1]
    kept = kept_bytes_per_rank(plan, block_bytes)
    decision = "keep"
    for r in plan.ranks:
        limit = budget if budget != RING_BUDGET else sum(block_bytes(b) for b in plan.local_blocks(r))
        if kept[r] > limit:
            decision = "resend"
            break
    if cache_key is not None:
        if len(_DECISIONS) > 1024:
            _DECISIONS.clear()
        _DECISIONS[key] = (weakref.ref(plan), decision)
    return decision


_DECISIONS: dict[tuple, tuple[weakref.ref, str]] = {}  # (id(plan), budget, key) -> (plan ref, decision)
