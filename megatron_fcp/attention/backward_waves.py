"""The executor's backward, wave by wave: a bounded window of received KV under ``resend``.

Note [Backward waves]
---------------------
Backward splits the plan's *deliveries* (a rank computing one block's gradient: a block it needs,
or its own) into waves (:func:`~megatron_fcp.schedule.waves.plan_waves`, the same on every rank:
it reads only the plan and the block sizes). A wave carries the plan transfers on the paths from
each of its blocks' owner to its readers (relays included); a block may reach some readers in one
wave and others later, its reduction tree then cut into one subtree per wave. Both backward KV
modes walk the same waves, so dq and every dK/dV partial are summed in the same order (bitwise
equal results). Compute runs back to back; the communication progresses between jobs::

    wave 0's own blocks (resend: while fetch(wave 0) runs, advanced between jobs; under auto
    the ranks whose part of wave 0 fits the budget kept it from the forward: see "The first wave";
    a single wave: only the first half of them, the rest after it, while its reduction returns:
    leading_own_jobs; their partials join the result after every wave's sum)
    for w = 0 .. W:
        queue reduce(w-1) and, resend only, fetch(w+1): their rounds interleaved behind what is left
        for each of this rank's jobs of wave w:
            poll: while the next queued round's predecessor *in its own chain* tests complete
                  (``transport.test``, non-blocking): wait it (returns at once), use its receives,
                  post the next round
            compute the job
        finish (blocking): fetch(w+1) and reduce(w-2); reduce(w-1) may run on into wave w+1
        a finished wave's local dK/dV are added into the result (wave order); its other partials dropped

* ``fetch`` re-sends a wave's KV along its transfers, one round after another (a relay forwards
  only what it has received; it drops a block it only passes on once its last send is posted);
* ``compute`` runs this rank's deliveries of the wave (received blocks in plan order, then its
  own), each received block freed once computed; its dK/dV partials go into the wave's own table;
* ``reduce`` returns the wave's partials along its rounds reversed (Note [Backward pipeline]):
  a relay adds its own partial and what its children returned (FP32), then sends the sum up in
  the input dtype (rounded once per hop, as TE's ring rounds once per step).

Determinism. Timing decides only *when* a round is posted, never what is added in which order:
dq sums the jobs in their fixed order; a wave's table gets its own partials (computed in wave w)
then each reverse round's receives in list order (a round is posted only after the one before it
completed and was added); the result adds the waves' sums in wave order. The posts themselves
follow one queue, the same on every rank, so messages between a pair match in post order
(gloo, NCCL and the in-process transport all match by post order). A transport whose ``test``
cannot tell (the base class answers False) still works: its rounds then move at the blocking
finish only (gloo's own ``is_completed`` cannot tell: :class:`~megatron_fcp.attention.comm.GlooTransport`
waits each round on a watcher thread, Note [Testing a gloo round] in :mod:`megatron_fcp.attention.gloo_watch`).

Note [Polling on the device's clock]
------------------------------------
The cost model's rank polls at the *end* of each job (Note [Wave pipeline timeline]). On a device
that runs kernels asynchronously (CUDA; the emulator's GPU stream) the host reaches the job
boundary once the job is *launched*: polled only then, it would find the rounds it waits for
still in flight (their partners' devices are behind too), race ahead launching the wave's jobs,
and post the reductions at the blocking finish. Waiting for the device there
(``synchronize``) observes job ends but leaves the device idle while the host polls, posts and
launches. So the pump paces the host by the device's clock without synchronising
(:class:`~megatron_fcp.attention.device_clock.DeviceClock`; Note [No host synchronisation in the
steady state]): :meth:`_Pump.poll` takes a mark after the jobs launched so far and, while rounds
are queued, keeps testing and posting them (non-blocking) until the device has reached the
*previous* poll's mark -- the end of the job before the one just launched. The host launches job
j + 1 while the device runs job j: the device always has work queued, and the host still sees
rounds complete about when a job ends, as priced. A post's sends are ordered after their
producer on the device (NCCL: the transport's event; no host wait). On CPU every mark is reached
at once: one poll per job, as before.

Under ``keep`` the blocks come from what the forward saved and nothing is fetched.

The first wave. Under ``auto`` deciding ``resend``, a rank whose received part of wave 0 fits its
budget (the ring's: its own shard, what Transformer Engine's ring saves) keeps that part from the
forward (:func:`~megatron_fcp.schedule.chains.first_keepers`), rank by rank: on a packed batch the
ranks holding a long document's late blocks receive several times their (short) shard in wave 0
while the others fit. fetch(wave 0) then re-sends only the rest
(:func:`~megatron_fcp.schedule.waves.first_fetch`): a transfer whose receiver computes the block
and did not keep it, or relays it on such a transfer; a relay that kept the block sends it from
what it kept. Every rank derives the keepers and the cut from the plan, so posts still match.
Packed cp = 64 on dgx-h100:8 (GQA 64:8, 32K tokens per rank, lognormal 8.0/1.2): 41 of 64 ranks
keep, and the backward's model goes from 85.7 to 84.7 ms (keeping all of wave 0: 83.9 ms, but
4.8x one rank's shard).

A plan whose blocks all travel chains (the ring) does not use waves: it streams one hop per step
(Note [Streaming chain backward] in :mod:`megatron_fcp.schedule.chains`; the executor picks by
:func:`~megatron_fcp.schedule.chains.chain_steps`, as the cost model does).

Memory. A rank holds received KV of at most two waves (w computing, w+1 arriving); each wave
brings a rank at most the largest shard's K and V (:func:`~megatron_fcp.schedule.waves.wave_budget`),
so the two hold no more than Transformer Engine's ring backward allocates beside its saved KV
(two shard-sized KV buffers) -- unless a single block is larger than a shard (a packed batch's
may be: it then forms a wave of its own). dK/dV partials: three waves' tables (w-2 and w-1
reducing, w computing), accumulated in FP32 -- up to three shards' K and V in FP32, where TE's
ring keeps two shard-sized dKV buffers in the input dtype (and FP32 dQ); a wave's more than a
loop that finishes each reduction within the next wave, the price of letting a reduction run on;
the buffers a round's returns arrive in are in the input dtype (half of FP32's bytes for
BF16/FP16), one round per chain in flight.

Cost. ``plan_waves`` also caps a rank's work per wave (Note [Balanced waves]), so with sub-blocks
(``parts_per_chunk`` >= 2) every rank computes about the same per wave and the waves' compute adds
up to about the one-pass backward's; the reductions and re-sends run behind it
(:func:`~megatron_fcp.cost.backward.simulate_backward_waves`, which follows every rank
through this loop: Note [Wave pipeline timeline] in cost/timeline.py). A round in flight
is noticed at the next job boundary, so a reduction advances at most one round per job of the
ranks on its path; it catches up in the blocking finish one wave later. With whole chunks under
causal zigzag a wave gives some ranks twice the work of others (the busiest ranks add up to
about 1.5x the one-pass compute).

Posts. Reduction rounds use phase ``"backward"``, re-sends ``"resend"``, both with the plan's round
index; every rank walks the same sequence of posts, so messages between a pair match in order.
Rounds that become ready together (a poll, or a blocking finish and what tests complete behind it)
go out as one batch (``transport.post_batch``): on gloo the batch's receives before its sends
(Note [Receives first across rounds] in :mod:`megatron_fcp.attention.comm`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from megatron_fcp.attention.comm import RoundPost
from megatron_fcp.attention.device_clock import DeviceClock
from megatron_fcp.attention.kv_block import pack_kv
from megatron_fcp.contract.blocks import Block, Transfer
from megatron_fcp.contract.plan import Plan
from megatron_fcp.schedule.waves import Wave, loop_jobs

if TYPE_CHECKING:
    from megatron_fcp.attention.layout import ShardLayout

__all__ = ["BackwardHost", "run_backward_waves"]


class BackwardHost(Protocol):
    """What a backward runner (:func:`run_backward_waves`,
    :func:`~megatron_fcp.attention.backward_chain.run_backward_chain`) uses of the executor that
    runs it: the plan the backward walks (the program's: Note [A backward on another graph] in
    :mod:`megatron_fcp.contract.plan`) and this rank's place in it, the shard layout, and the
    transport's verbs with the plan named in their errors. The schedule itself comes from the
    backward program (Note [Backward program] in :mod:`megatron_fcp.schedule.program`)."""

    backward_plan: Plan
    rank: int
    layout: ShardLayout
    local_blocks: tuple[Block, ...]
    clock: DeviceClock          # marks on the kernels' device (Note [No host synchronisation in the steady state])

    def post(self, sends, recvs, *, round_index: int, phase: str): ...
    def post_batch(self, posts: list[RoundPost]) -> list: ...
    def wait(self, handle) -> float: ...
    def test(self, handle) -> bool: ...
    def kv_shape(self, block: Block, x: torch.Tensor) -> tuple[int, ...]: ...


def _flip(t: Transfer) -> Transfer:
    return Transfer(t.dst, t.src, t.block)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class _Held:
    """Received KV bytes alive on this rank during backward, and their peak."""

    def __init__(self) -> None:
        self.alive = self.peak = 0

    def add(self, n: int) -> None:
        self.alive += n
        self.peak = max(self.peak, self.alive)


class _Fetch:
    """Re-sends one wave's KV (``resend``): the plan's forward rounds restricted to the wave, posted
    one after another (:meth:`complete` the round in flight, then :meth:`post_next`)."""

    def __init__(self, ex: BackwardHost, wave: Wave, k: torch.Tensor, v: torch.Tensor, held: _Held,
                 kept: dict[Block, torch.Tensor] | None = None) -> None:
        self.ex, self.wave, self.k, self.held = ex, wave, k, held
        self.have: dict[Block, torch.Tensor] = {}
        self.last: dict[Block, int] = {}                                         # block -> my last send round
        for r, t in wave.transfers:
            if t.src == ex.rank:
                self.last[t.block] = r
                if t.block.owner == ex.rank and t.block not in self.have:
                    sl = ex.layout.local_slice(t.block)
                    self.have[t.block] = pack_kv(k[sl], v[sl])                   # [2, blk, b, h_kv, d]
                elif kept and t.block in kept:                                   # a relay sends what it kept
                    self.have[t.block] = kept[t.block]
        self.relaying: dict[Block, torch.Tensor] = {}                            # received, still to forward
        self.needed: dict[Block, torch.Tensor] = {}                              # received, to compute on
        self.i, self.pending = 0, None
        self.wait_s, self.bytes_sent = 0.0, 0

    def left(self) -> int:
        """Rounds still to post."""
        return len(self.wave.rounds) - self.i

    def complete(self) -> None:
        """Wait for the round in flight (if any) and keep what it brought."""
        ex = self.ex
        if self.pending is not None:
            handle, recvs = self.pending
            self.wait_s += ex.wait(handle)
            self.pending = None
            for t, buf in recvs:
                self.have[t.block] = self.relaying[t.block] = buf
                self.held.add(_nbytes(buf))
                if (t.block, ex.rank) in self.wave.computes:
                    self.needed[t.block] = buf
        if not self.left():
            self._drop(math.inf)
            self.have.clear()  # local stacks: every send of the wave is complete

    def next_post(self) -> RoundPost:
        """The next round (the one before it must be complete): forward what I have."""
        ex, wave = self.ex, self.wave
        nxt = wave.rounds[self.i]
        sends = [(t, self.have[t.block]) for t in ex.backward_plan.sends(ex.rank, nxt) if wave.has(nxt, t)]
        recvs = [(t, torch.empty(ex.kv_shape(t.block, self.k), dtype=self.k.dtype, device=self.k.device))
                 for t in ex.backward_plan.recvs(ex.rank, nxt) if wave.has(nxt, t)]
        return RoundPost(sends, recvs, nxt, "resend")

    def attach(self, post: RoundPost, handle) -> None:
        """``post`` (from :meth:`next_post`) is posted as ``handle``: it is the round in flight."""
        self.bytes_sent += sum(_nbytes(x) for _, x in post.sends)
        self.pending = (handle, list(post.recvs))
        self.i += 1
        self._drop(post.round_index)

    def post_next(self) -> None:
        p = self.next_post()
        self.attach(p, self.ex.post(p.sends, p.recvs, round_index=p.round_index, phase=p.phase))

    def _drop(self, posted: float) -> None:
        for b in [b for b in self.relaying if self.last.get(b, -1) <= posted]:
            buf = self.relaying.pop(b)  # passed on (a posted send holds its buffer until waited)
            del self.have[b]
            if b not in self.needed:
                self.held.alive -= _nbytes(buf)

    def finish(self) -> None:
        while self.left():
            self.complete()
            self.post_next()
        self.complete()

    def release(self, block: Block) -> None:
        """The block's backward is computed: drop it (unless a later round of the wave forwards it)."""
        buf = self.needed.pop(block)
        if block not in self.have:
            self.held.alive -= _nbytes(buf)


