"""Transports: post one round of a plan's point-to-point transfers, then wait for it.

The executor (:mod:`megatron_fcp.attention.function`) talks to a :class:`Transport` only::

    handle = transport.post(round_sends, round_recvs, round_index=k, phase="forward")
    ...                                   # compute while the round is in flight
    transport.wait(handle)                # raises CommTimeout naming round / peer / block
    transport.test(handle)                # non-blocking: True once the round is complete

``test`` lets a caller make progress between compute jobs (the wave backward advances its
reductions and re-sends on it: Note [Backward waves]). True means every send and receive of the
round has completed; the caller then still calls ``wait`` (it moves staged receives into place,
orders the current CUDA stream behind NCCL's and raises on failure), which returns at once. The
base class answers False ("unknown"): a caller must then fall back to ``wait`` at a point where
blocking is acceptable -- correct, only less overlap. Wrappers forward ``test`` to the inner
transport (:class:`SerialTransport`: True, its rounds complete at post).

``round_sends`` / ``round_recvs`` are this rank's ``(Transfer, tensor)`` pairs of one round in plan
order (a receive's tensor is the preallocated buffer). In the backward pass the executor hands
over *flipped* transfers (``src``/``dst`` swapped), so every Transfer names the real sender and
receiver of the bytes. Both ends derive their posts from the same plan, so the i-th send from A to
B in a round matches the i-th receive on B from A.

Implementations:
* :class:`GlooTransport` — ordered ``irecv``/``isend``: all receives of the round are posted
  *before* any send (gloo keeps one FIFO per pair; a receive posted after a bulk send serialises a
  bidirectional exchange, measured at half the bandwidth each way). Waits are bounded; each round
  is waited from its post on by a watcher thread, so that ``test`` can answer (gloo's own
  ``is_completed`` cannot: Note [Testing a gloo round] in :mod:`megatron_fcp.attention.gloo_watch`).
* :class:`NcclTransport` — ``batch_isend_irecv`` issued from a side stream after an event that
  orders it behind the producer of the send buffers; ``wait`` makes the current stream wait for
  the round. Gated on CUDA + NCCL; small and reviewed, not exercised on this CPU machine.
* :class:`~megatron_fcp.testing.inprocess.InProcessTransport` — several CP ranks as threads of one
  process (tests, one-GPU checks): tensors handed over through a shared mailbox, copied by the
  receiver (on CUDA on its own stream, ordered by events).
* :class:`TransportWrapper` — the plug-in point for decorators: :class:`CountingTransport`
  records every posted transfer for tests; delay- or fault-injecting transports subclass the same
  wrapper and override ``post``/``wait``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_fcp.attention.gloo_watch import OnceWork, RoundWatch
from megatron_fcp.attention.groups import VirtualGroup
from megatron_fcp.contract.blocks import Transfer

__all__ = [
    "CommTimeout",
    "Handle",
    "RoundPost",
    "Transport",
    "GlooTransport",
    "NcclTransport",
    "TransportWrapper",
    "CountingTransport",
    "SerialTransport",
    "DelayTransport",
    "Posted",
    "default_transport",
]

log = logging.getLogger(__name__)

Pairs = Sequence[tuple[Transfer, torch.Tensor]]

DEFAULT_TIMEOUT_S = 300.0


class CommTimeout(RuntimeError):
    """A posted transfer did not complete in time; the message names phase, round, peer and block."""


@dataclass
class Handle:
    """One posted round: the pending works in post order, with what each one moves."""

    phase: str
    round_index: int
    works: list[tuple[str, Transfer, Any]] = field(default_factory=list)  # (kind, transfer, work)
    keep_alive: list[torch.Tensor] = field(default_factory=list)         # buffers in flight
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (host, device) receives
    watch: Any = None  # gloo: the RoundWatch that waits the works (Note [Testing a gloo round])


@dataclass(frozen=True)
class RoundPost:
    """One round to post (:meth:`Transport.post_batch`): this rank's sends and receives of it."""

    sends: Pairs
    recvs: Pairs
    round_index: int
    phase: str = "forward"


