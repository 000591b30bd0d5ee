"""The tile-priced compute model (ComputeModel.tiled; Note [Cost model], compute by tiles) is one
pricing: the cost model's blocks, TE's calls, the floors and the emulator's sleep kernel agree on
the same call shapes. Relations, not timings."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatron_fcp.contract.mask import CAUSAL, FULL
from megatron_fcp.cost.model import (
    KERNEL_CALIBRATIONS,
    AttentionShape,
    ComputeModel,
    simulate_plan,
    zigzag_block_work,
)
from megatron_fcp.cost.te import te_ring_steps_s
from megatron_fcp.cost.tiles import calls_time, zigzag_calls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TILED = ComputeModel.tiled("h200-fa2")
SHAPE = AttentionShape(8192, 32, 8, 128, 2)


def test_the_named_calibration_is_the_committed_fit():
    with open(os.path.join(ROOT, "benchmarks", "results", "tile_fit.json"), encoding="utf-8") as fh:
        fit = json.load(fh)["h200"]
    cal = KERNEL_CALIBRATIONS["h200-fa2"]
    for phase, costs in (("fwd", cal.fwd), ("bwd", cal.bwd)):
        for k, v in fit[phase]["constants"].items():
            assert getattr(costs, k) == v, (phase, k)


def test_a_16_token_chunk_costs_a_whole_tile():
    one_tile = TILED.work_s(128, 0, 128, 0, SHAPE, FULL, merged=False)
    assert TILED.work_s(16, 0, 16, 0, SHAPE, FULL, merged=False) == one_tile > 0
    # the FLOP model charges it 1/64 of the tile's pairs
    flops = ComputeModel()
    assert flops.work_s(16, 0, 16, 0, SHAPE, FULL) * 64 == pytest.approx(flops.work_s(128, 0, 128, 0, SHAPE, FULL))
    # a causal 16-token chunk is one partial tile pair; four whole-tile documents of 128 cost 4x one
    assert TILED.work_s(16, 0, 16, 0, SHAPE, CAUSAL, merged=False) < one_tile
    with pytest.raises(ValueError, match="work_s"):
        TILED.time(100, SHAPE)
    with pytest.raises(ValueError, match="unknown"):
        ComputeModel.tiled("no-such-gpu")


def test_zigzag_blocks_are_the_calls_the_fit_counted():
    """zigzag_block_work over every (rank, chunk) block is tiles.zigzag_calls priced by the same
    constants (launches aside): the planner's blocks and the fit's calls are one geometry."""
    seq, cp = 8192, 4
    shape = AttentionShape(seq, 32, 8, 128, 2)
    q, o, c = np.meshgrid(np.arange(cp), np.arange(cp), np.arange(2), indexing="ij")
    model = zigzag_block_work(TILED, shape, cp, 1, q, o, c, 0, CAUSAL).sum()
    calls = zigzag_calls(seq, cp)
    fwd = KERNEL_CALIBRATIONS["h200-fa2"].fwd
    assert model == pytest.approx(calls_time(fwd, calls, 32) - len(calls) * fwd.launch_s, rel=1e-12)
    # the FLOP model's form is its pairs at its rate, as before tiles
    flops = ComputeModel()
    pairs = zigzag_block_work(flops, shape, cp, 1, q, o, c, 0, CAUSAL).sum() / flops.pair_s(shape)
    assert pairs == pytest.approx(CAUSAL.pairs(0, seq, 0, seq))


def test_sub_blocks_cost_more_by_tiles_and_the_same_by_flops():
    """Splitting chunks into parts leaves the FLOP model's work as it is and adds tiles (query tiles
    paid per call, key tiles cut): the planner sees the price of its sub-blocks."""
    cp = 4
    q, o, c = (x.ravel() for x in np.meshgrid(np.arange(cp), np.arange(cp), np.arange(2), indexing="ij"))
    for cm, more in ((ComputeModel(), False), (TILED, True)):
        whole = zigzag_block_work(cm, SHAPE, cp, 1, q, o, c, np.zeros_like(q), CAUSAL).sum()
        parts = sum(zigzag_block_work(cm, SHAPE, cp, 4, q, o, c, np.full_like(q, p), CAUSAL).sum() for p in range(4))
        assert (parts > whole * (1 + 1e-9)) if more else parts == pytest.approx(whole)


def test_the_cost_model_prices_a_plan_with_its_blocks_calls():
    """simulate_plan's compute under tiles is the busiest rank's kernel calls plus one launch each:
    the executor's calls (Note [One launch per owner and stage]), a call on several blocks priced as
    that call (call_work_s: its keys joined into runs), never above its blocks priced one by one."""
    from megatron_fcp.contract.plan import Plan  # noqa: F401  (the plan below is a compiled one)
    from megatron_fcp.cost.model import call_work_s
    from megatron_fcp.planner.builders import build_graph
    from megatron_fcp.planner.compile import compile_plan
    from megatron_fcp.schedule.launches import forward_launches
    from megatron_fcp.topology import load_topology

    topo = load_topology("dgx-h100:1")
    plan = compile_plan(build_graph(topo, range(4), "full"), True)
    res = simulate_plan(plan, topo, SHAPE, compute_model=TILED)
    L = SHAPE.seq_len // 8
    busy = []
    for r in range(4):
        calls = [call for call in zigzag_calls(SHAPE.seq_len, 4) if call.q0 in (r * L, (7 - r) * L)]
        per_block = sum(TILED.work_s(x.rows, x.q0, x.keys, x.k0, SHAPE, CAUSAL) for x in calls)
        q_runs = [(0, r * L, (r + 1) * L), (0, (7 - r) * L, (8 - r) * L)]
        grouped = [call_work_s(TILED, SHAPE, q_runs, [(0, g * L, (g + 1) * L) for g in
                                                      (b.owner if b.chunk == 0 else 7 - b.owner for b in blocks)],
                               CAUSAL) for _, blocks in forward_launches(plan, r)]
        assert sum(grouped) <= per_block + 1e-12
        busy.append(sum(grouped) + len(grouped) * TILED.launch_s())
    assert res.compute_s == pytest.approx(max(busy), rel=1e-12)
    assert res.compute_s > simulate_plan(plan, topo, SHAPE).compute_s * 0.5


def test_te_ring_steps_are_the_calls_of_te():
    """TE's ring under tiles: step 0 the rank's two chunks causal, later steps full-mask calls on
    whole chunks (zigzag) or each document's real tokens (THD), padding not computed."""
    cp, seq = 4, 8192
    L = seq // (2 * cp)
    steps = te_ring_steps_s(TILED, SHAPE, [seq], cp, 1, True)
    launch = TILED.launch_s()
    assert len(steps) == cp
    assert steps[0] == pytest.approx(TILED.work_s(2 * L, 0, 2 * L, 0, SHAPE, CAUSAL) + launch)
    later = max(TILED.work_s(2 * L, 10 ** 6, L, 0, SHAPE, FULL), TILED.work_s(L, 10 ** 6, 2 * L, 0, SHAPE, FULL))
    assert all(s == pytest.approx(later + launch) for s in steps[1:])
    # THD at cp = 64: a 2K-token document is 16-token chunks, each a whole tile pair per call
    docs = [2048] * 8
    thd = te_ring_steps_s(TILED, SHAPE, docs, 64, 1, True)
    tile16 = TILED.work_s(16, 10 ** 6, 16, 0, SHAPE, FULL)
    assert thd[1] == pytest.approx(8 * max(TILED.work_s(32, 10 ** 6, 16, 0, SHAPE, FULL),
                                           TILED.work_s(16, 10 ** 6, 32, 0, SHAPE, FULL)) + launch)
    assert tile16 == TILED.work_s(128, 10 ** 6, 128, 0, SHAPE, FULL) - TILED.tile_costs(SHAPE).merge_s * 32 * 112
    # FCP keeps a 2K document whole on one rank (8 documents, 64 ranks: a rank computes at most one):
    # its busiest rank's call is far cheaper than TE's every rank's 64 steps of 16-token chunks
    whole = TILED.work_s(2048, 0, 2048, 0, SHAPE, CAUSAL)
    assert 4 * whole < sum(thd) - 64 * launch


