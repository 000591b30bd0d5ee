"""Host synchronisations of the executor, counted on CPU with a CUDA-like fake stream.

Note [No host synchronisation in the steady state] (megatron_fcp/attention/device_clock.py): the
forward and both backward runners wait for the device only right before a post that sends on a
transport that reads the buffers on the host (gloo), never per job. Here every rank's executor
runs the real :class:`~megatron_fcp.attention.device_clock.CudaClock` on a fake CUDA API whose
events and streams record every ``synchronize`` (``torch.cuda.synchronize`` is patched to record
too), through the in-process harness: forward + backward, chain (ring) and waves (hierarchical
with sub-blocks, packed), keep and resend, on a gloo-like (``reads_host``) and an NCCL-like
transport. The fake device answers "not yet" to the first query of each mark, so the wave pump's
pacing loop (Note [Polling on the device's clock]) runs; results stay bitwise those of the plain
run.
"""

from __future__ import annotations

import threading

import pytest
import torch

from _backward_kv_cases import case_setup
from megatron_fcp.attention.device_clock import CudaClock, DeviceClock, clock_for, reads_host
from megatron_fcp.testing.harness import harness_attention
from megatron_fcp.attention.kernels import MathKernel
from megatron_fcp.attention.comm import GlooTransport, TransportWrapper

SYNC = "sync"


class _Log:
    """One list of events per virtual rank (its thread)."""

    def __init__(self) -> None:
        self.by_thread: dict[str, list] = {}
        self.lock = threading.Lock()

    def add(self, *entry) -> None:
        with self.lock:
            self.by_thread.setdefault(threading.current_thread().name, []).append(entry)


class _FakeCuda:
    """A CUDA-like API on CPU: ``Event`` (record / query / synchronize) and ``current_stream``
    (synchronize / wait_event). Every host synchronisation is logged; an event answers its first
    query "not yet" (the device is behind the host), then "done"."""

    def __init__(self, log: _Log) -> None:
        self.log, self.queries = log, 0
        api = self

        class Stream:
            def synchronize(self):
                api.log.add(SYNC, "stream.synchronize")

            def wait_event(self, ev):                               # device-side: no host wait
                api.log.add("wait_event")

        class Event:
            def __init__(self):
                self.asked = False

            def record(self, stream):
                assert isinstance(stream, Stream)

            def query(self):
                api.queries += 1
                done, self.asked = self.asked, True
                return done

            def synchronize(self):
                api.log.add(SYNC, "event.synchronize")

        self.Event, self._stream = Event, Stream()

    def current_stream(self, device=None):
        assert device is None or torch.device(device).type == "cuda"
        return self._stream


class _ClockedKernel(MathKernel):
    """The math kernel on a fake CUDA device: each virtual rank's thread gets its own
    :class:`CudaClock` over the fake API; every job is logged."""

    def __init__(self, log: _Log) -> None:
        self.log, self.apis, self._local = log, [], threading.local()

    @property
    def clock(self):
        if not hasattr(self._local, "clock"):
            api = _FakeCuda(self.log)
            self.apis.append(api)
            self._local.clock = CudaClock(torch.device("cuda"), api.Event, api.current_stream)
        return self._local.clock

    def forward(self, *a, **kw):
        self.log.add("job", "forward")
        return super().forward(*a, **kw)

    def backward(self, *a, **kw):
        self.log.add("job", "backward")
        return super().backward(*a, **kw)


class _Recording(TransportWrapper):
    """Logs every post call (one entry per ``post`` or ``post_batch``: phase, whether it sends);
    ``host``: gloo-like (``reads_host``) or NCCL-like."""

    def __init__(self, inner, log: _Log, host: bool) -> None:
        super().__init__(inner)
        self.log, self.host = log, host

    @property
    def reads_host(self) -> bool:
        return self.host

    def post(self, round_sends, round_recvs, *, round_index, phase="forward"):
        self.log.add("post", phase, bool(round_sends))
        return self.inner.post(round_sends, round_recvs, round_index=round_index, phase=phase)

    def post_batch(self, posts):
        self.log.add("post", posts[0].phase if posts else "", any(p.sends for p in posts))
        return self.inner.post_batch(posts)


def _phase(p: str) -> str:
    return "forward" if p == "forward" else "backward"


def _count(entries: list) -> dict:
    """Per phase (forward, backward): host syncs, posts that send, jobs; and whether every sync
    came right before a post that sends."""
    c = {ph: {"syncs": 0, "sending_posts": 0, "jobs": 0} for ph in ("forward", "backward")}
    phase, pending, ok = "forward", 0, True
    for e in entries:
        if e[0] == "job":
            phase = e[1]
            c[phase]["jobs"] += 1
            ok &= pending == 0                     # a sync with no post behind it: a per-job sync
        elif e[0] == SYNC:
            pending += 1
        elif e[0] == "post":
            ph = _phase(e[1])
            c[ph]["sending_posts"] += e[2]
            c[ph]["syncs"] += pending
            ok &= pending <= int(e[2])             # at most one sync, and only before a post that sends
            pending = 0
    ok &= pending == 0
    return {"ok": ok, **c}


