"""The units a plan moves: KV blocks and point-to-point transfers. Pure data, no ``torch``.

A *block* is one owner's zigzag chunk (``chunk`` 0 is the early chunk, 1 the late one), optionally
cut into ``parts_per_chunk`` sub-blocks (``part``); see Note [Zigzag blocks and causal need
sets] in :mod:`megatron_fcp.contract.needs`. A *transfer* sends one block between two global ranks.

Note [Sub-block sizes]
----------------------
A chunk of ``L`` tokens is cut into ``P = parts_per_chunk`` sub-blocks at the floor cuts
``p * L // P``: part ``p`` holds tokens ``[p*L//P, (p+1)*L//P)`` of its chunk
(:func:`part_span`). When ``P`` divides ``L`` every part has ``L/P`` tokens (the equal cut); when it
does not, the parts hold ``floor(L/P)`` or ``ceil(L/P)`` tokens, so a sequence of any length that
Megatron can split (a multiple of ``2*cp``) can be cut into any ``P <= L`` parts without padding.
For ``L = 10, P = 4``::

    part      0       1        2       3
    tokens    0-1     2-4      5-6     7-9      (sizes 2, 3, 2, 3)

The planner's cost model, the backward waves and the executor's shard layout
(:class:`~megatron_fcp.attention.layout.ZigzagLayout`) all take sizes from :func:`part_span`, so
what the model prices is what the executor sends.
"""

from __future__ import annotations

import gc
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["PlanError", "Block", "Transfer", "blocks_of", "zigzag_chunk_index", "part_span", "part_tokens",
           "check_parts", "make_transfer", "make_transfers", "transfers_from_columns", "cp_index_of", "gc_paused"]


class PlanError(ValueError):
    """A plan is malformed; the message names the block, rank and round at fault."""


class Block(NamedTuple):
    """One KV block: ``owner``'s (global rank) zigzag ``chunk`` (0 early, 1 late), sub-block ``part``.

    A named tuple (before 2026-12-06 a frozen dataclass with the same fields, order, ``repr`` and
    hash): its hash and equality run in C, and planning hashes blocks by the hundred thousand (a
    backward program's waves at cp = 256). A block equals the plain tuple of its fields."""

    owner: int
    chunk: int
    part: int = 0

    def __str__(self) -> str:  # compact in error messages and round tables
        return f"B(r{self.owner},c{self.chunk},p{self.part})"


@dataclass(frozen=True, order=True, slots=True)
class Transfer:
    """Send ``block`` from global rank ``src`` to global rank ``dst``."""

    src: int
    dst: int
    block: Block

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}:{self.block}"


def blocks_of(owner: int, parts_per_chunk: int = 1) -> tuple[Block, ...]:
    """All blocks owned by global rank ``owner``, in sequence order of its local shard."""
    return tuple(Block(owner, c, p) for c in (0, 1) for p in range(parts_per_chunk))


def zigzag_chunk_index(cp_index: int, chunk: int, cp: int) -> int:
    """Global chunk index (of ``2*cp``) held by CP rank ``cp_index`` as its ``chunk`` (0 or 1)."""
    if chunk not in (0, 1):
        raise PlanError(f"chunk must be 0 or 1, got {chunk}")
    return cp_index if chunk == 0 else 2 * cp - 1 - cp_index


def part_span(chunk_tokens, parts_per_chunk: int, part):
    """Token range ``(start, end)`` of sub-block ``part`` inside its chunk of ``chunk_tokens``
    tokens: ``part * L // P`` to ``(part + 1) * L // P`` (Note [Sub-block sizes]). ``part`` and
    ``chunk_tokens`` may be integers or numpy integer arrays (broadcast)."""
    return part * chunk_tokens // parts_per_chunk, (part + 1) * chunk_tokens // parts_per_chunk