def test_te_schedules_price_with_the_tiled_model():
    from megatron_fcp.cost import te

    for fn in (te.simulate_te_p2p, te.simulate_te_a2a_p2p):
        flops = fn("dgx-h100:2", range(16), SHAPE)
        tiled = fn("dgx-h100:2", range(16), SHAPE, compute_model=TILED)
        assert tiled.comm_s == flops.comm_s and tiled.compute_s != flops.compute_s
        assert tiled.total_s >= max(tiled.comm_s, tiled.compute_s) * (1 - 1e-12)
    docs = [3000, 700, 129, 4096]
    for fn in (te.simulate_te_p2p_thd, te.simulate_te_a2a_p2p_thd):
        for backward in (False, True):
            r = fn("dgx-h100:2", range(16), docs, SHAPE, compute_model=TILED, backward=backward)
            assert r.total_s >= r.compute_s > 0


# ---- floors stay below the priced totals under tiles (Note [Backward floors]) -----------------------

@pytest.mark.parametrize("preset,cp,heads,kv,seq", [("dgx-h100:1", 8, 32, 8, 16384), ("pcie-box:2", 8, 32, 8, 8192)])
def test_floors_never_exceed_the_tiled_total(preset, cp, heads, kv, seq):
    from megatron_fcp.contract.head_parallel import head_parallel_degrees
    from megatron_fcp.cost.head_parallel import HeadParallelPricing, degree_floor
    from megatron_fcp.planner.head_parallel import compile_head_parallel
    from megatron_fcp.schedule.program import WaveBackward
    from megatron_fcp.topology import load_topology

    topo = load_topology(preset)
    shape = AttentionShape(seq, heads, kv, 128, 2)
    for backward in (None, WaveBackward()):
        for a in head_parallel_degrees(topo, range(cp), heads, kv):
            lo = degree_floor(topo, range(cp), shape, a, backward=backward, compute_model=TILED)
            for graph in ("ring", "hierarchical"):
                for opts in ({}, {"parts_per_chunk": 2} if a == 1 else {"stagger": 2}):
                    if a == cp and opts:
                        continue
                    hp = compile_head_parallel(topo, range(cp), shape, a, graph, **opts)
                    pr = HeadParallelPricing(hp, topo, shape, backward=backward, compute_model=TILED)
                    total = pr.result().total_s
                    assert lo <= pr.floor() <= pr.tight_floor() <= total, (a, graph, opts)


