"""A schedule search shared over ``n`` ranks, all in one process (Note [Sharing the search] in
:mod:`megatron_fcp.planner.choose`): one thread per rank, the gather a barrier over a list.

What the tests compare with the one-process search and what the setup benchmark times: each
thread's CPU seconds (``time.thread_time``) are what that rank would spend, since a rank's part
touches only the plans it compiles itself. Every object is passed through JSON, as
:func:`~megatron_fcp.attention.agreement.gather_json` carries it. Pure Python, no torch.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from megatron_fcp.planner.choose import ScheduleChoice, SearchShare, choose_schedule

__all__ = ["SharedRun", "run_shared_search"]


@dataclass(frozen=True)
class SharedRun:
    """Per rank: its choice, its CPU seconds, how many entries it sent in each gather, and the
    entries themselves (as the wire carried them)."""

    choices: tuple[ScheduleChoice, ...]
    cpu_s: tuple[float, ...]
    sent: tuple[tuple[int, ...], ...]
    objects: tuple[tuple[list, ...], ...]


def run_shared_search(n: int, *args, **kwargs) -> SharedRun:
    """``choose_schedule(*args, **kwargs, share=...)`` on ``n`` threads sharing one search."""
    slots: list = [None] * n
    choices: list = [None] * n
    cpu = [0.0] * n
    sent: list[list[int]] = [[] for _ in range(n)]
    objects: list[list[list]] = [[] for _ in range(n)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def gather_for(r: int):
        def gather(obj):
            slots[r] = json.loads(json.dumps(obj))   # what the wire carries
            sent[r].append(len(obj))
            objects[r].append(slots[r])
            barrier.wait()
            got = list(slots)
            barrier.wait()
            return got
        return gather

    def work(r: int) -> None:
        t0 = time.thread_time()
        try:
            choices[r] = choose_schedule(*args, share=SearchShare(r, n, gather_for(r)), **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised below; the others must not wait forever
            errors.append(exc)
            barrier.abort()
        cpu[r] = time.thread_time() - t0

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return SharedRun(tuple(choices), tuple(cpu), tuple(tuple(s) for s in sent), tuple(tuple(o) for o in objects))
