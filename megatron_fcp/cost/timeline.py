"""Timeline of the wave-by-wave backward, rank by rank, as the executor runs it. Pure, no ``torch``.

Note [Wave pipeline timeline]
-----------------------------
:func:`~megatron_fcp.cost.backward.simulate_backward_waves` prices the executor's backward
(Note [Backward waves] in :mod:`megatron_fcp.attention.backward_waves`) with this model. There is
no barrier between waves: every rank walks its own copy of the loop and blocks only on *its own*
messages, so a rank with nothing in wave w-1's last reverse rounds goes on to wave w+1 while the
others still reduce, and reductions of consecutive waves overlap where their links are disjoint
(on a rail cluster wave w's dK/dV crosses one rail while wave w+1's crosses another). Each rank
runs, one thread, in order::

    wave 0's own jobs (resend: while wave 0's fetch rounds are posted one after another, each
                       after the one before completed, polled between jobs; one wave: the first
                       half of them, the rest after the wave: leading_own_jobs)
    for w = 0 .. W:
        queue reduce(w-1) (rounds reversed) and resend: fetch(w+1), interleaved, behind the rest
        for each job of wave w (received blocks in plan order, then own; wave 0: the rest):
            poll: while the head of the queue's predecessor in its own chain is complete at the
                  rank's clock (test), post the head
            compute the job
        finish: post the queue up to fetch(w+1)'s last round and reduce(w-2)'s, waiting for each
                predecessor, then wait those chains' last rounds (reduce(w-1) runs on)

A job takes its query-key pairs times the backward's seconds per pair, plus one kernel launch. A
message starts when both ends have posted it; each resource of its route then carries its bytes
over the resource's bandwidth after the bytes it already took, first come first served, and the
message arrives a route latency after its last resource is through. Resources queue
independently: one idles only when nothing has been sent its way, as in a network where packets
of concurrent messages interleave and as the forward's per-round bottleneck model has it (Note
[Cost model] in :mod:`megatron_fcp.cost.model`: a batch posted together takes its most loaded
resource's time), and as Transformer Engine's baselines are priced. Before 2026-12-03 a message
held every resource of its route from the moment all of them were free, which left the others
idle meanwhile: at cp = 256 (32 dgx-h100 nodes; GQA 32:4, a = 8, 32K-token documents, 29 waves
re-sent) wave 0's re-send, 2,280 messages whose most loaded link needs 2.08 ms, then took 3.57 ms,
and the backward priced 61.1 ms against 25.1 ms now, for the same waves (64:8: 64.0 against 38.5
ms). That older rule, ``held_routes``, stays the emulated cluster's (gloo over
TCP on shaped veth links): re-predicting its 70 stored runs, the queues put ``fcp-full`` on 2x4
rails at 3.69 s against 4.34 s measured (+17.7%; held routes 4.12 s, +5.4%) and move no run of
that cluster closer; on one node ``fcp-full`` measured 1.37 s, queues 1.34 s, held routes 1.52 s
(docs/emulator.md, "Link contention"). Messages are resolved
in order of start time, after every rank has run as far as it can (a rank blocks at a wait
whose messages are not all resolved), so a message never takes a resource before one that
started earlier. A send is
complete for its sender when it arrives (NCCL) or, with ``buffered_sends`` (gloo over TCP), when it
starts: gloo's ``isend`` completes only once the peer has posted the matching receive (measured
here: a 4 KiB .. 16 MiB send's wait returned when a receiver that posted 1 s late did), and the
socket then takes the bytes (a model that took buffered sends as complete at once let a rank run
ahead of a receiver that had not posted, and under-priced them). A test at
clock t answers False once a message of it starts at or after t, else waits (in the simulation,
not in simulated time) until its messages are resolved and compares their arrival with t. The
result is the last rank's end. No barrier between waves: a wave whose reduction is one slow link's
transfer delays only the ranks on that transfer's path, which a lock-step sum over waves cannot see.

Note [Wave timeline floor]
--------------------------
:func:`wave_timeline_floor` bounds :func:`wave_timeline` from below without its event simulation,
so a search can rule a wave candidate out after packing its waves and before simulating them
(:meth:`~megatron_fcp.cost.head_parallel.HeadParallelPricing.packed_floor`). It keeps only
constraints every run of the loop above obeys, each of the form "this happens no sooner than
that", so with every input at its least the recursion yields a time no later than the
simulation's. Per rank ``x`` with ``T_x(w)`` the start of its iteration ``w``:

* ``T_x(0)`` is at least its leading own jobs, and wave 0's fetch (when it is re-sent);
* ``T_x(w+1)`` is at least ``T_x(w)`` plus its jobs of iteration ``w``, and the completion at ``x``
  of fetch(w+1) and of red(w-2) (what ``finish`` waits for); the end is iteration ``W``'s, after
  red(W-1) and red(W-2);
* a chain (one wave's fetch, or its reduction rounds reversed) queued in iteration ``w`` is posted
  by ``x`` no sooner than ``T_x(w)``, each next round of it no sooner than its previous round
  completed at ``x``;
* a message starts no sooner than both ends posted it, and arrives no sooner than its start plus
  its route's slowest resource and its latency (NCCL: a send completes when it arrives; gloo's
  buffered sends when they start);
* a rank's messages of one round start no sooner than it posts them and queue on every resource
  they share, so the round completes no sooner than the post plus their summed time on the
  busiest such resource plus the least latency;
* every message of the backward (re-sends and reductions, all waves) holds each resource of its
  route for its bytes over its bandwidth, one message at a time, so the backward lasts at least
  the busiest resource's sum.

What it leaves out (contention between different ranks' messages, the queue's order across
chains, polling only between jobs) is why it sits below; every constraint it keeps holds in every
run. The floor is the longest path
through these constraints: when a wave's blocks leave a few owners, each wave waits on one
sender's NIC and the path sums those queues over the waves, which neither the compute floor nor
the per-resource byte floors (Note [Backward floors] in :mod:`megatron_fcp.cost.floors`) see.
Tested below the timeline for every wave-running builder, KV mode, send completion, packed
placements and windows (``tests/test_wave_floor.py``).
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

import numpy as np

from megatron_fcp.contract.blocks import Block
from megatron_fcp.contract.plan import Plan
from megatron_fcp.cost.model import _ResourceIndex, round_comm_s
from megatron_fcp.jit import jit
from megatron_fcp.schedule.chains import ChainStep
from megatron_fcp.schedule.launches import launch_ids, launch_starts
from megatron_fcp.schedule.waves import Wave, block_sizes, loop_job_columns, loop_jobs, wave_columns
from megatron_fcp.topology import Topology

__all__ = ["wave_timeline", "wave_timeline_floor", "chain_timeline", "chain_step_compute", "chain_launches"]


def wave_timeline(plan: Plan, waves: Sequence[Wave], topo: Topology, *, kv_bytes: Callable[[Block], float],
                  grad_bytes: Callable[[Block], float], job_s: Callable[[int, Block], float], resend: bool,
                  round_overhead_s: float = 0.0, buffered_sends: bool = False, trace: bool = False,
                  first_kept: bool = False, first_fetch: Wave | None = None, held_routes: bool = False) -> dict:
    """Simulate the executor's wave loop (Note [Wave pipeline timeline]). ``kv_bytes``/``grad_bytes``:
    a block's K and V on the wire (re-send) and its dK/dV partial (reduction); ``job_s(rank, block)``:
    seconds of one gradient job. ``buffered_sends``: a rank's wait on its sends returns when they
    start, i.e. once their receivers have posted (gloo over TCP: a send waits for its receive, then
    the socket takes the bytes; Note [Wave pipeline timeline]); default, a send is waited
    until it arrives (NCCL). ``held_routes``: a message holds every resource of its route from the
    moment all of them are free (gloo over TCP on the emulated cluster; default, each resource
    queues on its own: Note [Wave pipeline timeline]). ``first_kept``: the first wave's KV was kept by the forward (no fetch);
    ``first_fetch``: only some ranks kept theirs, this part of the first wave is re-sent
    (:func:`~megatron_fcp.schedule.waves.first_fetch`).
    Returns ``total_s`` (the last rank's end), ``end_s`` and ``jobs_end_s`` (its last job's end) per rank;
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

    routes: dict[tuple[int, int], tuple[list[tuple[int, float]], float]] = {}   # (src, dst): [(resource, bw)], latency

    def add(key, src: int, dst: int, nbytes: float) -> None:
        i = len(m_src)
        hit = routes.get((src, dst))
        if hit is None:
            rid, lat = idx.route(src, dst)
            hit = routes[(src, dst)] = ([(x, idx.bw[x]) for x in rid.tolist()], lat + round_overhead_s)
        m_src.append(src)
        m_dst.append(dst)
        m_dur.append([(x, nbytes / bw) for x, bw in hit[0]])
        m_lat.append(hit[1])
        m_key.append(key)
        by = posts.setdefault(key, {})
        by.setdefault(src, []).append(i)
        by.setdefault(dst, []).append(i)

    fetched = [wave if w or first_fetch is None else first_fetch for w, wave in enumerate(waves)]
    for w, wave in enumerate(waves):
        for r, t in wave.transfers:
            add(("red", w, r), t.dst, t.src, grad_bytes(t.block))   # reverse: the reader returns dK/dV
        for r, t in (fetched[w].transfers if resend and not (first_kept and w == 0) else ()):
            add(("kv", w, r), t.src, t.dst, kv_bytes(t.block))
    W = len(waves)
    jobs, n_own, last = loop_jobs(plan, waves)

    def program(x: int):
        """The executor's loop for rank ``x`` as ops: ("post", ids), ("wait", ids), ("compute", s),
        ("test", ids) (answered through ``send``: are they all complete at the rank's clock?)."""
        def ids(key):
            return posts.get(key, {}).get(x, [])

        order: list[tuple[tuple, tuple]] = []        # the executor's _Pump: (chain, message key) in post order
        pending: dict[tuple, list[int]] = {}         # chain -> its round in flight
        k = 0

        def extend(*chains: list) -> None:
            order.extend((c[j][:2], c[j]) for j in range(max(map(len, chains))) for c in chains if j < len(c))

        def poll():
            nonlocal k
            while k < len(order):
                chain, key = order[k]
                p = pending.get(chain)
                if p:
                    if not (yield ("test", p)):
                        break
                    yield ("wait", p)
                pending[chain] = ids(key)
                if pending[chain]:
                    yield ("post", pending[chain])
                k += 1
            # (the executor also tests each chain's last round here, to settle a wave's sums early;
            # that changes no time: a complete round's wait returns at once, later or now)

        def finish(chains: set):
            nonlocal k
            last = max((i for i in range(k, len(order)) if order[i][0] in chains), default=-1)
            while k <= last:
                chain, key = order[k]
                if pending.get(chain):
                    yield ("wait", pending[chain])
                pending[chain] = ids(key)
                if pending[chain]:
                    yield ("post", pending[chain])
                k += 1
            for chain in chains:
                if pending.get(chain):
                    yield ("wait", pending.pop(chain))

        fetch0 = resend and W and not first_kept
        if fetch0:
            extend([("kv", 0, r) for r in fetched[0].rounds])
        for b in (jobs[x][0][:n_own[x]] if W else []):
            yield from poll()
            yield ("compute", job_s(x, b))
        if fetch0:
            yield from finish({("kv", 0)})
        for w in range(W + 1):
            red = [("red", w - 1, r) for r in reversed(waves[w - 1].rounds)] if w else []
            kv = [("kv", w + 1, r) for r in waves[w + 1].rounds] if resend and w + 1 < W else []
            extend(red, kv)
            for b in (jobs[x][w][n_own[x] if w == 0 else 0:] if w < W else last[x]):
                yield from poll()
                yield ("compute", job_s(x, b))
            # before wave w+1: its KV is here, wave w-2's reduction through (w-1's runs on); at the end, all
            yield from finish({("kv", w + 1), ("red", w - 2)} if w < W else {("red", w - 1), ("red", w - 2)})

    n_msgs = len(m_src)
    posted: list[list[float]] = [[] for _ in range(n_msgs)]
    fin: list[float | None] = [None] * n_msgs
    clock = {x: 0.0 for x in ranks}
    jobs_end = {x: 0.0 for x in ranks}
    gens = {x: program(x) for x in ranks}
    blocked: dict[int, set[int]] = {}                       # rank -> the messages its wait still needs
    blocked_at: dict[int, float] = {}                       # rank -> the latest completion its wait knows
    heap: list[tuple[float, int]] = []
    free: dict[int, float] = {}
    runnable = list(reversed(ranks))
    order: list[tuple[int, float]] = []

    answer: dict[int, bool | None] = {}
    tested: dict[int, set[int]] = {}                        # rank -> its pending test's unknown messages
    tested_at: dict[int, float] = {}                        # rank -> the latest completion its test knows
    tested_late: dict[int, bool] = {}                       # rank -> a message of its test started at/after its clock

    def done(i: int, x: int) -> float | None:
        """When message ``i`` is complete for rank ``x`` (None: not known yet): its arrival, or with
        ``buffered_sends`` for its sender the moment the receiver has posted too (gloo hands the
        bytes to the socket then: a send waits for its receive, not for the wire)."""
        if buffered_sends and m_src[i] == x:
            return max(posted[i]) if len(posted[i]) == 2 else None
        return fin[i]

    def verdict(x: int, arg: list[int], final: bool = False) -> bool | None:
        """A test at ``x``'s clock: False once a message starts at or after it, True/False once all
        are known, None (undecided: the rank waits for the simulation to catch up) otherwise; a
        send whose receiver has not posted is False once the receiver is past ``x``'s clock or
        nothing can run (``final``)."""
        for i in arg:
            if len(posted[i]) == 2 and max(posted[i]) >= clock[x]:
                return False
        times = [done(i, x) for i in arg]
        if all(t is not None for t in times):
            return max(times, default=0.0) <= clock[x]
        for i, t in zip(arg, times):
            if t is None and buffered_sends and m_src[i] == x and (final or clock[m_dst[i]] >= clock[x]):
                return False
        return None

    def run(x: int) -> None:
        g = gens[x]
        while True:
            try:
                op = g.send(answer.pop(x, None))
            except StopIteration:
                return
            kind, arg = op
            if kind == "test":
                v = verdict(x, arg) if arg else True
                if v is None:        # undecided: follow its unknown messages (touch) until it is
                    times = [done(i, x) for i in arg]
                    tested[x] = {i for i, t in zip(arg, times) if t is None}
                    tested_at[x] = max((t for t in times if t is not None), default=0.0)
                    tested_late[x] = False
                    return
                answer[x] = v
            elif kind == "compute":
                clock[x] += arg
                jobs_end[x] = clock[x]
            elif kind == "post":
                for i in arg:
                    posted[i].append(clock[x])
                    if len(posted[i]) == 2:
                        heapq.heappush(heap, (max(posted[i]), i))
                        other = m_src[i] if m_src[i] != x else m_dst[i]
                        touch(i, other)
                        unblock(other)
                        wake(other)
            else:  # wait
                times = [done(i, x) for i in arg]
                if any(t is None for t in times):
                    blocked[x] = {i for i, t in zip(arg, times) if t is None}
                    blocked_at[x] = max((t for t in times if t is not None), default=0.0)
                    return
                clock[x] = max([clock[x], *times])

    def touch(i: int, x: int) -> None:
        """Message ``i`` of ``x`` was posted by both ends or resolved: update what ``x``'s pending
        wait or test knows of it (each message is looked at once per event, not every message of
        the wait at every event)."""
        s = blocked.get(x)
        if s is not None and i in s:
            t = done(i, x)
            if t is not None:
                s.discard(i)
                blocked_at[x] = max(blocked_at[x], t)
        s = tested.get(x)
        if s is not None and i in s:
            if len(posted[i]) == 2 and max(posted[i]) >= clock[x]:
                tested_late[x] = True
            t = done(i, x)
            if t is not None:
                s.discard(i)
                tested_at[x] = max(tested_at[x], t)

    def unblock(x: int) -> None:
        """``x`` waits on messages: resume it once all are complete for it."""
        s = blocked.get(x)
        if s is not None and not s:
            del blocked[x]
            clock[x] = max(clock[x], blocked_at.pop(x))
            runnable.append(x)

    def pending_verdict(x: int, final: bool) -> bool | None:
        """:func:`verdict` of ``x``'s pending test from what :func:`touch` recorded (the same answer)."""
        if tested_late[x]:
            return False
        s = tested[x]
        if not s:
            return tested_at[x] <= clock[x]
        if buffered_sends:
            for i in s:
                if m_src[i] == x and (final or clock[m_dst[i]] >= clock[x]):
                    return False
        return None

    def wake(x: int, final: bool = False) -> None:
        """A message of ``x`` was posted by both ends or resolved: decide ``x``'s pending test."""
        if x in tested:
            v = pending_verdict(x, final)
            if v is not None:
                del tested[x]
                answer[x] = v
                runnable.append(x)

    while True:
        while runnable:
            run(runnable.pop())
        if not heap:
            for x in list(tested):          # nothing can run: a test of a send still unmatched says False
                wake(x, final=True)
            if runnable:
                continue
            break
        s, i = heapq.heappop(heap)
        if held_routes:                  # the whole route at once, once every resource of it is free
            begin = max([s] + [free.get(x, 0.0) for x, _ in m_dur[i]])
            for x, d in m_dur[i]:
                free[x] = begin + d
            fin[i] = begin + max((d for _, d in m_dur[i]), default=0.0) + m_lat[i]
        else:                            # each resource of the route serves it after what it already took
            end = s
            for x, d in m_dur[i]:
                free[x] = max(s, free.get(x, 0.0)) + d
                end = max(end, free[x])
            fin[i] = end + m_lat[i]
        if trace:
            order.append((i, s))
        for x in (m_src[i], m_dst[i]):
            touch(i, x)
            unblock(x)
            wake(x)
    if blocked or tested:
        raise RuntimeError(f"wave timeline: ranks {sorted(set(blocked) | set(tested))} wait on messages never "
                           f"posted (a bug)")
    out = {"total_s": max(clock.values(), default=0.0), "end_s": [clock[x] for x in ranks],
           "jobs_end_s": [jobs_end[x] for x in ranks]}
    if trace:
        out["messages"] = [(*m_key[i], m_src[i], m_dst[i], s, fin[i]) for i, s in order]
    return out