class _Reduce:
    """Returns one wave's dK/dV partials along its rounds reversed, one round after another:
    :meth:`next_post` builds this rank's sums of the next round (the pump posts it and
    :meth:`attach` es the handle), :meth:`complete` waits for the round in flight and adds what it
    received into the wave's table (in the round's list order)."""

    def __init__(self, ex: BackwardHost, wave: Wave, table: dict, prepare: Callable, add: Callable) -> None:
        self.ex, self.wave, self.table, self._prepare, self._add = ex, wave, table, prepare, add
        self.rounds = list(reversed(wave.rounds))
        self.i, self.pending = 0, None
        self.wait_s = 0.0

    def left(self) -> int:
        return len(self.rounds) - self.i

    def complete(self) -> None:
        if self.pending is None:
            return
        handle, recvs = self.pending
        self.wait_s += self.ex.wait(handle)
        self.pending = None
        for t, buf in recvs:
            self._add(self.table, t.block, buf)

    def next_post(self) -> RoundPost:
        return self._prepare(self.wave, self.table, self.rounds[self.i])

    def attach(self, post: RoundPost, handle) -> None:
        self.pending = (handle, list(post.recvs))
        self.i += 1


class _Pump:
    """Advances the reductions and re-sends in flight while a wave computes.

    Their posts follow one fixed order, the same on every rank: per wave w, reduce round 0 of
    w-1, fetch round 0 of w+1, reduce round 1, fetch round 1, ..., then the longer one's rest,
    appended behind what earlier waves left (:meth:`extend`). So messages between a pair match in
    order whatever the timing (gloo and NCCL match a pair's messages by post order). The next post
    is made once the round before it *in its own chain* is complete: :meth:`poll` asks
    ``transport.test`` (non-blocking) and stops at the first round still in flight; :meth:`finish`
    waits until given chains are through. A completed round is always waited (``wait``) before
    its receives are used."""

    def __init__(self, ex: BackwardHost, clock: DeviceClock) -> None:
        self.ex, self.order, self.k, self.clock = ex, [], 0, clock
        self.chains: list = []
        self.last_mark = None                                        # after the jobs launched so far

    def extend(self, chains: list) -> None:
        n = max((c.left() for c in chains), default=0)
        self.order += [c for j in range(n) for c in chains if j < c.left()]
        self.chains += chains

    def _ready(self, c) -> bool:
        return c.pending is None or self.ex.test(c.pending[0])

    def poll(self) -> None:
        """Between two jobs (before launching the next): post what is ready; while rounds are
        queued and the device has not reached the end of the job before last, keep polling
        (non-blocking; Note [Polling on the device's clock])."""
        before, self.last_mark = self.last_mark, self.clock.mark()
        self._advance()
        while self.k < len(self.order) and not self.clock.reached(before):
            self.clock.pause(before)
            self._advance()

    def _advance(self) -> None:
        self._post_ready(self._take_ready([], len(self.order) - 1))
        for c in self.chains:                                    # a chain's last round: nothing behind it
            if not c.left() and c.pending is not None and self._ready(c):
                c.complete()
        self.chains = [c for c in self.chains if c.left() or c.pending is not None]

    def _take_ready(self, batch: list, last: int) -> list:
        """Extend ``batch`` with the queue's next entries up to ``last`` while their round in flight
        tests complete (completing it); each chain at most once (its next round waits for the one
        this batch posts)."""
        while self.k <= last:
            c = self.order[self.k]
            if any(c is x for x in batch) or not self._ready(c):
                break
            c.complete()
            batch.append(c)
            self.k += 1
        return batch

    def _post_ready(self, batch: list) -> None:
        """Post the next round of every chain of ``batch`` at once: the batch's receives before its
        sends (Note [Receives first across rounds] in :mod:`megatron_fcp.attention.comm`)."""
        if batch:
            posts = [c.next_post() for c in batch]
            for c, p, h in zip(batch, posts, self.ex.post_batch(posts)):
                c.attach(p, h)

    def finish(self, chains: list) -> None:
        """Wait until every round of ``chains`` is posted and complete (and all posts before)."""
        last = max((i for i in range(self.k, len(self.order)) if any(self.order[i] is x for x in chains)),
                   default=-1)
        while self.k <= last:
            c = self.order[self.k]
            c.complete()                                              # blocking
            self.k += 1
            self._post_ready(self._take_ready([c], last))           # with what is ready behind it
        for c in chains:
            c.complete()
        self.chains = [c for c in self.chains if c.left() or c.pending is not None]


