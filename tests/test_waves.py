"""Backward waves (Note [Backward waves] in megatron_fcp/attention/backward_waves.py): the pure
split of a plan's deliveries (schedule/waves.py) and its cost model (packed_cost.simulate_backward_waves)."""

from __future__ import annotations

import pytest

from megatron_fcp.contract.placement import place_packed
from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.planner.build import build_plan
from megatron_fcp.cost.backward import simulate_backward_waves
from megatron_fcp.schedule.waves import block_work, plan_waves, restrict, wave_budget

BUILDERS = ("ring", "full", "hierarchical", "leader", "spanning", "entry")


def _check(plan, waves, size, budget):
    """Every need and every own block computed exactly once; a wave's transfers are paths from the
    owner (a sender owns the block or got it earlier in the same wave) carried by the plan; every
    rank receives at most ``budget`` bytes per wave (a wave's first delivery may exceed it alone)."""
    done = [c for w in waves for c in w.computes]
    assert len(done) == len(set(done))
    want = {(b, x) for x in plan.ranks for b in plan.needs(x)} | {(b, b.owner) for b in plan.blocks()}
    assert set(done) == want
    in_plan = set(plan.transfers())
    for w in waves:
        have = set()
        load: dict[int, int] = {}
        for r, t in w.transfers:
            assert (r, t) in in_plan
            assert t.src == t.block.owner or (t.block, t.src) in have
            have.add((t.block, t.dst))
            load[t.dst] = load.get(t.dst, 0) + size(t.block)
        for b, x in w.computes:
            assert x == b.owner or (b, x) in have                # computed where it arrives
        assert max(load.values(), default=0) <= budget or len({t.block for _, t in w.transfers}) == 1
        sub = restrict(plan, w)
        assert len(sub.rounds) == len(w.rounds) and all(sub.rounds)


@pytest.mark.parametrize("cp", (4, 8))
@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("parts", (1, 2))
def test_waves_compute_every_need_once_within_the_budget(cp, builder, parts):
    plan = build_plan("dgx-h100:1", range(cp), builder, parts_per_chunk=parts)
    size = lambda b: 100  # noqa: E731
    budget = wave_budget(plan, size)
    assert budget == 2 * parts * 100  # a shard of 2 chunks x parts
    waves = plan_waves(plan, size)
    _check(plan, waves, size, budget)
    assert plan_waves(plan, size, cache_key="k") == plan_waves(plan, size, cache_key="k") == waves


def test_waves_over_a_placement_and_blocks_larger_than_the_budget():
    pl = place_packed([5, 40, 3, 17, 1, 30], 4, block_tokens=8)
    plan = build_plan("dgx-h100:1", range(4), "hierarchical", placement=pl)
    size = lambda b: 10 * pl.blocks[b.owner][b.chunk].tokens  # noqa: E731
    _check(plan, plan_waves(plan, size), size, wave_budget(plan, size))
    tiny = plan_waves(plan, size, budget=1)                   # every block is too large: one per wave
    _check(plan, tiny, size, 1)
    assert all(len({t.block for _, t in w.transfers}) <= 1 for w in tiny)


def test_sub_blocks_balance_the_work_per_wave():
    """Causal zigzag at cp = 16: with two parts per chunk every wave gives each rank about the same
    work, so the waves' busiest ranks add up to the one-pass busiest rank's work."""
    plan = build_plan("dgx-h100:2", range(16), "hierarchical", parts_per_chunk=2)
    work = block_work(plan)
    waves = plan_waves(plan, lambda b: 100)
    per_wave = sum(max(sum(work(x, b) for b, y in w.computes if y == x) for x in plan.ranks) for w in waves)
    one_pass = max(sum(work(x, b) for b in plan.needs(x) | set(plan.local_blocks(x))) for x in plan.ranks)
    assert per_wave <= 1.02 * one_pass


def test_wave_cost_model_bounds_held_kv_by_the_ring_and_hides_the_resend():
    """cp = 16 on two DGX H100, 128K tokens, GQA 32:8, hierarchical with two parts per chunk:
    resend holds at most the ring's two shard buffers (2 x 32 MiB) within backward, keep its need set (480 MiB
    on CP rank 0); fwd+bwd with resend within 1.15x of keep's one-pass backward."""
    from megatron_fcp.cost.model import AttentionShape, simulate_plan
    from megatron_fcp.cost.backward import simulate_backward_waves, simulate_plan_backward

    shape = AttentionShape(131072, 32, 8, 128)
    plan = build_plan("dgx-h100:2", range(16), "hierarchical", parts_per_chunk=2)
    shard = shape.kv_bytes(131072 / 16)
    resend = simulate_backward_waves(plan, "dgx-h100:2", shape, backward_kv="resend")
    keep = simulate_backward_waves(plan, "dgx-h100:2", shape, backward_kv="keep")
    assert resend["held_kv_bytes_max"] <= 2 * shard and keep["held_kv_bytes_max"] == 15 * shard
    assert resend["waves"] == keep["waves"] > 8 and resend["resend_s"] > 0 and keep["resend_s"] == 0
    assert keep["bwd_s"] <= resend["bwd_s"] <= keep["bwd_s"] + resend["resend_s"]
    fwd = simulate_plan(plan, "dgx-h100:2", shape).total_s
    one_pass = simulate_plan_backward(plan, "dgx-h100:2", shape).total_s
    assert fwd + resend["bwd_s"] <= 1.15 * (fwd + one_pass)


