"""The head-parallel stage's all-to-alls: member order <-> a head group's rank order, bounded waits,
per-peer sends on gloo, and the two autograd functions that move q|k|v to head shards and out back.

The algorithm and its order of collectives are :mod:`megatron_fcp.attention.head_parallel`'s (Notes
[Head-parallel execution], [Q's all-to-all behind the KV stage], [dQ's all-to-all ahead of dK|dV's]
and [All-to-all on gloo] there); this module is their mechanics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_fcp.attention.comm import CommTimeout
from megatron_fcp.attention.stats import FCPStats


@dataclass
class _Pending:
    """An all-to-all in flight: ``recv`` [a, ...] in the group's slot order, filled once ``work``
    completes (``work`` None: already there)."""

    recv: torch.Tensor
    work: Any
    what: str
    nbytes: int


class _PairWorks:
    """The point-to-point works of one all-to-all on gloo, waited as one (Note [All-to-all on gloo]):
    ``wait(timeout)`` bounds the whole exchange, not each work."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for w in self.works:
            if deadline is None:
                ok = w.wait()
            else:
                ok = w.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            if ok is False:
                return False
        return True


def _pairwise_all_to_all(recv: torch.Tensor, send: torch.Tensor, group: Any, order: tuple[int, ...]) -> _PairWorks:
    """recv[i] <- slot ``me`` of rank ``order[i]``'s send, as one isend/irecv per peer, all in flight
    at once (Note [All-to-all on gloo]); ``send``/``recv`` [a, ...] in the group's slot order."""
    me = order.index(dist.get_rank())
    a = len(order)
    recv[me].copy_(send[me])
    works = []
    for i in range(1, a):
        src, dst = (me - i) % a, (me + i) % a
        works.append(dist.irecv(recv[src], order[src], group=group))
        works.append(dist.isend(send[dst], order[dst], group=group))
    return _PairWorks(works)


