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
from dataclasses import dataclass, replace
from itertools import chain, repeat
from operator import attrgetter
from typing import Callable, Collection, Hashable, Mapping, Sequence

import numpy as np

from megatron_fcp.contract.blocks import Block, Transfer
from megatron_fcp.contract.needs import block_pairs
from megatron_fcp.contract.plan import Plan
from megatron_fcp.contract.table import block_layout
from megatron_fcp.jit import isin_ints, jit
from megatron_fcp.memo import memo

__all__ = ["Wave", "plan_transfer_pairs", "wave_columns", "wave_compute_columns", "plan_waves", "wave_budget", "restrict", "first_fetch",
           "leading_own_jobs", "loop_jobs", "loop_job_columns", "block_work", "BACKWARD_KV_MODES", "RING_BUDGET",
           "kept_bytes_per_rank", "choose_backward_kv", "BlockBytes", "block_sizes", "own_block_bytes"]


class Wave:
    """Deliveries handled together in backward and the plan transfers that carry them.

    ``transfers``: ``(plan round, transfer)`` pairs, in plan order; ``computes``: ``(block, rank)``,
    rank computes block's gradient here; ``rounds``: ascending plan rounds with a transfer of the
    wave. ``plan_index`` (int64 ``[len(transfers)]``): each transfer's place in plan order (its row
    of ``Plan.transfer_columns()``), where the wave was cut from the plan's columns, else None;
    ``compute_index``: the computes as columns ``(block numbers in Plan.blocks() order, global
    ranks)``, where the packing gave them, else None. Both are views, not part of the wave's
    identity (equality and hash are ``transfers`` and ``computes``).

    Note [Waves as columns]
    -----------------------
    The packing gives a wave as its rows of the plan and its computes as columns
    (:meth:`of_plan`); its ``transfers`` and ``computes`` are built from them on first read. The
    degree choice packs every degree's waves for its floor, which reads only the columns
    (``wave_columns``, ``wave_compute_columns``), and simulates one or two of them; at cp = 256
    the tuples and sets of the others (~10^5 ``(round, transfer)`` pairs, and the plan's transfers
    built for them) were ~0.1 s of a degree choice. Such a wave holds its plan weakly: the wave
    caches (``plan_waves``, the program's) hold waves of plans that may be gone, and hand them out
    only for a live plan, so a wave must not keep its plan (and the plan's tables) alive.
    """

    __slots__ = ("_transfers", "_computes", "_rounds", "_tset", "_plan", "plan_index", "compute_index")

    def __init__(self, transfers, computes, plan_index: np.ndarray | None = None,
                 compute_index: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self._transfers = tuple(transfers)
        self._computes = frozenset(computes)
        self._rounds = self._tset = self._plan = None
        self.plan_index, self.compute_index = plan_index, compute_index
        if plan_index is not None and len(plan_index) != len(self._transfers):
            raise ValueError(f"Wave: plan_index has {len(plan_index)} entries for {len(self._transfers)} transfers")
        if compute_index is not None and any(len(c) != len(self._computes) for c in compute_index):
            raise ValueError(f"Wave: compute_index does not have {len(self._computes)} entries")

    @classmethod
    def of_plan(cls, plan: Plan, plan_index: np.ndarray, compute_index: tuple[np.ndarray, np.ndarray]) -> "Wave":
        """The wave of ``plan`` whose transfers are its rows ``plan_index`` (plan order) and whose
        computes are ``compute_index``; ``transfers`` and ``computes`` built on first read (Note
        [Waves as columns])."""
        w = cls.__new__(cls)
        w._transfers = w._computes = w._rounds = w._tset = None
        w._plan, w.plan_index, w.compute_index = weakref.ref(plan), plan_index, compute_index
        return w

    def _source(self) -> Plan:
        """The plan a wave of columns was cut from (it must still be alive)."""
        plan = self._plan()
        if plan is None:
            raise RuntimeError("Wave: the plan this wave's columns index is gone; keep the plan while its waves are read")
        return plan

    @property
    def transfers(self) -> tuple[tuple[int, Transfer], ...]:
        if self._transfers is None:
            pairs = plan_transfer_pairs(self._source())
            self._transfers = tuple(map(pairs.__getitem__, self.plan_index.tolist()))
        return self._transfers

    @property
    def computes(self) -> frozenset:
        if self._computes is None:
            blocks = self._source().blocks()
            number, rank = self.compute_index
            self._computes = frozenset(zip(map(blocks.__getitem__, number.tolist()), rank.tolist()))
        return self._computes

    @property
    def rounds(self) -> tuple[int, ...]:
        if self._rounds is None:
            if self._transfers is None:   # from the plan's round column: no pairs built
                self._rounds = tuple(np.unique(self._source().transfer_columns()[0][self.plan_index]).tolist())
            else:
                self._rounds = tuple(sorted({r for r, _ in self._transfers}))
        return self._rounds

    def has(self, round_index: int, t: Transfer) -> bool:
        """Whether the wave carries transfer ``t`` of plan round ``round_index`` (the set of them is
        built on the first call: the cost model never asks, an executor's rank asks per round)."""
        if self._tset is None:
            self._tset = frozenset(self.transfers)
        return (round_index, t) in self._tset

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self.transfers == other.transfers and self.computes == other.computes

    def __hash__(self) -> int:
        return hash((self.transfers, self.computes))

    def __repr__(self) -> str:
        return f"Wave(transfers={self.transfers!r}, computes={self.computes!r}, rounds={self.rounds!r})"

    def __reduce__(self):   # pickled whole, without the plan it may be a view of
        return (Wave, (self.transfers, self.computes, self.plan_index, self.compute_index))


def plan_transfer_pairs(plan: Plan) -> list[tuple[int, Transfer]]:
    """The plan's ``(round, transfer)`` pairs in plan order (what a wave's ``plan_index`` names);
    built once per plan object."""
    got = plan.__dict__.get("_wave_transfer_pairs")
    if got is None:
        rounds = plan.rounds
        got = plan.__dict__["_wave_transfer_pairs"] = list(zip(
            chain.from_iterable(repeat(k, len(rnd)) for k, rnd in enumerate(rounds)), chain.from_iterable(rounds)))
    return got


def leading_own_jobs(n_own: int, n_waves: int) -> int:
    """How many of a rank's ``n_own`` own jobs in the first wave run first, while the first wave's KV
    arrives (Note [Backward waves] in :mod:`megatron_fcp.attention.backward_waves`); the rest run
    last, while the last reduction returns. With several waves all run first (later waves' jobs
    hide the reductions); a single wave's reduction has nothing after it but what is left of the
    own jobs, so half of them (rounded up) run first and half last: the wave's reduction then
    overlaps the second half instead of running alone at the end."""
    return n_own if n_waves > 1 else (n_own + 1) // 2


def loop_job_columns(plan: Plan, waves: Sequence[Wave]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The wave loop's gradient jobs as int64 columns ``(iteration, CP position, block number,
    leading)``, each rank's in the order it runs them: iteration ``w < W`` is wave ``w``'s jobs, its
    received blocks in plan order and its own in local order, except that wave 0 runs
    :func:`leading_own_jobs` of its own jobs first (``leading`` 1, while its KV arrives) and leaves
    the rest for iteration ``W`` (after the last wave, while the last reduction returns). The one
    rule of the job order: :func:`loop_jobs` (the executor, the timeline) lists it, the wave floor
    (:func:`~megatron_fcp.cost.timeline.wave_timeline_floor`) prices it as columns."""
    cp, W = plan.cp, len(waves)
    owner_pos = block_layout(plan.chunks_per_rank(), plan.parts_per_chunk)[1]   # [blocks]: owner's CP position
    parts: list[tuple[int | np.ndarray, np.ndarray, np.ndarray, int | np.ndarray]] = []
    for w, wave in enumerate(waves):
        cb, cx = wave_compute_columns(plan, wave)             # [computes]: block number, global rank
        cq = plan.cp_positions(cx)
        own = owner_pos[cb] == cq
        _, _, dst, o, ch, pt = wave_columns(plan, wave)       # [transfers], plan order
        tb, tq = plan.block_numbers(o, ch, pt), plan.cp_positions(dst)
        got = isin_ints(tb * cp + tq, cb[~own] * cp + cq[~own], len(owner_pos) * cp)   # bring a job, in turn
        received = (w, tq[got], tb[got], 0)
        o_blk = np.sort(cb[own])                              # own jobs: owner by owner, local order
        o_pos = owner_pos[o_blk]
        if w:
            parts += [received, (w, o_pos, o_blk, 0)]
            continue
        n_own = np.bincount(o_pos, minlength=cp)
        n_lead = np.array([leading_own_jobs(n, W) for n in n_own.tolist()], dtype=np.int64)
        rank_start = np.concatenate(([0], np.cumsum(n_own)[:-1]))
        lead = np.arange(len(o_blk)) - rank_start[o_pos] < n_lead[o_pos]
        parts += [(0, o_pos[lead], o_blk[lead], 1), received, (W, o_pos[~lead], o_blk[~lead], 0)]
    if not parts:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(4))
    lens = [len(p[1]) for p in parts]
    return (np.repeat(np.array([p[0] for p in parts], dtype=np.int64), lens),
            np.concatenate([p[1] for p in parts]).astype(np.int64),
            np.concatenate([p[2] for p in parts]).astype(np.int64),
            np.repeat(np.array([p[3] for p in parts], dtype=np.int64), lens))


def loop_jobs(plan: Plan, waves: Sequence[Wave]
              ) -> tuple[dict[int, list[list[Block]]], dict[int, int], dict[int, list[Block]]]:
    """Each rank's gradient jobs as the wave loop runs them, one kernel call each (the executor's
    :func:`~megatron_fcp.attention.backward_waves.run_backward_waves` runs these, the cost model's
    :func:`~megatron_fcp.cost.timeline.wave_timeline` prices them: Note [One launch per owner and
    stage] in :mod:`megatron_fcp.schedule.launches`): per wave, the received blocks in plan order
    then its own (wave 0: its own first); how many of wave 0's own jobs run first, while wave 0's
    KV arrives (:func:`leading_own_jobs`), and the rest, run after the last wave: the lists of
    :func:`loop_job_columns`. Memoised per waves object (the program's)."""
    cache, key = memo(plan), ("loop_jobs", id(waves))     # Note [Caches live with their object]
    hit = cache.get(key)
    if hit is not None and hit[0] is waves:
        return hit[1]
    ranks, W, blocks = list(plan.ranks), len(waves), plan.blocks()
    jobs: dict[int, list[list[Block]]] = {x: [[] for _ in range(W)] for x in ranks}
    n_own = dict.fromkeys(ranks, 0)
    last: dict[int, list[Block]] = {x: [] for x in ranks}
    for it, q, i, lead in zip(*(c.tolist() for c in loop_job_columns(plan, waves))):
        x = ranks[q]
        (last[x] if it == W else jobs[x][it]).append(blocks[i])
        n_own[x] += lead
    cache[key] = (waves, (jobs, n_own, last))
    return jobs, n_own, last


class BlockBytes:
    """A block's K and V bytes in a plan: its tokens (:meth:`~megatron_fcp.contract.plan.Plan.block_tokens`,
    ``seq_len`` for a zigzag plan) times ``token_bytes``. Called per block, as every ``block_bytes``
    here is; :func:`block_sizes` reads the plan's every block at once from
    :meth:`~megatron_fcp.contract.plan.Plan.block_token_counts` instead of one call per block (at
    cp = 256 a plan has 5K blocks, and the backward program asked for all of them several times)."""

    def __init__(self, plan: Plan, token_bytes: int, seq_len: int | None = None):
        self.plan, self.token_bytes, self.seq_len = plan, token_bytes, seq_len
        self._memo: dict[Block, int] = {}
        self._array: np.ndarray | None = None

    def __call__(self, b: Block) -> int:
        n = self._memo.get(b)
        if n is None:
            n = self._memo[b] = self.plan.block_tokens(b, self.seq_len) * self.token_bytes
        return n

    def array(self) -> np.ndarray:
        """``[n_blocks]``, read-only: every block's bytes, ``plan.blocks()`` order (int64 for integer
        ``token_bytes``)."""
        if self._array is None:
            self._array = self.plan.block_token_counts(self.seq_len) * self.token_bytes
            self._array.flags.writeable = False
        return self._array


def block_sizes(plan: Plan, block_bytes: Callable[[Block], float], dtype=np.int64) -> np.ndarray:
    """``[n_blocks]`` of ``dtype``: ``block_bytes`` of every block of ``plan.blocks()``, in that order
    (read at once from a :class:`BlockBytes` of ``plan``, else one call per block)."""
    if isinstance(block_bytes, BlockBytes) and block_bytes.plan is plan:
        return block_bytes.array().astype(dtype, copy=False)
    return np.array([block_bytes(b) for b in plan.blocks()], dtype=dtype)


def own_block_bytes(plan: Plan, block_bytes: Callable[[Block], int]) -> dict[int, int]:
    """Per global rank, the bytes of the blocks it owns (:func:`block_sizes` summed owner by owner;
    exact integers)."""
    sizes = block_sizes(plan, block_bytes)
    n_local = plan.chunks_per_rank() * plan.parts_per_chunk              # [cp]
    offset = block_layout(plan.chunks_per_rank(), plan.parts_per_chunk)[0]
    total = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    return dict(zip(plan.ranks, (total[offset + n_local] - total[offset]).tolist()))


def wave_budget(plan: Plan, block_bytes: Callable[[Block], int]) -> int:
    """The largest shard's K and V bytes: the two waves alive at once (w computing, w+1 arriving)
    then hold what Transformer Engine's ring backward allocates for the same purpose, two buffers of
    one shard's KV (and dKV) beside the KV it saved (``AttnFuncWithCPAndKVP2P.backward``:
    ``p2p_comm_buffers``, read 2026-12-03). Before 2026-12-03 a wave held half a shard, which
    counted one of those buffers: the waves re-sent twice as often as that memory allows (packed
    cp = 256, 64:8, 32K median: backward 37.6 -> 31.2 ms at one shard; docs/planner.md, "Waves of
    a shard"). The one wave rule of the executor, the cost model and the emulator; the chains'
    sub-rounds use the same (:func:`~megatron_fcp.schedule.chains.chain_budget`)."""
    return max(own_block_bytes(plan, block_bytes).values())


def block_work(plan: Plan) -> Callable[[int, Block], float]:
    """Query-key pairs of a rank's queries against a block (relative: zigzag at 64 tokens per
    sub-block), read from :func:`work_matrix`."""
    pos = {r: i for i, r in enumerate(plan.ranks)}
    table = work_matrix(plan)                                           # [cp, blocks]
    col = _block_column(plan)
    # one element read per call, not the table turned into lists: a head-parallel stage's table at
    # cp = 256 (2,048 documents) has 5.0M entries and its simulated backward makes 28K calls (the
    # lists took 0.09 s, the calls take 0.01 s; 2026-12-06)
    return lambda rank, b: float(table[pos[rank], col(b)])


def work_matrix(plan: Plan) -> np.ndarray:
    """``[cp, n_blocks]`` float64, read-only: :func:`block_work` of every CP rank (CP order) against
    every block of ``plan.blocks()`` (columns ``offset[owner] + chunk * P + part``), one vectorised
    table per plan object: a placement's exact pairs
    (:meth:`~megatron_fcp.contract.placement.Placement.pair_matrix`), or a zigzag plan's relative
    pairs (:func:`zigzag_pairs`)."""
    cache = memo(plan)                                    # Note [Caches live with their object]
    hit = cache.get("work_matrix")
    if hit is not None:
        return hit
    if plan.placement is not None:
        out = plan.placement.pair_matrix().astype(np.float64)
    else:  # relative work: 64 tokens per sub-block; a windowed plan's own length (its window is in tokens)
        out = _zigzag_rows(plan, plan.seq_len if plan.mask.windowed else 2 * plan.cp * plan.parts_per_chunk * 64
                           ).astype(np.float64)
    out.flags.writeable = False
    cache["work_matrix"] = out
    return out


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
    cache, key = memo(plan), ("zigzag_pairs", seq_len)    # Note [Caches live with their object]
    hit = cache.get(key)
    if hit is not None:
        return hit
    pos = {r: i for i, r in enumerate(plan.ranks)}
    P = plan.parts_per_chunk
    rows = _zigzag_rows(plan, seq_len).tolist()                         # [cp][blocks]

    def pairs(rank: int, b: Block) -> int:   # plan.blocks() order: owner, chunk, part
        return rows[pos[rank]][(2 * pos[b.owner] + b.chunk) * P + b.part]

    cache[key] = pairs
    return pairs


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
    cache, key = memo(plan), ("waves", budget, cache_key)  # Note [Caches live with their object]
    hit = cache.get(key) if cache_key is not None else None
    if hit is not None:
        return hit
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
        cache[key] = waves
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
    """What every packing of one plan reads, numbered once (the work caps of :func:`plan_waves`
    share it), as the flat arrays :func:`_pack_kernel` takes (:func:`_kernel_args`).

    Blocks are numbered by their column in :func:`work_matrix` (``plan.blocks()`` order). An
    *arrival* is a (block, rank) the plan brings the block to, numbered in plan order of the
    transfer that brings it (a verified plan brings a block to a rank once): its transfer's index
    in plan order, its block, its rank, the arrival at the transfer's sender (-1: the sender is the
    owner), whether the rank needs the block, and the rank's work on it. The packing walks these
    compact columns, not ``[blocks, ranks]`` tables: at cp = 256 a table is 1M entries, scattered
    reads into it cost more than the packing's own loop (2026-12-06, 512 packed documents on
    dgx-h100:32: a packing took 21 ms over tables, 17 ms over arrivals, 11 ms with each wave's sort
    left to the packing kept, :meth:`_RawPacking.in_plan_order`, and the buffer growth checked inline).
    Besides them: the blocks with readers in the order the plan first sends them (``order``) and
    each one's reading arrivals in plan order (CSR); each rank's needs (counts; as arrivals, least
    work and fewest bytes first) and own blocks; block bytes and each block's work at its owner;
    and what a pace is relative to (Note [Balanced waves]): the busiest rank's total work, the most
    bytes a rank receives. All of it is read from the plan's transfer columns, need matrix and work
    matrix (numpy), not from a Python loop over every transfer."""

    def __init__(self, plan: Plan, block_bytes: Callable[[Block], int]):
        self.plan = plan
        ranks = np.array(plan.ranks, dtype=np.int64)
        R = int(ranks.max()) + 1
        blocks = list(plan.blocks())                               # block number = its work_matrix column
        nB = len(blocks)
        n_local = plan.chunks_per_rank() * plan.parts_per_chunk    # [cp] blocks each rank owns
        first_col, owner_pos, _ = block_layout(plan.chunks_per_rank(), plan.parts_per_chunk)
        offset = np.zeros(R, dtype=np.int64)                       # global rank -> its first column
        offset[ranks] = first_col
        _, src, dst, owner, chunk, part = plan.transfer_columns()  # [T] each, plan order
        c = plan.block_numbers(owner, chunk, part)                 # [T]: each transfer's block number
        key = c * R + dst
        _, first = np.unique(key, return_index=True)               # each (block, rank)'s arriving transfer
        first.sort()                                               # [A] arrivals, plan order
        a_key, a_blk, a_dst = key[first], c[first], dst[first]
        a_up = np.full(len(first), -1, dtype=np.int64)             # [A]: the arrival at its sender; -1: the owner
        if len(first):
            by_key = np.argsort(a_key)
            up_key = a_blk * R + src[first]                        # (block, sender) of each arrival
            at = by_key[np.minimum(np.searchsorted(a_key, up_key, sorter=by_key), len(first) - 1)]
            a_up = np.where(a_key[at] == up_key, at, a_up)
        need = plan.need_matrix()                                  # [cp, blocks] bool
        work = work_matrix(plan)                                   # [cp, blocks] float64
        a_pos = plan.cp_positions(a_dst)                           # [A]: the rank's CP position
        a_need = need[a_pos, a_blk].astype(np.uint8)               # [A]: the rank needs the block
        a_work = work[a_pos, a_blk]                                # [A]: its work on it
        own_work = work[owner_pos, np.arange(nB)]                  # [blocks]: the owner's work on it
        # blocks with readers by first send; each one's reading arrivals, in plan order (a relay
        # that does not read the block is never a delivery)
        _, at_first = np.unique(a_blk, return_index=True)
        order = a_blk[np.sort(at_first)]
        slot = np.empty(nB, dtype=np.int64)
        slot[order] = np.arange(len(order))
        reading = np.flatnonzero(a_need)
        rd_a = reading[np.argsort(slot[a_blk[reading]], kind="stable")]
        rd_ptr = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(np.bincount(slot[a_blk[reading]], minlength=len(order)), out=rd_ptr[1:])
        sizes = block_sizes(plan, block_bytes)
        got = np.zeros(R, dtype=np.int64)                          # bytes each rank receives in all
        np.add.at(got, dst, sizes[c])
        # per rank: its own blocks, numbers own_lo[x] .. own_hi[x] - 1 in local order; as CSR over
        # global ranks its needs (arrivals) least work first and fewest bytes first (only the least
        # still left is ever read: ties need no order)
        own_hi = offset.copy()
        own_hi[ranks] += n_local
        needs = reading[np.argsort(a_dst[reading] * nB + a_blk[reading], kind="stable")]   # rank, then block
        light = needs[np.lexsort((a_work[needs], a_dst[needs]))]
        small = needs[np.lexsort((sizes[a_blk[needs]], a_dst[needs]))]
        n_needs = np.bincount(a_dst[reading], minlength=R).astype(np.int64)
        need_ptr = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(n_needs, out=need_ptr[1:])
        self.arrays = {"order": order, "rd_ptr": rd_ptr, "rd_a": rd_a, "a_t": first, "a_blk": a_blk,
                       "a_dst": a_dst, "a_up": a_up, "a_need": a_need, "a_work": a_work, "size": sizes,
                       "own_work": own_work, "n_needs": n_needs, "own_lo": offset, "own_hi": own_hi,
                       "need_ptr": need_ptr, "light": light, "small": small, "ranks": ranks}
        self.span = R
        # the largest single delivery's work, and the busiest rank's total summed block after block
        # in block order (a running sum: the same float whatever numpy's reduction order)
        does = need.copy()                                         # [cp, blocks]: x computes i somewhere
        does[owner_pos, np.arange(nB)] = True
        self.top = float(max(a_work[reading].max(initial=0.0), own_work.max(initial=0.0)))
        self.work_all = float(_row_totals(does, work).max(initial=0.0)) or 1.0
        self.bytes_all = int(got[ranks].max(initial=0)) or 1


@jit
def _row_totals(does, work):
    """``[rows]``: each row's ``work`` where ``does``, summed left to right (a running sum in column
    order; ``np.cumsum(np.where(does, work, 0.0), axis=1)[:, -1]``, which walks the array across
    its rows, took 35 ms at cp = 256 with 2,048 documents, this 2)."""
    out = np.zeros(does.shape[0])
    for x in range(does.shape[0]):
        s = 0.0
        for i in range(does.shape[1]):
            if does[x, i]:
                s += work[x, i]
        out[x] = s
    return out


def _pack(inp: _PackInput, budget: int, scale: float) -> tuple[tuple[Wave, ...], float, bool]:
    """:func:`_pack_raw`'s packing as waves, with its pace and whether the cap turned work away."""
    raw, pace, capped = _pack_raw(inp, budget, scale)
    return _waves(inp, raw), pace, capped


def _waves(inp: _PackInput, raw: "_RawPacking") -> tuple[Wave, ...]:
    """The waves of a raw packing, as columns (:meth:`Wave.of_plan`): per wave, its rows of the plan
    (in plan order) and its computes ``(block number, rank)``."""
    index = raw.in_plan_order()
    cp_, mp = raw.carried_ptr.tolist(), raw.comp_ptr.tolist()
    return tuple(Wave.of_plan(inp.plan, index[cp_[w]:cp_[w + 1]], (raw.comp_i[mp[w]:mp[w + 1]], raw.comp_x[mp[w]:mp[w + 1]]))
                 for w in range(len(raw)))


def _kernel_args(inp: _PackInput, budget: int, cap: float) -> tuple:
    """:func:`_pack_kernel`'s arguments for one packing of ``inp``."""
    a = inp.arrays
    return (a["order"], a["rd_ptr"], a["rd_a"], a["a_t"], a["a_blk"], a["a_dst"], a["a_up"], a["a_need"],
            a["a_work"], a["size"], a["own_work"], a["n_needs"], a["own_lo"], a["own_hi"], a["need_ptr"],
            a["light"], a["small"], a["ranks"], inp.span, int(budget), float(cap), float(inp.work_all),
            float(inp.bytes_all))


def _pack_raw(inp: _PackInput, budget: int, scale: float) -> tuple["_RawPacking", float, bool]:
    """Greedy packing (module docstring) with a rank's work per wave capped at ``scale`` times the
    largest single delivery's (a rank's first delivery of a wave always fits), and its *pace*: the
    sum over waves of the larger of the busiest rank's work and the most bytes a rank receives in
    the wave, each relative to the whole backward's (``inp.work_all``, ``inp.bytes_all``): 1.0 when
    every wave is as balanced as the one pass (Note [Balanced waves]); and whether the cap ever
    turned work away (if not, any larger cap packs the same waves). The loop is
    :func:`_pack_kernel`, compiled (Note [Compiled planning loops] in :mod:`megatron_fcp.jit`)."""
    out = _pack_kernel(*_kernel_args(inp, budget, inp.top * scale))
    carried_ptr, carried, comp_ptr, comp_i, comp_x, pace, capped = out
    return _RawPacking(carried_ptr, carried, comp_ptr, comp_i, comp_x), float(pace), bool(capped)


@dataclass(frozen=True)
class _RawPacking:
    """A packing as :func:`_pack_kernel` returns it: wave ``w``'s carried transfers (indices into
    the plan's transfers, in the order they were packed: :meth:`in_plan_order` sorts them) are
    ``carried[carried_ptr[w]:carried_ptr[w + 1]]``, its computes ``(comp_i, comp_x)[comp_ptr[w]:
    comp_ptr[w + 1]]`` (block number, rank), in the order they were packed."""

    carried_ptr: np.ndarray
    carried: np.ndarray
    comp_ptr: np.ndarray
    comp_i: np.ndarray
    comp_x: np.ndarray

    def __len__(self) -> int:
        return len(self.carried_ptr) - 1

    def in_plan_order(self) -> np.ndarray:
        """``carried`` with each wave's transfers ascending (plan order). Sorted here, for the
        packing :func:`plan_waves` keeps, not in the kernel for every candidate: numba's sort of
        each wave took 6 of a packing's 13 ms at cp = 256 (2026-12-06)."""
        span = int(self.carried.max(initial=-1)) + 1
        wave = np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.carried_ptr))
        return np.sort(wave * span + self.carried) - wave * span


