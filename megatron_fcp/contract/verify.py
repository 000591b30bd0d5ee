"""``Plan.verify``: prove a plan executable and complete without running it. Pure, no ``torch``.

Checks (see :meth:`megatron_fcp.contract.plan.Plan.verify` for the contract):

* ``ranks`` are distinct; every endpoint is in the CP group; no self-sends;
* every block in a transfer is a block of this group (owner in group, chunk/part in range);
* causality: a rank sends a block only if it owns it or received it in an *earlier* round;
* exactly once: no rank receives a block twice, and no owner receives its own block;
* completeness: every rank receives every block of its need set (``Plan.need_matrix``: the
  zigzag rule of :mod:`megatron_fcp.contract.needs`, or a placement's document need sets);
* port limits (when given): no rank posts more than ``max_sends`` sends or ``max_recvs``
  receives in one round.

:func:`verify_plan` is vectorised (integer columns, numpy passes); when a check fails it reports the
fault a sequential scan in plan order would hit first, with the same message as
:func:`verify_reference`, the plain-Python specification kept for differential tests.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from megatron_fcp.contract.blocks import Block, PlanError, cp_index_of

if TYPE_CHECKING:
    from megatron_fcp.contract.plan import Plan

__all__ = ["verify_plan", "verify_reference", "check_header", "missing_error", "port_error"]


def verify_reference(plan: "Plan") -> None:
    """Sequential specification of :func:`verify_plan` (without port limits); slow, exact."""
    if len(set(plan.ranks)) != len(plan.ranks):
        raise PlanError(f"plan ranks repeat: {list(plan.ranks)}")
    if plan.parts_per_chunk < 1:
        raise PlanError(f"parts_per_chunk must be >= 1, got {plan.parts_per_chunk}")
    group = set(plan.ranks)
    have: dict[int, set[Block]] = {r: set(plan.local_blocks(r)) for r in plan.ranks}
    n_chunks = dict(zip(plan.ranks, plan.chunks_per_rank().tolist()))
    for k, rnd in enumerate(plan.rounds):
        arriving: list[tuple[int, Block]] = []
        for t in rnd:
            where = f"round {k}, transfer {t}"
            if t.src not in group or t.dst not in group:
                outside = t.src if t.src not in group else t.dst
                raise PlanError(f"{where}: rank {outside} is outside the CP group {sorted(group)}")
            if t.src == t.dst:
                raise PlanError(f"{where}: a rank sends to itself")
            b = t.block
            if b.owner not in group or not 0 <= b.chunk < n_chunks[b.owner] or not 0 <= b.part < plan.parts_per_chunk:
                raise PlanError(f"{where}: {b} is not a block of this group")
            if b not in have[t.src]:
                raise PlanError(f"{where}: rank {t.src} forwards {b} before it has arrived there")
            if b.owner == t.dst:
                raise PlanError(f"{where}: {b} is sent back to its owner {t.dst}")
            arriving.append((t.dst, b))
        seen_this_round: set[tuple[int, Block]] = set()
        for dst, b in arriving:
            if b in have[dst] or (dst, b) in seen_this_round:
                raise PlanError(f"round {k}: rank {dst} receives {b} more than once")
            seen_this_round.add((dst, b))
        for dst, b in arriving:
            have[dst].add(b)
    for r in plan.ranks:
        missing = plan.needs(r) - have[r]
        if missing:
            first = sorted(missing)[0]
            raise PlanError(
                f"rank {r} never receives {first} (and {len(missing) - 1} more needed blocks)"
            )


_NEVER = np.iinfo(np.int64).max  # arrival round of a (rank, block) that never arrives


def verify_plan(plan: "Plan", max_sends: int | None, max_recvs: int | None) -> None:
    """Raise :class:`PlanError` at the first fault (see the module docstring for the order).

    Steps: check the header; read every transfer into integer columns (:func:`_transfer_columns`);
    classify each transfer (:func:`_transfer_faults`); raise the first fault in plan order, then
    incompleteness (:func:`_check_complete`), then port limits (:func:`_check_ports`).
    """
    check_header(plan, max_sends, max_recvs)
    try:
        cols = _transfer_columns(plan)
    except (TypeError, ValueError, OverflowError, AttributeError):
        verify_reference(plan)  # odd field types: let the specification report them
        if max_sends is None and max_recvs is None:
            return
        raise PlanError("plan fields are not plain integers; cannot check port limits") from None
    faults = _transfer_faults(plan, cols)
    _raise_first_fault(plan, cols, faults)
    _check_complete(plan, faults["first"] < len(cols["flat"]))
    _check_ports(plan, cols, max_sends, max_recvs)


def check_header(plan: "Plan", max_sends: int | None, max_recvs: int | None) -> None:
    """Distinct ranks, ``parts_per_chunk >= 1``, port limits None or integers >= 1."""
    if len(set(plan.ranks)) != len(plan.ranks):
        raise PlanError(f"plan ranks repeat: {list(plan.ranks)}")
    if plan.parts_per_chunk < 1:
        raise PlanError(f"parts_per_chunk must be >= 1, got {plan.parts_per_chunk}")
    for name, v in (("max_sends", max_sends), ("max_recvs", max_recvs)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise PlanError(f"{name}: must be None or an integer >= 1, got {v!r}")


def _transfer_columns(plan: "Plan") -> dict:
    """Every transfer of ``plan`` as integer columns, in plan order.

    Returns ``flat`` (the transfers), ``rnd`` (round of each), ``src_g``/``dst_g`` (global ranks),
    ``src_i``/``dst_i`` (CP index, -1 outside the group) and, per transfer, its block's
    ``own_i`` (owner's CP index, -1 outside), ``chunk``, ``part``. Blocks are mostly shared
    objects, so block fields are read once per distinct object (``np.unique`` over ``id``) and
    gathered. Raises TypeError/ValueError/OverflowError/AttributeError on fields that are not
    plain integers.
    """
    flat = list(chain.from_iterable(plan.rounds))
    T = len(flat)
    src_g = np.fromiter(map(attrgetter("src"), flat), dtype=np.int64, count=T)
    dst_g = np.fromiter(map(attrgetter("dst"), flat), dtype=np.int64, count=T)
    obj_ids = np.fromiter(map(id, map(attrgetter("block"), flat)), dtype=np.int64, count=T)
    _, first_of, inverse = np.unique(obj_ids, return_index=True, return_inverse=True)
    uniq = [flat[i].block for i in first_of.tolist()]
    n = len(uniq)
    index_of = cp_index_of(plan.ranks)
    own_u = index_of(np.fromiter(map(attrgetter("owner"), uniq), dtype=np.int64, count=n))
    chunk_u = np.fromiter(map(attrgetter("chunk"), uniq), dtype=np.int64, count=n)
    part_u = np.fromiter(map(attrgetter("part"), uniq), dtype=np.int64, count=n)
    rnd = np.repeat(np.arange(len(plan.rounds), dtype=np.int64), [len(r) for r in plan.rounds])
    return {"flat": flat, "rnd": rnd, "src_g": src_g, "dst_g": dst_g, "src_i": index_of(src_g),
            "dst_i": index_of(dst_g), "own_i": own_u[inverse], "chunk": chunk_u[inverse],
            "part": part_u[inverse]}


def _transfer_faults(plan: "Plan", cols: dict) -> dict:
    """Boolean fault masks per transfer, and the first arrival of every (rank, block).

    A transfer is *structural*ly bad (endpoint outside the group, self-send, not a block of this
    group) or, if structurally valid: *early* (its source neither owns the block nor received it
    in an earlier round), *owner* (sent back to its owner) or a *dup*licate (not the first valid
    transfer of its (dst, block)). Block id ``b = offset[owner_index] + chunk * P + part`` (offsets
    from :meth:`Plan.chunks_per_rank`; zigzag: ``(owner_index * 2 + chunk) * P + part``); key
    ``dst_index * nb + b``; ``first[key]`` is the index of the first valid transfer of a key
    (``np.minimum.at``), ``T`` when none: transfers are in round order, so that transfer's round
    is the earliest arrival.
    """
    P, cp = plan.parts_per_chunk, plan.cp
    chunks = plan.chunks_per_rank()                                   # [cp]
    offset = np.concatenate(([0], np.cumsum(chunks * P)[:-1]))
    nb = int(chunks.sum()) * P
    rnd, src_i, dst_i, own_i = cols["rnd"], cols["src_i"], cols["dst_i"], cols["own_i"]
    chunk, part = cols["chunk"], cols["part"]
    T = len(rnd)
    outside = (src_i < 0) | (dst_i < 0)
    self_send = cols["src_g"] == cols["dst_g"]
    own_chunks = chunks[np.clip(own_i, 0, cp - 1)]
    bad_block = (own_i < 0) | (chunk < 0) | (chunk >= own_chunks) | (part < 0) | (part >= P)
    structural = outside | self_send | bad_block
    valid = ~structural
    bid = np.where(structural, 0, offset[np.clip(own_i, 0, cp - 1)] + np.clip(chunk, 0, own_chunks - 1) * P
                   + np.clip(part, 0, P - 1))
    key = np.where(valid, dst_i * nb + bid, 0)
    first = np.full(cp * nb, T, dtype=np.int64)
    idx = np.arange(T, dtype=np.int64)
    np.minimum.at(first, key[valid], idx[valid])
    arrival = np.where(first < T, rnd[np.minimum(first, max(T - 1, 0))] if T else 0, _NEVER)
    src_key = np.where(valid, src_i * nb + bid, 0)
    has = (own_i == src_i) | (arrival[src_key] < rnd)
    return {"outside": outside, "self": self_send, "block": bad_block, "structural": structural,
            "early": valid & ~has, "owner": valid & (own_i == dst_i),
            "dup": valid & (first[key] != idx), "first": first}


def _raise_first_fault(plan: "Plan", cols: dict, f: dict) -> None:
    """Raise the fault a sequential scan would meet first: per-transfer faults of round k come
    before round k's duplicates (the order of :meth:`Plan._verify_reference`)."""
    flat, rnd = cols["flat"], cols["rnd"]
    any_bad = f["structural"] | f["early"] | f["owner"]
    i1 = int(np.argmax(any_bad)) if any_bad.any() else None
    i2 = int(np.argmax(f["dup"])) if f["dup"].any() else None
    if i1 is not None and (i2 is None or rnd[i1] <= rnd[i2]):
        t, k = flat[i1], int(rnd[i1])
        where = f"round {k}, transfer {t}"
        if f["outside"][i1]:
            outside = t.src if cols["src_i"][i1] < 0 else t.dst
            raise PlanError(f"{where}: rank {outside} is outside the CP group {sorted(plan.ranks)}")
        if f["self"][i1]:
            raise PlanError(f"{where}: a rank sends to itself")
        if f["block"][i1]:
            raise PlanError(f"{where}: {t.block} is not a block of this group")
        if f["early"][i1]:
            raise PlanError(f"{where}: rank {t.src} forwards {t.block} before it has arrived there")
        raise PlanError(f"{where}: {t.block} is sent back to its owner {t.dst}")
    if i2 is not None:
        t = flat[i2]
        raise PlanError(f"round {int(rnd[i2])}: rank {t.dst} receives {t.block} more than once")


def _check_complete(plan: "Plan", received: np.ndarray) -> None:
    """Every rank received its need set (see Note [Zigzag blocks and causal need sets]).

    ``received[dst_index * nb + b]`` says whether block id ``b`` arrived at that rank.
    """
    cp = plan.cp
    nb = int(plan.chunks_per_rank().sum()) * plan.parts_per_chunk
    need = plan.need_matrix()
    missing = need & ~received.reshape(cp, nb)
    if missing.any():
        jr = int(np.argmax(missing.any(axis=1)))
        raise missing_error(plan, jr, np.nonzero(missing[jr])[0])


def missing_error(plan: "Plan", jr: int, miss_b: np.ndarray) -> PlanError:
    """The incompleteness error: CP rank ``jr`` never receives block ids ``miss_b``; names the
    smallest missing block."""
    ranks, P, chunks = plan.ranks, plan.parts_per_chunk, plan.chunks_per_rank()
    owner_of = np.repeat(np.arange(plan.cp), chunks * P)
    offset = np.concatenate(([0], np.cumsum(chunks * P)[:-1]))
    blocks_missing = sorted(Block(ranks[owner_of[b]], int(b - offset[owner_of[b]]) // P,
                                  int(b - offset[owner_of[b]]) % P) for b in miss_b)
    return PlanError(
        f"rank {ranks[jr]} never receives {blocks_missing[0]} (and {len(blocks_missing) - 1} more needed blocks)"
    )


def _check_ports(plan: "Plan", cols: dict, max_sends: int | None, max_recvs: int | None) -> None:
    """No rank posts more than ``max_sends`` sends / ``max_recvs`` receives in one round."""
    cp, n_rounds, rnd = plan.cp, len(plan.rounds), cols["rnd"]
    for limit, idx, what in ((max_sends, cols["src_i"], "sends"), (max_recvs, cols["dst_i"], "receives")):
        if limit is None or len(rnd) == 0:
            continue
        c = np.bincount(rnd * cp + idx, minlength=n_rounds * cp)
        if c.max() > limit:
            at = int(np.argmax(c > limit))
            k, r = divmod(at, cp)
            raise port_error(plan, k, r, int(c[at]), limit, what)


def port_error(plan: "Plan", k: int, r: int, count: int, limit: int, what: str) -> PlanError:
    """The port-limit error: CP rank ``r`` posts ``count`` ``what`` ("sends"/"receives") in round ``k``."""
    return PlanError(f"round {k}: rank {plan.ranks[r]} posts {count} {what}, over the port limit of {limit} "
                     f"(max_{'sends' if what == 'sends' else 'recvs'})")
