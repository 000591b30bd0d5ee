"""Sliding windows in the Megatron integration: per-layer plans, the CPU band mask, cp = 1 paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_fcp.config import FCPConfig
from megatron_fcp.contract.mask import Mask
from megatron_fcp.patches.packed import local_packed_attention, window_mask
from megatron_fcp.patches.runtime import reset_fcp, setup_fcp, setup_fingerprint
from megatron_fcp.planner.megatron_layout import MegatronLayout


@pytest.fixture(autouse=True)
def _fresh():
    reset_fcp()
    yield
    reset_fcp()


def _dense(q, k, v, visible, scale):
    """FP64 attention of q [n, h, d] over k, v [m, h, d] with a boolean [n, m] mask."""
    s = torch.einsum("nhd,mhd->hnm", q, k) * scale
    s = s.masked_fill(~torch.as_tensor(visible)[None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(s, dim=-1), v)


def test_cpu_band_mask_is_megatrons():
    """The shim's band (masked = True) is the complement of Mask's visible rule, for causal windows."""
    from megatron_fcp.patches.cpu import _make_sliding_window_mask

    band = _make_sliding_window_mask(None)
    for n, w in ((12, (3, 0)), (12, (0, 0)), (9, (20, 0)), (10, (2, 3))):
        causal = w[1] == 0
        assert torch.equal(band(n, n, w), ~window_mask(n, causal, w)), (n, w)


def test_local_packed_attention_windows_each_document():
    torch.manual_seed(0)
    lengths, window = (5, 11, 3), (4, 0)
    t = sum(lengths)
    q, k, v = (torch.randn(t, 2, 8, dtype=torch.float64) for _ in range(3))
    out = local_packed_attention(q, k, v, lengths, causal=True, scale=0.3, window=window)
    doc = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    visible = (doc[:, None] == doc[None, :]) & Mask.of(True, window).visible(pos[:, None], pos[None, :])
    torch.testing.assert_close(out, _dense(q, k, v, visible, 0.3), rtol=1e-12, atol=1e-12)


def test_setup_settles_and_agrees_a_plan_per_window():
    cfg = FCPConfig(enabled=True, graph="full", topology="dgx-h100:1")
    layout = MegatronLayout(world=4, cp=4)
    runtime = setup_fcp(cfg, layout=layout, groups={}, seq_len=256, heads=4, kv_heads=2, head_dim=8,
                        windows=((16, 0), (16, 0), (64, 0)))
    assert runtime.windows == ((16, 0), (64, 0))
    ranks = layout.cp_groups()[0]
    plain = runtime.plans[(ranks, True, runtime.parts_per_chunk(64))]
    small = runtime.window_plan(ranks, causal=True, window=(16, 0), s_local=64)
    large = runtime.window_plan(ranks, causal=True, window=(64, 0), s_local=64)
    assert small.mask == Mask(True, 16, 0) and large.mask == Mask(True, 64, 0)
    assert small.num_transfers() < large.num_transfers() <= plain.num_transfers()
    assert len(runtime.window_plans) == 2  # settled at setup, reused on use
    fingerprint = setup_fingerprint(runtime, ranks, runtime.parts_per_chunk(64))
    assert [w[0][0] for w in fingerprint["windows"]] == [(16, 0), (64, 0)]
    entry = runtime.report_layer(1, cp_group=None, window=(16, 0))
    assert entry["window"] == [16, 0] and entry["head_parallel"] == 1 and entry["rounds"] == len(small.rounds)


def test_bad_window_is_refused_at_setup():
    cfg = FCPConfig(enabled=True, graph="full", topology="dgx-h100:1")
    with pytest.raises(ValueError, match="right side must be 0"):
        setup_fcp(cfg, layout=MegatronLayout(world=4, cp=4), groups={}, seq_len=256, windows=((16, 4),))


def test_each_window_gets_its_own_schedule_choice():
    """graph auto: the full layers' schedule may take a head-parallel stage; each window its own
    choice at degree 1 (the planner's, priced under the window), which its plan then runs."""
    cfg = FCPConfig(enabled=True, topology="dgx-h100:2")
    layout = MegatronLayout(world=16, cp=16)
    runtime = setup_fcp(cfg, layout=layout, groups={}, seq_len=64 * 1024, heads=16, kv_heads=16, head_dim=64,
                        windows=((1024, 0),))
    choice = runtime.window_schedules[(1024, 0)]
    assert choice is not None and choice.degree == 1 and choice.seq_len == 64 * 1024
    ranks = layout.cp_groups()[0]
    plan = runtime.window_plan(ranks, causal=True, window=(1024, 0), s_local=4096)
    assert plan.name == choice.graph and plan.parts_per_chunk == choice.parts and plan.window == (1024, 0)
    entry = runtime.report_layer(3, cp_group=None, window=(1024, 0))
    assert entry["schedule"] == choice.label and entry["plan"] == choice.graph
    assert runtime.schedule.total_s > choice.total_s  # a 1K window of 64K tokens: far less to move and compute
