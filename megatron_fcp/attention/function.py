"""``fcp_attention``: exact context-parallel attention that executes a communication :class:`Plan`.

Each CP rank holds its zigzag shard of Q, K, V (``[s_local, b, h, d]``), or, for a packed batch,
the tokens a :class:`~megatron_fcp.planning.Placement` gives it (THD ``[t_local, h, d]``, run as
``b = 1``). Its KV is cut into blocks (``Plan.parts_per_chunk`` per zigzag chunk, or the
placement's spans, of any size); the plan says, round by round, which rank sends which block to
whom. Every rank folds each block it *needs* (``Plan.needs``) into a running ``(out, lse)``; blocks
a plan only routes through a rank (a ring delivers everything everywhere) are relayed, never
computed on. One executor serves both layouts: what it needs to know about tokens comes from a
shard layout (Note [Shard layouts] in :mod:`megatron_fcp.attention.layout`). Over a placement a
block is computed only against the query rows of its document, merged into those rows.

Note [Windowed attention in the executor]
-----------------------------------------
The call's mask (:class:`~megatron_fcp.contract.mask.Mask`: ``causal`` and ``window=(left,
right)`` in Megatron's convention) is resolved once, in :func:`_validate` (checked against the
plan's and placement's own mask where they carry one), agreed by the ranks with the other facts,
and passed to every kernel call. A block that has no visible pair with this rank's query rows
(:func:`~megatron_fcp.attention.tiles.sees_any`: e.g. a block wholly before every query's
window) is not computed: no kernel call in forward (nothing merged), a zero dK/dV partial in
backward (the plan still routes and returns it). So a plan that delivers more than the window
needs (a causal ``ring`` or ``full`` plan) stays exact; the extra blocks cost bytes, not compute.

Note [Forward pipeline]
-----------------------
A block travels as one tensor ``[2, blk, b, h_kv, d]`` (K and V stacked; ``[blk, b, h_kv, d_k + d_v]``
when K and V have different head sizes, MLA: Note [KV block tensors] in
:mod:`megatron_fcp.attention.kv_block`) in the input dtype::

    post(round 0)
    compute local blocks                     # overlaps round 0
    for k in rounds:
        wait(round k)                        # blocks received in round k are now here
        post(round k+1)                      # may forward blocks received in round k
        compute needed blocks of round k     # overlaps round k+1

Kernel calls follow one rule, the one the cost model prices (Note [One launch per owner and stage]
in :mod:`megatron_fcp.schedule.launches`; :meth:`_Executor.forward_calls`): the local blocks are
one call, and a round's blocks of one owner another -- their K and V joined on the key axis in
plan order, each with its own positions (and document ids), the query rows the union of theirs
(:meth:`_Executor._call_args`); a block no query sees joins no call. Every kernel is exact on
such keys: ``math`` masks from positions, the fused kernels cut keys at jumps in position
(item 5 of :mod:`megatron_fcp.attention.fused`). Calls are merged in *plan order* (local blocks,
then each round's calls in the order of their first block), never in arrival order, so a fixed
plan gives bitwise identical results run after run; different plans agree within rounding (the
merge is order independent up to rounding).

Note [Backward pipeline]
------------------------
Like flash-attn, the backward recomputes each block's scores from the saved ``q, k, v`` (the local
shard), the final FP32 ``out`` and ``lse``, and the received KV blocks this rank computed on
(saved in forward under ``backward_kv="keep"``, or re-sent wave by wave in backward under
``"resend"``: Note [Backward KV modes] in :mod:`megatron_fcp.schedule.program`). dQ stays
local. dK/dV of a block flow back along the plan reversed: rounds run last to first and every
transfer is flipped, so the receiver of a block returns its partial ``[2, blk, b, h_kv, d]`` dKV
to the rank it got the block from. A relay first adds its own contribution and what its own
children returned (children receive the block in later forward rounds, i.e. return it in earlier
backward rounds), so every link carries one tensor per block. A rank that neither needs the block
nor has children returns zeros (the plan lists the transfer; a ring does exactly this). The owner
adds all returns into its local dK/dV. Kernel calls: a backward in waves computes one block per job
(a job is one call, as its model prices); a chain backward one call per step and owner, like the
forward (Note [One launch per owner and stage]); the call's dK/dV is cut back into the blocks'
partials::

    waves: the plan's deliveries, split (Note [Backward waves] in backward_waves)
    for w = 0 .. W:  reverse rounds of wave w-1 (last to first), resend: wave w+1's re-send
        for each of this rank's blocks of wave w:     # back to back
            between blocks: a round in flight that tests complete is waited, its returned
            partials added, the next round posted  # relays: own partial + children's returns
            compute the block
        finish wave w+1's re-send and wave w-2's reduction (w-1's may run on)

Precision on the wire: partials are computed and summed in FP32 (FP64 for FP64 inputs), but each
travels in the *input* dtype, as Transformer Engine's ring sends dKV: a partial (or a relay's sum
of its own and its children's) is cast just before it is sent, and the receiver adds it into an
FP32 accumulator. So a relay's sum is rounded once per hop, as TE's ring rounds its running dKV
once per step; for BF16/FP16 the backward moves half the bytes FP32 partials would, and for
FP32/FP64 inputs nothing is rounded. The owner's local dK/dV stay in FP32 until the final cast.

Both backward KV modes walk the same waves and cast at the same points, so dq and every dK/dV
partial are summed and rounded in the same order (bitwise equal results); a wave's received KV is
freed as it is computed, its non-local partials once reduced.

All validation happens before the first post; errors are ``ValueError`` naming the fix.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Union

import torch

from megatron_fcp.attention.agreement import LastAgreed
from megatron_fcp.attention.backward_chain import run_backward_chain
from megatron_fcp.attention.backward_waves import run_backward_waves
from megatron_fcp.attention.comm import DEFAULT_TIMEOUT_S, CommTimeout, Transport, default_transport
from megatron_fcp.attention.device_clock import DeviceClock, clock_for
from megatron_fcp.attention.dispatch import resolve_kernel
from megatron_fcp.attention.groups import group_membership
from megatron_fcp.attention.kernels import BlockKernel, compute_dtype_for
from megatron_fcp.attention.kv_block import kv_block_shape, kv_token_elems, pack_kv, split_kv
from megatron_fcp.attention.layout import PlacementLayout, ShardLayout, ZigzagLayout
from megatron_fcp.attention.merge import LseAccumulator
from megatron_fcp.attention.resolve import PLAN_ALIASES, PlanLike, check_placement, resolve_plan
from megatron_fcp.attention.sinks import apply_sink, check_softmax_offset, sink_grad, sink_logits
from megatron_fcp.attention.stats import FCPStats
from megatron_fcp.attention.tiles import sees_any
from megatron_fcp.contract.blocks import Block
from megatron_fcp.contract.mask import Mask, check_window
from megatron_fcp.contract.placement import Placement
from megatron_fcp.contract.plan import Plan
from megatron_fcp.schedule.launches import OWN, forward_launches
from megatron_fcp.schedule.program import RING_BUDGET, BackwardPolicy, BackwardProgram, compile_backward

__all__ = [
    "fcp_attention",
    "fcp_attention_with_lse",
    "build_executor",
    "FCPStats",
    "resolve_plan",
    "PLAN_ALIASES",
    "FCPNumericsError",
    "PLAN_AGREEMENT",
    "check_finite",
    "resolve_mask",
]

KernelLike = Union[str, BlockKernel]  # PlanLike, PLAN_ALIASES, resolve_plan: attention/resolve.py

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Agreement on the first use of a plan per CP group (process-wide, like the process groups it
#: keys on): :func:`fcp_attention_with_lse` agrees through it unless given ``agreement=None``.
PLAN_AGREEMENT = LastAgreed()


class FCPNumericsError(FloatingPointError):
    """``check_numerics``: an FCP attention forward produced NaN/inf (the message names where)."""


def check_finite(out: torch.Tensor, lse: torch.Tensor, where: str) -> None:
    """Raise :class:`FCPNumericsError` unless ``out`` is finite and ``lse`` has no NaN or +inf
    (``-inf`` is a fully masked row: out 0 there)."""
    bad_out = int((~torch.isfinite(out)).sum())
    bad_lse = int((torch.isnan(lse) | torch.isposinf(lse)).sum())
    if bad_out or bad_lse:
        raise FCPNumericsError(
            f"{where}: out has {bad_out} non-finite values of {out.numel()}, lse has {bad_lse} NaN/+inf; "
            "the inputs q/k/v are probably already non-finite (check the layer before), or a kernel is broken"
        )


# ---------------------------------------------------------------------------------------------
# validation (before any communication)
# ---------------------------------------------------------------------------------------------
def check_qkv(q, k, v, *, thd: bool = False, softmax_scale: float | None = None) -> None:
    """The checks every entry point makes of its tensors before any communication (this one and the
    head-parallel stage's): ranks, one dtype and device, q and k/v agreeing on tokens, batch and
    head size, query heads a multiple of KV heads, a positive finite scale. Zigzag tensors are
    ``[s_local, b, heads, head_dim]``, THD ones (``thd``) ``[t_local, heads, head_dim]``. q and k
    share the head size ``d_qk``; v may have its own ``d_v`` (MLA), out then has ``d_v``."""
    ndim, dims = (3, "[t_local, heads, head_dim] (THD, no batch dim)") if thd else (4, "[s_local, b, heads, head_dim]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != ndim:
            hint = "" if thd else "; for a packed batch pass placement= and THD tensors [t_local, heads, head_dim]"
            raise ValueError(f"{name} must be a {ndim}-D tensor {dims}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}{hint}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {[str(d) for d in _DTYPES]}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}); move them to one")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on every dim but the head size "
                         f"({'[t_local, h_kv, d_qk]' if thd else '[s_local, b, h_kv, d_qk]'} and "
                         f"{'[t_local, h_kv, d_v]' if thd else '[s_local, b, h_kv, d_v]'}: the same tokens and KV "
                         f"heads; only MLA's head sizes may differ)")
    if v.shape[-1] < 1:
        raise ValueError(f"v {tuple(v.shape)} has head size 0; pass values with at least one channel")
    s_local, h, d = q.shape[0], q.shape[-2], q.shape[-1]
    if k.shape[0] != s_local or k.shape[-1] != d or k.shape[1:-2] != q.shape[1:-2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on "
                         f"{'t_local' if thd else 's_local, batch'} and head_dim d_qk (self-attention over the "
                         f"same local tokens; v may have its own head size d_v)")
    h_kv = k.shape[-2]
    if h_kv < 1 or h % h_kv != 0:
        raise ValueError(f"query heads h={h} must be a multiple of KV heads h_kv={h_kv} (GQA/MQA); "
                         f"fix num_query_groups")
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale}")


def resolve_mask(causal: bool, window, plan=None, placement: Placement | None = None) -> Mask:
    """The call's :class:`~megatron_fcp.contract.mask.Mask` from ``causal`` and ``window``
    (Megatron's ``(left, right)``, -1 unbounded, None: no window), checked against the mask a
    plan or placement object carries (``.mask``, where it has one); ValueError naming the fix.

    A plan built for the call's mask runs; so does one built for a mask without a window that
    sees every pair the call's sees (full attention's, or causal's under a causal window): its need
    sets contain the window's, it only delivers more (the executor skips what no query sees)."""
    try:
        mask = Mask.of(causal, check_window(window))
    except ValueError as exc:
        raise ValueError(f"fcp_attention: {exc}") from None
    for what, obj in (("plan", plan), ("placement", placement)):
        theirs = getattr(obj, "mask", None)  # plans/placements built for a mask carry it
        covers = theirs is not None and not theirs.windowed and (not theirs.causal or mask.causal)
        if theirs is not None and theirs != mask and not covers:
            if theirs.causal != mask.causal:
                build = "place_packed" if what == "placement" else "build_plan"
                raise ValueError(f"the {what} was built with causal={theirs.causal} but attention runs "
                                 f"causal={mask.causal}; rebuild the {what} with {build}(..., causal={mask.causal}) "
                                 f"(need sets differ), or pass causal={theirs.causal}")
            raise ValueError(f"the {what} was built for {theirs.describe()} but attention runs {mask.describe()}; "
                             f"rebuild the {what} with window={mask.window} (need sets differ), or pass "
                             f"window={theirs.window}")
    return mask


def _validate(q, k, v, cp_group, plan: PlanLike | None, causal: bool, softmax_scale,
              kernel: KernelLike = "auto", placement: Placement | None = None, softmax_offset=None, window=None):
    """Check everything this rank can check locally; return (plan, rank, scale, kernel, mask).

    Zigzag: q, k, v are ``[s_local, b, h, d]``. Over a placement: THD ``[t_local, h, d]``."""
    thd = placement is not None
    mask = resolve_mask(causal, window, plan, placement)  # the mask comes from here only
    check_qkv(q, k, v, thd=thd, softmax_scale=softmax_scale)
    check_softmax_offset(softmax_offset, q.shape[-2], q.device)
    s_local, d = q.shape[0], q.shape[-1]
    kernel_obj = resolve_kernel(kernel, q.dtype, q.device, head_dim=q.shape[-1], v_head_dim=v.shape[-1])
    if thd and not getattr(kernel_obj, "documents", False):
        raise ValueError(f"block kernel {kernel_obj.name!r} has no document mask (BlockKernel.documents); "
                         f"use kernel='auto' (or any fused kernel, or 'math') for a placement")
    group_ranks, rank = group_membership(cp_group)  # a process group or a VirtualGroup (attention/groups.py)
    if rank not in group_ranks:
        raise ValueError(f"this rank {rank} is not in cp_group {list(group_ranks)}; pass this rank's CP group")
    if thd:
        check_placement(placement, group_ranks, rank, causal, s_local)
    plan = resolve_plan(plan, group_ranks, causal, placement)
    cp, ppc = plan.cp, plan.parts_per_chunk
    if not thd and s_local % 2 != 0:
        raise ValueError(f"local sequence length {s_local} (global {s_local * cp}) is odd; pad the global "
                         f"sequence to a multiple of 2*cp = {2 * cp} (two zigzag chunks per rank)")
    if not thd and not 1 <= ppc <= s_local // 2:  # uneven parts are fine (Note [Sub-block sizes])
        raise ValueError(f"the plan cuts each {s_local // 2}-token zigzag chunk into {ppc} parts, more than it has "
                         f"tokens; build the plan with parts_per_chunk <= {max(s_local // 2, 1)}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)  # d = d_qk
    resolve_mask(causal, window, plan)  # a named plan, now built: its mask (if any) agrees too
    return plan, rank, scale, kernel_obj, mask


# ---------------------------------------------------------------------------------------------
# execution
# ---------------------------------------------------------------------------------------------
def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    """Tensors joined on their first dim (the one itself: no copy, the per-block path's bits)."""
    return xs[0] if len(xs) == 1 else torch.cat(xs)


def _call_kv(kvs: list[torch.Tensor], d_qk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's K [m, b, h_kv, d_qk] and V [m, b, h_kv, d_v]: its blocks' on the key axis, in order."""
    parts = [split_kv(x, d_qk) for x in kvs]                                   # views
    return _cat([kb for kb, _ in parts]), _cat([vb for _, vb in parts])


class _Executor:
    """Runs one plan for one rank: forward and backward pipelines (see the Notes above). What it
    knows about tokens comes from a :class:`~megatron_fcp.attention.layout.ShardLayout` (zigzag or
    placement; Note [Shard layouts]); tensors are ``[n, b, h, d]`` (THD runs as ``b = 1``)."""

    def __init__(self, plan: Plan, rank: int, transport: Transport, mask: Mask, scale: float,
                 layout: ShardLayout, stats: FCPStats | None, kernel: BlockKernel, program: BackwardProgram,
                 device: torch.device, q_ready: Callable[[], None] | None = None,
                 dq_ready: Callable[[torch.Tensor], None] | None = None, sink: torch.Tensor | None = None,
                 v_head_dim: int | None = None) -> None:
        if program.plan is not plan.backward_plan:
            raise ValueError("_Executor: the backward program was compiled for another plan")
        self.plan, self.rank, self.transport, self.kernel = plan, rank, transport, kernel
        self.backward_plan = program.plan  # the transfers the backward walks (Note [A backward on another graph])
        self.mask, self.scale, self.layout, self.stats = mask, scale, layout, stats
        self.causal = mask.causal
        self._sees: dict[Block, bool] = {}  # block -> some local query sees some of its keys
        self._forward_calls: dict[int, list[tuple[Block, ...]]] | None = None  # forward_calls()
        self.program = program      # every backward decision (Note [Backward program])
        self.needs = plan.needs(rank)
        self.local_blocks = layout.local_blocks
        self.num_rounds = len(plan.rounds)
        self.q_ready = q_ready      # forward: called once before q is first read
        self.dq_ready = dq_ready    # backward: called once with the final dq
        self.sink = sink            # [h] sink logits, accumulation dtype, or None (Note in attention.sinks)
        self.v_head_dim = v_head_dim  # d_v when it differs from d_qk (MLA); None: the same
        self._last_send: dict[Block, int] = {}  # received block -> last round this rank forwards it
        self.clock: DeviceClock = clock_for(kernel, device)  # Note [No host synchronisation in the steady state]
        for r, rnd in enumerate(plan.rounds):
            for t in rnd:
                if t.src == rank:
                    self._last_send[t.block] = r

    # -- helpers -------------------------------------------------------------------------------
    def _job_end(self) -> None:
        if self.stats is not None:  # a job's compute time is measured to its end
            self.clock.host_wait(self.clock.mark(), "stats")

    # -- what the backward runners use (the BackwardHost protocol of backward_waves) ------------
    def post(self, sends, recvs, *, round_index: int, phase: str):
        """Post one round of this rank's sends and receives (:meth:`~megatron_fcp.attention.comm.Transport.post`)."""
        if sends:  # Note [No host synchronisation in the steady state]
            self.clock.before_send(self.transport)
        try:
            return self.transport.post(sends, recvs, round_index=round_index, phase=phase)
        except CommTimeout as exc:  # a peer already gone: the same words as a failed wait
            raise self._with_plan(exc) from exc

    def post_batch(self, posts):
        """Several rounds at once (:meth:`~megatron_fcp.attention.comm.Transport.post_batch`): one handle each."""
        if any(p.sends for p in posts):
            self.clock.before_send(self.transport)
        try:
            return self.transport.post_batch(posts)
        except CommTimeout as exc:
            raise self._with_plan(exc) from exc

    def _with_plan(self, exc: CommTimeout) -> CommTimeout:
        """``exc`` with what only the executor knows: the plan."""
        return CommTimeout(f"{exc} [plan {self.plan.name!r} over CP ranks {list(self.plan.ranks)}, "
                           f"{self.num_rounds} rounds, on rank {self.rank}]")

    def wait(self, handle) -> float:
        """Wait for a posted round; returns the seconds waited."""
        t0 = time.perf_counter()
        try:
            self.transport.wait(handle)
        except CommTimeout as exc:  # add what only the executor knows: the plan
            raise self._with_plan(exc) from exc
        return time.perf_counter() - t0

    def test(self, handle) -> bool:
        """Whether a posted round is complete, without blocking (:meth:`~megatron_fcp.attention.comm.Transport.test`)."""
        return self.transport.test(handle)

    def kv_shape(self, block: Block, x: torch.Tensor) -> tuple[int, ...]:
        """K and V (or dK and dV) of ``block`` as one tensor, ``x`` the local K [n, b, h_kv, d_qk]:
        [2, block tokens, b, h_kv, d], or [block tokens, b, h_kv, d_qk + d_v] for MLA (Note [KV block
        tensors] in :mod:`megatron_fcp.attention.kv_block`)."""
        d_v = self.v_head_dim if self.v_head_dim is not None else x.shape[3]
        return kv_block_shape(self.layout.block_tokens(block), x.shape[1], x.shape[2], x.shape[3], d_v)

    def _call_args(self, blocks: tuple[Block, ...], cache: dict, prepare) -> tuple[slice | None, torch.Tensor, dict]:
        """For one kernel call on ``blocks`` (Note [One launch per owner and stage] in
        :mod:`megatron_fcp.schedule.launches`): the query rows that may attend them (the union of
        each block's rows; None: all), the keys' positions (the blocks' own, concatenated in
        order) and the kernel's keyword arguments for those rows: per-row-range preparation (built
        once per range, from ``prepare(rows)``), query and key document ids (placement layouts)."""
        lay = self.layout
        rows = [lay.q_rows(b) for b in blocks]
        if any(r is None for r in rows):
            rows = None
        elif len(rows) == 1:
            rows = rows[0]
        else:  # the hull: rows between two blocks' documents see neither (document mask: 0 / -inf)
            rows = slice(min(r.start for r in rows), max(r.stop for r in rows))
        key = None if rows is None else (rows.start, rows.stop)
        if key not in cache:
            cache[key] = prepare(rows)
        kw = dict(cache[key])
        if lay.q_doc is not None:
            kw["q_doc"] = lay.q_doc[rows]
            kw["k_doc"] = _cat([lay.k_doc(b) for b in blocks])
        return rows, _cat([lay.k_pos(b) for b in blocks]), kw

    def _local_span(self, blocks: tuple[Block, ...]) -> slice | None:
        """The local shard's token range of ``blocks`` when they are this rank's own and adjacent in
        order (their K and V are then a view of the shard's), else None."""
        if len(blocks) < 2 or blocks[0].owner != self.rank:
            return None
        sl = [self.layout.local_slice(b) for b in blocks]
        if any(a.stop != b.start for a, b in zip(sl, sl[1:])):
            return None
        return slice(sl[0].start, sl[-1].stop)

    def sees(self, block: Block) -> bool:
        """Whether the block has a visible pair with this rank's query rows (Note [Windowed
        attention in the executor]); a block without one is never computed."""
        if block not in self._sees:
            lay = self.layout
            rows = lay.q_rows(block)
            rows = slice(None) if rows is None else rows
            self._sees[block] = sees_any(lay.q_pos[rows], lay.k_pos(block), self.mask,
                                         None if lay.q_doc is None else lay.q_doc[rows], lay.k_doc(block))
        return self._sees[block]

    # -- forward -------------------------------------------------------------------------------
    def _distribute(self, k: torch.Tensor, v: torch.Tensor, phase: str,
                    on_local: Callable[[dict], None],
                    on_received: Callable[[int, list[tuple[Block, torch.Tensor]]], None],
                    kept: dict | None = None, relay_keep: frozenset | None = None):
        """Run the plan's forward rounds for this rank: post round r+1 before handling round r's
        arrivals (overlap), call ``on_local(local_kv)`` while round 0 is in flight and
        ``on_received(r, [(block, kv), ...])`` with round r's needed blocks in plan order. A
        received block is dropped as soon as it is handled and forwarded (``on_received`` keeps
        what it wants, in ``kept``: still alive after the drop; ``relay_keep``: blocks this rank
        only relays that go into ``kept`` too). Returns (seconds waited, bytes sent, peak bytes of
        received KV alive at once)."""
        lay = self.layout
        have: dict[Block, torch.Tensor] = {}
        for b in self.local_blocks:
            sl = lay.local_slice(b)
            have[b] = pack_kv(k[sl], v[sl])                                     # [2, blk, b, h_kv, d]
        local = set(have)
        wait_s, bytes_sent, alive, peak = 0.0, 0, 0, 0

        def post(r: int):
            nonlocal bytes_sent
            sends = [(t, have[t.block]) for t in self.plan.sends(self.rank, r)]
            recvs = [(t, torch.empty(self.kv_shape(t.block, k), dtype=k.dtype, device=k.device))
                     for t in self.plan.recvs(self.rank, r)]
            bytes_sent += sum(x.numel() * x.element_size() for _, x in sends)
            return self.post(sends, recvs, round_index=r, phase=phase), recvs

        pending = post(0) if self.num_rounds else None
        on_local({b: have[b] for b in self.local_blocks})
        for r in range(self.num_rounds):
            handle, recvs = pending
            wait_s += self.wait(handle)
            for t, buf in recvs:
                have[t.block] = buf
                alive += buf.numel() * buf.element_size()
            peak = max(peak, alive)
            pending = post(r + 1) if r + 1 < self.num_rounds else None
            on_received(r, [(t.block, buf) for t, buf in recvs if t.block in self.needs])
            if relay_keep is not None:
                for t, buf in recvs:
                    if t.block not in self.needs and t.block in relay_keep:
                        kept[t.block] = buf                  # a ring's first sub-round, forwarded in backward
            for t, buf in recvs:  # posted sends keep their buffers alive until waited on
                if self._last_send.get(t.block, -1) <= r + 1 and t.block not in local:
                    del have[t.block]
                    if kept is None or t.block not in kept:
                        alive -= buf.numel() * buf.element_size()
        return wait_s, bytes_sent, peak

    def forward_calls(self) -> dict[int, list[tuple[Block, ...]]]:
        """This rank's forward kernel calls by stage (:data:`~megatron_fcp.schedule.launches.OWN`,
        then round indices): :func:`~megatron_fcp.schedule.launches.forward_launches` over the
        blocks its queries see (Note [One launch per owner and stage])."""
        if self._forward_calls is None:
            calls: dict[int, list[tuple[Block, ...]]] = {}
            for stage, blocks in forward_launches(self.plan, self.rank, self.sees):
                calls.setdefault(stage, []).append(blocks)
            self._forward_calls = calls
        return self._forward_calls

    def forward_saving(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grads: bool):
        """:meth:`forward` keeping what :meth:`backward` needs when ``grads``: under ``keep`` the
        need set; under ``resend`` nothing (None: backward re-sends every block), or for a ring
        whose first sub-round fits the budget that sub-round (Note [Streaming chain backward])."""
        prog = self.program
        keep_first = prog.keep_first(self.rank)
        out, lse, kept = self.forward(q, k, v, keep_blocks=prog.mode == "keep" and grads,
                                      keep_only=keep_first if grads else None)
        return out, lse, kept if prog.mode == "keep" or keep_first is not None else None

    @property
    def backward_kv(self) -> str:
        """The backward KV mode this call runs (``"keep"`` or ``"resend"``: the program's)."""
        return self.program.mode

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep_blocks: bool = True,
                keep_only: frozenset | None = None):
        """Returns (out [n,b,h,d] compute dtype, lse [b,h,n] compute dtype, received blocks kept
        for backward; none when ``keep_blocks`` is False (no input needs a gradient, or the
        backward re-sends KV) except those in ``keep_only`` (a ring's first sub-round))."""
        t_start = time.perf_counter()
        compute_s = 0.0
        lay, hk = self.layout, k.shape[2]
        preps: dict = {}                                                         # per-row-range layouts
        acc = LseAccumulator.empty(*q.shape[:3], v.shape[3], compute_dtype_for(q.dtype), q.device)  # out: d_v
        kept: dict[Block, torch.Tensor] = {}

        def prepare(rows):
            return self.kernel.prepare_forward(q if rows is None else q[rows], hk, self.scale)

        def compute(blocks: tuple[Block, ...], kvs: list[torch.Tensor]) -> None:
            """One kernel call on ``blocks`` (every one seen by some query: the launch rule's
            ``live``), merged into the accumulator."""
            nonlocal compute_s
            t0 = time.perf_counter()
            rows, k_pos, kw = self._call_args(blocks, preps, prepare)
            span = self._local_span(blocks)
            if span is not None:                                                 # own blocks, adjacent: views
                kb, vb = k[span], v[span]
            else:
                kb, vb = _call_kv(kvs, q.shape[-1])                              # [m, b, h_kv, d_qk | d_v]
            if rows is None:
                acc.add(*self.kernel.forward(q, kb, vb, lay.q_pos, k_pos, self.mask, self.scale, **kw))
            else:
                acc.add(*self.kernel.forward(q[rows], kb, vb, lay.q_pos[rows], k_pos,
                                             self.mask, self.scale, **kw), rows=rows)
            self._job_end()
            compute_s += time.perf_counter() - t0

        calls = self.forward_calls()                                             # stage -> calls, in order

        def compute_local(local_kv: dict) -> None:  # round 0 is posted: q may arrive now
            if self.q_ready is not None:
                self.q_ready()
            for blocks in calls.get(OWN, ()):
                compute(blocks, [local_kv[b] for b in blocks])

        def on_received(r: int, got: list[tuple[Block, torch.Tensor]]) -> None:
            kv = dict(got)
            for blocks in calls.get(r, ()):
                compute(blocks, [kv[b] for b in blocks])
            if keep_blocks or keep_only is not None:
                for block, buf in got:
                    if keep_blocks or block in keep_only:
                        kept[block] = buf

        wait_s, bytes_sent, peak = self._distribute(k, v, "forward", compute_local, on_received, kept,
                                                    relay_keep=keep_only)
        out, lse = acc.result()
        if self.sink is not None:  # once, after every block: Note [A sink enters once, after the merge]
            out, lse = apply_sink(out, lse, self.sink)
        if self.stats is not None:
            self.stats.forward_total_s += time.perf_counter() - t_start
            self.stats.forward_compute_s += compute_s
            self.stats.forward_wait_s += wait_s
            self.stats.forward_bytes_sent += bytes_sent
            self.stats.saved_kv_bytes += sum(x.numel() * x.element_size() for x in kept.values())
            self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, peak)
            self.stats.ring_kv_bytes = max(self.stats.ring_kv_bytes, (k.numel() + v.numel()) * k.element_size())
            self.stats.backward_kv = self.backward_kv
        return out, lse, kept

    # -- backward ------------------------------------------------------------------------------
    def sink_grad(self, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor | None:
        """This rank's rows' gradient of the sink logits ``[h]`` (accumulation dtype; None without a
        sink): ``out``/``lse`` are what :meth:`forward` returned (the sink merged in)."""
        if self.sink is None:
            return None
        return sink_grad(dout.to(out.dtype), out, lse, self.sink)

    def backward(self, dout, q, k, v, out, lse, kept: dict[Block, torch.Tensor] | None):
        """Returns dq [n,b,h,d_qk], dk [n,b,h_kv,d_qk], dv [n,b,h_kv,d_v] in q's dtype (see Note [Backward pipeline]).
        ``kept`` None: re-send the KV wave by wave (Note [Backward waves] in backward_waves)."""
        t_start = time.perf_counter()
        compute_s = 0.0
        lay, hk = self.layout, k.shape[2]
        cd = compute_dtype_for(q.dtype)
        doc = dout.to(cd)
        preps: dict = {}                                                         # per-row-range layouts
        dq = torch.zeros(q.shape, dtype=cd, device=q.device)                     # [n, b, h, d]

        def prepare(rows):
            if rows is None:
                return self.kernel.prepare_backward(q, doc, out, hk)
            return self.kernel.prepare_backward(q[rows], doc[rows], out[rows], hk)

        def compute(blocks: tuple[Block, ...], kvs: list[torch.Tensor]) -> list[torch.Tensor]:
            """One kernel call on the blocks its queries see (Note [One launch per owner and
            stage]); adds their dq and returns each block's dK/dV partial [2, blk, b, h_kv, d]
            (MLA: Note [KV block tensors]), zeros for a block no query sees."""
            nonlocal compute_s
            live = [i for i, b in enumerate(blocks) if self.sees(b)]
            parts = [None if i in live else torch.zeros(kv.shape, dtype=cd, device=kv.device)
                     for i, kv in enumerate(kvs)]                                # no visible pair: zero partial
            if not live:
                return parts
            t0 = time.perf_counter()
            call = tuple(blocks[i] for i in live)
            rows, k_pos, kw = self._call_args(call, preps, prepare)
            span = self._local_span(call)
            if span is not None:                                                 # own blocks, adjacent: views
                kb, vb = k[span], v[span]
            else:
                kb, vb = _call_kv([kvs[i] for i in live], q.shape[-1])           # [m, b, h_kv, d_qk | d_v]
            if rows is None:
                dq_b, dk_b, dv_b = self.kernel.backward(
                    doc, q, kb, vb, out, lse, lay.q_pos, k_pos, self.mask, self.scale, **kw)
                dq.add_(dq_b)
            else:
                dq_b, dk_b, dv_b = self.kernel.backward(
                    doc[rows], q[rows], kb, vb, out[rows], lse[:, :, rows], lay.q_pos[rows],
                    k_pos, self.mask, self.scale, **kw)
                dq[rows].add_(dq_b)
            self._job_end()
            compute_s += time.perf_counter() - t0
            a = 0
            for i in live:                                                       # each block's keys of the call
                z = a + kvs[i].shape[-4]
                parts[i] = pack_kv(dk_b[a:z], dv_b[a:z])                         # [2, blk, b, h_kv, d]
                a = z
            return parts

        dq_out: list[torch.Tensor] = []

        def jobs_done() -> None:  # every job has added its dq: hand it on before the last sums arrive
            dq_out.append(dq.to(q.dtype))
            self.dq_ready(dq_out[0])

        done = jobs_done if self.dq_ready is not None else None
        prog = self.program
        if prog.steps is not None:                                  # a ring: Note [Streaming chain backward]
            res = run_backward_chain(self, prog.steps, k, v, kept, compute, cd, wire_dtype=q.dtype,
                                     resend=prog.resend, jobs_done=done)
        else:                                                       # partials travel in q's dtype
            res = run_backward_waves(self, prog.waves, k, v, kept,              # one block per job (call)
                                     lambda b, kv: compute((b,), [kv])[0], cd, wire_dtype=q.dtype,
                                     resend=prog.resend, first_kept=prog.first_kept,
                                     first_fetch=prog.first_fetch, jobs_done=done)
        wait_s, bytes_sent, grads = res["wait_s"], res["bytes_sent"], res["grads"]
        if self.stats is not None:
            saved = sum(x.numel() * x.element_size() for x in (kept or {}).values())
            held = saved + (res["peak"] if prog.resend else 0)
            self.stats.resend_bytes_sent += res["resend_bytes"]
            self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, held)
            self.stats.backward_peak_kv_bytes = max(self.stats.backward_peak_kv_bytes, held)
            self.stats.backward_waves = len(prog.steps if prog.steps is not None else prog.waves)
            self.stats.backward_form = prog.form
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)               # [n, b, h_kv, d_qk]
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)               # [n, b, h_kv, d_v]
        for b in self.local_blocks:
            sl = lay.local_slice(b)
            dk[sl], dv[sl] = split_kv(grads[b], k.shape[-1])
        if self.stats is not None:
            self.stats.backward_total_s += time.perf_counter() - t_start
            self.stats.backward_compute_s += compute_s
            self.stats.backward_wait_s += wait_s
            self.stats.backward_bytes_sent += bytes_sent
        if done is not None and not dq_out:
            raise RuntimeError("FCP backward: the runner never reported its last job (dq_ready not called)")
        return (dq_out[0] if dq_out else dq.to(q.dtype)), dk, dv


