"""Non-blocking completion of gloo point-to-point rounds: daemon threads that wait them.

Note [Testing a gloo round]
---------------------------
The wave backward advances its reductions and re-sends between compute jobs on
``transport.test`` (Note [Backward waves] in :mod:`megatron_fcp.attention.backward_waves`), and the
cost model prices it so (Note [Wave pipeline timeline]). On gloo, ``Work.is_completed()`` of an
``isend`` or ``irecv`` stays False until ``wait()`` is called, however long ago the bytes moved
(measured, torch 2.13: a 256 KB pair 0.5 s after both ends posted: False, False; after ``wait``:
True). So a test never saw a round complete, every round was advanced only at the wave's blocking
finish, and the backward ran up to a job late per reduction hop: the emulated 2x4 GQA head-parallel
stage's backward took 0.82 s where the model, which tests as it should, priced 0.67 s.

A :class:`RoundWatch` asks a small process-wide pool of daemon threads (:data:`WATCHERS`) to wait the
round's works as soon as it is posted (``Work.wait`` releases the GIL); ``test`` is then "has the
watch finished". Whoever *claims* the round first waits its works: a watcher thread, or the
caller's own ``wait`` when every watcher is busy with other rounds (so a round is never left
waiting behind rounds that might depend on it: no deadlock, only a ``test`` that says False a
little longer). Errors (a timeout, a failed peer) raised in a watcher are re-raised by the
caller's ``wait``. Daemon threads never hold the interpreter at exit.

Note [Watchers hold nothing between rounds]
-------------------------------------------
A watcher thread drops the round it ran (or failed to claim) before it blocks for the next, and a
round drops its ``wait_works`` (the transport, hence the process group, and the round's works with
their tensors) once waited. Before, each watcher's frame kept its last round alive for the life of
the process, so ``destroy_process_group`` could not free the group: measured (torch 2.13, 2 gloo
ranks, three rounds, then destroy), a rank still ran 13 OS threads, the group's 3 among them; now
10. Those C++ threads lived on into interpreter finalization, where a thread that drops a Python
tensor needs a GIL the finalizing interpreter no longer gives. That is the likely cause of the one
abort seen in CI (stop 48: an emulated run's rank 1 ended every timed run, passed the final
barrier and died with ``terminate called without an active exception``); it did not recur in 10
reruns of that test, so it stays likely, not proven. With nothing held, the group is freed by
``destroy_process_group`` while the interpreter is whole.

Every gloo work is held as a :class:`OnceWork`: waited once, later waits get that wait's answer. A
gloo work must not be waited twice (the second ``wait`` waits for a second completion that never
comes: measured, a send then timed out), and a round's works may be waited by its watcher, by a
caller's ``wait`` and, when a wrapper merges rounds (``DelayTransport`` appends later sends'
works to the first handle), by another round's watcher.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

__all__ = ["WATCHERS", "OnceWork", "RoundWatch"]

WATCHERS = 8
"""Watcher threads per process: more than the rounds a rank has in flight at once (the wave
backward: two reductions and a re-send; the forward: one round ahead)."""

_queue: "queue.SimpleQueue[RoundWatch]" = queue.SimpleQueue()
_started = 0
_start_lock = threading.Lock()


class OnceWork:
    """A ``torch.distributed`` work waited at most once (module docstring): ``wait(timeout)`` waits it
    the first time and returns (or raises) that answer every time; :meth:`is_completed` is True once
    a wait has returned or raised."""

    def __init__(self, work) -> None:
        self.work = work
        self._lock = threading.Lock()
        self._waited = False
        self._result = None
        self._error: BaseException | None = None

    def wait(self, timeout=None):
        with self._lock:  # a second waiter blocks here until the first has its answer
            if not self._waited:
                try:
                    self._result = self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
                except BaseException as exc:
                    self._error = exc
                self._waited = True
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        return self._waited


def _watcher() -> None:
    while True:
        watch = _queue.get()
        if watch._claim():
            watch._run()
        del watch  # Note [Watchers hold nothing between rounds]


def _ensure_watchers() -> None:
    global _started
    if _started >= WATCHERS:
        return
    with _start_lock:
        while _started < WATCHERS:
            threading.Thread(target=_watcher, name=f"fcp-gloo-watch-{_started}", daemon=True).start()
            _started += 1


class RoundWatch:
    """Waits one posted round with ``wait_works`` (blocking, bounded, raising on failure), on a
    watcher thread or on the caller's :meth:`wait`, whichever claims it first (Note [Testing a
    gloo round])."""

    def __init__(self, wait_works: Callable[[], None]) -> None:
        self._wait_works = wait_works
        self._lock = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._error: BaseException | None = None
        _ensure_watchers()
        _queue.put(self)

    def _claim(self) -> bool:
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def _run(self) -> None:
        try:
            self._wait_works()
        except BaseException as exc:  # re-raised by wait(), in the caller's thread
            self._error = exc
        finally:
            self._wait_works = None  # the transport and its works: Note [Watchers hold nothing between rounds]
            self._done.set()

    def done(self) -> bool:
        """Non-blocking: is the round complete (or failed: :meth:`wait` then raises)?"""
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the round is complete; raise what waiting it raised."""
        if self._claim():
            self._run()
        else:
            self._done.wait()  # a watcher waits the works, bounded by their own timeout
        if self._error is not None:
            raise self._error
