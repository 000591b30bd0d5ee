"""The in-process multi-rank harness: virtual groups, the in-process transport, failure handling,
and the ready-made numerics matrix (megatron_fcp.testing.inprocess, megatron_fcp.testing.harness).

The numerics matrix itself runs through the harness in tests/test_attention_dist.py,
tests/test_attention_thd.py and tests/test_backward_kv.py; the harness-vs-gloo bit-for-bit cases
are in tests/test_attention_dist.py (they share its gloo world).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_fcp.attention.agreement import FCPAgreementError, LastAgreed, agree
from megatron_fcp.attention.function import fcp_attention_with_lse
from megatron_fcp.testing.harness import QUANTITIES, check_numerics_cases, harness_attention
from megatron_fcp.attention.comm import CommTimeout, CountingTransport, default_transport
from megatron_fcp.attention.groups import group_membership
from megatron_fcp.testing.inprocess import InProcessGroup, InProcessTransport, RankFailed, TransferMismatch, run_ranks
from megatron_fcp.contract.blocks import Block, Transfer
from megatron_fcp.contract.placement import place_packed
from megatron_fcp.contract.plan import full_plan, ring_plan


def _exchange(h, sends, recvs, *, round_index=0, phase="forward", timeout_s=5.0):
    tr = h.transport(timeout_s)
    handle = tr.post(sends, recvs, round_index=round_index, phase=phase)
    tr.wait(handle)


def test_blocks_travel_in_plan_order_between_threads():
    """Two sends from 0 to 1 in one round meet the two receives in order; the receiver gets copies."""
    t0, t1 = Transfer(0, 1, Block(0, 0)), Transfer(0, 1, Block(0, 1))
    a, b = torch.arange(6.0).view(2, 3), torch.arange(6.0, 12.0).view(2, 3)

    def fn(h):
        if h.rank == 0:
            _exchange(h, [(t0, a), (t1, b)], [])
            return None
        bufs = [torch.empty(2, 3), torch.empty(2, 3)]
        _exchange(h, [], [(t0, bufs[0]), (t1, bufs[1])])
        return bufs

    _, got = run_ranks(2, fn)
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    assert got[0].data_ptr() != a.data_ptr()  # copied into the receiver's own buffer


def test_test_is_non_blocking_and_receives_match_posts_waited_in_any_order():
    """``test`` is False until the peer's send is posted (receiver) or taken (sender), then True;
    two rounds under the same (phase, round, pair) -- two waves' reductions -- meet their sends
    in post order even when the receiver waits the second first."""
    t = Transfer(0, 1, Block(0, 0))
    first, second = torch.full((3,), 1.0), torch.full((3,), 2.0)
    posted, taken = threading.Event(), threading.Event()

    def fn(h):
        tr = h.transport(5.0)
        if h.rank == 0:
            posted.wait(5)                                       # the receiver tested before any send
            a = tr.post([(t, first)], [], round_index=1, phase="backward")
            b = tr.post([(t, second)], [], round_index=1, phase="backward")
            early = tr.test(a)                                   # not taken yet
            taken.wait(5)
            done = tr.test(a) and tr.test(b)
            tr.wait(a)
            tr.wait(b)
            return early, done
        bufs = [torch.empty(3), torch.empty(3)]
        a = tr.post([], [(t, bufs[0])], round_index=1, phase="backward")
        b = tr.post([], [(t, bufs[1])], round_index=1, phase="backward")
        before = tr.test(a)
        posted.set()
        while not tr.test(b):
            time.sleep(0.001)
        tr.wait(b)                                               # the second posted, waited first
        tr.wait(a)
        taken.set()
        return before, bufs

    (early, done), (before, bufs) = run_ranks(2, fn)
    assert before is False and early is False and done is True
    assert torch.equal(bufs[0], first) and torch.equal(bufs[1], second)


def test_a_receive_that_never_arrives_raises_comm_timeout_naming_phase_round_peer_block():
    def fn(h):
        if h.rank == 2:
            _exchange(h, [], [(Transfer(1, 2, Block(1, 0, 1)), torch.empty(4))], round_index=3, phase="backward",
                      timeout_s=0.3)

    t = time.monotonic()
    with pytest.raises(CommTimeout, match=r"backward round 3: receive from rank 1 of B\(r1,c0,p1\)"):
        run_ranks((0, 1, 2), fn, timeout_s=30)
    assert time.monotonic() - t < 10


def test_a_send_nobody_receives_raises_comm_timeout():
    def fn(h):
        if h.rank == 0:
            _exchange(h, [(Transfer(0, 1, Block(0, 1)), torch.ones(3))], [], round_index=1, timeout_s=0.3)

    with pytest.raises(CommTimeout, match=r"forward round 1: send to rank 1 of B\(r0,c1,p0\)"):
        run_ranks(2, fn)


def test_an_exception_in_one_rank_is_reraised_and_releases_the_others():
    """Rank 1 raises at once; ranks 0 and 2 wait (60 s bound) for blocks it never sends: they are
    released at once with RankFailed and the caller sees rank 1's own error."""
    released = []

    def fn(h):
        if h.rank == 1:
            raise KeyError("boom on rank 1")
        try:
            _exchange(h, [], [(Transfer(1, h.rank, Block(1, 0)), torch.empty(2))], timeout_s=60)
        except RankFailed as e:
            released.append((h.rank, str(e)))
            raise

    t = time.monotonic()
    with pytest.raises(KeyError, match="boom on rank 1") as info:
        run_ranks(3, fn)
    assert time.monotonic() - t < 10
    assert sorted(r for r, _ in released) == [0, 2]
    assert all("virtual rank 1 failed" in msg for _, msg in released)
    assert any("virtual rank 1" in note for note in getattr(info.value, "__notes__", []))


