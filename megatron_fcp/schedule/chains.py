"""The streaming backward of a plan whose blocks travel in chains (the ring). Pure, no ``torch``.

Note [Streaming chain backward]
-------------------------------
In a ring plan every block travels a *chain*: its owner sends it to one rank, that rank forwards
it to one more, and so on to its last reader (no rank sends a block twice). The wave backward
(Note [Backward waves] in :mod:`megatron_fcp.attention.backward_waves`) re-sends each wave's
blocks from their owners and returns every partial along the whole path, so a block read k hops
away crosses k links twice in *every* wave that needs it: on a ring of n ranks the backward moves
O(n^2) blocks per link where Transformer Engine's ring moves O(n) (priced: pcie-box, one node,
cp = 8, 128K, GQA 32:8: 0.289 s against the one-pass ring's 0.110 s). A chain streams instead, as
TE's ring does: each rank passes the block on once and the dK/dV partial follows it, one hop
behind, accumulating::

    owner v0 -> v1 -> ... -> vk          KV (resend only: the forward's transfers again)
    acc_1 = p_1; acc_i = p_i + acc_(i-1) (FP32, sent in the input dtype: rounded once per hop)
    vk -> v0                             the chain's sum goes home; the owner adds its own partial

**Steps.** The plan's rounds are cut into *sub-rounds* in plan order, each bringing a rank at most
one shard's K and V (:func:`chain_budget`; a larger block alone). With J sub-rounds the backward
runs steps 0 .. J+1; step s posts one round of messages, computes, then waits for them:

* KV: sub-round s's transfers (resend only; under ``keep`` the blocks come from the forward), but
  not a hop past a block's last reader (a plan may carry it on; backward has no use for it);
* compute: the blocks received in sub-round s-1 that the rank reads (plan order), and the rank's
  own blocks where they fit (below, "Own blocks");
* partials: for a hop ``v_i -> v_(i+1)`` of sub-round j (i >= 1), ``acc_i`` at step j+1: v_i
  computed its partial at step j_i + 1 <= j and received ``acc_(i-1)`` at the end of that step;
  no message while no rank of v_1..v_i reads the block (pure relays so far);
* home: ``vk -> v0`` at step j_k + 2, when vk has its partial and ``acc_(k-1)``.

**The first sub-round.** Step 0 above only brings KV: nothing to compute until it lands. TE's ring
avoids that step by saving the forward's last received KV for its backward. Here the forward may
keep what a rank receives in the first sub-round (``first_kept``; at most one shard): the steps
then shift by one (KV of sub-round j at step j-1, its compute at step j, ``acc`` at step j_(i+1),
home at j_k + 1): J+1 steps, TE's count. ``keep`` always runs this way (everything is kept);
``auto`` does when every rank's first sub-round fits ``--fcp-kv-memory-budget`` (the ring's: the
largest shard, the receive buffer a ring relays every shard through; :func:`keep_limits`); an
explicit ``resend`` keeps nothing and pays the step. The jobs and
their order are the same in every variant, so ``keep``, ``resend`` and ``auto`` agree bit for bit
(a relay's ``p_i + acc_(i-1)`` is one IEEE addition: the same whichever arrives first).

**Own blocks.** A rank's own K and V are there from the start and their partials go nowhere, so
their jobs may run at any step that computes anyway, among the steps after the first sub-round's
compute (whose partials start the chains), counted from that sub-round so that every backward KV
mode places alike (a re-sending ring without the first sub-round kept has one step more in front,
KV only, which gets none). Two ways to place them:

* *whole*: each rank's own blocks together, in the step where the rank has the least work so far
  (ties: the later step). They are one owner's blocks, so they cost one kernel call there.
* *spread*: each own block on its own, larger first, to the step where the rank has the least work
  so far (ties: the later step). Each step it touches costs the rank one more call.

A plan over Transformer Engine's packed layout (``placement.layout == "thd"``) places *whole*, as
TE's ring computes its own chunks in one call; every other plan places *spread*. Why spread: a step
lasts the longer of its busiest rank's compute and its messages. Compute piled on one step makes
that step compute-bound while the steps before it leave link time unused. A head-parallel stage
ring staggered over several rounds computes a sliver of remote work per step and owns ``a``
members' chunks; there spreading lets message-bound steps take the own work. Ties send a zigzag
ring's own chunks to the last step, as TE's ring computes them. Why whole on TE's layout: every
step is the same ring round, and *spread* put the own blocks of different ranks in three
different steps (their real shards differ by a few tokens of padding), each with one more call:
10-15 us over TE's price at cp = 16 and at a cp = 256 stage (32K-token documents; 2026-12-07).
Whole was not made the rule everywhere: over 144 zigzag stage rings (cp 8-64, a = 1-8, stagger
1-8, 32K-512K tokens) it priced from 0.8% below to 0.4% above *spread*, and which one wins depends on
the steps' messages, which the plan's backward program does not see (it reads only the plan).
Only where a job runs changes, not which jobs, so every backward KV mode still walks the same jobs
in the same order and agrees bit for bit.

**Memory.** Within backward a rank holds received KV of two sub-rounds (computing and arriving,
counted from the receive buffer's allocation: two shards) plus, with ``first_kept``, the saved
first sub-round (one shard) -- the three shards of KV TE's ring backward holds (its saved buffer
and the two it allocates); partials until they are sent. Between the passes: nothing, or the
first sub-round (TE: its last received shard).

**Balance.** Steps run in lock-step with the forward's rounds, so a rank's work per step is set by
the plan: a zigzag ring (or a head-parallel stage's ring of zigzag chunks) gives every rank one
owner's two chunks per step, equal work; a packed batch's blocks differ and reach ranks at different
steps, and the busiest rank of each step adds up (a cp = 16 packed ring, lognormal 8.0/1.2: 4.1x
the busiest rank's work, 2.2x the waves' backward). :func:`chain_steps` keeps the chain only while the
sum over steps of the busiest rank's work stays within :data:`CHAIN_PACE` of the busiest rank's
total; otherwise the plan runs in waves. (A staggered stage ring's milder imbalance, up to 1.25,
is priced by the lock-step cost model like any other step.) The test
reads only the plan, so every rank and the cost model decide alike.

**Cost** (:func:`chain_timeline`): lock-step like the model of TE's ring
(:func:`~megatron_fcp.cost.backward._ring_backward`): each step lasts the longer of its
busiest rank's compute (one kernel call per owner with work, as TE computes a step's KV pair in one
call and as the executor runs it: Note [One launch per owner and stage] in
:mod:`megatron_fcp.schedule.launches`) and its
messages' time under contention. With the first sub-round kept a zigzag ring (a = 1) or a
head-parallel stage ring (a = ranks per node) prices exactly as TE's p2p or a2a+p2p backward, or
less where the ring prunes relays past a block's last reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import numpy as np

from megatron_fcp.contract.blocks import Block, Transfer
from megatron_fcp.contract.plan import Plan
from megatron_fcp.jit import isin_ints, unique_ints
from megatron_fcp.memo import memo
from megatron_fcp.schedule.waves import (RING_BUDGET, BlockBytes, Wave, block_work, first_fetch, own_block_bytes,
                                         plan_waves, wave_budget, wave_columns, wave_compute_columns)

__all__ = ["CHAIN_PACE", "ChainStep", "chain_budget", "chain_routes", "chain_steps", "is_chain_plan",
           "first_kept_blocks", "first_kept_bytes", "first_keepers", "first_received", "first_wave_fetch", "keep_limits"]


@dataclass(frozen=True)
class ChainStep:
    """One step of the streaming chain backward (Note [Streaming chain backward]). Every rank
    derives the same steps from the plan, so the i-th message between a pair matches in order."""

    kv: tuple[Transfer, ...]                  # KV hops (resend), plan order
    grad: tuple[Transfer, ...]                # accumulated dK/dV partial, v_i -> v_(i+1)
    home: tuple[Transfer, ...]                # a chain's sum, its last reader -> the owner
    computes: tuple[tuple[Block, int], ...]   # (block, rank): gradient jobs of the step, in order


def chain_budget(plan: Plan, block_bytes: Callable[[Block], int]) -> int:
    """The largest shard's K and V: a sub-round brings a rank at most that, so two sub-rounds alive
    hold what Transformer Engine's ring backward allocates (two buffers of one shard's KV): the
    waves' budget (:func:`~megatron_fcp.schedule.waves.wave_budget`)."""
    return wave_budget(plan, block_bytes)


