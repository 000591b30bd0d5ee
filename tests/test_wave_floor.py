"""The wave loop's floor (Note [Wave timeline floor] in megatron_fcp/cost/timeline.py) is a lower
bound on the wave timeline for every plan shape the executor runs in waves, and it sees what the
resource and compute floors cannot: a wave's sends queued behind one sender's NIC."""

from __future__ import annotations

import pytest

from megatron_fcp.contract.placement import lognormal_lengths, place_packed
from megatron_fcp.cost.backward import simulate_backward_waves, wave_backward_floor
from megatron_fcp.cost.floors import compute_floor, reduction_floor
from megatron_fcp.cost.model import AttentionShape, ComputeModel
from megatron_fcp.planner.build import build_plan
from megatron_fcp.topology import load_topology

ZIGZAG = [("dgx-h100:2", 16, "hierarchical", 1), ("dgx-h100:2", 16, "full", 2), ("pcie-box:2", 16, "leader", 1),
          ("single-uplink:2", 16, "spanning", 2), ("dgx-a100:1", 8, "full", 4)]


def _both(plan, topo, shape, **kw):
    floor = wave_backward_floor(plan, topo, shape, **kw)
    priced = simulate_backward_waves(plan, topo, shape, **kw)
    return floor, priced


@pytest.mark.parametrize("preset,cp,graph,parts", ZIGZAG)
@pytest.mark.parametrize("mode", ["auto", "keep", "resend"])
@pytest.mark.parametrize("buffered", [False, True], ids=["nccl", "gloo"])
def test_the_wave_floor_never_exceeds_the_wave_timeline(preset, cp, graph, parts, mode, buffered):
    """Zigzag plans of every wave-running builder, sub-blocks, each KV mode (auto keeps the first
    wave), NCCL's and gloo's send completion: floor <= timeline, and at least the busiest
    rank's compute (launches aside)."""
    shape = AttentionShape(65536, 32, 8, 128, 2)
    plan = build_plan(preset, range(cp), graph, parts_per_chunk=parts)
    floor, priced = _both(plan, preset, shape, backward_kv=mode, buffered_sends=buffered, round_overhead_s=2e-6)
    assert priced["backward"] == "waves" and floor is not None
    assert floor <= priced["bwd_s"] * (1 + 1e-12)
    cm = ComputeModel()
    assert floor >= compute_floor(None, cp, shape, True, cm, 2.5) * (1 - 1e-9)


@pytest.mark.parametrize("mode", ["auto", "resend"])
def test_the_wave_floor_bounds_packed_and_windowed_plans(mode):
    """A packed placement (first waves kept by some ranks only, re-sent for the others) and a
    sliding window: floor <= timeline."""
    lengths = lognormal_lengths(8.0, 1.2, 16384 * 16, 1)
    pl = place_packed(lengths, 16, block_tokens=2048)
    plan = build_plan("dgx-h100:2", range(16), "hierarchical", placement=pl)
    shape = AttentionShape(1, 32, 8, 128, 2)
    floor, priced = _both(plan, "dgx-h100:2", shape, backward_kv=mode)
    assert floor is not None and floor <= priced["bwd_s"] * (1 + 1e-12)
    windowed = build_plan("dgx-h100:2", range(16), "full", parts_per_chunk=2, seq_len=65536, window=(8192, 0))
    floor, priced = _both(windowed, "dgx-h100:2", AttentionShape(65536, 32, 8, 128, 2), backward_kv=mode)
    assert floor is not None and floor <= priced["bwd_s"] * (1 + 1e-12)


@pytest.mark.slow
def test_the_wave_floor_sees_a_senders_queue_and_chains_have_none():
    """cp = 64 hierarchical with sub-blocks, MHA at 128K: each wave's blocks leave a few owners'
    NICs, so the waves run near one sender's queue each. The floor is far above the compute and
    reduction floors (the bounds the search had before) and within a factor of two of the
    timeline; a ring streams as chains and has no wave floor."""
    shape = AttentionShape(131072, 32, 32, 128, 2)
    plan = build_plan("dgx-h100:8", range(64), "hierarchical", parts_per_chunk=4)
    floor, priced = _both(plan, "dgx-h100:8", shape)
    cm = ComputeModel()
    others = max(compute_floor(None, 64, shape, True, cm, 2.5, launches=True),
                 reduction_floor(plan, load_topology("dgx-h100:8"), shape, 2))
    assert 2 * others < floor <= priced["bwd_s"] < 2 * floor
    ring = build_plan("dgx-h100:2", range(16), "ring")
    assert wave_backward_floor(ring, "dgx-h100:2", AttentionShape(65536, 32, 8, 128, 2)) is None