def part_tokens(seq_len: int, cp: int, parts_per_chunk: int, part: int) -> int:
    """Tokens of sub-block ``part`` of any zigzag chunk of a ``seq_len``-token sequence (a multiple
    of ``2*cp``) cut into ``parts_per_chunk`` parts: :func:`part_span` of ``seq_len / (2*cp)``."""
    a, z = part_span(seq_len // (2 * cp), parts_per_chunk, part)
    return z - a


def check_parts(chunk_tokens: int, parts_per_chunk: int) -> None:
    """Raise ValueError unless every one of ``parts_per_chunk`` sub-blocks of a ``chunk_tokens``
    chunk holds at least one token (``1 <= P <= L``)."""
    if not 1 <= parts_per_chunk <= chunk_tokens:
        raise ValueError(f"a zigzag chunk of {chunk_tokens} tokens cannot be cut into {parts_per_chunk} parts of at "
                         f"least one token each; use parts_per_chunk between 1 and {max(chunk_tokens, 1)} "
                         f"(or a longer sequence)")


_object_new = object.__new__
_SET_SRC = Transfer.__dict__["src"].__set__  # slot descriptors: bypass the frozen __setattr__
_SET_DST = Transfer.__dict__["dst"].__set__
_SET_BLOCK = Transfer.__dict__["block"].__set__


def make_transfer(src: int, dst: int, block: Block) -> Transfer:
    """``Transfer(src, dst, block)`` without the frozen ``__init__``'s ``object.__setattr__`` calls."""
    t = _object_new(Transfer)
    _SET_SRC(t, src)
    _SET_DST(t, dst)
    _SET_BLOCK(t, block)
    return t


def make_transfers(srcs: Sequence[int], dsts: Sequence[int], block: Block) -> list[Transfer]:
    """``[Transfer(s, d, block) for s, d in zip(srcs, dsts)]`` (equal objects) at ~1/3 of the cost.

    Algorithm: allocate the objects in one ``map``, then fill each slot with one ``map`` over its
    slot descriptor (all loops run in C). The compiler builds ~1.5M transfers for a 1,024-rank
    group this way.
    """
    n = len(srcs)
    if len(dsts) != n:
        raise ValueError(f"make_transfers: {n} sources but {len(dsts)} destinations")
    out = list(map(_object_new, repeat(Transfer, n)))
    deque(map(_SET_SRC, out, srcs), maxlen=0)  # deque(maxlen=0) only consumes the iterator
    deque(map(_SET_DST, out, dsts), maxlen=0)
    deque(map(_SET_BLOCK, out, repeat(block, n)), maxlen=0)
    return out


def transfers_from_columns(srcs: Sequence[int], dsts: Sequence[int], blocks: Sequence[Block]) -> list[Transfer]:
    """``[Transfer(s, d, b) for s, d, b in zip(srcs, dsts, blocks)]`` built as :func:`make_transfers`
    builds them (a columnar plan's rounds are materialised this way)."""
    n = len(srcs)
    if len(dsts) != n or len(blocks) != n:
        raise ValueError(f"transfers_from_columns: {n} sources, {len(dsts)} destinations, {len(blocks)} blocks")
    out = list(map(_object_new, repeat(Transfer, n)))
    deque(map(_SET_SRC, out, srcs), maxlen=0)
    deque(map(_SET_DST, out, dsts), maxlen=0)
    deque(map(_SET_BLOCK, out, blocks), maxlen=0)
    return out


def cp_index_of(ranks: Sequence[int]):
    """Vectorised map global rank -> CP index (``-1`` for a rank outside the group).

    Algorithm: a lookup table over ``[min(ranks), max(ranks)]`` when that span is small (at most
    ``64 * cp + 1024`` entries: every real CP group), else a binary search over the sorted ranks.
    """
    r = np.asarray(ranks, dtype=np.int64)
    lo, hi = int(r.min()), int(r.max())
    if hi - lo < 64 * len(r) + 1024:
        table = np.full(hi - lo + 2, -1, dtype=np.int64)  # last entry: every rank out of range
        table[r - lo] = np.arange(len(r))

        def index_of(g: np.ndarray) -> np.ndarray:
            off = np.subtract(g, lo, dtype=np.int64).view(np.uint64)  # below lo: huge
            return table[np.minimum(off, hi - lo + 1, out=off)]

        return index_of
    order = np.argsort(r, kind="stable")
    sorted_r = r[order]

    def index_of_sparse(g: np.ndarray) -> np.ndarray:
        pos = np.minimum(np.searchsorted(sorted_r, g), len(r) - 1)
        return np.where(sorted_r[pos] == g, order[pos], -1)

    return index_of_sparse


_GC_LOCK = threading.Lock()
_GC_PAUSE = {"depth": 0, "was_enabled": False}   # pauses open in this process, and the collector's state before them


@contextmanager
def gc_paused():
    """Pause the cyclic GC while many short-lived objects are created with few or no cycles (a
    plan's ~10^6 transfers, a schedule search's waves and timelines); without this, generation
    sweeps over the growing heap cost more than the work itself. Reentrant and shared by threads:
    the collector is disabled by the first pause to open and enabled again (if it was) when the
    last one closes, so a nested or concurrent pause never re-enables it under another. Also a
    decorator (``@gc_paused()``): the per-batch planning entry points (``place_batch``,
    ``build_plan``, the packed degree choice, ``compile_backward``, the pricing of a program) run
    under it; measured 2026-12-06 at cp = 256, 512 documents, ``graph="auto"``: placement, plan and
    backward program 4.4 -> 3.4 s (a list of the plan's 125K ``(round, transfer)`` pairs alone took
    0.36 s to build with the collector on, 0.008 s off); nothing they build is a cycle they drop, so
    reference counting frees it as before."""
    with _GC_LOCK:
        if _GC_PAUSE["depth"] == 0:
            _GC_PAUSE["was_enabled"] = gc.isenabled()
            gc.disable()
        _GC_PAUSE["depth"] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSE["depth"] -= 1
            if _GC_PAUSE["depth"] == 0 and _GC_PAUSE["was_enabled"]:
                gc.enable()
