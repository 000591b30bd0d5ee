"""Packed batches: the placement contract, place_packed, document need sets and plans over them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fcp.contract.blocks import Block, PlanError
from megatron_fcp.contract.needs import need_set
from megatron_fcp.contract.placement import Placement, Span, place_packed
from megatron_fcp.contract.plan import full_plan
from megatron_fcp.cost.model import AttentionShape, simulate_plan
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.builders import BUILDERS
from megatron_fcp.contract.placement import span_pairs
from megatron_fcp.contract.verify import verify_reference
from megatron_fcp.topology import load_topology


def _token_need(pl: Placement, j: int, n: int) -> bool:
    """Brute force: does some query token of CP rank j attend to some key token of block n?"""
    i, _, k = pl.block_list()[n]
    if i == j:
        return False
    return any(q.doc == k.doc and (not pl.causal or p >= k.start)
               for q in pl.blocks[j] for p in range(q.start, q.end))


def _brute_pairs(q: Span, k: Span, causal: bool) -> int:
    if q.doc != k.doc:
        return 0
    return sum(1 for a in range(q.start, q.end) for b in range(k.start, k.end) if not causal or b <= a)


# ---- the contract ---------------------------------------------------------------------------------


@given(qs=st.integers(0, 12), ql=st.integers(1, 9), ks=st.integers(0, 12), kl=st.integers(1, 9),
       causal=st.booleans(), same=st.booleans())
def test_span_pairs_is_the_token_mask(qs, ql, ks, kl, causal, same):
    q, k = Span(0, qs, qs + ql), Span(0 if same else 1, ks, ks + kl)
    assert span_pairs(q, k, causal) == _brute_pairs(q, k, causal)


def test_placement_rejects_gaps_overlaps_and_bad_spans():
    with pytest.raises(ValueError, match=r"document 0 tokens \[2, 3\) are held by no rank"):
        Placement((4,), ((Span(0, 0, 2),), (Span(0, 3, 4),)))
    with pytest.raises(ValueError, match=r"document 0 tokens \[1, 2\) are held twice"):
        Placement((4,), ((Span(0, 0, 2),), (Span(0, 1, 4),)))
    with pytest.raises(ValueError, match="not a non-empty range"):
        Placement((4,), ((Span(0, 0, 5),),))
    with pytest.raises(ValueError, match=r"document 1 tokens \[0, 3\) are held by no rank"):
        Placement((4, 3), ((Span(0, 0, 4),),))
    with pytest.raises(ValueError, match="at least 1 token"):
        Placement((4, 0), ((Span(0, 0, 4),),))


@pytest.mark.parametrize("lengths, msg", [
    ([], "the batch is empty"), ([3, 0, 2], r"doc_lengths\[1\] = 0"), ([5, -1], r"doc_lengths\[1\] = -1"),
    ([2.5], "at least 1 token"),
])
def test_place_packed_rejects_bad_lengths(lengths, msg):
    with pytest.raises(ValueError, match=msg):
        place_packed(lengths, 2)


def test_place_packed_rejects_bad_cp_and_block_tokens():
    with pytest.raises(ValueError, match="cp: must be a positive integer"):
        place_packed([4], 0)
    with pytest.raises(ValueError, match="block_tokens: must be a positive integer"):
        place_packed([4], 2, block_tokens=0)


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12), cp=st.integers(1, 5),
       block=st.integers(1, 16), causal=st.booleans())
def test_place_packed_covers_every_token_once_and_needs_match_the_mask(lengths, cp, block, causal):
    pl = place_packed(lengths, cp, block_tokens=block, causal=causal)  # __post_init__ checks coverage
    assert pl.cp == cp and pl.total_tokens == sum(lengths)
    assert pl == place_packed(lengths, cp, block_tokens=block, causal=causal)  # deterministic
    for i in range(cp):
        for s in pl.blocks[i]:
            assert s.tokens <= block
            if lengths[s.doc] <= block:  # short documents stay whole
                assert (s.start, s.end) == (0, lengths[s.doc])
    need = pl.need_matrix()
    for j in range(cp):
        for n in range(len(pl.block_list())):
            assert need[j, n] == _token_need(pl, j, n)
    # per-rank work is the brute-force pair count of its queries against their documents
    if sum(lengths) <= 120:
        whole = {d: Span(d, 0, n) for d, n in enumerate(lengths)}
        for j in range(cp):
            assert pl.work()[j] == sum(_brute_pairs(q, whole[q.doc], causal) for q in pl.blocks[j])


def test_any_lengths_work():
    one = place_packed([1], 4)  # one token, four ranks: three hold nothing
    assert sorted(one.tokens(i) for i in range(4)) == [0, 0, 0, 1]
    assert not one.need_matrix().any()
    odd = place_packed([7, 1, 1, 13, 2], 3, block_tokens=5)  # a total (24) that divides by nothing useful
    assert sum(odd.tokens(i) for i in range(3)) == 24


def test_zigzag_as_a_placement_has_the_zigzag_need_sets():
    """One document cut like Megatron's zigzag: the document need rule gives the zigzag need sets."""
    for cp in (1, 2, 3, 4, 6):
        for causal in (True, False):
            L = 3  # tokens per chunk
            blocks = tuple((Span(0, i * L, (i + 1) * L), Span(0, (2 * cp - 1 - i) * L, (2 * cp - i) * L))
                           for i in range(cp))
            pl = Placement((2 * cp * L,), blocks, causal)
            ranks = tuple(range(100, 100 + cp))
            for r in ranks:
                assert pl.needs(ranks, r) == need_set(ranks, r, causal)