class _FCPAttentionFunction(torch.autograd.Function):
    """autograd wrapper: forward/backward delegate to an :class:`_Executor` built per call."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_offset, executor: _Executor):
        # softmax_offset is an input only so that autograd hands its gradient back; the executor
        # holds its values (executor.sink)
        out, lse, kept = executor.forward_saving(q, k, v, any(ctx.needs_input_grad[:4]))
        ctx.executor, ctx.out_acc, ctx.lse, ctx.kept = executor, out, lse, kept
        ctx.offset_dtype = None if softmax_offset is None else softmax_offset.dtype
        ctx.save_for_backward(q, k, v)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v = ctx.saved_tensors
        dsink = None
        if ctx.needs_input_grad[3]:  # out and lse have the sink in them: Note in attention.sinks
            dsink = ctx.executor.sink_grad(dout, ctx.out_acc, ctx.lse).to(ctx.offset_dtype)
        dq, dk, dv = ctx.executor.backward(dout, q, k, v, ctx.out_acc, ctx.lse, ctx.kept)
        ctx.kept = ctx.out_acc = ctx.lse = None
        return dq, dk, dv, dsink, None


def fcp_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group, plan: PlanLike | None = None,
    causal: bool = True, softmax_scale: float | None = None, transport: Transport | None = None,
    stats: FCPStats | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, kernel: KernelLike = "auto",
    placement: Placement | None = None, backward_kv: str = "auto", kv_memory_budget: int = RING_BUDGET,
    agreement: LastAgreed | None = PLAN_AGREEMENT, check_numerics: bool = False,
    q_ready: Callable[[], None] | None = None, dq_ready: Callable[[torch.Tensor], None] | None = None,
    softmax_offset: torch.Tensor | None = None,
    window: "tuple[int, int] | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`fcp_attention` but also returns ``lse`` (FP32, FP64 for FP64 inputs):
    ``[b, h, s_local]`` for zigzag shards, ``[h, t_local]`` over a ``placement`` (THD).

    transport: override the default (gloo / NCCL by the group's backend), e.g. a CountingTransport.
    stats: an :class:`FCPStats` to add this call's times and bytes to (forward now, backward later).
    timeout_s: bound on each round's wait for the default transport, and on the agreement.
    kernel, plan, placement, window: see :func:`fcp_attention`.
    backward_kv: ``"auto"`` (default, as the plugin's: keep while every rank's kept bytes fit
    ``kv_memory_budget``, bytes per rank, default the ring's, else re-send with the first step kept
    where it fits), ``"keep"`` (save received KV for backward: no KV traffic in backward, most
    memory) or ``"resend"`` (re-send it in backward; keep nothing); Note [Backward KV modes] in
    :mod:`megatron_fcp.schedule.program`. Outputs and gradients are bitwise the same.
    agreement: before the first transfer of a plan on a group the CP ranks agree (one bounded
    collective) on the plan, shapes, dtypes, causal, window, scale and kernel; repeated calls with the same
    facts skip it (:class:`~megatron_fcp.attention.agreement.LastAgreed`). ``None``: the caller agreed
    already (the Megatron packed path agrees once per micro-batch). Every rank of the group must
    pass the same kind of ``agreement``.
    check_numerics: raise :class:`FCPNumericsError` if out is not finite or lse has NaN/+inf.
    q_ready: called once in the forward after the first round is posted and before q's values are
    first read, so q may still be arriving when the call starts (the head-parallel stage posts Q's
    all-to-all behind K|V's: Note [Q's all-to-all behind the KV stage] in
    :mod:`megatron_fcp.attention.head_parallel`).
    dq_ready: called once in the backward with q's gradient (q's dtype and shape, the tensor the
    backward then returns) as soon as the last block's job has added to it, before the last dK/dV
    sums are waited for, so dq may leave while they arrive (the head-parallel stage posts dQ's
    all-to-all there: Note [dQ's all-to-all ahead of dK|dV's] in
    :mod:`megatron_fcp.attention.head_parallel`).
    softmax_offset: attention sinks, see :func:`fcp_attention`; the returned lse includes the sink.
    """
    executor = build_executor(q, k, v, cp_group=cp_group, plan=plan, causal=causal, softmax_scale=softmax_scale,
                              transport=transport, stats=stats, timeout_s=timeout_s, kernel=kernel,
                              placement=placement, backward_kv=backward_kv, kv_memory_budget=kv_memory_budget,
                              agreement=agreement, q_ready=q_ready, dq_ready=dq_ready, softmax_offset=softmax_offset,
                              window=window)
    if placement is None:
        out, lse = _FCPAttentionFunction.apply(q, k, v, softmax_offset, executor)
    else:
        out, lse = _FCPAttentionFunction.apply(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), softmax_offset,
                                               executor)                     # b = 1
        out, lse = out.squeeze(1), lse.squeeze(0)                           # [t, h, d], [h, t]
    if check_numerics:
        check_finite(out, lse, f"FCP attention forward on rank {executor.rank} (plan {executor.plan.name!r})")
    return out, lse


