"""The need rule: which KV blocks a CP rank must receive (causal, full or windowed). One rule, every
user derives from it.

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

Note [Windowed need sets]
-------------------------
Under a sliding window (:class:`~megatron_fcp.contract.mask.Mask` with ``left``/``right`` >= 0) the
same rule holds in its general form: a rank needs a block iff at least one of its queries sees at
least one of the block's keys. For zigzag that is ``block_pairs > 0`` (exact pair counts of the
rank's two query chunks against the block's token range, :meth:`Mask.pairs`), so the need sets
depend on the sequence length in tokens (a window is in tokens, a chunk is ``seq_len / (2*cp)``)
and, with sub-blocks, on the part: a part beyond the window's reach is not needed even when an
earlier part of the same chunk is. For cp = 4 and a causal window of one chunk (``W = L``), query
chunk ``g`` sees only chunks ``g-1`` and ``g``::

    needs (x = needed, . = not, cp = 4, window (L, 0))
               owner 0    owner 1    owner 2    owner 3
    rank       c0  c1     c0  c1     c0  c1     c0  c1
      0        -   -      .   x      .   .      .   .      chunk 7 sees chunk 6 (rank 1's c1)
      1        x   .      -   -      .   x      .   .
      2        .   .      x   .      -   -      .   x
      3        .   .      .   .      x   .      -   -      chunk 4 sees chunk 3: its own

6 chunks over the group instead of the causal 18: each rank needs at most ``ceil(W/L)`` chunks
before each of its own, all from its CP neighbours, and a rank whose window lies inside its own
shard (here rank 3's late chunk; in a packed batch a rank holding whole documents, or a block's
predecessor) needs nothing from there. A window longer than the sequence is the plain mask:
identical need sets. Plain causal and full masks keep the closed form of :func:`needs_chunk`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np

from megatron_fcp.contract.blocks import Block, PlanError, part_span
from megatron_fcp.contract.mask import Mask, as_mask

__all__ = ["needs_chunk", "need_set", "readers", "need_matrix", "causal_pairs", "block_pairs",
           "zigzag_need_matrix", "chunk_need_matrix"]


def needs_chunk(reader, owner, chunk, causal: bool):
    """Whether CP rank ``reader`` needs zigzag ``chunk`` (0/1) of CP rank ``owner`` (CP indices).

    Scalars give a bool; numpy arrays broadcast and give a boolean array. A rank never needs its
    own chunks (they are local); with ``causal`` it needs an owner's late chunk only when the owner
    comes after it (``owner > reader``), see the Note.
    """
    reader, owner, chunk = np.asarray(reader), np.asarray(owner), np.asarray(chunk)
    out = (owner != reader) & ((not causal) | (chunk == 0) | (owner > reader))
    return bool(out) if out.ndim == 0 else out


def need_set(ranks: Sequence[int], rank: int, causal: "bool | Mask", parts_per_chunk: int = 1, *,
             window: Sequence[int] | None = None, seq_len: int | None = None) -> frozenset[Block]:
    """Blocks that global ``rank`` must receive (its own blocks excluded). ``causal`` may be a
    :class:`~megatron_fcp.contract.mask.Mask`; a windowed mask needs ``seq_len`` (the padded
    global sequence, Note [Windowed need sets])."""
    ranks = list(ranks)
    j = ranks.index(rank)
    mask = as_mask(causal, window)
    if mask.windowed:
        row = zigzag_need_matrix(len(ranks), parts_per_chunk, mask, seq_len)[j]
        P = parts_per_chunk
        return frozenset(Block(ranks[b // (2 * P)], (b // P) % 2, b % P) for b in np.flatnonzero(row).tolist())
    return frozenset(
        Block(owner, chunk, p)
        for i, owner in enumerate(ranks)
        for chunk in (0, 1)
        if needs_chunk(j, i, chunk, mask.causal)
        for p in range(parts_per_chunk)
    )


def readers(ranks: Sequence[int], owner_index: int, chunk: int, causal: "bool | Mask", *,
            window: Sequence[int] | None = None, seq_len: int | None = None, parts_per_chunk: int = 1,
            part: int | None = None) -> list[int]:
    """Global ranks that need ``chunk`` of CP rank ``owner_index``, in CP order. Under a window:
    those that need sub-block ``part`` of it, or (``part=None``) any of its ``parts_per_chunk`` parts."""
    mask = as_mask(causal, window)
    if mask.windowed:
        P = parts_per_chunk
        need = zigzag_need_matrix(len(ranks), P, mask, seq_len)
        b0 = (owner_index * 2 + chunk) * P
        cols = need[:, b0:b0 + P] if part is None else need[:, b0 + part:b0 + part + 1]
        return np.asarray(ranks, dtype=np.int64)[cols.any(axis=1)].tolist()
    sel = needs_chunk(np.arange(len(ranks)), owner_index, chunk, mask.causal)
    return np.asarray(ranks, dtype=np.int64)[sel].tolist()


def need_matrix(cp: int, parts_per_chunk: int, causal: "bool | Mask", *, window: Sequence[int] | None = None,
                seq_len: int | None = None) -> np.ndarray:
    """``[cp, cp*2*P]`` booleans: CP rank j needs block id ``b = (owner*2 + chunk)*P + part``."""
    mask = as_mask(causal, window)
    if mask.windowed:
        return zigzag_need_matrix(cp, parts_per_chunk, mask, seq_len)
    b = np.arange(cp * 2 * parts_per_chunk)
    owner, chunk = b // (2 * parts_per_chunk), (b // parts_per_chunk) % 2
    return needs_chunk(np.arange(cp)[:, None], owner[None, :], chunk[None, :], mask.causal)


def zigzag_need_matrix(cp: int, parts_per_chunk: int, mask: Mask, seq_len: int | None) -> np.ndarray:
    """:func:`need_matrix` of any mask by the general rule (Note [Windowed need sets]): CP rank j
    needs block ``b`` iff ``b`` is not its own and :func:`block_pairs` of j against it is > 0.
    Read-only, cached per ``(cp, P, mask, seq_len)``."""
    if seq_len is None:
        raise PlanError(f"a zigzag plan under the {mask.describe()} mask needs seq_len (the padded global "
                        "sequence in tokens, a multiple of 2*cp): its need sets depend on it; pass seq_len=")
    if seq_len % (2 * cp) or seq_len < 2 * cp * parts_per_chunk:
        raise PlanError(f"seq_len={seq_len}: a zigzag plan needs a multiple of 2*cp = {2 * cp} with at least "
                        f"parts_per_chunk = {parts_per_chunk} tokens per chunk; pad the sequence as Megatron does "
                        "(cost.model.zigzag_padded_len)")
    return _zigzag_need(cp, parts_per_chunk, mask, int(seq_len))


@lru_cache(maxsize=64)
def _zigzag_need(cp: int, P: int, mask: Mask, seq_len: int) -> np.ndarray:
    nb = cp * 2 * P
    b = np.arange(nb)
    owner, chunk, part = (x[None, :] for x in (b // (2 * P), (b // P) % 2, b % P))
    need = np.empty((cp, nb), dtype=bool)                                           # [cp, 2*cp*P]
    step = max(1, (1 << 20) // nb)  # reader rows per pass: int64 temporaries of a few MB at any cp
    for j0 in range(0, cp, step):
        q = np.arange(j0, min(j0 + step, cp))[:, None]
        need[j0:j0 + len(q)] = (block_pairs(cp, seq_len, P, q, owner, chunk, part, mask) > 0) & (owner != q)
    need.flags.writeable = False
    return need


def chunk_need_matrix(cp: int, causal: "bool | Mask", seq_len: int | None = None) -> np.ndarray:
    """``[cp, 2*cp]`` booleans, chunk-major columns (chunk 0 of every owner, then chunk 1): what the
    lower bounds and floors count (``seq_len`` needed only under a window)."""
    mask = as_mask(causal)
    if not mask.windowed:
        idx = np.arange(cp)
        return np.concatenate([needs_chunk(idx[:, None], idx[None, :], c, mask.causal) for c in (0, 1)], axis=1)
    return zigzag_need_matrix(cp, 1, mask, seq_len).reshape(cp, cp, 2).transpose(0, 2, 1).reshape(cp, 2 * cp)


def causal_pairs(q0, q1, k0, k1, causal: "bool | Mask" = True) -> np.ndarray:
    """Number of (q, k) token pairs with q in [q0, q1), k in [k0, k1) and (if causal) k <= q.

    Exact integer count, vectorised over numpy arrays: for each q the count is
    ``clamp(q - k0 + 1, 0, k1 - k0)``; summing the clamp is a difference of two ramps. ``causal``
    may be a :class:`~megatron_fcp.contract.mask.Mask`: a windowed one counts by :meth:`Mask.pairs`.
    """
    if isinstance(causal, Mask):
        if causal.windowed:
            return causal.pairs(q0, q1, k0, k1)
        causal = causal.causal
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


def block_pairs(cp: int, seq_len: int, P: int, q_index, owner_index, chunk, part, causal: "bool | Mask") -> np.ndarray:
    """Allowed pairs between rank ``q_index``'s two zigzag query chunks and block (owner, chunk, part)
    under ``causal`` (a bool, or any :class:`~megatron_fcp.contract.mask.Mask`)."""
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
