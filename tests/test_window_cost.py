"""Sliding windows on the cost model: work from the window's pairs, TE's refusals and the schedules
it does run (a2a, all_gather), the halo ring, bounds on need sets, ``simulate --window``."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.needs import block_pairs
from megatron_fcp.contract.plan import full_plan, halo_plan
from megatron_fcp.cost.backward import simulate_plan_backward
from megatron_fcp.cost.floors import rank_pairs
from megatron_fcp.cost.model import AttentionShape, simulate_plan
from megatron_fcp.cost.te import (
    lower_bound,
    simulate_halo_ring,
    simulate_te_a2a,
    simulate_te_a2a_p2p,
    simulate_te_a2a_p2p_thd,
    simulate_te_all_gather,
    simulate_te_p2p,
    simulate_te_p2p_thd,
)
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.compare import compare_window

SHAPE = AttentionShape(65536, 32, 8, 128)


@pytest.mark.parametrize("window", [(100, 0), (4096, 0), (5000, 0)])
@pytest.mark.parametrize("P", [1, 3])
def test_every_visible_pair_is_priced_once(window, P):
    cp, S = 8, 2 * 8 * 1000
    mask = Mask(True, *window)
    q, o, c, p = np.meshgrid(range(cp), range(cp), (0, 1), range(P), indexing="ij")
    assert block_pairs(cp, S, P, q, o, c, p, mask).sum() == mask.pairs(0, S, 0, S)
    assert rank_pairs(None, cp, S, mask).sum() == mask.pairs(0, S, 0, S)
    plan = full_plan(range(cp), True, P, window=window, seq_len=S)
    got = sum(int(block_pairs(cp, S, P, plan.cp_index(t.dst), plan.cp_index(t.block.owner), t.block.chunk,
                              t.block.part, mask)) for _, t in plan.transfers())
    own = sum(int(block_pairs(cp, S, P, j, j, cc, pp, mask)) for j in range(cp) for cc in (0, 1) for pp in range(P))
    assert got + own == mask.pairs(0, S, 0, S)  # the plan delivers exactly the blocks with work


def test_windowed_plans_price_less_work_and_bytes():
    shape = SHAPE
    plain = build_plan("dgx-h100:2", range(16), "full", seq_len=shape.seq_len)
    win = build_plan("dgx-h100:2", range(16), "full", window=(1024, 0), seq_len=shape.seq_len)
    a, b = simulate_plan(plain, "dgx-h100:2", shape), simulate_plan(win, "dgx-h100:2", shape)
    assert b.compute_s < a.compute_s / 4 and b.bytes < a.bytes / 4
    bw = simulate_plan_backward(win, "dgx-h100:2", shape)
    assert bw.total_s < simulate_plan_backward(plain, "dgx-h100:2", shape).total_s
    lb = lower_bound("dgx-h100:2", range(16), shape, causal=True, window=(1024, 0))
    assert lb["lower_bound_s"] <= b.comm_s * (1 + 1e-9)
    assert lb["lower_bound_s"] < lower_bound("dgx-h100:2", range(16), shape, causal=True)["lower_bound_s"]


def test_a_plan_priced_on_another_length_is_refused():
    plan = full_plan(range(4), True, window=(8, 0), seq_len=64)
    with pytest.raises(ValueError, match="built for seq_len=64"):
        simulate_plan(plan, "dgx-h100:1", AttentionShape(128, 8, 8, 64))


def test_te_refuses_windows_on_p2p_and_a2a_p2p():
    for fn in (simulate_te_p2p, simulate_te_a2a_p2p):
        with pytest.raises(ValueError, match="refuses a sliding window"):
            fn("dgx-h100:2", range(16), SHAPE, window=(128, 0))
        fn("dgx-h100:2", range(16), SHAPE, window=None)  # no window: priced as before
    for fn in (simulate_te_p2p_thd, simulate_te_a2a_p2p_thd):
        with pytest.raises(ValueError, match="refuses a sliding window"):
            fn("dgx-h100:2", range(16), [40000, 25536], SHAPE, window=(128, 0))


def test_te_a2a_needs_heads_divisible_by_cp():
    with pytest.raises(ValueError, match="must divide by the CP size 16"):
        simulate_te_a2a("dgx-h100:2", range(16), AttentionShape(65536, 64, 8, 64), window=(128, 0))
    r = simulate_te_a2a("dgx-h100:1", range(8), AttentionShape(65536, 64, 8, 64), window=(128, 0))
    assert r.rounds == 2 and r.total_s == pytest.approx(r.comm_s + r.compute_s)


def test_te_schedules_price_the_windows_work():
    for fn in (simulate_te_a2a, simulate_te_all_gather):
        narrow = fn("dgx-h100:1", range(8), SHAPE, window=(512, 0))
        causal = fn("dgx-h100:1", range(8), SHAPE)
        assert narrow.compute_s < causal.compute_s / 8
        assert narrow.bytes == causal.bytes  # TE moves the same bytes whatever the window
        bwd = fn("dgx-h100:1", range(8), SHAPE, window=(512, 0), backward=True)
        assert bwd.compute_s > 2 * narrow.compute_s


def test_halo_ring_moves_only_neighbour_chunks():
    cp, S = 16, SHAPE.seq_len
    chunk = S // (2 * cp)
    for W in (chunk // 2, chunk, 2 * chunk + 1):
        plan = halo_plan(range(cp), True, window=(W, 0), seq_len=S)
        reach = -(-W // chunk)
        for _, t in plan.transfers():
            d = abs(plan.cp_index(t.src) - plan.cp_index(t.dst))
            assert min(d, cp - d) <= reach
        r = simulate_halo_ring("dgx-h100:2", range(cp), SHAPE, window=(W, 0))
        assert r.bytes == pytest.approx(plan.num_transfers() * SHAPE.kv_bytes(chunk))


@pytest.mark.parametrize("cp,W,heads,kv", [(8, 128, 64, 8), (16, 1024, 32, 16), (16, 4096, 32, 16)])
def test_fcp_on_a_windowed_layer(cp, W, heads, kv):
    shape = AttentionShape(131072, heads, kv, 64 if heads == 64 else 128)
    out = compare_window(f"dgx-h100:{cp // 8}", None, shape, window=(W, 0), parts_per_chunk=1)
    s = out["schedules"]
    assert "refused" in s["te-p2p"] and "refused" in s["te-a2a-p2p"]
    assert s["fcp"]["bytes_over_exact"] <= 1.05
    assert out["a2a_bytes_over_fcp"] >= 3
    assert out["fcp_vs_best_te"] >= 1
    assert s["fcp"]["fwd_bwd"]["total_s"] <= s["halo-ring"]["fwd_bwd"]["total_s"] * (1 + 1e-9)


def test_simulate_window_cli():
    cmd = [sys.executable, "-m", "megatron_fcp.cli", "simulate", "dgx-h100:1", "--seq", "64k", "--heads", "64",
           "--kv-heads", "8", "--head-dim", "64", "--window", "128,0"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "te-a2a" in text and "te-all-gather" in text and "halo-ring" in text and "refused" in text
    out = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True).stdout)
    assert out["window"] == [128, 0] and "refused" in out["schedules"]["te-p2p"]
    assert out["schedules"]["fcp"]["fwd_bwd"]["total_s"] > 0
    bad = subprocess.run(cmd[:-1] + ["128"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--window" in bad.stderr


def test_choose_schedule_plans_a_windowed_layer_with_its_own_plan():
    from megatron_fcp.contract.blocks import PlanError
    from megatron_fcp.planner.choose import choose_schedule
    from megatron_fcp.planner.head_parallel import compile_head_parallel
    from megatron_fcp.schedule.program import WaveBackward

    shape = AttentionShape(65536, 32, 8, 128)
    plain = choose_schedule("dgx-h100:2", list(range(16)), shape)
    for backward in (None, WaveBackward()):
        win = choose_schedule("dgx-h100:2", list(range(16)), shape, window=(1024, 0), backward=backward)
        kv = win.plan.kv_plan
        assert win.degree == 1 and kv.window == (1024, 0) and kv.seq_len == 65536
        assert win.total_s < plain.total_s / 4
        kv.verify()
    with pytest.raises(PlanError, match="degree 1"):
        compile_head_parallel("dgx-h100:2", range(16), shape, 2, "full", window=(1024, 0))
    with pytest.raises(ValueError, match="one of \\[1\\]"):
        choose_schedule("dgx-h100:2", list(range(16)), shape, degree=2, window=(1024, 0))