@pytest.mark.parametrize("make", [np.arange, torch.arange])
def test_shard_unshard_round_trip(make):
    pl = place_packed([5, 1, 9, 3], 3, block_tokens=4)
    x = make(18) * 10
    shards = [pl.shard(x, i) for i in range(3)]
    assert [len(s) for s in shards] == [pl.tokens(i) for i in range(3)]
    back = pl.unshard(shards)
    assert (back == x).all() and type(back) is type(x)
    for i in range(3):  # positions inside documents and document ids follow the shard
        idx = pl.token_index(i)
        starts = np.array([0, 5, 6, 15])
        doc = np.searchsorted(starts, idx, side="right") - 1
        assert (pl.doc_ids(i) == doc).all() and (pl.positions(i) == idx - starts[doc]).all()
    with pytest.raises(ValueError, match="tensor has 17 tokens, the batch has 18"):
        pl.shard(make(17), 0)


def test_balance_on_a_lognormal_mix():
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(7.0, 1.0, 400).astype(int)).tolist()
    pl = place_packed(lengths, 16, block_tokens=1024)
    work = pl.work()
    assert work.max() / work.mean() <= 1.05


# ---- plans over placements --------------------------------------------------------------------------


@pytest.mark.parametrize("graph", sorted(BUILDERS))
@pytest.mark.parametrize("causal", [True, False])
def test_every_builder_plans_a_placement_exactly(graph, causal):
    """Verified, every needed block delivered, nothing sent that is not needed except to a relay,
    and the verify specification agrees."""
    rng = random.Random(7)
    lengths = [rng.choice([3, 40, 7, 150, 1, 64]) for _ in range(30)]
    pl = place_packed(lengths, 16, block_tokens=32, causal=causal)
    topo = load_topology("dgx-h100:2")
    plan = build_plan(topo, range(16), graph, causal=causal, placement=pl)
    assert plan.verified and plan.placement == pl
    verify_reference(plan)
    forwards = {(t.src, t.block) for _, t in plan.transfers()}
    for _, t in plan.transfers():
        assert t.block in plan.needs(t.dst) or (t.dst, t.block) in forwards
    for r in range(16):
        assert set(plan.received_blocks(r)) >= plan.needs(r)
    exact = int(pl.need_matrix().sum())
    if graph in ("full", "entry"):  # straight to readers, or into each node at a reader: no relays
        assert plan.num_transfers() == exact
    if graph == "hierarchical":  # relays through rail peers that read nothing of the document
        assert exact <= plan.num_transfers() <= 1.25 * exact + 16


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths,cp", [([1, 37, 3, 5, 90, 2, 1, 7, 13, 61, 4, 1], 3), ([101], 4), ([1], 4),
                                        ([5, 9, 2, 30], 2)])