@jit
def _grow(a, n):
    """``a`` with room for at least ``n`` entries (doubling), its first ``len(a)`` kept."""
    if n <= a.shape[0]:
        return a
    b = np.empty(max(n, 2 * a.shape[0]), dtype=a.dtype)
    b[:a.shape[0]] = a
    return b


@jit
def _pack_kernel(order, rd_ptr, rd_a, a_t, a_blk, a_dst, a_up, a_need, a_work, size, own_work, n_needs, own_lo,
                 own_hi, need_ptr, light, small, ranks, R, budget, cap, work_all, bytes_all):
    """The greedy packing of :func:`_pack_raw` over flat arrays (Note [Compiled planning loops]).

    Blocks are numbers (``work_matrix`` columns), arrivals (block, rank) numbers in plan order
    (:class:`_PackInput`): ``a_t``, ``a_blk``, ``a_dst``, ``a_up``, ``a_need``, ``a_work`` per
    arrival (its transfer's index, block, rank, the arrival at its sender or -1 for the owner,
    whether the rank needs the block, its work on it); ``order`` the blocks with readers by first
    send, ``rd_a[rd_ptr[j]:rd_ptr[j + 1]]`` block ``order[j]``'s reading arrivals in plan order;
    ``size``, ``own_work`` per block (bytes, the owner's work); per global rank ``n_needs``, its own
    blocks ``own_lo[x] .. own_hi[x] - 1`` in local order and, as CSR over ranks (``need_ptr``), its
    needs as arrivals least work first (``light``) and fewest bytes first (``small``); ``ranks``
    the plan's ranks in order; ``R`` one more than the largest rank.

    A wave visits the blocks in ``order`` and each one's readers still to serve; a delivery joins
    unless its reader already holds work and the cap would be passed, or (once the wave has one) a
    rank on its path from the nearest holder would receive more than ``budget`` bytes. Relays on
    the path that need the block compute it too within the cap. A rank stops taking work in the
    wave once it has nothing left, its bytes reach the budget, its smallest delivery left no longer
    fits, or (holding work) its least-work delivery left would pass the cap (read once a wave). Own
    blocks then fill each rank's spare work, in local order."""
    left = a_need.copy()                            # [A]: the arrival's rank still has to do its block
    n_left = n_needs.copy()                         # [R]
    own_pos = own_lo.copy()                         # [R]: own blocks own_pos[x] .. own_hi[x] - 1 still to do
    rd_a = rd_a.copy()                              # compacted in place as readers are served
    pend_len = rd_ptr[1:] - rd_ptr[:-1]             # [len(order)]: readers still to serve (a superset)
    first_left = need_ptr[:-1].copy()               # [R]: light[need_ptr[x]:first_left[x]] all done
    first_small = need_ptr[:-1].copy()
    mins = np.zeros(R)
    mins_at = np.full(R, -1, dtype=np.int64)
    hungry = np.zeros(R, dtype=np.bool_)
    carried_at = np.full(a_t.shape[0], -1, dtype=np.int64)  # the wave that carries each arrival's transfer
    path = np.empty(R, dtype=np.int64)              # arrivals
    load = np.zeros(R, dtype=np.int64)
    comp = np.zeros(R)
    total_left = 0
    for x in ranks:
        total_left += n_left[x]
    own_left = 0
    for x in ranks:
        own_left += own_hi[x] - own_lo[x]
    carried = np.empty(1024, dtype=np.int64)
    n_carried = 0
    carried_ptr = np.zeros(64, dtype=np.int64)
    comp_i = np.empty(total_left + own_left, dtype=np.int64)
    comp_x = np.empty(total_left + own_left, dtype=np.int64)
    n_comp = 0
    comp_ptr = np.zeros(64, dtype=np.int64)
    pace = 0.0
    capped = False
    wave_no = 0
    while total_left > 0 or own_left > 0:
        load[:] = 0
        comp[:] = 0.0
        wave_comp0 = n_comp
        hungry[:] = False
        n_hungry = 0
        for x in ranks:
            if n_left[x] > 0:
                hungry[x] = True
                n_hungry += 1
        for j in range(order.shape[0]):
            if n_hungry == 0:
                break
            m = pend_len[j]
            if m == 0:
                continue
            i = order[j]
            n_i = size[i]
            r0 = rd_ptr[j]
            touched = False
            for q in range(r0, r0 + m):
                a = rd_a[q]
                x = a_dst[a]
                if not hungry[x] or left[a] == 0:
                    continue
                w = a_work[a]
                if comp[x] != 0.0 and comp[x] + w > cap:
                    capped = True
                    continue
                n_path = 0                        # the arrivals the block still needs, the reader's first
                e = a
                fits = True
                while e != -1 and carried_at[e] != wave_no:
                    if n_comp > wave_comp0 and load[a_dst[e]] + n_i > budget:
                        fits = False
                        break
                    path[n_path] = e
                    n_path += 1
                    e = a_up[e]
                if not fits:
                    continue
                if n_carried + n_path > carried.shape[0]:
                    carried = _grow(carried, n_carried + n_path)
                for p in range(n_path):
                    e = path[p]
                    load[a_dst[e]] += n_i
                    carried_at[e] = wave_no
                    carried[n_carried] = a_t[e]
                    n_carried += 1
                comp_i[n_comp] = i
                comp_x[n_comp] = x
                n_comp += 1
                comp[x] += w
                left[a] = 0
                n_left[x] -= 1
                total_left -= 1
                touched = True
                # relays that need it compute it too (the delivery's bookkeeping above, written out
                # again: a helper call per delivery, not inlined by numba, cost 10% of the packing)
                for p in range(1, n_path):
                    e = path[p]
                    if left[e] != 0:
                        d = a_dst[e]
                        wd = a_work[e]
                        if comp[d] + wd <= cap:
                            comp_i[n_comp] = i
                            comp_x[n_comp] = d
                            n_comp += 1
                            comp[d] += wd
                            left[e] = 0
                            n_left[d] -= 1
                            total_left -= 1
                        else:
                            capped = True
                # full: no delivery of theirs fits any more (a rank already full is checked again:
                # its cap check still counts as turning work away)
                for p in range(n_path):
                    d = a_dst[path[p]]
                    if n_left[d] == 0 or load[d] >= budget:
                        if hungry[d]:
                            hungry[d] = False
                            n_hungry -= 1
                        continue
                    k = first_small[d]            # its smallest delivery left no longer fits: it
                    while left[small[k]] == 0:    # cannot read again in this wave, whatever the
                        k += 1                    # cap (load only grows)
                    first_small[d] = k
                    if load[d] + size[a_blk[small[k]]] > budget:
                        if hungry[d]:
                            hungry[d] = False
                            n_hungry -= 1
                    elif comp[d] != 0.0:
                        if mins_at[d] != wave_no:  # least work d still has to do (read once a wave)
                            k = first_left[d]
                            end = need_ptr[d + 1]
                            while k < end and left[light[k]] == 0:
                                k += 1
                            first_left[d] = k
                            mins[d] = a_work[light[k]] if k < end else 0.0
                            mins_at[d] = wave_no
                        if comp[d] + mins[d] > cap:
                            if hungry[d]:
                                hungry[d] = False
                                n_hungry -= 1
                            capped = True
            if touched:                           # keep the readers still to serve, in order
                kept = r0
                for q in range(r0, r0 + m):
                    a = rd_a[q]
                    if left[a] != 0:
                        rd_a[kept] = a
                        kept += 1
                pend_len[j] = kept - r0
        for x in ranks:                           # own blocks fill spare work
            end = own_hi[x]
            while own_pos[x] < end:
                i = own_pos[x]
                if comp[x] != 0.0 and comp[x] + own_work[i] > cap:
                    break
                comp_i[n_comp] = i
                comp_x[n_comp] = x
                n_comp += 1
                comp[x] += own_work[i]
                own_pos[x] += 1
                own_left -= 1
            if own_pos[x] < end:
                capped = True
        carried_ptr = _grow(carried_ptr, wave_no + 2)
        comp_ptr = _grow(comp_ptr, wave_no + 2)
        carried_ptr[wave_no + 1] = n_carried
        comp_ptr[wave_no + 1] = n_comp
        # load: the bytes each rank receives in the wave (every carried transfer once)
        pace += max(comp.max() / work_all, load.max() / bytes_all)
        wave_no += 1
    return (carried_ptr[:wave_no + 1].copy(), carried[:n_carried].copy(), comp_ptr[:wave_no + 1].copy(),
            comp_i[:n_comp].copy(), comp_x[:n_comp].copy(), pace, capped)


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
    return replace(plan, rounds=tuple(tuple(rounds[r]) for r in wave.rounds), name=f"{plan.name}/wave",
                   backward=None)   # waves are of the plan the backward walks: its own