def build_executor(q, k, v, *, cp_group, plan=None, causal=True, softmax_scale=None, transport=None, stats=None,
                   timeout_s=DEFAULT_TIMEOUT_S, kernel="math", placement=None, backward_kv="auto",
                   kv_memory_budget=RING_BUDGET, agreement=PLAN_AGREEMENT, q_ready=None,
                   dq_ready=None, softmax_offset=None, window=None) -> _Executor:
    """What one :func:`fcp_attention_with_lse` call runs (same arguments): validate, agree, pick the
    transport, compile the backward program (Note [Backward program] in
    :mod:`megatron_fcp.schedule.program`) and return the plan executor, complete. The in-process
    harness (:mod:`megatron_fcp.testing.harness`) drives it directly instead of through autograd."""
    policy = BackwardPolicy(backward_kv, kv_memory_budget)          # bad values fail before any communication
    plan_obj, rank, scale, kernel_obj, mask = _validate(q, k, v, cp_group, plan, causal, softmax_scale, kernel,
                                                        placement, softmax_offset, window)
    if agreement is not None:
        thd = placement is not None
        agreement.ensure({
            "shape": (tuple(q.shape[1:] if thd else q.shape), tuple(k.shape[1:] if thd else k.shape),
                      v.shape[-1]),
            "dtype": str(q.dtype),
            "causal": causal, "window": mask.window, "softmax_scale": scale, "kernel": kernel_obj.name,
            "sink": softmax_offset is not None,                      # that a sink is used, not its values
            "placement": None if placement is None else placement.blocks,
            "plan": (plan_obj.name, plan_obj.ranks, plan_obj.parts_per_chunk, plan_obj.rounds),
            "backward_plan": None if plan_obj.backward is None else (plan_obj.backward.name, plan_obj.backward.rounds),
        }, cp_group, what="fcp_attention", timeout_s=timeout_s)
    if transport is None:
        transport = default_transport(cp_group, timeout_s)
    if placement is None:
        layout: ShardLayout = ZigzagLayout(plan_obj.ranks, rank, q.shape[0], plan_obj.parts_per_chunk, causal)
    else:
        layout = PlacementLayout(placement, plan_obj.ranks, rank)
    batch = 1 if placement is not None else k.shape[1]
    token_bytes = batch * kv_token_elems(k.shape[-2], k.shape[-1], v.shape[-1]) * k.element_size()  # K and V
    program = compile_backward(plan_obj, token_bytes, policy,
                               seq_len=None if placement is not None else q.shape[0] * plan_obj.cp)
    return _Executor(plan_obj, rank, transport, mask, scale, layout, stats, kernel_obj, program, q.device,
                     q_ready=q_ready, dq_ready=dq_ready, sink=sink_logits(softmax_offset, compute_dtype_for(q.dtype)),
                     v_head_dim=v.shape[-1] if v.shape[-1] != k.shape[-1] else None)


