"""Megatron's zigzag context-parallel layout: split, unsplit, token positions, block positions.

Megatron cuts a global sequence of ``s`` tokens into ``2*cp`` equal chunks and gives CP rank ``i``
chunks ``i`` and ``2*cp-1-i`` (``megatron.core.utils.get_batch_on_this_cp_rank``), so each rank
holds ``s_local = s / cp`` tokens: first its early chunk, then its late chunk. For cp = 2::

    global chunk    0    1    2    3
    CP rank         0    1    1    0
    local shard     rank 0 = [chunk 0 | chunk 3],  rank 1 = [chunk 1 | chunk 2]

A KV *block* (``megatron_fcp.planning.Block``) is one owner's chunk (0 early, 1 late), optionally cut
into ``parts_per_chunk`` sub-blocks at the floor cuts ``p * L // P`` (parts of ``floor(L/P)`` or
``ceil(L/P)`` tokens when ``P`` does not divide the chunk length ``L``; Note [Sub-block sizes] in
:mod:`megatron_fcp.contract.blocks`). This module maps blocks to token ranges of the owner's
shard and to global token positions; the attention mask is built from global positions only
(causal: key position <= query position), so it is correct whatever order blocks arrive in.

Note [Shard layouts]
--------------------
The plan executor never looks at zigzag chunks or documents itself; it asks a *shard layout* (one
small object per call) what it needs: this rank's blocks, each block's token slice of the local
shard and token count (receive buffers: blocks may differ in size), key positions (and document
ids) of any block of the group, query positions (and document ids) of the local tokens, and the
query rows that can attend a block. Two layouts:

=================  ===============================  ==============================================
                   :class:`ZigzagLayout`            :class:`PlacementLayout`
=================  ===============================  ==============================================
tensors            ``[s_local, b, h, d]``           THD ``[t_local, h, d]``, run as ``b = 1``
blocks             2 zigzag chunks x parts          the placement's spans (``Block(owner, i, 0)``)
block size         ``part_span`` of ``s_local / 2``  the span's tokens (any, 0 tokens on a rank ok)
positions          global token positions           positions inside the document
document ids       none (one sequence)              the span's document (kernels mask by it)
query rows         all                              the rows of the block's document on this rank
=================  ===============================  ==============================================
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_fcp.contract.blocks import Block, blocks_of, check_parts, part_span, zigzag_chunk_index
from megatron_fcp.contract.placement import Placement, Span

__all__ = [
    "zigzag_split",
    "zigzag_unsplit",
    "zigzag_positions",
    "block_local_slice",
    "block_positions",
    "ShardLayout",
    "ZigzagLayout",
    "PlacementLayout",
]


def _check_divisible(length: int, cp: int, what: str) -> None:
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if length % (2 * cp) != 0:
        raise ValueError(
            f"{what} length {length} is not a multiple of 2*cp = {2 * cp}; pad the sequence to a "
            f"multiple of {2 * cp} (Megatron's zigzag layout cuts it into 2*cp equal chunks)"
        )


def zigzag_split(x: torch.Tensor, cp: int, cp_index: int, seq_dim: int = 0) -> torch.Tensor:
    """CP rank ``cp_index``'s shard of a global tensor: chunks ``cp_index`` and ``2*cp-1-cp_index``.

    x: [..., s, ...] with the sequence at ``seq_dim``; returns [..., s/cp, ...] (a new contiguous
    tensor), identical to ``get_batch_on_this_cp_rank`` for that rank.
    """
    if not 0 <= cp_index < cp:
        raise ValueError(f"cp_index must be in [0, {cp}), got {cp_index}")
    s = x.shape[seq_dim]
    _check_divisible(s, cp, "sequence")
    chunks = x.chunk(2 * cp, dim=seq_dim)  # 2*cp views of [..., s/(2cp), ...]
    return torch.cat([chunks[cp_index], chunks[2 * cp - 1 - cp_index]], dim=seq_dim)


def zigzag_unsplit(shards: Sequence[torch.Tensor], seq_dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`zigzag_split`: ``shards[i]`` is CP rank i's shard; returns the global tensor."""
    cp = len(shards)
    if cp < 1:
        raise ValueError("zigzag_unsplit needs at least one shard")
    ordered: list[torch.Tensor] = [None] * (2 * cp)  # type: ignore[list-item]
    for i, shard in enumerate(shards):
        if shard.shape[seq_dim] % 2 != 0:
            raise ValueError(f"shard {i} has odd sequence length {shard.shape[seq_dim]}; not a zigzag shard")
        early, late = shard.chunk(2, dim=seq_dim)
        ordered[i], ordered[2 * cp - 1 - i] = early, late
    return torch.cat(ordered, dim=seq_dim)