def test_megatron_runtime_cuts_chunks_in_two_where_backward_may_resend():
    """--fcp-block-tokens 0: whole chunks, except where the backward may re-send KV (auto/resend
    at cp > 2): two parts per chunk balance the waves. An explicit block size always wins."""
    from megatron_fcp.config import FCPConfig
    from megatron_fcp.patches.runtime import reset_fcp, setup_fcp
    from megatron_fcp.planner.megatron_layout import MegatronLayout

    def parts(cfg, cp, s_local=32):
        reset_fcp()
        try:
            rt = setup_fcp(cfg, layout=MegatronLayout(world=cp, cp=cp), groups={}, seq_len=s_local * cp)
            return rt.parts_per_chunk(s_local)
        finally:
            reset_fcp()

    base = FCPConfig(enabled=True, topology="dgx-h100:1", head_parallel=1)
    assert parts(base, 4) == 2 and parts(base.replace(backward_kv="resend"), 8) == 2
    assert parts(base, 4, s_local=30) == 2                      # odd 15-token chunks: halves of 7 and 8
    assert parts(base.replace(backward_kv="keep"), 4) == 1
    assert parts(base, 2) == 1                                  # cp = 2: auto keeps within the ring's budget
    assert parts(base.replace(block_tokens=4), 4) == 4          # 16-token chunks cut into 4-token blocks


def test_balanced_waves_pick_the_least_pace_then_the_fewest_waves():
    """Note [Balanced waves]: on a packed plan whose need sets fit the byte budget, the 1x work cap
    alone made five waves; a larger cap makes one with the least pace and makespan (every rank's
    total)."""
    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.schedule import waves as W
    from megatron_fcp.contract.placement import place_packed

    lengths = lognormal_lengths(8.0, 1.2, 32768 * 16, 0)
    pl = place_packed(lengths, 16, block_tokens=4096)
    plan = build_plan("dgx-h100:2", range(16), "entry", placement=pl)
    tok = {(plan.ranks[i], b): s.tokens for i, b, s in pl.block_list()}
    size = lambda blk: tok[(blk.owner, blk.chunk)] * 4096  # noqa: E731
    work = W.block_work(plan)
    budget = W.wave_budget(plan, size)
    inp = W._PackInput(plan, size)
    packed = {k: W._pack(inp, budget, k) for k in W.WAVE_CAP_SCALES}
    packs = {k: p for k, (p, _, _) in packed.items()}
    spans = {k: W._makespan(p, work) for k, p in packs.items()}
    paces = {k: pace for k, (_, pace, _) in packed.items()}
    waves = W.plan_waves(plan, size)
    assert W._makespan(waves, work) == min(spans.values())
    chosen = next(pace for p, pace, _ in packed.values() if p == waves)
    assert chosen == min(paces.values()) == pytest.approx(1.0)
    assert len(packs[1.0]) > 1 and len(waves) == 1  # the cap alone had cut it
    totals = {x: sum(work(x, b) for b in plan.needs(x)) + sum(work(x, b) for b in plan.local_blocks(x))
              for x in plan.ranks}
    assert W._makespan(waves, work) == pytest.approx(max(totals.values()))
    # every delivery exactly once, whatever the cap
    for pack in packs.values():
        done = [c for w in pack for c in w.computes]
        assert len(done) == len(set(done)) == sum(len(plan.needs(x)) + len(plan.local_blocks(x)) for x in plan.ranks)


def _rail_2x4():
    """The emulated rail-2x4-mha configuration's fcp-auto plan (hierarchical, whole chunks), its
    topology, attention shape, compute model and the executor's block bytes."""
    from megatron_fcp.emulate.spec import ClusterSpec, emulated_topology
    from megatron_fcp.emulate.workloads import WorkloadShape, executor_program, make_workloads
    from megatron_fcp.cost.model import ComputeModel

    spec = ClusterSpec(2, 4, "rail", 360e6, 40e6)
    topo = emulated_topology(spec)
    cm = ComputeModel(flops=400e12 / spec.time_scale, kernel_overhead_s=0.0)
    shape = WorkloadShape(4096, heads=4, kv_heads=4, head_dim=64)
    plan = make_workloads(["fcp-auto"], shape, topo, cm)[0].plan
    att = shape.attention()
    return plan, topo, att, cm, executor_program("auto", plan, att.seq_len, att.kv_heads, att.head_dim).block_bytes


