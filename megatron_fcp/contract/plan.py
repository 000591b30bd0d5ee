"""The plan contract: who sends which KV block to whom, in which round. Pure data, no ``torch``.

This module is the contract between the planner (graph -> plan) and the attention engine
(plan -> communication + compute). Everything here is plain frozen data so plans can be built,
verified and compared in microseconds without processes. Blocks and need sets:
:mod:`megatron_fcp.contract.blocks`, :mod:`megatron_fcp.contract.needs`.

Rounds
------
A plan is a sequence of rounds. All transfers in a round run concurrently; a transfer's source
must hold the block when the round starts (it owns it or received it in an earlier round). Ranks
are **global** ranks; ``Plan.ranks`` lists the CP group's global ranks in CP-rank order. Two
transfers of one round between the same pair are matched in plan order on both sides.

The backward pass runs the same rounds reversed with every transfer flipped: each rank sends its
partial dK/dV of a block back to the rank it received the block from, after adding the partials
its own children sent it (which arrive in later forward rounds, i.e. earlier backward rounds).

Note [A backward on another graph]
----------------------------------
The forward and the backward of a plan need not walk one graph. The forward moves each block once
to its readers and is done; the backward re-sends KV under a memory budget and reduces dK/dV, and a
graph whose blocks travel chains (the ring) streams that one hop per step where a need-driven graph
packs waves whose relays hold blocks too. On TE's layout at cp = 16 (1M tokens, median 32K, 64:8,
dgx-h100:2; 2026-12-07) the ring's forward moved its KV in 80.7 ms, ``hierarchical``'s in 9.6 ms
(1.19x the need-set bound), both hidden behind 184.4 ms of compute; the ring's backward took
460.9 ms in 16 steps, ``hierarchical``'s 464.7 ms in 18 waves. A plan may therefore carry
``backward``: the plan whose transfers the backward walks (:attr:`Plan.backward_plan`: that one,
or the plan itself). Everything about the backward reads it and only it: the backward program
(:func:`~megatron_fcp.schedule.program.compile_backward`), so the executor's backward runners, the
cost model's backward and its floors, and the emulator.

Invariants, checked by :meth:`Plan.with_backward` and :meth:`Plan.verify` before anything is sent: both plans are verified
and over the same ranks, placement, mask and blocks; the backward plan has no backward of its own;
and the forward delivers every block the backward plan delivers in its first round. What a backward
keeps from the forward (Note [Backward KV modes] in :mod:`megatron_fcp.schedule.program`) is the
need set (``keep``), the first wave's deliveries that their receiver computes (a need, which every
verified forward delivers), or a chain's first sub-round, relays included: part of the first
round. So whatever is kept, the forward has received. A forward graph that sends blocks only to
their readers therefore also carries the backward's first-round relays
(:func:`~megatron_fcp.planner.build.join_backward`). The rounds the forward posts are ``rounds``;
the reduction's are the backward plan's, reversed and flipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Iterable, Iterator

import numpy as np

from megatron_fcp.contract.blocks import Block, PlanError, Transfer, blocks_of, cp_index_of, part_tokens
from megatron_fcp.contract.mask import Mask, check_window
from megatron_fcp.contract.needs import need_matrix, need_set, zigzag_need_matrix
from megatron_fcp.contract.placement import Placement
from megatron_fcp.contract.table import TransferTable, block_layout, table_columns, table_rank_rounds, table_rounds
from megatron_fcp.contract.table_verify import verify_table
from megatron_fcp.contract.verify import verify_plan
from megatron_fcp.memo import without_memo
from megatron_fcp.topology import Topology, TopologyError

__all__ = ["Plan", "AutoChoice", "ring_plan", "full_plan", "halo_plan", "SIMPLE_PLANS", "check_cp_ranks", "plan_mask"]


@dataclass(frozen=True)
class AutoChoice:
    """How ``graph="auto"`` chose a plan: the predicted seconds of every candidate graph."""

    metric: str  # "comm_s" (communication alone) or "total_s" (overlapped with compute)
    times: tuple[tuple[str, float], ...]  # (graph name, predicted seconds), in candidate order


class _Rounds:
    """``Plan.rounds`` (a dataclass field whose storage is ``_rounds``): the rounds given to the
    constructor, or for a table-backed plan (``rounds=None, table=...``) the rounds materialised
    from the table on first access and cached (Note [Columnar plans] in
    :mod:`megatron_fcp.contract.table`)."""

    def __get__(self, plan, owner=None):
        if plan is None:
            raise AttributeError("rounds")  # no class-level default: the field stays required
        d = plan.__dict__
        rounds = d.get("_rounds")
        if rounds is None:
            rounds = d["_rounds"] = table_rounds(plan.table, plan.ranks, plan.chunks_per_rank(), plan.parts_per_chunk)
        return rounds

    def __set__(self, plan, value) -> None:
        plan.__dict__["_rounds"] = value


def plan_mask(causal: bool, window, placement: Placement | None = None) -> Mask:
    """The mask a plan is built for: ``causal`` and ``window`` (None: the placement's window, or
    none), checked; :class:`~megatron_fcp.contract.blocks.PlanError` naming the fix otherwise."""
    if window is None and placement is not None:
        window = placement.window
    try:
        return Mask(bool(causal), *check_window(window))
    except ValueError as e:
        raise PlanError(str(e)) from None


@dataclass(frozen=True)
class Plan:
    """A schedule of KV block transfers inside one CP group; :meth:`verify` proves it.

    ranks: the CP group's global ranks, index = CP rank (zigzag position, or placement index).
    rounds: per round, the transfers that run concurrently.
    causal: whether need sets follow the causal mask (Note in :mod:`megatron_fcp.contract.needs`).
    parts_per_chunk: sub-blocks per zigzag chunk (a chunk of L tokens is cut at ``p*L//P``: Note
        [Sub-block sizes] in :mod:`megatron_fcp.contract.blocks`).
    name: the graph it was built on (``"ring"``, ``"full"``, ``"hierarchical"`` ...).
    max_sends / max_recvs: per-rank, per-round port limits the rounds were packed under (None: none).
    kv_sizes: relative KV size of each CP rank's blocks (CP order) when they differ (``balanced``);
        None means equal sizes.
    auto: for ``graph="auto"``, the candidates' predicted times.
    placement: for a packed batch, the blocks each rank holds (Note in
        :mod:`megatron_fcp.contract.placement`); ``Block(owner, chunk, 0)`` is then the ``chunk``-th
        block of ``owner`` and need sets follow documents. None: Megatron's zigzag layout.
    table: the transfers as columns (:class:`~megatron_fcp.contract.table.TransferTable`) for a plan
        built with ``rounds=None``: ``rounds`` is then materialised from it on first access, and
        :meth:`verify`, :meth:`num_transfers`, :attr:`num_rounds` and :meth:`transfer_columns` read
        the table without building objects (Note [Columnar plans]). Explicit rounds win: a plan given
        both drops the table (``dataclasses.replace(plan, rounds=...)`` stays right).
    window: the sliding window ``(left, right)`` need sets follow (Megatron's ``window_size``, -1:
        unbounded; default ``(-1, -1)``: none); :attr:`mask` is ``causal`` and ``window`` together
        (Note [Windowed need sets] in :mod:`megatron_fcp.contract.needs`). Over a placement the
        default takes the placement's window; another window is an error.
    seq_len: the padded global sequence in tokens (a multiple of ``2*cp``). Required for a
        windowed zigzag plan (its need sets depend on it); None otherwise.
    backward: the plan whose transfers the backward walks when it is not this one (Note [A backward
        on another graph]); attach it with :meth:`with_backward`, which checks it. None: this plan.
    """

    ranks: tuple[int, ...]
    rounds: tuple[tuple[Transfer, ...], ...] = _Rounds()  # type: ignore[assignment]
    causal: bool = True
    parts_per_chunk: int = 1
    name: str = "custom"
    max_sends: int | None = None
    max_recvs: int | None = None
    kv_sizes: tuple[float, ...] | None = None
    auto: AutoChoice | None = None
    placement: Placement | None = None
    table: TransferTable | None = field(default=None, repr=False, compare=False)
    window: tuple[int, int] = (-1, -1)
    seq_len: int | None = None
    backward: "Plan | None" = field(default=None, repr=False)
    _verified_ports: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.__dict__["_rounds"] is None:
            if self.table is None:
                raise PlanError("a plan needs rounds, or rounds=None and a transfer table (table=)")
        elif self.table is not None:
            object.__setattr__(self, "table", None)  # explicit rounds win
        try:
            window = Mask(bool(self.causal), *check_window(self.window)).window  # causal: right = 0
        except ValueError as e:
            raise PlanError(str(e)) from None
        if self.placement is not None and window == (-1, -1):
            window = self.placement.window  # a plan over a placement follows the placement's mask
        if window != self.window:
            object.__setattr__(self, "window", window)
        if self.placement is not None:
            pl = self.placement
            if pl.cp != len(self.ranks) or pl.causal != self.causal or self.parts_per_chunk != 1:
                raise PlanError(f"plan over a placement: needs {pl.cp} ranks (got {len(self.ranks)}), "
                                f"causal={pl.causal} (got {self.causal}) and parts_per_chunk=1 "
                                f"(got {self.parts_per_chunk}); cut blocks in the placement instead")
            if pl.window != window:
                raise PlanError(f"plan over a placement: window={window} but the placement's is {pl.window}; "
                                "place the batch with place_packed(window=...) and pass the same window")
        elif self.mask.windowed:
            zigzag_need_matrix(len(self.ranks), self.parts_per_chunk, self.mask, self.seq_len)  # checks seq_len
        if self.backward is not None:
            self._check_backward(self.backward)

    def _check_backward(self, other: "Plan") -> None:
        """PlanError unless ``other`` is over the same blocks and mask as this plan and has no
        backward of its own (the cheap half of :meth:`with_backward`'s checks; a copy of a plan
        made with another CP group or placement fails here instead of running the old backward)."""
        if not isinstance(other, Plan):
            raise PlanError(f"backward: a Plan over the same blocks, got {type(other).__name__}")
        if other.backward is not None:
            raise PlanError(f"backward: plan {other.name!r} has a backward of its own; attach its backward_plan")
        same = (other.ranks == self.ranks, other.placement is self.placement or other.placement == self.placement,
                other.causal == self.causal, other.window == self.window,
                other.parts_per_chunk == self.parts_per_chunk, other.seq_len == self.seq_len,
                other.kv_sizes == self.kv_sizes)
        if not all(same):
            raise PlanError(f"backward: plan {other.name!r} must cover this plan's ranks, placement, mask and "
                            f"blocks (ranks, placement, causal, window, parts_per_chunk, seq_len, kv_sizes "
                            f"equal: {same}); build both with the same arguments but the graph")

    # ---- queries ----------------------------------------------------------------------------
    @property
    def cp(self) -> int:
        return len(self.ranks)

    @property
    def mask(self) -> Mask:
        """The position mask the need sets follow: ``causal`` and ``window``."""
        return Mask(self.causal, *self.window)

    def cp_index(self, rank: int) -> int:
        pos = self.__dict__.get("_cp_index")   # global rank -> CP index, once per plan object
        if pos is None:
            pos = self.__dict__["_cp_index"] = {r: i for i, r in enumerate(self.ranks)}
        try:
            return pos[rank]
        except (KeyError, TypeError):
            raise PlanError(f"rank {rank} is not in the plan's CP group {list(self.ranks)}") from None

    def cp_positions(self, ranks) -> np.ndarray:
        """:meth:`cp_index` of an array of global ranks at once (int64; -1 outside the group)."""
        index_of = self.__dict__.get("_cp_index_of")
        if index_of is None:
            index_of = self.__dict__["_cp_index_of"] = cp_index_of(self.ranks)
        return index_of(np.asarray(ranks, dtype=np.int64))

    def block_numbers(self, owner, chunk, part) -> np.ndarray:
        """int64: each block's place in :meth:`blocks` (a need or work matrix column), for arrays of
        global owner ranks, chunks and parts (``block_layout``'s ``offset[owner] + chunk * P + part``)."""
        at = self.cp_positions(owner)
        if (at < 0).any():
            bad = np.asarray(owner, dtype=np.int64).reshape(-1)[(at < 0).reshape(-1)][:3].tolist()
            raise PlanError(f"block owners {bad} are not in the plan's CP group {list(self.ranks)}")
        offset = block_layout(self.chunks_per_rank(), self.parts_per_chunk)[0]
        return offset[at] + np.asarray(chunk) * self.parts_per_chunk + np.asarray(part)

    def local_blocks(self, rank: int) -> tuple[Block, ...]:
        """Blocks global ``rank`` owns, in the order of its local tokens (built once per rank and
        plan object: the backward program, the cost model and the executor ask per wave)."""
        cache = self.__dict__.setdefault("_local_blocks", {})
        got = cache.get(rank)
        if got is None:
            if self.placement is None:
                got = blocks_of(rank, self.parts_per_chunk)
            else:
                got = tuple(Block(rank, b, 0) for b in range(len(self.placement.blocks[self.cp_index(rank)])))
            cache[rank] = got
        return got

    def blocks(self) -> tuple[Block, ...]:
        """Every block, owner by owner in CP order (built once per plan object)."""
        got = self.__dict__.get("_blocks")
        if got is None:
            got = self.__dict__["_blocks"] = tuple(b for r in self.ranks for b in self.local_blocks(r))
        return got

    def block_tokens(self, block: Block, seq_len: int | None = None) -> int:
        """Tokens of ``block``: its span of the placement, or the zigzag sub-block of a ``seq_len``-token
        global sequence (a multiple of ``2 * cp``: the padded one; parts of floor/ceil size, Note
        [Sub-block sizes]). The one rule for a block's size: the executor's buffers, the backward
        program and the cost model all count with it."""
        if self.placement is not None:
            return self.placement.blocks[self.cp_index(block.owner)][block.chunk].tokens
        seq_len = self.seq_len if seq_len is None else seq_len
        if seq_len is None:
            raise ValueError("Plan.block_tokens: a zigzag plan needs seq_len (the padded global sequence)")
        return part_tokens(seq_len, self.cp, self.parts_per_chunk, block.part)

    def block_token_counts(self, seq_len: int | None = None) -> np.ndarray:
        """int64 ``[n_blocks]``, read-only: :meth:`block_tokens` of every block of :meth:`blocks`, in
        that order (a placement's block spans; a zigzag plan's parts, the same ``2 * cp`` times)."""
        if self.placement is not None:
            return self.placement.block_tokens()
        seq_len = self.seq_len if seq_len is None else seq_len
        if seq_len is None:
            raise ValueError("Plan.block_token_counts: a zigzag plan needs seq_len (the padded global sequence)")
        parts = [part_tokens(seq_len, self.cp, self.parts_per_chunk, p) for p in range(self.parts_per_chunk)]
        got = np.tile(np.asarray(parts, dtype=np.int64), 2 * self.cp)       # blocks_of: chunk-major, then parts
        got.flags.writeable = False
        return got

    def chunks_per_rank(self) -> np.ndarray:
        """Chunks each CP rank owns (int64 ``[cp]``; each cut into ``parts_per_chunk`` blocks):
        2 under zigzag, the number of its blocks under a placement."""
        if self.placement is None:
            return np.full(self.cp, 2, dtype=np.int64)
        return self.placement.blocks_per_rank()

    def needs(self, rank: int) -> frozenset[Block]:
        """Blocks global ``rank`` must receive (:func:`~megatron_fcp.contract.needs.need_set`, or the
        placement's document need sets)."""
        cache = self.__dict__.setdefault("_needs", {})   # per rank, computed once per plan object
        got = cache.get(rank)
        if got is None:
            if self.placement is None:
                got = need_set(self.ranks, rank, self.mask, self.parts_per_chunk, seq_len=self.seq_len)
            else:
                got = self.placement.needs(self.ranks, rank)
            cache[rank] = got
        return got

    def need_matrix(self) -> np.ndarray:
        """``[cp, n_blocks]`` booleans over block ids ``offset[owner] + chunk * P + part``."""
        if self.placement is None:
            return need_matrix(self.cp, self.parts_per_chunk, self.mask, seq_len=self.seq_len)
        return self.placement.need_matrix()

    def transfers(self) -> Iterator[tuple[int, Transfer]]:
        """All ``(round, transfer)`` pairs in plan order."""
        for k, rnd in enumerate(self.rounds):
            for t in rnd:
                yield k, t

    def sends(self, rank: int, round_index: int) -> tuple[Transfer, ...]:
        """Transfers ``rank`` sends in round ``round_index``, plan order (:meth:`rank_rounds`)."""
        return self.rank_rounds(rank)[round_index][0]

    def recvs(self, rank: int, round_index: int) -> tuple[Transfer, ...]:
        """Transfers ``rank`` receives in round ``round_index``, plan order (:meth:`rank_rounds`)."""
        return self.rank_rounds(rank)[round_index][1]

    def rank_rounds(self, rank: int) -> tuple[tuple[tuple[Transfer, ...], tuple[Transfer, ...]], ...]:
        """Per round, ``(sends, receives)`` of global ``rank`` in plan order: one rank's view of the
        plan, built once per rank and cached (an executor asks for it every round). A table-backed
        plan whose rounds were never materialised builds only this rank's transfers, from two
        column compares (8,192 ranks: ~0.8 s and ~24K objects instead of ~100M)."""
        cache = self.__dict__.setdefault("_rank_rounds", {})
        view = cache.get(rank)
        if view is None:
            if self.table is not None and self.__dict__["_rounds"] is None and rank in self.ranks:
                view = table_rank_rounds(self.table, self.ranks, self.chunks_per_rank(), self.parts_per_chunk,
                                         self.cp_index(rank))
            else:
                view = tuple((tuple(t for t in rnd if t.src == rank), tuple(t for t in rnd if t.dst == rank))
                             for rnd in self.rounds)
            cache[rank] = view
        return view

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_rank_rounds", None)  # caches: rebuilt on use
        state.pop("_needs", None)
        state.pop("_cp_index", None)
        state.pop("_cp_index_of", None)
        state.pop("_columns", None)
        state.pop("_local_blocks", None)
        state.pop("_blocks", None)
        return without_memo(state)     # what the planner derived from this object (megatron_fcp.memo)

    def received_blocks(self, rank: int) -> tuple[Block, ...]:
        """Blocks ``rank`` receives, in the order they arrive (plan order)."""
        return tuple(t.block for _, t in self.transfers() if t.dst == rank)

    def num_transfers(self) -> int:
        if self.table is not None:
            return self.table.num_transfers
        return sum(len(r) for r in self.rounds)

    @property
    def num_rounds(self) -> int:
        """``len(self.rounds)``, without materialising a table-backed plan's rounds."""
        return self.table.num_rounds if self.table is not None else len(self.rounds)

    def transfer_columns(self) -> tuple[np.ndarray, ...]:
        """``(round, src, dst, owner, chunk, part)`` int64 arrays of every transfer (global ranks),
        in plan order; read from the table when the plan has one. Built once per plan object (the
        cost model, the floors and the wave packing all read them), read-only."""
        got = self.__dict__.get("_columns")
        if got is not None:
            return got
        if self.table is not None:
            got = table_columns(self.table, self.ranks, self.chunks_per_rank(), self.parts_per_chunk)
        else:
            flat = [t for r in self.rounds for t in r]
            T = len(flat)
            rnd = np.repeat(np.arange(len(self.rounds), dtype=np.int64), [len(r) for r in self.rounds])
            got = (rnd, *(np.fromiter(map(attrgetter(f), flat), dtype=np.int64, count=T)
                          for f in ("src", "dst", "block.owner", "block.chunk", "block.part")))
        for col in got:
            col.flags.writeable = False
        self.__dict__["_columns"] = got
        return got

    def chunks_moved(self) -> float:
        """Bytes moved in units of one zigzag chunk of KV."""
        return self.num_transfers() / self.parts_per_chunk

    # ---- verification -----------------------------------------------------------------------
    def verify(self, max_sends: int | None = None, max_recvs: int | None = None) -> "Plan":
        """Prove the plan is executable and complete; raise :class:`PlanError` otherwise.

        Checks, without running anything:
        * ``ranks`` are distinct; every endpoint is in the CP group; no self-sends;
        * every block in a transfer is a block of this group (owner in group, chunk/part in range);
        * causality: a rank sends a block only if it owns it or received it in an *earlier* round;
        * exactly once: no rank receives a block twice, and no owner receives its own block;
        * completeness: every rank receives every block of its need set;
        * port limits (when given): no rank posts more than ``max_sends`` sends or ``max_recvs``
          receives in one round.
        Send/receive matching and deadlock freedom hold by construction of the round model: both
        sides derive their per-round posts from the same transfer list (sends and receives of a
        round are all posted before any is waited on), so each receive has exactly one matching
        send in the same round, and rounds only wait on transfers they themselves posted.
        Returns ``self`` so calls can be chained.

        A plan is verified once: a verified plan carries that state (:attr:`verified`, with the
        port limits it was checked against), and calling ``verify`` again with no stricter limits
        returns at once, so executors can call it on every use. Algorithm and error order:
        :mod:`megatron_fcp.contract.verify`.
        """
        if self._verified_ports is not None and _no_stricter(self._verified_ports, (max_sends, max_recvs)):
            return self
        if self.table is not None:
            verify_table(self, max_sends, max_recvs)  # same checks and messages, no objects
        else:
            verify_plan(self, max_sends, max_recvs)
        if self.backward is not None:   # a plan made with Plan(..., backward=) too, not only with_backward
            self.backward.verify()
            self._check_first_round(self.backward)
        object.__setattr__(self, "_verified_ports", (max_sends, max_recvs))  # a fact about frozen data
        return self

    def with_auto(self, auto: AutoChoice) -> "Plan":
        """This plan with ``auto`` recorded; the rounds are the same, so it stays verified."""
        return self._with(auto=auto)

    @property
    def backward_plan(self) -> "Plan":
        """The plan whose transfers the backward walks: :attr:`backward`, or this plan (Note [A
        backward on another graph])."""
        return self if self.backward is None else self.backward

    def with_backward(self, backward: "Plan | None") -> "Plan":
        """This plan with its backward walking ``backward``'s transfers (None: its own), after the
        checks of Note [A backward on another graph]; PlanError naming what differs otherwise. The
        forward rounds are the same, so the result stays verified."""
        if backward is not None:
            self._check_backward(backward)
            if not (self.verified and backward.verified):
                raise PlanError("with_backward: verify both plans first (Plan.verify())")
            self._check_first_round(backward)
        return self._with(backward=backward)

    def _check_first_round(self, backward: "Plan") -> None:
        """PlanError unless this plan's forward makes every delivery of ``backward``'s first round
        (Note [A backward on another graph])."""
        missing = self.undelivered_first_round(backward)
        if missing:
            rank, block = missing[0]
            raise PlanError(f"backward: plan {backward.name!r} delivers {len(missing)} block(s) in its first "
                            f"round that plan {self.name!r}'s forward does not (e.g. {block} to rank {rank}), "
                            "so its backward could not keep them; add them to the forward "
                            "(megatron_fcp.planner.build.join_backward) or use this plan's own backward")

    def undelivered_first_round(self, backward: "Plan") -> list[tuple[int, Block]]:
        """``(rank, block)`` of each delivery of ``backward``'s first round that this plan's
        forward does not make, in ``backward``'s order (Note [A backward on another graph])."""
        rnd, _, dst, owner, chunk, part = backward.transfer_columns()
        first = rnd == 0
        want = self._delivery_keys(dst[first], owner[first], chunk[first], part[first])
        got = self._delivery_keys(*self.transfer_columns()[2:])
        where = np.flatnonzero(~np.isin(want, got))
        idx = np.flatnonzero(first)[where]
        return [(int(dst[i]), Block(int(owner[i]), int(chunk[i]), int(part[i]))) for i in idx]

    def _delivery_keys(self, dst: np.ndarray, owner: np.ndarray, chunk: np.ndarray, part: np.ndarray) -> np.ndarray:
        """int64 per delivery: (receiving CP position, block number) as one number, for set tests."""
        blocks = block_layout(self.chunks_per_rank(), self.parts_per_chunk)[2]
        return self.cp_positions(dst) * blocks + self.block_numbers(owner, chunk, part)

    def _with(self, **changes) -> "Plan":
        """This plan with fields other than its transfers changed: the rounds are the same object,
        so it stays verified."""
        out = replace(self, rounds=self.__dict__["_rounds"] if self.table is None else None, **changes)
        if self.table is not None and self.__dict__["_rounds"] is not None:
            out.__dict__["_rounds"] = self.__dict__["_rounds"]  # keep rounds already materialised
        object.__setattr__(out, "_verified_ports", self._verified_ports)
        return out

    @property
    def verified(self) -> bool:
        """Whether :meth:`verify` has proved this plan (it is frozen, so the proof stays valid)."""
        return self._verified_ports is not None

    def backward_rounds(self) -> tuple[tuple[Transfer, ...], ...]:
        """Rounds of the dK/dV reduction: forward rounds reversed, every transfer flipped.

        In backward round ``k`` a rank sends its partial dK/dV of ``block`` to the rank it received
        ``block`` from in forward round ``len(rounds)-1-k``, after adding the partials its own
        children sent it in earlier backward rounds.
        """
        return tuple(tuple(Transfer(t.dst, t.src, t.block) for t in rnd) for rnd in reversed(self.rounds))

    # ---- presentation -----------------------------------------------------------------------
    def round_table(self) -> str:
        """One line per round: ``round k: src->dst:block, ...``."""
        mask = f" window={self.window}" if self.mask.windowed else ""
        lines = [f"plan {self.name!r}: cp={self.cp} ranks={list(self.ranks)} causal={self.causal}{mask} "
                 f"parts/chunk={self.parts_per_chunk} rounds={len(self.rounds)} transfers={self.num_transfers()}"]
        for k, rnd in enumerate(self.rounds):
            lines.append(f"  round {k}: " + ", ".join(str(t) for t in rnd))
        if self.backward is not None:   # Note [A backward on another graph]
            lines.append(f"  backward: plan {self.backward.name!r}, rounds={self.backward.num_rounds} "
                         f"transfers={self.backward.num_transfers()}")
        return "\n".join(lines)


def _check_ranks(ranks: Iterable[int]) -> tuple[int, ...]:
    ranks = tuple(int(r) for r in ranks)
    if len(ranks) < 1:
        raise PlanError("a plan needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise PlanError(f"CP group ranks repeat: {list(ranks)}")
    return ranks


def ring_plan(ranks: Iterable[int], causal: bool = True, parts_per_chunk: int = 1, *,
              window: tuple[int, int] | None = None, seq_len: int | None = None) -> Plan:
    """Transformer Engine's p2p ring: ``cp-1`` rounds, each rank forwards what it received.

    In round ``k`` CP rank ``i`` sends the KV pair of CP rank ``(i-k) mod cp`` (both chunks, as TE
    does whatever the mask) to CP rank ``i+1``. Every rank ends up with every block; with causal
    masking some arrive only to be passed on, exactly as in TE. Under a ``window`` (``seq_len``
    required) it stays this ring: it over-delivers and is priced so (TE itself refuses windows on
    ``p2p``; :func:`halo_plan` is the ring that moves only the window's neighbours).
    """
    ranks = _check_ranks(ranks)
    cp = len(ranks)
    rounds = []
    for k in range(cp - 1):
        rnd = []
        for i, src in enumerate(ranks):
            owner = ranks[(i - k) % cp]
            dst = ranks[(i + 1) % cp]
            rnd.extend(Transfer(src, dst, b) for b in blocks_of(owner, parts_per_chunk))
        rounds.append(tuple(rnd))
    return Plan(ranks, tuple(rounds), causal, parts_per_chunk, name="ring", **_window_fields(causal, window, seq_len))


def full_plan(ranks: Iterable[int], causal: bool = True, parts_per_chunk: int = 1, *,
              placement: Placement | None = None, window: tuple[int, int] | None = None,
              seq_len: int | None = None) -> Plan:
    """The ``full`` graph's direct schedule without a topology: each owner sends each block straight
    to every rank that needs it.

    Round ``k`` (``k = 1..cp-1``) pairs CP rank ``i`` with ``i+k`` so every rank sends to one peer
    and receives from one peer per round, and blocks arrive progressively for overlap. (Compiled
    on a topology, :class:`~megatron_fcp.planner.builders.FullGraph` sends the same transfers in
    one round.) ``placement``: the same staggered rounds over a packed batch's blocks and document
    need sets (``causal`` must be the placement's); rounds left empty are dropped. ``window``
    (default: the placement's, or none) and ``seq_len`` (zigzag under a window): each block goes
    only to the ranks its window reaches; rounds left empty are dropped.
    """
    ranks = _check_ranks(ranks)
    cp = len(ranks)
    if window is None and placement is not None:
        window = placement.window
    base = Plan(ranks, (), causal, parts_per_chunk, name="full", placement=placement,
                **_window_fields(causal, window, seq_len))  # checks cp, causal, window, seq_len
    needed = {r: base.needs(r) for r in ranks}
    rounds = []
    for k in range(1, cp):
        rnd = []
        for i, src in enumerate(ranks):
            dst = ranks[(i + k) % cp]
            rnd.extend(Transfer(src, dst, b) for b in base.local_blocks(src) if b in needed[dst])
        if rnd or (placement is None and not base.mask.windowed):
            rounds.append(tuple(rnd))
    return replace(base, rounds=tuple(rounds))


def halo_plan(ranks: Iterable[int], causal: bool = True, parts_per_chunk: int = 1, *,
              window: tuple[int, int] | None = None, seq_len: int | None = None) -> Plan:
    """The halo exchange of a sliding window (Megatron-LM PR #5597's ``swa_p2p`` idea): every rank
    receives exactly the blocks its window reaches, straight from their owners, nearest CP
    neighbours first. Round ``d`` (``d = 1, 2, ...``) carries what CP rank ``i`` needs from CP ranks
    ``i-d`` and ``i+d``; rounds with nothing to carry are dropped. For a causal window of at most
    one chunk under zigzag each rank receives one chunk from each CP neighbour (two rounds; Note
    [Windowed need sets]). Without a window it is the ``full`` plan reordered by distance.
    """
    ranks = _check_ranks(ranks)
    cp = len(ranks)
    base = Plan(ranks, (), causal, parts_per_chunk, name="halo", **_window_fields(causal, window, seq_len))
    needed = {r: base.needs(r) for r in ranks}
    rounds = []
    for d in range(1, cp // 2 + 1):
        rnd = []
        for i, dst in enumerate(ranks):
            for src in dict.fromkeys((ranks[(i - d) % cp], ranks[(i + d) % cp])):  # d = cp/2: one peer
                rnd.extend(Transfer(src, dst, b) for b in base.local_blocks(src) if b in needed[dst])
        if rnd:
            rounds.append(tuple(rnd))
    return replace(base, rounds=tuple(rounds))


def _window_fields(causal: bool, window, seq_len) -> dict:
    """``window`` and ``seq_len`` for a Plan: ``seq_len`` is kept only when the mask is windowed, so
    a plain plan stays the plain plan whatever its caller passes."""
    w = Mask(bool(causal), *check_window(window)).window
    return dict(window=w, seq_len=int(seq_len) if seq_len is not None and Mask(bool(causal), *w).windowed else None)


SIMPLE_PLANS = {"ring": ring_plan, "full": full_plan, "halo": halo_plan}
"""Plans built from the CP ranks alone (no topology), by name: what ``fcp_attention(plan=NAME)`` takes."""


def _no_stricter(done: tuple, asked: tuple) -> bool:
    """Whether port limits ``asked`` are implied by limits ``done`` already verified (None = no limit)."""
    return all(a is None or (d is not None and d <= a) for d, a in zip(done, asked))


def check_cp_ranks(topology: Topology | None, cp_ranks: Iterable[int]) -> tuple[int, ...]:
    """Validate a CP group: non-empty, distinct integers, all inside the topology."""
    try:
        ranks = tuple(cp_ranks)
    except TypeError:
        raise ValueError(f"cp_ranks: expected a list of global ranks, got {cp_ranks!r}") from None
    if not ranks:
        raise ValueError("cp_ranks: the CP group is empty")
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool):
            raise ValueError(f"cp_ranks: rank {r!r} is not an integer")
    if len(set(ranks)) != len(ranks):
        dup = next(r for r in ranks if ranks.count(r) > 1)
        raise ValueError(f"cp_ranks: rank {dup} appears twice in {list(ranks)}")
    if topology is not None:
        bad = [r for r in ranks if not 0 <= r < topology.world]
        if bad:
            raise TopologyError(
                f"cp_ranks: rank {bad[0]} is missing from topology {topology.name!r} (world size {topology.world})"
            )
    return ranks
