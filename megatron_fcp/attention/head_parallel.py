"""``fcp_head_parallel_attention``: CP attention with a head-parallel (Ulysses) stage before the KV stage.

The plan is a :class:`~megatron_fcp.contract.head_parallel.HeadParallelPlan` (Note [Head-parallel
stage] there): ``G = cp / a`` head groups of ``a`` ranks; member ``j`` of a group takes head shard
``j``; the ranks with the same member index form a KV stage that runs an ordinary FCP plan over the
groups' tokens.

Note [Head-parallel execution]
------------------------------
Zigzag shards in Megatron's layout: q ``[s, b, h, d]``, k/v ``[s, b, h_kv, d]`` (``s = s_local``).
With ``rep = kv_replication(h_kv, a)`` the KV heads are first repeated to ``H = h_kv * rep``
(``repeat_interleave``: query head ``i`` keeps KV head ``i // (h / H)``; autograd sums the
copies' gradients back). Then, per rank of head group ``g``, member ``j``::

    pack   [s, b, a, h/a + 2H/a, d]       q | k | v heads of each shard side by side
    a2a    shard i -> member i            one all-to-all in the head group (gloo: Note [All-to-all on gloo])
    unpack [a*s, b, h/a | H/a | H/a, d]   every member's s tokens (member order, chunk 0 then 1),
                                          head shard j only: group_placement's token order
    KV stage (G > 1): fcp_attention_with_lse over the KV-stage group (kv_stage_ranks(j)) with
           plan kv_plan_for(j) and placement = its group placement; the batch is folded into the
           heads, THD [a*s, b*h/a, d] (query b*h/a + i uses KV b*H/a + i // (h/H), GQA intact)
    local  (G == 1, Ulysses / TE's a2a): the block kernel over the whole sequence at once
    a2a    out [a*s, b, h/a, d] -> [s, b, h, d] (and lse [b, h/a, a*s] -> [b, h, s] if asked)

Note [Q's all-to-all behind the KV stage]
-----------------------------------------
With a KV stage (``G > 1``) the forward's first all-to-all moves K|V only; Q's is posted right
after and left in flight while the stage posts its first round, so Q crosses the intra-node links
while the first KV blocks cross the inter-node ones (on a rail cluster, disjoint links). The stage
calls ``q_ready`` (:meth:`_HeadComm.finish_pending`) once its round 0 is posted and before it first
reads q (:func:`~megatron_fcp.attention.function.fcp_attention_with_lse`); the pending a2a is
finished on any error too. The bytes are those of the one Q|K|V all-to-all; the backward is
unchanged (one dQ|dK|dV all-to-all). The cost model prices it the same way
(:func:`~megatron_fcp.cost.head_parallel.simulate_head_parallel`: the stage's compute
starts after Q's all-to-all, its transfers after K|V's). ``G == 1`` (Ulysses) keeps one all-to-all.

Note [dQ's all-to-all ahead of dK|dV's]
---------------------------------------
The backward's mirror of the note above. dQ is final once this rank's last block job has run;
dK and dV only once the stage's last partial sums have come home, which on a communication-bound
stage is most of a step later. So with a KV stage the stage's backward hands dQ over at its last
job (``dq_ready`` of :func:`~megatron_fcp.attention.function.fcp_attention_with_lse`) and the
engine posts dQ's all-to-all there (:meth:`_HeadComm.post_dq`), in flight while the stage waits;
the all-to-all out then moves dK|dV only and takes dQ's with it (:meth:`_QKVToHeads.backward`).
Every rank of a head group posts dQ's before dK|dV's, so the pairs match in order; the bytes
are those of the one dQ|dK|dV all-to-all. The cost model prices it the same way
(:func:`~megatron_fcp.cost.head_parallel.simulate_head_parallel`: dQ's all-to-all starts
at the stage's last job, dK|dV's after the stage; both on the intra-node links). ``overlap_q=False``
(Transformer Engine's order) keeps one dQ|dK|dV all-to-all, as ``G == 1`` does. If the stage's
backward fails after dQ's all-to-all was posted the error propagates and that all-to-all is left
unwaited, as any collective of a failed step.

Note [All-to-all on gloo]
-------------------------
On gloo the engine posts an all-to-all as one ``isend``/``irecv`` per peer of the head group, all in
flight at once (:func:`_pairwise_all_to_all`), instead of ``all_to_all_single``: NCCL's all-to-all
is exactly that (grouped sends and receives to every peer), and gloo's own took about twice the
bytes' time on the emulated cluster (2 ranks, 128 KB each way: 7.4 ms against 3.8 ms for the pair
of ``isend``/``irecv``; 4 ranks, 256 KB per peer: 30.7 ms against 25.5 ms; the links' rate allows
18.3 ms). The bytes and the result are the same; NCCL (and any other backend) keeps
``all_to_all_single``.

Backward is the mirror, by autograd: dO a2a to head shards, the stage's backward (dK/dV reduced
along the reversed trees, partials sent in the input dtype: Note [Backward pipeline]), one a2a of
dQ|dK|dV back (with a KV stage dQ's ahead, at the stage's last job, then dK|dV's: Note [dQ's
all-to-all ahead of dK|dV's]), replicated KV heads summed. Each a2a is one autograd function whose
backward is the inverse permutation, so every rank issues the same collectives in the same order
(forward: qkv, or with a KV stage k|v then q (in flight while the stage starts), [stage], out,
lse; backward: dout, [stage], dqkv, or with a KV stage dout, [stage, dq at its last job], dk|dv).

Bytes per rank and direction (E = element size): the Q/K/V a2a sends ``(a-1)/a * s*b*(h + 2H)*d*E``,
the O a2a ``(a-1)/a * s*b*h*d*E`` (LSE: ``(a-1)/a * s*b*h`` FP32 values when returned); the KV
stage moves the blocks of the KV plan, one per member's zigzag chunk, ``[2, s/2, b*H/a, d]``: 1/a
of the heads of ``a`` times the tokens. Replication (rep > 1) multiplies the K/V part of the a2a
and the KV stage by ``rep``. MLA (V's head size ``d_v`` differs from ``d``): heads and channels
travel flattened side by side, unpadded: Q/K/V ``(a-1)/a * s*b*(h*d + H*(d + d_v))*E``, O
``(a-1)/a * s*b*h*d_v*E``; KV-stage blocks as Note [KV block tensors] in
:mod:`megatron_fcp.attention.kv_block` says. With ``a = 1`` there is no a2a and the stage is plain FCP over the
zigzag chunks: as a placement (the runtime's plan), or, for a plan from
:func:`~megatron_fcp.planner.head_parallel.compile_head_parallel` (a zigzag KV plan,
sub-blocks allowed), ``fcp_attention_with_lse`` on the zigzag shards with that plan.

Process groups: the head groups and KV-stage groups are created once, on every rank of the world,
in the same order (``dist.new_group`` is collective): :func:`create_head_parallel_groups`. The
function takes this rank's two groups as :class:`HeadParallelGroups`; for ``a = cp`` and ``a = 1``
the CP group itself serves and nothing needs creating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_fcp.attention.agreement import LastAgreed
from megatron_fcp.attention.comm import DEFAULT_TIMEOUT_S, Transport
from megatron_fcp.attention.dispatch import resolve_kernel
from megatron_fcp.attention.function import (
    PLAN_AGREEMENT,
    check_finite,
    check_qkv,
    fcp_attention_with_lse,
    resolve_mask,
)
from megatron_fcp.attention.head_parallel_a2a import _HeadComm, _OutToSeq, _QKVToHeads
from megatron_fcp.attention.kernels import BlockKernel, compute_dtype_for
from megatron_fcp.attention.sinks import apply_sink, check_softmax_offset, sink_grad, sink_logits
from megatron_fcp.attention.stats import FCPStats
from megatron_fcp.contract.blocks import zigzag_chunk_index
from megatron_fcp.contract.head_parallel import HeadParallelPlan, check_head_parallel, group_placement
from megatron_fcp.schedule.program import RING_BUDGET

__all__ = [
    "HeadParallelGroups",
    "create_head_parallel_groups",
    "fcp_head_parallel_attention",
    "fcp_head_parallel_attention_with_lse",
    "head_parallel_bytes",
]


# ---------------------------------------------------------------------------------------------
# process groups
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadParallelGroups:
    """This rank's process groups for one :class:`HeadParallelPlan`.

    head_group: the ranks of this rank's head group (``None``: the plan has ``a = 1``, no a2a).
    kv_group: the ranks of this rank's KV stage, ``kv_stage_ranks(j)`` (``None``: ``G = 1``).
    """

    head_group: Any
    kv_group: Any

    @classmethod
    def of_cp_group(cls, hp_plan: HeadParallelPlan, cp_group: Any) -> "HeadParallelGroups | None":
        """The groups when the CP group itself serves (``a = 1``: KV stage; ``a = cp``: head
        group); None for any other degree (create them with :func:`create_head_parallel_groups`)."""
        if hp_plan.degree == 1:
            return cls(None, cp_group)
        if hp_plan.num_groups == 1:
            return cls(cp_group, None)
        return None


def create_head_parallel_groups(partitions: Sequence[HeadParallelPlan | Sequence[Sequence[int]]], *,
                                backend: str | None = None,
                                timeout_s: float | None = None) -> list[HeadParallelGroups | None]:
    """Create the head-group and KV-stage process groups of every CP group of the job, in the same
    order on every rank (``dist.new_group`` is a collective of the whole world).

    partitions: per CP group its head groups (``HeadParallelPlan.head_groups``, or the plan itself).
    Returns, aligned with ``partitions``, this rank's :class:`HeadParallelGroups` (None for a CP
    group this rank is not in, and for degree 1 or one head group, which create nothing: the CP
    group serves, :meth:`HeadParallelGroups.of_cp_group`). KV stage ``j`` is member ``j`` of every
    head group, in head-group order."""
    kwargs: dict[str, Any] = {}
    if backend is not None:
        kwargs["backend"] = backend
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    rank = dist.get_rank()
    mine: list[HeadParallelGroups | None] = []
    for part in partitions:
        head_groups = tuple(tuple(g) for g in (part.head_groups if isinstance(part, HeadParallelPlan) else part))
        degree = len(head_groups[0])
        if degree == 1 or len(head_groups) == 1:
            mine.append(None)
            continue
        head = kv = None
        for group in head_groups:
            pg = dist.new_group(list(group), **kwargs)
            if rank in group:
                head = pg
        for j in range(degree):
            stage = [group[j] for group in head_groups]
            pg = dist.new_group(stage, **kwargs)
            if rank in stage:
                kv = pg
        mine.append(None if head is None else HeadParallelGroups(head, kv))
    return mine


def head_parallel_bytes(hp_plan: HeadParallelPlan, s_local: int, batch: int, heads: int, kv_heads: int,
                        head_dim: int, elem_bytes: int, with_lse: bool = False, v_head_dim: int | None = None) -> int:
    """Bytes one rank sends in the forward all-to-alls of one call: Q|K|V in, O out and, with
    ``with_lse``, the LSE (in the compute dtype: 8 bytes for FP64 inputs, else 4). The backward
    sends the same minus the LSE (dO in, dQ|dK|dV out). ``v_head_dim``: V's (and O's) head size
    when it differs from Q's and K's ``head_dim`` (MLA)."""
    a = hp_plan.degree
    if a == 1:
        return 0
    d_v = head_dim if v_head_dim is None else v_head_dim
    big_h = kv_heads * check_head_parallel(heads, kv_heads, a, hp_plan.cp)
    per_token = (heads // a) * head_dim + (big_h // a) * (head_dim + d_v) + (heads // a) * d_v  # q|k|v in, o out
    sent = (a - 1) * s_local * batch * per_token * elem_bytes
    lse_bytes = 8 if elem_bytes == 8 else 4
    return sent + ((a - 1) * s_local * batch * (heads // a) * lse_bytes if with_lse else 0)


# ---------------------------------------------------------------------------------------------
# G == 1: attention over the whole sequence on this rank (Ulysses)
# ---------------------------------------------------------------------------------------------
class _LocalAttention(torch.autograd.Function):
    """The block kernel over all tokens at once: q [n,b,h,d], k/v [n,b,h_kv,d], positions ``pos``,
    under ``mask`` (a :class:`~megatron_fcp.contract.mask.Mask`); ``softmax_offset`` [h] or None: the
    sink, merged once after the kernel (attention.sinks). ``docs`` (int64 [n], packed batches):
    each token's document, so a query sees only its own document's keys (a kernel with
    ``documents``)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel: BlockKernel, pos: torch.Tensor, mask, scale: float,
                softmax_offset: torch.Tensor | None, docs: torch.Tensor | None = None):
        hk = k.shape[2]
        ctx.doc_kw = {} if docs is None else {"q_doc": docs, "k_doc": docs}
        out, lse = kernel.forward(q, k, v, pos, pos, mask, scale, **kernel.prepare_forward(q, hk, scale), **ctx.doc_kw)
        sink = sink_logits(softmax_offset, out.dtype)
        if sink is not None:  # Note [A sink enters once, after the merge]
            out, lse = apply_sink(out, lse, sink)
        ctx.kernel, ctx.pos, ctx.mask, ctx.scale = kernel, pos, mask, scale
        ctx.sink, ctx.offset_dtype = sink, None if softmax_offset is None else softmax_offset.dtype
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        kern, pos = ctx.kernel, ctx.pos
        doc = dout.to(compute_dtype_for(q.dtype))
        dsink = sink_grad(doc, out, lse, ctx.sink).to(ctx.offset_dtype) if ctx.needs_input_grad[7] else None
        dq, dk, dv = kern.backward(doc, q, k, v, out, lse, pos, pos, ctx.mask, ctx.scale,
                                   **kern.prepare_backward(q, doc, out, k.shape[2]), **ctx.doc_kw)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, dsink, None


