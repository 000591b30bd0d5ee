"""The attention engine: shard layouts (zigzag, placements), block kernels, LSE merge and the
plan-executing autograd function. ``fcp_attention`` is the public entry point (also exported as
``megatron_fcp.fcp_attention``); submodules are imported on first use so that importing the
package stays cheap.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "fcp_attention": "megatron_fcp.attention.function",
    "fcp_attention_with_lse": "megatron_fcp.attention.function",
    "fcp_head_parallel_attention": "megatron_fcp.attention.head_parallel",
    "fcp_head_parallel_attention_with_lse": "megatron_fcp.attention.head_parallel",
    "create_head_parallel_groups": "megatron_fcp.attention.head_parallel",
    "FCPStats": "megatron_fcp.attention.stats",
    "block_attention_forward": "megatron_fcp.attention.kernels",
    "block_attention_backward": "megatron_fcp.attention.kernels",
    "reference_attention": "megatron_fcp.attention.kernels",
    "BlockKernel": "megatron_fcp.attention.kernels",
    "BLOCK_KERNELS": "megatron_fcp.attention.dispatch",
    "resolve_kernel": "megatron_fcp.attention.dispatch",
    "merge_two": "megatron_fcp.attention.merge",
    "LseAccumulator": "megatron_fcp.attention.merge",
    "zigzag_split": "megatron_fcp.attention.layout",
    "zigzag_unsplit": "megatron_fcp.attention.layout",
    "zigzag_positions": "megatron_fcp.attention.layout",
    "block_positions": "megatron_fcp.attention.layout",
    "ZigzagLayout": "megatron_fcp.attention.layout",
    "PlacementLayout": "megatron_fcp.attention.layout",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'megatron_fcp.attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
