"""The device's clock as the executor sees it: marks on the compute stream, polled without blocking.

One small protocol, :class:`DeviceClock`, stands between the executor's loops (the forward rounds,
the chain and wave backward runners) and the device the kernels run on, so that no loop calls
``synchronize`` itself:

============  ==============================  =================================  =====================
method        CPU (:class:`DeviceClock`)      CUDA (:class:`CudaClock`)          emulator (VirtualStream)
============  ==============================  =================================  =====================
``mark``      None (kernels ran in the call)  an event recorded on the current   the time its queued
                                              (compute) stream                   work ends
``reached``   True                            ``event.query()`` (non-blocking)   ``now >= mark``
``host_wait`` nothing                         ``event.synchronize()`` (counted)  sleep until the mark
``pause``     nothing                         ``time.sleep(0)`` (yield the GIL)  sleep <= 1 ms
============  ==============================  =================================  =====================

(:class:`~megatron_fcp.emulate.sleep_kernel.VirtualStream` implements the protocol in the
emulator; a kernel brings its own clock as ``kernel.clock``: :func:`clock_for`.)

Note [No host synchronisation in the steady state]
--------------------------------------------------
On a device that runs kernels asynchronously the host only *launches* a job; it must not wait for
the device between jobs, or the device idles while the host polls, posts and launches the next
one. So:

* completion is observed by marks: the wave backward's pump (:mod:`~megatron_fcp.attention.backward_waves`)
  takes a mark after each job and, while rounds are queued, keeps testing and posting them
  (``transport.test``, non-blocking) until the device has *reached the mark of the job before
  last* (``reached``, ``event.query()``) -- the host launches job j + 1 while the device runs job j,
  never further ahead, so the device always has the next job queued and the host still observes
  (about) job ends, as the cost model prices it (Note [Wave pipeline timeline]);
* a send is ordered after the compute that produced it on the device: NCCL's transport records an
  event on the compute stream at the post and its communication stream ``wait_event`` s it
  (:class:`~megatron_fcp.attention.comm.NcclTransport`); no host wait;
* the host blocks only where the bytes must be on the host: a transport that reads send buffers
  on the host (``Transport.reads_host``: gloo, which stages a CUDA tensor through host memory)
  gets one ``host_wait`` right before each post that sends (:meth:`DeviceClock.before_send`);
* with ``FCPStats`` on, each job's compute time is measured up to a ``host_wait`` (timing is a
  measurement, not the steady state).

Host waits per layer (rank), so: forward and both backward runners, an NCCL-like transport: 0; a
host-reading transport (gloo): one per post that sends (forward: one per round with sends; chain
backward: one per step with sends; wave backward: one per posted batch with sends; at most one
per send); none per job on either (tests/test_device_clock.py counts them on a CUDA-like fake).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

__all__ = ["DeviceClock", "CudaClock", "clock_for", "reads_host"]


def reads_host(transport) -> bool:
    """Does ``transport`` read send buffers on the host (``Transport.reads_host``: gloo)?"""
    return bool(getattr(transport, "reads_host", False))


class DeviceClock:
    """The protocol, and the CPU clock: a kernel call returns when its work is done, so every mark
    is reached and nothing is waited for. ``host_waits``: the host synchronisations so far, by
    reason (``{why: count}``)."""

    def __init__(self) -> None:
        self.host_waits: dict[str, int] = {}

    def mark(self) -> Any:
        """A point on the compute stream after every kernel launched so far."""
        return None

    def reached(self, mark: Any) -> bool:
        """Non-blocking: has the device passed ``mark``?"""
        del mark
        return True

    def host_wait(self, mark: Any, why: str) -> None:
        """Block the host until the device has passed ``mark`` (a host synchronisation; counted)."""
        del mark
        self._count(why)

    def pause(self, mark: Any) -> None:
        """Between two non-blocking polls of a device not yet at ``mark``: let other threads run
        (never past ``mark``)."""
        del mark

    def before_send(self, transport) -> None:
        """Right before a post that sends: the host waits for the device only if ``transport``
        reads the buffers on the host (:func:`reads_host`). CPU tensors are on the host already."""
        del transport

    def _count(self, why: str) -> None:
        self.host_waits[why] = self.host_waits.get(why, 0) + 1


class CudaClock(DeviceClock):
    """Marks are CUDA events on ``device``'s current stream. ``new_event`` / ``current_stream``:
    the CUDA API used (tests pass a CUDA-like fake on CPU)."""

    def __init__(self, device: torch.device, new_event: Callable[[], Any] | None = None,
                 current_stream: Callable[[torch.device], Any] | None = None) -> None:
        super().__init__()
        self.device = device
        self._new_event = new_event or torch.cuda.Event
        self._current_stream = current_stream or torch.cuda.current_stream

    def mark(self) -> Any:
        ev = self._new_event()
        ev.record(self._current_stream(self.device))
        return ev

    def reached(self, mark: Any) -> bool:
        return mark is None or bool(mark.query())

    def host_wait(self, mark: Any, why: str) -> None:
        self._count(why)
        if mark is not None:
            mark.synchronize()

    def pause(self, mark: Any) -> None:
        del mark
        time.sleep(0)

    def before_send(self, transport) -> None:
        if reads_host(transport):
            self.host_wait(self.mark(), "send read on the host")


def clock_for(kernel, device: torch.device) -> DeviceClock:
    """The clock of ``kernel``'s device: the kernel's own (``kernel.clock``: the emulator's virtual
    stream, a test's fake) if it has one, else CUDA events on a CUDA ``device``, else the CPU's."""
    own = getattr(kernel, "clock", None)
    if own is not None:
        return own
    if device.type == "cuda":
        return CudaClock(device)
    return DeviceClock()