class Transport:
    """Interface: ``post`` one round of sends/receives, ``wait`` for a posted round.

    ``reads_host``: the transport reads send buffers on the host (gloo stages a CUDA tensor
    through host memory), so the device must be done with them at the post: the executor waits
    for its device there, and only there (Note [No host synchronisation in the steady state] in
    :mod:`megatron_fcp.attention.device_clock`). False: sends are ordered on the device."""

    reads_host = False

    def post(self, round_sends: Pairs, round_recvs: Pairs, *, round_index: int, phase: str = "forward") -> Handle:
        raise NotImplementedError

    def post_batch(self, posts: Sequence[RoundPost]) -> list[Handle]:
        """Post several rounds at once (one handle each, in order). By default one :meth:`post` after
        another; :class:`GlooTransport` posts every receive of the batch before any send (Note
        [Receives first across rounds]). Either way a pair's sends, and its receives, keep the
        batch's order, so they still match the peer's."""
        return [self.post(p.sends, p.recvs, round_index=p.round_index, phase=p.phase) for p in posts]

    def wait(self, handle: Handle) -> None:
        raise NotImplementedError

    def test(self, handle: Handle) -> bool:
        """Non-blocking: has every operation of the posted round completed? False if unknown."""
        del handle
        return False


def _describe(kind: str, t: Transfer) -> str:
    return f"{'send to' if kind == 'send' else 'receive from'} rank {t.dst if kind == 'send' else t.src} of {t.block}"


