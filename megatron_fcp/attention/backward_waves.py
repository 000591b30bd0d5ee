"""The executor's backward, wave by wave: a bounded window of received KV under ``resend``.

Note [Backward waves]
---------------------
Backward splits the plan's *deliveries* (a rank computing one block's gradient: a block it needs,
or its own) into waves (:func:`~megatron_fcp.planning.waves.plan_waves`, the same on every rank:
it reads only the plan and the block sizes). A wave carries the plan transfers on the paths from
each of its blocks' owner to its readers (relays included); a block may reach some readers in one
wave and others later, its reduction tree then cut into one subtree per wave. Both backward KV
modes walk the same waves, so dq and every dK/dV partial are summed in the same order (bitwise
equal results). Three waves are in flight at once::

    resend only: fetch(wave 0)
    for w = 0 .. W:                                 # one step per reverse round of wave w-1
        reduce(w-1)  |  compute(w)  |  resend only: fetch(w+1)
        wave w-1's local dK/dV are added into the result (wave order); its other partials dropped

* ``fetch`` re-sends a wave's KV along its transfers, one round per step (a relay forwards only
  what it has received; it drops a block it only passes on once its last send is posted);
* ``compute`` runs this rank's deliveries of the wave, spread over the steps, each received block
  freed once computed; its dK/dV partials go into the wave's own table;
* ``reduce`` returns the wave's partials along its rounds reversed (Note [Backward pipeline]):
  a relay adds its own partial and what its children returned (FP32), then sends the sum up in
  the input dtype (rounded once per hop, as TE's ring rounds once per step).

Under ``keep`` the blocks come from what the forward saved and nothing is fetched.

Memory. A rank holds received KV of at most two waves (w computing, w+1 arriving); each wave
brings a rank at most half of the largest shard's K and V, so the two hold no more than
Transformer Engine's ring has in flight beside its own KV (one shard) -- unless a single block is
larger than half a shard (a packed batch's may be: it then forms a wave of its own). dK/dV
partials: two waves' (reducing and computing), accumulated in FP32; the buffers a wave's returns
arrive in are in the input dtype (half of FP32's bytes for BF16/FP16).

Cost. ``plan_waves`` also caps a rank's work per wave (Note [Balanced waves]), so with sub-blocks
(``parts_per_chunk`` >= 2) every rank computes about the same per wave and the waves' compute adds
up to about the one-pass backward's; the reductions and re-sends run behind it
(:func:`~megatron_fcp.planning.packed_cost.simulate_backward_waves`, which follows every rank
through this loop: Note [Wave pipeline timeline] in planning/wave_timeline.py). Each step waits
its reduction round before the next share of gradients, so a step lasts the longer of the two on
the slower of the rank's partners. With whole chunks under causal zigzag a wave gives some ranks
twice the work of others (the busiest ranks add up to about 1.5x the one-pass compute).

Posts. Reduction rounds use phase ``"backward"``, re-sends ``"resend"``, both with the plan's round
index; every rank walks the same sequence of posts, so messages between a pair match in order.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from megatron_fcp.planning.blocks import Block, Transfer
from megatron_fcp.planning.waves import Wave, plan_waves, wave_budget

__all__ = ["Wave", "plan_waves", "wave_budget", "run_backward_waves"]  # waves: megatron_fcp.planning.waves


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
    """Re-sends one wave's KV (``resend``): the plan's forward rounds restricted to the wave,
    advanced one round per :meth:`step` (wait the round in flight, then post the next one)."""

    def __init__(self, ex, wave: Wave, k: torch.Tensor, v: torch.Tensor, held: _Held) -> None:
        self.ex, self.wave, self.k, self.held = ex, wave, k, held
        self.have: dict[Block, torch.Tensor] = {}
        self.last: dict[Block, int] = {}                                         # block -> my last send round
        for r, t in wave.transfers:
            if t.src == ex.rank:
                self.last[t.block] = r
                if t.block.owner == ex.rank and t.block not in self.have:
                    sl = ex.layout.local_slice(t.block)
                    self.have[t.block] = torch.stack([k[sl], v[sl]])             # [2, blk, b, h_kv, d]
        self.local = set(self.have)
        self.relaying: dict[Block, torch.Tensor] = {}                            # received, still to forward
        self.needed: dict[Block, torch.Tensor] = {}                              # received, to compute on
        self.i, self.pending = 0, None
        self.wait_s, self.bytes_sent = 0.0, 0

    def done(self) -> bool:
        return self.i == len(self.wave.rounds) and self.pending is None

    def step(self) -> None:
        ex, wave = self.ex, self.wave
        if self.pending is not None:
            handle, recvs = self.pending
            self.wait_s += ex._wait(handle)
            self.pending = None
            for t, buf in recvs:
                self.have[t.block] = self.relaying[t.block] = buf
                self.held.add(_nbytes(buf))
                if (t.block, ex.rank) in wave.computes:
                    self.needed[t.block] = buf
        nxt = wave.rounds[self.i] if self.i < len(wave.rounds) else None
        if nxt is not None:
            sends = [(t, self.have[t.block]) for t in ex.plan.sends(ex.rank, nxt) if wave.has(nxt, t)]
            recvs = [(t, torch.empty(ex._kv_shape(t.block, self.k), dtype=self.k.dtype, device=self.k.device))
                     for t in ex.plan.recvs(ex.rank, nxt) if wave.has(nxt, t)]
            self.bytes_sent += sum(_nbytes(x) for _, x in sends)
            self.pending = (ex.transport.post(sends, recvs, round_index=nxt, phase="resend"), recvs)
            self.i += 1
        posted = nxt if nxt is not None else math.inf
        for b in [b for b in self.relaying if self.last.get(b, -1) <= posted]:
            buf = self.relaying.pop(b)  # passed on (a posted send holds its buffer until waited)
            del self.have[b]
            if b not in self.needed:
                self.held.alive -= _nbytes(buf)

    def finish(self) -> None:
        while not self.done():
            self.step()
        self.have.clear()  # local stacks: every send of the wave is complete

    def release(self, block: Block) -> None:
        """The block's backward is computed: drop it (unless a later round of the wave forwards it)."""
        buf = self.needed.pop(block)
        if block not in self.have:
            self.held.alive -= _nbytes(buf)


