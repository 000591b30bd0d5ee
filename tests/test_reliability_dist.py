"""Agreement, delay fuzzing, fully masked rows and user reports on one gloo world of 4 processes
(the worker is tests/_reliability_cases.py; see its docstring for what runs in which order)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _reliability_cases import AGREE_TIMEOUT_S, FAIL_TIMEOUT_S, FUZZ_EXAMPLES, SETUP_CASES, worker  # noqa: E402

from megatron_fcp.testing.launch import run_gloo  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def results():
    return run_gloo(worker, 4, timeout_s=300)


def _assert_refusal(results, section, name, field, odd):
    others = sorted(set(range(4)) - {odd})
    for r in results:
        kind, msg, seconds = r[section][name]
        assert kind == "FCPAgreementError", (r[section][name])
        assert f"'{field}' differs across the CP group" in msg, msg
        assert f"ranks {others} hold" in msg and f"ranks [{odd}] hold" in msg, msg
        assert seconds <= AGREE_TIMEOUT_S + 10, seconds


# ---- agreement at setup ---------------------------------------------------------------------------------
def test_setup_fcp_agrees_when_the_ranks_agree(results):
    assert all(r["setup"]["agree"] == ("", "", r["setup"]["agree"][2]) for r in results), [r["setup"]["agree"] for r in results]


@pytest.mark.parametrize("name", [n for n in SETUP_CASES if n != "agree"])
def test_setup_fcp_refuses_ranks_configured_differently(results, name):
    odd = SETUP_CASES[name][0]
    _assert_refusal(results, "setup", name, name, odd)


def test_setup_fcp_without_a_live_group_skips_the_agreement(results):
    assert all(r["setup"]["skipped_collectives"] == 0 for r in results)


# ---- agreement on first use of a plan ----------------------------------------------------------------------
@pytest.mark.parametrize("name,field,odd", [("plan", "plan", 1), ("block_size", "plan", 2), ("shape", "shape", 2),
                                            ("dtype", "dtype", 0), ("causal", "causal", 3)])
def test_fcp_attention_refuses_ranks_that_disagree(results, name, field, odd):
    _assert_refusal(results, "attention", name, field, odd)


def test_user_report_cp4_ranks_disagreeing_on_the_exchange_plan_refuse_instead_of_hanging(results):
    """A CP = 4 all-to-all hang traced to 'the CP ranks disagree on their exchange plan': rank 1
    runs the direct ("full", all-to-all) plan while the others run the ring; every rank refuses
    at once, naming the plan and who holds which, instead of posting transfers that never match."""
    _assert_refusal(results, "attention", "plan", "plan", 1)
    assert all(r["attention"]["agree"][0] == "" for r in results)


def test_a_rank_failing_its_own_checks_makes_its_peer_raise_within_the_timeout(results):
    kind0, msg0, s0 = results[0]["local_failure"]
    kind1, msg1, _ = results[1]["local_failure"]
    assert kind1 == "ValueError" and "local sequence length 3" in msg1, msg1
    assert kind0 == "FCPAgreementError" and f"did not complete within {FAIL_TIMEOUT_S:g} s" in msg0, msg0
    assert "[0, 1]" in msg0 and s0 <= FAIL_TIMEOUT_S + 10, (msg0, s0)


def test_one_rank_switching_plans_alone_never_hangs(results):
    """The limit of caching (megatron_fcp.attention.agreement, LastAgreed): a rank whose plan changed agrees,
    a peer whose plan did not skips; no named refusal then, but both raise within the timeout."""
    kind2, msg2, s2 = results[2]["switch_alone"]
    kind3, msg3, s3 = results[3]["switch_alone"]
    assert kind2 == "CommTimeout" and "plan 'ring'" in msg2, msg2
    assert kind3 == "FCPAgreementError" and "[2, 3]" in msg3, msg3
    assert s2 <= FAIL_TIMEOUT_S + 10 and s3 <= FAIL_TIMEOUT_S + 10, (s2, s3)


# ---- delay fuzzing -------------------------------------------------------------------------------------
def test_delay_fuzzing_never_changes_a_bit_for_a_fixed_plan(results):
    for r in results:
        f = r["fuzz"]
        assert f["examples"] == FUZZ_EXAMPLES and f["distinct"] >= 50, (f["examples"], f["distinct"])
        assert f["plans"] == ["full", "hierarchical", "ring"] and f["dtypes"] == ["bf16", "fp64"]
        assert f["messages"] > 0
        assert not f["mismatches"], f["mismatches"][:5]


def test_different_plans_agree_within_the_numerics_rule(results):
    for r in results:
        bad = [k for k, (ok64, ok16) in r["fuzz"]["cross"].items() if not (ok64 and ok16)]
        assert not bad, bad


# ---- fully masked rows through fcp_attention ------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["zigzag", "thd"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fully_masked_rows_give_zero_output_and_gradients_never_nan(results, layout, dtype):
    for rank, r in enumerate(results):
        rep = r["masked"][(layout, dtype)]
        assert rep["finite"], rep
        assert rep["masked_out_zero"] and rep["masked_dq_zero"] and rep["masked_lse_neginf"], rep
        assert rep["within_tol"], rep
    assert results[2]["masked"][(layout, dtype)]["masked_rows"] == results[2]["masked"][(layout, dtype)].get(
        "tokens", 8)  # every query of CP rank 2 is masked


def test_user_report_nan_loss_when_every_token_on_a_rank_is_masked(results):
    """Megatron-LM 1764: every token on one rank masked gave NaN; here CP rank 2's queries see no
    key at all (zigzag and packed, FP32 and BF16): its output and gradients are 0, nothing is NaN,
    and the other ranks' results are unchanged (the masked rows add nothing to dK/dV)."""
    for layout in ("zigzag", "thd"):
        for dtype in ("fp32", "bf16"):
            rep = results[2]["masked"][(layout, dtype)]
            assert rep["finite"] and rep["masked_out_zero"] and rep["masked_dq_zero"] and rep["within_tol"], rep


# ---- user reports ---------------------------------------------------------------------------------------
def test_user_report_sequence_of_length_7_at_cp2_is_not_treated_as_6(results):
    """TE 1929/1930: 7 tokens at cp = 2 were attended as 6. FCP's placement holds all 7 (4 + 3
    or similar) and the result matches single-device attention over all 7 tokens."""
    got = [results[r]["length7"] for r in (2, 3)]
    assert sum(g["tokens"] for g in got) == 7 and all(g["total"] == 7 for g in got)
    assert all(g["err"] <= 1e-12 for g in got), got


def test_user_report_packing_with_cp_keeps_the_document_mask(results):
    """Packing refused with CP because the document mask was dropped: FCP's packed CP attention is
    per-document attention (error <= 1e-12) and far from attention across documents."""
    per_rank = [r["document_mask"] for r in results]
    assert all(d["err_vs_documents"] <= 1e-12 for d in per_rank), per_rank
    # a rank holding only the first document's tokens sees no difference (nothing precedes them);
    # over the group, dropping the mask would have changed the output
    assert max(d["diff_vs_mask_dropped"] for d in per_rank) > 1e-2, per_rank
