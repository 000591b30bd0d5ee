"""Attention sinks (Megatron's ``softmax_type`` ``"off-by-one"`` / ``"learnable"``) in FCP's engine.

Against a dense single-device reference with the sink as one more softmax column
(tests/_sink_cases.py, megatron-core's ``SoftmaxOne`` form), every quantity: out, lse (over keys
and sink), dq, dk, dv and dsink (the sum of every rank's share: Note [The sink's gradient across
ranks] in megatron_fcp.attention.sinks).

* In process (the harness, FP64 within 1e-12 x max(1, max|ref|)): cp = 2, 3, 4; zigzag and packed;
  GQA 4:2; plans full and ring (packed: full and a compiled ring over the placement); backward KV
  keep and resend; both sink types; causal and not. BF16 by the 2x rule against plain BF16
  attention with the same sink; the fused CPU kernel in FP32. Large and very negative sinks give finite results.
* On gloo (4 processes, autograd): zigzag (learnable: dsink shares sum to the reference; off-by-one:
  zeros without grad), packed, the head-parallel stage at a = 2 (KV stage) and a = 4 (local), bad
  sinks refused before any communication.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _sink_cases import QUANTITIES, inputs, packed_sink_reference, sink_reference  # noqa: E402

from megatron_fcp.attention.layout import zigzag_split  # noqa: E402
from megatron_fcp.testing.harness import harness_attention  # noqa: E402

ALL = QUANTITIES + ("dsink",)
DOCS = (1, 37, 3, 5, 30, 2, 1, 7, 13, 4)
_CAP = {torch.float64: 1e-12}


def _gathered(res) -> dict:
    got = {n: res.gathered(n) for n in QUANTITIES}
    got["dsink"] = sum(r.dsink.double() for r in res.ranks)
    return got


def _assert_fp64(got: dict, ref: dict, names=ALL) -> None:
    for n in names:
        err = (got[n].double() - ref[n]).abs().max().item()
        assert err <= 1e-12 * max(1.0, ref[n].abs().max().item()), f"{n}: error {err:.3g}"


def _ring_over(pl, causal):
    from megatron_fcp.planner.build import build_plan

    return lambda ranks: build_plan("pcie-box:1", ranks, "ring", causal=causal, placement=pl)


@pytest.mark.parametrize("cp", (2, 3, 4))
@pytest.mark.parametrize("plan", ("full", "ring"))
@pytest.mark.parametrize("backward_kv", ("keep", "resend"))
@pytest.mark.parametrize("learnable", (True, False), ids=("learnable", "off-by-one"))
def test_zigzag_fp64(cp, plan, backward_kv, learnable):
    causal = plan == "ring" or cp != 3          # one non-causal group per plan kind
    name = f"zig-{cp}-{plan}-{backward_kv}-{learnable}-{causal}"
    q, k, v, do, sink = inputs(name, 2 * cp * 6, 2, 4, 2, learnable=learnable)
    scale = 1 / math.sqrt(q.shape[-1])
    ref = sink_reference(q, k, v, do, sink, causal=causal, scale=scale)
    res = harness_attention(q, k, v, do, cp=cp, plan=plan, causal=causal, backward_kv=backward_kv,
                            softmax_offset=sink)
    assert all(r.backward_kv == backward_kv for r in res.ranks)
    _assert_fp64(_gathered(res), ref)


@pytest.mark.parametrize("cp", (2, 3, 4))
@pytest.mark.parametrize("plan", ("full", "ring"))
@pytest.mark.parametrize("backward_kv", ("keep", "resend"))
@pytest.mark.parametrize("learnable", (True, False), ids=("learnable", "off-by-one"))
def test_packed_fp64(cp, plan, backward_kv, learnable):
    from megatron_fcp.contract.placement import place_packed

    causal = plan == "ring" or cp != 3
    pl = place_packed(DOCS, cp, block_tokens=8, causal=causal)
    name = f"thd-{cp}-{plan}-{backward_kv}-{learnable}-{causal}"
    q, k, v, do, sink = inputs(name, pl.total_tokens, 1, 4, 2, thd=True, learnable=learnable)
    scale = 1 / math.sqrt(q.shape[-1])
    ref = packed_sink_reference(q, k, v, do, sink, DOCS, causal=causal, scale=scale)
    res = harness_attention(q, k, v, do, placement=pl, plan=None if plan == "full" else _ring_over(pl, causal),
                            causal=causal, backward_kv=backward_kv, softmax_offset=sink)
    _assert_fp64(_gathered(res), ref)


def test_the_sink_changes_the_result():
    """Guard against a sink silently dropped (TE PR #3551's bug): vanilla attention is far off."""
    q, k, v, do, sink = inputs("dropped", 32, 2, 4, 2)
    with_sink = harness_attention(q, k, v, do, cp=4, plan="ring", softmax_offset=sink)
    without = harness_attention(q, k, v, do, cp=4, plan="ring")
    ref = sink_reference(q, k, v, do, sink, causal=True, scale=1 / math.sqrt(8))
    assert (without.gathered("out") - ref["out"]).abs().max() > 1e-2
    assert (with_sink.gathered("out") - ref["out"]).abs().max() < 1e-12
    assert without.ranks[0].dsink is None


def test_off_by_one_is_one_in_the_denominator():
    """off-by-one (zeros): lse_t = log(1 + exp(lse)) row by row, out scaled by sigmoid(lse)."""
    q, k, v, _, _ = inputs("obo", 32, 1, 4, 4)
    plain = harness_attention(q, k, v, cp=2, plan="full")
    obo = harness_attention(q, k, v, cp=2, plan="full", softmax_offset=torch.zeros(4, dtype=torch.float64))
    lse = plain.gathered("lse")
    assert torch.allclose(obo.gathered("lse"), torch.nn.functional.softplus(lse), rtol=0, atol=1e-13)
    w = torch.sigmoid(lse).permute(2, 0, 1).unsqueeze(-1)
    assert torch.allclose(obo.gathered("out"), plain.gathered("out") * w, rtol=0, atol=1e-13)


@pytest.mark.parametrize("level", (60.0, -1e4))
def test_extreme_sinks_stay_finite(level):
    """A sink far above every score (out ~ 0) or far below (plain softmax) is exact and finite."""
    q, k, v, do, _ = inputs(f"extreme{level}", 48, 2, 4, 2)
    sink = torch.full((4,), level, dtype=torch.float64)
    ref = sink_reference(q, k, v, do, sink, causal=True, scale=1 / math.sqrt(8))
    res = harness_attention(q, k, v, do, cp=3, plan="ring", softmax_offset=sink)
    got = _gathered(res)
    assert all(bool(torch.isfinite(got[n]).all()) for n in ALL)
    _assert_fp64(got, ref)


@pytest.mark.parametrize("layout", ("zigzag", "packed"))
@pytest.mark.parametrize("cp", (2, 4))
def test_bf16_two_x_rule(layout, cp):
    """BF16 inputs and a BF16 sink (params_dtype bf16): each error <= 2 x plain BF16 attention's
    error (with the same sink) + the rounding slack, and <= 2^-6 x max(1, max|ref|)."""
    from megatron_fcp.contract.placement import place_packed

    bf = torch.bfloat16
    name = f"bf16-{layout}-{cp}"
    if layout == "zigzag":
        q, k, v, do, sink = inputs(name, 2 * cp * 8, 2, 4, 2)
        sink = sink.to(bf).double()
        ref = sink_reference(q, k, v, do, sink, causal=True, scale=1 / math.sqrt(8))
        base = sink_reference(*(x.to(bf) for x in (q, k, v, do, sink)), causal=True, scale=1 / math.sqrt(8))
        res = harness_attention(*(x.to(bf) for x in (q, k, v, do)), cp=cp, plan="ring", softmax_offset=sink.to(bf))
    else:
        pl = place_packed(DOCS, cp, block_tokens=8, causal=True)
        q, k, v, do, sink = inputs(name, pl.total_tokens, 1, 4, 2, thd=True)
        sink = sink.to(bf).double()
        ref = packed_sink_reference(q, k, v, do, sink, DOCS, causal=True, scale=1 / math.sqrt(8))
        base = packed_sink_reference(*(x.to(bf) for x in (q, k, v, do, sink)), DOCS, causal=True,
                                     scale=1 / math.sqrt(8))
        res = harness_attention(*(x.to(bf) for x in (q, k, v, do)), placement=pl, softmax_offset=sink.to(bf))
    got = _gathered(res)
    assert res.ranks[0].dsink.dtype == bf and res.ranks[0].out.dtype == bf
    for n in ALL:
        r = ref[n]
        err = (got[n].double() - r).abs().max().item()
        base_err = (base[n].double() - r).abs().max().item()
        slack = 2 * ((r.to(bf) + 0.3 - 0.3) - r.to(bf)).abs().max().item()
        assert err <= 2 * base_err + slack, f"{n}: {err:.3g} > 2 x {base_err:.3g} + {slack:.3g}"
        assert err <= 2 ** -6 * max(1.0, r.abs().max().item()), f"{n}: {err:.3g}"


@pytest.mark.parametrize("layout", ("zigzag", "packed"))
def test_fused_cpu_kernel_fp32(layout):
    """The fused CPU flash block kernel (FP32) takes the sink-merged out and lse in its backward
    as the math kernel does: within 1e-5 of the FP64 reference, dsink included."""
    from megatron_fcp.contract.placement import place_packed

    f32 = torch.float32
    if layout == "zigzag":
        q, k, v, do, sink = inputs("flash-zig", 48, 2, 4, 2)
        ref = sink_reference(q, k, v, do, sink, causal=True, scale=1 / math.sqrt(8))
        res = harness_attention(*(x.float() for x in (q, k, v, do)), cp=3, plan="ring", kernel="cpu-flash",
                                softmax_offset=sink.to(f32))
    else:
        pl = place_packed(DOCS, 4, block_tokens=8, causal=True)
        q, k, v, do, sink = inputs("flash-thd", pl.total_tokens, 1, 4, 2, thd=True)
        ref = packed_sink_reference(q, k, v, do, sink, DOCS, causal=True, scale=1 / math.sqrt(8))
        res = harness_attention(*(x.float() for x in (q, k, v, do)), placement=pl, kernel="cpu-flash",
                                softmax_offset=sink.to(f32))
    got = _gathered(res)
    for n in ALL:
        err = (got[n].double() - ref[n]).abs().max().item()
        assert err <= 1e-5 * max(1.0, ref[n].abs().max().item()), f"{n}: {err:.3g}"


def test_fp32_sink_with_bf16_inputs():
    """An FP32 sink parameter with BF16 activations: dsink comes back in FP32."""
    q, k, v, do, sink = inputs("mixed", 32, 1, 4, 2)
    res = harness_attention(*(x.to(torch.bfloat16) for x in (q, k, v, do)), cp=2, plan="full",
                            softmax_offset=sink.float())
    assert all(r.dsink.dtype == torch.float32 for r in res.ranks)


def test_bad_sinks_are_refused_before_any_communication():
    from megatron_fcp.attention.comm import CountingTransport

    q, k, v, _, _ = inputs("bad", 16, 1, 4, 2)
    counted = []

    def wrap(rank, inner):
        counted.append(CountingTransport(inner))
        return counted[-1]

    for offset, match in ((torch.zeros(2, dtype=torch.float64), r"shape \(2,\) but q has 4 query heads"),
                          (torch.tensor([0.0, math.nan, 0.0, 0.0], dtype=torch.float64), "non-finite"),
                          (torch.zeros(1, 4, dtype=torch.float64), "one sink logit per query head")):
        with pytest.raises(ValueError, match=match):
            harness_attention(q, k, v, cp=2, plan="full", softmax_offset=offset, transport=wrap)
    assert all(t.posts == 0 for t in counted)


def test_agreement_sees_whether_a_sink_is_used():
    """Ranks that disagree on using a sink fail the agreement (before any transfer)."""
    from megatron_fcp.attention.agreement import FCPAgreementError, LastAgreed
    from megatron_fcp.attention.function import build_executor
    from megatron_fcp.testing.inprocess import run_ranks

    q, k, v, _, sink = inputs("agree", 16, 1, 4, 2)
    agreement = LastAgreed()

    def one(h):
        ql, kl, vl = (zigzag_split(x, 2, h.index) for x in (q, k, v))
        build_executor(ql, kl, vl, cp_group=h, plan="full", agreement=agreement, timeout_s=10,
                       softmax_offset=sink if h.index == 0 else None)

    with pytest.raises(FCPAgreementError, match="'sink' differs across the CP group"):
        run_ranks((0, 1), one, timeout_s=30)


# ---- the process-group path ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gloo():
    from _sink_cases import worker

    from megatron_fcp.testing.launch import run_gloo

    return run_gloo(worker, 4, timeout_s=300)


def _check_gloo(per_rank: list[dict], case: str, names=QUANTITIES) -> None:
    for r in per_rank:
        for n in names:
            assert r[case]["err"][n] <= 1e-12 * 10, f"{case} {n}: {r[case]['err'][n]:.3g}"
    total = sum(r[case]["dsink"] for r in per_rank)
    ref = per_rank[0][case]["ref_dsink"]
    assert (total - ref).abs().max().item() <= 1e-12 * max(1.0, ref.abs().max().item()), case


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", ("zigzag-ring-learnable-keep", "zigzag-full-learnable-resend", "packed", "hp2",
                                  "hp2-rep", "hp4"))
def test_gloo_autograd(gloo, case):
    _check_gloo(gloo, case)


@pytest.mark.dist
@pytest.mark.slow
def test_gloo_off_by_one_has_no_gradient(gloo):
    case = "zigzag-ring-off-by-one-auto"
    for r in gloo:
        assert not r[case]["has_grad"] and r[case]["dsink"] is None
        assert all(r[case]["err"][n] <= 1e-11 for n in QUANTITIES)


@pytest.mark.dist
@pytest.mark.slow
def test_gloo_bad_sinks(gloo):
    import re

    for r in gloo:
        for name, (text, posts, expect) in r["bad_inputs"].items():
            assert re.search(expect, text), f"{name}: {text}"
            assert posts == 0, name
