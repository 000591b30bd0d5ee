"""MLA: K and V with different head sizes (``d_qk = 48, d_v = 32``; DeepSeek-V3 has 192 and 128).

Exactness against a single-device FP64 reference at cp = 2, 3, 4 (zigzag and packed, GQA, plans
full and ring, backward KV keep and resend) in the in-process harness; the kernels against the
dense reference; BF16 by the 2x rule; the fused kernels' padding (Note item 4 of
:mod:`megatron_fcp.attention.fused`); bytes on the wire and in the cost model (Note [KV block
tensors] in :mod:`megatron_fcp.attention.kv_block`); bad shapes refused before any communication.
The gloo multi-process case is in tests/_mla_cases.py (the shared gloo world).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_fcp.attention.fused import CpuFlashKernel, _pad_to
from megatron_fcp.attention.kernels import MathKernel, reference_attention
from megatron_fcp.attention.kv_block import kv_block_shape, pack_kv, split_kv
from megatron_fcp.contract.placement import place_packed
from megatron_fcp.contract.plan import full_plan
from megatron_fcp.testing.harness import QUANTITIES, harness_attention, per_document_reference

D_QK, D_V = 48, 32
DOCS = (1, 37, 3, 5, 50, 2, 13, 7)


def _randn(g, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _zigzag_inputs(cp: int, heads=(4, 2), b: int = 2, chunk: int = 6, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    s, (h, hk) = 2 * cp * chunk, heads
    return (_randn(g, s, b, h, D_QK, dtype=dtype), _randn(g, s, b, hk, D_QK, dtype=dtype),
            _randn(g, s, b, hk, D_V, dtype=dtype), _randn(g, s, b, h, D_V, dtype=dtype))


def _packed_inputs(heads=(4, 1), seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    t, (h, hk) = sum(DOCS), heads
    return (_randn(g, t, h, D_QK, dtype=dtype), _randn(g, t, hk, D_QK, dtype=dtype),
            _randn(g, t, hk, D_V, dtype=dtype), _randn(g, t, h, D_V, dtype=dtype))


def _errors(res, ref) -> dict:
    return {n: (res.gathered(n).double() - ref[n].double()).abs().max().item() for n in QUANTITIES}


CASES = [(cp, plan, bkv) for cp in (2, 3, 4) for plan in ("full", "ring") for bkv in ("keep", "resend")]


@pytest.mark.parametrize("cp, plan, backward_kv", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full-mask"])
def test_zigzag_fp64_matches_the_reference(cp, plan, backward_kv, causal):
    q, k, v, do = _zigzag_inputs(cp, heads=(4, 2) if cp != 3 else (6, 3), seed=cp)
    scale = 1.0 / math.sqrt(D_QK)
    ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do)
    res = harness_attention(q, k, v, do, cp=cp, plan=plan, causal=causal, backward_kv=backward_kv)
    assert res.ranks[0].backward_kv == backward_kv
    assert res.gathered("out").shape == (q.shape[0], q.shape[1], q.shape[2], D_V)
    assert res.gathered("dv").shape == v.shape and res.gathered("dk").shape == k.shape
    err = _errors(res, ref)
    assert all(e < 1e-12 for e in err.values()), err


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("backward_kv", ["keep", "resend"])
def test_packed_fp64_matches_the_reference(cp, backward_kv):
    q, k, v, do = _packed_inputs(seed=cp)
    pl = place_packed(DOCS, cp, block_tokens=8, causal=True)
    ref = per_document_reference(q, k, v, do, DOCS, True, 1.0 / math.sqrt(D_QK))
    res = harness_attention(q, k, v, do, placement=pl, plan=full_plan(tuple(range(cp)), True, placement=pl),
                            backward_kv=backward_kv)
    err = _errors(res, ref)
    assert all(e < 1e-12 for e in err.values()), err


def test_the_default_scale_is_one_over_sqrt_d_qk():
    q, k, v, do = _zigzag_inputs(2)
    res = harness_attention(q, k, v, do, cp=2, plan="full")
    ref = reference_attention(q, k, v, causal=True, scale=1.0 / math.sqrt(D_QK), dout=do)
    assert (res.gathered("out") - ref["out"]).abs().max() < 1e-12


def test_keep_and_resend_are_bitwise_equal():
    q, k, v, do = _zigzag_inputs(4, seed=7, dtype=torch.float32)
    a, b = (harness_attention(q, k, v, do, cp=4, plan="ring", backward_kv=m) for m in ("keep", "resend"))
    assert all(torch.equal(a.gathered(n), b.gathered(n)) for n in QUANTITIES)


@pytest.mark.parametrize("kernel", ["math", "cpu-flash"])
@pytest.mark.parametrize("layout", ["zigzag", "packed"])
def test_bf16_by_the_2x_rule(kernel, layout):
    """BF16 FCP within 2x plain BF16 attention's error vs FP64 (+ flash-attn's rounding slack)."""
    scale = 1.0 / math.sqrt(D_QK)
    if layout == "zigzag":
        x = _zigzag_inputs(4, seed=3)
        ref = reference_attention(*x[:3], causal=True, scale=scale, dout=x[3])
        lo = [t.bfloat16() for t in x]
        base = reference_attention(*lo[:3], causal=True, scale=scale, dout=lo[3])
        res = harness_attention(*lo, cp=4, plan="ring", kernel=kernel)
    else:
        x = _packed_inputs(seed=3)
        ref = per_document_reference(*x, DOCS, True, scale)
        lo = [t.bfloat16() for t in x]
        base = per_document_reference(*lo, DOCS, True, scale)
        pl = place_packed(DOCS, 4, block_tokens=8, causal=True)
        res = harness_attention(*lo, placement=pl, plan=full_plan((0, 1, 2, 3), True, placement=pl), kernel=kernel)
    for n in QUANTITIES:
        r = ref[n].bfloat16()
        slack = 2 * (r + 0.3 - 0.3 - r).double().abs().max().item()
        base_err = (base[n].double() - ref[n]).abs().max().item()
        err = (res.gathered(n).double() - ref[n]).abs().max().item()
        assert err <= 2 * base_err + slack, (n, err, base_err, slack)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel, dtype", [(MathKernel(), torch.float64), (MathKernel(), torch.float32),
                                           (CpuFlashKernel(), torch.float32)], ids=["math-fp64", "math-fp32",
                                                                                     "cpu-flash-fp32"])
@pytest.mark.parametrize("dims", [(D_QK, D_V), (D_V, D_QK)], ids=["dv<dqk", "dv>dqk"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full-mask"])
def test_kernels_against_the_dense_reference(kernel, dtype, dims, causal):
    d, dv = dims
    g = torch.Generator().manual_seed(11)
    n, b, h, hk = 20, 2, 4, 2
    q, k = _randn(g, n, b, h, d, dtype=dtype), _randn(g, n, b, hk, d, dtype=dtype)
    v, do = _randn(g, n, b, hk, dv, dtype=dtype), _randn(g, n, b, h, dv, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    ref = reference_attention(q.double(), k.double(), v.double(), causal=causal, scale=scale, dout=do.double())
    pos = torch.arange(n)
    out, lse = kernel.forward(q, k, v, pos, pos, causal, scale, **kernel.prepare_forward(q, hk, scale))
    fo, fl = ref["out"].to(out.dtype), ref["lse"].to(out.dtype)
    grads = kernel.backward(do.to(out.dtype), q, k, v, fo, fl, pos, pos, causal, scale,
                            **kernel.prepare_backward(q, do.to(out.dtype), fo, hk))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for name, x in zip(QUANTITIES, (out, lse, *grads)):
        assert x.shape == ref[name].shape, name
        assert (x.double() - ref[name]).abs().max() <= tol * max(1.0, ref[name].abs().max().item()), name


def test_fused_padding_is_zero_channels_and_a_no_op_at_equal_sizes():
    x = torch.randn(3, 2, 4, 5)
    assert _pad_to(x, 5) is x
    y = _pad_to(x, 8)
    assert y.shape == (3, 2, 4, 8) and torch.equal(y[..., :5], x) and not y[..., 5:].any()


def test_cpu_flash_runs_the_op_on_padded_values(monkeypatch):
    """The fused op sees one head size (V padded to d_qk); the kernel slices the padding off."""
    seen = []
    ops = CpuFlashKernel._OPS
    fwd = type(ops).forward
    monkeypatch.setattr(type(ops), "forward", lambda self, q, k, v, c, s: (seen.append(
        (q.shape[-1], k.shape[-1], v.shape[-1])), fwd(self, q, k, v, c, s))[1])
    g = torch.Generator().manual_seed(2)
    q, k, v = _randn(g, 8, 1, 2, D_QK, dtype=torch.float32), _randn(g, 8, 1, 2, D_QK, dtype=torch.float32), \
        _randn(g, 8, 1, 2, D_V, dtype=torch.float32)
    pos = torch.arange(8)
    out, _ = CpuFlashKernel().forward(q, k, v, pos, pos, True, 0.1)
    assert seen and all(s == (D_QK, D_QK, D_QK) for s in seen) and out.shape[-1] == D_V


# ---------------------------------------------------------------------------------------------
# the block tensor and bytes
# ---------------------------------------------------------------------------------------------
def test_block_tensors_carry_no_padding():
    k, v = torch.randn(5, 2, 3, D_QK), torch.randn(5, 2, 3, D_V)
    x = pack_kv(k, v)
    assert x.shape == kv_block_shape(5, 2, 3, D_QK, D_V) == (5, 2, 3, D_QK + D_V)
    kk, vv = split_kv(x, D_QK)
    assert torch.equal(kk, k) and torch.equal(vv, v) and kk.stride(-1) == 1 and vv.stride(-1) == 1
    assert pack_kv(k, k).shape == kv_block_shape(5, 2, 3, D_QK, D_QK) == (2, 5, 2, 3, D_QK)


def test_recorded_bytes_equal_the_programs_and_follow_d_qk_plus_d_v():
    """The executor's bytes (forward and backward) are the program's token bytes times the blocks
    it sends, and MLA moves (d_qk + d_v) / (2 d_qk) of what d_v = d_qk moves."""
    q, k, v, do = _zigzag_inputs(4, seed=5)
    got = {}
    for name, vv, dd in (("mla", v, do), ("equal", torch.cat([v, v[..., :D_QK - D_V]], -1),
                                          torch.cat([do, do[..., :D_QK - D_V]], -1))):
        res = harness_attention(q, k, vv, dd, cp=4, plan="ring", stats=True, backward_kv="resend")
        r = res.ranks[1]
        tb = r.program.token_bytes
        assert tb == 2 * 2 * (D_QK + vv.shape[-1]) * 8                     # b = 2, h_kv = 2, FP64
        sent = sum(res.ranks[1].program.plan.block_tokens(t.block, q.shape[0]) for _, t in
                   r.program.plan.transfers() if t.src == r.rank)
        assert r.stats.forward_bytes_sent == sent * tb
        got[name] = (r.stats.forward_bytes_sent, r.stats.backward_bytes_sent, r.stats.resend_bytes_sent)
    ratio = (D_QK + D_V) / (2 * D_QK)
    assert all(m == pytest.approx(ratio * e) for m, e in zip(got["mla"], got["equal"])), got


# ---------------------------------------------------------------------------------------------
# bad shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shapes, match", [
    (((12, 1, 4, 48), (12, 1, 2, 48), (8, 1, 2, 32)), "must agree on every dim but the head size"),
    (((12, 1, 4, 48), (12, 1, 2, 48), (12, 1, 1, 32)), "must agree on every dim but the head size"),
    (((12, 1, 4, 48), (12, 1, 2, 32), (12, 1, 2, 32)), "head_dim d_qk"),
    (((12, 1, 4, 48), (12, 1, 2, 48), (12, 1, 2, 0)), "head size 0"),
])
def test_bad_shapes_raise_before_any_communication(shapes, match):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        harness_attention(q, k, v, cp=2, plan="full", timeout_s=5.0)


# ---------------------------------------------------------------------------------------------
# real process groups (the shared gloo world, tests/_mla_cases.py)
# ---------------------------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
def test_gloo_process_groups_match_the_reference(gloo_attention_world):
    per_rank = [r["mla"] for r in gloo_attention_world]
    for r in per_rank:
        assert "must agree on every dim but the head size" in r["bad"], r["bad"]
        for layout in ("zigzag", "packed"):
            assert all(e < 1e-12 for e in r[layout].values()), (layout, r[layout])


# ---------------------------------------------------------------------------------------------
# the cost model
# ---------------------------------------------------------------------------------------------
def test_cost_model_bytes_follow_d_qk_plus_d_v_and_flops_d_qk_plus_d_v():
    """MLA's KV moves (d_qk + d_v) / (2 d_qk) of the bytes d_v = d_qk moves (FCP forward and
    backward, TE's ring), and a pair costs 2 h (d_qk + d_v) FLOPs: DeepSeek-V3's head sizes."""
    from megatron_fcp.cost.backward import simulate_plan_backward
    from megatron_fcp.cost.model import AttentionShape, ComputeModel, kv_block_bytes, simulate_plan
    from megatron_fcp.cost.te import simulate_te_p2p

    ranks = tuple(range(8))
    plan = full_plan(ranks, True)
    eq = AttentionShape(64 * 1024, 16, 16, 192)
    mla = AttentionShape(64 * 1024, 16, 16, 192, v_head_dim=128)
    ratio = (192 + 128) / (2 * 192)
    assert mla.kv_bytes(10) == 10 * 16 * 320 * 2 and mla.kv_bytes(1) == pytest.approx(ratio * eq.kv_bytes(1))
    assert kv_block_bytes(1024, 4, 16, 192, v_head_dim=128) == pytest.approx(ratio * kv_block_bytes(1024, 4, 16, 192))
    fwd = [simulate_plan(plan, "dgx-h100:1", s, compute=False).bytes for s in (mla, eq)]
    bwd = [simulate_plan_backward(plan, "dgx-h100:1", s).bytes for s in (mla, eq)]
    te = [simulate_te_p2p("dgx-h100:1", ranks, s, compute=False).bytes for s in (mla, eq)]
    for m, e in (fwd, bwd, te):
        assert m == pytest.approx(ratio * e) and m < e
    assert mla.pair_flops == 2 * 16 * 320 and eq.pair_flops == 4 * 16 * 192
    cm = ComputeModel(flops=1e12, kernel_overhead_s=0.0)
    assert cm.time(1e6, mla) == pytest.approx(cm.time(1e6, eq) * 320 / 384)
    with pytest.raises(ValueError, match="v_head_dim"):
        AttentionShape(1024, v_head_dim=0)