class GlooTransport(Transport):
    """Ordered ``irecv``-then-``isend`` on a gloo process group, with bounded waits.

    group: the CP process group (peers are global ranks, as in the plan).
    timeout_s: how long ``wait`` waits for a whole round before raising :class:`CommTimeout`.
    """

    reads_host = True  # a CUDA send buffer is copied to the host at the post

    def __init__(self, group: dist.ProcessGroup, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.group = group
        self.timeout_s = float(timeout_s)

    def post(self, round_sends: Pairs, round_recvs: Pairs, *, round_index: int, phase: str = "forward") -> Handle:
        return self.post_batch([RoundPost(round_sends, round_recvs, round_index, phase)])[0]

    def post_batch(self, posts: Sequence[RoundPost]) -> list[Handle]:
        """Every receive of ``posts`` (in order), then every send (in order); one handle per round,
        each waited from now on by a watcher (Note [Testing a gloo round]).

        Note [Receives first across rounds]
        -----------------------------------
        gloo carries both directions of a pair on one connection, and a receive posted after a bulk
        send to the same peer waits behind it (module docstring). Within a round the receives go
        first; the wave backward also posts several rounds at once (a reduction's and a re-send's,
        one poll), and there a rank posting reduce ``4 -> 0`` then the re-send's receive ``0 -> 4``
        serialised them: traced on the emulated 2 x 4 cluster (``fcp-leader``), the 256 KB
        re-send took 106 ms where its bytes need 55, the reduction the other way 48 ms. Posting a
        batch's receives before its sends keeps each pair's order of sends and of receives."""
        handles = [Handle(p.phase, p.round_index) for p in posts]
        for h, p in zip(handles, posts):
            self._post_ops(h, p.recvs, "recv")
        for h, p in zip(handles, posts):
            self._post_ops(h, p.sends, "send")
        for h in handles:
            if h.works:  # waited at once on a watcher thread, so that test() can answer
                h.watch = RoundWatch(lambda h=h: self._wait_works(h))
        return handles

    def _post_ops(self, h: Handle, pairs: Pairs, kind: str) -> None:
        t = None
        try:
            for t, x in pairs:
                if kind == "recv":
                    host = _host(x, stage=True)
                    if host is not x:                                  # staged: copied to x in wait()
                        h.staged.append((host, x))
                    h.works.append(("recv", t, OnceWork(dist.irecv(host, src=t.src, group=self.group))))
                else:
                    host = _host(x.contiguous(), stage=True, copy=True)
                    h.works.append(("send", t, OnceWork(dist.isend(host, dst=t.dst, group=self.group))))
                h.keep_alive.append(host)
        except RuntimeError as e:  # gloo refuses a post to a peer whose connection is gone
            raise CommTimeout(f"{h.phase} round {h.round_index}: {_describe(kind, t)} failed when posted ({e}); is "
                              f"that rank alive and running the same plan? (the group is unusable after this)") from e

    def wait(self, handle: Handle) -> None:
        if handle.watch is not None:
            handle.watch.wait()
        self._wait_works(handle)  # at once unless a wrapper added works after the watch ran (OnceWork)
        for host, buf in handle.staged:
            buf.copy_(host)
        handle.staged.clear()
        handle.keep_alive.clear()

    def _wait_works(self, handle: Handle) -> None:
        """Wait every work of ``handle``, bounded by ``timeout_s`` from now; CommTimeout on failure."""
        deadline = time.monotonic() + self.timeout_s
        for kind, t, work in handle.works:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                ok = work.wait(timeout=timedelta(seconds=left))
            except RuntimeError as e:
                raise CommTimeout(
                    f"{handle.phase} round {handle.round_index}: {_describe(kind, t)} failed or did not "
                    f"complete within {self.timeout_s:g} s ({e}); is that rank alive and running the "
                    f"same plan? (the group is unusable after this)"
                ) from e
            if ok is False:
                raise CommTimeout(f"{handle.phase} round {handle.round_index}: {_describe(kind, t)} failed")

    def test(self, handle: Handle) -> bool:
        """Has the round's watch waited every operation (a failed one counts: ``wait`` then raises)?
        gloo's own ``Work.is_completed()`` stays False until ``wait`` (Note [Testing a gloo round]).
        A send is complete once the peer has posted the matching receive and gloo has handed its
        bytes to the socket."""
        return (handle.watch is None or handle.watch.done()) and all(w.is_completed() for _, _, w in handle.works)


_STAGING_LOGGED = False


def _host(x: torch.Tensor, stage: bool, copy: bool = False) -> torch.Tensor:
    """gloo moves host memory only: a CUDA tensor goes through a host copy (numerics unchanged;
    logged once). Several CP ranks sharing one GPU over gloo is a test setup, not a fast path."""
    global _STAGING_LOGGED
    if not (stage and x.is_cuda):
        return x
    if not _STAGING_LOGGED:
        _STAGING_LOGGED = True
        log.info("gloo transport: CUDA KV blocks are staged through host memory (use NCCL for speed)")
    return x.to("cpu") if copy else torch.empty(x.shape, dtype=x.dtype, device="cpu")


class NcclTransport(Transport):
    """``batch_isend_irecv`` on a side stream, ordered with CUDA events (CUDA + NCCL only).

    post: record an event on the current (compute) stream, make the side stream wait for it (the
    send buffers are ready), issue the batched P2P from the side stream, and mark every buffer
    with ``record_stream`` so the caching allocator does not reuse it while NCCL still reads or
    writes it. wait: ``work.wait()`` makes the *current* stream wait for the round on the device
    (no host synchronisation); hangs are bounded by the process group's own NCCL timeout.
    """

    def __init__(self, group: dist.ProcessGroup, stream: "torch.cuda.Stream | None" = None) -> None:
        if not torch.cuda.is_available() or dist.get_backend(group) != "nccl":
            raise ValueError("NcclTransport needs CUDA and an NCCL process group; use GlooTransport on CPU")
        self.group = group
        self.stream = stream if stream is not None else torch.cuda.Stream()

    def post(self, round_sends: Pairs, round_recvs: Pairs, *, round_index: int, phase: str = "forward") -> Handle:
        h = Handle(phase, round_index)
        ops = [dist.P2POp(dist.irecv, buf, peer=t.src, group=self.group) for t, buf in round_recvs]
        ops += [dist.P2POp(dist.isend, x.contiguous(), peer=t.dst, group=self.group) for t, x in round_sends]
        if not ops:
            return h
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            works = dist.batch_isend_irecv(ops)
        for op in ops:
            op.tensor.record_stream(self.stream)
            h.keep_alive.append(op.tensor)
        pairs = [("recv", t) for t, _ in round_recvs] + [("send", t) for t, _ in round_sends]
        # batch_isend_irecv may return one work for the whole batch: attach it to the first op.
        for i, w in enumerate(works):
            kind, t = pairs[min(i, len(pairs) - 1)]
            h.works.append((kind, t, w))
        return h

    def wait(self, handle: Handle) -> None:
        for _, _, work in handle.works:
            work.wait()  # current stream waits on the NCCL stream
        handle.keep_alive.clear()

    def test(self, handle: Handle) -> bool:
        """``Work.is_completed()``: the NCCL kernels of the round have finished on the device (a
        host-side query of the work's end event; no synchronisation). The caller's ``wait`` then
        orders its current stream behind the side stream."""
        return all(work.is_completed() for _, _, work in handle.works)


def default_transport(group: dist.ProcessGroup, timeout_s: float = DEFAULT_TIMEOUT_S) -> Transport:
    """NCCL transport for an NCCL group on CUDA, otherwise the gloo transport; a
    :class:`~megatron_fcp.attention.groups.VirtualGroup` brings its own (in-process) transport."""
    if isinstance(group, VirtualGroup):
        return group.transport(timeout_s)
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        return NcclTransport(group)
    return GlooTransport(group, timeout_s)


class TransportWrapper(Transport):
    """Delegates to ``inner``; subclass to observe, delay or break transfers (tests, fault drills)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    @property
    def reads_host(self) -> bool:  # type: ignore[override]
        return getattr(self.inner, "reads_host", False)

    def post(self, round_sends: Pairs, round_recvs: Pairs, *, round_index: int, phase: str = "forward") -> Handle:
        return self.inner.post(round_sends, round_recvs, round_index=round_index, phase=phase)

    def post_batch(self, posts: Sequence[RoundPost]) -> list[Handle]:
        # a wrapper that changes post() applies it round by round; one that does not passes the
        # batch on (the inner transport may order it: Note [Receives first across rounds])
        if type(self).post is not TransportWrapper.post:
            return Transport.post_batch(self, posts)
        return self.inner.post_batch(posts)

    def wait(self, handle: Handle) -> None:
        self.inner.wait(handle)

    def test(self, handle: Handle) -> bool:
        return self.inner.test(handle)


class SerialTransport(TransportWrapper):
    """Waits for each round as soon as it is posted: communication and compute never overlap.

    What ``--no-fcp-overlap`` runs; the numerics are the same as with overlap (the executor merges
    in plan order either way), only the timing changes.
    """

    def post(self, round_sends: Pairs, round_recvs: Pairs, *, round_index: int, phase: str = "forward") -> Handle:
        handle = self.inner.post(round_sends, round_recvs, round_index=round_index, phase=phase)
        self.inner.wait(handle)
        return handle

    def wait(self, handle: Handle) -> None:
        del handle  # already complete

    def test(self, handle: Handle) -> bool:
        del handle
        return True


class DelayTransport(TransportWrapper):
    """Delays every message by ``delay()`` seconds (tests: timing must never change the arithmetic).

    ``post`` posts the round's receives at once, then each send after its own delay (in plan order,
    so sends still match receives pair by pair); ``wait`` sleeps one more delay before waiting, so
    a round is also observed late. ``delay``: e.g. a seeded generator's ``uniform(0, 5e-4)``.
    """

    def __init__(self, inner: Transport, delay: Callable[[], float]) -> None:
        super().__init__(inner)
        self.delay = delay

    def post(self, round_sends: Pairs, round_recvs: Pairs, *, round_index: int, phase: str = "forward") -> Handle:
        handle = self.inner.post([], round_recvs, round_index=round_index, phase=phase)
        for pair in round_sends:
            time.sleep(self.delay())
            one = self.inner.post([pair], [], round_index=round_index, phase=phase)
            handle.works.extend(one.works)
            handle.keep_alive.extend(one.keep_alive)
        return handle

    def wait(self, handle: Handle) -> None:
        time.sleep(self.delay())
        self.inner.wait(handle)


@dataclass(frozen=True)
class Posted:
    """One posted operation as :class:`CountingTransport` saw it."""

    phase: str
    round_index: int
    kind: str  # "send" | "recv"
    transfer: Transfer
    nbytes: int
    dtype: torch.dtype


class CountingTransport(TransportWrapper):
    """Records every posted send and receive (phase, round, transfer, bytes) before delegating."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.posted: list[Posted] = []
        self.posts = 0  # number of post() calls, including empty rounds
        self.rounds: list[tuple[str, int, tuple[Transfer, ...], tuple[Transfer, ...]]] = []  # per post():
        # (phase, round, sends, receives) in post order

    def post(self, round_sends: Pairs, round_recvs: Pairs, *, round_index: int, phase: str = "forward") -> Handle:
        self.posts += 1
        self.rounds.append((phase, round_index, tuple(t for t, _ in round_sends), tuple(t for t, _ in round_recvs)))
        for kind, pairs in (("recv", round_recvs), ("send", round_sends)):
            for t, x in pairs:
                self.posted.append(Posted(phase, round_index, kind, t, x.numel() * x.element_size(), x.dtype))
        return super().post(round_sends, round_recvs, round_index=round_index, phase=phase)

    def transfers(self, phase: str, round_index: int, kind: str) -> tuple[Transfer, ...]:
        """Posted transfers of one phase/round/kind in post order."""
        return tuple(p.transfer for p in self.posted
                     if p.phase == phase and p.round_index == round_index and p.kind == kind)
