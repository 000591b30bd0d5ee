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
``auto`` does when every rank's first sub-round fits ``--fcp-kv-memory-budget`` (the ring's: its own
shard; :func:`first_keepers`); an explicit ``resend`` keeps nothing and pays the step. The jobs and
their order are the same in every variant, so ``keep``, ``resend`` and ``auto`` agree bit for bit
(a relay's ``p_i + acc_(i-1)`` is one IEEE addition: the same whichever arrives first).

**Own blocks.** A rank's own K and V are there from the start and their partials go nowhere, so
their jobs may run at any step that computes anyway. :func:`_place_own` gives each own block,
larger first, to the step where the rank has the least work so far (ties: the later step), among
the steps after the first sub-round's compute (whose partials start the chains), counted from that
sub-round so that every backward KV mode places alike (a re-sending ring without the first
sub-round kept has one step more in front, KV only, which gets none). Why: a step lasts the longer
of its busiest rank's compute and its messages, so compute piled on one step (all own blocks at the
last one) makes that step compute-bound while the steps before it leave link time unused; a
head-parallel stage ring staggered over several rounds, which computes a sliver of remote work per
step and owns ``a`` members' chunks, is the case where it matters. A zigzag ring's steps carry
equal work, so ties send its own chunks to the last step, as TE's ring computes them. Only where a
job runs changes, not which jobs, so every backward KV mode still walks the same jobs in the same
order and agrees bit for bit.

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
busiest rank's compute (one kernel launch per owner, as TE's model charges one per step) and its
messages' time under contention. With the first sub-round kept a zigzag ring (a = 1) or a
head-parallel stage ring (a = ranks per node) prices exactly as TE's p2p or a2a+p2p backward, or
less where the ring prunes relays past a block's last reader.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Hashable

from megatron_fcp.contract.blocks import Block, Transfer
from megatron_fcp.contract.plan import Plan
from megatron_fcp.schedule.waves import RING_BUDGET, Wave, block_work, first_fetch, plan_waves, wave_budget

__all__ = ["CHAIN_PACE", "ChainStep", "chain_budget", "chain_routes", "chain_steps",
           "first_kept_blocks", "first_keepers", "first_received", "first_wave_fetch"]


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
    hold what Transformer Engine's ring backward allocates (two buffers of one shard's KV)."""
    return 2 * wave_budget(plan, block_bytes)


def chain_routes(plan: Plan) -> dict[Block, tuple[tuple[int, Transfer], ...]] | None:
    """Each block's transfers in plan order when every block travels a chain (its owner and each
    reader send it at most once, each hop from the rank the block last reached), else None."""
    routes: dict[Block, list[tuple[int, Transfer]]] = {}
    for r, t in plan.transfers():
        hops = routes.setdefault(t.block, [])
        at = hops[-1][1].dst if hops else t.block.owner
        if t.src != at:
            return None
        hops.append((r, t))
    return {b: tuple(h) for b, h in routes.items()}


def _sub_rounds(plan: Plan, block_bytes: Callable[[Block], int], budget: int) -> dict[Transfer, int]:
    """Sub-round index of every transfer: each plan round cut, in plan order, so that a rank
    receives at most ``budget`` bytes per sub-round (a larger block alone)."""
    sub: dict[Transfer, int] = {}
    base = 0
    for rnd in plan.rounds:
        slot: dict[int, int] = {}       # dst -> its current sub-round (relative)
        got: dict[int, int] = {}        # dst -> bytes in it
        for t in rnd:
            n = block_bytes(t.block)
            j = slot.get(t.dst, 0)
            if got.get(t.dst, 0) and got[t.dst] + n > budget:
                j, got[t.dst] = j + 1, 0
            slot[t.dst] = j
            got[t.dst] = got.get(t.dst, 0) + n
            sub[t] = base + j
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
    backward], "The first sub-round"): one step fewer."""
    pace = CHAIN_PACE if pace is None else pace
    key = (id(plan), budget, cache_key, pace, first_kept)
    hit = _STEPS.get(key)
    if cache_key is not None and hit is not None and hit[0]() is plan:
        return hit[1]
    steps = _build(plan, block_bytes, budget, pace, first_kept, cache_key)
    if cache_key is not None:
        if len(_STEPS) > 1024:
            _STEPS.clear()
        _STEPS[key] = (weakref.ref(plan), steps)
    return steps


_STEPS: dict[tuple, tuple[weakref.ref, tuple[ChainStep, ...] | None]] = {}