def chain_timeline(steps: tuple[ChainStep, ...], topo: Topology, *, kv_bytes: Callable[[Block], float],
                   grad_bytes: Callable[[Block], float], job_s: Callable[[int, Block], float], resend: bool,
                   round_overhead_s: float = 0.0, launch_s: float = 0.0,
                   call_s: "Callable[[int, tuple[Block, ...]], float] | None" = None) -> dict:
    """Lock-step time of ``steps`` (Note [Streaming chain backward]): per step the longer of the
    busiest rank's jobs and the step's messages (KV when ``resend``, partials, homes) under
    contention. ``job_s``: a job's compute; ``launch_s``: one kernel launch per rank, owner and
    step with work (the executor's calls: Note [One launch per owner and stage] in
    :mod:`megatron_fcp.schedule.launches`); ``call_s``: as for :func:`chain_step_compute`. Returns
    ``total_s``, per-step ``compute_s`` and ``comm_s``, ``resend_s`` (the KV messages alone, summed)
    and ``jobs_end_s`` (when the last step with jobs ends its compute: the busiest rank's last job)."""
    total = resend_s = jobs_end = 0.0
    comps, comms = [], []
    idx = _ResourceIndex(topo)                 # routes looked up once for all steps
    for st, c in zip(steps, chain_step_compute(steps, job_s, launch_s, call_s)):
        msgs = [(t.src, t.dst, grad_bytes(t.block)) for t in st.grad + st.home]
        kvm = [(t.src, t.dst, kv_bytes(t.block)) for t in st.kv] if resend else []
        m = round_comm_s(idx, msgs + kvm, round_overhead_s)
        if kvm:
            resend_s += round_comm_s(idx, kvm, round_overhead_s)
        comps.append(c)
        comms.append(m)
        if st.computes:
            jobs_end = total + c
        total += max(c, m)
    return {"total_s": total, "compute_s": comps, "comm_s": comms, "resend_s": resend_s, "jobs_end_s": jobs_end}