@pytest.mark.parametrize("builder,parts", [("hierarchical", 1), ("full", 1), ("hierarchical", 4), ("full", 4)])
def test_a_cap_that_turns_no_work_away_packs_as_every_larger_cap(builder, parts):
    """plan_waves stops at the first cap that never turned a job away (Note [Balanced waves]): every
    larger cap then packs the very same waves, checked here by packing with all of them."""
    import megatron_fcp.schedule.waves as W

    plan = build_plan("pcie-box:2", range(16), builder, parts_per_chunk=parts)
    size = lambda blk: 100  # noqa: E731
    inp = W._PackInput(plan, size)
    budget = W.wave_budget(plan, size)
    packed = [W._pack(inp, budget, k) for k in W.WAVE_CAP_SCALES]
    free = [k for k, (_, _, capped) in enumerate(packed) if not capped]
    assert free and not packed[-1][2]                 # an unbounded cap never turns work away
    for k in range(free[0], len(packed)):
        assert packed[k][:2] == packed[free[0]][:2]
    best = min(pace for _, pace, _ in packed)             # the rule over all four caps, as before the shortcut
    expected = min((c for c in packed if c[1] <= best * (1 + W.WAVE_TIE)), key=lambda c: (len(c[0]), c[1]))[0]
    assert W.plan_waves(plan, size) == expected


@pytest.mark.slow  # a long single-process sweep (docs/megatron.md, "Test tiers")
def test_pace_lets_fine_sub_blocks_fill_the_byte_budget():
    """Note [Balanced waves]: dgx-a100:3, cp = 24, 8 uneven parts per chunk. The 1x work cap alone
    gives every rank one or two small blocks per wave (195 waves, each paying its reduction's
    rounds); the least pace fills the byte budget about 4x better. Every delivery once, within the
    budget; the same waves from an equal plan built again (deterministic)."""
    from megatron_fcp.schedule import waves as W
    from megatron_fcp.contract.blocks import part_tokens

    def build():
        return build_plan("dgx-a100:3", range(24), "hierarchical", parts_per_chunk=8)

    plan = build()
    size = lambda b: part_tokens(131088, 24, 8, b.part) * 4096  # noqa: E731
    budget = wave_budget(plan, size)
    waves = plan_waves(plan, size)
    _check(plan, waves, size, budget)
    assert len(W._pack(W._PackInput(plan, size), budget, 1.0)[0]) > 3 * len(waves)
    assert plan_waves(build(), size) == waves
    got = max(sum(size(t.block) for _, t in plan.transfers() if t.dst == x) for x in plan.ranks)
    assert len(waves) >= got / budget  # no wave brings a rank more than the budget


def test_rail_waves_are_as_few_as_the_byte_budget_allows():
    """rail-2x4-mha (the emulated benchmark): the budget is two whole chunks (a shard), and a CP
    rank of node 0 receives 14 (relays included), so 7 waves is the least any packing can do; the
    2x cap makes 7, each rank receiving at most two blocks a wave, but plan_waves runs the 1x cap's
    9, whose pace is lower (Note [Balanced waves]: with whole chunks under causal zigzag two blocks
    a wave give some ranks twice the work of others)."""
    from megatron_fcp.schedule import waves as W

    plan, _, _, _, size = _rail_2x4()
    budget = wave_budget(plan, size)
    waves = plan_waves(plan, size)
    _check(plan, waves, size, budget)
    got = max(sum(size(t.block) for _, t in plan.transfers() if t.dst == x) for x in plan.ranks)
    assert got == 7 * budget and len(waves) == 9
    inp = W._PackInput(plan, size)
    (few, few_pace, _), (tight, tight_pace, _) = W._pack(inp, budget, 2.0), W._pack(inp, budget, 1.0)
    assert len(few) == 7 and tight == waves and tight_pace < few_pace


