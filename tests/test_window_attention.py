"""The whole engine under sliding windows: FP64 exactness at cp = 2, 3, 4, zigzag and packed.

Every case runs all CP ranks in the in-process harness (the production executor, the in-process
transport) and compares out, lse, dq, dk, dv with a single-device FP64 reference
(``reference_attention(..., window=)``; per document for packed batches). Plans are the causal
ones available today (``ring``, ``full``): they deliver more blocks than a window needs, so the
executor must skip the blocks no local query sees and stay exact. One gloo test runs zigzag
cp = 4 through autograd and real process groups (tests/_window_cases.py).
"""

from __future__ import annotations

import math
import threading
import types

import pytest
import torch

from megatron_fcp.attention.agreement import FCPAgreementError, LastAgreed
from megatron_fcp.attention.comm import CountingTransport
from megatron_fcp.attention.function import build_executor, resolve_mask
from megatron_fcp.attention.kernels import MathKernel, reference_attention
from megatron_fcp.attention.layout import zigzag_positions
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.placement import place_packed
from megatron_fcp.contract.plan import ring_plan
from megatron_fcp.testing.harness import QUANTITIES, _judge, harness_attention, per_document_reference
from megatron_fcp.testing.inprocess import run_ranks

F64 = torch.float64
DOCS = (3, 29, 1, 17, 40, 6, 11, 2)


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


def _zigzag_inputs(cp: int, chunk: int = 6, b: int = 2, h: int = 4, hk: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed + cp)
    s = 2 * cp * chunk
    return _randn(g, s, b, h, d), _randn(g, s, b, hk, d), _randn(g, s, b, hk, d), _randn(g, s, b, h, d)


def _packed_inputs(h: int = 4, hk: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(DOCS)
    return _randn(g, t, h, d), _randn(g, t, hk, d), _randn(g, t, hk, d), _randn(g, t, h, d)


def _assert_exact(res, ref: dict, tol: float = 1e-12) -> None:
    for n in QUANTITIES:
        got = res.gathered(n)
        assert not torch.isnan(got).any(), f"{n}: NaN"
        assert torch.isfinite(got).all(), f"{n}: non-finite (every row sees at least itself)"
        err = (got.double() - ref[n]).abs().max().item()
        assert err <= tol * max(1.0, ref[n].abs().max().item()), f"{n}: error {err:.3g}"


# windows against blocks of 6 tokens (one zigzag chunk per block), sequences of 24-48 tokens
ZIGZAG_WINDOWS = [
    ("w2-below-block", True, (2, 0)),
    ("w9-not-multiple", True, (9, 0)),
    ("w1000-beyond-seq", True, (1000, 0)),
    ("left4-right3", False, (4, 3)),
    ("left-unbounded-right5", False, (-1, 5)),
]


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("name, causal, window", ZIGZAG_WINDOWS, ids=[w[0] for w in ZIGZAG_WINDOWS])
@pytest.mark.parametrize("plan, backward_kv", [("ring", "keep"), ("full", "resend")])
def test_zigzag_windows_are_exact_in_fp64(cp, name, causal, window, plan, backward_kv):
    q, k, v, do = _zigzag_inputs(cp)
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do, window=window)
    res = harness_attention(q, k, v, do, cp=cp, plan=plan, causal=causal, softmax_scale=scale, kernel="math",
                            backward_kv=backward_kv, window=window)
    assert {r.backward_kv for r in res.ranks} == {backward_kv}
    _assert_exact(res, ref)


@pytest.mark.parametrize("kernel", ["math", "cpu-flash"])
def test_zigzag_window_with_sub_blocks_and_cpu_flash(kernel):
    """Two parts per chunk (sub-blocks of 3 and 4 tokens), GQA 4:1, both kernels; FP32 for cpu-flash."""
    cp = 4
    q, k, v, do = _zigzag_inputs(cp, chunk=7, hk=1)
    scale = 0.4
    dtype, tol = (F64, 1e-12) if kernel == "math" else (torch.float32, 1e-5)
    for causal, window in ((True, (5, 0)), (False, (3, 8))):
        ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do, window=window)
        res = harness_attention(*(x.to(dtype) for x in (q, k, v, do)), cp=cp,
                                plan=ring_plan(tuple(range(cp)), causal, parts_per_chunk=2).verify(), causal=causal,
                                softmax_scale=scale, kernel=kernel, window=window)
        _assert_exact(res, ref, tol)


