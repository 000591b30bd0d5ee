"""Cases of tests/test_backward_kv.py: keep, resend and auto on the same inputs (cp = 4).

:func:`worker` runs :data:`GLOO_CASES` through autograd on a gloo group (inside the shared gloo
world, tests/_gloo_world.py) and measures the received KV the autograd graph holds;
test_backward_kv.py runs every case in the in-process harness with :func:`case_setup`.
"""

from __future__ import annotations

import zlib

import torch

TOPO = "examples/configs/topology_2x2.yaml"
CASES = [("ring", "fp64"), ("ring", "fp32"), ("ring", "bf16"), ("hier", "fp64"), ("hier", "fp32"),
         ("full", "bf16"), ("hier", "bf16"), ("packed", "fp32"), ("packed", "bf16"), ("packed-partial", "fp64")]
GLOO_CASES = [("hier", "fp32"), ("packed", "fp32"), ("packed-partial", "fp64")]
MODES = ("keep", "resend", "auto")


def _held_received_kv(out) -> int:
    """Bytes of received KV the autograd graph holds for this call (the Function's saved state)."""
    node = out.grad_fn
    while not hasattr(node, "kept"):  # THD outputs are views (squeeze) of the Function's output
        node = node.next_functions[0][0]
    kept = node.kept
    return 0 if kept is None else sum(t.numel() * t.element_size() for t in kept.values())


def case_setup(name: str, dt: str):
    """Global q, k, v, dout (FP64), the placement (packed) or None, and the plan argument (cp = 4)."""
    import os

    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.planner.build import build_plan
    from megatron_fcp.topology import load_topology

    topo = load_topology(os.path.join(os.path.dirname(os.path.dirname(__file__)), TOPO))
    g = torch.Generator().manual_seed(zlib.crc32((name + dt).encode()))  # the same in every process
    if name.startswith("packed"):
        # packed-partial: under auto rank 3 keeps its part of the first wave, ranks 0-2's are re-sent
        # (ranks 1-2 kept theirs too while a wave held half a shard, before 2026-12-03)
        # (a relay sends on what it kept: test_auto_keeps_the_first_wave_rank_by_rank)
        placement = place_packed([5, 40, 3, 17, 1, 30], 4, block_tokens=8) if name == "packed" else \
            place_packed([33, 5, 5], 4, block_tokens=4)
        t = placement.total_tokens
        full = [torch.randn(t, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]
        return full, placement, build_plan(topo, range(4), "hierarchical", placement=placement)
    full = [torch.randn(64, 2, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4)]
    plan = {"ring": "ring", "full": "full"}.get(name) or build_plan(topo, range(4), "hierarchical", parts_per_chunk=2)
    return full, None, plan


_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.layout import zigzag_split
    from megatron_fcp.attention.stats import FCPStats

    group = dist.new_group(list(range(world)))
    out: dict = {}
    for name, dt in GLOO_CASES:
        full, placement, plan = case_setup(name, dt)
        shard = (lambda x: placement.shard(x, rank)) if placement is not None else (lambda x: zigzag_split(x, 4, rank))
        q, k, v, do = (shard(x).to(_DTYPES[dt]) for x in full)
        res = {}
        for mode in MODES:
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            stats = FCPStats()
            o, lse = fcp_attention_with_lse(qq, kk, vv, cp_group=group, plan=plan, causal=True, stats=stats,
                                            placement=placement, backward_kv=mode)
            held = _held_received_kv(o)
            o.backward(do)
            res[mode] = {"out": o.detach(), "lse": lse, "dq": qq.grad, "dk": kk.grad, "dv": vv.grad,
                         "held": held, "stats": stats.as_dict(),
                         "local_kv": 2 * k.numel() * k.element_size()}
        out[f"{name}-{dt}"] = res
    return out