def _basis(plan: Plan, block_bytes: Callable[[Block], int], budget: int | None, cache_key: Hashable = None):
    """``(routes, sub-rounds, needs, live hops)`` of a chain plan, or None when it is not one:
    what :func:`_build` (with or without the kept first sub-round) and :func:`first_received`
    share; computed once per plan object, budget and ``cache_key`` (with one)."""
    key = (id(plan), budget, cache_key)
    hit = _BASIS.get(key)
    if cache_key is not None and hit is not None and hit[0]() is plan:
        return hit[1]
    routes = chain_routes(plan)
    out = None
    if routes:
        sub = _sub_rounds(plan, block_bytes, chain_budget(plan, block_bytes) if budget is None else budget)
        needs = {x: plan.needs(x) for x in plan.ranks}
        out = routes, sub, needs, _live_hops(routes, needs)
    if cache_key is not None:
        if len(_BASIS) > 1024:
            _BASIS.clear()
        _BASIS[key] = (weakref.ref(plan), out)
    return out


_BASIS: dict[tuple, tuple[weakref.ref, tuple | None]] = {}


def _build(plan: Plan, block_bytes: Callable[[Block], int], budget: int | None,
           pace: float, first_kept: bool = False, cache_key: Hashable = None) -> tuple[ChainStep, ...] | None:
    basis = _basis(plan, block_bytes, budget, cache_key)
    if basis is None:
        return None
    routes, sub, needs, live = basis
    J = max(sub.values()) + 1
    d = 0 if first_kept else 1                                   # KV one step ahead of its compute
    S = J + 1 + d                                                # steps 0 .. J (+1 without the kept first)
    kv: list[list[Transfer]] = [[] for _ in range(S)]
    grad: list[list[Transfer]] = [[] for _ in range(S)]
    home: list[list[Transfer]] = [[] for _ in range(S)]
    comp: list[list[tuple[Block, int]]] = [[] for _ in range(S)]
    for _, t in plan.transfers():                                # plan order within each step
        if t in live and sub[t] - 1 + d >= 0:                    # (kept first: sub-round 0 came with the forward)
            kv[sub[t] - 1 + d].append(t)
        if t.block in needs[t.dst]:
            comp[sub[t] + d].append((t.block, t.dst))
    for b, hops in routes.items():
        read = False
        for i, (_, t) in enumerate(hops):
            read = read or t.block in needs[t.dst]
            if i + 1 < len(hops):
                if read:                                         # acc_i: v_i -> v_(i+1), one step behind the KV
                    nxt = hops[i + 1][1]
                    grad[sub[nxt] + d].append(nxt)
            elif read:
                home[sub[t] + 1 + d].append(Transfer(t.dst, b.owner, b))
    work_of, memo = block_work(plan), {}

    def work(x: int, b: Block) -> float:  # each (rank, block)'s pairs once
        w = memo.get((x, b))
        if w is None:
            w = memo[(x, b)] = work_of(x, b)
        return w

    _place_own(comp, plan, work, first=1 + d)               # after sub-round 0's compute, in every mode
    if _pace(comp, work) > pace:
        return None
    return tuple(ChainStep(tuple(kv[s]), tuple(grad[s]), tuple(home[s]), tuple(comp[s])) for s in range(S))


def _place_own(comp: list[list[tuple[Block, int]]], plan: Plan, work: Callable[[int, Block], float],
               first: int) -> None:
    """Add every rank's own blocks to ``comp`` [step][(block, rank)], each to the step from ``first``
    on where the rank has the least work so far (``work``; ties: the later step), larger blocks
    first, ties in plan order (Note [Streaming chain backward], "Own blocks"). Reads only the plan:
    every rank and the cost model place alike."""
    S = len(comp)
    loads: dict[int, list[float]] = {x: [0] * S for x in plan.ranks}   # each rank's work per step, one pass
    for s in range(S):
        for b, y in comp[s]:
            loads[y][s] += work(y, b)
    for x in plan.ranks:
        load = loads[x]
        own = sorted(plan.local_blocks(x), key=lambda b: -work(x, b))
        for b in own:
            s = min(range(first, S), key=lambda i: (load[i], -i))
            comp[s].append((b, x))
            load[s] += work(x, b)


def _live_hops(routes: dict, needs: dict) -> set[Transfer]:
    """The hops whose KV the backward needs: those with a reader at or after their destination (a
    plan may carry a block on past its last reader; backward does not re-send that)."""
    live: set[Transfer] = set()
    for b, hops in routes.items():
        read = False
        for _, t in reversed(hops):
            read = read or b in needs[t.dst]
            if read:
                live.add(t)
    return live


