"""The plan's forward transfers alone, timed: the "communication only" number beside compute."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_fcp.attention.comm import Transport, default_transport
from megatron_fcp.contract.blocks import blocks_of
from megatron_fcp.contract.plan import Plan

__all__ = ["measure_comm_only"]


def measure_comm_only(
    plan: Plan, cp_group, kv_block_shape: tuple[int, ...], dtype: torch.dtype,
    device: torch.device | str = "cpu", transport: Transport | None = None,
) -> float:
    """Seconds to run the plan's forward transfers with no compute (this rank's view).

    kv_block_shape: ``(2, blk, b, h_kv, d)``. Rounds run back to back: post k, wait k, post k+1.
    """
    rank = dist.get_rank()
    if transport is None:
        transport = default_transport(cp_group)
    have = {b: torch.zeros(kv_block_shape, dtype=dtype, device=device)
            for b in blocks_of(rank, plan.parts_per_chunk)}
    t0 = time.perf_counter()
    for r in range(len(plan.rounds)):
        recvs = [(t, torch.empty(kv_block_shape, dtype=dtype, device=device)) for t in plan.recvs(rank, r)]
        sends = [(t, have[t.block]) for t in plan.sends(rank, r)]
        transport.wait(transport.post(sends, recvs, round_index=r, phase="comm-only"))
        have.update((t.block, buf) for t, buf in recvs)
    return time.perf_counter() - t0