def fcp_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group, plan: PlanLike | None = None,
    causal: bool = True, softmax_scale: float | None = None, kernel: KernelLike = "auto",
    placement: Placement | None = None, softmax_offset: torch.Tensor | None = None,
    window: "tuple[int, int] | None" = None,
) -> torch.Tensor:
    """Exact attention over the whole CP group's sequence (or packed batch), for this rank's shard.

    Zigzag (``placement=None``): q [s_local, b, h, d]; k, v [s_local, b, h_kv, d] (h % h_kv == 0),
    Megatron's zigzag layout (``get_batch_on_this_cp_rank``); all ranks pass the same shapes.
    MLA: v may have its own head size, v [s_local, b, h_kv, d_v] (q and k keep ``d``); out then
    has ``d_v``, and KV blocks travel without padding (Note [KV block tensors] in
    :mod:`megatron_fcp.attention.kv_block`).
    plan: ``"ring"`` (Transformer Engine's p2p ring; also what None means), ``"full"`` (each block
    straight to its readers), or a :class:`~megatron_fcp.planning.Plan` over
    ``dist.get_process_group_ranks(cp_group)`` with the same ``causal``.

    Packed batch (THD): ``placement`` a :class:`~megatron_fcp.planning.Placement` with one entry
    per CP rank (``place_packed(doc_lengths, cp, causal=causal)``); q [t_local, h, d], k, v
    [t_local, h_kv, d] with ``t_local = placement.tokens(cp_index)`` (``placement.shard(x,
    cp_index)``, 0 allowed); attention stays inside each document (causal by position in the
    document). plan: None or ``"full"`` (direct rounds, ``full_plan(ranks, causal,
    placement=placement)``) or a Plan over this placement (``build_plan(..., placement=)``).

    window: a sliding window ``(left, right)`` in Megatron's convention (``--window-size``; query
    ``i`` sees keys ``i - left .. i + right`` inclusive, -1 unbounded, ``right`` is 0 under
    ``causal``; over a placement, positions inside each document); None: no window. A plan for
    the window's mask, or for the unwindowed mask (``"ring"``, ``"full"``: they deliver more), is
    exact: blocks outside every local window are received (if the plan sends them) but not
    computed (Note [Windowed attention in the executor]).
    softmax_scale defaults to ``1/sqrt(d)`` (``d`` of q and k). kernel: the block kernel: ``"auto"`` (default: the
    best that runs here, :mod:`megatron_fcp.attention.dispatch`), ``"math"`` (pure torch, any dtype
    incl. FP64), ``"cpu-flash"``, ``"cuda-flash"``, ``"flash-attn"`` (fused ops) or a
    ``BlockKernel`` instance (with ``documents = True`` for a placement). Returns out shaped like
    q (with v's head size), in q's dtype; differentiable in q, k, v. Raises ValueError (naming the fix) before any
    communication on bad input.

    softmax_offset: attention sinks (Megatron's ``softmax_type`` ``"off-by-one"``/``"learnable"``):
    a finite float tensor ``[h]`` on q's device, one logit per query head of this call, that joins
    every row's softmax denominator unscaled (:mod:`megatron_fcp.attention.sinks`); any float
    dtype, differentiable (its gradient is this rank's rows' share: Note [The sink's gradient
    across ranks]). None: plain softmax.
    """
    out, _ = fcp_attention_with_lse(q, k, v, cp_group=cp_group, plan=plan, causal=causal,
                                    softmax_scale=softmax_scale, kernel=kernel, placement=placement,
                                    softmax_offset=softmax_offset, window=window)
    return out