def test_ranks_running_different_plans_fail_with_a_mismatch_not_a_hang():
    def fn(h):
        if h.rank == 0:
            _exchange(h, [(Transfer(0, 1, Block(0, 0)), torch.ones(2, 2))], [])
        else:
            _exchange(h, [], [(Transfer(0, 1, Block(0, 1)), torch.empty(2, 2))])

    with pytest.raises(TransferMismatch, match="different plans"):
        run_ranks(2, fn)


def test_a_rank_that_never_finishes_is_reported_by_the_runner():
    stop = threading.Event()

    def fn(h):
        if h.rank == 1:
            stop.wait(20)  # stuck in compute, not in a wait: the runner's bound reports it
    try:
        with pytest.raises(CommTimeout, match=r"virtual ranks \[1\] .* did not finish within 0.5 s"):
            run_ranks(2, fn, timeout_s=0.5)
    finally:
        stop.set()


def test_virtual_groups_are_cp_groups_without_torch_distributed():
    import torch.distributed as dist

    assert not dist.is_initialized()
    group = InProcessGroup((1, 3))
    h = group.handle(3)
    assert group_membership(h) == ((1, 3), 3)
    assert isinstance(default_transport(h), InProcessTransport)
    with pytest.raises(ValueError, match="not initialised.*run_ranks"):
        group_membership(None)
    with pytest.raises(ValueError, match="rank 2 is not in the in-process group"):
        group.handle(2)
    with pytest.raises(ValueError, match="distinct ranks"):
        InProcessGroup((0, 0))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            InProcessGroup(2, device="cuda")


def test_validation_runs_per_virtual_rank_before_any_post():
    """A plan over other ranks is refused on every virtual rank before anything is posted."""
    posts = []

    def fn(h):
        tr = CountingTransport(h.transport(5))
        q = torch.randn(8, 1, 2, 4)
        try:
            fcp_attention_with_lse(q, q, q, cp_group=h, plan=ring_plan((0, 1)), transport=tr, agreement=None)
        finally:
            posts.append(tr.posts)

    with pytest.raises(ValueError, match="not the CP group's ranks"):
        run_ranks((1, 3), fn)
    assert posts == [0, 0]


