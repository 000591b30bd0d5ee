"""Timeline of the wave-by-wave backward, rank by rank, as the executor runs it. Pure, no ``torch``.

Note [Wave pipeline timeline]
-----------------------------
:func:`~megatron_fcp.planning.packed_cost.simulate_backward_waves` prices the executor's backward
(Note [Backward waves] in :mod:`megatron_fcp.attention.backward_waves`) with this model. There is
no barrier between waves: every rank walks its own copy of the loop and blocks only on *its own*
messages, so a rank with nothing in wave w-1's last reverse rounds goes on to wave w+1 while the
others still reduce, and reductions of consecutive waves overlap where their links are disjoint
(on a rail cluster wave w's dK/dV crosses one rail while wave w+1's crosses another). Each rank
runs, one thread, in order::

    resend: for r in wave 0's rounds: post fetch r (after waiting r-1); wait the last
    for w = 0 .. W:                                   rounds = wave w-1's rounds, reversed
        for step j (max(len(rounds), 1) steps):
            post reduce rounds[j]                      (its sends and receives in that round, if any)
            resend: wait fetch of w+1's round in flight, post its next round
            compute this rank's j-th share of wave w's jobs (received blocks in plan order, then own)
            wait reduce rounds[j]
        resend: finish wave w+1's fetch (wait, post next, ... wait the last)

A job takes its query-key pairs times the backward's seconds per pair, plus one kernel launch. A
message starts when both ends have posted it and then holds each resource of its route for its
bytes over the resource's bandwidth, first come first served (a resource busy with an earlier
message delays it); it arrives a route latency later. Messages are resolved in order of start
time, after every rank has run as far as it can (a rank blocks at a wait whose messages are not
all resolved), so a message never takes a resource before one that started earlier. The result
is the last rank's end. The lock-step sum ``fetch(0) + sum_w max(reduce(w-1), compute(w),
fetch(w+1))`` (the model before this one) put a barrier after every wave; it cannot see that a
wave whose reduction is one slow link's transfer delays only the ranks on that transfer's path.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

from megatron_fcp.planning.blocks import Block
from megatron_fcp.planning.cost import _ResourceIndex
from megatron_fcp.planning.plan import Plan
from megatron_fcp.planning.waves import Wave
from megatron_fcp.topology import Topology

__all__ = ["wave_timeline"]


def _split(items: list, n: int) -> list[list]:
    """``items`` in ``n`` consecutive parts, earlier parts one longer (the executor's ``_split``)."""
    q, r = divmod(len(items), n)
    out, i = [], 0
    for j in range(n):
        m = q + (j < r)
        out.append(items[i:i + m])
        i += m
    return out


def wave_timeline(plan: Plan, waves: Sequence[Wave], topo: Topology, *, kv_bytes: Callable[[Block], float],
                  grad_bytes: Callable[[Block], float], job_s: Callable[[int, Block], float], resend: bool,
                  round_overhead_s: float = 0.0, buffered_sends: bool = False, trace: bool = False) -> dict:
    """Simulate the executor's wave loop (Note [Wave pipeline timeline]). ``kv_bytes``/``grad_bytes``:
    a block's K and V on the wire (re-send) and its dK/dV partial (reduction); ``job_s(rank, block)``:
    seconds of one gradient job. ``buffered_sends``: a rank's wait returns without its sends
    (gloo over TCP: a send is complete once the kernel has its bytes); default, a send is waited
    until it arrives (NCCL). Returns ``total_s`` (the last rank's end) and ``end_s`` per rank;
    ``trace``: also ``messages``, ``(phase, wave, round, src, dst, start, finish)`` in start order."""
    idx = _ResourceIndex(topo)
    ranks = list(plan.ranks)
    # messages: src, dst, bytes, route; per (phase, wave, round): rank -> its message ids
    m_src: list[int] = []
    m_dst: list[int] = []
    m_dur: list[list[tuple[int, float]]] = []
    m_lat: list[float] = []
    m_key: list[tuple[str, int, int]] = []
    posts: dict[tuple[str, int, int], dict[int, list[int]]] = {}

    def add(key, src: int, dst: int, nbytes: float) -> None:
        i = len(m_src)
        rid, lat = idx.route(src, dst)
        m_src.append(src)
        m_dst.append(dst)
        m_dur.append([(x, nbytes / idx.bw[x]) for x in rid.tolist()])
        m_lat.append(lat + round_overhead_s)
        m_key.append(key)
        by = posts.setdefault(key, {})
        by.setdefault(src, []).append(i)
        by.setdefault(dst, []).append(i)

    for w, wave in enumerate(waves):
        for r, t in wave.transfers:
            add(("red", w, r), t.dst, t.src, grad_bytes(t.block))   # reverse: the reader returns dK/dV
            if resend:
                add(("kv", w, r), t.src, t.dst, kv_bytes(t.block))
    jobs: dict[int, list[list[Block]]] = {x: [] for x in ranks}
    for wave in waves:
        for x in ranks:
            got = [t.block for _, t in wave.transfers if t.dst == x and (t.block, x) in wave.computes]
            jobs[x].append(got + [b for b in plan.local_blocks(x) if (b, x) in wave.computes])
    W = len(waves)

    def program(x: int):
        """The executor's loop for rank ``x`` as ops: ("post", ids), ("wait", ids), ("compute", s)."""
        def ids(key):
            return posts.get(key, {}).get(x, [])

        def fetch_steps(w: int):  # _Fetch.step, one per call: wait the round in flight, post the next
            pending = None
            for r in waves[w].rounds:
                if pending:
                    yield ("wait", pending)
                pending = ids(("kv", w, r))
                if pending:
                    yield ("post", pending)
                yield None                                    # one step done
            if pending:
                yield ("wait", pending)
            yield None

        if resend and W:
            for op in fetch_steps(0):
                if op is not None:
                    yield op
        for w in range(W + 1):
            rounds = list(reversed(waves[w - 1].rounds)) if w else []
            steps = max(len(rounds), 1)
            todo = _split(jobs[x][w], steps) if w < W else [[] for _ in range(steps)]
            nxt = fetch_steps(w + 1) if resend and w + 1 < W else None
            nxt_done = nxt is None
            for j in range(steps):
                red = ids(("red", w - 1, rounds[j])) if j < len(rounds) else []
                if red:
                    yield ("post", red)
                if not nxt_done:
                    for op in nxt:
                        if op is None:
                            break
                        yield op
                for b in todo[j]:
                    yield ("compute", job_s(x, b))
                if red:
                    yield ("wait", red)
            if not nxt_done:
                for op in nxt:
                    if op is not None:
                        yield op

    n_msgs = len(m_src)
    posted: list[list[float]] = [[] for _ in range(n_msgs)]
    fin: list[float | None] = [None] * n_msgs
    clock = {x: 0.0 for x in ranks}
    gens = {x: program(x) for x in ranks}
    blocked: dict[int, list[int]] = {}
    heap: list[tuple[float, int]] = []
    free: dict[int, float] = {}
    runnable = list(reversed(ranks))
    order: list[tuple[int, float]] = []

    def run(x: int) -> None:
        g = gens[x]
        while True:
            op = next(g, None)
            if op is None:
                return
            kind, arg = op
            if kind == "compute":
                clock[x] += arg
            elif kind == "post":
                for i in arg:
                    posted[i].append(clock[x])
                    if len(posted[i]) == 2:
                        heapq.heappush(heap, (max(posted[i]), i))
            else:  # wait
                if buffered_sends:
                    arg = [i for i in arg if m_dst[i] == x]
                    if not arg:
                        continue
                if any(fin[i] is None for i in arg):
                    blocked[x] = arg
                    return
                clock[x] = max(clock[x], max(fin[i] for i in arg))

    while True:
        while runnable:
            run(runnable.pop())
        if not heap:
            break
        s, i = heapq.heappop(heap)
        begin = max([s] + [free.get(x, 0.0) for x, _ in m_dur[i]])
        for x, d in m_dur[i]:
            free[x] = begin + d
        fin[i] = begin + max((d for _, d in m_dur[i]), default=0.0) + m_lat[i]
        if trace:
            order.append((i, s))
        for x in (m_src[i], m_dst[i]):
            arg = blocked.get(x)
            if arg is not None and all(fin[k] is not None for k in arg):
                del blocked[x]
                clock[x] = max(clock[x], max(fin[k] for k in arg))
                runnable.append(x)
    if blocked:
        raise RuntimeError(f"wave timeline: ranks {sorted(blocked)} wait on messages never posted (a bug)")
    out = {"total_s": max(clock.values(), default=0.0), "end_s": [clock[x] for x in ranks]}
    if trace:
        out["messages"] = [(*m_key[i], m_src[i], m_dst[i], s, fin[i]) for i, s in order]
    return out
