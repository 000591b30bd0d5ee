"""Transformer Engine's ``p2p`` ring, re-implemented on our transports, kernels and merge.

The emulator's ``te-p2p`` workload: the schedule TE runs (``AttnFuncWithCPAndKVP2P`` in
``transformer_engine/pytorch/attention``), with our :class:`~megatron_fcp.attention.comm.Transport`, block
kernels (:mod:`megatron_fcp.attention.kernels`, or the emulator's sleep) and FP32 LSE merge, so the
comparison with FCP changes the schedule and nothing else.

Note [Transformer Engine's p2p ring]
------------------------------------
Layout: TE's zigzag per document (:class:`TeLayout`): every document is padded to a multiple of
``2*cp`` tokens and cut into ``2*cp`` chunks; CP index ``i`` holds chunks ``i`` and ``2cp-1-i`` of
every document (one sequence: Megatron's zigzag). Every rank holds the same number of tokens, so
the KV travels as one tensor ``[2, n, b, h_kv, d]`` (K and V of both chunks).

Forward, ``cp`` steps; at step ``i`` rank ``r`` holds the KV of CP index ``r - i``::

    for i in 0 .. cp-1:
        wait(round i-1)                          # the KV of step i is here
        post(round i): send that KV to r+1, receive the next from r-1      (i < cp-1)
        compute step i (attention of the local queries against it; LSE merge in FP32)

Backward runs the ring the other way (send to ``r-1``, receive from ``r+1``) starting from the KV
the forward ended with (CP index ``r+1``) and ends on the rank's own (the diagonal). Two buffers
``[2 (KV, dKV), 2, n, b, h_kv, d]`` in the KV dtype alternate; the dKV partial of a KV travels
behind it, each rank adding its share::

    for i in 0 .. cp-1:
        wait(round i-1)
        post(round i): i = 0 the KV only; 0 < i < cp-1 the KV and the dKV partial; i = cp-1 the dKV only
        compute step i's gradients (dQ local)
        wait(round i); add this step's dK/dV into the partial just received (i = 0: start one)

so round ``i`` overlaps step ``i``'s compute, and the last round brings every rank its own dK/dV.
Bytes per rank: forward ``cp-1`` KV; backward ``2*(cp-2) + 2`` KV (dK/dV in the KV dtype, as TE).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_fcp.attention.comm import DEFAULT_TIMEOUT_S, Transport, default_transport
from megatron_fcp.attention.dispatch import resolve_kernel
from megatron_fcp.attention.kernels import BlockKernel, compute_dtype_for
from megatron_fcp.attention.merge import LseAccumulator
from megatron_fcp.contract.blocks import Block, Transfer

__all__ = ["TeLayout", "te_p2p_attention"]


class TeLayout:
    """TE's per-document zigzag of a packed batch (one document: Megatron's zigzag split).

    ``doc_lengths``: the documents (one entry for a single sequence, then its length must divide by
    ``2*cp``; a packed batch pads every document to a multiple of ``2*cp``, as TE's
    ``cu_seqlens_padded``). Per CP index: :meth:`positions` (inside the document), :meth:`doc_ids`
    (None for one unpadded sequence: no document mask needed) and :meth:`token_index` (index into
    the packed batch, -1 for padding).
    """

    def __init__(self, doc_lengths: Sequence[int], cp: int) -> None:
        lengths = [int(x) for x in doc_lengths]
        if not lengths or min(lengths) < 1 or cp < 1:
            raise ValueError(f"TeLayout: need document lengths >= 1 and cp >= 1, got {doc_lengths!r}, cp={cp}")
        self.cp, self.doc_lengths = cp, tuple(lengths)
        self.padded = tuple(-(-x // (2 * cp)) * (2 * cp) for x in lengths)
        self.single = len(lengths) == 1 and self.padded[0] == lengths[0]
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        self._pos, self._doc, self._idx = [], [], []
        pad_id = -1
        for i in range(cp):
            pos, doc, idx = [], [], []
            for d, (length, padded, start) in enumerate(zip(lengths, self.padded, starts)):
                chunk = padded // (2 * cp)
                for c in (i, 2 * cp - 1 - i):
                    p = np.arange(c * chunk, (c + 1) * chunk, dtype=np.int64)
                    real = p < length
                    pos.append(p)
                    # a padding token is its own document: it attends itself only (negligible work)
                    doc.append(np.where(real, d, np.arange(pad_id, pad_id - len(p), -1)))
                    pad_id -= len(p)
                    idx.append(np.where(real, p + start, -1))
            self._pos.append(torch.from_numpy(np.concatenate(pos)))
            self._doc.append(torch.from_numpy(np.concatenate(doc)))
            self._idx.append(np.concatenate(idx))

    @property
    def tokens_per_rank(self) -> int:
        return sum(self.padded) // self.cp

    def positions(self, i: int) -> torch.Tensor:
        return self._pos[i]

    def doc_ids(self, i: int) -> torch.Tensor | None:
        return None if self.single else self._doc[i]

    def token_index(self, i: int) -> np.ndarray:
        return self._idx[i]

    def shard(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """CP index ``i``'s tokens of a packed ``[t, ...]`` tensor (zeros for padding)."""
        idx = torch.from_numpy(self._idx[i])
        out = x[idx.clamp(min=0)].clone()
        out[idx < 0] = 0
        return out