def test_the_wave_timeline_has_no_barrier_between_waves():
    """Note [Wave pipeline timeline] on rail-2x4-mha: with gloo's buffered sends the ranks run ahead
    of a wave whose dK/dV crosses one slow rail, so keep's backward is well under the lock-step sum
    (0.53 of it in 9 waves; under half with the half-shard waves before 2026-12-03)
    (reduce, compute and re-send of each wave in step); waiting for sends only slows it; resend
    costs more than keep; every result key the reports read is there."""
    from megatron_fcp.cost.backward import simulate_backward_waves

    plan, topo, att, cm, _ = _rail_2x4()
    runs = {(m, b): simulate_backward_waves(plan, topo, att, compute_model=cm, backward_kv=m, buffered_sends=b)
            for m in ("keep", "resend") for b in (False, True)}
    keep = runs[("keep", True)]
    assert set(keep) == {"bwd_s", "backward_kv", "resend_s", "waves", "wave_compute_s", "wave_reduce_s",
                         "wave_resend_s", "held_kv_bytes_max", "first_kept", "first_kept_ranks", "backward",
                         "held_between_passes_bytes_max", "jobs_end_s", "launches"}
    assert 0 < keep["jobs_end_s"] <= keep["bwd_s"]          # the last job ends before the last sums arrive
    W = keep["waves"]
    red, comp = keep["wave_reduce_s"], keep["wave_compute_s"]
    lockstep = sum(max(red[i - 1] if i else 0.0, comp[i] if i < W else 0.0) for i in range(W + 1))
    assert keep["bwd_s"] < 0.6 * lockstep
    assert keep["bwd_s"] < runs[("keep", False)]["bwd_s"]
    assert keep["bwd_s"] < runs[("resend", True)]["bwd_s"] < runs[("resend", False)]["bwd_s"]
    assert keep["bwd_s"] >= max(sum(comp) / plan.cp, max(red))  # no faster than its parts


def test_held_kv_under_resend_stays_within_a_shard_on_a_packed_cp64_plan():
    """cp = 64 packed (lognormal 8.0/1.2, 32K tokens per rank, 4096-token blocks, entry graph on
    dgx-h100:8): two consecutive waves' received KV on any rank is at most two of the largest shard
    (the budget is one and every block is smaller); keep holds its need set."""
    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.cost.model import AttentionShape
    from megatron_fcp.cost.backward import simulate_backward_waves

    pl = place_packed(lognormal_lengths(8.0, 1.2, 32768 * 64, 0), 64, block_tokens=4096)
    plan = build_plan("dgx-h100:8", range(64), "entry", placement=pl)
    shape = AttentionShape(1, 64, 8, 128, 2)
    per_token = shape.kv_bytes(1)
    shard = max(pl.tokens(i) for i in range(64)) * per_token
    resend = simulate_backward_waves(plan, "dgx-h100:8", shape, backward_kv="resend")
    keep = simulate_backward_waves(plan, "dgx-h100:8", shape, backward_kv="keep")
    need = max(sum(plan.block_tokens(b) for b in plan.needs(x)) for x in plan.ranks) * per_token
    assert 0 < resend["held_kv_bytes_max"] <= 2 * shard and keep["held_kv_bytes_max"] == need


def test_auto_keeps_the_first_wave_where_it_fits_the_ring_budget():
    """Under auto (the ring's budget) the forward saves what the first wave computes (at most one
    shard: Transformer Engine's ring saves its last received shard), so backward starts without
    re-sending it; an explicit resend saves nothing and fetches it first. dgx-h100:2, cp = 16,
    128K GQA 32:8, hierarchical with two parts per chunk."""
    from megatron_fcp.schedule.chains import first_kept_blocks, first_keepers

    shape = AttentionShape(131072, 32, 8, 128, 2)
    plan = build_plan("dgx-h100:2", range(16), "hierarchical", parts_per_chunk=2)
    auto = simulate_backward_waves(plan, "dgx-h100:2", shape, backward_kv="auto")
    bare = simulate_backward_waves(plan, "dgx-h100:2", shape, backward_kv="resend")
    assert (auto["backward_kv"], auto["first_kept"], bare["first_kept"]) == ("resend", True, False)
    assert auto["backward"] == bare["backward"] == "waves" and auto["waves"] == bare["waves"]
    shard = 131072 // 16 * 2 * 8 * 128 * 2 * 2                      # a rank's K and V, bf16
    assert 0 < auto["held_between_passes_bytes_max"] <= shard and bare["held_between_passes_bytes_max"] == 0
    assert auto["bwd_s"] < bare["bwd_s"] and auto["resend_s"] < bare["resend_s"]
    size = lambda b: 100  # noqa: E731
    got = first_kept_blocks(plan, size)
    assert first_keepers("auto", "resend", plan, size) == frozenset(plan.ranks)
    assert first_keepers("resend", "resend", plan, size) == frozenset()
    assert first_keepers("auto", "resend", plan, size, kv_memory_budget=0) == frozenset(
        r for r in plan.ranks if not got.get(r))                 # only ranks that receive nothing in wave 0
    assert all(b.owner != r for r, blocks in got.items() for b in blocks)