def test_full_plan_over_a_placement_sends_each_needed_block_once_directly(lengths, cp, causal):
    """No topology: round k pairs CP rank i with i+k, owners send straight to readers, empty rounds dropped."""
    pl = place_packed(lengths, cp, block_tokens=16, causal=causal)
    ranks = tuple(range(10, 10 + cp))
    plan = full_plan(ranks, causal, placement=pl).verify()
    verify_reference(plan)
    assert plan.name == "full" and plan.placement == pl and all(plan.rounds)
    assert plan.num_transfers() == int(pl.need_matrix().sum())               # exactly the need sets
    for rnd in plan.rounds:
        assert all(t.block.owner == t.src for t in rnd)                     # direct, no relays
        offsets = {(ranks.index(t.dst) - ranks.index(t.src)) % cp for t in rnd}
        assert len(offsets) == 1                                             # one CP offset per round
    with pytest.raises(PlanError, match="causal"):
        full_plan(ranks, not causal, placement=pl)


def test_short_documents_need_no_communication():
    pl = place_packed([100] * 32, 8, block_tokens=128)
    plan = build_plan("dgx-h100:1", range(8), "hierarchical", placement=pl)
    assert plan.num_transfers() == 0 and plan.rounds == ()


def test_verify_catches_a_missing_document_block():
    pl = place_packed([16], 2, block_tokens=4)
    plan = build_plan("dgx-h100:1", range(2), "full", placement=pl)
    assert plan.num_transfers() > 0
    dropped = type(plan)(plan.ranks, tuple(r[1:] if r else r for r in plan.rounds), plan.causal, placement=pl)
    with pytest.raises(PlanError, match="never receives"):
        dropped.verify()
    bogus = Block(0, len(pl.blocks[0]), 0)  # one past rank 0's blocks
    t = type(plan.rounds[0][0])(0, 1, bogus)
    with pytest.raises(PlanError, match="is not a block of this group"):
        type(plan)(plan.ranks, ((t,),), plan.causal, placement=pl).verify()


def test_a_plan_and_its_placement_must_agree():
    pl = place_packed([8, 8], 2, block_tokens=4)
    with pytest.raises(PlanError, match="needs 2 ranks"):
        type(build_plan("dgx-h100:1", range(2), "full", placement=pl))((0, 1, 2), (), True, placement=pl)
    with pytest.raises(PlanError, match="causal"):
        build_plan("dgx-h100:1", range(2), "full", causal=False, placement=pl)


def test_auto_and_the_cost_model_use_the_placement():
    rng = np.random.default_rng(1)
    lengths = np.maximum(1, rng.lognormal(8.0, 1.3, 120).astype(int)).tolist()
    pl = place_packed(lengths, 16, block_tokens=2048)
    plan = build_plan("dgx-h100:2", range(16), placement=pl)
    assert plan.placement == pl and dict(plan.auto.times)
    res = simulate_plan(plan, "dgx-h100:2", AttentionShape(1, 32, 8, 128))
    # bytes: exactly the tokens of every transfer
    shape = AttentionShape(1, 32, 8, 128)
    sizes = {(plan.ranks[i], b): s.tokens for i, b, s in pl.block_list()}
    assert res.bytes == pytest.approx(sum(sizes[(t.block.owner, t.block.chunk)] for _, t in plan.transfers())
                                      * shape.kv_bytes(1))
    # compute: the busiest rank's work at the model's FLOP/s (plus kernel overheads)
    assert res.compute_s >= pl.work().max() * 4 * 32 * 128 / 400e12


def test_note_example_long_blocks_first_then_short_documents():
    """Note [Placements and document need sets]: d1's blocks latest first, the prefix joins the rank
    holding d1[3,6) (its need drops to 0), short documents fill the work."""
    pl = place_packed([3, 9, 2], 2, block_tokens=4, max_block_work=10)
    assert pl.blocks == ((Span(1, 6, 9), Span(2, 0, 2)), (Span(0, 0, 3), Span(1, 0, 3), Span(1, 3, 6)))
    assert pl.work().tolist() == [27, 27]
    tok = np.array([s.tokens for _, _, s in pl.block_list()])
    assert (pl.need_matrix() * tok[None, :]).sum(axis=1).tolist() == [6, 0]