def run_backward_waves(ex: BackwardHost, waves: tuple[Wave, ...], k: torch.Tensor, v: torch.Tensor,
                       kept: dict[Block, torch.Tensor] | None,
                       compute: Callable[[Block, torch.Tensor], torch.Tensor], grad_dtype: torch.dtype,
                       wire_dtype: torch.dtype | None = None, resend: bool | None = None,
                       first_kept: bool = False, first_fetch: Wave | None = None,
                       jobs_done: Callable[[], None] | None = None) -> dict:
    """Backward over ``waves`` (Note [Backward waves]). ``compute(block, kv)`` adds a block's dq and
    returns its dK/dV partial ``[2, blk, b, h_kv, d]`` in ``grad_dtype`` (the accumulation dtype).
    A partial is cast to ``wire_dtype`` (default ``grad_dtype``; the executor passes the input
    dtype) just before it is sent; a received one is added into a ``grad_dtype`` accumulator, so a
    relay's sum is rounded once per hop. ``kept`` None: re-send the KV. ``resend`` (default ``kept
    is None``) with ``first_kept``: the first wave's blocks are in ``kept`` (saved by the forward,
    every rank in :func:`~megatron_fcp.schedule.chains.first_keepers`), the later waves re-sent; ``first_fetch``
    instead: only some ranks kept theirs (:func:`~megatron_fcp.schedule.chains.first_keepers`;
    this rank's part, if any, is in ``kept``), the first wave's fetch re-sends this part of it
    (:func:`~megatron_fcp.schedule.chains.first_wave_fetch`). ``jobs_done``: called once, right after
    this rank's last job, before the last reductions are waited (dq is final then). Returns ``grads`` (the
    local blocks' complete dK/dV in ``grad_dtype``: each wave's sum, added in wave order), wait
    seconds, bytes sent (dK/dV; re-sent KV apart) and the peak received KV bytes alive."""
    plan, rank, lay = ex.backward_plan, ex.rank, ex.layout
    wire = grad_dtype if wire_dtype is None else wire_dtype
    resend = kept is None if resend is None else resend
    kept = kept or {}
    held = _Held()
    local = set(ex.local_blocks)
    grads: dict[Block, torch.Tensor] = {}
    out = {"wait_s": 0.0, "bytes_sent": 0, "resend_bytes": 0, "grads": grads}

    def add(g: dict, block: Block, x: torch.Tensor) -> None:
        # x: a local partial (grad_dtype) or a received one (wire dtype): g holds grad_dtype
        g[block] = x.to(grad_dtype) if block not in g else g[block].add_(x)

    def prepare(wave: Wave, g: dict, r: int) -> RoundPost:
        # forward t: src -> me  ==> backward: me -> src, carrying my accumulated dKV of t.block,
        # rounded to the wire dtype here (once per hop)
        sends = [(_flip(t), g[t.block].to(wire) if t.block in g
                  else torch.zeros(ex.kv_shape(t.block, k), dtype=wire, device=k.device))
                 for t in plan.recvs(rank, r) if wave.has(r, t)]
        # forward t: me -> dst  ==> backward: dst -> me, its partial dKV of t.block (wire dtype)
        recvs = [(_flip(t), torch.empty(ex.kv_shape(t.block, k), dtype=wire, device=k.device))
                 for t in plan.sends(rank, r) if wave.has(r, t)]
        out["bytes_sent"] += sum(_nbytes(x) for _, x in sends)
        return RoundPost(sends, recvs, r, "backward")

    # this rank's jobs, one kernel call each: the order the cost model prices (loop_jobs: received
    # blocks in plan order, then its own; the first wave its own first, computed while the wave's KV
    # arrives, and with one wave half of them last: leading_own_jobs)
    all_jobs, all_lead, all_last = loop_jobs(plan, waves)
    jobs, lead, last = all_jobs[rank], all_lead[rank], all_last[rank]

    def run_job(b: Block, fetch: _Fetch | None, g: dict) -> None:
        if b in local:
            sl = lay.local_slice(b)
            add(g, b, compute(b, pack_kv(k[sl], v[sl])))
        elif b in kept:                                          # keep, or the first wave kept
            add(g, b, compute(b, kept[b]))
        else:
            add(g, b, compute(b, fetch.needed[b]))
            fetch.release(b)

    # the first wave's own blocks are computed while its KV arrives (every mode: the same job order);
    # with one wave, half of them wait for the end, while its reduction returns (leading_own_jobs)
    pump = _Pump(ex, ex.clock)
    first = jobs[0] if waves else []
    n_own = lead
    g_last: dict[Block, torch.Tensor] = {}                       # their partials: added after every wave's sum
    g_first: dict[Block, torch.Tensor] = {}
    fetch = None
    if resend and waves and not first_kept:
        fetch = _Fetch(ex, waves[0] if first_fetch is None else first_fetch, k, v, held, kept)
        pump.extend([fetch])
    for b in first[:n_own]:
        pump.poll()
        run_job(b, fetch, g_first)
    if fetch is not None:
        pump.finish([fetch])
    prev: tuple[Wave, dict] | None = None                        # computed, its dK/dV still to reduce
    reducing: list[_Reduce] = []                                 # waves' reductions not yet settled, in order

    def settle(all_: bool = False) -> None:
        # a finished reduction: its non-local partials are sent (drop them); its local sums join
        # the result in wave order
        while reducing and (all_ or (not reducing[0].left() and reducing[0].pending is None)):
            r = reducing.pop(0)
            out["wait_s"] += r.wait_s
            for b in ex.local_blocks:
                if b in r.table:
                    add(grads, b, r.table[b])

    for w in range(len(waves) + 1):
        cur = waves[w] if w < len(waves) else None
        nxt = _Fetch(ex, waves[w + 1], k, v, held) if resend and w + 1 < len(waves) else None
        red = _Reduce(ex, prev[0], prev[1], prepare, add) if prev is not None else None
        older = list(reducing)                                   # wave w-2's reduction (if not settled)
        if red is not None:
            reducing.append(red)
        pump.extend([c for c in (red, nxt) if c is not None])
        g_cur: dict[Block, torch.Tensor] = g_first if w == 0 else g_last if cur is None else {}
        todo = first[n_own:] if w == 0 else (jobs[w] if cur is not None else last)
        for b in todo:                                           # compute w | reduce w-2, w-1 | fetch w+1
            pump.poll()
            settle()
            run_job(b, fetch, g_cur)
        if cur is None and jobs_done is not None:                # every job has run; the sums are on their way
            jobs_done()
        # before wave w+1 computes: its KV is here and wave w-2's reduction is through (w-1's may
        # run on into wave w+1); after the last wave, everything
        pump.finish(([nxt] if nxt is not None else []) + (older if cur is not None else list(reducing)))
        settle(all_=cur is None)
        if fetch is not None:
            out["wait_s"] += fetch.wait_s
            out["resend_bytes"] += fetch.bytes_sent
        prev = (cur, g_cur) if cur is not None else None
        fetch = nxt
    for b in ex.local_blocks:                                    # in a fixed place: after every wave's sum
        if b in g_last:
            add(grads, b, g_last[b])
    out["peak"] = held.peak
    return out
