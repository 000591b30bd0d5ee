"""Columnar plans: a plan's transfers as integer columns instead of ``Transfer`` objects. Pure, no torch.

Note [Columnar plans]
---------------------
A 1,024-rank ``hierarchical`` plan holds 1.57M transfers; 8,192 ranks hold ~100M. As frozen
``Transfer`` objects that is ~0.1 KB and ~0.3 us each: 10 GB and minutes at 8,192 ranks, so large
plans keep their transfers in a :class:`TransferTable` instead, four numpy columns::

    round_starts  int64 [R+1]   round k is rows round_starts[k] : round_starts[k+1]
    src, dst      int16/32 [T]  CP index (position in Plan.ranks) of sender and receiver
    block         int16/32 [T]  block id  offset[owner] + chunk * P + part

Rows are in plan order (round by round, each round's transfers in the order ``Plan.rounds`` lists
them), so the table and the rounds are two spellings of one plan: :func:`table_rounds` and
:func:`table_from_rounds` convert exactly, and the golden plan digests (taken over ``Plan.rounds``)
are the same whichever spelling a plan was built in. ``offset`` comes from
``Plan.chunks_per_rank()`` (zigzag: two chunks per rank, so ``block = (owner * 2 + chunk) * P +
part``, the block ids of ``verify``). CP indices rather than global ranks keep the columns small (int16
up to 32,767 ranks: 6 bytes per transfer, ~0.6 GB at 8,192 ranks) and make "every endpoint is in
the group" a range check. There is no round column: rounds are contiguous.

The compiler writes a table for large groups (:mod:`megatron_fcp.planner.table_compile`);
:mod:`megatron_fcp.contract.table_verify` proves it without objects. ``Plan.rounds`` stays the
contract every consumer reads: a table-backed plan materialises it on first access and caches it,
so small plans, the executor and the cost model see exactly what they saw before.

Example: ``build_plan("dgx-h100:2", [0, 1, 8, 9], "hierarchical", causal=False)`` (two nodes of two
CP ranks; block id = owner's CP index * 2 + chunk)::

    round_starts  0 16 24
    round 0  src  0 0 1 1 2 2 3 3 | 0 0 1 1 2 2 3 3      (NVLink first, then the rails)
             dst  1 1 0 0 3 3 2 2 | 2 2 3 3 0 0 1 1
           block  0 1 2 3 4 5 6 7 | 0 1 2 3 4 5 6 7
    round 1  src  2 2 3 3 0 0 1 1                        (each relay fans out what crossed)
             dst  3 3 2 2 1 1 0 0
           block  0 1 2 3 4 5 6 7

i.e. ``round 0: 0->1:B(r0,c0,p0), 0->1:B(r0,c1,p0), ..., 9->1:B(r9,c1,p0)``, ``round 1:
8->9:B(r0,c0,p0), ...`` in ``Plan.round_table()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Sequence

import numpy as np

from megatron_fcp.contract.blocks import Block, PlanError, Transfer, gc_paused, transfers_from_columns

__all__ = ["TransferTable", "block_layout", "table_rounds", "table_rank_rounds", "table_from_rounds", "table_columns",
           "small_int"]


def small_int(max_value: int) -> np.dtype:
    """The narrowest of int16 / int32 / int64 that holds ``0..max_value``."""
    for dt in (np.int16, np.int32):
        if max_value <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


@dataclass(frozen=True, eq=False)
class TransferTable:
    """A plan's transfers as columns, in plan order; see Note [Columnar plans].

    round_starts: int64 ``[R+1]`` row offsets of the rounds (``round_starts[0] == 0``, last = T).
    src, dst: ``[T]`` CP indices of sender and receiver. block: ``[T]`` block ids.
    """

    round_starts: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    block: np.ndarray

    def __post_init__(self) -> None:
        rs = self.round_starts
        cols = (("src", self.src), ("dst", self.dst), ("block", self.block))
        if not isinstance(rs, np.ndarray) or rs.ndim != 1 or rs.dtype.kind not in "iu" or len(rs) < 1:
            raise PlanError("transfer table: round_starts must be a 1-D integer array [rounds + 1]")
        for name, c in cols:
            if not isinstance(c, np.ndarray) or c.ndim != 1 or c.dtype.kind not in "iu":
                raise PlanError(f"transfer table: {name} must be a 1-D integer array")
        T = len(self.src)
        if len(self.dst) != T or len(self.block) != T:
            raise PlanError(f"transfer table: columns differ in length (src {T}, dst {len(self.dst)}, "
                            f"block {len(self.block)})")
        if int(rs[0]) != 0 or int(rs[-1]) != T or (len(rs) > 1 and (np.diff(rs) < 0).any()):
            raise PlanError(f"transfer table: round_starts must rise from 0 to the {T} rows, got "
                            f"{rs[:4].tolist()}...{rs[-1:].tolist()}")

    @property
    def num_rounds(self) -> int:
        return len(self.round_starts) - 1

    @property
    def num_transfers(self) -> int:
        return len(self.src)

    @property
    def nbytes(self) -> int:
        return self.round_starts.nbytes + self.src.nbytes + self.dst.nbytes + self.block.nbytes

    def rows(self, k: int) -> slice:
        """Rows of round ``k``."""
        return slice(int(self.round_starts[k]), int(self.round_starts[k + 1]))

    def round_of_rows(self) -> np.ndarray:
        """Round of every row (int64 ``[T]``)."""
        return np.repeat(np.arange(self.num_rounds, dtype=np.int64), np.diff(self.round_starts))


def block_layout(chunks: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(offset [cp], owner_of [nb], nb)``: block id ``offset[i] + chunk * P + part`` of CP rank
    ``i``'s blocks, and the CP index owning each block id (``chunks``: chunks per CP rank)."""
    chunks = np.asarray(chunks, dtype=np.int64)
    offset = np.concatenate(([0], np.cumsum(chunks * P)[:-1])).astype(np.int64)
    nb = int(chunks.sum()) * P
    owner_of = np.repeat(np.arange(len(chunks), dtype=np.int64), chunks * P)
    return offset, owner_of, nb


