"""THD attention over placements (packed batches), cp = 2, 3, 4, against an FP64 per-document
reference (plain torch, each document attended alone): every case in the in-process harness
(megatron_fcp.testing.harness), ``GLOO_CASES`` also on real gloo groups (with the bad-input probes).

Tolerances (max-abs over each rank's shard, maximum over ranks): FP64 <= 1e-12 * max(1, max|ref|),
FP32 <= 1e-5 * max(1, max|ref|); BF16 <= 2 x the error of plain PyTorch attention in BF16 (per
document) plus flash-attn's rounding slack, and <= 2^-6 * max(1, max|ref|) (see
tests/test_attention_dist.py). Also: transfers equal the plan's (per-block byte counts), a fixed
plan repeats bitwise (with and without overlap), changing one document leaves every other
document's outputs and gradients bit-identical, and bad input raises before any communication.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _thd_cases import GLOO_CASES, QUANTITIES, ThdCase, harness_case  # noqa: E402


C = ThdCase
CASES = [
    # cp = 4 (the world): every placement shape, full and a compiled hierarchical plan on 2x2
    C("cp4", "mix", "none", True, "fp64", isolate=True),
    C("cp4", "mix", "hier", True, "fp64"),
    C("cp4", "mix", "full-plan", False, "fp64", heads=(2, 2)),
    C("cp4", "mix", "hier", False, "fp32", kernel="cpu-flash"),
    C("cp4", "mix", "full", True, "fp32"),
    C("cp4", "mix", "hier", True, "bf16"),
    C("cp4", "mix", "full", True, "bf16", kernel="cpu-flash", isolate=True),
    C("cp4", "mix", "hier", True, "fp32", kernel="cpu-flash", isolate=True),
    C("cp4", "tiny", "none", True, "fp64"),
    C("cp4", "tiny", "hier", True, "fp32", kernel="cpu-flash"),
    C("cp4", "one", "hier", True, "fp64"),
    C("cp4", "one", "full", False, "fp32", kernel="cpu-flash"),
    C("cp4", "short", "full", True, "fp64", heads=(4, 1)),
    C("cp4", "two-long", "hier", False, "bf16", kernel="cpu-flash"),
    C("cp4", "twelve", "relay", False, "fp64"),   # ranks without tokens relay (and reduce dK/dV)
    C("cp4", "twelve", "relay", True, "fp32", kernel="cpu-flash"),
    # cp = 2 on {0, 2} and {1, 3} (CP ranks != global ranks; hierarchical across the two nodes)
    C("cp2", "mix", "full", True, "fp64", isolate=True),
    C("cp2", "mix", "hier", True, "fp32", kernel="cpu-flash"),
    C("cp2", "tiny", "none", True, "fp64"),
    C("cp2", "one", "full-plan", False, "fp32", heads=(2, 2)),
    C("cp2", "two-long", "hier", True, "bf16"),
    # cp = 3 on {0, 1, 2}
    C("cp3", "mix", "none", True, "fp64", isolate=True),
    C("cp3", "mix", "full", False, "fp32", kernel="cpu-flash"),
    C("cp3", "tiny", "full", False, "fp64"),
    C("cp3", "one", "full-plan", True, "bf16", kernel="cpu-flash"),
    C("cp3", "short", "none", False, "fp32"),
]
assert set(GLOO_CASES) <= set(CASES)  # the gloo cases (tests/_thd_cases.py) are matrix cases too
_DIST = [pytest.mark.dist, pytest.mark.slow]  # tests that need the gloo world


@pytest.fixture(scope="module")
def gloo(gloo_attention_world):
    """GLOO_CASES and the bad-input probes, from the shared gloo world (tests/_gloo_world.py)."""
    return [r["thd"] for r in gloo_attention_world]


@pytest.fixture(scope="module")
def harness():
    return {c.name: harness_case(c) for c in CASES}


def _ranks(request, source, case):
    if source == "harness":
        return request.getfixturevalue("harness")[case.name]
    return [r[case.name] for r in request.getfixturevalue("gloo") if case.name in r]


def _matrix(cases):
    gloo_cases = [c for c in GLOO_CASES if c in cases]
    return [pytest.param("harness", c, id=f"harness-{c.name}") for c in cases] + \
        [pytest.param("gloo", c, id=f"gloo-{c.name}", marks=_DIST) for c in gloo_cases]


def _max(per_rank, key):
    return {n: max(r[key][n] for r in per_rank) for n in QUANTITIES}


@pytest.mark.parametrize("source, case", _matrix(CASES))
def test_matches_the_per_document_fp64_reference(request, source, case):
    per_rank = _ranks(request, source, case)
    assert len(per_rank) == {"cp4": 4, "cp2": 4, "cp3": 3}[case.group]  # cp2: two pairs side by side
    assert all(r["finite"] for r in per_rank), "NaN/inf in out, lse or grads"
    assert all(r["shapes"] == r["want_shapes"] for r in per_rank)
    dtypes = per_rank[0]["dtypes"]
    want = {"fp64": "torch.float64", "fp32": "torch.float32", "bf16": "torch.bfloat16"}[case.dtype]
    assert dtypes["out"] == dtypes["dq"] == dtypes["dk"] == dtypes["dv"] == want
    assert dtypes["lse"] == ("torch.float64" if case.dtype == "fp64" else "torch.float32")
    err, ref = _max(per_rank, "err"), _max(per_rank, "ref_max")
    if case.dtype in ("fp64", "fp32"):
        tol = 1e-12 if case.dtype == "fp64" else 1e-5
        for n in QUANTITIES:
            assert err[n] <= tol * max(1.0, ref[n]), f"{n}: error {err[n]:.3g} vs max|ref| {ref[n]:.3g}"
    else:
        base, atol = _max(per_rank, "base_err"), _max(per_rank, "atol")
        for n in QUANTITIES:
            assert err[n] <= 2 * base[n] + atol[n], f"{n}: error {err[n]:.3g} > 2 x plain-BF16 {base[n]:.3g}"
            assert err[n] <= 2 ** -6 * max(1.0, ref[n]), f"{n}: error {err[n]:.3g} vs max|ref| {ref[n]:.3g}"


@pytest.mark.parametrize("source, case", _matrix(CASES))
def test_transfers_are_exactly_the_plans_and_repeat_bitwise(request, source, case):
    per_rank = _ranks(request, source, case)
    problems = [p for r in per_rank for p in r["count_problems"]]
    assert not problems, "\n".join(problems[:5])
    assert all(r["bitwise_repeat"] for r in per_rank)
    want_plan = {"hier": "hierarchical", "relay": "relay"}.get(case.plan, "full")
    assert all(r["plan_name"] == want_plan for r in per_rank)
    if case.dtype == "fp64":
        assert all(r["public_api_equal"] for r in per_rank)


@pytest.mark.parametrize("source, case", _matrix([c for c in CASES if c.isolate]))
def test_no_attention_across_documents(request, source, case):
    per_rank = _ranks(request, source, case)
    assert all(r["isolation"]["others_bit_identical"] for r in per_rank)
    holders = [r for r in per_rank if r["isolation"]["rank_holds_changed"]]
    assert holders and all(r["isolation"]["changed_doc_differs"] for r in holders)


def test_ranks_without_tokens_take_part(harness):
    assert {c.group for c in CASES if c.docs == "tiny"} == {"cp2", "cp3", "cp4"}
    for case in CASES:
        if case.docs == "tiny":
            tokens = sorted(r["tokens"] for r in harness[case.name])
            groups = 2 if case.group == "cp2" else 1
            assert tokens == [0] * (len(tokens) - groups) + [1] * groups
    for case in CASES:
        if case.plan == "relay":  # the relay holds no tokens but moves (and reduces) every block
            relays = [r for r in harness[case.name] if r["tokens"] == 0 and r["sent"]]
            assert relays, case.name


@pytest.mark.dist
@pytest.mark.slow
def test_bad_thd_input_raises_before_any_communication(gloo):
    for r in gloo:
        for name, (msg, posts, expect) in r["bad_inputs_cp4"].items():
            assert re.search(expect, msg), f"{name}: {msg!r} does not mention {expect!r}"
            assert posts == 0, f"{name}: {posts} rounds posted before the error"