def chain_routes(plan: Plan) -> dict[Block, tuple[tuple[int, Transfer], ...]] | None:
    """Each block's transfers in plan order when every block travels a chain (its owner and each
    reader send it at most once, each hop from the rank the block last reached), else None."""
    num = _numbered(plan)
    if num is None:
        return None
    return {num.blocks[i]: tuple((num.rnd[k], num.ts[k]) for k in num.routes[i]) for i in num.order}


def is_chain_plan(plan: Plan) -> bool:
    """``chain_routes(plan) is not None``, from the plan's numbering (computed once per plan object)."""
    return _numbered(plan) is not None


class _Numbered:
    """A chain plan's transfers numbered once (:func:`_numbered`): ``ts[k]``, ``rnd[k]`` and the
    block number ``tb[k]`` of the k-th transfer in plan order; ``blocks`` in :meth:`Plan.blocks`
    order (block numbers index it); ``routes[i]``: block i's transfer numbers in plan order;
    ``order``: the block numbers that travel, by first send."""

    __slots__ = ("ts", "rnd", "tb", "blocks", "bid", "pos", "routes", "order")

    def __init__(self, ts, rnd, tb, blocks, bid, pos, routes, order) -> None:
        self.ts, self.rnd, self.tb, self.blocks, self.bid = ts, rnd, tb, blocks, bid
        self.pos, self.routes, self.order = pos, routes, order


