"""A block kernel that sleeps for the modelled GPU time of the block instead of computing it.

On a GPU the attention kernel runs on the device and leaves the host CPU free; on the emulator's
shared CPU, real attention of eight ranks contends for two cores and hides every network effect
(DESIGN.md section 5: a schedule 2x faster on the network measured 1.0x). So the emulator runs the
whole executor for real (plan, transport, buffers, merge) and stands a calibrated sleep in for the
block kernel only.

Length of one call (the cost model's compute, :class:`~megatron_fcp.planning.ComputeModel`)::

    forward:   4 * pairs * b * h * d / flops                 pairs = (query, key) token pairs the
    backward:  backward_ratio * the forward of the block     mask allows (causal, document ids)

(or, with a tiled ``compute_model``, :meth:`~megatron_fcp.cost.model.ComputeModel.work_s` of the
call's increasing runs of query and key positions per document, plus one launch: the same
calls the cost model prices, its calibration scaled by the time scale, :func:`call_runs`)
with ``flops`` the *emulated* FLOP/s: the GPU's (400 TFLOP/s by default) divided by the cluster's
time scale (Note [Emulated cluster] in :mod:`megatron_fcp.emulate.spec`), and ``backward_ratio`` the
cost model's 2.5 (flash-attention's backward: 5 matmuls to the forward's 2). The 5 us launch
overhead per block of the cost model is left out here *and* in the emulator's predictions: the
emulated shapes are small, and a stretched launch (50 ms at a time scale of 10,000) would dwarf
the FLOP-proportional work the shapes stand for.

Note [The emulated GPU stream]
------------------------------
A GPU kernel launch returns at once: the host goes on (merges, posting the next transfers, the
next launch) while the device computes, and the host waits for the device only where it needs a
result. By default (``--compute sleep``) the kernel is emulated that way: a :class:`VirtualStream`
holds the time the emulated GPU is busy until; a launch moves that time on by the block's seconds
(starting no earlier than now) and returns at once, and :meth:`VirtualStream.synchronize` sleeps
until then. The emulator synchronizes where a GPU runtime would wait for the device before data
leaves the rank: before a backward post that sends (dK/dV partials depend on the kernels; NCCL's
stream would wait on the compute stream's event), before each head-parallel all-to-all (out and
dQ|dK|dV are computed), and at the end of the timed forward + backward (``cuda.synchronize``
before the timer stops): :mod:`megatron_fcp.emulate.runners`. Forward KV transfers and relays
never wait, as on a GPU. Between jobs the executor only *queries* the stream, as it queries a CUDA
stream's events: the stream is the kernel's device clock (``SleepKernel.clock``; Note [No host
synchronisation in the steady state] in :mod:`megatron_fcp.attention.device_clock`), a mark the
time the work queued so far ends, and the wave backward's pump polls until the job before last
has ended (Note [Polling on the device's clock] in :mod:`megatron_fcp.attention.backward_waves`).
So the executor's own CPU work (merges, bookkeeping, autograd) overlaps the emulated kernels as it
overlaps real ones, instead of adding to them.

``--compute blocking-sleep`` (the emulator's first measurements) sleeps inside the kernel call
instead: the host is busy for the block's time, and CPU work adds to the kernels. A
:class:`Sleeper` keeps the sum of the sleeps of one timed run on target there: each sleep is
shortened by what earlier ones overslept (``time.sleep`` wakes late, more so on a loaded machine).

Outputs have the right shapes and dtypes and are zero (``lse`` 0 where a row sees a key of the
block, -inf where it sees none), so merges, reductions and transfers run on real tensors.
"""

from __future__ import annotations

import math
import time

import torch

from megatron_fcp.attention.device_clock import DeviceClock
from megatron_fcp.attention.fused import position_order
from megatron_fcp.attention.kernels import BlockKernel, compute_dtype_for
from megatron_fcp.contract.mask import Mask, as_mask

__all__ = ["count_pairs", "call_runs", "Sleeper", "SleepKernel", "VirtualStream"]

_DOC_STRIDE = 1 << 40  # document id * stride + position: one sort key for (document, position)


def call_runs(pos: torch.Tensor, doc: torch.Tensor | None = None) -> list[tuple[int, int, int]]:
    """``(document, first position, length)`` of each increasing run of consecutive positions (one
    document each) in a call's rows or keys, taken in (document, position) order as the fused
    kernels take them (item 6 of the note in :mod:`megatron_fcp.attention.fused`): the pieces a
    varlen flash call tiles separately."""
    p = pos.detach().to("cpu", torch.int64)
    d = torch.zeros_like(p) if doc is None else doc.detach().to("cpu", torch.int64)
    if p.numel() == 0:
        return []
    order = position_order(p, None if doc is None else d)
    if order is not None:
        p, d = p[order], d[order]
    brk = torch.nonzero((p[1:] != p[:-1] + 1) | (d[1:] != d[:-1])).flatten() + 1
    starts = [0] + brk.tolist()
    ends = starts[1:] + [p.numel()]
    return [(int(d[a]), int(p[a]), b - a) for a, b in zip(starts, ends)]


