"""One rank's forward + backward of a workload, with a given block kernel and transport.

The three timings of the benchmark come from the same runner (DESIGN.md section 2, "Overlap"):

* overlapped: the workload's kernel (a :class:`~megatron_fcp.emulate.sleep_kernel.SleepKernel`, or
  the real CPU kernel) and the real gloo transport;
* communication only: a sleep kernel that sleeps 0 s (the executor still runs every step);
* compute only: the kernel, and a :class:`NullTransport` that moves nothing.

Tensors are bf16, ``b = 1``; the inputs are random, the same shapes on every rank. FCP runs
:func:`~megatron_fcp.attention.function.fcp_attention_with_lse` with ``agreement=None``: every rank
unpickled the same plan, and an agreement collective per switch of plan would cross the shaped
network inside the timed region.

``te-a2a``, ``te-a2a-p2p`` and ``fcp-hp`` run
:func:`~megatron_fcp.attention.head_parallel.fcp_head_parallel_attention` (zigzag shards
``[s_local, 1, h, d]``), ``fcp-hp`` on a packed batch of degree above 1
:func:`~megatron_fcp.attention.head_parallel_thd.fcp_head_parallel_packed_attention` (THD shards
``[t, h, d]`` of the member placement): the runner creates the plan's head-group and KV-stage
process groups when it is built
(:func:`~megatron_fcp.attention.head_parallel.create_head_parallel_groups`; every
rank builds the same runners in the same order, so every rank creates every group in the same
order), the KV stage uses the worker's transport (peers are global ranks). Its all-to-alls are
gloo point-to-point or collectives, not transport rounds: for the compute-only timing they are
replaced, for that run only, by a local exchange that moves nothing (:func:`_no_all_to_all`).

With the emulated GPU stream (Note [The emulated GPU stream] in
:mod:`megatron_fcp.emulate.sleep_kernel`) the runner waits for the emulated device where a GPU
runtime would: :class:`DeviceSyncTransport` before every backward post that sends computed data,
:func:`_synced_all_to_all` before each head-parallel all-to-all, and :meth:`Runner.run` at the end.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_fcp.attention import head_parallel, head_parallel_a2a, head_parallel_thd
from megatron_fcp.attention.comm import Handle, Transport, TransportWrapper
from megatron_fcp.attention.function import fcp_attention_with_lse
from megatron_fcp.emulate.te_ring import TeLayout, te_p2p_attention
from megatron_fcp.emulate.workloads import (
    FcpWorkload,
    HeadParallelWorkload,
    PackedHeadParallelWorkload,
    TeA2AWorkload,
    TeP2PWorkload,
    Workload,
)

__all__ = ["DeviceSyncTransport", "NullTransport", "Runner", "make_runner"]

DTYPE = torch.bfloat16


class NullTransport(Transport):
    """Moves nothing: receive buffers are zeroed at post, waits return at once (compute-only timing)."""

    def post(self, round_sends, round_recvs, *, round_index: int, phase: str = "forward") -> Handle:
        for _, buf in round_recvs:
            buf.zero_()
        return Handle(phase, round_index)

    def wait(self, handle: Handle) -> None:
        return None

    def test(self, handle: Handle) -> bool:
        return True


class DeviceSyncTransport(TransportWrapper):
    """Waits for the kernel's emulated device before a post that sends what the kernels computed:
    the backward phases (dK/dV partials, TE's KV + dKV), as NCCL's stream waits on the compute
    stream's event. Forward KV, relays and re-sent KV go at once."""

    COMPUTED = frozenset({"backward", "te-backward"})

    def __init__(self, inner: Transport, kernel) -> None:
        super().__init__(inner)
        self.kernel = kernel

    def post(self, round_sends, round_recvs, *, round_index: int, phase: str = "forward") -> Handle:
        if round_sends and phase in self.COMPUTED:
            self.kernel.synchronize()
        return self.inner.post(round_sends, round_recvs, round_index=round_index, phase=phase)

    def post_batch(self, posts):
        if any(p.sends and p.phase in self.COMPUTED for p in posts):
            self.kernel.synchronize()
        return self.inner.post_batch(posts)


def _synchronize(kernel) -> None:
    sync = getattr(kernel, "synchronize", None)
    if sync is not None:
        sync()


class Runner:
    """``run(kernel, transport)``: one forward + backward of this rank's share of the workload."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.q, self.k, self.v = (x.requires_grad_(True) for x in (q, k, v))
        self.dout = torch.ones_like(q)

    def attention(self, kernel, transport) -> torch.Tensor:
        raise NotImplementedError

    def run(self, kernel, transport) -> None:
        for x in (self.q, self.k, self.v):
            x.grad = None
        if getattr(kernel, "stream", None) is not None:
            transport = DeviceSyncTransport(transport, kernel)
        out = self.attention(kernel, transport)
        out.backward(self.dout)
        _synchronize(kernel)                         # the timer stops when the device is done


class _Fcp(Runner):
    def __init__(self, w: FcpWorkload, rank: int, group) -> None:
        s, pl = w.shape, w.placement
        g = torch.Generator().manual_seed(rank)
        n = pl.tokens(w.plan.ranks.index(rank)) if pl is not None else \
            -(-s.seq // (2 * w.plan.cp)) * (2 * w.plan.cp) // w.plan.cp
        lead = (n,) if pl is not None else (n, 1)                                   # THD or [s, b]
        super().__init__(*(torch.randn(*lead, h, s.head_dim, generator=g).to(DTYPE)
                           for h in (s.heads, s.kv_heads, s.kv_heads)))
        self.w, self.group = w, group

    def attention(self, kernel, transport):
        w = self.w
        out, _ = fcp_attention_with_lse(self.q, self.k, self.v, cp_group=self.group, plan=w.plan,
                                        causal=w.shape.causal, transport=transport, kernel=kernel,
                                        placement=w.placement, backward_kv=w.executor_kv, agreement=None,
                                        window=w.shape.window)
        return out


class _TeP2P(Runner):
    def __init__(self, w: TeP2PWorkload, rank: int, group) -> None:
        s = w.shape
        cp = len(w.ranks)
        docs = list(s.doc_lengths) if s.doc_lengths else [-(-s.seq // (2 * cp)) * (2 * cp)]
        self.layout = TeLayout(docs, cp)
        n = self.layout.tokens_per_rank
        lead = (n,) if s.doc_lengths else (n, 1)
        g = torch.Generator().manual_seed(rank)
        super().__init__(*(torch.randn(*lead, h, s.head_dim, generator=g).to(DTYPE)
                           for h in (s.heads, s.kv_heads, s.kv_heads)))
        self.w, self.group = w, group

    def attention(self, kernel, transport):
        out, _ = te_p2p_attention(self.q, self.k, self.v, cp_group=self.group, layout=self.layout,
                                  causal=self.w.shape.causal, kernel=kernel, transport=transport)
        return out


@contextlib.contextmanager
def _patched(owner: type, name: str, replacement):
    """``owner.name`` is ``replacement(original)`` inside the block."""
    original = getattr(owner, name)
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def _no_all_to_all():
    """The head-parallel all-to-alls (zigzag and packed) exchange nothing (zeros of the right
    shape) inside the block."""

    def start(original):
        def run(self, x: torch.Tensor, what: str):
            recv = torch.zeros(x.shape, dtype=x.dtype, device=x.device)    # [a, ...] as received (contiguous)
            return head_parallel_a2a._Pending(recv, None, what, 0)
        return run

    def exchange(original):
        def run(self, sends: list[torch.Tensor], rows: list[int], what: str) -> list[torch.Tensor]:
            mine = sends[self.me]                                          # [n_me, W]
            return [mine if m == self.me else mine.new_zeros((rows[m], *mine.shape[1:])) for m in range(self.a)]
        return run

    with _patched(head_parallel_a2a._HeadComm, "start", start), \
            _patched(head_parallel_thd._PackedComm, "_exchange", exchange):
        yield


@contextlib.contextmanager
def _synced_all_to_all(kernel):
    """Each head-parallel all-to-all (zigzag and packed) waits for the emulated device first (out
    and dQ|dK|dV are computed; Q|K|V and dO find it idle)."""

    def synced(original):
        def run(self, *args):
            kernel.synchronize()
            return original(self, *args)
        return run

    with _patched(head_parallel_a2a._HeadComm, "start", synced), \
            _patched(head_parallel_thd._PackedComm, "_exchange", synced):
        yield


class _HeadParallel(Runner):
    """``te-a2a`` / ``te-a2a-p2p`` / ``fcp-hp``: the head-parallel engine over ``w.hp_plan`` (module
    docstring), under the shape's window."""

    def __init__(self, w: HeadParallelWorkload, rank: int, group, timeout_s: float | None = None) -> None:
        s, hp = w.shape, w.hp_plan
        g = torch.Generator().manual_seed(rank)
        n = -(-s.seq // (2 * hp.cp)) * (2 * hp.cp) // hp.cp                       # s_local (padded zigzag)
        super().__init__(*(torch.randn(n, 1, h, s.head_dim, generator=g).to(DTYPE)
                           for h in (s.heads, s.kv_heads, s.kv_heads)))
        made = head_parallel.create_head_parallel_groups([hp], timeout_s=timeout_s)[0]  # collective, all ranks
        self.groups = made if made is not None else head_parallel.HeadParallelGroups.of_cp_group(hp, group)
        self.w, self.group = w, group

    def attention(self, kernel, transport):
        w = self.w
        return head_parallel.fcp_head_parallel_attention(
            self.q, self.k, self.v, cp_group=self.group, hp_plan=w.hp_plan, groups=self.groups,
            causal=w.shape.causal, kernel=kernel, transport=transport, backward_kv=w.executor_kv, agreement=None,
            overlap_q=w.overlap_q, window=w.shape.window)

    def run(self, kernel, transport) -> None:
        with contextlib.ExitStack() as stack:
            if isinstance(transport, NullTransport):
                stack.enter_context(_no_all_to_all())
            if getattr(kernel, "stream", None) is not None:
                stack.enter_context(_synced_all_to_all(kernel))
            super().run(kernel, transport)


class _PackedHeadParallel(_HeadParallel):
    """``fcp-hp`` on a packed batch of degree above 1: the packed head-parallel engine over
    ``w.hp_plan`` on this rank's tokens of its member placement (module docstring)."""

    def __init__(self, w: PackedHeadParallelWorkload, rank: int, group, timeout_s: float | None = None) -> None:
        s, hp = w.shape, w.hp_plan
        g = torch.Generator().manual_seed(rank)
        n = hp.placement.tokens(hp.ranks.index(rank))                             # t_j: THD rows
        Runner.__init__(self, *(torch.randn(n, h, s.head_dim, generator=g).to(DTYPE)
                                for h in (s.heads, s.kv_heads, s.kv_heads)))
        self.groups = head_parallel.create_head_parallel_groups([hp.head_groups], timeout_s=timeout_s)[0]
        self.w, self.group = w, group

    def attention(self, kernel, transport):
        w = self.w
        return head_parallel_thd.fcp_head_parallel_packed_attention(
            self.q, self.k, self.v, cp_group=self.group, hp_plan=w.hp_plan, groups=self.groups,
            causal=w.shape.causal, kernel=kernel, transport=transport, backward_kv=w.executor_kv, agreement=None)


#: workload class -> runner class.
_RUNNERS: dict[type, type] = {FcpWorkload: _Fcp, TeP2PWorkload: _TeP2P, HeadParallelWorkload: _HeadParallel,
                              TeA2AWorkload: _HeadParallel, PackedHeadParallelWorkload: _PackedHeadParallel}


def make_runner(w: Workload, rank: int, group) -> Runner:
    """This rank's runner for ``w`` (which must be available: ``w.unavailable is None``)."""
    if w.unavailable is not None or type(w) not in _RUNNERS:
        raise ValueError(f"workload {w.name!r} cannot run: {w.unavailable or 'no runner registered'}")
    return _RUNNERS[type(w)](w, rank, group)
