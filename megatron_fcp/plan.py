"""Plans: who sends which KV block to whom, in which round. Pure data, no ``torch.distributed``.

This module is the contract between the planner (graph -> plan) and the attention engine
(plan -> communication + compute). Everything here is plain frozen data so plans can be built,
verified and compared in microseconds without processes.

Note [Zigzag blocks and causal need sets]
-----------------------------------------
Megatron splits a sequence into ``2*cp`` chunks; CP rank ``i`` holds chunks ``i`` and
``2*cp-1-i`` (``get_batch_on_this_cp_rank``). A *block* is one owner's chunk (``chunk`` 0 is the
early chunk ``i``, ``chunk`` 1 the late chunk ``2*cp-1-i``), optionally cut into
``parts_per_chunk`` equal sub-blocks. For cp = 4::

    global chunk   0  1  2  3  4  5  6  7
    CP rank        0  1  2  3  3  2  1  0
    block chunk    0  0  0  0  1  1  1  1

With causal masking a query in global chunk ``q`` sees keys in chunks ``c <= q``. Rank ``j``'s
latest query chunk is ``2*cp-1-j``, so it needs chunk 0 of every rank and chunk 1 only of ranks
``i >= j``::

    needs (x = needed, . = not, cp = 4; own blocks are local and never "needed")
               owner 0    owner 1    owner 2    owner 3
    rank       c0  c1     c0  c1     c0  c1     c0  c1
      0        -   -      x   x      x   x      x   x
      1        x   .      -   -      x   x      x   x
      2        x   .      x   .      -   -      x   x
      3        x   .      x   .      x   .      -   -

A ring moves 2*(cp-1) chunks into every rank; the need sets add up to 1.5*cp*(cp-1) chunks over
the group, i.e. 0.75x the ring's bytes.

Rounds
------
A plan is a sequence of rounds. All transfers in a round run concurrently; a transfer's source
must hold the block when the round starts (it owns it or received it in an earlier round). Ranks
are **global** ranks; ``Plan.ranks`` lists the CP group's global ranks in CP-rank order. Two
transfers of one round between the same pair are matched in plan order on both sides.

The backward pass runs the same rounds reversed with every transfer flipped: each rank sends its
partial dK/dV of a block back to the rank it received the block from, after adding the partials
its own children sent it (which arrive in later forward rounds, i.e. earlier backward rounds).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator

__all__ = [
    "Block",
    "Transfer",
    "Plan",
    "PlanError",
    "zigzag_chunk_index",
    "blocks_of",
    "need_set",
    "ring_plan",
    "all_to_all_plan",
    "per_rank_counts",
]


class PlanError(ValueError):
    """A plan is malformed; the message names the block, rank and round at fault."""


@dataclass(frozen=True, order=True)
class Block:
    """One KV block: ``owner``'s (global rank) zigzag ``chunk`` (0 early, 1 late), sub-block ``part``."""

    owner: int
    chunk: int
    part: int = 0

    def __str__(self) -> str:  # compact in error messages and round tables
        return f"B(r{self.owner},c{self.chunk},p{self.part})"


@dataclass(frozen=True, order=True)
class Transfer:
    """Send ``block`` from global rank ``src`` to global rank ``dst``."""

    src: int
    dst: int
    block: Block

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}:{self.block}"


def zigzag_chunk_index(cp_index: int, chunk: int, cp: int) -> int:
    """Global chunk index (of ``2*cp``) held by CP rank ``cp_index`` as its ``chunk`` (0 or 1)."""
    if chunk not in (0, 1):
        raise PlanError(f"chunk must be 0 or 1, got {chunk}")
    return cp_index if chunk == 0 else 2 * cp - 1 - cp_index


def blocks_of(owner: int, parts_per_chunk: int = 1) -> tuple[Block, ...]:
    """All blocks owned by global rank ``owner``, in sequence order of its local shard."""
    return tuple(Block(owner, c, p) for c in (0, 1) for p in range(parts_per_chunk))


