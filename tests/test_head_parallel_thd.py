"""The head-parallel stage on packed (THD) batches on real gloo worlds: cp = 4 (a = 2, and a = 4:
one head group, attention local over the whole batch) and cp = 8 (a = 4 and a = 2).

Every case against an FP64 per-document reference (plain torch, each document attended alone):
out, LSE, dQ, dK, dV within 1e-12 x max(1, max|ref|) on every rank's shard; GQA with and without KV
replication (h = 4, h_kv = 2 / 1 at a = 2; h = 8, h_kv = 2 at a = 4), causal and not, a sink, the
fused CPU flash kernel in FP32 (1e-5), members without tokens, and Transformer Engine's layout on
its ring (``layout="thd"``). The member placement is checked
pure: each group's member shards concatenate to the group's placement shard. Bad input raises
ValueError before any communication. Pure: the merged stage plan and the all-to-all sizes the
cost model prices, and choose_packed_head_parallel's choice (the least predicted time).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _head_parallel_thd_cases import (  # noqa: E402
    DOCS,
    QUANTITIES,
    TOPOLOGIES,
    TOPOLOGY_2X2,
    Case,
    make_plan,
    worker,
)

from megatron_fcp.testing.launch import run_gloo  # noqa: E402

CASES_4 = [
    Case(2, "mix", True), Case(2, "mix", False), Case(2, "mix", True, heads=(4, 1)), Case(2, "one", True),
    Case(2, "tiny", True), Case(2, "mix", True, graph="ring"), Case(2, "mix", True, sink=True),
    Case(2, "mix", True, dtype="fp32", kernel="cpu-flash"),
    Case(4, "mix", True, heads=(8, 2)), Case(4, "mix", False, heads=(8, 2)), Case(4, "tiny", True, heads=(8, 2)),
    Case(2, "mix", True, layout="thd"),
]
CASES_8 = [
    Case(4, "mix", True, heads=(8, 2)), Case(4, "mix", False, heads=(8, 2)), Case(4, "one", True, heads=(8, 4)),
    Case(2, "mix", True), Case(2, "mix", True, heads=(4, 1), graph="ring"),
    Case(4, "mix", True, heads=(8, 2), layout="thd"), Case(2, "one", True, layout="thd"),
]


def _check(per_rank, cases):
    for case in cases:
        tol = 1e-12 if case.dtype == "fp64" else 1e-5
        for r, res in enumerate(per_rank):
            got = res[case.name]
            for n in QUANTITIES:
                bound = tol * max(1.0, got["ref_max"][n])
                assert got["err"][n] <= bound, f"{case.name} rank {r} {n}: {got['err'][n]:.3e} > {bound:.1e}"
        assert sum(res[case.name]["tokens"] for res in per_rank) == sum(DOCS[case.docs])
        assert any(res[case.name]["a2a_bytes"] > 0 for res in per_rank)


def _check_bad(per_rank):
    want = {"tokens": "member placement gives it", "heads": "must divide the query heads",
            "rep": "kv_replication", "causal": "causal=True", "plan": "PackedHeadParallelPlan"}
    for res in per_rank:
        for name, text in want.items():
            msg = res["bad_inputs"][name]
            assert msg is not None and text in msg, f"bad input {name!r}: {msg!r}"


@pytest.mark.dist
@pytest.mark.slow
def test_packed_head_parallel_cp4():
    per_rank = run_gloo(worker, 4, CASES_4, timeout_s=300)
    _check_bad(per_rank)
    _check(per_rank, CASES_4)


@pytest.mark.dist
@pytest.mark.slow
def test_packed_head_parallel_cp8():
    per_rank = run_gloo(worker, 8, CASES_8, timeout_s=400)
    _check_bad(per_rank)
    _check(per_rank, CASES_8)


def test_member_placement_concatenates_to_the_group_placement():
    from megatron_fcp.contract.head_parallel_packed import member_counts

    for case, ranks in ((Case(2, "mix", True), (0, 1, 2, 3)), (Case(4, "mix", True, heads=(8, 2)), tuple(range(8))),
                        (Case(2, "tiny", True), (0, 1, 2, 3))):
        hp = make_plan(case, ranks)
        for g, group in enumerate(hp.head_groups):
            idx = [ranks.index(r) for r in group]
            joined = [i for c in idx for i in hp.placement.token_index(c).tolist()]
            assert joined == hp.group_placement.token_index(g).tolist()
            assert hp.member_tokens(g) == member_counts(hp.group_placement.tokens(g), hp.degree)
        assert (hp.kv_plan is None) == (hp.num_groups == 1)


def test_verify_refuses_a_member_placement_that_is_not_the_split():
    """``verify`` proves the member placement is the group placement's split: two members' shards
    swapped (a valid placement of the same tokens) or another layout are refused."""
    import dataclasses

    from megatron_fcp.contract.blocks import PlanError
    from megatron_fcp.contract.placement import Placement

    hp = make_plan(Case(2, "mix", True), (0, 1, 2, 3))
    assert hp.verify() is hp
    pl = hp.placement
    swapped = Placement(pl.doc_lengths, (pl.blocks[1], pl.blocks[0]) + pl.blocks[2:], pl.causal, pl.window)
    thd = Placement(pl.doc_lengths, pl.blocks, pl.causal, pl.window, layout="thd")
    for bad in (swapped, thd):
        with pytest.raises(PlanError, match="not the split of the group placement"):
            dataclasses.replace(hp, placement=bad).verify()


def test_packed_head_parallel_plan_errors():
    from megatron_fcp.planner.head_parallel import compile_packed_head_parallel

    with pytest.raises(ValueError, match="must divide the CP size"):
        compile_packed_head_parallel(TOPOLOGY_2X2, (0, 1, 2, 3), (5, 7), 6, 6, 3)
    with pytest.raises(ValueError, match="must divide the query heads"):
        compile_packed_head_parallel(TOPOLOGY_2X2, (0, 1, 2, 3), (5, 7), 3, 3, 2)
    with pytest.raises(ValueError, match="degree 1 is the plain packed plan"):
        compile_packed_head_parallel(TOPOLOGY_2X2, (0, 1, 2, 3), (5, 7), 4, 4, 1)
    with pytest.raises(ValueError, match="doc_lengths"):
        compile_packed_head_parallel(TOPOLOGY_2X2, (0, 1, 2, 3), (5, 0), 4, 4, 2)


def test_packed_stage_plan_and_all_to_all_sizes():
    """The merged stage plan verifies and carries each KV-plan transfer once per member; the
    all-to-alls move (a-1)/a of each member's tokens' bytes each way (Note [Packed head-parallel cost])."""
    from megatron_fcp.cost.head_parallel_packed import (
        packed_a2a_messages,
        packed_stage_plan,
        simulate_packed_head_parallel,
    )
    from megatron_fcp.cost.model import AttentionShape

    shape = AttentionShape(256, 8, 2, 16, 2)
    for case, ranks in ((Case(2, "mix", True, heads=(8, 2)), (0, 1, 2, 3)), (Case(4, "mix", True, heads=(8, 2)),
                                                                           tuple(range(8)))):
        hp = make_plan(case, ranks)
        sp = packed_stage_plan(hp)
        assert sp.num_transfers() == hp.degree * (hp.kv_plan.num_transfers() if hp.kv_plan else 0)
        a, rep = hp.degree, hp.kv_replication
        per = (shape.q_bytes(1) + shape.kv_bytes(1) * rep) / a
        for which in ("qkv-in", "qkv-out"):
            msgs = packed_a2a_messages(hp, shape, which)
            assert sum(b for _, _, b in msgs) == pytest.approx((a - 1) * sum(DOCS["mix"]) * per)
        got = {(s, d): b for s, d, b in packed_a2a_messages(hp, shape, "o-out")}
        for g, group in enumerate(hp.head_groups):  # O back: member m receives its t_m rows from each peer
            for m, r in enumerate(group):
                assert all(got.get((p, r), 0) == hp.member_tokens(g)[m] * shape.o_bytes(1) / a for p in group if p != r)
        res = simulate_packed_head_parallel(hp, TOPOLOGIES[len(ranks)], shape)
        assert res.total_s > 0 and res.meta["head_parallel"] == a
    with pytest.raises(ValueError, match="which"):
        packed_a2a_messages(hp, shape, "kv-in")


def _a2a_messages_by_loop(hp, shape, which):
    """The all-to-all's messages as the definition reads (group, then sender member, then receiver)."""
    a, rep = hp.degree, hp.kv_replication
    per = (shape.q_bytes(1) + shape.kv_bytes(1) * rep) / a if which.startswith("qkv") else shape.o_bytes(1) / a
    out = []
    for g, group in enumerate(hp.head_groups):
        tokens = hp.member_tokens(g)
        for m, src in enumerate(group):
            for i, dst in enumerate(group):
                if m != i and tokens[m]:
                    out.append((src, dst, tokens[m] * per) if which.endswith("in") else (dst, src, tokens[m] * per))
    return out