class _HeadComm:
    """One head group's all-to-all: member order <-> the group's rank order, bounded waits.
    ``pending`` holds Q's all-to-all while the KV stage starts (Note [Q's all-to-all behind the KV
    stage]). On gloo the all-to-all is one isend/irecv per peer (Note [All-to-all on gloo])."""

    def __init__(self, group: Any, members: tuple[int, ...], timeout_s: float, stats: FCPStats | None) -> None:
        self.group, self.timeout_s, self.stats = group, timeout_s, stats
        order = tuple(dist.get_process_group_ranks(group))
        self.order = order
        self.a = len(members)
        self.perm = [members.index(r) for r in order]          # group slot i -> member index
        self.inv = [self.perm.index(m) for m in range(self.a)]  # member index -> group slot
        self.identity = self.perm == list(range(self.a))
        self.gloo = dist.get_backend(group) == "gloo"
        self.pending: tuple[_Pending, torch.Tensor] | None = None
        self.pending_dq: _Pending | None = None  # Note [dQ's all-to-all ahead of dK|dV's]

    def start(self, x: torch.Tensor, what: str) -> _Pending:
        """Post the all-to-all of x [a, ...] (slot m for member m); :meth:`finish` waits for it."""
        send = (x if self.identity else x[self.perm]).contiguous()
        recv = torch.empty_like(send)
        if self.gloo:
            work = _pairwise_all_to_all(recv, send, self.group, self.order)
        else:
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        return _Pending(recv, work, what, (self.a - 1) * send[0].numel() * send.element_size())

    def finish(self, p: _Pending, out: torch.Tensor | None = None) -> torch.Tensor:
        """Wait (bounded) for ``p``; returns [a, ...] with slot m received from member m (written
        into ``out`` when given)."""
        if p.work is not None:
            try:
                ok = p.work.wait(timeout=timedelta(seconds=self.timeout_s)) if self.gloo else p.work.wait()
            except RuntimeError as exc:
                raise CommTimeout(f"head-parallel all-to-all ({p.what}) over ranks "
                                  f"{dist.get_process_group_ranks(self.group)} failed or did not complete within "
                                  f"{self.timeout_s:g} s ({exc}); is every rank of the head group alive and running "
                                  f"the same layer?") from exc
            if ok is False:
                raise CommTimeout(f"head-parallel all-to-all ({p.what}) failed")
        if self.stats is not None:
            self.stats.head_parallel_bytes_sent += p.nbytes
        y = p.recv if self.identity else p.recv[self.inv]
        if out is None:
            return y
        if out.data_ptr() != y.data_ptr():  # filled as the wire fills a receive buffer: not an autograd write
            out.data.view_as(y).copy_(y)
        return out

    def exchange(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x [a, ...] (slot m for member m) -> [a, ...] (slot m received from member m)."""
        return self.finish(self.start(x, what))

    def finish_pending(self) -> None:
        """Complete the deferred all-to-all (Q's), if any: called by the KV stage before it reads q."""
        if self.pending is not None:
            p, out = self.pending
            self.pending = None
            self.finish(p, out)

    def post_dq(self, dq: torch.Tensor) -> None:
        """Post dQ's all-to-all back to the sequence layout ahead of dK|dV's (Note [dQ's all-to-all
        ahead of dK|dV's]): dq [a*s, b, h/a, d]; :meth:`finish_dq` waits for it."""
        if self.pending_dq is not None:
            raise RuntimeError("head-parallel backward: dQ's all-to-all was posted twice")
        n = dq.shape[0]
        self.pending_dq = self.start(dq.reshape(self.a, n // self.a, *dq.shape[1:]), "dq backward")

    def finish_dq(self) -> torch.Tensor | None:
        """dQ posted by :meth:`post_dq`, as [s, b, a, h/a, d] (None if none was posted)."""
        if self.pending_dq is None:
            return None
        p, self.pending_dq = self.pending_dq, None
        return self.finish(p).permute(1, 2, 0, 3, 4)                          # [s, b, a, h/a, d]

    def to_heads(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x [s, b, a, w, d] (w = sum(widths): shard m's heads) -> [a*s, b, w, d]: all members'
        tokens (member order) for this member's head shard."""
        s, b, a, w, d = x.shape
        y = self.exchange(x.permute(2, 0, 1, 3, 4), what)                       # [a, s, b, w, d]
        return y.reshape(a * s, b, w, d)

    def to_seq(self, y: torch.Tensor, what: str) -> torch.Tensor:
        """y [a*s, b, w, d] (this member's heads, all members' tokens) -> [s, b, a*w, d]."""
        n, b, w, d = y.shape
        x = self.exchange(y.view(self.a, n // self.a, b, w, d), what)          # [a (shard), s, b, w, d]
        return x.permute(1, 2, 0, 3, 4).reshape(n // self.a, b, self.a * w, d)


def _features(xs, lead: tuple[int, ...]) -> torch.Tensor:
    """Tensors [*lead, w_i, d_i] -> [*lead, sum(w_i * d_i), 1]: heads and channels flattened side by
    side, so Q, K and V of different head sizes (MLA) travel in one all-to-all."""
    return torch.cat([x.reshape(*lead, -1) for x in xs], dim=-1).unsqueeze(-1)


def _unfeatures(y: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Inverse of :func:`_features`: y [*lead, F] -> [*lead, w_i, d_i] per ``shapes`` (views)."""
    parts = torch.split(y, [w * d for w, d in shapes], dim=-1)
    return [p.reshape(*p.shape[:-1], w, d) for p, (w, d) in zip(parts, shapes)]


class _QKVToHeads(torch.autograd.Function):
    """q [s,b,h,d], k [s,b,H,d], v [s,b,H,d_v] -> [a*s, b, h/a | H/a | H/a, d | d | d_v] of this
    member's head shard; backward: one a2a of dq|dk|dv back. Heads and channels travel flattened
    side by side (:func:`_features`), so ``d_v`` may differ from ``d`` (MLA) and no padding is
    sent. ``defer_q``: K|V's all-to-all first, then Q's posted and left in flight
    (``comm.pending``; the returned q is filled by ``comm.finish_pending()``): Note [Q's all-to-all
    behind the KV stage]."""

    @staticmethod
    def forward(ctx, q, k, v, comm: _HeadComm, defer_q: bool = False):
        s, b, h, d = q.shape
        a, big_h = comm.a, k.shape[2]
        ctx.comm, ctx.widths = comm, (h // a, big_h // a, big_h // a)
        ctx.shapes = tuple(zip(ctx.widths, (d, d, v.shape[3])))            # (heads, channels) of q, k, v
        ctx.n, ctx.b, ctx.dtype, ctx.device = a * s, b, q.dtype, q.device
        if not defer_q:
            packed = _features([x.reshape(s, b, a, x.shape[2] // a, x.shape[3]) for x in (q, k, v)], (s, b, a))
            y = comm.to_heads(packed, "q|k|v forward")                  # [a*s, b, F, 1]
            return tuple(t.contiguous() for t in _unfeatures(y.squeeze(-1), ctx.shapes))
        packed = _features([x.reshape(s, b, a, big_h // a, x.shape[3]) for x in (k, v)], (s, b, a))  # [s,b,a,F,1]
        kv = comm.to_heads(packed, "k|v forward")                                                # [a*s, b, F, 1]
        pending = comm.start(q.reshape(s, b, a, h // a, d).permute(2, 0, 1, 3, 4), "q forward")  # [a, s, b, h/a, d]
        qs = pending.recv if comm.identity else torch.empty_like(pending.recv)
        comm.pending = (pending, qs)
        ks, vs = (t.contiguous() for t in _unfeatures(kv.squeeze(-1), ctx.shapes[1:]))
        return qs.view(a * s, b, h // a, d), ks, vs

    @staticmethod
    def backward(ctx, dq, dk, dv):
        n, b = ctx.n, ctx.b
        comm, a = ctx.comm, ctx.comm.a
        s = n // a
        grads = [g if g is not None else torch.zeros(n, b, w, d, dtype=ctx.dtype, device=ctx.device)
                 for g, (w, d) in zip((dq, dk, dv), ctx.shapes)]
        if comm.pending_dq is None:                                             # one dQ|dK|dV all-to-all
            x = comm.to_seq(_features(grads, (n, b)), "dq|dk|dv backward")       # [s, b, a*F, 1]
            parts = _unfeatures(x.view(s, b, a, -1), ctx.shapes)                # [s, b, a, w_i, d_i]
        else:  # dQ's went ahead (Note [dQ's all-to-all ahead of dK|dV's]); the stage's dq is that one
            y = _features(grads[1:], (n, b)).view(a, s, b, -1)                  # [a, s, b, F_kv]
            kv_pending = comm.start(y, "dk|dv backward")                      # posted before dQ's is waited
            dq_x = comm.finish_dq()                                             # [s, b, a, h/a, d]
            x = comm.finish(kv_pending).permute(1, 2, 0, 3)                     # [s, b, a, F_kv]
            parts = (dq_x, *_unfeatures(x, ctx.shapes[1:]))
        return (*(p.reshape(s, b, -1, d) for p, (_, d) in zip(parts, ctx.shapes)), None, None)


class _OutToSeq(torch.autograd.Function):
    """out [a*s, b, h/a, d] -> [s, b, h, d]; backward: dout to head shards."""

    @staticmethod
    def forward(ctx, out, comm: _HeadComm):
        ctx.comm = comm
        return comm.to_seq(out, "out forward")

    @staticmethod
    def backward(ctx, dout):
        s, b, h, d = dout.shape
        a = ctx.comm.a
        return ctx.comm.to_heads(dout.reshape(s, b, a, h // a, d), "dout backward"), None
