"""The causal need rule: which KV blocks a CP rank must receive. One rule, every user derives from it.

Note [Zigzag blocks and causal need sets]
-----------------------------------------
Megatron splits a sequence into ``2*cp`` chunks; CP rank ``i`` holds chunks ``i`` and
``2*cp-1-i`` (``get_batch_on_this_cp_rank``). A *block* is one owner's chunk (``chunk`` 0 is the
early chunk ``i``, ``chunk`` 1 the late chunk ``2*cp-1-i``), optionally cut into
``parts_per_chunk`` sub-blocks (Note [Sub-block sizes] in :mod:`megatron_fcp.contract.blocks`).
For cp = 4::

    global chunk   0  1  2  3  4  5  6  7
    CP rank        0  1  2  3  3  2  1  0
    block chunk    0  0  0  0  1  1  1  1

With causal masking a query in global chunk ``q`` sees keys in chunks ``c <= q``. Rank ``j``'s
latest query chunk is ``2*cp-1-j``, so it needs chunk 0 of every rank and chunk 1 only of ranks
``i > j``::

    needs (x = needed, . = not, cp = 4; own blocks are local and never "needed")
               owner 0    owner 1    owner 2    owner 3
    rank       c0  c1     c0  c1     c0  c1     c0  c1
      0        -   -      x   x      x   x      x   x
      1        x   .      -   -      x   x      x   x
      2        x   .      x   .      -   -      x   x
      3        x   .      x   .      x   .      -   -

A ring moves 2*(cp-1) chunks into every rank; the need sets add up to 1.5*cp*(cp-1) chunks over
the group, i.e. 0.75x the ring's bytes. Every sub-block of a chunk shares the chunk's rule.

:func:`needs_chunk` is the rule; the plan contract (:func:`need_set`), the compiler
(:func:`readers`), ``Plan.verify`` (:func:`need_matrix`) and the cost model's lower bound all call
it. A test checks it against the token-level causal mask.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_fcp.contract.blocks import Block, part_span

__all__ = ["needs_chunk", "need_set", "readers", "need_matrix", "causal_pairs", "block_pairs"]


def needs_chunk(reader, owner, chunk, causal: bool):
    """Whether CP rank ``reader`` needs zigzag ``chunk`` (0/1) of CP rank ``owner`` (CP indices).

    Scalars give a bool; numpy arrays broadcast and give a boolean array. A rank never needs its
    own chunks (they are local); with ``causal`` it needs an owner's late chunk only when the owner
    comes after it (``owner > reader``), see the Note.
    """
    reader, owner, chunk = np.asarray(reader), np.asarray(owner), np.asarray(chunk)
    out = (owner != reader) & ((not causal) | (chunk == 0) | (owner > reader))
    return bool(out) if out.ndim == 0 else out


def need_set(ranks: Sequence[int], rank: int, causal: bool, parts_per_chunk: int = 1) -> frozenset[Block]:
    """Blocks that global ``rank`` must receive (its own blocks excluded)."""
    j = list(ranks).index(rank)
    return frozenset(
        Block(owner, chunk, p)
        for i, owner in enumerate(ranks)
        for chunk in (0, 1)
        if needs_chunk(j, i, chunk, causal)
        for p in range(parts_per_chunk)
    )


def readers(ranks: Sequence[int], owner_index: int, chunk: int, causal: bool) -> list[int]:
    """Global ranks that need ``chunk`` of CP rank ``owner_index``, in CP order."""
    mask = needs_chunk(np.arange(len(ranks)), owner_index, chunk, causal)
    return np.asarray(ranks, dtype=np.int64)[mask].tolist()


def need_matrix(cp: int, parts_per_chunk: int, causal: bool) -> np.ndarray:
    """``[cp, cp*2*P]`` booleans: CP rank j needs block id ``b = (owner*2 + chunk)*P + part``."""
    b = np.arange(cp * 2 * parts_per_chunk)
    owner, chunk = b // (2 * parts_per_chunk), (b // parts_per_chunk) % 2
    return needs_chunk(np.arange(cp)[:, None], owner[None, :], chunk[None, :], causal)


def causal_pairs(q0, q1, k0, k1, causal: bool = True) -> np.ndarray:
    """Number of (q, k) token pairs with q in [q0, q1), k in [k0, k1) and (if causal) k <= q.

    Exact integer count, vectorised over numpy arrays: for each q the count is
    ``clamp(q - k0 + 1, 0, k1 - k0)``; summing the clamp is a difference of two ramps.
    """
    q0, q1, k0, k1 = (np.asarray(x, dtype=np.int64) for x in (q0, q1, k0, k1))
    if not causal:
        return np.maximum(q1 - q0, 0) * np.maximum(k1 - k0, 0)
    L = np.maximum(k1 - k0, 0)
    # f(q) = min(max(q - k0 + 1, 0), L); sum_{q=q0}^{q1-1} f(q) = F(q1-1) - F(q0-1), F(x)=sum_{q<=x} f
    def F(x):
        m = x - k0 + 1  # f values ramp 1..L then flat at L
        ramp_part = _ramp(np.minimum(m, L))
        flat = np.maximum(m - L, 0) * L
        return ramp_part + flat

    return np.where(q1 > q0, F(q1 - 1) - F(q0 - 1), 0)


def block_pairs(cp: int, seq_len: int, P: int, q_index, owner_index, chunk, part, causal: bool) -> np.ndarray:
    """Allowed pairs between rank ``q_index``'s two zigzag query chunks and block (owner, chunk, part)."""
    L = seq_len // (2 * cp)
    q_index, owner_index, chunk, part = (np.asarray(x, dtype=np.int64) for x in (q_index, owner_index, chunk, part))
    g = np.where(chunk == 0, owner_index, 2 * cp - 1 - owner_index)
    p0, p1 = part_span(L, P, part)  # Note [Sub-block sizes]
    k0, k1 = g * L + p0, g * L + p1
    total = np.zeros(np.broadcast(q_index, k0).shape, dtype=np.int64)
    for qc in (0, 1):
        gq = q_index if qc == 0 else 2 * cp - 1 - q_index
        total = total + causal_pairs(gq * L, (gq + 1) * L, k0, k1, causal)
    return total


def _ramp(n: np.ndarray) -> np.ndarray:
    """sum_{x=1..n} x for n >= 0 (vectorised)."""
    n = np.maximum(n, 0)
    return n * (n + 1) // 2
