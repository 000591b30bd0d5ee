"""``Plan.verify`` for a table-backed plan (Note [Columnar plans]): proofs without objects. Pure, no torch.

Same checks, order and messages as :func:`megatron_fcp.contract.verify.verify_plan` (whose
sequential specification is ``verify_reference``): endpoints in the group, no self-sends, blocks of
this group, causality, exactly-once delivery, completeness of every need set, port limits.

Note [Verifying a table]
------------------------
A table's rows are in plan order and its endpoints are CP indices, so one pass in plan order
with one array indexed by ``(block, rank)`` proves causality and delivery:

* ``arrived[b * cp + j]`` is -1 where CP rank ``j`` owns block id ``b``, else a round in which the
  block reached it, or "never" (the dtype's maximum; int8 while there are fewer than 127 rounds).
  Block-major keys keep a block's receivers (and the relays sending it) close in memory: rows of
  one block touch one ``cp``-byte stretch.
* Round ``k``, in pieces of ``2^20`` rows, two gathers and a scatter: a row is a fault when
  ``arrived[b * cp + src] >= k`` (the sender neither owns the block nor received it in an earlier
  round: forwarding early, or sending to itself what it lacks) or ``arrived[b * cp + dst] !=
  never`` (the receiver owns it, or an earlier round delivered it: sent back to the owner, a
  duplicate, or a self-send); then ``arrived[b * cp + dst] = k``. Ranges (endpoints in
  ``0..cp-1``, block ids in ``0..nb-1``) are min/max reductions over whole columns.
* Exactly once within a round: with no fault above every row wrote one new key, so there is no
  duplicate exactly when ``count(arrived != never)`` is the number of rows plus the ``nb`` owned
  entries.
* Completeness: the need rows of a few blocks at a time (``needs_chunk``) against ``arrived``, in
  the same pass as the count.
* Ports: per round ``bincount`` of senders and receivers.

The pass only *detects* a per-row fault or a duplicate. The message names the fault a sequential
scan meets first (a round's per-transfer faults before its duplicates, earlier rounds first), so on
detection :func:`_raise_first_fault` scans again round by round with exact duplicate detection
(``np.unique`` per round): slower, and only on a broken plan. At 8,192 ranks (~100M rows) the pass
costs a few seconds and ``arrived`` 134 MB.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_fcp.contract.blocks import Block, PlanError, Transfer
from megatron_fcp.contract.needs import needs_chunk
from megatron_fcp.contract.table import TransferTable, block_layout
from megatron_fcp.contract.verify import check_header, missing_error, port_error

if TYPE_CHECKING:
    from megatron_fcp.contract.plan import Plan

__all__ = ["verify_table"]

PIECE = 1 << 20
"""Rows per numpy pass (int64 temporaries of 8 MB: heap memory is reused, no page faults per pass)."""

NEED_ROWS = 1 << 24
"""Need-matrix entries checked per pass (block rows x cp)."""


def _arrival_dtype(n_rounds: int) -> np.dtype:
    for dt in (np.int8, np.int16, np.int32):
        if n_rounds < np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def verify_table(plan: "Plan", max_sends: int | None, max_recvs: int | None) -> None:
    """Raise :class:`PlanError` at the first fault of ``plan.table`` (see Note [Verifying a table])."""
    check_header(plan, max_sends, max_recvs)
    table: TransferTable = plan.table
    cp, P = plan.cp, plan.parts_per_chunk
    chunks = plan.chunks_per_rank()
    _, owner_of, nb = block_layout(chunks, P)
    arrived, never, faulty, ports = _scan(table, cp, nb, owner_of, max_sends, max_recvs)
    if faulty:
        _raise_first_fault(plan, table, owner_of, nb)
    held, lacking = _holdings(plan, arrived.reshape(nb, cp), never)
    if held != table.num_transfers + nb:  # a (rank, block) delivered twice in one round
        _raise_first_fault(plan, table, owner_of, nb)
    if lacking.any():
        jr = int(np.argmax(lacking))
        need = _need_rows(plan, nb, cp)(0, nb)[:, jr]
        raise missing_error(plan, jr, np.nonzero(need & (arrived.reshape(nb, cp)[:, jr] == never))[0])
    for what in ("sends", "receives"):
        if ports[what] is not None:
            raise port_error(plan, *ports[what])


def _scan(table: TransferTable, cp: int, nb: int, owner_of: np.ndarray, max_sends, max_recvs):
    """One pass in plan order: ``(arrived, never, fault detected, first port violations)``.

    ``arrived[b * cp + j]``: -1 where CP rank ``j`` owns block ``b``, the round it arrived, or
    ``never``. A row is a fault when its sender does not hold the block yet (``>= k``) or its
    receiver already does (its owner, an earlier round's delivery, or a self-send)."""
    R, T = table.num_rounds, table.num_transfers
    dt = _arrival_dtype(R)
    never = np.iinfo(dt).max
    arrived = np.full(nb * cp, never, dtype=dt)  # [nb * cp]
    arrived[np.arange(nb) * cp + owner_of] = -1
    ports: dict = {"sends": None, "receives": None}
    src, dst, blk = table.src, table.dst, table.block
    if T and (min(int(src.min()), int(dst.min()), int(blk.min())) < 0 or int(src.max()) >= cp
              or int(dst.max()) >= cp or int(blk.max()) >= nb):
        return arrived, never, True, ports
    limits = (("sends", src, max_sends), ("receives", dst, max_recvs))
    for k in range(R):
        a, e = int(table.round_starts[k]), int(table.round_starts[k + 1])
        for what, col, limit in limits:
            if limit is not None and ports[what] is None and e > a:
                c = np.bincount(col[a:e], minlength=cp)
                if c.max() > limit:
                    r = int(np.argmax(c > limit))
                    ports[what] = (k, r, int(c[r]), limit, what)
        for p in range(a, e, PIECE):
            q = min(p + PIECE, e)
            key = np.multiply(blk[p:q], cp, dtype=np.int64)  # [piece] b * cp
            if (arrived[key + src[p:q]] >= k).any():          # sender does not hold it yet
                return arrived, never, True, ports
            key += dst[p:q]
            if (arrived[key] != never).any():                 # receiver holds it already
                return arrived, never, True, ports
            arrived[key] = k
    return arrived, never, False, ports


def _need_rows(plan: "Plan", nb: int, cp: int):
    """``rows(b0, b1)``: the need matrix's rows of block ids ``b0:b1`` (``[b1 - b0, cp]`` booleans)."""
    if plan.placement is not None or plan.mask.windowed:
        need_t = plan.need_matrix().T  # [nb, cp] (placements are small; windowed need sets are cached)
        return lambda b0, b1: need_t[b0:b1]
    P = plan.parts_per_chunk
    b = np.arange(nb)
    owner, chunk = b // (2 * P), (b // P) % 2
    reader = np.arange(cp)[None, :]
    return lambda b0, b1: needs_chunk(reader, owner[b0:b1, None], chunk[b0:b1, None], plan.causal)


def _holdings(plan: "Plan", arrived: np.ndarray, never: int) -> tuple[int, np.ndarray]:
    """``(entries of arrived that are not never, [cp] CP ranks missing a needed block)``, a few
    block rows at a time; ``arrived``: ``[nb, cp]``."""
    nb, cp = arrived.shape
    need_rows = _need_rows(plan, nb, cp)
    step = max(1, NEED_ROWS // max(cp, 1))
    lacking = np.zeros(cp, dtype=bool)  # [cp]
    held = 0
    for b0 in range(0, nb, step):
        b1 = min(b0 + step, nb)
        got = arrived[b0:b1] != never                     # [rows, cp]
        held += int(np.count_nonzero(got))
        lacking |= (need_rows(b0, b1) & ~got).any(axis=0)
    return held, lacking


def _raise_first_fault(plan: "Plan", table: TransferTable, owner_of: np.ndarray, nb: int) -> None:
    """Scan round by round as ``verify_reference`` does and raise the first fault it meets.

    Per round: the first row (plan order) that has an endpoint outside the group, sends to itself,
    names no block of the group, forwards a block before it arrived, or sends a block to its owner;
    else the first row delivering a (rank, block) that arrived in an earlier round or earlier in
    this round (``np.unique``'s first occurrences); else record the round's arrivals.
    """
    cp, P, ranks = plan.cp, plan.parts_per_chunk, plan.ranks
    offset = np.concatenate(([0], np.cumsum(plan.chunks_per_rank() * P)[:-1]))
    dt = _arrival_dtype(table.num_rounds)
    never = np.iinfo(dt).max
    arrived = np.full(nb * cp, never, dtype=dt)  # [nb * cp]: a round each block reached each rank in

    def block(b: int) -> Block:
        o = int(owner_of[b])
        return Block(ranks[o], int(b - offset[o]) // P, int(b - offset[o]) % P)

    def transfer(s: int, d: int, b: int) -> Transfer:
        return Transfer(ranks[s], ranks[d], block(b))

    for k in range(table.num_rounds):
        sl = table.rows(k)
        s, d, b = (c[sl].astype(np.int64) for c in (table.src, table.dst, table.block))
        outside = (s < 0) | (s >= cp) | (d < 0) | (d >= cp)
        bad_block = (b < 0) | (b >= nb)
        sc, dc, bc = np.clip(s, 0, cp - 1), np.clip(d, 0, cp - 1), np.clip(b, 0, nb - 1)
        own = owner_of[bc]
        structural = outside | (s == d) | bad_block
        early = ~structural & (own != sc) & (arrived[bc * cp + sc] >= k)
        to_owner = ~structural & ~early & (own == dc)
        bad = structural | early | to_owner
        if bad.any():
            i = int(np.argmax(bad))
            si, di, bi = int(s[i]), int(d[i]), int(b[i])
            if outside[i]:
                x = si if not 0 <= si < cp else di
                raise PlanError(f"round {k}, transfer row {sl.start + i}: CP index {x} is outside the CP group of "
                                f"{cp} ranks {sorted(ranks)}")
            where = f"round {k}, transfer {ranks[si]}->{ranks[di]}:" + (f"block id {bi}" if bad_block[i] else
                                                                         str(block(bi)))
            if si == di:
                raise PlanError(f"{where}: a rank sends to itself")
            if bad_block[i]:
                raise PlanError(f"{where}: block id {bi} is not a block of this group (0..{nb - 1})")
            t = transfer(si, di, bi)
            if early[i]:
                raise PlanError(f"{where}: rank {t.src} forwards {t.block} before it has arrived there")
            raise PlanError(f"{where}: {t.block} is sent back to its owner {t.dst}")
        key = bc * cp + dc
        dup = arrived[key] != never
        _, first = np.unique(key, return_index=True)
        again = np.ones(len(key), dtype=bool)
        again[first] = False
        dup |= again
        if dup.any():
            i = int(np.argmax(dup))
            raise PlanError(f"round {k}: rank {ranks[int(d[i])]} receives {block(int(b[i]))} more than once")
        arrived[key] = k
    raise AssertionError("verify_table: the fast pass saw a fault that the sequential scan did not find")
