"""The head-parallel stage (attention.head_parallel) on a real 4-process gloo world, cp = 4.

Degrees a = 2 (two head groups, KV stage over two virtual ranks) and a = 4 (one head group: plain
Ulysses, attention local over the whole sequence), plus a = 1 (no all-to-all, the KV stage over
the zigzag placement, or compile_head_parallel's degree-1 zigzag plan run as plain FCP, its chunks
cut into uneven parts). MHA and GQA including h_kv = 1 and h_kv not divisible by a (KV heads
replicated: h = 6, h_kv = 3 at a = 2; h = 8, h_kv = 2 / 1 and h = 12, h_kv = 3 at a = 4), causal
and not; KV-stage plans full_plan, and build_plan's ring and hierarchical graphs over the group
placement. Tolerances as tests/test_attention_dist.py: FP64 <= 1e-12 and FP32 <= 1e-5 (times
max(1, max|ref|)); BF16 by the 2x rule (error <= 2 x plain BF16 PyTorch attention's error + the
rounding slack) and a 2^-6 relative cap. The KV stage's transfers are counted against its plan,
the all-to-all bytes against head_parallel_bytes, and bad input must be refused before any
communication.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _attention_cases import assert_within_tolerance  # noqa: E402
from _head_parallel_cases import QUANTITIES, Case, worker  # noqa: E402

from megatron_fcp.testing.launch import run_gloo  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HEADS = {2: ((4, 4), (8, 2), (4, 1), (6, 3)), 4: ((8, 8), (8, 2), (8, 1), (12, 3))}
CASES = [
    Case(a, "full", causal, heads, dtype)
    for a in (2, 4) for heads in HEADS[a] for causal in (True, False) for dtype in ("fp64", "fp32", "bf16")
] + [  # compiled KV-stage plans over the group placement
    Case(2, kv, causal, (4, 2), dtype)
    for kv in ("ring", "hierarchical", "auto") for causal in (True, False) for dtype in ("fp64", "fp32")
] + [  # a = 1: no head-parallel stage, the KV stage over the zigzag placement
    Case(1, kv, causal, (4, 2), "fp64") for kv in ("full", "ring") for causal in (True, False)
] + [  # a = 1 from compile_head_parallel: plain FCP over its zigzag plan, uneven sub-blocks (1, 1, 2 tokens)
    Case(1, "zigzag", causal, (4, 2), dtype) for causal in (True, False) for dtype in ("fp64", "bf16")
] + [  # head groups (1, 0), (3, 2): member order is not the process groups' rank order
    Case(2, "full", causal, (4, 1), "fp64", swapped=True) for causal in (True, False)
] + [  # MLA: V's head size 4 or 12 against q/k's 8, in the KV stage (a = 2, with and without GQA) and a = 4
    Case(a, "full", True, heads, dtype, d_v=dv)
    for a, heads, dv in ((2, (4, 2), 4), (2, (4, 4), 12), (4, (8, 2), 4)) for dtype in ("fp64", "bf16")
] + [  # the fused CPU flash block kernel in the KV stage (a = 2) and over the whole sequence (a = 4)
    Case(a, "full", True, heads, dtype, kernel="cpu-flash")
    for a, heads in ((2, (6, 3)), (4, (8, 2))) for dtype in ("fp32", "bf16")
]


@pytest.fixture(scope="module")
def results():
    return run_gloo(worker, 4, CASES, timeout_s=480)


def _max(per_rank, name, key):
    return {n: max(r[name][key][n] for r in per_rank) for n in QUANTITIES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_fp64_reference(results, case):
    err, ref = _max(results, case.name, "err"), _max(results, case.name, "ref_max")
    assert all(r[case.name]["finite"] for r in results), "NaN/inf in out, lse or grads"
    bf16 = case.dtype == "bf16"
    assert_within_tolerance(err, ref, _max(results, case.name, "base_err") if bf16 else None,
                            _max(results, case.name, "atol") if bf16 else None, case.dtype,
                            results[0][case.name]["dtypes"])


@pytest.mark.parametrize("case", [c for c in CASES if c.degree != 4], ids=lambda c: c.name)
def test_kv_stage_runs_exactly_its_plan(results, case):
    for rank, r in enumerate(results):
        posted, want = r[case.name]["stage_posts"]
        assert posted == want and want[0] > 0, f"rank {rank}: forward posts, forward set, backward set {posted}; " \
            f"the KV-stage plan lists {want[0]}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_all_to_all_bytes(results, case):
    from megatron_fcp.attention.head_parallel import head_parallel_bytes
    from _head_parallel_cases import make_hp_plan  # noqa: PLC0415

    h, hk = case.heads
    s_local, elem = 2 * case.tokens, {"fp64": 8, "fp32": 4, "bf16": 2}[case.dtype]
    hp = make_hp_plan((0, 1, 2, 3), case.degree, 4 * s_local, case.causal, "full", h, hk, swapped=case.swapped)
    fwd = head_parallel_bytes(hp, s_local, 2, h, hk, 8, elem, v_head_dim=case.d_v)
    fwd_lse = head_parallel_bytes(hp, s_local, 2, h, hk, 8, elem, with_lse=True, v_head_dim=case.d_v)
    assert all(r[case.name]["a2a_bytes"] == fwd_lse + fwd for r in results)  # forward (+ LSE) and backward
    assert (fwd > 0) == (case.degree > 1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_q_all_to_all_goes_behind_the_kv_stage(results, case):
    """Note [Q's all-to-all behind the KV stage]: with a KV stage, K|V's all-to-all, then the stage's
    first round posted, then Q's all-to-all finished; without one (a = cp), one Q|K|V all-to-all."""
    for r in results:
        order = r[case.name]["a2a_order"]
        if case.degree == 1:
            assert order and all(e.startswith("post") for e in order)   # no all-to-all at all
        elif case.degree == 4:  # one head group: no KV stage
            assert order[:2] == ["q|k|v forward", "out forward"]
        else:
            assert order.index("k|v forward") < order.index("post forward 0") < order.index("q forward")
            assert "q|k|v forward" not in order


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dq_all_to_all_goes_ahead_of_dk_dv(results, case):
    """Note [dQ's all-to-all ahead of dK|dV's]: with a KV stage, dQ's all-to-all is posted at the
    stage's last job, before the stage's last round is waited, and dK|dV's after the stage; without
    one (a = cp), one dQ|dK|dV all-to-all. (Bitwise the same gradients as TE's order:
    test_out_only_entry_point_matches.)"""
    for r in results:
        order = r[case.name]["a2a_order_backward"]
        if case.degree == 1:
            assert not any(e.startswith("start ") for e in order)          # no all-to-all at all
        elif case.degree == 4:
            assert [e for e in order if e.startswith("start ")] == ["start dout backward", "start dq|dk|dv backward"]
        else:
            starts = [e for e in order if e.startswith("start ")]
            assert starts == ["start dout backward", "start dq backward", "start dk|dv backward"], order
            dq = order.index("start dq backward")
            last_wait = len(order) - 1 - order[::-1].index("wait")
            assert order.index("post backward 0") < dq < last_wait < order.index("start dk|dv backward"), order


def test_out_only_entry_point_matches(results):
    checked = [r[c.name]["out_only_equal"] for c in CASES for r in results if "out_only_equal" in r[c.name]]
    assert len(checked) == 4 * sum(c.dtype == "fp64" for c in CASES) and all(checked)
    serial = [r[c.name]["serial_q_equal"] for c in CASES for r in results if "serial_q_equal" in r[c.name]]
    assert len(serial) == len(checked) and all(serial)  # overlap_q=False (TE's order): bitwise the same out
    grads = [r[c.name]["serial_grads_equal"] for c in CASES for r in results if "serial_grads_equal" in r[c.name]]
    assert len(grads) == len(checked) and all(grads)    # ... and the same dq, dk, dv


def test_groups_are_the_plans(results):
    assert [r["groups"] for r in results] == [{"head": [0, 1], "kv": [0, 2]}, {"head": [0, 1], "kv": [1, 3]},
                                              {"head": [2, 3], "kv": [0, 2]}, {"head": [2, 3], "kv": [1, 3]}]


def test_bad_input_raises_before_any_communication(results):
    """Each refusal is a ValueError naming the fix; the bad calls run first on every rank, so any
    communication before a refusal would have derailed every case after them."""
    for r in results:
        for name, (msg, expect) in r["bad_inputs"].items():
            assert msg.startswith(("ValueError", "PlanError")), f"{name}: {msg}"
            assert re.search(expect, msg), f"{name}: {msg!r} does not mention {expect!r}"


def test_all_to_all_on_gloo_is_per_peer_and_exact(results):
    """Note [All-to-all on gloo]: isend/irecv per peer equals all_to_all_single bitwise, and a head
    group listed in another order than the process group's gets each slot to its member."""
    assert [r["pairwise_a2a"] for r in results] == [(True, True)] * 4


def test_bounded_all_to_all_wait_names_the_head_group(results):
    msg = results[0]["timeout"]
    assert msg is not None and "head-parallel all-to-all (probe) over ranks [0, 1]" in msg, msg
    assert "did not complete within 0.5 s" in msg, msg
