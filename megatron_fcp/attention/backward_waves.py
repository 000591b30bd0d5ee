"""The executor's backward, wave by wave: a bounded window of received KV under ``resend``.

Note [Backward waves]
---------------------
The plan's blocks are split into *waves* (:func:`plan_waves`, the same on every rank: it reads only
the plan and the block sizes). Backward handles one wave at a time, the same way in both backward
KV modes (so ``keep`` and ``resend`` add dq and every dK/dV partial in the same order: bitwise
equal results)::

    resend only: fetch(wave 0)                     # the plan's rounds restricted to wave 0
    for each wave w:
        reduce(w)                                  # Note [Backward pipeline], restricted to w:
                                                   # compute w's blocks, dK/dV back along w's
                                                   # rounds reversed (relays add and pass on)
        resend only: fetch(w + 1), one round per reduce round of w (overlapped), then the rest
        free w's KV and non-local dK/dV partials

``fetch`` re-sends a wave's KV along the plan's forward rounds that carry its blocks (relays
included; a relay drops a block it only passes on as soon as its last send is posted). Under
``keep`` the blocks come from what the forward saved and nothing is fetched.

Wave size. A rank holds at most two waves' received KV at once (wave w being computed, wave w+1
arriving). :func:`~megatron_fcp.planning.waves.plan_waves` packs blocks, in the order the plan first sends them, greedily into
waves in which every rank receives at most ``budget`` bytes; with the default budget, half of the
largest shard's K and V, two waves hold no more than what Transformer Engine's ring holds in
flight beside its own KV (one shard's K and V) -- as long as no single block is larger than the
budget (zigzag blocks never are; a packed batch's block may be: it then forms a wave of its own,
and the bound is two such blocks).

Cost. A wave's rounds run one after another (a relay forwards only what it has received), so
backward takes about ``sum over waves of 2 x (its rounds)`` steps instead of ``2 x rounds``; the
re-send of wave w+1 hides behind wave w's compute and reduction. Plans with long chains (the ring:
each block is relayed ``cp - 2`` times) pay most.

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
        for b in ex.local_blocks:
            if b in wave:
                sl = ex.layout.local_slice(b)
                self.have[b] = torch.stack([k[sl], v[sl]])                       # [2, blk, b, h_kv, d]
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
                if t.block in ex.needs:
                    self.needed[t.block] = buf
        nxt = wave.rounds[self.i] if self.i < len(wave.rounds) else None
        if nxt is not None:
            sends = [(t, self.have[t.block]) for t in ex.plan.sends(ex.rank, nxt) if t.block in wave]
            recvs = [(t, torch.empty(ex._kv_shape(t.block, self.k), dtype=self.k.dtype, device=self.k.device))
                     for t in ex.plan.recvs(ex.rank, nxt) if t.block in wave]
            self.bytes_sent += sum(_nbytes(x) for _, x in sends)
            self.pending = (ex.transport.post(sends, recvs, round_index=nxt, phase="resend"), recvs)
            self.i += 1
        posted = nxt if nxt is not None else math.inf
        for b in [b for b in self.relaying if ex._last_send.get(b, -1) <= posted]:
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


def run_backward_waves(ex, waves: tuple[Wave, ...], k: torch.Tensor, v: torch.Tensor,
                       kept: dict[Block, torch.Tensor] | None, compute: Callable[[Block, torch.Tensor], None],
                       grads: dict[Block, torch.Tensor], grad_dtype: torch.dtype) -> dict:
    """Backward over ``waves`` (Note [Backward waves]): ``compute(block, kv)`` adds a block's dq and
    puts its dK/dV partial ``[2, blk, b, h_kv, d]`` into ``grads`` (adding); the reduction adds the
    partials returned by children and sends this rank's up. ``kept`` None: re-send the KV. On return
    ``grads`` holds the local blocks' complete dK/dV. Returns wait seconds, bytes sent (dK/dV and
    re-sent KV) and the peak received KV bytes alive."""
    plan, rank, lay = ex.plan, ex.rank, ex.layout
    resend = kept is None
    held = _Held()
    local = set(ex.local_blocks)
    out = {"wait_s": 0.0, "bytes_sent": 0, "resend_bytes": 0}

    def add_grad(block: Block, g: torch.Tensor) -> None:
        grads[block] = g if block not in grads else grads[block].add_(g)

    def post(wave: Wave, r: int):
        # forward t: src -> me  ==> backward: me -> src, carrying my accumulated dKV of t.block
        sends = [(_flip(t), grads[t.block] if t.block in grads
                  else torch.zeros(ex._kv_shape(t.block, k), dtype=grad_dtype, device=k.device))
                 for t in plan.recvs(rank, r) if t.block in wave]
        # forward t: me -> dst  ==> backward: dst -> me, its partial dKV of t.block
        recvs = [(_flip(t), torch.empty(ex._kv_shape(t.block, k), dtype=grad_dtype, device=k.device))
                 for t in plan.sends(rank, r) if t.block in wave]
        out["bytes_sent"] += sum(_nbytes(x) for _, x in sends)
        return ex.transport.post(sends, recvs, round_index=r, phase="backward"), recvs

    def compute_round(wave: Wave, r: int, fetch: _Fetch | None) -> None:
        for t in plan.recvs(rank, r):
            if t.block in wave and t.block in ex.needs:
                compute(t.block, fetch.needed[t.block] if resend else kept[t.block])
                if resend:
                    fetch.release(t.block)

    def compute_local(wave: Wave) -> None:
        for b in ex.local_blocks:
            if b in wave:
                sl = lay.local_slice(b)
                compute(b, torch.stack([k[sl], v[sl]]))

    fetch = None
    if resend and waves:
        fetch = _Fetch(ex, waves[0], k, v, held)
        fetch.finish()
    for w, wave in enumerate(waves):
        nxt = _Fetch(ex, waves[w + 1], k, v, held) if resend and w + 1 < len(waves) else None
        rs = wave.rounds
        if not rs:
            compute_local(wave)
        else:
            compute_round(wave, rs[-1], fetch)
            pending = post(wave, rs[-1])
            for i in range(len(rs) - 1, -1, -1):
                if nxt is not None:
                    nxt.step()                                   # wave w+1's KV arrives meanwhile
                if i > 0:
                    compute_round(wave, rs[i - 1], fetch)
                else:
                    compute_local(wave)
                handle, recvs = pending
                out["wait_s"] += ex._wait(handle)
                for t, buf in recvs:
                    add_grad(t.block, buf)
                if i > 0:
                    pending = post(wave, rs[i - 1])
        for b in wave.blocks:                                    # sent back: free the partials
            if b not in local:
                grads.pop(b, None)
        if nxt is not None:
            nxt.finish()
        if fetch is not None:
            out["wait_s"] += fetch.wait_s
            out["resend_bytes"] += fetch.bytes_sent
        fetch = nxt
    out["peak"] = held.peak
    return out
