"""``fcp_head_parallel_packed_attention``: the head-parallel stage on packed (THD) shards.

The plan is a :class:`~megatron_fcp.contract.head_parallel_packed.PackedHeadParallelPlan` (Note
[Head-parallel stage on packed batches] there): the batch placed over ``G = cp / a`` head groups,
each group's tokens split among its ``a`` members (the *member placement*, what each rank holds).

Note [Head-parallel execution on packed batches]
------------------------------------------------
Rank (group ``g``, member ``j``) holds ``t_j`` tokens: q ``[t_j, h, d]``, k/v ``[t_j, h_kv, d]``
(``d_v`` for v), its piece of group ``g``'s tokens. KV heads are repeated to ``H = h_kv * rep`` as in
the zigzag stage (Note [Head-parallel execution] in :mod:`megatron_fcp.attention.head_parallel`).
Then::

    pack   [t_j, a, (h/a)*d + (H/a)*(d + d_v)]   q | k | v of each head shard, flattened side by side
    a2a    shard m -> member m, t_j rows each     sizes differ by member: member m sends t_m rows
    unpack [T_g, h/a | H/a | H/a, d]              T_g = sum_m t_m: group g's tokens in the group
                                                  placement's order (members' pieces concatenated)
    KV stage (G > 1): fcp_attention_with_lse over kv_stage_ranks(j) with plan kv_plan_for(j) and
           placement = the group placement (an ordinary packed plan over G ranks)
    local  (G == 1): the block kernel over the whole batch at once, with document ids
    a2a    out [T_g, h/a, d_v] -> [t_j, h, d_v] (member m gets rows of piece m); lse likewise

Backward is the mirror by autograd: dO to head shards, the stage's backward, one all-to-all of
dQ|dK|dV back, replicated KV heads summed. Every rank of a head group issues the same
all-to-alls in the same order (forward: qkv, out, lse if asked; backward: dout, dqkv). Q's
all-to-all is not deferred behind the stage's start, nor dQ's sent ahead of dK|dV's (the zigzag
stage's overlaps): one all-to-all each way, Transformer Engine's order.

The all-to-all with unequal sizes: ``all_to_all`` with a list of tensors per peer (NCCL), or on
gloo one ``isend``/``irecv`` per peer, all in flight at once (Note [All-to-all on gloo]); a piece
of zero rows (a member without tokens) is neither sent nor received, which every rank of the group
knows from the plan. Bytes one rank sends in the forward: ``(a-1)/a`` of its Q|K|V and, back, the
output rows of the other members' pieces, ``(T_g - t_j) * h/a * d_v`` elements.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_fcp.attention.agreement import LastAgreed
from megatron_fcp.attention.comm import DEFAULT_TIMEOUT_S, CommTimeout, Transport
from megatron_fcp.attention.dispatch import resolve_kernel
from megatron_fcp.attention.function import (
    PLAN_AGREEMENT,
    check_finite,
    check_qkv,
    fcp_attention_with_lse,
    resolve_mask,
)
from megatron_fcp.attention.head_parallel import HeadParallelGroups, _LocalAttention, plan_ranks, stage_groups
from megatron_fcp.attention.head_parallel_a2a import _PairWorks, _unfeatures
from megatron_fcp.attention.sinks import check_softmax_offset
from megatron_fcp.attention.stats import FCPStats
from megatron_fcp.contract.head_parallel_packed import PackedHeadParallelPlan
from megatron_fcp.schedule.program import RING_BUDGET

__all__ = ["fcp_head_parallel_packed_attention", "fcp_head_parallel_packed_attention_with_lse"]


class _PackedComm:
    """One head group's all-to-all with unequal pieces: member ``m`` holds ``counts[m]`` tokens."""

    def __init__(self, group: Any, members: tuple[int, ...], counts: tuple[int, ...], timeout_s: float,
                 stats: FCPStats | None) -> None:
        self.group, self.members, self.counts = group, members, counts
        self.timeout_s, self.stats = timeout_s, stats
        self.a = len(members)
        self.me = members.index(dist.get_rank())
        order = tuple(dist.get_process_group_ranks(group))
        self.slots = [members.index(r) for r in order]             # group slot -> member index
        self.gloo = dist.get_backend(group) == "gloo"

    def _exchange(self, sends: list[torch.Tensor], rows: list[int], what: str) -> list[torch.Tensor]:
        """sends[m] [n_m, W] to member m; returns recvs[m] [rows[m], W] from member m (member order)."""
        me = self.me
        width = sends[me].shape[1:]
        recvs = [sends[me] if m == me else sends[me].new_empty((rows[m], *width)) for m in range(self.a)]
        sends = [x.contiguous() for x in sends]
        if self.gloo:
            works = []
            for i in range(1, self.a):
                src, dst = (me - i) % self.a, (me + i) % self.a
                if rows[src]:
                    works.append(dist.irecv(recvs[src], self.members[src], group=self.group))
                if sends[dst].shape[0]:
                    works.append(dist.isend(sends[dst], self.members[dst], group=self.group))
            work = _PairWorks(works)
        else:
            work = dist.all_to_all([recvs[m] for m in self.slots], [sends[m] for m in self.slots], group=self.group,
                                   async_op=True)
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout_s)) if self.gloo else work.wait()
        except RuntimeError as exc:
            raise CommTimeout(f"packed head-parallel all-to-all ({what}) over ranks {list(self.members)} failed or did "
                              f"not complete within {self.timeout_s:g} s ({exc}); is every rank of the head group "
                              "alive and running the same layer?") from exc
        if ok is False:
            raise CommTimeout(f"packed head-parallel all-to-all ({what}) failed")
        if self.stats is not None:
            self.stats.head_parallel_bytes_sent += sum(x.numel() * x.element_size()
                                                       for m, x in enumerate(sends) if m != me)
        return recvs

    def to_heads(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x [t_me, a, W] (slot m: head shard m) -> [T_g, W]: every member's rows of this member's shard."""
        return torch.cat(self._exchange(list(x.unbind(1)), list(self.counts), what))

    def to_seq(self, y: torch.Tensor, what: str) -> torch.Tensor:
        """y [T_g, W] (this member's shard, the group's rows) -> [t_me, a, W] (slot m: shard m)."""
        return torch.stack(self._exchange(list(torch.split(y, list(self.counts))), [self.counts[self.me]] * self.a,
                                          what), dim=1)


def _flat(xs, lead: int) -> torch.Tensor:
    """Tensors [*lead, w_i, d_i] -> [*lead, sum(w_i * d_i)] (heads and channels side by side; any
    row count, zero included)."""
    return torch.cat([x.flatten(lead) for x in xs], dim=-1)


class _PackedToHeads(torch.autograd.Function):
    """q [t,h,d], k [t,H,d], v [t,H,d_v] -> [T_g, h/a | H/a | H/a, d | d | d_v]; backward: the
    gradients back to [t, h | H | H, ...] in one all-to-all."""

    @staticmethod
    def forward(ctx, q, k, v, comm: _PackedComm):
        t, a = q.shape[0], comm.a
        ctx.comm, ctx.t, ctx.dtype, ctx.device = comm, t, q.dtype, q.device
        ctx.shapes = tuple((x.shape[1] // a, x.shape[2]) for x in (q, k, v))        # (heads, channels) per shard
        packed = _flat([x.reshape(t, a, x.shape[1] // a, x.shape[2]) for x in (q, k, v)], 2)   # [t, a, F]
        y = comm.to_heads(packed, "q|k|v forward")                                      # [T_g, F]
        return tuple(p.contiguous() for p in _unfeatures(y, ctx.shapes))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        comm, n = ctx.comm, sum(ctx.comm.counts)
        grads = [g if g is not None else torch.zeros(n, w, d, dtype=ctx.dtype, device=ctx.device)
                 for g, (w, d) in zip((dq, dk, dv), ctx.shapes)]
        x = comm.to_seq(_flat(grads, 1), "dq|dk|dv backward")                          # [t, a, F]
        parts = _unfeatures(x, ctx.shapes)                                              # [t, a, w_i, d_i]
        return (*(p.reshape(ctx.t, comm.a * w, d) for p, (w, d) in zip(parts, ctx.shapes)), None)


class _PackedOutToSeq(torch.autograd.Function):
    """out [T_g, h/a, d_v] -> [t, h, d_v]; backward: dout to head shards."""

    @staticmethod
    def forward(ctx, out, comm: _PackedComm):
        ctx.comm, ctx.w, ctx.d = comm, out.shape[1], out.shape[2]
        x = comm.to_seq(out.flatten(1), "out forward")                                 # [t, a, w*d_v]
        return x.reshape(x.shape[0], comm.a * ctx.w, ctx.d)

    @staticmethod
    def backward(ctx, dout):
        t = dout.shape[0]
        y = ctx.comm.to_heads(dout.reshape(t, ctx.comm.a, ctx.w * ctx.d), "dout backward")   # [T_g, w*d_v]
        return y.view(-1, ctx.w, ctx.d), None


def _validate(q, k, v, cp_group, hp_plan, groups, causal, softmax_scale, kernel, softmax_offset):
    check_qkv(q, k, v, thd=True, softmax_scale=softmax_scale)
    t, h, d = q.shape
    check_softmax_offset(softmax_offset, h, q.device)
    if not isinstance(hp_plan, PackedHeadParallelPlan):
        raise ValueError(f"hp_plan must be a megatron_fcp.contract.head_parallel_packed.PackedHeadParallelPlan "
                         f"(compile_packed_head_parallel), got {type(hp_plan).__name__}")
    rep = hp_plan.check_heads(h, k.shape[1])
    if hp_plan.placement.causal != causal:
        raise ValueError(f"the packed head-parallel plan was built with causal={hp_plan.placement.causal} but "
                         f"attention runs with causal={causal}; rebuild it with causal={causal}")
    kern = resolve_kernel(kernel, q.dtype, q.device, head_dim=d, v_head_dim=v.shape[2])
    if not getattr(kern, "documents", False):
        raise ValueError(f"block kernel {kern.name!r} has no document mask (BlockKernel.documents), which packed "
                         "batches need; use kernel='auto' (or any fused kernel, or 'math')")
    ranks, rank = plan_ranks(hp_plan, cp_group)
    want = hp_plan.placement.tokens(ranks.index(rank))
    if t != want:
        raise ValueError(f"this rank holds {t} tokens but the packed head-parallel plan's member placement gives it "
                         f"{want}: shard the batch with hp_plan.placement.shard (not the plain packed placement)")
    g, j = hp_plan.position(rank)
    groups = stage_groups(hp_plan, cp_group, groups, g, j)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    return rank, g, j, rep, scale, kern, groups


def fcp_head_parallel_packed_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group, hp_plan: PackedHeadParallelPlan,
    groups: HeadParallelGroups | None = None, causal: bool = True, softmax_scale: float | None = None,
    kernel: Any = "auto", transport: Transport | None = None, stats: FCPStats | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S, backward_kv: str = "auto", kv_memory_budget: int = RING_BUDGET,
    agreement: LastAgreed | None = PLAN_AGREEMENT, check_numerics: bool = False, return_lse: bool = True,
    softmax_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact attention of this rank's packed shard through the head-parallel stage (Note
    [Head-parallel execution on packed batches]).

    q [t, h, d]; k, v [t, h_kv, d] / [t, h_kv, d_v]: this rank's tokens of ``hp_plan.placement``
    (the member placement; ``hp_plan.placement.shard(x, cp_index)``). hp_plan: over
    ``dist.get_process_group_ranks(cp_group)``; groups: this rank's head-group and KV-stage process
    groups (:func:`~megatron_fcp.attention.head_parallel.create_head_parallel_groups` with the
    plan's head groups; not needed for ``a = cp``). transport, stats, backward_kv,
    kv_memory_budget: the KV stage's, as in
    :func:`~megatron_fcp.attention.function.fcp_attention_with_lse`. agreement: the KV stage's
    (None: the caller agreed, as the Megatron packed path does once per micro-batch); with one
    head group there is no stage and nothing to agree but the plan the caller built.
    softmax_offset: sink logits [h]; each rank applies those of its head shard. Returns out
    [t, h, d_v] in q's dtype and lse [h, t] (FP32, FP64 for FP64 inputs) or None. Raises
    ValueError naming the fix before any communication on bad input."""
    mask = resolve_mask(causal, None)
    rank, g, j, rep, scale, kern, groups = _validate(q, k, v, cp_group, hp_plan, groups, causal, softmax_scale,
                                                     kernel, softmax_offset)
    t, h, _ = q.shape
    a = hp_plan.degree
    if rep > 1:  # GQA with h_kv not divisible by a: repeat each KV head (grads summed back)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)        # [t, H, d]
    comm = _PackedComm(groups.head_group, hp_plan.head_groups[g], hp_plan.member_tokens(g), timeout_s, stats)
    qs, ks, vs = _PackedToHeads.apply(q, k, v, comm)                       # [T_g, h/a | H/a | H/a, d | d | d_v]
    hq = h // a
    sink_j = None if softmax_offset is None else softmax_offset.view(a, hq)[j]   # [h/a]: head shard j's
    if hp_plan.kv_plan is None:  # G == 1: the whole batch is here for h/a heads
        gp = hp_plan.group_placement
        pos, docs = (torch.as_tensor(x) for x in (gp.positions(0), gp.doc_ids(0)))
        o4, l3 = _LocalAttention.apply(qs[:, None], ks[:, None], vs[:, None], kern, pos, mask, scale, sink_j, docs)
        o_st, l_st = o4[:, 0], l3[0]                                       # [T, h/a, d_v], [h/a, T]
    else:
        plan_j = hp_plan.kv_plan_for(j)
        o_st, l_st = fcp_attention_with_lse(
            qs, ks, vs, cp_group=groups.kv_group, plan=plan_j, placement=plan_j.placement, causal=causal,
            softmax_scale=scale, transport=transport, stats=stats, timeout_s=timeout_s, kernel=kern,
            backward_kv=backward_kv, kv_memory_budget=kv_memory_budget, agreement=agreement,
            softmax_offset=sink_j)                                         # [T_g, h/a, d_v], [h/a, T_g]
    out = _PackedOutToSeq.apply(o_st, comm)                                # [t, h, d_v]
    lse = None
    if return_lse:
        with torch.no_grad():
            lse = comm.to_seq(l_st.t().contiguous(), "lse forward").reshape(t, h).t().contiguous()   # [h, t]
    if check_numerics:
        check_finite(out, lse if lse is not None else torch.zeros(()),
                     f"FCP packed head-parallel attention forward on rank {rank} (degree {a})")
    return out, lse


def fcp_head_parallel_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group,
                                       hp_plan: PackedHeadParallelPlan, **kwargs: Any) -> torch.Tensor:
    """Like :func:`fcp_head_parallel_packed_attention_with_lse` but returns only ``out`` [t, h, d_v]."""
    out, _ = fcp_head_parallel_packed_attention_with_lse(q, k, v, cp_group=cp_group, hp_plan=hp_plan,
                                                         return_lse=False, **kwargs)
    return out