def _numbered(plan: Plan) -> _Numbered | None:
    """The plan's transfers numbered, or None when its blocks do not all travel chains (a plan with
    no transfers is one, vacuously); memoised per plan object (it reads only the plan)."""
    cache = memo(plan)                                    # Note [Caches live with their object]
    hit = cache.get("numbered", _MISS)
    if hit is not _MISS:
        return hit
    if not _travels_chains(plan):   # over the plan's columns: no Transfer objects for a tree plan
        cache["numbered"] = None
        return None
    blocks = plan.blocks()
    bid = {b: i for i, b in enumerate(blocks)}
    at = [b.owner for b in blocks]                     # the rank each block last reached
    routes: list[list[int]] = [[] for _ in blocks]
    order: list[int] = []
    ts: list[Transfer] = []
    rnd: list[int] = []
    tb: list[int] = []
    out: _Numbered | None = None
    for r, t in plan.transfers():
        i = bid[t.block]
        if t.src != at[i]:
            break
        at[i] = t.dst
        if not routes[i]:
            order.append(i)
        routes[i].append(len(ts))
        ts.append(t)
        rnd.append(r)
        tb.append(i)
    else:
        out = _Numbered(ts, rnd, tb, blocks, bid, {x: j for j, x in enumerate(plan.ranks)}, routes, order)
    cache["numbered"] = out
    return out


_MISS = object()   # not computed yet (None is an answer: not a chain plan)


def _travels_chains(plan: Plan) -> bool:
    """Whether every block of ``plan`` travels a chain: in plan order, each of its transfers leaves
    from where the block last arrived (its owner first). The test :func:`_numbered` makes transfer
    by transfer, over the plan's columns (a tree plan's multicast fails it at once, and a plan at
    cp = 256 has ~10^5 transfers to build objects for)."""
    _, src, dst, owner, chunk, part = plan.transfer_columns()           # [T], plan order
    if not len(src):
        return True
    block = plan.block_numbers(owner, chunk, part)                      # [T]
    order = np.argsort(block, kind="stable")                            # by block, plan order within
    b, s, d, o = block[order], src[order], dst[order], owner[order]
    first = np.ones(len(b), dtype=bool)
    first[1:] = b[1:] != b[:-1]
    came_from = np.where(first, o, np.roll(d, 1))                       # owner, or the previous hop's dst
    return bool((s == came_from).all())


def _sub_rounds(plan: Plan, num: _Numbered, size: list[int], budget: int) -> list[int]:
    """Sub-round index of every transfer (by number): each plan round cut, in plan order, so that a
    rank receives at most ``budget`` bytes per sub-round (a larger block alone)."""
    sub = [0] * len(num.ts)
    base = k = 0
    tb = num.tb
    for rnd in plan.rounds:
        slot: dict[int, int] = {}       # dst -> its current sub-round (relative)
        got: dict[int, int] = {}        # dst -> bytes in it
        for t in rnd:
            n, d = size[tb[k]], t.dst
            j, g = slot.get(d, 0), got.get(d, 0)
            if g and g + n > budget:
                j, g = j + 1, 0
            slot[d], got[d] = j, g + n
            sub[k] = base + j
            k += 1
        base += max(slot.values(), default=-1) + 1
    return sub