PACKED_WINDOWS = [
    ("w2-below-block", True, (2, 0)),
    ("w7-not-multiple", True, (7, 0)),
    ("w1000-beyond-docs", True, (1000, 0)),
    ("left3-right2", False, (3, 2)),
]


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("name, causal, window", PACKED_WINDOWS, ids=[w[0] for w in PACKED_WINDOWS])
@pytest.mark.parametrize("backward_kv", ["keep", "resend"])
def test_packed_windows_are_exact_in_fp64(cp, name, causal, window, backward_kv):
    """A window inside each document, over a placement from place_packed (blocks of 5 tokens)."""
    q, k, v, do = _packed_inputs()
    scale = 1.0 / math.sqrt(q.shape[-1])
    pl = place_packed(DOCS, cp, block_tokens=5, causal=causal)
    ref = per_document_reference(q, k, v, do, DOCS, causal, scale, window=window)
    res = harness_attention(q, k, v, do, placement=pl, plan="full", causal=causal, softmax_scale=scale,
                            kernel="math", backward_kv=backward_kv, window=window)
    _assert_exact(res, ref)


def test_packed_window_on_cpu_flash():
    q, k, v, do = _packed_inputs(hk=1)
    pl = place_packed(DOCS, 3, block_tokens=5)
    ref = per_document_reference(q, k, v, do, DOCS, True, 0.35, window=(4, 0))
    res = harness_attention(*(x.float() for x in (q, k, v, do)), placement=pl, softmax_scale=0.35,
                            kernel="cpu-flash", window=(4, 0))
    _assert_exact(res, ref, 1e-5)


def test_a_window_beyond_the_sequence_is_bitwise_causal():
    q, k, v, do = _zigzag_inputs(3)
    a = harness_attention(q, k, v, do, cp=3, plan="ring", kernel="math")
    b = harness_attention(q, k, v, do, cp=3, plan="ring", kernel="math", window=(10_000, 0))
    assert all(torch.equal(a.gathered(n), b.gathered(n)) for n in QUANTITIES)


@pytest.mark.parametrize("kernel", ["math", "cpu-flash"])
def test_bf16_windows_meet_the_2x_rule(kernel):
    """BF16 against FP64: at most 2x plain BF16 attention's error (+ flash-attn's slack), under the cap."""
    cp = 4
    q, k, v, do = _zigzag_inputs(cp, chunk=8, d=16)
    scale = 0.25
    for causal, window in ((True, (5, 0)), (False, (6, 3))):
        ref = reference_attention(q, k, v, causal=causal, scale=scale, dout=do, window=window)
        base = reference_attention(*(x.bfloat16() for x in (q, k, v)), causal=causal, scale=scale,
                                   dout=do.bfloat16(), window=window)
        res = harness_attention(*(x.bfloat16() for x in (q, k, v, do)), cp=cp, plan="ring", causal=causal,
                                softmax_scale=scale, kernel=kernel, window=window)
        verdict = _judge({n: res.gathered(n) for n in QUANTITIES}, ref, base, torch.bfloat16)
        assert verdict["ok"], (causal, window, verdict["max_err"], verdict["bound"])
    q, k, v, do = _packed_inputs(d=16)
    pl = place_packed(DOCS, 3, block_tokens=5)
    ref = per_document_reference(q, k, v, do, DOCS, True, scale, window=(4, 0))
    base = per_document_reference(*(x.bfloat16() for x in (q, k, v, do)), DOCS, True, scale, window=(4, 0))
    res = harness_attention(*(x.bfloat16() for x in (q, k, v, do)), placement=pl, softmax_scale=scale,
                            kernel=kernel, window=(4, 0))
    verdict = _judge({n: res.gathered(n) for n in QUANTITIES}, ref, base, torch.bfloat16)
    assert verdict["ok"], (verdict["max_err"], verdict["bound"])


class CountingKernel(MathKernel):
    """The math kernel, recording ``(rank, key positions)`` of every call; the rank comes from the
    calling thread (the harness runs each virtual rank in its own thread). A call may compute
    several blocks (Note [One launch per owner and stage] in megatron_fcp.schedule.launches)."""

    def __init__(self) -> None:
        self.rank_of_thread: dict[int, int] = {}
        self.calls = {"forward": [], "backward": []}

    def _note(self, phase: str, k_pos) -> None:
        self.calls[phase].append((self.rank_of_thread[threading.get_ident()], k_pos.tolist()))

    def forward(self, q, k, v, q_pos, k_pos, mask, scale, **prep):
        self._note("forward", k_pos)
        return super().forward(q, k, v, q_pos, k_pos, mask, scale, **prep)

    def backward(self, dout, q, k, v, out, lse, q_pos, k_pos, mask, scale, **prep):
        self._note("backward", k_pos)
        return super().backward(dout, q, k, v, out, lse, q_pos, k_pos, mask, scale, **prep)