def _group_positions(hp_plan: HeadParallelPlan, group: tuple[int, ...], s_local: int) -> torch.Tensor:
    """Global positions (int64 [a*s_local]) of a head group's tokens: members in order, each
    member's zigzag chunk 0 then chunk 1 (group_placement's order)."""
    chunk, cp = s_local // 2, hp_plan.cp
    ar = torch.arange(chunk, dtype=torch.int64)
    return torch.cat([ar + zigzag_chunk_index(hp_plan.ranks.index(m), c, cp) * chunk for m in group for c in (0, 1)])


# ---------------------------------------------------------------------------------------------
# validation (before any communication) and the entry points
# ---------------------------------------------------------------------------------------------
def _validate(q, k, v, cp_group, hp_plan, groups, causal, softmax_scale, kernel, softmax_offset=None):
    check_qkv(q, k, v, softmax_scale=softmax_scale)                     # the tensors, as fcp_attention checks them
    check_softmax_offset(softmax_offset, q.shape[2], q.device)
    s, b, h, d = q.shape
    if not isinstance(hp_plan, HeadParallelPlan):
        raise ValueError(f"hp_plan must be a megatron_fcp.contract.head_parallel.HeadParallelPlan, got "
                         f"{type(hp_plan).__name__}")
    h_kv = k.shape[2]
    rep = check_head_parallel(h, h_kv, hp_plan.degree, hp_plan.cp)
    if hp_plan.kv_replication != rep:
        raise ValueError(f"hp_plan was built with kv_replication={hp_plan.kv_replication} but h={h}, h_kv={h_kv} "
                         f"at degree {hp_plan.degree} need {rep}; build it with kv_replication="
                         f"check_head_parallel(h, h_kv, degree, cp)")
    if s % 2:
        raise ValueError(f"local sequence length {s} must be even (two zigzag chunks); pad the global sequence "
                         f"to a multiple of 2*cp = {2 * hp_plan.cp}")
    kernel_obj = resolve_kernel(kernel, q.dtype, q.device, head_dim=d, v_head_dim=v.shape[3])
    zigzag = hp_plan.kv_plan is not None and hp_plan.kv_plan.placement is None  # degree 1, plain FCP
    if hp_plan.num_groups > 1 and not zigzag and not getattr(kernel_obj, "documents", False):
        raise ValueError(f"block kernel {kernel_obj.name!r} has no document mask (BlockKernel.documents), which the "
                         f"KV stage's placement needs; use kernel='auto' (or any fused kernel, or 'math')")
    ranks, rank = plan_ranks(hp_plan, cp_group)
    g, j = hp_plan.position(rank)
    if hp_plan.kv_plan is not None:
        kv_plan = hp_plan.kv_plan
        if kv_plan.causal != causal:
            raise ValueError(f"hp_plan's KV-stage plan was built with causal={kv_plan.causal} but attention runs with "
                             f"causal={causal}; rebuild it with causal={causal}")
        want = group_placement(ranks, hp_plan.head_groups, s * hp_plan.cp, causal)
        if zigzag and hp_plan.degree != 1:
            raise ValueError(f"hp_plan's KV-stage plan of degree {hp_plan.degree} is over the zigzag layout; a "
                             f"head-parallel KV stage runs over group_placement: build it with compile_head_parallel")
        if not zigzag and kv_plan.placement != want:  # zigzag (degree 1): the executor checks the parts
            raise ValueError(f"hp_plan's KV-stage plan is not over group_placement(ranks, head_groups, seq_len="
                             f"{s * hp_plan.cp}, causal={causal}) (this call's sequence); rebuild it for this "
                             f"sequence length")
    groups = stage_groups(hp_plan, cp_group, groups, g, j)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    return rank, g, j, rep, scale, kernel_obj, groups


