"""The head-parallel stage on packed (THD) batches: a placement over head groups, split among members. Pure.

Note [Head-parallel stage on packed batches]
--------------------------------------------
The zigzag stage (Note [Head-parallel stage] in :mod:`megatron_fcp.contract.head_parallel`) gives a
head group the union of its members' zigzag chunks. A packed batch has no zigzag chunks, so the
mapping is built the other way round, from the head groups down:

1. **group placement**: the documents are placed over ``G = cp / a`` virtual ranks, one per head
   group (:func:`~megatron_fcp.contract.layer_placement.place_balanced` with ``cp = G``): short documents
   whole on one group, long ones cut into blocks, work (and, balanced by the layer, tokens)
   balanced over the *groups*.
2. **member split**: group ``g``'s tokens (its spans, in order) are cut into ``a`` contiguous
   pieces of near-equal token count (the first ``T_g mod a`` members one token more); member ``j``
   holds piece ``j``. A span crossing a cut becomes two adjacent spans. The result is an ordinary
   :class:`~megatron_fcp.contract.placement.Placement` over the ``cp`` ranks (by CP index): the
   *member placement*. It is what each rank holds before and after attention, so the data path
   (``shard_packed_batch``) and RoPE follow it unchanged.
3. **exactness**: the concatenation of group ``g``'s members' shards in member order is group
   ``g``'s shard of the group placement, token for token. After the all-to-all inside the head
   group, member ``j`` holds exactly that shard for head shard ``j``, so the KV stage of head shard
   ``j`` (member ``j`` of every group) is an ordinary packed FCP plan over the group placement,
   run on those ``G`` ranks. The inverse all-to-all returns each member's piece for all heads.

For ``cp = 4``, ``a = 2``, head groups ``(r0, r1)``, ``(r2, r3)`` and documents ``[3, 9, 2]`` (blocks
of 4 tokens; adjacent spans shown merged)::

    group placement (G = 2)    g0: d1[6,9) d2[0,2)          g1: d0[0,3) d1[0,3) d1[3,6)
    member split               r0: d1[6,9)  r1: d2[0,2)     r2: d0[0,3) d1[0,2)  r3: d1[2,3) d1[3,6)
    after the all-to-all       r0, r1: g0's 5 tokens        r2, r3: g1's 9 tokens (h/a heads each)
    KV stage j                 (r0|r1 for j = 0|1, r2|r3) runs the packed plan of the group placement

Member shards are near-equal within a group, not across groups (the placement balances work, not
tokens), and the all-to-all's sizes differ by member: it moves ``t_m`` tokens from member ``m``
(``all_to_all`` with split sizes; on gloo one ``isend``/``irecv`` pair per peer).

Why not place over ``cp`` ranks and let a group be the union of its members' placements? Then a
member's shard is whatever the placement gave it and the group's work is the sum of ``a`` ranks'
work, balanced only by chance; placing over groups balances exactly what the KV stage computes,
and the member split only moves tokens the all-to-all moves anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from megatron_fcp.contract.blocks import PlanError
from megatron_fcp.contract.head_parallel import HeadGroups, check_head_parallel
from megatron_fcp.contract.layer_placement import place_balanced
from megatron_fcp.contract.placement import Placement, Span
from megatron_fcp.contract.plan import Plan
from megatron_fcp.memo import memo, without_memo

__all__ = ["PackedHeadParallelPlan", "split_group_placement", "place_packed_groups", "member_counts"]


def member_counts(tokens: int, degree: int) -> tuple[int, ...]:
    """Tokens of each of ``degree`` members of a group holding ``tokens`` (near-equal, the first
    ``tokens % degree`` members one more)."""
    base, extra = divmod(tokens, degree)
    return tuple(base + (1 if j < extra else 0) for j in range(degree))


def split_group_placement(group_placement: Placement, ranks: Sequence[int],
                          head_groups: Sequence[Sequence[int]]) -> Placement:
    """The member placement (Note [Head-parallel stage on packed batches], step 2): virtual rank
    ``g`` of ``group_placement`` is head group ``head_groups[g]``; its tokens are cut into
    :func:`member_counts` pieces, member ``j`` (global rank ``head_groups[g][j]``) taking piece
    ``j``. Returns a Placement over ``ranks`` (CP order); its pieces are :func:`_split_columns`."""
    ranks = tuple(ranks)
    count, doc, start, end = _split_columns(group_placement, ranks, head_groups)
    pieces = list(map(Span, doc.tolist(), start.tolist(), end.tolist()))
    at = np.concatenate(([0], np.cumsum(count))).tolist()
    return Placement(group_placement.doc_lengths, tuple(tuple(pieces[a:b]) for a, b in zip(at, at[1:])),
                     group_placement.causal, group_placement.window, group_placement.layout)


def _split_columns(group_placement: Placement, ranks: tuple[int, ...],
                   head_groups: Sequence[Sequence[int]]) -> tuple[np.ndarray, ...]:
    """:func:`split_group_placement`'s pieces as columns, ranks in CP order: ``(pieces per rank
    [cp], document, start, end [pieces])``. The groups' spans laid end to end, group after group,
    each in its order; every span boundary and every member boundary is a cut, and each stretch
    between two cuts is one member's piece of one span (a span cut only where a member's tokens
    end). PlanError unless the head groups partition ``ranks``."""
    if group_placement.cp != len(head_groups):
        raise PlanError(f"group placement over {group_placement.cp} ranks for {len(head_groups)} head groups")
    members = [r for g in head_groups for r in g]                            # [members], group by group
    if sorted(members) != sorted(ranks) or len(set(members)) != len(members):
        raise PlanError(f"head groups {list(map(list, head_groups))} do not partition the CP ranks {list(ranks)}")
    doc, start, end = group_placement.block_spans()                          # [spans], group by group
    span_at = np.cumsum(end - start) - (end - start)                         # [spans]: first token, end to end
    held = np.asarray(group_placement.rank_tokens(), dtype=np.int64)         # [G]
    size = np.array([len(g) for g in head_groups], dtype=np.int64)           # [G]
    j = np.arange(len(members), dtype=np.int64) - np.repeat(np.cumsum(size) - size, size)   # [members]
    base, extra = np.repeat(held // size, size), np.repeat(held % size, size)
    member_at = np.repeat(np.cumsum(held) - held, size) + j * base + np.minimum(j, extra)   # [members]: first token
    cuts = np.union1d(np.append(span_at, int(held.sum())), member_at)        # sorted, distinct
    lo, hi = cuts[:-1], cuts[1:]                                             # [pieces], member by member
    k = np.searchsorted(span_at, lo, side="right") - 1                       # [pieces]: its span
    m = np.searchsorted(member_at, lo, side="right") - 1                     # [pieces]: its member (of the
    first = start[k] + lo - span_at[k]                                       # empty ones at lo, the last)
    cp_of = {r: i for i, r in enumerate(ranks)}
    order = np.argsort(np.array([cp_of[r] for r in members], dtype=np.int64)[m], kind="stable")  # CP order
    count = np.zeros(len(ranks), dtype=np.int64)
    np.add.at(count, [cp_of[r] for r in members], np.bincount(m, minlength=len(members)))
    return count, doc[k][order], first[order], (first + hi - lo)[order]


def place_packed_groups(doc_lengths: Sequence[int], ranks: Sequence[int], head_groups: Sequence[Sequence[int]], *,
                        balance: str = "attention", **place_kw) -> tuple[Placement, Placement]:
    """``(group placement over G virtual ranks, member placement over ranks)`` of a packed batch
    (Note [Head-parallel stage on packed batches]); the group placement balances ``balance``
    (:func:`~megatron_fcp.contract.layer_placement.place_balanced`, ``place_kw`` go to it)."""
    group = place_balanced(doc_lengths, len(head_groups), balance=balance, **place_kw)
    return group, split_group_placement(group, ranks, head_groups)


@dataclass(frozen=True)
class PackedHeadParallelPlan(HeadGroups):
    """A CP group's head-parallel stage on one packed batch (Note [Head-parallel stage on packed batches]).

    ranks: the CP group's global ranks in CP order.
    degree: ``a``, ranks per head group (> 1).
    head_groups: ``G = cp / a`` tuples of ``a`` global ranks; member ``j`` takes head shard ``j``.
    group_placement: the batch placed over the ``G`` head groups (virtual ranks ``0..G-1``).
    placement: the member placement over ``ranks`` (:func:`split_group_placement`): each rank's tokens.
    kv_plan: the KV stage's plan over virtual ranks ``0..G-1`` with ``placement=group_placement``;
        None when ``G == 1`` (attention local over the whole batch).
    kv_replication: times each KV head is repeated before the split (as the zigzag stage).
    """

    ranks: tuple[int, ...]
    degree: int
    head_groups: tuple[tuple[int, ...], ...]
    group_placement: Placement
    placement: Placement
    kv_plan: Plan | None
    kv_replication: int = 1
    _stage_plans: dict[int, Plan] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """Pickled without what the planner derived from it (:mod:`megatron_fcp.memo`)."""
        return without_memo(dict(self.__dict__))

    def __post_init__(self) -> None:
        cp = len(self.ranks)
        members = sorted(r for g in self.head_groups for r in g)
        if self.degree < 2 or cp % self.degree or members != sorted(self.ranks) \
                or any(len(g) != self.degree for g in self.head_groups):
            raise PlanError(f"head groups {self.head_groups} must split the CP ranks {self.ranks} into groups of "
                            f"{self.degree} (degree >= 2; degree 1 is the plain packed plan)")
        groups = len(self.head_groups)
        if self.group_placement.cp != groups or self.placement.cp != cp:
            raise PlanError(f"placements over {self.group_placement.cp} groups / {self.placement.cp} ranks for "
                            f"{groups} head groups of {cp} CP ranks")
        if (self.kv_plan is None) != (groups == 1):
            raise PlanError("a packed head-parallel plan has a KV-stage plan exactly when there is more than one "
                            "head group")
        if self.kv_plan is not None and (self.kv_plan.ranks != tuple(range(groups))
                                         or self.kv_plan.placement != self.group_placement):
            raise PlanError("the KV-stage plan must run over virtual ranks 0..G-1 and the group placement")

    def member_tokens(self, g: int) -> tuple[int, ...]:
        """Tokens each member of head group ``g`` holds (member order): row ``g`` of
        :meth:`member_token_table`."""
        return tuple(self.member_token_table()[g].tolist())

    def member_token_table(self) -> np.ndarray:
        """int64 ``[groups, degree]``, read-only: the tokens each member of each head group holds
        (the member placement's shards), computed once per plan object."""
        cache = memo(self)                                # Note [Caches live with their object]
        got = cache.get("member tokens")
        if got is None:
            held = np.asarray(self.placement.rank_tokens(), dtype=np.int64)          # [cp]: CP order
            pos = {r: i for i, r in enumerate(self.ranks)}
            got = held[np.array([[pos[r] for r in g] for g in self.head_groups], dtype=np.int64)]
            got.flags.writeable = False
            cache["member tokens"] = got
        return got

    def verify(self) -> "PackedHeadParallelPlan":
        """Prove the stage: the groups partition the ranks, the member placement is the group
        placement's split (member shards concatenate to the group's shard, span for span up to
        cuts), the KV plan is verified. Raises :class:`PlanError`; returns ``self``."""
        self.__post_init__()
        count, doc, start, end = _split_columns(self.group_placement, self.ranks, self.head_groups)
        mine, gp = self.placement, self.group_placement
        if (mine.doc_lengths, mine.causal, mine.window, mine.layout) != (gp.doc_lengths, gp.causal, gp.window, gp.layout) \
                or not np.array_equal(mine.blocks_per_rank(), count) \
                or not all(np.array_equal(a, b) for a, b in zip(mine.block_spans(), (doc, start, end))):
            raise PlanError("the member placement is not the split of the group placement")
        if self.kv_plan is not None:
            self.kv_plan.verify()
        return self

    def check_heads(self, heads: int, kv_heads: int) -> int:
        """:func:`check_head_parallel` for these head counts (ValueError naming the fix); checks
        ``kv_replication`` too and returns it."""
        rep = check_head_parallel(heads, kv_heads, self.degree, self.cp)
        if rep != self.kv_replication:
            raise ValueError(f"the packed head-parallel plan was built with kv_replication={self.kv_replication} but "
                             f"h={heads}, h_kv={kv_heads} at degree {self.degree} need {rep}; rebuild it for these "
                             "head counts")
        return rep