def test_the_pruned_search_finds_the_full_answer_under_tiles():
    from megatron_fcp.cost.model import pick_best
    from megatron_fcp.planner.choose import choose_schedule, head_parallel_candidates
    from megatron_fcp.schedule.program import WaveBackward

    shape = AttentionShape(16384, 32, 8, 128, 2)
    kw = dict(backward=WaveBackward(), compute_model=TILED)
    full = head_parallel_candidates("dgx-h100:1", range(8), shape, **kw)
    best, _ = pick_best(full, "total")
    choice = choose_schedule("dgx-h100:1", range(8), shape, **kw)
    assert choice.label == best.meta["label"] and choice.total_s == best.total_s


def test_packed_floors_under_tiles():
    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.cost.backward import simulate_plan_backward
    from megatron_fcp.cost.floors import compute_floor
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.topology import load_topology

    topo = load_topology("dgx-h100:1")
    docs = [5000, 300, 16, 1200, 2048, 900]
    pl = place_packed(docs, 4, block_tokens=1024)
    plan = build_plan(topo, range(4), "full", placement=pl)
    shape = AttentionShape(sum(docs), 32, 8, 128, 2)
    fwd = simulate_plan(plan, topo, shape, compute_model=TILED)
    bwd = simulate_plan_backward(plan, topo, shape, compute_model=TILED)
    assert compute_floor(pl, 4, shape, pl.mask, TILED, 1.0, launches=True) <= fwd.compute_s
    assert compute_floor(pl, 4, shape, pl.mask, TILED, 2.5, launches=True) <= bwd.compute_s


# ---- the emulator's sleep kernel sleeps what the model prices -------------------------------------

def test_the_sleep_kernel_sleeps_the_tile_priced_block():
    """SleepKernel with a tiled model: rank r's two zigzag chunks on one block cost what
    zigzag_block_work prices plus one launch, forward and backward; a packed call's documents are
    priced per document run."""
    import torch

    from megatron_fcp.emulate.sleep_kernel import SleepKernel, VirtualStream, call_runs

    seq, cp, h, h_kv, d = 4096, 4, 4, 2, 16
    shape = AttentionShape(seq, h, h_kv, d, 2)
    L = seq // (2 * cp)
    for r, owner, chunk in ((0, 0, 0), (2, 1, 1), (3, 0, 1), (1, 3, 0)):
        q_pos = torch.cat([torch.arange(r * L, (r + 1) * L), torch.arange((7 - r) * L, (8 - r) * L)])
        g = owner if chunk == 0 else 2 * cp - 1 - owner
        k_pos = torch.arange(g * L, (g + 1) * L)
        q, k = torch.zeros(2 * L, 1, h, d), torch.zeros(L, 1, h_kv, d)
        for backward, ratio in ((False, 1.0), (True, 2.5)):
            kern = SleepKernel(1e12, stream=VirtualStream(), compute_model=TILED)
            if backward:
                kern.backward(q, q, k, k, q, None, q_pos, k_pos, True, 1.0)
            else:
                kern.forward(q, k, k, q_pos, k_pos, True, 1.0)
            want = float(zigzag_block_work(TILED, shape, cp, 1, r, owner, chunk, 0, CAUSAL, ratio))
            assert kern.modelled_s == pytest.approx(want + TILED.launch_s(ratio) if want else 0.0, rel=1e-12)
    pos, doc = torch.tensor([0, 1, 2, 0, 1, 5, 6]), torch.tensor([0, 0, 0, 1, 1, 1, 1])
    assert call_runs(pos, doc) == [(0, 0, 3), (1, 0, 2), (1, 5, 2)]
    with pytest.raises(ValueError, match="tiled"):
        SleepKernel(1e12, compute_model=ComputeModel())