def first_received(plan: Plan, block_bytes: Callable[[Block], int], *,
                   cache_key: Hashable = None) -> dict[int, tuple[Block, ...]]:
    """Blocks each rank receives in the first sub-round that backward needs (it reads them or
    passes them on to a reader), in plan order: what ``first_kept`` keeps from the forward (the
    plan's chains; empty for a plan that is not one)."""
    basis = _basis(plan, block_bytes, None, cache_key)
    if basis is None:
        return {}
    _, sub, _, live = basis
    out: dict[int, list[Block]] = {}
    for _, t in plan.transfers():
        if sub[t] == 0 and t in live:
            out.setdefault(t.dst, []).append(t.block)
    return {r: tuple(b) for r, b in out.items()}


def first_kept_blocks(plan: Plan, block_bytes: Callable[[Block], int], *,
                      cache_key: Hashable = None) -> dict[int, tuple[Block, ...]]:
    """What each rank would keep from the forward for the backward's first step: a chain plan's
    first sub-round (:func:`first_received`, relayed blocks too: they go on from there), any other
    plan's first wave of received deliveries (Note [Backward waves])."""
    if chain_steps(plan, block_bytes, cache_key=cache_key) is not None:
        return first_received(plan, block_bytes, cache_key=cache_key)
    waves = plan_waves(plan, block_bytes, cache_key=cache_key)
    out: dict[int, list[Block]] = {}
    for _, t in (waves[0].transfers if waves else ()):
        if (t.block, t.dst) in waves[0].computes and t.block not in out.get(t.dst, ()):
            out.setdefault(t.dst, []).append(t.block)
    return {r: tuple(b) for r, b in out.items()}


def first_keepers(requested: str, decided: str, plan: Plan, block_bytes: Callable[[Block], int],
                  kv_memory_budget: int = RING_BUDGET, *, cache_key: Hashable = None) -> frozenset[int]:
    """The ranks whose backward starts from their first step's KV kept from the forward (a chain's
    first sub-round, Note [Streaming chain backward], "The first sub-round"; another plan's first
    wave, Note [Backward waves], "The first wave"). ``requested``: ``--fcp-backward-kv``;
    ``decided``: what :func:`~megatron_fcp.schedule.waves.choose_backward_kv` made of it. ``keep``:
    every rank (everything is kept); an explicit ``resend``: none; ``auto`` deciding ``resend``: each
    rank whose part (:func:`first_kept_blocks`) fits ``kv_memory_budget`` (the ring's: its own
    shard; Transformer Engine's ring saves its last received shard) -- for a chain plan all ranks
    or none (its steps shift for everyone at once), for waves each rank on its own (the others'
    part of the first wave is re-sent: :func:`~megatron_fcp.schedule.waves.first_fetch`). Reads
    only the plan and block sizes: every rank and the cost model decide alike."""
    if decided == "keep":
        return frozenset(plan.ranks)
    if requested != "auto":
        return frozenset()
    got = first_kept_blocks(plan, block_bytes, cache_key=cache_key)
    fits = frozenset(r for r in plan.ranks if sum(block_bytes(b) for b in got.get(r, ())) <= (
        kv_memory_budget if kv_memory_budget != RING_BUDGET else sum(block_bytes(b) for b in plan.local_blocks(r))))
    if len(fits) < len(plan.ranks) and chain_steps(plan, block_bytes, cache_key=cache_key) is not None:
        return frozenset()
    return fits


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
    return first_fetch(waves[0], {r: got.get(r, ()) for r in keepers})


CHAIN_PACE = 1.5
"""The most a chain backward's steps may add to the busiest rank's work (:func:`_pace`); above it
the plan runs in waves (Note [Streaming chain backward], "Balance"): zigzag rings are at 1.0,
head-parallel stage rings staggered over 2-8 rounds at 1.06-1.25, packed batches' rings at 4-14."""


def _pace(comp: list[list[tuple[Block, int]]], work: Callable[[int, Block], float]) -> float:
    """Sum over steps of the busiest rank's work in the step, over the busiest rank's total: 1.0 when
    the steps keep every rank in step (a zigzag ring: each step a rank computes one owner's two
    chunks, work 2 either way), more when big blocks reach different ranks at different steps."""
    total: dict[int, float] = {}
    steps = 0.0
    for jobs in comp:
        busy: dict[int, float] = {}
        for b, x in jobs:
            w = work(x, b)
            busy[x] = busy.get(x, 0.0) + w
            total[x] = total.get(x, 0.0) + w
        steps += max(busy.values(), default=0.0)
    top = max(total.values(), default=0.0)
    return steps / top if top else 1.0