def first_fetch(plan: Plan, wave: Wave, kept: Mapping[int, Collection[Block]]) -> Wave:
    """The part of ``plan``'s first wave that is re-sent when some ranks kept theirs from the forward
    (``kept``: rank -> the blocks it kept; Note [Backward waves], "The first wave"). A transfer goes
    again when its receiver computes the block in the wave and did not keep it, or forwards it on
    a transfer that goes again (a relay that kept a block sends it from what it kept). Same
    computes as ``wave``; reads only the wave, so every rank and the cost model cut it alike.
    Walked backwards over the wave's columns, a (block, rank) pair as ``block number * R + rank``;
    a wave of columns gives one (Note [Waves as columns])."""
    _, src, dst, owner, chunk, part = wave_columns(plan, wave)
    number, rank = wave_compute_columns(plan, wave)
    R = max(plan.ranks) + 1
    block = plan.block_numbers(owner, chunk, part)                      # [transfers of the wave]
    b, s, d, o = block.tolist(), src.tolist(), dst.tolist(), owner.tolist()
    computes = set((number * R + rank).tolist())
    col = _block_column(plan)
    held = {col(blk) * R + r for r, blocks in kept.items() for blk in blocks}
    wanted: set[int] = set()                      # block * R + rank: the rank must hold it again
    again: list[int] = []                         # places in the wave's transfers, last first
    for k in range(len(b) - 1, -1, -1):
        key = b[k] * R + d[k]
        if key in held or (key not in computes and key not in wanted):
            continue
        again.append(k)
        if s[k] != o[k]:
            wanted.add(b[k] * R + s[k])
    again.reverse()
    if wave.plan_index is None:    # a wave built from its transfers: cut them
        return Wave(tuple(wave.transfers[k] for k in again), wave.computes, None, wave.compute_index)
    return Wave.of_plan(plan, wave.plan_index[np.array(again, dtype=np.int64)], (number, rank))