def chain_steps(plan: Plan, block_bytes: Callable[[Block], int], budget: int | None = None, *,
                cache_key: Hashable = None, pace: float | None = None,
                first_kept: bool = False) -> tuple[ChainStep, ...] | None:
    """The steps of Note [Streaming chain backward], or None when the plan's blocks do not all
    travel chains, nothing travels, or the steps would unbalance the work (:data:`CHAIN_PACE`).
    ``block_bytes``: one block's K and V; ``budget``: bytes a rank receives per sub-round (default
    :func:`chain_budget`, the largest shard). cache_key: what ``block_bytes``
    depends on besides the plan; with it the steps are computed once per plan object and key.
    ``pace``: the balance limit (default :data:`CHAIN_PACE`; ``math.inf`` keeps any chain plan).
    ``first_kept``: the first sub-round's blocks are kept from the forward (Note [Streaming chain
    backward], "The first sub-round"): one step fewer. Both variants come from one build: without
    the kept first sub-round the steps are those with it, behind one step that only brings
    sub-round 0's KV (the jobs, their order and the own blocks' places are the same)."""
    pace = CHAIN_PACE if pace is None else pace
    cache, key = memo(plan), ("chain_steps", budget, cache_key, pace)   # Note [Caches live with their object]
    hit = cache.get(key) if cache_key is not None else None
    if hit is not None:
        kept, first = hit
    else:
        basis = _basis(plan, block_bytes, budget, cache_key)
        kept = _build(plan, basis, pace)
        first = None if basis is None else basis.first
        if cache_key is not None:
            cache[key] = (kept, first)
    if kept is None or first_kept:
        return kept
    return (ChainStep(first, (), (), ()),) + kept




class _Basis:
    """What :func:`_build` and :func:`first_received` share for one plan, budget and block sizes:
    the numbering, each transfer's sub-round, whether its destination reads the block
    (``reads``), whether the backward needs the hop at all (``live``: a reader at or after its
    destination; a plan may carry a block on past its last reader), and sub-round 0's live
    transfers in plan order (``first``)."""

    __slots__ = ("num", "sub", "reads", "live", "first")

    def __init__(self, num: _Numbered, sub: list[int], reads: list[bool], live: list[bool]) -> None:
        self.num, self.sub, self.reads, self.live = num, sub, reads, live
        self.first = tuple(num.ts[k] for k in range(len(sub)) if sub[k] == 0 and live[k])


def _basis(plan: Plan, block_bytes: Callable[[Block], int], budget: int | None,
           cache_key: Hashable = None) -> _Basis | None:
    """The :class:`_Basis` of a chain plan, or None when it is not one; computed once per plan
    object, budget and ``cache_key`` (with one)."""
    cache, key = memo(plan), ("chain_basis", budget, cache_key)   # Note [Caches live with their object]
    hit = cache.get(key, _MISS) if cache_key is not None else _MISS
    if hit is not _MISS:
        return hit
    num = _numbered(plan)
    out = None
    if num is not None and num.ts:                                     # nothing travels: no steps
        size = [block_bytes(b) for b in num.blocks]
        sub = _sub_rounds(plan, num, size, chain_budget(plan, block_bytes) if budget is None else budget)
        need = [{num.bid[b] for b in plan.needs(x)} for x in plan.ranks]      # [rank position] -> block numbers
        pos = num.pos
        reads = [i in need[pos[t.dst]] for t, i in zip(num.ts, num.tb)]
        live = [False] * len(reads)
        for i in num.order:
            read = False
            for k in reversed(num.routes[i]):
                read = read or reads[k]
                live[k] = read
        out = _Basis(num, sub, reads, live)
    if cache_key is not None:
        cache[key] = out
    return out