@pytest.mark.parametrize("resend", (False, True), ids=("keep", "resend"))
def test_a_buffered_send_completes_once_its_receiver_posts(resend):
    """gloo's isend completes only once the peer has posted the matching receive (measured on this
    machine: a 4 KiB .. 16 MiB send's wait returned 1.0 s after it was posted, when the receiver
    posted 1 s late), then the socket takes the bytes. So with ``buffered_sends`` a rank's wait on
    its own sends returns when the message starts (both ends posted), not when it arrives: every
    sender ends no earlier than its messages start (before, a rank could run ahead of a receiver
    that had not posted: rail 2x4 hierarchical broke this 8 times under keep), and no later than
    with sends waited until they arrive (NCCL)."""
    from megatron_fcp.cost.timeline import wave_timeline

    plan, topo, att, cm, size = _rail_2x4()
    waves = plan_waves(plan, size)
    job_s = lambda x, b: 1e-3 * (1 + (x + b.owner + b.chunk) % 3)  # noqa: E731  uneven work: ranks drift apart
    run = {b: wave_timeline(plan, waves, topo, kv_bytes=size, grad_bytes=size, job_s=job_s, resend=resend,
                            buffered_sends=b, trace=True) for b in (True, False)}
    ends = dict(zip(plan.ranks, run[True]["end_s"]))
    starts = [(m[3], m[5]) for m in run[True]["messages"]]        # (sender, both ends posted)
    assert starts and all(ends[src] >= start for src, start in starts)
    assert run[True]["total_s"] <= run[False]["total_s"]


# plan_waves of fixed plans, recorded before the 2026-12-06 speedups of the packing (raw packings,
# Wave objects for the winner only, readers dropped once their smallest delivery left no longer
# fits): the same waves, to the transfer and the delivery. Update a digest only when the packing's
# rule changes on purpose, and say why in the commit.
WAVES_DIGESTS = {
    ("packed", "entry"): "95e617f42bfa0951",
    ("packed", "hierarchical"): "f9dcadb34b812d7e",
    ("packed", "full"): "77d22b4cf4884324",
    ("zigzag", "hierarchical", 4): "eee4dd2f069f5d2c",
    ("zigzag", "full", 1): "d3c17a9c07577371",
}