def count_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: "bool | Mask",
                q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """Keys each query row sees (int64 ``[n]``): causal means key position <= query position (a
    :class:`~megatron_fcp.contract.mask.Mask` with a window: its ``offsets`` bound key - query), and
    with document ids only keys of the query's own document count (positions inside documents)."""
    mask = as_mask(causal)
    causal = mask.causal
    if mask.windowed:                           # keys at doc*S + [q + lo, q + hi], clipped to the document
        lo, hi = mask.offsets
        q_doc = torch.zeros_like(q_pos) if q_doc is None else q_doc
        k_doc = torch.zeros_like(k_pos) if k_doc is None else k_doc
        ks = torch.sort(k_doc * _DOC_STRIDE + k_pos).values
        base = q_doc * _DOC_STRIDE
        first = base + torch.clamp(q_pos + max(int(lo), -_DOC_STRIDE), min=0)
        last = base + torch.clamp(q_pos + min(int(hi), _DOC_STRIDE), max=_DOC_STRIDE - 1)
        return (torch.searchsorted(ks, last, right=True) - torch.searchsorted(ks, first, right=False)).clamp(min=0)
    if q_doc is None:
        if not causal:
            return torch.full(q_pos.shape, k_pos.numel(), dtype=torch.int64)
        ks = torch.sort(k_pos).values
        return torch.searchsorted(ks, q_pos, right=True)
    ks = torch.sort(k_doc * _DOC_STRIDE + k_pos).values
    lo = torch.searchsorted(ks, q_doc * _DOC_STRIDE, right=False)
    hi_key = q_doc * _DOC_STRIDE + (q_pos if causal else _DOC_STRIDE - 1)
    return torch.searchsorted(ks, hi_key, right=True) - lo