def zigzag_positions(s_local: int, cp: int, cp_index: int, device=None) -> torch.Tensor:
    """Global token positions (int64 [s_local]) of CP rank ``cp_index``'s shard, in shard order."""
    if s_local % 2 != 0:
        raise ValueError(f"local sequence length {s_local} must be even (two zigzag chunks)")
    chunk = s_local // 2
    starts = (zigzag_chunk_index(cp_index, 0, cp) * chunk, zigzag_chunk_index(cp_index, 1, cp) * chunk)
    ar = torch.arange(chunk, dtype=torch.int64, device=device)
    return torch.cat([ar + starts[0], ar + starts[1]])


def _part_range(block: Block, s_local: int, parts_per_chunk: int) -> tuple[int, int]:
    """``(start, end)`` of ``block``'s tokens inside its chunk of ``s_local / 2`` tokens."""
    if s_local % 2 != 0:
        raise ValueError(f"local sequence length {s_local} must be even (two zigzag chunks); pad the global "
                         f"sequence to a multiple of 2*cp")
    check_parts(s_local // 2, parts_per_chunk)
    return part_span(s_local // 2, parts_per_chunk, block.part)


def block_local_slice(block: Block, s_local: int, parts_per_chunk: int = 1) -> slice:
    """Token range of ``block`` inside its owner's local shard (``[s_local]`` indexing)."""
    a, z = _part_range(block, s_local, parts_per_chunk)
    base = block.chunk * (s_local // 2)
    return slice(base + a, base + z)


def block_positions(
    block: Block, ranks: Sequence[int], s_local: int, parts_per_chunk: int = 1, device=None
) -> torch.Tensor:
    """Global token positions (int64 ``[tokens of the part]``, :func:`part_span`) of ``block``.

    ranks: the CP group's global ranks in CP order (``Plan.ranks``); the owner's index there is
    its zigzag position.
    """
    ranks = tuple(ranks)
    if block.owner not in ranks:
        raise ValueError(f"{block} is owned by rank {block.owner}, which is not in the CP group {list(ranks)}")
    a, z = _part_range(block, s_local, parts_per_chunk)
    cp = len(ranks)
    chunk_start = zigzag_chunk_index(ranks.index(block.owner), block.chunk, cp) * (s_local // 2)
    return torch.arange(chunk_start + a, chunk_start + z, dtype=torch.int64, device=device)


class ShardLayout:
    """What the plan executor needs to know about the tokens of a CP group; see Note [Shard layouts].

    Attributes: ``local_blocks`` (this rank's blocks in local token order), ``q_pos`` (int64 CPU
    ``[n]``, positions of the local tokens) and ``q_doc`` (their document ids, or None: one
    sequence, no document mask).
    """

    local_blocks: tuple[Block, ...]
    q_pos: torch.Tensor
    q_doc: torch.Tensor | None = None

    def local_slice(self, block: Block) -> slice:
        """Token range of one of this rank's blocks in its local shard."""
        raise NotImplementedError

    def block_tokens(self, block: Block) -> int:
        """Tokens of any block of the group (the size of its receive buffer)."""
        raise NotImplementedError

    def k_pos(self, block: Block) -> torch.Tensor:
        """Positions (int64 CPU ``[block_tokens]``) of a block's keys."""
        raise NotImplementedError

    def k_doc(self, block: Block) -> torch.Tensor | None:
        """Document ids of a block's keys (None when ``q_doc`` is None)."""
        return None

    def q_rows(self, block: Block) -> slice | None:
        """Local query rows that may attend ``block`` (rows outside are fully masked), None: all."""
        return None


class ZigzagLayout(ShardLayout):
    """Megatron's zigzag shard of one sequence: blocks are chunks cut into ``parts_per_chunk``
    (equal, or floor/ceil sizes: Note [Sub-block sizes] in :mod:`megatron_fcp.contract.blocks`)."""

    def __init__(self, ranks: Sequence[int], rank: int, s_local: int, parts_per_chunk: int = 1,
                 causal: bool = False) -> None:
        self.ranks, self.s_local, self.ppc, self.causal = tuple(ranks), s_local, parts_per_chunk, causal
        self.local_blocks = blocks_of(rank, parts_per_chunk)
        self.q_pos = zigzag_positions(s_local, len(self.ranks), self.ranks.index(rank))  # [s_local]
        self._kpos: dict[Block, torch.Tensor] = {}

    def q_rows(self, block: Block) -> slice | None:
        """Causal: the rows at or after the block's first key. A zigzag shard's positions increase
        (chunk 0 before chunk 1), so the rows that see a block are a suffix; the kernel and the
        merge then touch only those rows (the other half of the shard, for most blocks)."""
        if not self.causal:
            return None
        r0 = int(torch.searchsorted(self.q_pos, int(self.k_pos(block)[0])))
        return None if r0 == 0 else slice(r0, self.s_local)

    def local_slice(self, block: Block) -> slice:
        return block_local_slice(block, self.s_local, self.ppc)

    def block_tokens(self, block: Block) -> int:
        a, z = _part_range(block, self.s_local, self.ppc)
        return z - a

    def k_pos(self, block: Block) -> torch.Tensor:
        if block not in self._kpos:
            self._kpos[block] = block_positions(block, self.ranks, self.s_local, self.ppc)
        return self._kpos[block]


class PlacementLayout(ShardLayout):
    """A packed batch placed by a :class:`~megatron_fcp.contract.placement.Placement`: block ``i``
    of global rank ``owner`` is ``Block(owner, i, 0)``; masks by document and in-document position."""

    def __init__(self, placement: Placement, ranks: Sequence[int], rank: int) -> None:
        self.placement, self.ranks = placement, tuple(ranks)
        idx = self.ranks.index(rank)
        spans = placement.blocks[idx]
        self.local_blocks = tuple(Block(rank, i, 0) for i in range(len(spans)))
        self._starts = placement.block_starts(idx)
        self.q_pos = torch.from_numpy(placement.positions(idx))              # [t_local] int64
        self.q_doc = torch.from_numpy(placement.doc_ids(idx))                # [t_local] int64
        self._rows: dict[int, slice] = {}                                    # document -> local rows
        for start, span in zip(self._starts, spans):
            lo = self._rows[span.doc].start if span.doc in self._rows else start
            self._rows[span.doc] = slice(lo, start + span.tokens)

    def span(self, block: Block) -> Span:
        return self.placement.blocks[self.ranks.index(block.owner)][block.chunk]

    def local_slice(self, block: Block) -> slice:
        start = self._starts[block.chunk]
        return slice(start, start + self.span(block).tokens)

    def block_tokens(self, block: Block) -> int:
        return self.span(block).tokens

    def k_pos(self, block: Block) -> torch.Tensor:
        s = self.span(block)
        return torch.arange(s.start, s.end, dtype=torch.int64)

    def k_doc(self, block: Block) -> torch.Tensor:
        s = self.span(block)
        return torch.full((s.tokens,), s.doc, dtype=torch.int64)

    def q_rows(self, block: Block) -> slice:
        # spans of one document are adjacent when blocks are sorted (place_packed); otherwise the
        # range also covers other documents' rows, which the kernels' document mask skips
        return self._rows.get(self.span(block).doc, slice(0, 0))