def _build(plan: Plan, basis: _Basis | None, pace: float) -> tuple[ChainStep, ...] | None:
    """The steps with the first sub-round kept (KV of sub-round j at step j - 1, its compute at step
    j), or None where the plan is no chain (``basis`` None) or the steps exceed ``pace``. Works on
    numbers (:class:`_Basis`); the steps hold the plan's own transfer objects."""
    if basis is None:
        return None
    num, sub, reads, live = basis.num, basis.sub, basis.reads, basis.live
    ts, tb, pos = num.ts, num.tb, num.pos
    S = max(sub) + 2                                             # steps 0 .. J
    kv: list[list[int]] = [[] for _ in range(S)]                 # transfer numbers
    grad: list[list[int]] = [[] for _ in range(S)]
    home: list[list[int]] = [[] for _ in range(S)]               # the last hop's number: its dst sends home
    comp: list[list[tuple[int, int]]] = [[] for _ in range(S)]   # (block number, rank position)
    for k, t in enumerate(ts):                                   # plan order within each step
        s = sub[k]
        if live[k] and s:                                        # sub-round 0 came with the forward
            kv[s - 1].append(k)
        if reads[k]:
            comp[s].append((tb[k], pos[t.dst]))
    for i in num.order:
        route = num.routes[i]
        read = False
        last = len(route) - 1
        for n, k in enumerate(route):
            read = read or reads[k]
            if not read:
                continue
            if n < last:                                         # acc_i: v_i -> v_(i+1), one step behind the KV
                nxt = route[n + 1]
                grad[sub[nxt]].append(nxt)
            else:
                home[sub[k] + 1].append(k)
    work = _work_table(plan, num)
    comp = _place_own(comp, plan, num, work, first=1)            # after sub-round 0's compute, in every mode
    if _pace(comp, work) > pace:
        return None
    blocks, ranks = num.blocks, plan.ranks
    return tuple(ChainStep(tuple(ts[k] for k in kv[s]), tuple(ts[k] for k in grad[s]),
                           tuple(Transfer(ts[k].dst, ts[k].block.owner, ts[k].block) for k in home[s]),
                           tuple((blocks[i], ranks[x]) for i, x in comp[s])) for s in range(S))


def _work_table(plan: Plan, num: _Numbered) -> Callable[[int, int], float]:
    """``work(rank position, block number)``: :func:`~megatron_fcp.schedule.waves.block_work`,
    memoised on numbers."""
    work_of, memo, blocks, ranks = block_work(plan), {}, num.blocks, plan.ranks
    span = len(ranks)

    def work(x: int, i: int) -> float:
        k = i * span + x
        w = memo.get(k)
        if w is None:
            w = memo[k] = work_of(ranks[x], blocks[i])
        return w

    return work


def _place_own(comp: list[list[tuple[int, int]]], plan: Plan, num: _Numbered, work: Callable[[int, int], float],
               first: int) -> list[list[tuple[int, int]]]:
    """``comp`` [step][(block number, rank position)] with every rank's own blocks added in the steps
    from ``first`` on: *whole* over Transformer Engine's layout, else *spread* (Note [Streaming chain
    backward], "Own blocks"). Reads only the plan: every rank and the cost model place alike."""
    S = len(comp)
    loads = [[0] * S for _ in plan.ranks]                        # each rank's work per step, one pass
    for s in range(S):
        for i, x in comp[s]:
            loads[x][s] += work(x, i)
    steps = range(first, S)
    own = [sorted((num.bid[b] for b in plan.local_blocks(r)), key=lambda i: -work(x, i))
           for x, r in enumerate(plan.ranks)]                    # larger first, ties in plan order
    whole = plan.placement is not None and plan.placement.layout == "thd"
    out = [list(c) for c in comp]
    for x, blocks in enumerate(own):
        load = loads[x]
        if whole and blocks:
            out[min(steps, key=lambda j: (load[j], -j))].extend((i, x) for i in blocks)
            continue
        for i in blocks:
            s = min(steps, key=lambda j: (load[j], -j))
            out[s].append((i, x))
            load[s] += work(x, i)
    return out


def first_received(plan: Plan, block_bytes: Callable[[Block], int], *,
                   cache_key: Hashable = None) -> dict[int, tuple[Block, ...]]:
    """Blocks each rank receives in the first sub-round that backward needs (it reads them or
    passes them on to a reader), in plan order: what ``first_kept`` keeps from the forward (the
    plan's chains; empty for a plan that is not one)."""
    basis = _basis(plan, block_bytes, None, cache_key)
    if basis is None:
        return {}
    out: dict[int, list[Block]] = {}
    for t in basis.first:
        out.setdefault(t.dst, []).append(t.block)
    return {r: tuple(b) for r, b in out.items()}


