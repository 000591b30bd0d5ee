"""Sliding windows in the plan contract: need sets against the token rule, plans that move only the
window's blocks, verification, and plain plans unchanged (Note [Windowed need sets])."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_fcp.contract.blocks import Block, PlanError, part_span
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.needs import block_pairs, need_matrix, need_set, readers
from megatron_fcp.contract.placement import Placement, Span, place_packed, span_pairs
from megatron_fcp.contract.plan import Plan, full_plan, halo_plan, ring_plan
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.builders import BUILDERS, get_builder
from megatron_fcp.planner.compile import compile_plan
from megatron_fcp.topology import load_topology

L = 10  # tokens per zigzag chunk in the token-level checks

# (causal, window): smaller than a part, not a multiple of the chunk, longer than the sequence,
# non-causal left/right windows
WINDOWS = [(True, (3, 0)), (True, (L, 0)), (True, (13, 0)), (True, (10_000, 0)),
           (False, (4, 2)), (False, (0, 7)), (False, (12, -1)), (False, (-1, 5)), (False, (10_000, 10_000))]


def _zigzag_positions(cp: int, P: int, owner: int, chunk: int, part: int) -> np.ndarray:
    g = owner if chunk == 0 else 2 * cp - 1 - owner
    a, b = part_span(L, P, part)
    return np.arange(g * L + a, g * L + b)


def _token_need(cp: int, P: int, mask: Mask) -> np.ndarray:
    """``[cp, 2*cp*P]`` from Mask.visible over every (query token, key token) pair."""
    out = np.zeros((cp, 2 * cp * P), dtype=bool)
    for j in range(cp):
        q = np.concatenate([_zigzag_positions(cp, 1, j, c, 0) for c in (0, 1)])
        for i, c, p in itertools.product(range(cp), (0, 1), range(P)):
            if i != j:
                k = _zigzag_positions(cp, P, i, c, p)
                out[j, (i * 2 + c) * P + p] = mask.visible(q[:, None], k[None, :]).any()
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("causal,window", WINDOWS)
def test_zigzag_need_rule_matches_the_token_rule(cp, P, causal, window):
    mask = Mask(causal, *window)
    S = 2 * cp * L
    need = need_matrix(cp, P, mask, seq_len=S)
    assert (need == _token_need(cp, P, mask)).all()
    ranks = [10 + 3 * r for r in range(cp)]  # global ranks are not CP indices
    for j, r in enumerate(ranks):
        got = need_set(ranks, r, causal, P, window=window, seq_len=S)
        assert got == {Block(ranks[b // (2 * P)], (b // P) % 2, b % P) for b in np.flatnonzero(need[j])}
    for i, c in itertools.product(range(cp), (0, 1)):
        col = need[:, (i * 2 + c) * P:(i * 2 + c + 1) * P].any(axis=1)
        assert readers(ranks, i, c, mask, seq_len=S, parts_per_chunk=P) == [ranks[j] for j in np.flatnonzero(col)]
    if max(window) >= S:  # a window beyond the sequence is the plain mask: identical need sets
        assert (need == need_matrix(cp, P, causal)).all()
    # pair counts follow the mask exactly
    q_i, o_i, c_i, p_i = np.meshgrid(range(cp), range(cp), (0, 1), range(P), indexing="ij")
    pairs = block_pairs(cp, S, P, q_i, o_i, c_i, p_i, mask)
    for j, i, c, p in itertools.product(range(cp), range(cp), (0, 1), range(P)):
        q = np.concatenate([_zigzag_positions(cp, 1, j, cc, 0) for cc in (0, 1)])
        k = _zigzag_positions(cp, P, i, c, p)
        assert pairs[j, i, c, p] == mask.visible(q[:, None], k[None, :]).sum()


def test_plain_masks_keep_the_closed_form():
    for cp, P, causal in itertools.product((2, 3, 5), (1, 3), (True, False)):
        assert (need_matrix(cp, P, Mask(causal)) == need_matrix(cp, P, causal)).all()
        plain = need_matrix(cp, P, causal, window=(-1, -1), seq_len=None)
        assert (plain == need_matrix(cp, P, causal)).all()


def _packed_token_need(pl: Placement) -> np.ndarray:
    blocks = pl.block_list()
    out = np.zeros((pl.cp, len(blocks)), dtype=bool)
    for j in range(pl.cp):
        for n, (i, _, k) in enumerate(blocks):
            if i == j:
                continue
            for q in pl.blocks[j]:
                if q.doc == k.doc and pl.mask.visible(np.arange(q.start, q.end)[:, None],
                                                      np.arange(k.start, k.end)[None, :]).any():
                    out[j, n] = True
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("causal,window", WINDOWS)
def test_packed_need_rule_matches_the_token_rule(cp, causal, window):
    docs = [37, 5, 64, 12, 3, 41]
    pl = place_packed(docs, cp, block_tokens=8, causal=causal, window=window)
    assert pl.window == Mask(causal, *window).window
    assert (pl.need_matrix() == _packed_token_need(pl)).all()
    for j, i in itertools.product(range(cp), range(cp)):
        for b, k in enumerate(pl.blocks[i]):
            kpos = np.arange(k.start, k.end)[None, :]
            want = sum(int(pl.mask.visible(np.arange(q.start, q.end)[:, None], kpos).sum())
                       for q in pl.blocks[j] if q.doc == k.doc)
            assert pl.pairs(j, i, b) == want
    plain = place_packed(docs, cp, block_tokens=8, causal=causal)
    if max(window) >= max(docs):
        assert (Placement(pl.doc_lengths, pl.blocks, causal).need_matrix() == pl.need_matrix()).all()
    assert pl.work().sum() <= plain.work().sum()


def test_span_pairs_under_a_window():
    m = Mask(True, 4, 0)
    for q, k in [(Span(0, 10, 20), Span(0, 0, 12)), (Span(0, 3, 9), Span(0, 3, 9)), (Span(0, 30, 40), Span(0, 0, 20))]:
        want = int(m.visible(np.arange(q.start, q.end)[:, None], np.arange(k.start, k.end)[None, :]).sum())
        assert span_pairs(q, k, m) == want
    assert span_pairs(Span(0, 0, 5), Span(1, 0, 5), m) == 0


# ---- plans -------------------------------------------------------------------------------------
def _moved_tokens(plan: Plan, seq_len: int | None = None) -> int:
    return sum(plan.block_tokens(t.block, seq_len) for _, t in plan.transfers())


def _needed_tokens(plan: Plan, seq_len: int | None = None) -> int:
    return sum(plan.block_tokens(b, seq_len) for r in plan.ranks for b in plan.needs(r))


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("window", [(3, 0), (L, 0), (25, 0)])
def test_windowed_zigzag_plans_move_only_the_window(P, window):
    cp, S = 16, 2 * 16 * L
    for plan in (full_plan(range(cp), True, P, window=window, seq_len=S),
                 halo_plan(range(cp), True, P, window=window, seq_len=S),
                 build_plan("dgx-h100:2", range(cp), "full", window=window, seq_len=S, parts_per_chunk=P)):
        plan.verify()
        assert plan.window == window and plan.seq_len == S and plan.mask == Mask(True, *window)
        assert _moved_tokens(plan) <= 1.05 * _needed_tokens(plan)
        assert _needed_tokens(plan) < _needed_tokens(full_plan(range(cp), True, P), S)
        for r in plan.ranks:
            if not plan.needs(r):
                assert not plan.received_blocks(r)


def test_ranks_whose_window_is_inside_their_shard_receive_nothing():
    # rank 0 holds whole documents and the start of a long one; rank 1 the long one's later blocks
    pl = Placement((4, 6, 100), ((Span(0, 0, 4), Span(1, 0, 6), Span(2, 0, 50)), (Span(2, 50, 100),)),
                   True, (8, 0))
    plan = build_plan("dgx-h100:1", [0, 1], "full", placement=pl).verify()
    assert plan.needs(0) == frozenset() and not plan.received_blocks(0)
    assert plan.needs(1) == {Block(0, 2, 0)} and plan.num_transfers() == 1
    # zigzag, cp = 4, window of one chunk: rank 3's late chunk sees only its own early chunk
    z = full_plan(range(4), True, window=(L, 0), seq_len=8 * L).verify()
    assert z.needs(3) == {Block(2, 0, 0)} and z.num_transfers() == 6
    assert z.received_blocks(3) == (Block(2, 0, 0),)


@pytest.mark.parametrize("causal,window", [(True, (5, 0)), (True, (300, 0)), (False, (40, 9))])
def test_windowed_packed_plans_move_the_need_set(causal, window):
    docs = [700, 90, 33, 1200, 8, 400]
    pl = place_packed(docs, 8, block_tokens=128, causal=causal, window=window)
    for graph in ("full", "hierarchical", "entry", "auto"):
        plan = build_plan("dgx-h100:2", [0, 1, 2, 3, 8, 9, 10, 11], graph, causal=causal, placement=pl).verify()
        assert plan.window == pl.window
        if graph == "full":
            assert _moved_tokens(plan) <= 1.05 * _needed_tokens(plan)
        for r in plan.ranks:
            if not plan.needs(r):
                assert not plan.received_blocks(r)
    tok = np.array([s.tokens for _, _, s in pl.block_list()])
    plain = Placement(pl.doc_lengths, pl.blocks, causal)
    assert (pl.need_matrix() * tok).sum() <= (plain.need_matrix() * tok).sum()


@pytest.mark.parametrize("name", sorted(set(BUILDERS) - {"balanced"}))
@pytest.mark.parametrize("P", [1, 2, 3])
def test_every_builder_compiles_a_verified_windowed_plan(name, P):
    cp = 16
    S = 2 * cp * 12
    cg = get_builder(name).build(load_topology("dgx-h100:2"), list(range(cp)))
    for window in ((5, 0), (20, 0), (1000, 0)):
        plan = compile_plan(cg, True, P, window=window, seq_len=S).verify()
        have = {r: set(plan.local_blocks(r)) for r in plan.ranks}
        for _, t in plan.transfers():
            have[t.dst].add(t.block)
        # every delivery is needed or forwarded later (relays only where the graph forces them)
        sent = {(t.src, t.block) for _, t in plan.transfers()}
        for _, t in plan.transfers():
            assert t.block in plan.needs(t.dst) or (t.dst, t.block) in sent
        plain = compile_plan(cg, True, P)
        assert plan.num_transfers() <= plain.num_transfers()


def test_a_window_beyond_the_sequence_is_the_plain_plan():
    cp, S = 8, 2 * 8 * L
    for name in ("full", "hierarchical", "ring"):
        w = build_plan("dgx-h100:1", range(cp), name, window=(S, 0), seq_len=S)
        p = build_plan("dgx-h100:1", range(cp), name)
        assert [set(r) for r in w.rounds if r] == [set(r) for r in p.rounds if r]


def test_plain_plans_are_unchanged():
    p = build_plan("dgx-h100:2", range(16), "hierarchical", parts_per_chunk=2, seq_len=65536)
    q = build_plan("dgx-h100:2", range(16), "hierarchical", parts_per_chunk=2, window=(-1, -1))
    assert p == q and p.window == (-1, -1) and p.seq_len is None and p.mask == Mask(True)
    assert full_plan(range(4), window=None, seq_len=64).seq_len is None  # seq_len kept only under a window


def test_windowed_zigzag_plans_need_seq_len():
    with pytest.raises(PlanError, match="needs seq_len"):
        full_plan(range(4), True, window=(8, 0))
    with pytest.raises(PlanError, match="needs seq_len"):
        build_plan("dgx-h100:1", range(4), "full", window=(8, 0))
    with pytest.raises(PlanError, match="multiple of 2\\*cp"):
        Plan((0, 1), (), True, window=(8, 0), seq_len=10)
    with pytest.raises(PlanError, match="each side"):
        Plan((0, 1), (), True, window=(-3, 0), seq_len=8)
    pl = place_packed([100, 40], 2, block_tokens=32, window=(8, 0))
    with pytest.raises(PlanError, match="window"):
        full_plan([0, 1], True, placement=pl, window=(4, 0))
    assert Plan((0, 1), (), True, placement=pl).window == (8, 0)  # a placement's plan follows its mask
    # build_plan pads seq_len as Megatron pads and records the padded length
    assert build_plan("dgx-h100:1", range(4), "full", window=(8, 0), seq_len=61).seq_len == 64


def test_a_causal_window_takes_no_right_side():
    """right -1 under causal means 0; right > 0 is refused (contract/mask.py: TE refuses it too)."""
    assert full_plan(range(2), True, window=(8, -1), seq_len=32).window == (8, 0)
    with pytest.raises(ValueError, match="right side must be 0"):
        full_plan(range(2), True, window=(8, 5), seq_len=32)


def test_ring_plan_under_a_window_over_delivers_and_verifies():
    cp, S = 4, 8 * L
    ring = ring_plan(range(cp), True, window=(3, 0), seq_len=S).verify()
    assert ring.num_transfers() == 2 * cp * (cp - 1)
    assert _needed_tokens(ring) < _moved_tokens(ring)


def test_large_windowed_group_compiles_as_objects():
    cp = 512
    S = 2 * cp * 64
    plan = build_plan("dgx-h100:64", range(cp), "hierarchical", window=(64, 0), seq_len=S).verify()
    assert plan.table is None
    assert _moved_tokens(plan) <= 1.05 * _needed_tokens(plan) + 64 * 2 * 64  # a relay per node at most