@pytest.mark.parametrize("preset,cp,graph,parts", ZIGZAG[:3])
def test_a_ranks_jobs_are_the_computes_its_waves_run(preset, cp, graph, parts):
    """``rank_jobs`` (the per-job launches of a backward in waves, counted before packing) is each
    rank's number of gradient jobs in the packed waves, and the compute floor with those launches
    is at most the wave timeline."""
    from megatron_fcp.cost.floors import rank_jobs
    from megatron_fcp.schedule.waves import plan_waves

    shape = AttentionShape(65536, 32, 8, 128, 2)
    plan = build_plan(preset, range(cp), graph, parts_per_chunk=parts)
    waves = plan_waves(plan, lambda b: plan.block_tokens(b, 65536) * shape.kv_bytes(1))
    jobs = rank_jobs(plan, 65536)
    assert [sum(x == r for w in waves for _, x in w.computes) for r in plan.ranks] == jobs.tolist()
    cm = ComputeModel()
    floor = compute_floor(None, cp, shape, True, cm, 2.5, launches=jobs)
    assert compute_floor(None, cp, shape, True, cm, 2.5, launches=True) <= floor
    assert floor <= simulate_backward_waves(plan, preset, shape)["bwd_s"] * (1 + 1e-12)


@pytest.mark.parametrize("preset,cp,graph,parts", ZIGZAG + [("pcie-box:2", 16, "hierarchical", 4)])
@pytest.mark.parametrize("mode", ["auto", "keep", "resend"])
def test_the_resend_floor_counts_kv_again_and_stays_below_the_timeline(preset, cp, graph, parts, mode):
    """Before packing, a backward in waves that re-sends KV carries every reader delivery's KV
    again, less what its receivers may keep (resend_keep_limits): the reduction floor with that
    term is at least the partials' alone, equal to it under keep (nothing re-sent), and below
    the wave timeline in every KV mode."""
    from megatron_fcp.schedule.program import WaveBackward, resend_keep_limits

    shape = AttentionShape(65536, 32, 8, 128, 2)
    topo = load_topology(preset)
    plan = build_plan(preset, range(cp), graph, parts_per_chunk=parts)
    kv_tok = shape.kv_token_elems * shape.dtype_bytes
    limits = resend_keep_limits(plan, kv_tok, WaveBackward(backward_kv=mode), seq_len=shape.seq_len)
    if mode == "keep":
        assert limits is None                                  # nothing re-sent
    if mode == "resend":
        assert set(limits.values()) == {0}                     # an explicit resend keeps nothing
    if mode == "auto" and limits is not None:                  # re-sending: each rank may keep up to its own shard
        assert all(v == sum(plan.block_tokens(b, shape.seq_len) for b in plan.local_blocks(r)) * kv_tok
                   for r, v in limits.items())
    partials = reduction_floor(plan, topo, shape, 2)
    both = reduction_floor(plan, topo, shape, 2, resend_limits=limits)
    assert both >= partials
    if limits is None:
        assert both == partials
    if mode == "resend":
        assert both > partials                                 # the KV again adds to some resource
    priced = simulate_backward_waves(plan, topo, shape, backward_kv=mode)
    assert priced["backward"] == "waves" and both <= priced["bwd_s"] * (1 + 1e-12)


@pytest.mark.parametrize("graph", ["ring", "hierarchical", "entry", "full"])
@pytest.mark.parametrize("mode", ["auto", "keep", "resend"])
@pytest.mark.parametrize("size", ["large", "tiny"])
def test_the_jobs_floor_holds_before_any_wave_is_packed(graph, mode, size):
    """``backward_compute_floor`` (the busiest rank's backward work, and its launches: once per job
    in waves, once per owner for a chain) is below the backward as priced, in waves or as chains
    (``ring``, whose steps launch several jobs at once: with tiny blocks the launches are most of a
    job), by FLOPs and by tiles, and below the wave floor where the backward runs in waves; it
    reads no program (none is compiled for it)."""
    from megatron_fcp.cost.floors import backward_compute_floor
    from megatron_fcp.cost.model import BACKWARD_FLOP_RATIO
    from megatron_fcp.schedule.chains import is_chain_plan
    from megatron_fcp.schedule.program import compiled_programs

    topo = load_topology("dgx-h100:2")
    if size == "large":
        shape, docs, block = AttentionShape(1, 32, 8, 128, 2), lognormal_lengths(8.5, 1.0, 16 * 8192, seed=4), 4096
    else:
        shape, docs, block = AttentionShape(1, 8, 2, 16, 2), lognormal_lengths(5.0, 1.0, 4096, seed=4), 64
    plan = build_plan(topo, range(16), graph, placement=place_packed(docs, 16, block_tokens=block))
    waves = not is_chain_plan(plan)
    assert waves == (graph != "ring")
    floors = {cm: backward_compute_floor(plan, shape, cm, BACKWARD_FLOP_RATIO, waves=waves)
              for cm in (ComputeModel(), ComputeModel.tiled())}
    assert all(f > 0 for f in floors.values()) and not compiled_programs(plan)
    for cm, jobs in floors.items():
        floor, priced = _both(plan, topo, shape, backward_kv=mode, compute_model=cm)
        assert jobs <= priced["bwd_s"]
        if waves:
            assert jobs <= floor