@pytest.mark.parametrize("plan, backward_kv", [("ring", "keep"), ("full", "resend")])
def test_blocks_without_a_visible_pair_are_received_but_not_computed(plan, backward_kv):
    """Under a (2, 0) window at cp = 4 a rank sees only its own chunks and the chunk before each;
    the causal plans deliver more. Those blocks arrive but get no kernel call, forward or backward."""
    cp, chunk = 4, 6
    q, k, v, do = _zigzag_inputs(cp, chunk)
    mask = Mask(True, 2, 0)
    kern = CountingKernel()

    def tap(rank, inner):
        kern.rank_of_thread[threading.get_ident()] = rank
        return CountingTransport(inner)

    res = harness_attention(q, k, v, do, cp=cp, plan=plan, kernel=kern, window=mask.window, transport=tap,
                            backward_kv=backward_kv)
    _assert_exact(res, reference_attention(q, k, v, causal=True, scale=1 / math.sqrt(8), dout=do,
                                           window=mask.window))
    for r in res.ranks:
        qp = zigzag_positions(2 * chunk, cp, r.index).numpy()
        runs = (qp[:chunk], qp[chunk:])
        visible = sorted(c * chunk for c in range(2 * cp)          # chunks with a visible pair (Mask.pairs)
                         if sum(int(mask.pairs(int(x[0]), int(x[-1]) + 1, c * chunk, (c + 1) * chunk)) for x in runs))
        for phase in ("forward", "backward"):                       # the blocks (chunks) of its calls
            computed = sorted(p for rank, keys in kern.calls[phase] if rank == r.rank for p in keys if p % chunk == 0)
            assert computed == visible, phase
        received = {p.transfer.block for p in r.transport.posted if p.phase == "forward" and p.kind == "recv"}
        assert len(received) + 2 > len(visible), "the causal plan delivers more than the window needs"


def test_bad_windows_fail_before_any_communication():
    q, k, v, do = _zigzag_inputs(2)
    for bad in ((-2, 0), (1, 2, 3), "wide", (0.5, None)):
        with pytest.raises(ValueError, match="window"):
            harness_attention(q, k, v, do, cp=2, window=bad, timeout_s=5.0)


def test_a_plan_built_for_another_mask_is_refused():
    plan = types.SimpleNamespace(mask=Mask(True, 8, 0))
    assert resolve_mask(True, (8, 0), plan) == Mask(True, 8, 0)
    with pytest.raises(ValueError, match=r"window=\(8, 0\)"):
        resolve_mask(True, (4, 0), plan)
    with pytest.raises(ValueError, match="placement"):
        resolve_mask(True, None, None, types.SimpleNamespace(mask=Mask(True, 8, 0)))
    # a plan for the mask without a window delivers a superset: it runs (the executor skips the rest)
    assert resolve_mask(True, (4, 0), types.SimpleNamespace(mask=Mask(True))) == Mask(True, 4, 0)
    assert resolve_mask(False, (4, 3), types.SimpleNamespace(mask=Mask(False))) == Mask(False, 4, 3)
    with pytest.raises(ValueError, match="rebuild the plan"):       # causal need sets lack later keys
        resolve_mask(False, (4, 3), types.SimpleNamespace(mask=Mask(True)))


def test_ranks_that_disagree_on_the_window_raise():
    q, k, v, _ = _zigzag_inputs(2)
    agreement = LastAgreed()

    def one(h):
        sl = slice(h.index * 12, (h.index + 1) * 12)
        try:
            build_executor(q[sl], k[sl], v[sl], cp_group=h, plan="ring", kernel="math", agreement=agreement,
                           window=(3, 0) if h.index == 0 else (4, 0), timeout_s=10.0)
        except FCPAgreementError as exc:
            return str(exc)
        return None

    msgs = run_ranks(2, one, timeout_s=30.0)
    assert all(m is not None and "window" in m for m in msgs), msgs