def test_the_emulated_compute_model_is_the_calibration_stretched():
    from megatron_fcp.emulate.bench import BenchConfig
    from megatron_fcp.emulate.spec import ClusterSpec
    from megatron_fcp.emulate.workloads import WorkloadShape

    cluster = ClusterSpec(2, 2)
    shape = WorkloadShape(8192, 8, 2, 32, True)
    flops = BenchConfig(cluster, shape).compute_model()
    tiled = BenchConfig(cluster, shape, kernel="h200-fa2").compute_model()
    assert flops.kernel is None and tiled.launch_s() == tiled.launch_s(2.5) == 0.0
    att = shape.attention()
    s = cluster.time_scale
    assert tiled.work_s(300, 0, 300, 0, att, CAUSAL) == pytest.approx(s * TILED.work_s(300, 0, 300, 0, att, CAUSAL))
    with pytest.raises(ValueError, match="kernel-model"):
        BenchConfig(cluster, shape, kernel="nope")


# ---- block size from the kernel model (issue 28 item 5) ---------------------------------------------

def test_block_tokens_come_from_the_kernel_model():
    from megatron_fcp.contract.placement import DEFAULT_BLOCK_TOKENS
    from megatron_fcp.cost.model import FLOP_MODEL_BLOCK_TOKENS, block_efficiency, kernel_block_tokens

    assert kernel_block_tokens(ComputeModel(), SHAPE) == FLOP_MODEL_BLOCK_TOKENS == DEFAULT_BLOCK_TOKENS
    n = kernel_block_tokens(TILED, SHAPE)
    assert n == 4096 and block_efficiency(TILED, n, SHAPE) >= 0.8 > block_efficiency(TILED, n // 2, SHAPE)
    # efficiency rises with size; a stricter target asks for larger blocks; fewer heads amortise less
    effs = [block_efficiency(TILED, t, SHAPE) for t in (256, 1024, 4096, 16384)]
    assert effs == sorted(effs) and effs[-1] < 1
    assert kernel_block_tokens(TILED, SHAPE, 0.9) > n
    assert kernel_block_tokens(TILED, AttentionShape(1, 8, 8, 128)) == 2 * n   # fewer heads: launches dearer
    with pytest.raises(ValueError, match="efficiency"):
        kernel_block_tokens(TILED, SHAPE, 1.0)


def test_key_runs_take_a_call_in_position_order():
    """Rows and keys go to the fused kernels sorted by (document, position) (item 6 of the note in
    megatron_fcp.attention.fused): zigzag chunks of one sequence, rank by rank, are one run."""
    from megatron_fcp.cost.model import key_runs

    cp, L = 4, 8
    chunks = [c for j in range(cp) for c in (j, 2 * cp - 1 - j)]
    assert key_runs([(0, c * L, (c + 1) * L) for c in chunks]) == [(0, 0, 2 * cp * L)]
    assert key_runs([(1, 5, 9), (0, 0, 4), (1, 0, 5)]) == [(0, 0, 4), (1, 0, 9)]
    assert key_runs([(0, 0, 4), (0, 8, 12)]) == [(0, 0, 4), (0, 8, 12)]


@pytest.mark.parametrize("seq", [32768, 131072])
def test_head_parallel_at_a_equal_cp_prices_as_te_ulysses_under_tiles(seq):
    """One node, a = cp: FCP's stage is one causal call over the whole sequence per rank, as TE's
    a2a runs it, and no LSE merge (the plan has no rounds): the same price within 0.1%."""
    from megatron_fcp.cost.head_parallel import simulate_te
    from megatron_fcp.cost.model import AttentionShape, ComputeModel
    from megatron_fcp.planner.choose import head_parallel_candidates

    cm = ComputeModel.tiled("h200-fa2")
    shape = AttentionShape(seq, 32, 8, 128, 2)
    (res, hp), = head_parallel_candidates("dgx-h100:1", range(8), shape, compute_model=cm, degree=8)
    te = simulate_te("te-a2a-p2p", "dgx-h100:1", range(8), shape, compute_model=cm)
    assert hp.kv_plan is None
    assert res.total_s == pytest.approx(te.total_s, rel=1e-3)