def plan_ranks(hp_plan: Any, cp_group) -> tuple[tuple[int, ...], int]:
    """``(the CP group's ranks, this rank)``, checked against a head-parallel plan (zigzag or
    packed): ValueError naming the fix before any communication."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("torch.distributed is not initialised; call dist.init_process_group first")
    if cp_group is None:
        raise ValueError("cp_group is required (e.g. parallel_state.get_context_parallel_group())")
    ranks, rank = tuple(dist.get_process_group_ranks(cp_group)), dist.get_rank()
    if ranks != hp_plan.ranks:
        raise ValueError(f"hp_plan ranks {list(hp_plan.ranks)} are not the CP group's ranks {list(ranks)} (CP order); "
                         f"build the plan from dist.get_process_group_ranks(cp_group)")
    if rank not in ranks:
        raise ValueError(f"this rank {rank} is not in cp_group {list(ranks)}; pass this rank's CP group")
    return ranks, rank


def stage_groups(hp_plan: Any, cp_group, groups: "HeadParallelGroups | None", g: int, j: int) -> "HeadParallelGroups":
    """The head-parallel process groups of member ``j`` of head group ``g`` (given, or this CP
    group's created ones), checked against ``hp_plan`` (zigzag or packed: its ``head_groups``,
    ``kv_plan``, ``kv_stage_ranks``); ValueError naming the fix before any communication."""
    groups = groups if groups is not None else HeadParallelGroups.of_cp_group(hp_plan, cp_group)
    if groups is None:
        raise ValueError(f"head-parallel degree {hp_plan.degree} of cp={hp_plan.cp} needs its own process groups: "
                         f"create them on every rank with create_head_parallel_groups([...every CP group's plan]) "
                         f"and pass groups=")
    if hp_plan.degree > 1 and set(dist.get_process_group_ranks(groups.head_group)) != set(hp_plan.head_groups[g]):
        raise ValueError(f"groups.head_group has ranks {dist.get_process_group_ranks(groups.head_group)}, not this "
                         f"rank's head group {list(hp_plan.head_groups[g])}")
    if hp_plan.kv_plan is not None:
        stage = hp_plan.kv_stage_ranks(j)
        got = tuple(dist.get_process_group_ranks(groups.kv_group))
        if got != stage:
            raise ValueError(f"groups.kv_group has ranks {list(got)} but this rank's KV stage is {list(stage)} (in head "
                             f"group order; process groups order ranks ascending, so head groups must be listed "
                             f"in ascending order of their members)")
    return groups


def fcp_head_parallel_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group, hp_plan: HeadParallelPlan,
    groups: HeadParallelGroups | None = None, causal: bool = True, softmax_scale: float | None = None,
    kernel: str | BlockKernel = "auto", transport: Transport | None = None, stats: FCPStats | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S, backward_kv: str = "auto", kv_memory_budget: int = RING_BUDGET,
    agreement: LastAgreed | None = PLAN_AGREEMENT, check_numerics: bool = False, return_lse: bool = True,
    overlap_q: bool = True, softmax_offset: torch.Tensor | None = None,
    window: "tuple[int, int] | None" = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact attention of this rank's zigzag shard through the head-parallel stage.

    q [s_local, b, h, d]; k, v [s_local, b, h_kv, d] (Megatron's zigzag shard, the same shapes on
    every rank; MLA: v [s_local, b, h_kv, d_v], out then has d_v). hp_plan: over ``dist.get_process_group_ranks(cp_group)``; its KV-stage plan over
    ``group_placement(ranks, head_groups, s_local * cp, causal)`` (degree 1: or a zigzag plan, as
    ``compile_head_parallel`` builds) and ``kv_replication`` matching
    the head counts (:func:`~megatron_fcp.contract.head_parallel.check_head_parallel`). groups:
    this rank's process groups (:func:`create_head_parallel_groups`; not needed for ``a = 1`` or
    ``a = cp``). transport / backward_kv / kv_memory_budget / stats: the KV stage's, as in
    :func:`~megatron_fcp.attention.function.fcp_attention_with_lse` (stats also counts the
    all-to-all bytes). Returns out [s_local, b, h, d] in q's dtype (differentiable in q, k, v) and
    lse [b, h, s_local] (FP32, FP64 for FP64 inputs), or None with ``return_lse=False``.
    overlap_q: with a KV stage, send Q's all-to-all behind the stage's start (Note [Q's all-to-all
    behind the KV stage]; False: one Q|K|V all-to-all first, Transformer Engine's order).
    softmax_offset: sink logits ``[h]`` (the layer's heads, as for
    :func:`~megatron_fcp.attention.function.fcp_attention`); after the all-to-all each rank applies
    those of the heads it holds (head shard ``j``: heads ``j*h/a .. (j+1)*h/a``), once per row, and
    autograd maps their gradient back to the layer's heads.
    window: a sliding window ``(left, right)`` as for ``fcp_attention``; heads do not move tokens'
    positions, so the stage passes it through unchanged (the local attention and the KV stage run
    it on global positions). Raises ValueError naming the fix before any communication on bad input.
    """
    mask = resolve_mask(causal, window)                     # bad windows fail before any communication
    rank, g, j, rep, scale, kern, groups = _validate(q, k, v, cp_group, hp_plan, groups, causal, softmax_scale,
                                                     kernel, softmax_offset)
    if agreement is not None and hp_plan.degree > 1:
        kv = hp_plan.kv_plan
        agreement.ensure({
            "shape": (tuple(q.shape), tuple(k.shape), v.shape[3]), "dtype": str(q.dtype), "causal": causal,
            "window": mask.window,
            "softmax_scale": scale, "kernel": kern.name, "return_lse": return_lse,
            "head_parallel": (hp_plan.ranks, hp_plan.degree, hp_plan.head_groups, hp_plan.kv_replication),
            "kv_plan": None if kv is None else (kv.name, kv.ranks, kv.rounds), "overlap_q": overlap_q,
            "sink": softmax_offset is not None,
        }, cp_group, what="fcp head-parallel attention", timeout_s=timeout_s)
    s, b, h, d = q.shape
    d_v = v.shape[3]                                                     # = d unless MLA
    a = hp_plan.degree
    if hp_plan.cp == 1:  # nothing to distribute
        out, lse = _LocalAttention.apply(q, k, v, kern, _group_positions(hp_plan, hp_plan.ranks, s), mask, scale,
                                         softmax_offset)
    elif a == 1 and hp_plan.kv_plan.placement is None:  # degree 1 from compile_head_parallel: plain FCP
        out, lse = fcp_attention_with_lse(                                   # [s, b, h, d], [b, h, s]
            q, k, v, cp_group=groups.kv_group, plan=hp_plan.kv_plan_for(0), causal=causal, softmax_scale=scale,
            transport=transport, stats=stats, timeout_s=timeout_s, kernel=kern, backward_kv=backward_kv,
            kv_memory_budget=kv_memory_budget, agreement=agreement, softmax_offset=softmax_offset, window=window)
    elif a == 1:  # no head-parallel stage: the KV stage over the CP group on the zigzag placement
        out3, lse = fcp_attention_with_lse(
            q.reshape(s, b * h, d), k.reshape(s, b * k.shape[2], d), v.reshape(s, b * v.shape[2], d_v),
            cp_group=groups.kv_group, plan=hp_plan.kv_plan_for(0), causal=causal, softmax_scale=scale,
            transport=transport, stats=stats, timeout_s=timeout_s, kernel=kern,
            placement=hp_plan.kv_plan.placement, backward_kv=backward_kv, kv_memory_budget=kv_memory_budget,
            agreement=agreement, window=window,                         # heads folded b-major: [b*h]
            softmax_offset=None if softmax_offset is None else softmax_offset.repeat(b))
        out, lse = out3.view(s, b, h, d_v), lse.view(b, h, s)
    else:
        if rep > 1:  # GQA with h_kv not divisible by a: repeat each KV head (grads summed back)
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)   # [s, b, H, d]
        comm = _HeadComm(groups.head_group, hp_plan.head_groups[g], timeout_s, stats)
        stage = hp_plan.kv_plan is not None                          # G > 1: Q's a2a behind the stage's start
        qs, ks, vs = _QKVToHeads.apply(q, k, v, comm, stage and overlap_q)  # [a*s, b, h/a | H/a | H/a, d | d | d_v]
        n, hq, hk = a * s, h // a, k.shape[2] // a
        sink_j = None if softmax_offset is None else softmax_offset.view(a, hq)[j]  # [h/a]: head shard j's
        if not stage:  # G == 1: the whole sequence is here for h/a heads
            pos = _group_positions(hp_plan, hp_plan.head_groups[g], s)
            o_st, l_st = _LocalAttention.apply(qs, ks, vs, kern, pos, mask, scale, sink_j)
        else:
            plan_j = hp_plan.kv_plan_for(j)
            try:
                o3, l3 = fcp_attention_with_lse(
                    qs.view(n, b * hq, d), ks.view(n, b * hk, d), vs.view(n, b * hk, d_v), cp_group=groups.kv_group,
                    plan=plan_j, causal=causal, softmax_scale=scale, transport=transport, stats=stats,
                    timeout_s=timeout_s, kernel=kern, placement=plan_j.placement, backward_kv=backward_kv,
                    kv_memory_budget=kv_memory_budget, agreement=agreement, window=window, q_ready=comm.finish_pending,
                    dq_ready=(lambda g: comm.post_dq(g.view(n, b, hq, d))) if overlap_q else None,
                    softmax_offset=None if sink_j is None else sink_j.repeat(b))    # [b*h/a], b-major
            finally:
                comm.finish_pending()                                # never leave Q's a2a behind (errors too)
            o_st, l_st = o3.view(n, b, hq, d_v), l3.view(b, hq, n)    # [a*s, b, h/a, d_v], [b, h/a, a*s]
        out = _OutToSeq.apply(o_st, comm)                               # [s, b, h, d_v]
        lse = None
        if return_lse:
            with torch.no_grad():
                lse = comm.to_seq(l_st.permute(2, 0, 1).unsqueeze(-1), "lse forward")    # [s, b, h, 1]
                lse = lse.squeeze(-1).permute(1, 2, 0).contiguous()                       # [b, h, s]
    if check_numerics:
        check_finite(out, lse if lse is not None else torch.zeros(()),
                     f"FCP head-parallel attention forward on rank {rank} (degree {a})")
    return out, lse


def fcp_head_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group,
                                hp_plan: HeadParallelPlan, groups: HeadParallelGroups | None = None,
                                causal: bool = True, softmax_scale: float | None = None,
                                kernel: str | BlockKernel = "auto", **kwargs: Any) -> torch.Tensor:
    """Like :func:`fcp_head_parallel_attention_with_lse` but returns only ``out`` [s_local, b, h, d]
    (the LSE is not sent back)."""
    out, _ = fcp_head_parallel_attention_with_lse(q, k, v, cp_group=cp_group, hp_plan=hp_plan, groups=groups,
                                                  causal=causal, softmax_scale=softmax_scale, kernel=kernel,
                                                  return_lse=False, **kwargs)
    return out