def wave_compute_columns(plan: Plan, wave: Wave) -> tuple[np.ndarray, np.ndarray]:
    """``(block numbers, global ranks)``, int64: the wave's computes as columns (block numbers in
    ``plan.blocks()`` order), from ``Wave.compute_index`` where the packing gave it, else read from
    its ``computes`` (in no particular order)."""
    if wave.compute_index is not None:
        return wave.compute_index
    col = _block_column(plan)
    pairs = list(wave.computes)
    return (np.fromiter((col(b) for b, _ in pairs), dtype=np.int64, count=len(pairs)),
            np.fromiter((x for _, x in pairs), dtype=np.int64, count=len(pairs)))


def wave_columns(plan: Plan, wave: Wave) -> tuple[np.ndarray, ...]:
    """``(round, src, dst, owner, chunk, part)`` int64 columns of the wave's transfers, in its
    order: rows of ``plan.transfer_columns()`` where the wave knows its places in the plan
    (``Wave.plan_index``), else read from its transfers."""
    if wave.plan_index is not None:
        return tuple(col[wave.plan_index] for col in plan.transfer_columns())
    T = len(wave.transfers)
    ts = [t for _, t in wave.transfers]
    return (np.fromiter((r for r, _ in wave.transfers), dtype=np.int64, count=T),
            *(np.fromiter(map(attrgetter(f), ts), dtype=np.int64, count=T)
              for f in ("src", "dst", "block.owner", "block.chunk", "block.part")))