@pytest.mark.parametrize("degree,cp", [(2, 4), (4, 8), (2, 8)])
def test_all_to_all_priced_from_one_routing_is_simulate_rounds(degree, cp):
    """Each all-to-all is the definition's messages in its order, and its price from the round
    routed once per direction (:class:`~megatron_fcp.cost.model.ScaledRound`) is
    ``simulate_rounds`` of those messages, every field equal (not approximately)."""
    from megatron_fcp.cost.head_parallel_packed import _a2a, packed_a2a_messages
    from megatron_fcp.cost.model import AttentionShape, ScaledRound, simulate_rounds
    from megatron_fcp.topology import load_topology

    shape = AttentionShape(256, 8, 2, 16, 2)
    hp = make_plan(Case(degree, "mix", True, heads=(8, 2)), tuple(range(cp)))
    topo = load_topology(TOPOLOGIES[cp])
    for which in ("qkv-in", "o-out", "o-in", "qkv-out"):
        msgs = packed_a2a_messages(hp, shape, which)
        assert msgs == _a2a_messages_by_loop(hp, shape, which)
        for overhead in (0.0, 3e-6):
            want, got = simulate_rounds(topo, [msgs], overhead, name="a2a-" + which), _a2a(hp, topo, shape, which, overhead)
            assert (got.name, got.comm_s, got.total_s, got.bytes, got.rounds, got.resource_bytes,
                    got.resource_bandwidth, got.timeline) == \
                   (want.name, want.comm_s, want.total_s, want.bytes, want.rounds, want.resource_bytes,
                    want.resource_bandwidth, want.timeline)
    src, dst, units = [np.array(c) for c in zip(*[(0, 1, 3.0), (2, 2, 5.0), (1, 3, 0.0), (3, 0, 2.0)])]
    rnd = ScaledRound(topo, src, dst, units)            # a message to itself and one of no bytes: left out
    want = simulate_rounds(topo, [[(0, 1, 6.0), (3, 0, 4.0)]])
    got = rnd.simulate(2.0)
    assert (got.total_s, got.bytes, got.resource_bytes, got.timeline) == \
           (want.total_s, want.bytes, want.resource_bytes, want.timeline)
    assert rnd.simulate(0.0).total_s == simulate_rounds(topo, [[]]).total_s == 0.0