#: (plan case of tests/_backward_kv_cases.py, backward KV mode, the backward's form)
CASES = [("ring", "keep", "chain"), ("ring", "resend", "chain"), ("packed", "resend", "chain"),
         ("hier", "keep", "waves"), ("hier", "resend", "waves"), ("full", "resend", "waves")]


@pytest.mark.parametrize("host", (True, False), ids=("gloo-like", "nccl-like"))
@pytest.mark.parametrize("case,mode,form", CASES, ids=[f"{c}-{m}" for c, m, _ in CASES])
def test_host_syncs_only_before_sends_that_the_host_reads(case, mode, form, host, monkeypatch):
    full, placement, plan = case_setup(case, "fp32")
    full = [x.to(torch.float32) for x in full]
    log = _Log()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: log.add(SYNC, "torch.cuda.synchronize"))
    kernel = _ClockedKernel(log)
    kw = dict(cp=4, plan=plan, causal=True, placement=placement, backward_kv=mode)
    res = harness_attention(*full, kernel=kernel, transport=lambda r, t: _Recording(t, log, host), **kw)
    plain = harness_attention(*full, stats=True, **kw)
    assert plain.ranks[0].stats.backward_form == form
    for a, b in zip(plain.ranks, res.ranks):
        for q in ("out", "lse", "dq", "dk", "dv"):
            assert torch.equal(a.tensors()[q], b.tensors()[q]), q
    counts = {name: _count(entries) for name, entries in log.by_thread.items()}
    assert len(counts) == 4
    for name, c in counts.items():
        assert c["ok"], (name, log.by_thread[name])
        assert c["forward"]["jobs"] and c["backward"]["jobs"]
        for ph in ("forward", "backward"):
            # gloo-like: exactly one host wait per post that sends; NCCL-like: none at all
            assert c[ph]["syncs"] == (c[ph]["sending_posts"] if host else 0), (name, ph, c)
    if form == "waves":                                           # the wave pump polled the fake device
        assert sum(api.queries for api in kernel.apis) > 0


def test_stats_time_each_job_to_its_end():
    """With FCPStats on (a measurement), each job's compute time ends at a host wait: one per job,
    counted as "stats"; the NCCL-like steady state has no other."""
    full, placement, plan = case_setup("hier", "fp32")
    full = [x.to(torch.float32) for x in full]
    log = _Log()
    kernel = _ClockedKernel(log)
    harness_attention(*full, cp=4, plan=plan, causal=True, backward_kv="resend", kernel=kernel, stats=True,
                      transport=lambda r, t: _Recording(t, log, False))
    for api, entries in zip(kernel.apis, log.by_thread.values()):
        del api
        jobs = sum(1 for e in entries if e[0] == "job")
        assert sum(1 for e in entries if e[0] == SYNC) == jobs > 0


def test_clock_for_and_reads_host():
    class Own(MathKernel):
        clock = DeviceClock()

    assert clock_for(Own(), torch.device("cpu")) is Own.clock
    assert type(clock_for(MathKernel(), torch.device("cpu"))) is DeviceClock
    assert isinstance(clock_for(MathKernel(), torch.device("cuda")), CudaClock)   # built lazily: no CUDA call
    cpu = DeviceClock()
    assert cpu.reached(cpu.mark()) and not cpu.host_waits
    assert GlooTransport.reads_host
    assert reads_host(TransportWrapper(GlooTransport.__new__(GlooTransport)))
    assert not reads_host(TransportWrapper(object()))


def test_the_emulated_stream_is_a_device_clock():
    """Note [The emulated GPU stream]: a mark is the end of the queued work, reached once that time
    has passed (no sleep to ask); host_wait sleeps until it and is counted; the sleep kernel names
    its stream as its clock (the executor's pump polls it), none when it sleeps in the call."""
    import time

    from megatron_fcp.emulate.sleep_kernel import SleepKernel, VirtualStream

    s = VirtualStream()
    assert isinstance(s, DeviceClock) and s.reached(s.mark())
    s.launch(0.02)
    m = s.mark()
    t0 = time.perf_counter()
    assert not s.reached(m) and time.perf_counter() - t0 < 0.01 and not s.host_waits
    s.host_wait(m, "test")
    assert s.reached(m) and time.perf_counter() >= m and s.host_waits == {"test": 1}
    s.synchronize()
    assert s.host_waits == {"test": 1, "synchronize": 1}
    assert clock_for(SleepKernel(1e12, stream=s), torch.device("cpu")) is s
    assert type(clock_for(SleepKernel(1e12), torch.device("cpu"))) is DeviceClock