@pytest.mark.slow
@pytest.mark.dist
def test_gloo_zigzag_cp4_windows_through_autograd():
    """Real process groups (gloo), fcp_attention_with_lse + autograd, zigzag cp = 4, FP64."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import _window_cases

    for report in _window_cases.run():
        for case, errs in report.items():
            for n, (err, ref_max) in errs.items():
                assert err <= 1e-12 * max(1.0, ref_max), (case, n, err)


@pytest.mark.parametrize("backward_kv", ["keep", "resend"])
def test_compiled_plans_with_relays_stay_exact_under_a_window(backward_kv):
    """build_plan's spanning trees (relays, two parts per chunk) and, packed, a compiled plan over
    the placement: blocks a rank only relays, or receives but does not see, are not computed."""
    from megatron_fcp.planner.build import build_plan

    cp, ranks = 4, (0, 1, 2, 3)
    q, k, v, do = _zigzag_inputs(cp, chunk=8)
    plan = build_plan("pcie-box:1", ranks, "spanning", causal=True, parts_per_chunk=2)
    ref = reference_attention(q, k, v, causal=True, scale=0.3, dout=do, window=(3, 0))
    res = harness_attention(q, k, v, do, cp=cp, plan=plan, softmax_scale=0.3, kernel="math", window=(3, 0),
                            backward_kv=backward_kv)
    _assert_exact(res, ref)
    q, k, v, do = _packed_inputs()
    pl = place_packed(DOCS, cp, block_tokens=5, causal=False)
    plan = build_plan("pcie-box:1", ranks, "spanning", causal=False, placement=pl)
    ref = per_document_reference(q, k, v, do, DOCS, False, 0.3, window=(2, 3))
    res = harness_attention(q, k, v, do, placement=pl, plan=plan, causal=False, softmax_scale=0.3, kernel="math",
                            window=(2, 3), backward_kv=backward_kv)
    _assert_exact(res, ref)


def _plans_take_windows() -> bool:
    import inspect

    from megatron_fcp.contract.plan import full_plan
    return "window" in inspect.signature(full_plan).parameters


def _forward_bytes(res) -> int:
    return sum(p.nbytes for r in res.ranks for p in r.transport.posted if p.kind == "send" and p.phase == "forward")


@pytest.mark.skipif(not _plans_take_windows(), reason="plans carry no window here (the planner side of issue 27)")
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_windowed_plans_run_exactly_and_move_fewer_bytes(cp):
    """Plans built for the window (full_plan / halo_plan with window=, place_packed(window=)) run
    exactly, move fewer bytes than the causal plan, and a plan for another window is refused."""
    from megatron_fcp.contract.plan import full_plan, halo_plan

    ranks = tuple(range(cp))
    q, k, v, do = _zigzag_inputs(cp)
    s = q.shape[0]
    count = dict(transport=lambda rank, inner: CountingTransport(inner))
    for causal, window in ((True, (2, 0)), (True, (9, 0)), (False, (4, 3))):
        ref = reference_attention(q, k, v, causal=causal, scale=0.3, dout=do, window=window)
        causal_full = harness_attention(q, k, v, do, cp=cp, plan="full", causal=causal, softmax_scale=0.3,
                                        kernel="math", window=window, **count)
        for make, backward_kv in ((full_plan, "keep"), (halo_plan, "resend")):
            plan = make(ranks, causal, window=window, seq_len=s).verify()
            res = harness_attention(q, k, v, do, cp=cp, plan=plan, causal=causal, softmax_scale=0.3, kernel="math",
                                    window=window, backward_kv=backward_kv, **count)
            _assert_exact(res, ref)
            assert _forward_bytes(res) <= _forward_bytes(causal_full)
        with pytest.raises(ValueError, match="rebuild the plan"):
            harness_attention(q, k, v, do, cp=cp, plan=full_plan(ranks, causal, window=window, seq_len=s).verify(),
                              causal=causal, window=(window[0] + 1, window[1]), timeout_s=5.0)
    q, k, v, do = _packed_inputs()
    for causal, window in ((True, (3, 0)), (False, (2, 3))):
        pl = place_packed(DOCS, cp, block_tokens=5, causal=causal, window=window)
        ref = per_document_reference(q, k, v, do, DOCS, causal, 0.3, window=window)
        res = harness_attention(q, k, v, do, placement=pl, plan=full_plan(ranks, causal, placement=pl).verify(),
                                causal=causal, softmax_scale=0.3, kernel="math", window=window)
        _assert_exact(res, ref)