@pytest.mark.parametrize("mean, sigma, cp", [(8.0, 1.2, 16), (8.5, 1.5, 8)])
def test_received_tokens_on_a_seeded_mix(mean, sigma, cp):
    """Work stays balanced while the rank receiving most receives well under the longest document
    (its tail's holder) and short documents stay whole."""
    from megatron_fcp.contract.placement import lognormal_lengths

    lengths = lognormal_lengths(mean, sigma, 32768 * cp, seed=0)
    pl = place_packed(lengths, cp)
    work = pl.work()
    assert work.max() / work.mean() <= 1.05
    tok = np.array([s.tokens for _, _, s in pl.block_list()])
    recv = (pl.need_matrix() * tok[None, :]).sum(axis=1)
    assert recv.max() <= 0.8 * max(lengths)
    assert recv.sum() <= 0.5 * sum(lengths)  # most tokens are read where they live (0.32, 0.44 here)
    for rank_blocks in pl.blocks:
        for s in rank_blocks:
            if lengths[s.doc] <= 4096:
                assert (s.start, s.end) == (0, lengths[s.doc])


def test_packed_auto_breaks_near_ties_by_inter_node_bytes():
    """Candidates within PACKED_TIE of the best predicted time tie; the one crossing nodes least wins
    (the bytes benchmark's mix where ``full`` was 0.4% faster than ``entry`` but crossed 10.7% more)."""
    from megatron_fcp.planner.build import PACKED_TIE
    from megatron_fcp.contract.placement import lognormal_lengths

    lengths = lognormal_lengths(8.0, 1.2, 32768 * 16, 0)
    pl = place_packed(lengths, 16, block_tokens=4096)
    plan = build_plan("dgx-h100:2", range(16), placement=pl, objective="comm")
    times = dict(plan.auto.times)
    best = min(times.values())
    assert times[plan.name] <= best * (1 + PACKED_TIE)
    crossing = {name: simulate_plan(build_plan("dgx-h100:2", range(16), name, placement=pl), "dgx-h100:2",
                                    AttentionShape(1, 32, 8, 128)).inter_node_bytes
                for name, t in times.items() if t <= best * (1 + PACKED_TIE)}
    assert crossing[plan.name] == min(crossing.values())
    assert len(crossing) > 1 and plan.name == "entry"  # a real tie was broken, not a lone winner