def test_choose_packed_head_parallel_takes_the_least_predicted_time():
    import math

    from megatron_fcp.contract.head_parallel import head_parallel_degrees
    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.cost.model import AttentionShape
    from megatron_fcp.planner.head_parallel import choose_packed_head_parallel

    docs = lognormal_lengths(math.log(2048), 1.0, 128 * 1024, seed=0)
    shape = AttentionShape(128 * 1024, 32, 8, 128, 2)
    best, times = choose_packed_head_parallel("dgx-h100:2", range(16), docs, shape, prune=False)
    assert sorted(times) == head_parallel_degrees("dgx-h100:2", range(16), 32, 8) == [1, 2, 4, 8]
    assert times[best] == min(times.values())
    best2, times2 = choose_packed_head_parallel("dgx-h100:2", range(16), docs, shape, degrees=[1, 2], prune=False)
    assert times2 == {a: times[a] for a in (1, 2)} and best2 in (1, 2)
    # pruned (the default): the same choice, each degree simulated has the full search's time
    best3, times3 = choose_packed_head_parallel("dgx-h100:2", range(16), docs, shape)
    assert best3 == best and best in times3 and times3 == {a: times[a] for a in times3}


def test_pruned_degree_choice_is_the_full_search():
    """Note [Pruning the packed degree choice]: on mixes where degrees are pruned, the choice is the
    full search's, each pruned degree's floors rule it out, and no floor (the jobs', the waves') is
    above its own degree's time; a degree the jobs' floor rules out has no backward program
    compiled (its waves were never packed)."""
    import math

    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.cost.head_parallel_packed import PackedAsRun, priced_stage_plan
    from megatron_fcp.cost.model import AttentionShape
    from megatron_fcp.planner.head_parallel import choose_packed_head_parallel
    from megatron_fcp.schedule.program import compiled_programs
    from megatron_fcp.topology import load_topology

    topo = load_topology("dgx-h100:4")
    shape = AttentionShape(1, 64, 8, 128, 2)
    pruned_somewhere = left_unpacked = False
    for median, seed in ((2048, 0), (8192, 1), (32768, 2)):
        docs = lognormal_lengths(math.log(median), 1.0, 1 << 18, seed)
        plans: dict = {}
        full_best, full = choose_packed_head_parallel(topo, range(32), docs, shape, prune=False, plans=plans)
        mine: dict = {}
        best, times = choose_packed_head_parallel(topo, range(32), docs, shape, plans=mine)
        assert best == full_best and times == {a: full[a] for a in times}
        for a, plan in plans.items():
            priced = PackedAsRun(plan, topo, shape)
            jobs, waves = priced.compute_floor(), priced.floor()
            assert jobs <= full[a] * (1 + 1e-9) and waves <= full[a] * (1 + 1e-9)
            if a not in times:
                pruned_somewhere = True
                assert max(jobs, waves) > full[best]
                stage = mine[a] if a == 1 else priced_stage_plan(mine[a], topo)
                if jobs > full[best]:
                    assert not compiled_programs(stage)
                    left_unpacked = True
    assert pruned_somewhere and left_unpacked