def _split(items: list, n: int) -> list[list]:
    """``items`` in ``n`` consecutive parts of nearly equal length (earlier parts one longer)."""
    q, r = divmod(len(items), n)
    out, i = [], 0
    for j in range(n):
        m = q + (j < r)
        out.append(items[i:i + m])
        i += m
    return out


def run_backward_waves(ex, waves: tuple[Wave, ...], k: torch.Tensor, v: torch.Tensor,
                       kept: dict[Block, torch.Tensor] | None,
                       compute: Callable[[Block, torch.Tensor], torch.Tensor], grad_dtype: torch.dtype,
                       wire_dtype: torch.dtype | None = None) -> dict:
    """Backward over ``waves`` (Note [Backward waves]). ``compute(block, kv)`` adds a block's dq and
    returns its dK/dV partial ``[2, blk, b, h_kv, d]`` in ``grad_dtype`` (the accumulation dtype).
    A partial is cast to ``wire_dtype`` (default ``grad_dtype``; the executor passes the input
    dtype) just before it is sent; a received one is added into a ``grad_dtype`` accumulator, so a
    relay's sum is rounded once per hop. ``kept`` None: re-send the KV. Returns ``grads`` (the
    local blocks' complete dK/dV in ``grad_dtype``: each wave's sum, added in wave order), wait
    seconds, bytes sent (dK/dV; re-sent KV apart) and the peak received KV bytes alive."""
    plan, rank, lay = ex.plan, ex.rank, ex.layout
    wire = grad_dtype if wire_dtype is None else wire_dtype
    resend = kept is None
    held = _Held()
    local = set(ex.local_blocks)
    grads: dict[Block, torch.Tensor] = {}
    out = {"wait_s": 0.0, "bytes_sent": 0, "resend_bytes": 0, "grads": grads}

    def add(g: dict, block: Block, x: torch.Tensor) -> None:
        # x: a local partial (grad_dtype) or a received one (wire dtype): g holds grad_dtype
        g[block] = x.to(grad_dtype) if block not in g else g[block].add_(x)

    def post(wave: Wave, g: dict, r: int):
        # forward t: src -> me  ==> backward: me -> src, carrying my accumulated dKV of t.block,
        # rounded to the wire dtype here (once per hop)
        sends = [(_flip(t), g[t.block].to(wire) if t.block in g
                  else torch.zeros(ex._kv_shape(t.block, k), dtype=wire, device=k.device))
                 for t in plan.recvs(rank, r) if wave.has(r, t)]
        # forward t: me -> dst  ==> backward: dst -> me, its partial dKV of t.block (wire dtype)
        recvs = [(_flip(t), torch.empty(ex._kv_shape(t.block, k), dtype=wire, device=k.device))
                 for t in plan.sends(rank, r) if wave.has(r, t)]
        out["bytes_sent"] += sum(_nbytes(x) for _, x in sends)
        return ex.transport.post(sends, recvs, round_index=r, phase="backward"), recvs

    def jobs(wave: Wave) -> list[Block]:
        """This rank's gradients in ``wave``: received blocks in plan order, then its own."""
        got = [t.block for r, t in wave.transfers if t.dst == rank and (t.block, rank) in wave.computes]
        return got + [b for b in ex.local_blocks if (b, rank) in wave.computes]

    def run_job(b: Block, fetch: _Fetch | None, g: dict) -> None:
        if b in local:
            sl = lay.local_slice(b)
            add(g, b, compute(b, torch.stack([k[sl], v[sl]])))
        elif resend:
            add(g, b, compute(b, fetch.needed[b]))
            fetch.release(b)
        else:
            add(g, b, compute(b, kept[b]))

    fetch = None
    if resend and waves:
        fetch = _Fetch(ex, waves[0], k, v, held)
        fetch.finish()
    prev: tuple[Wave, dict] | None = None                        # computed, its dK/dV still to reduce
    for w in range(len(waves) + 1):
        cur = waves[w] if w < len(waves) else None
        nxt = _Fetch(ex, waves[w + 1], k, v, held) if resend and w + 1 < len(waves) else None
        rounds = list(reversed(prev[0].rounds)) if prev is not None else []
        steps = max(len(rounds), 1)
        todo = _split(jobs(cur), steps) if cur is not None else [[] for _ in range(steps)]
        g_cur: dict[Block, torch.Tensor] = {}
        for j in range(steps):                                   # reduce w-1 | compute w | fetch w+1
            pending = post(prev[0], prev[1], rounds[j]) if j < len(rounds) else None
            if nxt is not None:
                nxt.step()
            for b in todo[j]:
                run_job(b, fetch, g_cur)
            if pending is not None:
                handle, recvs = pending
                out["wait_s"] += ex._wait(handle)
                for t, buf in recvs:
                    add(prev[1], t.block, buf)
        if nxt is not None:
            nxt.finish()
        if fetch is not None:
            out["wait_s"] += fetch.wait_s
            out["resend_bytes"] += fetch.bytes_sent
        if prev is not None:                                     # its non-local partials are sent: drop
            for b in ex.local_blocks:
                if b in prev[1]:
                    add(grads, b, prev[1][b])
        prev = (cur, g_cur) if cur is not None else None
        fetch = nxt
    out["peak"] = held.peak
    return out