class Sleeper:
    """``sleep(s)`` that keeps the total on target: each call sleeps what is owed since :meth:`reset`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requested_s = 0.0
        self.slept_s = 0.0

    def sleep(self, seconds: float) -> None:
        self.requested_s += seconds
        owed = self.requested_s - self.slept_s
        if owed <= 0:
            return
        t0 = time.perf_counter()
        time.sleep(owed)
        self.slept_s += time.perf_counter() - t0


class VirtualStream(DeviceClock):
    """An emulated GPU stream (Note [The emulated GPU stream]): :meth:`launch` queues seconds of work
    and returns at once; :meth:`synchronize` sleeps until the queue is done. It is the kernel's
    :class:`~megatron_fcp.attention.device_clock.DeviceClock` (``SleepKernel.clock``): a mark is the
    time the work queued so far ends, ``reached`` compares it with now, ``host_wait`` sleeps until
    it -- the executor's loops see it exactly as they see a CUDA stream's events."""

    #: seconds :meth:`pause` sleeps at most between two polls of a busy emulated device (eight
    #: ranks share the emulator's cores: a poll is host work that a real GPU's host does not share)
    POLL_S = 1e-3

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.busy_until = 0.0      # perf_counter time the queued work ends

    def launch(self, seconds: float) -> None:
        self.busy_until = max(time.perf_counter(), self.busy_until) + seconds

    def mark(self) -> float:
        return self.busy_until

    def reached(self, mark) -> bool:
        return mark is None or time.perf_counter() >= mark

    def host_wait(self, mark, why: str) -> None:
        self._count(why)
        owed = (self.busy_until if mark is None else mark) - time.perf_counter()
        if owed > 0:
            time.sleep(owed)

    def pause(self, mark) -> None:
        left = self.POLL_S if mark is None else min(self.POLL_S, mark - time.perf_counter())
        if left > 0:
            time.sleep(left)

    def synchronize(self) -> None:
        """Wait for everything queued (a GPU runtime's ``stream.synchronize()``)."""
        self.host_wait(self.busy_until, "synchronize")


class SleepKernel(BlockKernel):
    """Sleeps for the modelled GPU time of each block (module docstring); any dtype and device.

    flops: emulated FLOP/s (GPU FLOP/s / time scale); ``0`` or ``inf`` sleeps not at all (the
    "communication only" runs). backward_ratio: backward over forward FLOPs. stream: a
    :class:`VirtualStream` to launch the seconds on (the call returns at once; Note [The emulated GPU
    stream]); None sleeps inside the call (``blocking-sleep``). ``modelled_s`` sums the requested
    seconds (what the cost model would charge) since the last :meth:`reset`.
    """

    name = "sleep"
    documents = True

    def __init__(self, flops: float, backward_ratio: float = 2.5, sleeper: Sleeper | None = None,
                 stream: VirtualStream | None = None, compute_model=None) -> None:
        if not (flops >= 0):
            raise ValueError(f"flops: must be >= 0 (0 = no compute), got {flops!r}")
        if compute_model is not None and compute_model.kernel is None:
            raise ValueError("compute_model: only a tiled ComputeModel (ComputeModel.tiled); the FLOP model is `flops`")
        self.compute_model = compute_model
        self.flops = float(flops)
        self.backward_ratio = float(backward_ratio)
        self.sleeper = sleeper or Sleeper()
        self.stream = stream
        self.modelled_s = 0.0

    def reset(self) -> None:
        self.sleeper.reset()
        if self.stream is not None:
            self.stream.reset()
        self.modelled_s = 0.0

    @property
    def clock(self) -> VirtualStream | None:
        """The executor's device clock: the emulated stream (None when blocking: a call returns
        when its sleep is done, the CPU's clock)."""
        return self.stream

    def synchronize(self) -> None:
        """Wait for the emulated GPU (no-op when blocking: every call already slept)."""
        if self.stream is not None:
            self.stream.synchronize()

    def check(self, dtype: torch.dtype, device: torch.device) -> None:
        return None

    def seconds(self, pairs: int, b: int, h: int, d: int, backward: bool = False) -> float:
        """Modelled seconds of one call on ``pairs`` visible (query, key) pairs."""
        if self.flops <= 0 or math.isinf(self.flops) or pairs <= 0:
            return 0.0
        return 4.0 * pairs * b * h * d / self.flops * (self.backward_ratio if backward else 1.0)

    def tile_seconds(self, q_pos, k_pos, causal, q_doc, k_doc, b: int, h: int, h_kv: int, d: int,
                     backward: bool = False) -> float:
        """Modelled seconds of one call under the tiled ``compute_model``: every (query run, key
        run) of one document priced as the cost model prices a block's calls, ``b`` sequences,
        one launch (0 when no row sees a key, or ``flops`` is 0: the communication-only runs)."""
        from megatron_fcp.cost.model import AttentionShape

        cm = self.compute_model
        if self.flops <= 0 or math.isinf(self.flops):
            return 0.0
        shape = AttentionShape(1, h, h_kv, d)
        ratio = self.backward_ratio if backward else 1.0
        mask = as_mask(causal)
        kr = call_runs(k_pos, k_doc)
        w = sum(cm.work_s(n, q0, m, k0, shape, mask, ratio) for dq, q0, n in call_runs(q_pos, q_doc)
                for dk, k0, m in kr if dq == dk)
        return b * w + cm.launch_s(ratio) if w > 0 else 0.0

    def _sleep(self, counts: torch.Tensor, q: torch.Tensor, backward: bool, geometry=None) -> None:
        n, b, h, d = q.shape
        if self.compute_model is not None and geometry is not None:
            s = self.tile_seconds(*geometry[:5], b, h, geometry[5], d, backward) if int(counts.sum()) > 0 else 0.0
        else:
            s = self.seconds(int(counts.sum()), b, h, d, backward)
        self.modelled_s += s
        if s > 0:
            if self.stream is not None:
                self.stream.launch(s)
            else:
                self.sleeper.sleep(s)

    def forward(self, q, k, v, q_pos, k_pos, causal, scale, q_doc=None, k_doc=None, **prep):
        n, b, h, d = q.shape
        counts = count_pairs(q_pos, k_pos, causal, q_doc, k_doc)                   # [n]
        self._sleep(counts, q, backward=False, geometry=(q_pos, k_pos, causal, q_doc, k_doc, k.shape[2]))
        cd = compute_dtype_for(q.dtype)
        out = torch.zeros(n, b, h, d, dtype=cd, device=q.device)                   # [n, b, h, d]
        lse = torch.where(counts > 0, 0.0, -math.inf).to(cd).to(q.device)        # [n]
        return out, lse.expand(b, h, n).contiguous()                               # [b, h, n]

    def backward(self, dout, q, k, v, out, lse, q_pos, k_pos, causal, scale, q_doc=None, k_doc=None, **prep):
        counts = count_pairs(q_pos, k_pos, causal, q_doc, k_doc)
        self._sleep(counts, q, backward=True, geometry=(q_pos, k_pos, causal, q_doc, k_doc, k.shape[2]))
        cd = compute_dtype_for(q.dtype)
        return (torch.zeros(q.shape, dtype=cd, device=q.device),                  # dq [n, b, h, d]
                torch.zeros(k.shape, dtype=cd, device=k.device),                  # dk [m, b, h_kv, d]
                torch.zeros(v.shape, dtype=cd, device=v.device))                  # dv [m, b, h_kv, d]