def chain_step_compute(steps: Sequence[ChainStep], job_s: Callable[[int, Block], float],
                       launch_s: float = 0.0,
                       call_s: "Callable[[int, tuple[Block, ...]], float] | None" = None) -> list[float]:
    """Per step of ``steps``, the busiest rank's jobs: ``job_s`` each (work, launch not included)
    plus one launch per call the executor makes, one per rank and owner among the step's jobs
    with work (:func:`~megatron_fcp.schedule.launches.launch_ids`, Note [One launch per owner and
    stage]); ``call_s(rank, blocks)``: the work of one call on several blocks (tile pricing; None:
    the sum of its jobs', the FLOP model's). :func:`chain_timeline`'s compute, and their sum is a
    floor on its total."""
    out = []
    for s, st in enumerate(steps):
        w, first = _step_calls(s, st, job_s)
        busy: dict[int, float] = {}
        if call_s is not None and len(first) < sum(1 for v in w if v > 0):   # a call on several blocks
            ids = launch_ids([s] * len(w), [x for _, x in st.computes], [b.owner for b, _ in st.computes],
                             [v > 0 for v in w]).tolist()
            calls: dict[int, list[int]] = {}
            for i, g in enumerate(ids):
                if g >= 0:
                    calls.setdefault(g, []).append(i)
            for idx in calls.values():
                x = st.computes[idx[0]][1]
                v = w[idx[0]] if len(idx) == 1 else call_s(x, tuple(st.computes[i][0] for i in idx))
                busy[x] = busy.get(x, 0.0) + v + launch_s
        else:
            for i, ((b, x), v) in enumerate(zip(st.computes, w)):
                busy[x] = busy.get(x, 0.0) + v + (launch_s if i in first else 0.0)
        out.append(max(busy.values(), default=0.0))
    return out