def _waves_digest(waves) -> str:
    import hashlib

    h = hashlib.sha256()
    for w in waves:
        h.update(repr([(r, t.src, t.dst, t.block) for r, t in w.transfers]).encode())
        h.update(repr(sorted(w.computes)).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("case", list(WAVES_DIGESTS), ids=lambda c: "-".join(map(str, c)))
def test_waves_are_the_recorded_ones(case):
    """Packed plans of 107 blocks at cp = 16 (7 waves) and zigzag plans (17 waves): plan_waves
    gives the recorded waves, and they pass the invariants of :func:`_check`."""
    from megatron_fcp.contract.placement import lognormal_lengths

    if case[0] == "packed":
        pl = place_packed(lognormal_lengths(8.0, 1.2, 16 * 8192, 3), 16, block_tokens=2048)
        plan = build_plan("dgx-h100:2", range(16), case[1], placement=pl)
        size = lambda b: plan.block_tokens(b) * 4096  # noqa: E731
    else:
        plan = build_plan("pcie-box:2", range(16), case[1], parts_per_chunk=case[2])
        size = lambda b: plan.block_tokens(b, 65536) * 4096  # noqa: E731
    waves = plan_waves(plan, size)
    assert len(waves) > 1
    _check(plan, waves, size, wave_budget(plan, size))
    assert _waves_digest(waves) == WAVES_DIGESTS[case]


@pytest.mark.parametrize("builder", ("hierarchical", "entry", "ring"))
def test_waves_know_their_rows_of_the_plan(builder):
    """``Wave.plan_index`` (set by the packing, kept by ``first_fetch``) names each transfer's row of
    ``Plan.transfer_columns()``: ``wave_columns`` read through it equal the columns read from the
    wave's own transfers, and the wave floor is the same float either way."""
    from megatron_fcp.schedule.waves import Wave

    import numpy as np

    from megatron_fcp.cost.timeline import wave_timeline_floor
    from megatron_fcp.schedule.waves import first_fetch, wave_columns
    from megatron_fcp.topology import load_topology

    pl = place_packed([900, 40, 300, 170, 10, 3000, 77, 512], 8, block_tokens=64)
    plan = build_plan("dgx-h100:2", range(8), builder, placement=pl)
    size = lambda b: 10 * plan.block_tokens(b)  # noqa: E731
    waves = plan_waves(plan, size, budget=wave_budget(plan, size) // 2)
    assert len(waves) > 1
    kept = {x: [t.block for _, t in waves[0].transfers if t.dst == x][:1] for x in plan.ranks}
    for w in waves + (first_fetch(plan, waves[0], kept),):
        assert w.plan_index is not None and len(w.plan_index) == len(w.transfers)
        bare = Wave(w.transfers, w.computes, None, w.compute_index)
        assert bare == w                                        # a view, not part of the wave
        for a, b in zip(wave_columns(plan, w), wave_columns(plan, bare)):
            assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)
    topo = load_topology("dgx-h100:2")
    work = block_work(plan)
    for resend, fetch in ((True, None), (True, first_fetch(plan, waves[0], kept)), (False, None)):
        def floor(ws, fetch_wave):
            return wave_timeline_floor(plan, ws, topo, kv_bytes=size, grad_bytes=size,
                                       job_s=lambda x, b: 1e-9 * work(x, b), resend=resend,
                                       first_fetch=fetch_wave)
        fast = floor(waves, fetch)
        slow = floor(tuple(Wave(w.transfers, w.computes, None, w.compute_index) for w in waves),
                     None if fetch is None else Wave(fetch.transfers, fetch.computes, None, fetch.compute_index))
        assert fast == slow and fast > 0


@pytest.mark.parametrize("builder", ("hierarchical", "ring"))
@pytest.mark.parametrize("kv", ("resend", "keep"))
def test_the_wave_floor_sums_jobs_from_the_table_as_it_calls_them(builder, kv):
    """``wave_timeline_floor`` with ``job_seconds`` (the floor ``wave_backward_floor`` prices over a
    placement) and with a call per job (``loop_jobs``): the same float; the waves' compute columns
    are their computes."""
    import numpy as np

    from megatron_fcp.cost import backward as BK
    from megatron_fcp.cost import timeline as TL
    from megatron_fcp.schedule import program as P
    from megatron_fcp.schedule.waves import wave_compute_columns
    from megatron_fcp.topology import load_topology

    pl = place_packed([900, 40, 300, 170, 10, 3000, 77, 512, 64, 2048], 8, block_tokens=64)
    plan = build_plan("dgx-h100:2", range(8), builder, placement=pl)
    shape = AttentionShape(1, 32, 8, 128, 2)
    topo = load_topology("dgx-h100:2")
    program = P.compile_backward(plan, shape.kv_bytes(1), P.BackwardPolicy(kv),
                                 budget=wave_budget(plan, lambda b: plan.block_tokens(b) * shape.kv_bytes(1)) // 2)
    assert len(program.waves) > 1
    blocks = plan.blocks()
    for w in program.waves:
        cb, cx = wave_compute_columns(plan, w)
        assert sorted(zip((blocks[i] for i in cb.tolist()), cx.tolist())) == sorted(w.computes)
    cm = BK.ComputeModel()
    launch = cm.launch_s(BK.BACKWARD_FLOP_RATIO)
    work = BK._PairWork(plan, None, shape.pair_flops / cm.flops * BK.BACKWARD_FLOP_RATIO)
    size = lambda b: plan.block_tokens(b) * shape.kv_bytes(1)  # noqa: E731
    args = dict(kv_bytes=size, grad_bytes=size, job_s=BK._job_s(work, launch), resend=program.resend,
                first_kept=program.first_kept, first_fetch=program.first_fetch)
    seconds = BK._job_seconds(work, launch)
    assert seconds is not None
    pos, blk = np.repeat(np.arange(8), len(blocks)), np.tile(np.arange(len(blocks)), 8)
    assert seconds(pos, blk).tolist() == [BK._job_s(work, launch)(plan.ranks[p], blocks[b])
                                          for p, b in zip(pos.tolist(), blk.tolist())]
    called = TL.wave_timeline_floor(plan, program.waves, topo, **args)
    summed = TL.wave_timeline_floor(plan, program.waves, topo, job_seconds=seconds, **args)
    assert called > 0 and summed == called


@pytest.mark.parametrize("builder,parts", [("hierarchical", 1), ("ring", 2), ("entry", 1)])
def test_loop_jobs_run_received_blocks_then_own_ones_leading_own_first(builder, parts):
    """``loop_jobs`` (the executor's order, listed from ``loop_job_columns``) against the rule
    written out per rank: wave w's received blocks in plan order then its own in local order; wave
    0 runs ``leading_own_jobs`` of its own first and leaves the rest for the end; waves with and
    without their column views alike."""
    from megatron_fcp.schedule.waves import Wave

    from megatron_fcp.schedule import waves as W

    pl = place_packed([900, 40, 300, 170, 10, 3000, 77, 512, 64, 2048], 8, block_tokens=64)
    plans = [build_plan("dgx-h100:2", range(8), builder, placement=pl),
             build_plan("dgx-h100:2", range(16), builder, parts_per_chunk=parts)]
    for plan in plans:
        size = lambda b: 10 * plan.block_tokens(b, 4096)  # noqa: E731
        for budget in (wave_budget(plan, size), wave_budget(plan, size) // 3):
            waves = plan_waves(plan, size, budget)
            want_jobs, want_lead, want_last = {}, {}, {}
            for x in plan.ranks:
                want_jobs[x] = []
                for w, wave in enumerate(waves):
                    got = [t.block for _, t in wave.transfers if (t.block, t.dst) in wave.computes and t.dst == x]
                    own = [b for b in plan.local_blocks(x) if (b, x) in wave.computes]
                    if w == 0:
                        want_lead[x] = W.leading_own_jobs(len(own), len(waves))
                        want_last[x] = own[want_lead[x]:]
                        want_jobs[x].append(own[:want_lead[x]] + got)
                    else:
                        want_jobs[x].append(got + own)
                want_last.setdefault(x, [])
                want_lead.setdefault(x, 0)
            bare = tuple(Wave(w.transfers, w.computes) for w in waves)
            for ws in (waves, bare):
                assert W.loop_jobs(plan, ws) == (want_jobs, want_lead, want_last)


def test_waves_from_columns_are_the_waves_their_columns_name():
    """Note [Waves as columns]: a packed wave's transfers, computes and rounds, built on first read
    from its rows of the plan and its compute columns, are the plan's transfers at those rows and
    the computes those columns name; a wave built from them is equal (and hashes alike), and a
    pickled wave comes back equal without the plan."""
    import pickle

    import numpy as np

    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.schedule.waves import Wave, plan_transfer_pairs

    docs = lognormal_lengths(np.log(2048), 1.2, 16 * 2048, seed=7)
    plan = build_plan("dgx-h100:2", range(16), "hierarchical", placement=place_packed(docs, 16))
    size = lambda b: plan.block_tokens(b) * 1024  # noqa: E731
    waves = plan_waves(plan, size, wave_budget(plan, size) // 2)
    assert len(waves) > 1
    pairs, blocks, rounds_col = plan_transfer_pairs(plan), plan.blocks(), plan.transfer_columns()[0]
    for w in waves:
        fresh = Wave.of_plan(plan, w.plan_index, w.compute_index)
        assert fresh.rounds == tuple(sorted(set(rounds_col[w.plan_index].tolist())))   # read before any pairs
        assert fresh.transfers == tuple(pairs[k] for k in w.plan_index.tolist())
        numbers, ranks = w.compute_index
        assert fresh.computes == frozenset((blocks[i], x) for i, x in zip(numbers.tolist(), ranks.tolist()))
        eager = Wave(fresh.transfers, fresh.computes)
        assert eager == fresh and hash(eager) == hash(fresh) and eager.rounds == fresh.rounds
        back = pickle.loads(pickle.dumps(fresh))
        assert back == fresh and np.array_equal(back.plan_index, w.plan_index)
    with pytest.raises(ValueError, match="plan_index has"):
        Wave(waves[0].transfers, waves[0].computes, plan_index=np.zeros(len(waves[0].transfers) + 1, dtype=np.int64))


def _first_fetch_walk(wave, kept):
    """Note [Backward waves], "The first wave", over Transfer objects, written out: the transfers
    that go again, in plan order."""
    wanted, again = set(), []
    for r, t in reversed(wave.transfers):
        b, d = t.block, t.dst
        if b in set(kept.get(d, ())) or ((b, d) not in wave.computes and (b, d) not in wanted):
            continue
        again.append((r, t))
        if t.src != b.owner:
            wanted.add((b, t.src))
    return tuple(reversed(again))


@pytest.mark.parametrize("builder", ["hierarchical", "full", "entry"])
def test_the_first_waves_cut_is_the_rule_written_out(builder):
    """The first wave's re-sent part (``first_fetch``, an integer walk over the wave's columns) and
    what each rank keeps of it (``first_kept_blocks``) are the rule written out over Transfer
    objects, for several sets of keepers, from a wave of columns and from the same wave built from
    its transfers alike."""
    import numpy as np

    from megatron_fcp.contract.placement import lognormal_lengths
    from megatron_fcp.schedule import chains
    from megatron_fcp.schedule.waves import Wave, first_fetch

    docs = lognormal_lengths(np.log(4096), 1.2, 32 * 4096, seed=3)
    plan = build_plan("dgx-h100:4", range(32), builder, placement=place_packed(docs, 32))
    size = lambda b: plan.block_tokens(b) * 512  # noqa: E731
    wave = plan_waves(plan, size, wave_budget(plan, size))[0]
    built = Wave(wave.transfers, wave.computes)                  # no columns: read from its transfers
    kept = chains.first_kept_blocks(plan, size)
    walk: dict = {}
    seen: set = set()
    for _, t in wave.transfers:                                  # first_kept_blocks' rule, written out
        if (t.block, t.dst) in wave.computes and (t.block, t.dst) not in seen:
            seen.add((t.block, t.dst))
            walk.setdefault(t.dst, []).append(t.block)
    assert kept == {x: tuple(b) for x, b in walk.items()} and kept
    # their bytes: summed block by block, and read at once from BlockBytes (cached under a key)
    from megatron_fcp.schedule.waves import BlockBytes
    want_bytes = {x: sum(size(b) for b in bs) for x, bs in kept.items()}
    assert chains.first_kept_bytes(plan, size) == want_bytes
    assert chains.first_kept_bytes(plan, BlockBytes(plan, 512), cache_key="t") == want_bytes
    ranks = sorted(kept)
    for keepers in (ranks[::2], ranks[1::3], ranks[:1]):
        cut = {x: kept[x] for x in keepers}
        want = _first_fetch_walk(wave, cut)
        assert 0 < len(want) < len(wave.transfers)
        for source in (wave, built):
            got = first_fetch(plan, source, cut)
            assert got.transfers == want and got.computes == wave.computes
        assert np.array_equal(first_fetch(plan, wave, cut).plan_index,
                              [wave.plan_index[wave.transfers.index(x)] for x in want])


def test_a_wave_of_columns_does_not_keep_its_plan_alive():
    """Note [Waves as columns]: the wave caches hold waves of plans that may be gone, so a wave of
    columns holds its plan weakly; read after its plan is gone it says so."""
    import gc
    import weakref

    plan = build_plan("dgx-h100:2", range(8), "hierarchical",
                      placement=place_packed([900, 40, 300, 170, 10, 3000, 77, 512], 8, block_tokens=64))
    size = lambda b, p=plan: 10 * p.block_tokens(b)  # noqa: E731
    waves = plan_waves(plan, size, wave_budget(plan, size) // 2)
    assert len(waves) > 1 and all(w.transfers for w in waves[:-1])   # readable while the plan lives
    alive = weakref.ref(plan)
    del plan, size
    gc.collect()
    assert alive() is None
    with pytest.raises(RuntimeError, match="plan this wave's columns index is gone"):
        waves[-1].computes


@pytest.mark.parametrize("packed,parts", ((True, 1), (False, 1), (False, 3)))
def test_block_bytes_at_once_are_the_per_block_ones(packed, parts):
    """BlockBytes' array, block_sizes and own_block_bytes read every block at once; they are the
    per-block calls (Plan.block_tokens times the token bytes) in plan.blocks() order, exactly, on a
    packed plan and on a zigzag plan whose parts differ by a token; and every decision that reads
    them (the wave budget, the kept bytes, the keep-or-resend choice) is the per-block callable's."""
    from megatron_fcp.schedule.waves import (BlockBytes, block_sizes, choose_backward_kv, kept_bytes_per_rank,
                                             own_block_bytes)
    if packed:                                  # a placement's plan has one part per chunk
        pl = place_packed([5, 40, 3, 17, 1, 30, 9], 4, block_tokens=8)
        plan, seq_len = build_plan("dgx-h100:1", range(4), "hierarchical", placement=pl), None
    else:
        plan, seq_len = build_plan("dgx-h100:1", range(4), "full", parts_per_chunk=parts), 8 * 37 + 8
    fast = BlockBytes(plan, 12, seq_len)
    slow = lambda b: plan.block_tokens(b, seq_len) * 12  # noqa: E731   a plain callable: one call per block
    want = [slow(b) for b in plan.blocks()]
    assert fast.array().tolist() == want == block_sizes(plan, slow).tolist() == block_sizes(plan, fast).tolist()
    assert [fast(b) for b in plan.blocks()] == want
    assert not fast.array().flags.writeable
    assert own_block_bytes(plan, fast) == {r: sum(slow(b) for b in plan.local_blocks(r)) for r in plan.ranks}
    assert wave_budget(plan, fast) == wave_budget(plan, slow)
    assert kept_bytes_per_rank(plan, fast) == kept_bytes_per_rank(plan, slow)
    for budget in (-1, 0, 10**9):
        assert choose_backward_kv("auto", plan, fast, budget) == choose_backward_kv("auto", plan, slow, budget)
    other = build_plan("dgx-h100:1", range(4), "ring", parts_per_chunk=parts, placement=pl if packed else None)
    assert block_sizes(other, fast).tolist() == [fast(b) for b in other.blocks()]   # another plan: per block