def need_set(
    ranks: tuple[int, ...], rank: int, causal: bool, parts_per_chunk: int = 1
) -> frozenset[Block]:
    """Blocks that global ``rank`` must receive (its own blocks excluded). See the Note above."""
    j = ranks.index(rank)
    needed = set()
    for i, owner in enumerate(ranks):
        if owner == rank:
            continue
        for chunk in (0, 1):
            if causal and chunk == 1 and i < j:
                continue  # owner's late chunk lies after every query of this rank
            needed.update(Block(owner, chunk, p) for p in range(parts_per_chunk))
    return frozenset(needed)


@dataclass(frozen=True)
class Plan:
    """A verified-able schedule of KV block transfers inside one CP group.

    ranks: the CP group's global ranks, index = CP rank (zigzag position).
    rounds: per round, the transfers that run concurrently.
    causal: whether need sets follow the causal mask (see the Note).
    parts_per_chunk: sub-blocks per zigzag chunk (a chunk of L tokens is cut into equal parts).
    name: which builder made it (``"ring"``, ``"all-to-all"``, ``"hierarchical"`` ...).
    """

    ranks: tuple[int, ...]
    rounds: tuple[tuple[Transfer, ...], ...]
    causal: bool = True
    parts_per_chunk: int = 1
    name: str = "custom"
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    # ---- queries ----------------------------------------------------------------------------
    @property
    def cp(self) -> int:
        return len(self.ranks)

    def cp_index(self, rank: int) -> int:
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise PlanError(f"rank {rank} is not in the plan's CP group {list(self.ranks)}") from None

    def blocks(self) -> tuple[Block, ...]:
        return tuple(b for r in self.ranks for b in blocks_of(r, self.parts_per_chunk))

    def needs(self, rank: int) -> frozenset[Block]:
        return need_set(self.ranks, rank, self.causal, self.parts_per_chunk)

    def transfers(self) -> Iterator[tuple[int, Transfer]]:
        """All ``(round, transfer)`` pairs in plan order."""
        for k, rnd in enumerate(self.rounds):
            for t in rnd:
                yield k, t

    def sends(self, rank: int, round_index: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.rounds[round_index] if t.src == rank)

    def recvs(self, rank: int, round_index: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.rounds[round_index] if t.dst == rank)

    def received_blocks(self, rank: int) -> tuple[Block, ...]:
        """Blocks ``rank`` receives, in the order they arrive (plan order)."""
        return tuple(t.block for _, t in self.transfers() if t.dst == rank)

    def num_transfers(self) -> int:
        return sum(len(r) for r in self.rounds)

    def chunks_moved(self) -> float:
        """Bytes moved in units of one zigzag chunk of KV."""
        return self.num_transfers() / self.parts_per_chunk

    # ---- verification -----------------------------------------------------------------------
    def verify(self) -> "Plan":
        """Prove the plan is executable and complete; raise :class:`PlanError` otherwise.

        Checks, without running anything:
        * ``ranks`` are distinct; every endpoint is in the CP group; no self-sends;
        * every block in a transfer is a block of this group (owner in group, chunk/part in range);
        * causality: a rank sends a block only if it owns it or received it in an *earlier* round;
        * exactly once: no rank receives a block twice, and no owner receives its own block;
        * completeness: every rank receives every block of its need set.
        Send/receive matching and deadlock freedom hold by construction of the round model: both
        sides derive their per-round posts from the same transfer list (sends and receives of a
        round are all posted before any is waited on), so each receive has exactly one matching
        send in the same round, and rounds only wait on transfers they themselves posted.
        Returns ``self`` so calls can be chained.
        """
        if len(set(self.ranks)) != len(self.ranks):
            raise PlanError(f"plan ranks repeat: {list(self.ranks)}")
        if self.parts_per_chunk < 1:
            raise PlanError(f"parts_per_chunk must be >= 1, got {self.parts_per_chunk}")
        group = set(self.ranks)
        have: dict[int, set[Block]] = {r: set(blocks_of(r, self.parts_per_chunk)) for r in self.ranks}
        for k, rnd in enumerate(self.rounds):
            arriving: list[tuple[int, Block]] = []
            for t in rnd:
                where = f"round {k}, transfer {t}"
                if t.src not in group or t.dst not in group:
                    outside = t.src if t.src not in group else t.dst
                    raise PlanError(f"{where}: rank {outside} is outside the CP group {sorted(group)}")
                if t.src == t.dst:
                    raise PlanError(f"{where}: a rank sends to itself")
                b = t.block
                if b.owner not in group or b.chunk not in (0, 1) or not 0 <= b.part < self.parts_per_chunk:
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
        for r in self.ranks:
            missing = self.needs(r) - have[r]
            if missing:
                first = sorted(missing)[0]
                raise PlanError(
                    f"rank {r} never receives {first} (and {len(missing) - 1} more needed blocks)"
                )
        return self

    # ---- presentation -----------------------------------------------------------------------
    def round_table(self) -> str:
        """One line per round: ``round k: src->dst:block, ...``."""
        lines = [f"plan {self.name!r}: cp={self.cp} ranks={list(self.ranks)} causal={self.causal} "
                 f"parts/chunk={self.parts_per_chunk} rounds={len(self.rounds)} transfers={self.num_transfers()}"]
        for k, rnd in enumerate(self.rounds):
            lines.append(f"  round {k}: " + ", ".join(str(t) for t in rnd))
        return "\n".join(lines)