def test_recv_lower_bound_small_cases():
    """Note [Busiest receiver lower bound]: a document that fits one rank's work needs nothing; the
    holder of a long document's last query can hold its last token and the cheapest prefix only."""
    from megatron_fcp.contract.placement import recv_lower_bound

    assert recv_lower_bound([8] * 8, 4) == 0  # whole documents fit every rank
    # one document of 100 tokens on 4 ranks, causal: C = 1.05 * 5050 / 4 = 1325.6; C - L = 1225.6
    # -> m = 49 (49 * 50 / 2 = 1225): the holder holds 50 tokens, receives >= 50
    assert recv_lower_bound([100], 4) == 50
    assert recv_lower_bound([100], 4, ranks_per_group=2) < 50  # a node holds more of it
    assert recv_lower_bound([100], 4, causal=False) == 100 - int(1.05 * 10000 / 4 // 100)


@pytest.mark.parametrize("mean, sigma, cp", [(9.0, 1.0, 64), (10.4, 1.0, 64), (8.0, 1.2, 16)])
def test_recv_refine_lowers_the_busiest_receiver_within_the_work_bound(mean, sigma, cp):
    """The busiest-receiver search never raises the largest need, keeps work max/mean <= 1.05 and
    stays above the lower bound (which every placement meeting the cap respects)."""
    from megatron_fcp.contract.placement import lognormal_lengths, recv_lower_bound

    lengths = lognormal_lengths(mean, sigma, 1 << 20, seed=0)
    tok = lambda pl: np.array([s.tokens for _, _, s in pl.block_list()])  # noqa: E731
    recv = lambda pl: (pl.need_matrix() * tok(pl)[None, :]).sum(axis=1)  # noqa: E731
    before, after = place_packed(lengths, cp, recv_refine=False), place_packed(lengths, cp)
    work = after.work()
    assert work.max() / work.mean() <= 1.05
    assert recv(after).max() <= recv(before).max()
    assert recv(after).max() >= recv_lower_bound(lengths, cp)


def test_few_documents_per_rank_still_balance():
    """cp = 256 on a 1M-token mix of 32K-median documents (25 documents): pieces at 1/4 of a rank's
    work cannot balance, so place_packed cuts them finer and places again (BALANCE_TARGET)."""
    from megatron_fcp.contract.placement import BALANCE_TARGET, lognormal_lengths

    lengths = lognormal_lengths(10.4, 1.0, 1 << 20, seed=0)
    work = place_packed(lengths, 256).work()
    assert work.max() / work.mean() <= BALANCE_TARGET


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (700, 0)), (False, (300, 200))])
def test_pairs_of_counts_what_pairs_counts(causal, window):
    """Placement.pair_matrix (the one vectorised table), and pairs / pairs_of (gathers from it),
    equal the span-by-span count (span_pairs over the reader's spans in the block's document) for
    every (reader, block)."""
    import dataclasses
    import math

    from megatron_fcp.contract.placement import lognormal_lengths, span_pairs

    pl = place_packed(lognormal_lengths(math.log(2048), 1.0, 64 * 1024, 1), 16, block_tokens=1024, causal=causal)
    if window is not None:
        pl = dataclasses.replace(pl, window=window)
    J, I, B = zip(*[(j, i, b) for j in range(16) for i, b, _ in pl.block_list()])
    counted = [sum(span_pairs(q, pl.blocks[i][b], pl.mask) for q in pl.blocks[j] if q.doc == pl.blocks[i][b].doc)
               for j, i, b in zip(J, I, B)]
    got = pl.pairs_of(J, I, B)
    assert got.dtype == np.int64 and got.tolist() == counted
    assert [pl.pairs(j, i, b) for j, i, b in zip(J, I, B)] == counted
    assert got.sum() > 0 and pl.pairs_of([], [], []).tolist() == []
    matrix = pl.pair_matrix()                          # [cp, blocks]: the waves' work table
    assert matrix.dtype == np.int64 and matrix.shape == (16, len(pl.block_list()))
    assert matrix.ravel().tolist() == counted and not matrix.flags.writeable


def test_block_columns_read_the_block_list():
    """``block_tokens`` / ``block_owners``: each block's tokens and owner (CP index), block_list order,
    read-only; ``tokens_of`` reads the same table."""
    pl = place_packed([37, 5, 120, 64, 9, 300, 1], 4, block_tokens=16)
    blocks = pl.block_list()
    assert pl.block_tokens().tolist() == [s.tokens for _, _, s in blocks]
    assert pl.block_owners().tolist() == [i for i, _, _ in blocks]
    assert not pl.block_tokens().flags.writeable and not pl.block_owners().flags.writeable
    i = np.array([i for i, _, _ in blocks]), np.array([b for _, b, _ in blocks])
    assert np.array_equal(pl.tokens_of(*i), pl.block_tokens())


def test_a_placement_pickles_without_its_caches():
    """A placement that planning has used (need matrix, trees kept for auto, floors' need tokens
    holding weak references) pickles to an equal placement with an empty cache, and a plan over
    it still pickles (the emulated cluster's workers and the head-parallel setup send plans)."""
    import pickle

    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.cost.floors import kv_floor
    from megatron_fcp.topology import load_topology

    topo = load_topology("dgx-h100:2")
    pl = place_packed(lognormal_lengths(8.0, 1.2, 16 * 8192, 3), 16, block_tokens=2048)
    plan = build_plan(topo, range(16), "entry", placement=pl)
    kv_floor(topo, range(16), pl, 0, True, 4096.0)
    assert len(pl._cache) > 3
    back = pickle.loads(pickle.dumps(plan))
    assert back.placement == pl and back.rounds == plan.rounds
    assert back.placement.need_matrix().tolist() == pl.need_matrix().tolist()