def test_merged_stage_plan_is_every_member_copy_of_every_kv_transfer():
    """packed_stage_plan builds its table from the KV plan's columns: its rounds are, per KV round,
    each KV transfer once per member ``j`` (group ranks' ``j``-th members, in order), and the plan
    is built once per stage object."""
    import math

    from megatron_fcp.contract.blocks import Block, Transfer
    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.cost.head_parallel_packed import packed_stage_plan
    from megatron_fcp.planner.head_parallel import compile_packed_head_parallel

    docs = lognormal_lengths(math.log(4096), 1.0, 16 * 8192, seed=3)
    hp = compile_packed_head_parallel("dgx-h100:4", range(32), docs, 32, 8, 4, "auto")
    g = hp.head_groups
    want = tuple(tuple(Transfer(g[t.src][j], g[t.dst][j], Block(g[t.block.owner][j], t.block.chunk, 0))
                       for t in rnd for j in range(hp.degree)) for rnd in hp.kv_plan.rounds)
    sp = packed_stage_plan(hp)
    assert sp.table is not None and sp.verified and sp.rounds == want and len(want) > 1
    assert packed_stage_plan(hp) is sp


def _stage_prices(plan, topo, sshape, mode):
    """A KV stage plan's forward (total, communication, compute), wave floor and backward in waves
    (seconds, waves, mode), and how many ranks kept their first wave from the forward."""
    from megatron_fcp.cost.backward import simulate_backward_waves, wave_backward_floor
    from megatron_fcp.cost.model import simulate_plan

    fwd = simulate_plan(plan, topo, sshape)
    bwd = simulate_backward_waves(plan, topo, sshape, backward_kv=mode, per_wave=False)
    return (fwd.total_s, fwd.comm_s, fwd.compute_s, wave_backward_floor(plan, topo, sshape, backward_kv=mode),
            bwd["bwd_s"], bwd["waves"], bwd["backward_kv"], bwd["first_kept_ranks"])