def first_kept_blocks(plan: Plan, block_bytes: Callable[[Block], int], *,
                      cache_key: Hashable = None) -> dict[int, tuple[Block, ...]]:
    """What each rank would keep from the forward for the backward's first step: a chain plan's
    first sub-round (:func:`first_received`, relayed blocks too: they go on from there), any other
    plan's first wave of received deliveries (Note [Backward waves]). cache_key: as
    :func:`~megatron_fcp.schedule.waves.plan_waves`'s; with it the answer is computed once per plan
    object and key (the program asks three times), and is shared: read it, do not change it."""
    return _first_kept(plan, block_bytes, cache_key)[0]


def first_kept_bytes(plan: Plan, block_bytes: Callable[[Block], int], *,
                     cache_key: Hashable = None) -> dict[int, int]:
    """Per rank with any, the bytes of its :func:`first_kept_blocks` (``block_bytes`` summed; exact
    integers), cached with them."""
    return _first_kept(plan, block_bytes, cache_key)[1]


def _first_kept(plan: Plan, block_bytes: Callable[[Block], int],
                cache_key: Hashable) -> tuple[dict[int, tuple[Block, ...]], dict[int, int]]:
    """:func:`first_kept_blocks` and :func:`first_kept_bytes`, computed together."""
    cache, key = memo(plan), ("first_kept", cache_key)   # Note [Caches live with their object]
    hit = cache.get(key) if cache_key is not None else None
    if hit is not None:
        return hit
    if chain_steps(plan, block_bytes, cache_key=cache_key) is not None:
        got = first_received(plan, block_bytes, cache_key=cache_key)
        nbytes = {r: sum(block_bytes(b) for b in bs) for r, bs in got.items()}
    else:
        waves = plan_waves(plan, block_bytes, cache_key=cache_key)
        x, block = _first_deliveries(plan, waves[0]) if waves else (np.zeros(0, np.int64),) * 2
        blocks = plan.blocks()
        out: dict[int, list[Block]] = {}
        for r, i in zip(x.tolist(), block.tolist()):
            out.setdefault(r, []).append(blocks[i])
        got = {r: tuple(b) for r, b in out.items()}
        if isinstance(block_bytes, BlockBytes) and block_bytes.plan is plan:   # every block's bytes at once
            sizes = block_bytes.array()
            total = np.zeros(max(plan.ranks) + 1, dtype=sizes.dtype)           # [global ranks]
            np.add.at(total, x, sizes[block])                                  # in plan order, as the sum
            nbytes = {r: total[r].item() for r in got}
        else:
            nbytes = {r: sum(block_bytes(b) for b in bs) for r, bs in got.items()}
    if cache_key is not None:
        cache[key] = (got, nbytes)
    return got, nbytes


def _first_deliveries(plan: Plan, wave: Wave) -> tuple[np.ndarray, np.ndarray]:
    """``(ranks, block numbers)`` of each delivery of ``wave`` that its receiver computes there, at
    its first transfer, in plan order: :func:`first_kept_blocks`'s walk over the wave's columns."""
    _, _, dst, owner, chunk, part = wave_columns(plan, wave)
    number, rank = wave_compute_columns(plan, wave)
    R = max(plan.ranks) + 1
    block = plan.block_numbers(owner, chunk, part)                            # [transfers of the wave]
    key = block * R + dst
    span = len(plan.blocks()) * R
    first = np.zeros(len(key), dtype=bool)
    first[unique_ints(key, span)[1]] = True                                   # a key's first transfer
    keep = np.flatnonzero(first & isin_ints(key, number * R + rank, span))    # plan order
    return dst[keep], block[keep]


