"""RoundWatch: a posted round is waited on a watcher thread so that ``test`` can answer; the caller's
``wait`` re-raises what the wait raised, and waits the round itself when every watcher is busy
(Note [Testing a gloo round]). The real gloo round is in tests/test_attention_dist.py."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_fcp.attention import gloo_watch
from megatron_fcp.attention.comm import CommTimeout
from megatron_fcp.attention.gloo_watch import RoundWatch


def _until(pred, timeout_s: float = 5.0) -> bool:
    t0 = time.monotonic()
    while not pred() and time.monotonic() - t0 < timeout_s:
        time.sleep(0.002)
    return pred()


def test_a_watcher_waits_the_round_and_done_says_so():
    release = threading.Event()
    seen = []
    watch = RoundWatch(lambda: (release.wait(5), seen.append(threading.current_thread().name)))
    time.sleep(0.05)
    assert not watch.done()  # still in flight
    release.set()
    assert _until(watch.done)
    watch.wait()  # at once
    assert seen and seen[0].startswith("fcp-gloo-watch-")  # waited on a watcher, not by the caller
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("fcp-gloo-watch-"))


def test_wait_reraises_the_watchers_error():
    def fail():
        raise CommTimeout("backward round 2: receive from rank 3 of B(r3,c0,p0) did not complete")

    watch = RoundWatch(fail)
    assert _until(watch.done)  # a failed round counts as done: wait raises
    with pytest.raises(CommTimeout, match="round 2: receive from rank 3"):
        watch.wait()


def test_the_caller_waits_a_round_no_watcher_took():
    release = threading.Event()
    busy = [RoundWatch(lambda: release.wait(5)) for _ in range(gloo_watch.WATCHERS)]
    assert _until(lambda: all(w._claimed for w in busy))  # every watcher blocked on a round
    ran_on = []
    late = RoundWatch(lambda: ran_on.append(threading.current_thread().name))
    assert not late.done()
    late.wait()  # claimed by the caller: runs here, not behind the busy watchers
    assert ran_on == [threading.current_thread().name] and late.done()
    release.set()
    for w in busy:
        w.wait()
    assert all(w.done() for w in busy)


def test_a_work_is_waited_once_and_every_waiter_gets_that_answer():
    class Work:
        calls = 0

        def wait(self, timeout=None):
            Work.calls += 1
            time.sleep(0.05)
            return True

    once = gloo_watch.OnceWork(Work())
    assert not once.is_completed()
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(once.wait())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [True, True, True] and Work.calls == 1 and once.is_completed()

    class Broken:
        def wait(self, timeout=None):
            raise RuntimeError("Connection closed by peer")

    bad = gloo_watch.OnceWork(Broken())
    for _ in range(2):  # the first wait's error, every time
        with pytest.raises(RuntimeError, match="closed by peer"):
            bad.wait()
    assert bad.is_completed()


def test_a_batch_posts_every_receive_before_any_send(monkeypatch):
    """Note [Receives first across rounds]: GlooTransport.post_batch; a wrapper that changes post()
    posts round by round, one that does not passes the batch on."""
    import torch

    from megatron_fcp.attention import comm
    from megatron_fcp.attention.comm import CountingTransport, GlooTransport, RoundPost, TransportWrapper
    from megatron_fcp.contract.blocks import Block, Transfer

    calls = []

    class Done:
        def wait(self, timeout=None):
            return True

    monkeypatch.setattr(comm.dist, "irecv", lambda t, src, group: calls.append(("recv", src)) or Done())
    monkeypatch.setattr(comm.dist, "isend", lambda t, dst, group: calls.append(("send", dst)) or Done())
    x = torch.zeros(4)
    reduce_ = RoundPost([(Transfer(4, 0, Block(4, 0)), x)], [], 1, "backward")          # send only
    resend = RoundPost([], [(Transfer(0, 4, Block(0, 2)), x)], 1, "resend")             # receive only
    relay = RoundPost([(Transfer(4, 5, Block(0, 2)), x)], [(Transfer(6, 4, Block(6, 0)), x)], 2, "backward")
    tr = GlooTransport(group=None, timeout_s=5)
    handles = tr.post_batch([reduce_, resend, relay])
    assert calls == [("recv", 0), ("recv", 6), ("send", 0), ("send", 5)]
    assert [(h.phase, h.round_index, [k for k, _, _ in h.works]) for h in handles] == [
        ("backward", 1, ["send"]), ("resend", 1, ["recv"]), ("backward", 2, ["recv", "send"])]
    for h in handles:
        tr.wait(h)
        assert tr.test(h)
    calls.clear()
    TransportWrapper(tr).post_batch([reduce_, resend])                    # passed on: receives first
    assert calls == [("recv", 0), ("send", 0)]
    calls.clear()
    counting = CountingTransport(tr)                                      # changes post(): round by round
    counting.post_batch([reduce_, resend])
    assert calls == [("send", 0), ("recv", 0)] and counting.posts == 2


def test_no_watcher_keeps_a_round_alive_once_it_is_waited():
    """Note [Watchers hold nothing between rounds]: rounds run by watchers, rounds the caller claimed
    first (a watcher then fails to claim them) and failed rounds are all freed once the caller drops
    them, so nothing (a transport, its process group, works with tensors) outlives the caller."""
    import gc
    import weakref

    class Payload:  # stands for the transport and the round's works
        pass

    def make(i):
        payload = Payload()

        def wait_works():
            if i % 3 == 2:
                raise CommTimeout(f"round {i} failed")
            return payload

        return RoundWatch(wait_works), weakref.ref(payload)

    made = [make(i) for i in range(3 * gloo_watch.WATCHERS)]
    refs = [ref for _, ref in made]
    for watch, _ in made:
        try:
            watch.wait()
        except CommTimeout:
            pass
    del made, watch

    def all_freed():  # a failed round is a cycle (watch, error, traceback): freed by the collector
        gc.collect()
        return all(ref() is None for ref in refs)

    assert _until(all_freed), \
        f"{sum(ref() is not None for ref in refs)} rounds still held after their waits"


def _rounds_then_destroy(rank: int, world_size: int) -> bool:
    """Three real gloo rounds on a fresh group, then ``destroy_process_group(group)``: is the group
    freed (nothing, watchers included, still holds it)?"""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from megatron_fcp.attention.comm import GlooTransport
    from megatron_fcp.contract.blocks import Block, Transfer

    group = dist.new_group(list(range(world_size)))
    transport = GlooTransport(group, timeout_s=30)
    transfer = Transfer(0, 1, Block(0, 0, 0))
    for i in range(3):
        sends = [(transfer, torch.ones(1000))] if rank == 0 else []
        recvs = [(transfer, torch.empty(1000))] if rank == 1 else []
        transport.wait(transport.post(sends, recvs, round_index=i))
    group_ref = weakref.ref(group)
    del transport
    dist.destroy_process_group(group)
    del group

    def freed():
        gc.collect()
        return group_ref() is None

    return _until(freed, timeout_s=2.0)


def test_destroy_process_group_frees_a_group_fcp_rounds_ran_on():
    """Note [Watchers hold nothing between rounds], on real gloo: after ``destroy_process_group`` the
    group (with its C++ threads) is gone, not kept into interpreter finalization by a watcher."""
    from megatron_fcp.testing.launch import run_gloo

    assert run_gloo(_rounds_then_destroy, 2, timeout_s=120) == [True, True]