class _Ring:
    """One rank's TE ring (Note [Transformer Engine's p2p ring]); tensors ``[n, b, h(_kv), d]``."""

    def __init__(self, ranks: tuple[int, ...], rank: int, layout: TeLayout, kernel: BlockKernel,
                 transport: Transport, causal: bool, scale: float) -> None:
        self.ranks, self.rank, self.layout = ranks, rank, layout
        self.kernel, self.transport, self.causal, self.scale = kernel, transport, causal, scale
        self.cp = len(ranks)
        self.idx = ranks.index(rank)
        self.q_pos, self.q_doc = layout.positions(self.idx), layout.doc_ids(self.idx)

    def _kw(self, owner: int) -> dict:
        if self.q_doc is None:
            return {}
        return {"q_doc": self.q_doc, "k_doc": self.layout.doc_ids(owner)}

    def _post(self, r: int, phase: str, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
              send_owner: int, recv_owner: int):
        sends = [(Transfer(self.rank, self.ranks[dst], Block(self.ranks[send_owner], 0, 0)), send)]
        recvs = [(Transfer(self.ranks[src], self.rank, Block(self.ranks[recv_owner], 0, 0)), recv)]
        return self.transport.post(sends, recvs, round_index=r, phase=phase)

    def forward(self, q, k, v):
        cp, me = self.cp, self.idx
        hk = k.shape[2]
        kv = torch.stack([k, v])                                                 # [2, n, b, hk, d]
        acc = LseAccumulator()
        prep = self.kernel.prepare_forward(q, hk, self.scale)
        pending = recv = None
        for i in range(cp):
            if pending is not None:
                self.transport.wait(pending)
                kv = recv
            if i < cp - 1:
                recv = torch.empty_like(kv)
                pending = self._post(i, "te-forward", kv, (me + 1) % cp, recv, (me - 1) % cp,
                                     (me - i) % cp, (me - i - 1) % cp)
            owner = (me - i) % cp
            acc.add(*self.kernel.forward(q, kv[0], kv[1], self.q_pos, self.layout.positions(owner), self.causal,
                                         self.scale, **prep, **self._kw(owner)))
        out, lse = acc.result()
        return out, lse, kv                                      # kv: CP index me+1's (me's when cp == 1)

    def backward(self, dout, q, k, v, out, lse, kv_last):
        cp, me = self.cp, self.idx
        hk = k.shape[2]
        cd = compute_dtype_for(q.dtype)
        bufs = [torch.empty((2, *kv_last.shape), dtype=k.dtype, device=k.device) for _ in range(2)]
        bufs[0][0].copy_(kv_last)                                                # [2, 2, n, b, hk, d]
        dq = torch.zeros(q.shape, dtype=cd, device=q.device)                     # [n, b, h, d]
        prep = self.kernel.prepare_backward(q, dout, out, hk)
        pending = None
        for i in range(cp):
            if pending is not None:
                self.transport.wait(pending)
                pending = None
            if cp > 1:
                send, recv = bufs[i % 2], bufs[(i + 1) % 2]
                if i == 0:
                    send, recv = send[0], recv[0]
                if i == cp - 1:
                    send, recv = send[1], recv[1]
                pending = self._post(i, "te-backward", send, (me - 1) % cp, recv, (me + 1) % cp,
                                     (me + 1 + i) % cp, (me + 2 + i) % cp)
            kv = bufs[i % 2][0]
            owner = (me + 1 + i) % cp
            dq_, dk_, dv_ = self.kernel.backward(dout, q, kv[0], kv[1], out, lse, self.q_pos,
                                                 self.layout.positions(owner), self.causal, self.scale,
                                                 **prep, **self._kw(owner))
            dq.add_(dq_)
            if pending is not None:
                self.transport.wait(pending)
                pending = None
            dkv = bufs[(i + 1) % 2][1]                                           # [2, n, b, hk, d]
            if i == 0:
                dkv.copy_(torch.stack([dk_, dv_]))
            else:
                dkv.add_(torch.stack([dk_, dv_]))
        dkv = bufs[cp % 2][1]
        return dq.to(q.dtype), dkv[0].clone(), dkv[1].clone()


class _TeRingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        out, lse, kv_last = ring.forward(q, k, v)
        ctx.ring, ctx.out, ctx.lse, ctx.kv_last = ring, out, lse, kv_last
        ctx.save_for_backward(q, k, v)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward(dout, q, k, v, ctx.out, ctx.lse, ctx.kv_last)
        ctx.out = ctx.lse = ctx.kv_last = None
        return dq, dk, dv, None


def te_p2p_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group, layout: TeLayout,
                     causal: bool = True, softmax_scale: float | None = None, kernel="math",
                     transport: Transport | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
    """TE's p2p ring attention (Note [Transformer Engine's p2p ring]); returns ``(out, lse)``.

    q ``[n, b, h, d]``, k/v ``[n, b, h_kv, d]`` (or THD ``[n, h, d]``, run as ``b = 1``) with
    ``n = layout.tokens_per_rank`` tokens in the layout's order (:meth:`TeLayout.shard`).
    Differentiable in q, k, v; ``lse`` is ``[b, h, n]`` (``[h, n]`` for THD).
    """
    thd = q.dim() == 3
    if thd:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != layout.tokens_per_rank or k.shape[0] != q.shape[0]:
        raise ValueError(f"te_p2p_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         f"[n, b, h, d] / [n, b, h_kv, d] with n = layout.tokens_per_rank = {layout.tokens_per_rank}")
    ranks = tuple(dist.get_process_group_ranks(cp_group))
    if len(ranks) != layout.cp:
        raise ValueError(f"te_p2p_attention: layout is for cp={layout.cp}, the group has {len(ranks)} ranks")
    kernel_obj = resolve_kernel(kernel, q.dtype, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ring = _Ring(ranks, dist.get_rank(), layout, kernel_obj,
                 transport or default_transport(cp_group, timeout_s), causal, scale)
    out, lse = _TeRingFunction.apply(q, k, v, ring)
    if thd:
        out, lse = out.squeeze(1), lse.squeeze(0)
    return out, lse
