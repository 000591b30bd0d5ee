"""Several CP ranks inside one process: a virtual group, its transport, and a runner.

Every virtual rank is one Python thread (on CUDA also one CUDA stream, all on one GPU). The ranks
of an :class:`InProcessGroup` exchange tensors through a shared mailbox guarded by one condition
variable; the engine sees an ordinary :class:`~megatron_fcp.attention.comm.Transport` and an ordinary
``cp_group`` (a :class:`~megatron_fcp.attention.groups.VirtualGroup`), so the executor, the validation and
the agreement step run unchanged. ``torch.distributed`` is not used (nor patched).

Note [In-process transfers]
---------------------------
A message is keyed by ``(phase, round, src, dst)`` and numbered in post order under its key, and
a receive gets the next number under its key when *posted*, so the i-th send posted from A to B
meets the i-th receive posted on B from A (the contract of every transport, as gloo and NCCL match
by post order) -- even when the receives are waited in another order (the wave backward's
reductions of two waves share round indices and may complete out of order)::

    post (sender)     put (transfer, tensor, ready event) in the mailbox    # no copy yet
    post (receiver)   number the receive; the receive buffer waits in the handle
    test (either)     every receive's message is in the mailbox, every send taken (non-blocking)
    wait (receiver)   take each numbered message (bounded), check it is the transfer the plan
                      says, then copy it into the buffer:
                        CPU:  buf.copy_(tensor)
                        CUDA: my stream waits for the ready event; copy on my stream;
                              tensor.record_stream(my stream); record a done event
    wait (sender)     until every message of the round was taken (bounded); CUDA: my stream
                      waits for the done events (the sender may reuse its buffers after)

Ordering on CUDA comes from events only: a sender records *ready* on its stream when it posts
(after the kernels that produced the tensor), a receiver records *done* after its copy. Nothing
in the transfer path synchronises the host with the device. The copy is a device-to-device copy
on one GPU; ``record_stream`` keeps the caching allocator from handing the sender's memory out
again before the receiver's copy has run.

Failures: a wait that does not complete within ``timeout_s`` raises
:class:`~megatron_fcp.attention.comm.CommTimeout` naming phase, round, peer and block (like
:class:`~megatron_fcp.attention.comm.GlooTransport`). An exception in one rank's thread marks the group
failed: every other rank's pending or later wait raises :class:`RankFailed` at once, and
:meth:`InProcessGroup.run` re-raises the first rank's own exception in the caller.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from megatron_fcp.attention.agreement import FCPAgreementError
from megatron_fcp.attention.comm import DEFAULT_TIMEOUT_S, CommTimeout, Handle, Transport
from megatron_fcp.attention.groups import VirtualGroup
from megatron_fcp.contract.blocks import Transfer

__all__ = ["InProcessGroup", "VirtualRank", "InProcessTransport", "RankFailed", "TransferMismatch", "run_ranks"]


class RankFailed(RuntimeError):
    """Another virtual rank of the group raised; this rank stopped waiting (see its error)."""


class TransferMismatch(RuntimeError):
    """A received message is not the transfer this rank's plan expects: the ranks run different plans."""


@dataclass
class _Message:
    transfer: Transfer
    tensor: torch.Tensor
    ready: Any = None          # torch.cuda.Event recorded on the sender's stream (CUDA)
    done: Any = None           # torch.cuda.Event recorded on the receiver's stream after the copy
    taken: bool = False


@dataclass
class _Failure:
    rank: int | None           # None: the runner gave up (timeout)
    error: BaseException


@dataclass
class _Gather:
    values: dict = field(default_factory=dict)
    read: int = 0