@pytest.mark.parametrize("topology, ranks, median, heads", [
    ("dgx-h100:2", 16, 2048, (64, 8)),
    ("dgx-h100:4", 32, 8192, (32, 4)),
    ("gb200-nvl72:8", 32, 4096, (64, 8)),
])
def test_one_copy_prices_the_kv_stage_as_every_copy_merged(topology, ranks, median, heads):
    """Note [One copy prices the KV stage]: on rail-aligned topologies the copies are independent,
    and copy 0 alone prices the forward, the wave floor and the backward in waves (each mode) bit
    for bit as the merged plan of every copy; the stage is priced on that copy."""
    import math

    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.cost.head_parallel import stage_shape
    from megatron_fcp.cost.head_parallel_packed import packed_stage_plan, priced_stage_plan, stage_copies_independent
    from megatron_fcp.cost.model import AttentionShape
    from megatron_fcp.planner.head_parallel import compile_packed_head_parallel
    from megatron_fcp.topology import load_topology

    topo = load_topology(topology)
    docs = lognormal_lengths(math.log(median), 1.0, ranks * 4096, seed=ranks)
    shape = AttentionShape(1, *heads, 128, 2)
    staged = 0
    for a in (2, 4, 8):
        for graph in ("auto", "entry"):
            hp = compile_packed_head_parallel(topo, range(ranks), docs, *heads, a, graph, head_dim=128)
            if hp.kv_plan is None:
                continue
            staged += 1
            assert stage_copies_independent(hp, topo)
            assert priced_stage_plan(hp, topo) is hp.kv_plan_for(0)
            for mode in ("auto", "keep", "resend"):
                *copy, copy_keepers = _stage_prices(hp.kv_plan_for(0), topo, stage_shape(hp, shape), mode)
                *merged, merged_keepers = _stage_prices(packed_stage_plan(hp), topo, stage_shape(hp, shape), mode)
                assert copy == merged and merged_keepers == a * copy_keepers, (a, graph, mode)
    assert staged >= 4


@pytest.mark.parametrize("topology, ranks", [("single-uplink:2", 16), ("pcie-box:2", 16)])
def test_copies_that_share_a_link_are_priced_merged(topology, ranks):
    """Where the copies share a link (one NIC per node; GPU pairs behind a PCIe switch) they contend:
    copy 0 alone would price the forward too low, so the stage is priced merged."""
    import math

    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.cost.head_parallel import stage_shape
    from megatron_fcp.cost.head_parallel_packed import packed_stage_plan, priced_stage_plan, stage_copies_independent
    from megatron_fcp.cost.model import AttentionShape, simulate_plan
    from megatron_fcp.planner.head_parallel import compile_packed_head_parallel
    from megatron_fcp.topology import load_topology

    topo = load_topology(topology)
    docs = lognormal_lengths(math.log(2048), 1.0, ranks * 4096, seed=1)
    shape = AttentionShape(1, 32, 8, 128, 2)
    for a in (2, 4):
        hp = compile_packed_head_parallel(topo, range(ranks), docs, 32, 8, a, "auto", head_dim=128)
        assert not stage_copies_independent(hp, topo)
        assert priced_stage_plan(hp, topo) is packed_stage_plan(hp)
        sshape = stage_shape(hp, shape)
        alone = simulate_plan(hp.kv_plan_for(0), topo, sshape).comm_s
        assert simulate_plan(packed_stage_plan(hp), topo, sshape).comm_s > alone * 1.2


def test_the_jobs_floor_holds_where_launches_are_most_of_the_work():
    """Tiny blocks (64 tokens, head size 16) on one node: a job is mostly its launch, and a stage
    whose KV plan is a chain launches several jobs per step, so the jobs' floor counts launches only
    for a backward in waves; every degree's floors stay below its time and the pruned choice is the
    full search's (a floor counting a launch per job put ``a = 4``'s above its time and chose 8)."""
    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.cost.head_parallel_packed import PackedAsRun
    from megatron_fcp.cost.model import AttentionShape
    from megatron_fcp.planner.head_parallel import choose_packed_head_parallel
    from megatron_fcp.topology import load_topology

    topo = load_topology("dgx-h100:1")
    for seed in range(3):
        docs = tuple(lognormal_lengths(5.0, 1.0, 2048, seed=seed))
        shape = AttentionShape(sum(docs), 8, 2, 16, 2)
        plans: dict = {}
        kw = dict(graph="hierarchical", block_tokens=64)
        full_best, full = choose_packed_head_parallel(topo, range(8), docs, shape, prune=False, plans=plans, **kw)
        best, times = choose_packed_head_parallel(topo, range(8), docs, shape, **kw)
        assert best == full_best and times == {a: full[a] for a in times}
        for a, plan in plans.items():
            assert PackedAsRun(plan, topo, shape).compute_floor() <= full[a] * (1 + 1e-9), (seed, a)
