"""Waves of a plan's blocks for the wave-by-wave backward (Note [Backward waves] in
:mod:`megatron_fcp.attention.backward_waves`). Pure data, no ``torch``: the executor and the cost
model (:mod:`megatron_fcp.planning.packed_cost`) split a plan the same way.

:func:`plan_waves` takes the blocks in the order the plan first sends them (blocks it never sends
last, in plan order) and packs them greedily: a block joins the current wave while every rank's
received bytes in the wave (blocks it needs or relays) stay within the budget, else it starts the
next wave. The default budget (:func:`wave_budget`) is half of the largest shard's K and V, so two
waves alive at once hold no more than the ring's one shard in flight. :func:`restrict` is the plan
cut to one wave: its rounds that carry the wave's blocks, only those transfers.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable

from megatron_fcp.planning.blocks import Block
from megatron_fcp.planning.plan import Plan

__all__ = ["Wave", "plan_waves", "wave_budget", "restrict"]


@dataclass(frozen=True)
class Wave:
    """Blocks handled together in backward, in canonical order, and the plan rounds that carry them."""

    blocks: tuple[Block, ...]
    rounds: tuple[int, ...]  # ascending plan round indices with a transfer of one of ``blocks``
    _set: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_set", frozenset(self.blocks))

    def __contains__(self, block: Block) -> bool:
        return block in self._set


def wave_budget(plan: Plan, block_bytes: Callable[[Block], int]) -> int:
    """Half of the largest shard's K and V bytes: two waves then fit in what the ring holds in flight."""
    return max(sum(block_bytes(b) for b in plan.local_blocks(r)) for r in plan.ranks) // 2


def plan_waves(plan: Plan, block_bytes: Callable[[Block], int], budget: int | None = None, *,
               cache_key: Hashable = None) -> tuple[Wave, ...]:
    """Split the plan's blocks into waves (Note [Backward waves]).

    Blocks in the order the plan first sends them (blocks it never sends last, in plan order) join
    the current wave while every rank's received bytes in the wave (blocks it needs or relays) stay
    within ``budget`` (default :func:`wave_budget`); a block that does not fit starts the next wave.
    cache_key: what ``block_bytes`` depends on besides the plan; with it the waves are computed once
    per plan object and key."""
    key = (id(plan), budget, cache_key)
    hit = _WAVES.get(key)
    if cache_key is not None and hit is not None and hit[0]() is plan:
        return hit[1]
    if budget is None:
        budget = wave_budget(plan, block_bytes)
    order: dict[Block, None] = {}
    receivers: dict[Block, list[int]] = {}
    rounds_of: dict[Block, set[int]] = {}
    for r, t in plan.transfers():
        order.setdefault(t.block)
        receivers.setdefault(t.block, []).append(t.dst)
        rounds_of.setdefault(t.block, set()).add(r)
    for b in plan.blocks():
        order.setdefault(b)
    waves, cur, load = [], [], {}

    def close():
        if cur:
            rounds = sorted(set().union(*(rounds_of.get(b, set()) for b in cur)))
            waves.append(Wave(tuple(cur), tuple(rounds)))

    for b in order:
        size = block_bytes(b)
        fits = all(load.get(x, 0) + size <= budget for x in receivers.get(b, ()))
        if cur and not fits:
            close()
            cur, load = [], {}
        cur.append(b)
        for x in receivers.get(b, ()):
            load[x] = load.get(x, 0) + size
    close()
    waves = tuple(waves)
    if cache_key is not None:
        if len(_WAVES) > 1024:
            _WAVES.clear()
        _WAVES[key] = (weakref.ref(plan), waves)
    return waves


_WAVES: dict[tuple, tuple[weakref.ref, tuple[Wave, ...]]] = {}


def restrict(plan: Plan, wave: Wave) -> Plan:
    """The plan's rounds that carry ``wave``'s blocks, with only those transfers (not a complete
    plan: it delivers only this wave; for the cost model)."""
    rounds = tuple(tuple(t for t in plan.rounds[r] if t.block in wave) for r in wave.rounds)
    return replace(plan, rounds=rounds, name=f"{plan.name}/wave")