def test_in_process_agreement_names_the_differing_field_and_ranks():
    def fn(h):
        return agree({"plan": "ring", "shape": 8 if h.rank != 2 else 16}, h, timeout_s=5)

    with pytest.raises(FCPAgreementError, match=r"'shape' differs.*ranks \[0, 1\].*ranks \[2\]"):
        run_ranks(3, fn)
    digests = run_ranks(3, lambda h: agree({"plan": "ring"}, h, timeout_s=5))
    assert len(set(digests)) == 1


def test_an_agreement_a_rank_never_joins_times_out():
    def fn(h):
        if h.rank == 0:
            agree({"plan": "ring"}, h, timeout_s=0.3)

    with pytest.raises(FCPAgreementError, match=r"ranks \[1\] never reached it"):
        run_ranks(2, fn)


def test_fcp_attention_agrees_in_process_and_skips_repeats():
    """The engine's default agreement (LastAgreed) works on a virtual group: one in-process
    all-gather the first time, none when the same facts repeat."""
    agreement = LastAgreed()
    ran = []

    def fn(h):
        x = torch.randn(8, 1, 2, 4, generator=torch.Generator().manual_seed(h.rank))
        for _ in range(2):
            before = h.group._gather_calls[h.rank]
            fcp_attention_with_lse(x, x, x, cp_group=h, plan="full", agreement=agreement)
            ran.append(h.group._gather_calls[h.rank] - before)

    run_ranks(2, fn)
    assert sorted(ran) == [0, 0, 1, 1]


@pytest.mark.parametrize("packed", [False, True], ids=["zigzag", "packed"])
def test_gathered_results_are_the_unsharded_tensors(packed):
    g = torch.Generator().manual_seed(5)
    if packed:
        pl = place_packed([7, 20, 5], 3, block_tokens=4)
        shapes, kw = [(32, 2, 8), (32, 1, 8)], dict(placement=pl, plan=full_plan((0, 1, 2), True, placement=pl))
    else:
        shapes, kw = [(24, 1, 2, 8), (24, 1, 1, 8)], dict(cp=3, plan="ring")
    q, do = (torch.randn(*shapes[0], generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(*shapes[1], generator=g, dtype=torch.float64) for _ in range(2))
    res = harness_attention(q, k, v, do, **kw)
    lse_shape = (q.shape[1], q.shape[0]) if packed else (q.shape[1], q.shape[2], q.shape[0])  # [h, T] / [b, h, s]
    want = {"out": q.shape, "dq": q.shape, "dk": k.shape, "dv": k.shape, "lse": lse_shape}
    assert {n: tuple(res.gathered(n).shape) for n in QUANTITIES} == {n: tuple(s) for n, s in want.items()}
    no_grad = harness_attention(q, k, v, **kw)  # forward only: no gradients, same output
    assert no_grad.ranks[0].dq is None and torch.equal(no_grad.gathered("out"), res.gathered("out"))


@pytest.mark.parametrize("dtype, kernel", [(torch.float64, "math"), (torch.float32, "cpu-flash"),
                                           (torch.bfloat16, "math"), (torch.bfloat16, "cpu-flash")],
                         ids=["fp64-math", "fp32-cpu-flash", "bf16-math", "bf16-cpu-flash"])
def test_check_numerics_cases_meet_their_bounds(dtype, kernel):
    """The ready-made cp = 4 matrix a GPU check script calls (here on CPU, small sizes)."""
    rows = check_numerics_cases("cpu", dtype, kernel, tokens=64, heads=4, head_dim=16)
    assert [r["layout"] for r in rows] == ["zigzag"] * 3 + ["packed"] * 2
    for r in rows:
        assert set(r["max_err"]) == set(QUANTITIES) and r["dtype"] == str(dtype)
        assert r["ok"], (r["case"], r["max_err"], r["bound"])
        assert all(0 < r["bound"][n] for n in QUANTITIES)


def test_the_module_prints_the_matrix_as_json(capsys):
    import json

    from megatron_fcp.testing.harness import main

    assert main(["--device", "cpu", "--dtype", "fp64", "--tokens", "32", "--heads", "2", "--head-dim", "8"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 5 and all(r["ok"] and r["device"] == "cpu" for r in rows)
