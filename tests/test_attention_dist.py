"""fcp_attention on real gloo process groups (cp = 4 and cp = 2) against FP64 references.

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
from _attention_cases import QUANTITIES, Case, worker  # noqa: E402

from megatron_fcp.launch import run_gloo  # noqa: E402

pytestmark = pytest.mark.dist

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


@pytest.fixture(scope="module")
def results():
    per_rank = run_gloo(worker, 4, CASES, timeout_s=240)
    return per_rank


def _max_over_ranks(per_rank, case_name, key):
    return {n: max(r[case_name][key][n] for r in per_rank) for n in QUANTITIES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_fp64_reference(results, case):
    err = _max_over_ranks(results, case.name, "err")
    ref = _max_over_ranks(results, case.name, "ref_max")
    assert all(r[case.name]["finite"] for r in results), "NaN/inf in out, lse or grads"
    dtypes = results[0][case.name]["dtypes"]
    want_dtype = {"fp64": "torch.float64", "fp32": "torch.float32", "bf16": "torch.bfloat16"}[case.dtype]
    assert dtypes["out"] == dtypes["dq"] == dtypes["dk"] == dtypes["dv"] == want_dtype
    assert dtypes["lse"] == ("torch.float64" if case.dtype == "fp64" else "torch.float32")
    if case.dtype in ("fp64", "fp32"):
        tol = 1e-12 if case.dtype == "fp64" else 1e-5
        for n in QUANTITIES:
            assert err[n] <= tol * max(1.0, ref[n]), f"{n}: error {err[n]:.3g} vs max|ref| {ref[n]:.3g}"
    else:
        base = _max_over_ranks(results, case.name, "base_err")
        atol = _max_over_ranks(results, case.name, "atol")
        for n in QUANTITIES:
            assert err[n] <= 2 * base[n] + atol[n], (
                f"{n}: error {err[n]:.3g} > 2 x plain-BF16 error {base[n]:.3g} + {atol[n]:.3g}")
            assert err[n] <= 2 ** -6 * max(1.0, ref[n]), f"{n}: error {err[n]:.3g} vs max|ref| {ref[n]:.3g}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_transfers_are_exactly_the_plans(results, case):
    problems = [p for r in results for p in r[case.name]["count_problems"]]
    assert not problems, "\n".join(problems[:5])


def test_fixed_plan_is_bitwise_reproducible_with_and_without_overlap(results):
    repeated = [(c.name, r[c.name]["bitwise_repeat"]) for c in CASES for r in results if "bitwise_repeat" in r[c.name]]
    assert repeated and all(ok for _, ok in repeated), [n for n, ok in repeated if not ok]


def test_public_fcp_attention_matches_the_low_level_function(results):
    checked = [r[c.name]["public_api_equal"] for c in CASES for r in results if "public_api_equal" in r[c.name]]
    assert len(checked) == 16 * 4 and all(checked)  # 16 FP64 cases x 4 ranks
    inference = [r[c.name]["no_grad_equal"] for c in CASES for r in results if "no_grad_equal" in r[c.name]]
    assert len(inference) == 16 * 4 and all(inference)


@pytest.mark.parametrize("group", ["bad_inputs_cp4", "bad_inputs_cp2"])
def test_bad_input_raises_before_any_communication(results, group):
    import re
    for r in results:
        for name, (msg, posts, expect) in r[group].items():
            assert re.search(expect, msg), f"{name}: {msg!r} does not mention {expect!r}"
            assert posts == 0, f"{name}: {posts} rounds posted before the error"


def test_bounded_wait_names_round_peer_and_block(results):
    msg = results[0]["timeout"]
    assert msg is not None and "forward round 3" in msg and "rank 1" in msg and "B(r1,c0,p0)" in msg, msg
    assert results[1]["timeout"] is None


def test_nccl_transport_refuses_a_gloo_group(results):
    assert all("use GlooTransport" in r["nccl_gate"] for r in results), results[0]["nccl_gate"]