def _block_objects(ranks: Sequence[int], chunks: np.ndarray, P: int) -> list[Block]:
    """One ``Block`` per block id (shared by every transfer of it, as the object compiler does)."""
    return [Block(r, c, p) for r, n in zip(ranks, chunks.tolist()) for c in range(n) for p in range(P)]


def table_rounds(table: TransferTable, ranks: Sequence[int], chunks: np.ndarray,
                 P: int) -> tuple[tuple[Transfer, ...], ...]:
    """``Plan.rounds`` of a table-backed plan: one ``Transfer`` per row, plan order kept.

    Algorithm: global ranks and block objects by lookup (``block`` ids index one shared ``Block``
    each), then each round's objects are built in one batch
    (:func:`~megatron_fcp.contract.blocks.transfers_from_columns`)."""
    rank_arr = np.asarray(ranks, dtype=np.int64)
    blocks = _block_objects(ranks, np.asarray(chunks), P)
    get = blocks.__getitem__
    out = []
    with gc_paused():
        for k in range(table.num_rounds):
            sl = table.rows(k)
            out.append(tuple(transfers_from_columns(rank_arr[table.src[sl]].tolist(),
                                                    rank_arr[table.dst[sl]].tolist(),
                                                    list(map(get, table.block[sl].tolist())))))
    return tuple(out)


def table_rank_rounds(table: TransferTable, ranks: Sequence[int], chunks: np.ndarray, P: int, i: int):
    """Per round, ``(sends, receives)`` of CP rank ``i`` as ``Transfer`` tuples in plan order, built
    from the rows that name it (``src == i`` or ``dst == i``) without the rest of the plan."""
    rows = np.flatnonzero((table.src == i) | (table.dst == i))
    k_of = np.searchsorted(table.round_starts, rows, side="right") - 1
    rank_arr = np.asarray(ranks, dtype=np.int64)
    blocks = _block_objects(ranks, np.asarray(chunks), P)
    mine = transfers_from_columns(rank_arr[table.src[rows]].tolist(), rank_arr[table.dst[rows]].tolist(),
                                  list(map(blocks.__getitem__, table.block[rows].tolist())))
    per_round: list[tuple[list, list]] = [([], []) for _ in range(table.num_rounds)]
    for k, sends, receives, t in zip(k_of.tolist(), (table.src[rows] == i).tolist(),
                                     (table.dst[rows] == i).tolist(), mine):
        if sends:
            per_round[k][0].append(t)
        if receives:
            per_round[k][1].append(t)
    return tuple((tuple(s), tuple(r)) for s, r in per_round)


def table_from_rounds(rounds, ranks: Sequence[int], chunks: np.ndarray, P: int) -> TransferTable:
    """The table of object ``rounds`` (exact inverse of :func:`table_rounds`).

    Raises :class:`PlanError` for a transfer a table cannot hold: an endpoint or block owner outside
    the group, or a chunk / part out of range (``verify`` reports the same transfers)."""
    flat = list(chain.from_iterable(rounds))
    T = len(flat)
    index = {r: i for i, r in enumerate(ranks)}
    offset, _, nb = block_layout(chunks, P)
    chunks = np.asarray(chunks, dtype=np.int64)
    try:
        src = np.fromiter(map(index.__getitem__, map(attrgetter("src"), flat)), dtype=np.int64, count=T)
        dst = np.fromiter(map(index.__getitem__, map(attrgetter("dst"), flat)), dtype=np.int64, count=T)
        own = np.fromiter(map(index.__getitem__, map(attrgetter("block.owner"), flat)), dtype=np.int64, count=T)
    except KeyError as exc:
        raise PlanError(f"transfer table: rank {exc.args[0]} is outside the CP group {sorted(ranks)}") from None
    chunk = np.fromiter(map(attrgetter("block.chunk"), flat), dtype=np.int64, count=T)
    part = np.fromiter(map(attrgetter("block.part"), flat), dtype=np.int64, count=T)
    bad = (chunk < 0) | (chunk >= chunks[own]) | (part < 0) | (part >= P)
    if bad.any():
        raise PlanError(f"transfer table: {flat[int(np.argmax(bad))].block} is not a block of this group")
    idx_t, blk_t = small_int(len(ranks)), small_int(nb)
    starts = np.concatenate(([0], np.cumsum([len(r) for r in rounds]))).astype(np.int64)
    return TransferTable(starts, src.astype(idx_t), dst.astype(idx_t), (offset[own] + chunk * P + part).astype(blk_t))


def table_columns(table: TransferTable, ranks: Sequence[int], chunks: np.ndarray, P: int):
    """``(round, src, dst, owner, chunk, part)`` int64 arrays of every row (global ranks), plan order."""
    rank_arr = np.asarray(ranks, dtype=np.int64)
    offset, owner_of, _ = block_layout(chunks, P)
    b = table.block.astype(np.int64)
    own_i = owner_of[b]
    within = b - offset[own_i]
    return (table.round_of_rows(), rank_arr[table.src], rank_arr[table.dst], rank_arr[own_i], within // P,
            within % P)
