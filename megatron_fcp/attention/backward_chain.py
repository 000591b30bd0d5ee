"""The executor's streaming backward for chain plans (the ring): Note [Streaming chain backward]
in :mod:`megatron_fcp.schedule.chains` has the algorithm and its steps; this module runs them.

Per step every rank posts one round (the step's KV hops under ``resend``, then the accumulated
partials, then the chains' sums going home, each list in the schedule's order, so the i-th
message between a pair matches on both ends), computes its jobs of the step, then waits for the
round. A received KV block is freed once computed and forwarded; a partial once sent. Held KV is
counted from the receive buffer's allocation at the post: at most two steps' blocks (computing,
arriving), two shards for a ring -- what Transformer Engine's ring backward allocates.

Kernel calls: a step's jobs of one owner on this rank are one call (Note [One launch per owner and
stage] in :mod:`megatron_fcp.schedule.launches`), as the chain's cost model prices them.

Determinism: dq sums the calls in step order; a relay's ``acc_i = p_i + acc_(i-1)`` is one FP32
addition (the same whichever term is there first); the owner adds its own partial, then the
chain's sum. Neither depends on timing, and ``keep`` (KV from the forward) walks the same steps
as ``resend``, so the two agree bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_fcp.attention.backward_waves import BackwardHost
from megatron_fcp.attention.kv_block import pack_kv
from megatron_fcp.contract.blocks import Block
from megatron_fcp.schedule.chains import ChainStep
from megatron_fcp.schedule.launches import group_blocks

__all__ = ["run_backward_chain"]


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def run_backward_chain(ex: BackwardHost, steps: tuple[ChainStep, ...], k: torch.Tensor, v: torch.Tensor,
                       kept: dict[Block, torch.Tensor] | None,
                       compute: Callable[[tuple[Block, ...], list[torch.Tensor]], list[torch.Tensor]],
                       grad_dtype: torch.dtype,
                       wire_dtype: torch.dtype | None = None, resend: bool | None = None,
                       jobs_done: Callable[[], None] | None = None) -> dict:
    """Backward over ``steps`` (same contract as
    :func:`~megatron_fcp.attention.backward_waves.run_backward_waves`, but a call per group):
    ``compute(blocks, kvs)`` runs one kernel call on a step's blocks of one owner (Note [One
    launch per owner and stage] in :mod:`megatron_fcp.schedule.launches`), adds their dq and
    returns each block's dK/dV partial ``[2, blk, b, h_kv, d]`` in ``grad_dtype``;
    partials travel in ``wire_dtype`` (default ``grad_dtype``) and accumulate in ``grad_dtype``.
    ``kept``: the blocks the forward saved (all it needs under ``keep``; under ``resend`` with the
    first sub-round kept, that sub-round's; None: none). ``resend`` (default: ``kept is None``):
    the steps' KV messages run. ``jobs_done``: called once, right after this rank's last job (before
    that step's round is waited: dq is final then). Returns ``grads`` (local blocks' dK/dV), ``wait_s``,
    ``bytes_sent`` (partials), ``resend_bytes`` and ``peak`` (KV received in backward alive at once)."""
    rank, lay = ex.rank, ex.layout
    wire = grad_dtype if wire_dtype is None else wire_dtype
    resend = kept is None if resend is None else resend
    kept = kept or {}
    local = set(ex.local_blocks)
    own: dict[Block, torch.Tensor] = {}                 # my partial of my own blocks
    acc: dict[Block, torch.Tensor] = {}                 # a chain's running sum, held until sent on
    home: dict[Block, torch.Tensor] = {}                # a chain's sum, back at its owner
    have: dict[Block, torch.Tensor] = {}                # received KV (resend)
    uses: dict[Block, int] = {}                         # reasons to keep a received block: compute, forward
    out = {"wait_s": 0.0, "bytes_sent": 0, "resend_bytes": 0}
    alive = peak = 0
    for st in steps:
        for t in st.kv:
            if resend and t.src == rank and t.block.owner != rank and t.block not in kept:
                uses[t.block] = uses.get(t.block, 0) + 1
        for b, x in st.computes:
            if resend and x == rank and b not in local and b not in kept:
                uses[b] = uses.get(b, 0) + 1

    def kv_of(b: Block) -> torch.Tensor:
        return kept[b] if b in kept else have[b]

    def stack(b: Block) -> torch.Tensor:
        sl = lay.local_slice(b)
        return pack_kv(k[sl], v[sl])                                            # [2, blk, b, h_kv, d]

    def used(b: Block) -> None:
        nonlocal alive
        uses[b] -= 1
        if not uses[b]:
            alive -= _nbytes(have.pop(b))

    def add(g: dict, b: Block, x: torch.Tensor) -> None:
        g[b] = x.to(grad_dtype) if b not in g else g[b].add_(x)

    def empty(b: Block, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(ex.kv_shape(b, k), dtype=dtype, device=k.device)

    last_job = max((s for s, st in enumerate(steps) for _, x in st.computes if x == rank), default=-1)
    if last_job < 0 and jobs_done is not None:
        jobs_done()
    for s, st in enumerate(steps):
        sends, recvs, forwarded = [], [], []
        if resend:
            for t in st.kv:
                if t.src == rank:
                    sends.append((t, stack(t.block) if t.block.owner == rank else kv_of(t.block)))
                    out["resend_bytes"] += _nbytes(sends[-1][1])
                    if t.block.owner != rank and t.block not in kept:
                        forwarded.append(t.block)
                elif t.dst == rank:                     # counted from allocation: TE's ring holds two such buffers
                    recvs.append(("kv", t, empty(t.block, k.dtype)))
                    alive += _nbytes(recvs[-1][2])
                    peak = max(peak, alive)
        for kind, lst in (("grad", st.grad), ("home", st.home)):
            for t in lst:
                if t.src == rank:
                    x = acc.pop(t.block).to(wire)
                    out["bytes_sent"] += _nbytes(x)
                    sends.append((t, x))
                elif t.dst == rank:
                    recvs.append((kind, t, empty(t.block, wire)))
        handle = ex.post(sends, [(t, buf) for _, t, buf in recvs], round_index=s, phase="backward")
        for b in forwarded:
            used(b)
        for _, blocks in group_blocks([(s, b) for b, x in st.computes if x == rank], rank):  # one call each
            parts = compute(blocks, [stack(b) if b in local else kv_of(b) for b in blocks])
            for b, part in zip(blocks, parts):
                if b in local:
                    add(own, b, part)
                else:
                    add(acc, b, part)
                    if resend and b not in kept:
                        used(b)
        if s == last_job and jobs_done is not None:
            jobs_done()
        out["wait_s"] += ex.wait(handle)
        for kind, t, buf in recvs:
            if kind == "kv":
                have[t.block] = buf
            elif kind == "grad":
                add(acc, t.block, buf)
            else:
                home[t.block] = buf
    grads: dict[Block, torch.Tensor] = {}
    for b in ex.local_blocks:
        if b in own:
            add(grads, b, own[b])
        if b in home:
            add(grads, b, home[b])
    out["grads"] = grads
    out["peak"] = peak
    return out