def first_keepers(requested: str, decided: str, plan: Plan, block_bytes: Callable[[Block], int],
                  kv_memory_budget: int = RING_BUDGET, *, cache_key: Hashable = None) -> frozenset[int]:
    """The ranks whose backward starts from their first step's KV kept from the forward (a chain's
    first sub-round, Note [Streaming chain backward], "The first sub-round"; another plan's first
    wave, Note [Backward waves], "The first wave"). ``requested``: ``--fcp-backward-kv``;
    ``decided``: what :func:`~megatron_fcp.schedule.waves.choose_backward_kv` made of it. ``keep``:
    every rank (everything is kept); an explicit ``resend``: none; ``auto`` deciding ``resend``: each
    rank whose part (:func:`first_kept_blocks`) fits ``kv_memory_budget`` (:func:`keep_limits`;
    Transformer Engine's ring saves its last received shard) -- for a chain plan all ranks
    or none (its steps shift for everyone at once), for waves each rank on its own (the others'
    part of the first wave is re-sent: :func:`~megatron_fcp.schedule.waves.first_fetch`). Reads
    only the plan and block sizes: every rank and the cost model decide alike."""
    if decided == "keep":
        return frozenset(plan.ranks)
    if requested != "auto":
        return frozenset()
    got = first_kept_bytes(plan, block_bytes, cache_key=cache_key)
    limit = keep_limits(plan, block_bytes, kv_memory_budget)
    fits = frozenset(r for r in plan.ranks if got.get(r, 0) <= limit[r])
    if len(fits) < len(plan.ranks) and chain_steps(plan, block_bytes, cache_key=cache_key) is not None:
        return frozenset()
    return fits


def keep_limits(plan: Plan, block_bytes: Callable[[Block], int], kv_memory_budget: int = RING_BUDGET) -> dict[int, int]:
    """Per rank, the most received KV bytes it may keep from the forward for its first step under
    ``auto`` (:func:`first_keepers`): ``kv_memory_budget``, or under :data:`RING_BUDGET` what
    Transformer Engine's ring saves, its last received shard: for a plan that waves, the rank's own
    shard's K and V; for a chain plan (a ring), the largest shard's. A ring relays every shard
    through one receive buffer, so the buffer holds the largest. TE's ring on its packed layout
    pads every shard to one size, at least the largest real one; there an own-shard limit left the
    ranks whose real shard was a few tokens short unable to keep, and cost every rank a step. (On
    FCP's own placements, whose shards differ by up to about 1%, the largest may be that much over
    TE's padded shard of the same batch.)"""
    if kv_memory_budget != RING_BUDGET:
        return dict.fromkeys(plan.ranks, kv_memory_budget)
    own = own_block_bytes(plan, block_bytes)
    if is_chain_plan(plan) and own:
        return dict.fromkeys(plan.ranks, max(own.values()))
    return own


def first_wave_fetch(plan: Plan, block_bytes: Callable[[Block], int], keepers: frozenset[int], *,
                     cache_key: Hashable = None) -> Wave | None:
    """A wave plan's first wave cut to what is re-sent when only ``keepers`` (:func:`first_keepers`,
    neither none nor all) kept theirs (:func:`~megatron_fcp.schedule.waves.first_fetch`); None when
    nothing or everything was kept, or the plan streams as chains."""
    if not keepers or len(keepers) == len(plan.ranks) or \
            chain_steps(plan, block_bytes, cache_key=cache_key) is not None:
        return None
    waves = plan_waves(plan, block_bytes, cache_key=cache_key)
    if not waves:
        return None
    got = first_kept_blocks(plan, block_bytes, cache_key=cache_key)
    return first_fetch(plan, waves[0], {r: got.get(r, ()) for r in keepers})


CHAIN_PACE = 1.5
"""The most a chain backward's steps may add to the busiest rank's work (:func:`_pace`); above it
the plan runs in waves (Note [Streaming chain backward], "Balance"): zigzag rings are at 1.0,
head-parallel stage rings staggered over 2-8 rounds at 1.06-1.25, packed batches' rings at 4-14."""


def _pace(comp: list[list[tuple[int, int]]], work: Callable[[int, int], float]) -> float:
    """Sum over steps of the busiest rank's work in the step, over the busiest rank's total: 1.0 when
    the steps keep every rank in step (a zigzag ring: each step a rank computes one owner's two
    chunks, work 2 either way), more when big blocks reach different ranks at different steps."""
    total: dict[int, float] = {}
    steps = 0.0
    for jobs in comp:
        busy: dict[int, float] = {}
        for i, x in jobs:
            w = work(x, i)
            busy[x] = busy.get(x, 0.0) + w
            total[x] = total.get(x, 0.0) + w
        steps += max(busy.values(), default=0.0)
    top = max(total.values(), default=0.0)
    return steps / top if top else 1.0