# ---- keep or resend (Note [Backward KV modes] in megatron_fcp.schedule.program) ----------------
BACKWARD_KV_MODES = ("auto", "keep", "resend")
RING_BUDGET = -1
"""``kv_memory_budget`` value meaning "what the ring holds": one KV pair the size of the rank's shard."""


def kept_bytes_per_rank(plan: Plan, block_bytes: Callable[[Block], int]) -> dict[int, int]:
    """Bytes of received KV each rank would save for backward under ``keep`` (its need set): the
    need matrix (``[cp, blocks]``, columns in ``plan.blocks()`` order) times the blocks' bytes."""
    kept = plan.need_matrix().astype(np.int64) @ block_sizes(plan, block_bytes)   # [cp]
    return dict(zip(plan.ranks, kept.tolist()))


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
    cache, key = memo(plan), ("backward_kv", budget, cache_key)   # Note [Caches live with their object]
    hit = cache.get(key) if cache_key is not None else None
    if hit is not None:
        return hit
    kept = kept_bytes_per_rank(plan, block_bytes)
    own = own_block_bytes(plan, block_bytes) if budget == RING_BUDGET else None
    decision = "keep"
    for r in plan.ranks:
        limit = budget if own is None else own[r]
        if kept[r] > limit:
            decision = "resend"
            break
    if cache_key is not None:
        cache[key] = decision
    return decision
