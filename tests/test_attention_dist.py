"""fcp_attention at cp = 4 and cp = 2 against FP64 references: the numerics matrix in the
in-process harness, a smaller set on real gloo process groups, and the harness against gloo bit for bit.

The matrix (``CASES``) runs in the in-process harness (megatron_fcp.testing.harness: one thread
per CP rank, the production executor, no process start-up). ``GLOO_CASES`` (a subset) also run
through autograd on a real gloo world, with the bad-input, bounded-wait and NCCL-gate probes; the
harness must reproduce the gloo results bit for bit (tests/_harness_cases.py: ring, full, compiled
plans, packed batches, both backward KV modes, both CPU kernels).

Tolerances (errors are max-abs over each rank's shard, maximum over ranks):
* FP64: <= 1e-12 * max(1, max|ref|);  FP32: <= 1e-5 * max(1, max|ref|) (relative to the largest
  reference value when that exceeds 1, absolute otherwise).
* BF16 (flash-attn's rule): error <= 2 * error of plain PyTorch attention in BF16 (torch.softmax
  etc. on BF16 tensors, autograd) against the same FP64 reference, plus flash-attn's rounding
  slack 2 * |(x + 0.3 - 0.3) - x| of the reference rounded to BF16. Because plain BF16 attention
  is far off when logits reach 1e4 (the "extreme" cases), that rule alone is loose there; every
  BF16 case must also stay within 2^-6 * max(1, max|ref|) (a few BF16 ulps: what FP32
  accumulation followed by one rounding to BF16 gives), which a lost block or gradient breaks.
Transfers are counted through a CountingTransport and must equal plan.sends/recvs per rank and
round, forward and (flipped) backward. A few cases run the "cpu-flash" block kernel (torch's fused
CPU flash ops) under the same tolerances; the math kernel is the default everywhere else.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _harness_cases  # noqa: E402
import torch  # noqa: E402
from _attention_cases import GLOO_CASES, QUANTITIES, Case, assert_within_tolerance, harness_case  # noqa: E402

CASES = [
    Case(group, plan, causal, heads, dtype)
    for group in ("cp4", "cp2")
    for plan in ("ring", "full")
    for causal in (True, False)
    for heads in ((4, 4), (4, 2))
    for dtype in ("fp64", "fp32", "bf16")
] + [
    Case(group, plan, causal, (4, 2), "bf16", extreme=True)
    for group in ("cp4", "cp2") for plan in ("ring", "full") for causal in (True, False)
] + [
    Case(group, plan, True, (4, 2), dtype, parts=2)
    for group in ("cp4", "cp2") for plan in ("ring", "full") for dtype in ("fp64", "fp32")
] + [  # the fused CPU flash block kernel: diagonal, sub-block diagonal (parts=2), GQA, BF16, extreme
    Case("cp4", "ring", True, (4, 2), "fp32", kernel="cpu-flash"),
    Case("cp4", "full", True, (4, 2), "fp32", parts=2, kernel="cpu-flash"),
    Case("cp2", "full", False, (4, 4), "fp32", kernel="cpu-flash"),
    Case("cp2", "ring", True, (4, 2), "bf16", parts=2, kernel="cpu-flash"),
    Case("cp4", "full", True, (4, 2), "bf16", extreme=True, kernel="cpu-flash"),
]
assert set(GLOO_CASES) <= set(CASES)  # the gloo cases (tests/_attention_cases.py) are matrix cases too


@pytest.fixture(scope="module")
def gloo(gloo_attention_world):
    """Per rank: {case name: report} for GLOO_CASES, the probes, and the bit-for-bit cases (from
    the gloo world these tests share: tests/_gloo_world.py)."""
    return [r["dist"] for r in gloo_attention_world]


@pytest.fixture(scope="module")
def harness():
    """{case name: per-rank reports} for every case, from the in-process harness."""
    return {c.name: harness_case(c) for c in CASES}


def _per_rank(source: str, request, case) -> list[dict]:
    if source == "harness":
        return request.getfixturevalue("harness")[case.name]
    return [r[case.name] for r in request.getfixturevalue("gloo")]


_DIST = [pytest.mark.dist, pytest.mark.slow]  # tests that need the gloo world
_MATRIX = [pytest.param("harness", c, id=f"harness-{c.name}") for c in CASES] + \
    [pytest.param("gloo", c, id=f"gloo-{c.name}", marks=_DIST) for c in GLOO_CASES]
_SOURCES = ["harness", pytest.param("gloo", marks=_DIST)]


def _max_over_ranks(per_rank, key):
    return {n: max(r[key][n] for r in per_rank) for n in QUANTITIES}


@pytest.mark.parametrize("source, case", _MATRIX)
def test_matches_fp64_reference(request, source, case):
    per_rank = _per_rank(source, request, case)
    assert len(per_rank) == 4  # cp2: two pairs side by side
    err = _max_over_ranks(per_rank, "err")
    ref = _max_over_ranks(per_rank, "ref_max")
    assert all(r["finite"] for r in per_rank), "NaN/inf in out, lse or grads"
    bf16 = case.dtype == "bf16"
    assert_within_tolerance(err, ref, _max_over_ranks(per_rank, "base_err") if bf16 else None,
                            _max_over_ranks(per_rank, "atol") if bf16 else None, case.dtype, per_rank[0]["dtypes"])


@pytest.mark.parametrize("source, case", _MATRIX)
def test_transfers_are_exactly_the_plans(request, source, case):
    problems = [p for r in _per_rank(source, request, case) for p in r["count_problems"]]
    assert not problems, "\n".join(problems[:5])


@pytest.mark.parametrize("source", _SOURCES)
def test_fixed_plan_is_bitwise_reproducible_with_and_without_overlap(request, source):
    cases = CASES if source == "harness" else GLOO_CASES
    repeated = [(c.name, r["bitwise_repeat"]) for c in cases for r in _per_rank(source, request, c)
                if "bitwise_repeat" in r]
    assert repeated and all(ok for _, ok in repeated), [n for n, ok in repeated if not ok]


@pytest.mark.parametrize("source", _SOURCES)
def test_public_fcp_attention_matches_the_low_level_function(request, source):
    cases = CASES if source == "harness" else GLOO_CASES
    want = 4 * sum(c.dtype == "fp64" and c.parts == 1 for c in cases)  # FP64 cases x 4 ranks (16 in CASES)
    checked = [r["public_api_equal"] for c in cases for r in _per_rank(source, request, c) if "public_api_equal" in r]
    assert len(checked) == want and want > 0 and all(checked)
    inference = [r["no_grad_equal"] for c in cases for r in _per_rank(source, request, c) if "no_grad_equal" in r]
    assert len(inference) == want and all(inference)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", _harness_cases.CASES, ids=lambda c: c.name)
def test_harness_reproduces_gloo_bit_for_bit(gloo, case):
    """Same plan, inputs, kernel and backward KV mode: the in-process harness (executor driven
    directly, threads) and gloo processes (autograd, GlooTransport) give identical bits."""
    harness = _harness_cases.harness_bitwise(case)
    for rank, (h, g) in enumerate(zip(harness, (r["bitwise"][case.name] for r in gloo))):
        for n in QUANTITIES:
            assert h[n].dtype == g[n].dtype and h[n].shape == g[n].shape, (rank, n)
            assert torch.equal(h[n], g[n]), f"rank {rank} {n}: max diff {(h[n].double() - g[n].double()).abs().max()}"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("group", ["bad_inputs_cp4", "bad_inputs_cp2"])
def test_bad_input_raises_before_any_communication(gloo, group):
    import re
    for r in gloo:
        for name, (msg, posts, expect) in r[group].items():
            assert re.search(expect, msg), f"{name}: {msg!r} does not mention {expect!r}"
            assert posts == 0, f"{name}: {posts} rounds posted before the error"


@pytest.mark.dist
@pytest.mark.slow
def test_bounded_wait_names_round_peer_and_block(gloo):
    msg = gloo[0]["timeout"]
    assert msg is not None and "forward round 3" in msg and "rank 1" in msg and "B(r1,c0,p0)" in msg, msg
    assert gloo[1]["timeout"] is None


@pytest.mark.dist
@pytest.mark.slow
def test_gloo_test_sees_a_round_complete_without_wait(gloo):
    r0, r1 = gloo[0]["test"], gloo[1]["test"]
    assert r0["early"] is False  # rank 1 had not posted yet
    assert r0["late"] is True and r1["late"] is True  # before either called wait
    assert (r0["received"], r1["received"]) == (2.0, 1.0) and r0["all_same"] and r1["all_same"]
    assert gloo[2]["test"] is None and gloo[3]["test"] is None


@pytest.mark.dist
@pytest.mark.slow
def test_nccl_transport_refuses_a_gloo_group(gloo):
    assert all("use GlooTransport" in r["nccl_gate"] for r in gloo), gloo[0]["nccl_gate"]