def _check_ranks(ranks: Iterable[int]) -> tuple[int, ...]:
    ranks = tuple(int(r) for r in ranks)
    if len(ranks) < 1:
        raise PlanError("a plan needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise PlanError(f"CP group ranks repeat: {list(ranks)}")
    return ranks


def ring_plan(ranks: Iterable[int], causal: bool = True, parts_per_chunk: int = 1) -> Plan:
    """Transformer Engine's p2p ring: ``cp-1`` rounds, each rank forwards what it received.

    In round ``k`` CP rank ``i`` sends the KV pair of CP rank ``(i-k) mod cp`` (both chunks, as TE
    does whatever the mask) to CP rank ``i+1``. Every rank ends up with every block; with causal
    masking some arrive only to be passed on, exactly as in TE.
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
    return Plan(ranks, tuple(rounds), causal, parts_per_chunk, name="ring")


def all_to_all_plan(ranks: Iterable[int], causal: bool = True, parts_per_chunk: int = 1) -> Plan:
    """Every owner sends each block straight to every rank that needs it.

    Round ``k`` (``k = 1..cp-1``) pairs CP rank ``i`` with ``i+k`` so every rank sends to one peer
    and receives from one peer per round, and blocks arrive progressively for overlap.
    """
    ranks = _check_ranks(ranks)
    cp = len(ranks)
    rounds = []
    for k in range(1, cp):
        rnd = []
        for i, src in enumerate(ranks):
            dst = ranks[(i + k) % cp]
            needed = need_set(ranks, dst, causal, parts_per_chunk)
            rnd.extend(Transfer(src, dst, b) for b in blocks_of(src, parts_per_chunk) if b in needed)
        rounds.append(tuple(rnd))
    return Plan(ranks, tuple(rounds), causal, parts_per_chunk, name="all-to-all")


def per_rank_counts(plan: Plan) -> dict[int, tuple[int, int]]:
    """``{rank: (sends, receives)}`` over the whole plan (used by transport-counting tests)."""
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for _, t in plan.transfers():
        counts[t.src][0] += 1
        counts[t.dst][1] += 1
    return {r: (counts[r][0], counts[r][1]) for r in plan.ranks}