def _step_calls(s: int, st: ChainStep, job_s: Callable[[int, Block], float]) -> tuple[list[float], set[int]]:
    """Step ``s``'s jobs' work and the indices (into ``st.computes``) of the jobs that start a call."""
    w = [job_s(x, b) for b, x in st.computes]
    if not w:
        return w, set()
    first = launch_starts([s] * len(w), [x for _, x in st.computes], [b.owner for b, _ in st.computes],
                          [v > 0 for v in w])
    return w, set(first.tolist())


def chain_launches(steps: Sequence[ChainStep], job_s: Callable[[int, Block], float]) -> dict[int, int]:
    """Kernel calls per rank that :func:`chain_step_compute` prices (the executor's calls)."""
    out: dict[int, int] = {}
    for s, st in enumerate(steps):
        for i in _step_calls(s, st, job_s)[1]:
            x = st.computes[i][1]
            out[x] = out.get(x, 0) + 1
    return out


def wave_timeline_floor(plan: Plan, waves: Sequence[Wave], topo: Topology, *, kv_bytes: Callable[[Block], float],
                        grad_bytes: Callable[[Block], float], job_s: Callable[[int, Block], float], resend: bool,
                        round_overhead_s: float = 0.0, buffered_sends: bool = False, first_kept: bool = False,
                        first_fetch: Wave | None = None,
                        job_seconds: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> float:
    """A lower bound on :func:`wave_timeline`'s ``total_s`` for the same arguments, without the
    event simulation (Note [Wave timeline floor]). ``job_seconds``: ``job_s`` of many jobs at once,
    ``(CP positions, block numbers) -> seconds``, where the caller has it; else ``job_s`` is called
    per job (:func:`_job_sums`)."""
    idx = _ResourceIndex(topo)
    ranks = list(plan.ranks)
    W = len(waves)
    blocks = plan.blocks()
    # per rank and iteration of the loop: its jobs' seconds (iteration 0: after the leading own jobs;
    # iteration W: the first wave's own jobs left for the end)
    lead, comp = _job_sums(plan, waves, job_seconds or (
        lambda q, blk: np.array([job_s(ranks[x], blocks[i]) for x, i in zip(q.tolist(), blk.tolist())],
                                dtype=np.float64)))

    # every chain's messages as columns: block numbers (plan.blocks() order); the routes of every
    # (sender, receiver) pair of the plan, either way, looked up once (Note [Route ids])
    R = max(ranks) + 1
    kv_size = block_sizes(plan, kv_bytes, np.float64)
    grad_size = block_sizes(plan, grad_bytes, np.float64)
    all_src, all_dst = plan.transfer_columns()[1:3]
    pair_keys = np.unique(np.concatenate([all_src * R + all_dst, all_dst * R + all_src]))  # [pairs] sorted
    pair_len, pair_ids, pair_latency = idx.route_columns(pair_keys // R, pair_keys % R)
    pair_ptr = np.zeros(len(pair_keys) + 1, dtype=np.int64)
    np.cumsum(pair_len, out=pair_ptr[1:])
    pair_lat = np.asarray(pair_latency, dtype=np.float64) + round_overhead_s
    bws = np.array(idx.bw, dtype=np.float64)
    held = np.zeros(len(bws))                                          # seconds each resource is held

    def chain(wave: Wave, reverse: bool, size: Callable[[Block], float], start: dict[int, float]) -> dict[int, float]:
        """Each rank's completion of one chain (a wave's fetch, or reversed its reduction), every
        rank posting its first round no sooner than ``start`` and each next round once its last
        completed: a message starts once both ends posted and takes its route's slowest resource
        plus latency; a rank's messages of a round share its resources. Ranks without messages:
        ``start`` (:func:`_chain_floor`, compiled)."""
        rnd, src, dst, own, chunk, part = wave_columns(plan, wave)
        s, d = (dst, src) if reverse else (src, dst)
        route = np.searchsorted(pair_keys, s * R + d)                   # [T]: each message's pair
        block = plan.block_numbers(own, chunk, part)
        order = np.argsort(-rnd if reverse else rnd, kind="stable")     # rounds in turn, plan order in each
        ready = _chain_floor(rnd[order], plan.cp_positions(s)[order], plan.cp_positions(d)[order], route[order],
                             (kv_size if size is kv_bytes else grad_size)[block[order]], pair_ptr, pair_ids,
                             pair_lat, bws, held, np.array([start[x] for x in ranks], dtype=np.float64),
                             buffered_sends)
        return dict(zip(ranks, ready.tolist()))

    fetched = [wave if w or first_fetch is None else first_fetch for w, wave in enumerate(waves)]
    zero = dict.fromkeys(ranks, 0.0)
    begin = dict(lead)                                               # T_x(0): the leading own jobs, then wave 0's KV
    if resend and W and not first_kept:
        got = chain(fetched[0], False, kv_bytes, zero)
        begin = {x: max(lead[x], got[x]) for x in ranks}
    reduced: list[dict[int, float]] = []                             # red(w) complete, per rank
    end = zero
    for w in range(W + 1):
        # iteration w: red(w-1) and fetch(w+1) posted from its start; its jobs; then it waits fetch(w+1)
        # and red(w-2) (the last iteration: red(w-1) and red(w-2))
        if w:
            reduced.append(chain(waves[w - 1], True, grad_bytes, begin))
        nxt = {x: begin[x] + comp[w][x] for x in ranks}
        if resend and w + 1 < W:
            got = chain(fetched[w + 1], False, kv_bytes, begin)
            nxt = {x: max(nxt[x], got[x]) for x in ranks}
        for v in ((w - 2,) if w < W else (w - 1, w - 2)):
            if 0 <= v < len(reduced):
                nxt = {x: max(nxt[x], reduced[v][x]) for x in ranks}
        begin, end = nxt, nxt
    # every message of the backward holds each resource of its route for its bytes, one at a time
    return max(max(end.values(), default=0.0), float(held.max()) if len(held) else 0.0)


def _job_sums(plan: Plan, waves: Sequence[Wave], job_seconds: Callable[[np.ndarray, np.ndarray], np.ndarray]
              ) -> tuple[dict[int, float], list[dict[int, float]]]:
    """:func:`wave_timeline_floor`'s per-rank job seconds with every job priced at once
    (``job_seconds``) instead of a call per job: ``lead`` (wave 0's leading own jobs) and ``comp[w]``
    (iteration ``w``'s other jobs; ``comp[W]`` wave 0's own jobs left for the end), over
    :func:`~megatron_fcp.schedule.waves.loop_job_columns` and added in the order each rank runs
    them (``np.add.at`` adds repeated indices in turn), as the call-per-job sums do."""
    ranks = list(plan.ranks)
    it, q, blk, leading = loop_job_columns(plan, waves)
    secs = job_seconds(q, blk)
    lead = np.zeros(len(ranks))
    comp = np.zeros((len(waves) + 1, len(ranks)))
    first = leading == 1
    np.add.at(lead, q[first], secs[first])
    np.add.at(comp, (it[~first], q[~first]), secs[~first])
    return dict(zip(ranks, lead.tolist())), [dict(zip(ranks, c.tolist())) for c in comp]


@jit
def _chain_floor(rnd, s, d, route, nbytes, pair_ptr, pair_ids, pair_lat, bws, held, start, buffered):
    """One chain of :func:`wave_timeline_floor` over columns (compiled: Note [Compiled planning
    loops] in :mod:`megatron_fcp.jit`): messages ``s[m] -> d[m]`` (CP positions) of ``nbytes[m]``
    over route ``route[m]`` (resources ``pair_ids[pair_ptr[j]:pair_ptr[j + 1]]``, latency
    ``pair_lat[j]``), rounds in the order given (``rnd``, grouped). Returns each rank's completion
    (``start`` for a rank without messages); adds every message's seconds on each resource to
    ``held``. Per round: a message begins once both ends are ready and ends its route's slowest
    resource plus latency later; a rank is done no sooner than that (its sends, with ``buffered``,
    as they begin) nor than its ready time plus its messages' summed seconds on any one resource
    plus its least latency."""
    R = start.shape[0]
    n_res = bws.shape[0]
    ready = start.copy()
    done = np.zeros(R)
    has_done = np.zeros(R, dtype=np.bool_)
    lat = np.zeros(R)
    has_lat = np.zeros(R, dtype=np.bool_)
    load = np.zeros(R * n_res)                       # [rank * n_res + resource]: seconds in the round
    touched = np.empty(R * 8 + 64, dtype=np.int64)
    n_touched = 0
    ranks_hit = np.empty(R, dtype=np.int64)
    n_hit = 0
    M = rnd.shape[0]
    m = 0
    while m < M:
        r = rnd[m]
        while m < M and rnd[m] == r:
            a = s[m]
            b = d[m]
            j = route[m]
            latency = pair_lat[j]
            top = 0.0
            first = True
            for q in range(pair_ptr[j], pair_ptr[j + 1]):
                k = pair_ids[q]
                dur = nbytes[m] / bws[k]
                held[k] += dur
                if first or dur > top:
                    top = dur
                    first = False
            begin = ready[a] if ready[a] > ready[b] else ready[b]
            fin = begin + top + latency
            for x, t in ((a, begin if buffered else fin), (b, fin)):
                if not has_done[x]:
                    has_done[x] = True
                    done[x] = 0.0
                    ranks_hit[n_hit] = x
                    n_hit += 1
                done[x] = max(done[x], t)
            for who in range(2):
                if who == 0 and buffered:
                    continue
                x = a if who == 0 else b
                if not has_lat[x]:
                    has_lat[x] = True
                    lat[x] = latency
                else:
                    lat[x] = min(lat[x], latency)
                base = x * n_res
                for q in range(pair_ptr[j], pair_ptr[j + 1]):
                    k = pair_ids[q]
                    if load[base + k] == 0.0:
                        if n_touched == touched.shape[0]:
                            grown = np.empty(2 * n_touched, dtype=np.int64)
                            grown[:n_touched] = touched
                            touched = grown
                        touched[n_touched] = base + k
                        n_touched += 1
                    load[base + k] += nbytes[m] / bws[k]
            m += 1
        for q in range(n_touched):
            key = touched[q]
            x = key // n_res
            done[x] = max(done[x], ready[x] + load[key] + lat[x])
            load[key] = 0.0
        n_touched = 0
        for q in range(n_hit):
            x = ranks_hit[q]
            ready[x] = done[x]
            has_done[x] = False
            has_lat[x] = False
        n_hit = 0
    return ready