class InProcessGroup:
    """A CP group whose ranks are threads of this process.

    ranks: the group's global ranks in CP order (any distinct ints, e.g. ``(1, 3)``: CP index and
    global rank differ as with TP > 1), or an int ``cp`` for ``range(cp)``. device: ``"cpu"`` or a
    CUDA device; on CUDA each rank runs on its own stream of that device.
    """

    def __init__(self, ranks: Sequence[int] | int, device: "str | torch.device" = "cpu") -> None:
        ranks = tuple(range(ranks)) if isinstance(ranks, int) else tuple(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"an in-process group needs distinct ranks, got {list(ranks)}")
        self.ranks = ranks
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device} requested but CUDA is not available; use device='cpu'")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"in-process groups run on 'cpu' or 'cuda', got {self.device}")
        self._cond = threading.Condition()
        self._mail: dict[tuple, _Message] = {}             # (key, n): the n-th message sent under key
        self._posted: dict[tuple, int] = {}                # (key, "send" | "recv") -> how many posted
        self._failed: _Failure | None = None
        self._gathers: dict[int, _Gather] = {}
        self._gather_calls = {r: 0 for r in ranks}
        self._handles = {r: VirtualRank(self, r) for r in ranks}

    @property
    def cp(self) -> int:
        return len(self.ranks)

    def handle(self, rank: int) -> "VirtualRank":
        """The ``cp_group`` that global rank ``rank`` passes to the engine."""
        if rank not in self._handles:
            raise ValueError(f"rank {rank} is not in the in-process group {list(self.ranks)}")
        return self._handles[rank]

    # -- failure -------------------------------------------------------------------------------
    def fail(self, rank: int | None, error: BaseException) -> None:
        """Mark the group failed (first failure wins) and wake every waiting rank."""
        with self._cond:
            if self._failed is None:
                self._failed = _Failure(rank, error)
            self._cond.notify_all()

    def _check_failed(self, me: int, where: str) -> None:
        f = self._failed
        if f is not None and f.rank != me:
            who = "the runner (timeout)" if f.rank is None else f"virtual rank {f.rank}"
            raise RankFailed(f"{where}: released because {who} failed: {type(f.error).__name__}: {f.error}")

    def _wait_until(self, me: int, ready: Callable[[], bool], deadline: float, where: str) -> bool:
        """Wait (holding ``_cond``) until ``ready()`` or the deadline; raise if another rank failed."""
        while True:
            self._check_failed(me, where)
            if ready():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)

    # -- mailbox -------------------------------------------------------------------------------
    def _number(self, key: tuple, kind: str) -> int:
        """The post-order number of this send or receive under ``key`` (phase, round, src, dst): the
        n-th receive posted matches the n-th send posted, whatever order the receives are waited in."""
        with self._cond:
            n = self._posted.get((key, kind), 0)
            self._posted[(key, kind)] = n + 1
            return n

    def _put(self, key: tuple, msg: _Message) -> None:
        with self._cond:
            self._mail[(key, self._number(key, "send"))] = msg
            self._cond.notify_all()

    def _take(self, me: int, key: tuple, deadline: float, where: str) -> _Message | None:
        """The receive numbered ``key[-1]`` of ``key[:-1]``: wait for its message and take it."""
        with self._cond:
            if not self._wait_until(me, lambda: key in self._mail, deadline, where):
                return None
            return self._mail.pop(key)

    def _mark_taken(self, msg: _Message) -> None:
        with self._cond:
            msg.taken = True
            self._cond.notify_all()

    def _await_taken(self, me: int, msg: _Message, deadline: float, where: str) -> bool:
        with self._cond:
            return self._wait_until(me, lambda: msg.taken, deadline, where)

    def _complete(self, me: int, handle) -> bool:
        """Would ``wait(handle)`` of rank ``me`` return without blocking? (its ``test``)"""
        with self._cond:
            if self._failed is not None:
                return True
            for kind, t, item in handle.works:
                if (kind == "recv" and item[1] not in self._mail) or (kind == "send" and not item.taken):
                    return False
            return True

    # -- all-gather (agreement) ----------------------------------------------------------------
    def _all_gather(self, me: int, obj: Any, timeout_s: float, what: str) -> list[Any]:
        with self._cond:
            call = self._gather_calls[me]
            self._gather_calls[me] += 1
            slot = self._gathers.setdefault(call, _Gather())
            slot.values[me] = obj
            self._cond.notify_all()
            ok = self._wait_until(me, lambda: len(slot.values) == self.cp, time.monotonic() + timeout_s,
                                  f"{what}: agreement")
            if not ok:
                missing = [r for r in self.ranks if r not in slot.values]
                raise FCPAgreementError(
                    f"{what}: agreement across the in-process group {list(self.ranks)} did not complete within "
                    f"{timeout_s:g} s: ranks {missing} never reached it (they failed their own checks, took "
                    f"another path, or skipped an agreement the others ran)")
            values = [slot.values[r] for r in self.ranks]
            slot.read += 1
            if slot.read == self.cp:
                del self._gathers[call]
            return values

    # -- running -------------------------------------------------------------------------------
    def run(self, fn: Callable[["VirtualRank"], Any], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
        """Run ``fn(handle)`` for every rank, each in its own thread; return the results in CP order.

        On CUDA each thread runs under ``torch.cuda.stream(handle.stream)``; the streams first wait
        for the caller's current stream (inputs made there are ready), and the caller's device is
        synchronised once after all threads finished (results are ready; outside the transfer
        path). If a rank raises, the others are released (:class:`RankFailed`) and the first
        rank's exception is re-raised here; threads still running after ``timeout_s`` are released
        the same way and reported as a :class:`CommTimeout`.
        """
        if self._failed is not None:
            raise RuntimeError("this in-process group failed before; create a new InProcessGroup")
        results: list[Any] = [None] * self.cp
        errors: dict[int, BaseException] = {}
        start_event = None
        if self.device.type == "cuda":
            start_event = torch.cuda.Event()
            start_event.record(torch.cuda.current_stream(self.device))

        def body(i: int, rank: int) -> None:
            handle = self._handles[rank]
            try:
                with handle.activate(start_event):
                    results[i] = fn(handle)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors[i] = e
                self.fail(rank, e)

        threads = [threading.Thread(target=body, args=(i, r), name=f"fcp-virtual-rank-{r}", daemon=True)
                   for i, r in enumerate(self.ranks)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        stuck = [r for t, r in zip(threads, self.ranks) if t.is_alive()]
        if stuck:
            self.fail(None, CommTimeout(f"virtual ranks {stuck} did not finish within {timeout_s:g} s"))
            for t in threads:
                t.join(1.0)  # ranks blocked in a wait leave at once; one stuck in compute is left behind
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        own = [(i, e) for i, e in sorted(errors.items()) if not isinstance(e, RankFailed)]
        if own:
            i, e = own[0]
            e.add_note(f"(raised on virtual rank {self.ranks[i]} of the in-process group {list(self.ranks)})")
            raise e
        if stuck:
            raise CommTimeout(f"virtual ranks {stuck} of the in-process group {list(self.ranks)} did not finish "
                              f"within {timeout_s:g} s (a rank computing or waiting longer than the run's bound)")
        if errors:
            raise next(iter(errors.values()))
        return results


class VirtualRank(VirtualGroup):
    """One rank's ``cp_group`` in an :class:`InProcessGroup`: its global rank, the group's ranks,
    its CUDA stream (None on CPU), its transport and the agreement's all-gather."""

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self.group, self.rank, self.ranks = group, rank, group.ranks
        self.index = group.ranks.index(rank)
        self.stream = torch.cuda.Stream(device=group.device) if group.device.type == "cuda" else None

    def transport(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> "InProcessTransport":
        return InProcessTransport(self, timeout_s)

    def all_gather_object(self, obj: Any, timeout_s: float, what: str) -> list[Any]:
        return self.group._all_gather(self.rank, obj, timeout_s, what)

    @contextlib.contextmanager
    def activate(self, after=None):
        """CUDA: make this rank's stream (waiting for ``after``, an event) the thread's current stream."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.group.device), torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            yield

    def __repr__(self) -> str:
        return f"VirtualRank(rank={self.rank}, ranks={list(self.ranks)}, device={self.group.device})"


def _describe(kind: str, t: Transfer) -> str:
    return f"{'send to' if kind == 'send' else 'receive from'} rank {t.dst if kind == 'send' else t.src} of {t.block}"


class InProcessTransport(Transport):
    """The :class:`~megatron_fcp.attention.comm.Transport` of one virtual rank (Note [In-process transfers])."""

    def __init__(self, handle: VirtualRank, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.handle, self.group, self.rank = handle, handle.group, handle.rank
        self.timeout_s = float(timeout_s)
        self.cuda = self.group.device.type == "cuda"

    def post(self, round_sends, round_recvs, *, round_index: int, phase: str = "forward") -> Handle:
        h = Handle(phase, round_index)
        ready = None
        if self.cuda and round_sends:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        for t, buf in round_recvs:
            if t.dst != self.rank:
                raise ValueError(f"rank {self.rank} posted a receive of {t} addressed to rank {t.dst}")
            key = (phase, round_index, t.src, t.dst)
            h.works.append(("recv", t, (buf, (key, self.group._number(key, "recv")))))
            h.keep_alive.append(buf)
        for t, x in round_sends:
            if t.src != self.rank:
                raise ValueError(f"rank {self.rank} posted a send of {t} from rank {t.src}")
            msg = _Message(t, x.contiguous(), ready)
            self.group._put((phase, round_index, t.src, t.dst), msg)
            h.works.append(("send", t, msg))
        return h

    def wait(self, handle: Handle) -> None:
        deadline = time.monotonic() + self.timeout_s
        stream = torch.cuda.current_stream() if self.cuda else None
        for kind, t, item in handle.works:
            where = f"{handle.phase} round {handle.round_index}: {_describe(kind, t)} (rank {self.rank})"
            if kind == "recv":
                buf, numbered = item
                msg = self.group._take(self.rank, numbered, deadline, where)
                if msg is None:
                    raise CommTimeout(f"{handle.phase} round {handle.round_index}: {_describe(kind, t)} did not "
                                      f"arrive within {self.timeout_s:g} s (in-process group {list(self.group.ranks)}); "
                                      f"is rank {t.src} running the same plan?")
                self._receive(msg, t, buf, stream)
            else:
                if not self.group._await_taken(self.rank, item, deadline, where):
                    raise CommTimeout(f"{handle.phase} round {handle.round_index}: {_describe(kind, t)} was not "
                                      f"received within {self.timeout_s:g} s (in-process group "
                                      f"{list(self.group.ranks)}); is rank {t.dst} running the same plan?")
                if stream is not None and item.done is not None:
                    stream.wait_event(item.done)  # the receiver's copy has run before I touch the buffer
        handle.keep_alive.clear()

    def test(self, handle: Handle) -> bool:
        """Every receive's numbered message is in the mailbox and every send
        has been taken by its receiver. Non-blocking; a failed group answers True (``wait`` raises)."""
        return self.group._complete(self.rank, handle)

    def _receive(self, msg: _Message, t: Transfer, buf: torch.Tensor, stream) -> None:
        x = msg.tensor
        if msg.transfer != t or x.shape != buf.shape or x.dtype != buf.dtype:
            err = TransferMismatch(
                f"{t}: rank {t.src} sent {msg.transfer} {tuple(x.shape)} {x.dtype} but rank {self.rank} expects "
                f"{t} {tuple(buf.shape)} {buf.dtype}; the ranks run different plans or shapes (agree first)")
            self.group._mark_taken(msg)
            raise err
        if stream is None:
            buf.copy_(x)                                       # [2, blk, b, h_kv, d]
        else:
            if msg.ready is not None:
                stream.wait_event(msg.ready)                   # the sender's kernels producing x are done
            buf.copy_(x, non_blocking=True)                    # device-to-device, on my stream
            x.record_stream(stream)                            # allocator: x is in use on my stream too
            msg.done = torch.cuda.Event()
            msg.done.record(stream)
        self.group._mark_taken(msg)


def run_ranks(ranks: Sequence[int] | int, fn: Callable[[VirtualRank], Any], *, device: "str | torch.device" = "cpu",
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(cp_group)`` once per rank of a new :class:`InProcessGroup`, each in its own thread
    (on CUDA: its own stream); return the results in CP order. ``cp_group`` is a
    :class:`VirtualRank`: pass it to ``fcp_attention`` like a process group."""
    return InProcessGroup(ranks, device).run(fn, timeout_s=timeout_s)
