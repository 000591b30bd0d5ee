"""How one KV block (or its dK/dV partial) travels: K and V of the block's tokens in one tensor.

Note [KV block tensors]
-----------------------
A block is sent, received, kept and reduced as *one* tensor, so one transfer moves it. Its form
depends only on the two head sizes, ``d_k`` (queries and keys) and ``d_v`` (values):

=====================  ==========================================  ===========================
head sizes             tensor                                      K, V (views)
=====================  ==========================================  ===========================
``d_k == d_v``         ``[2, blk, b, h_kv, d]`` (K and V stacked)  ``x[0]``, ``x[1]``
``d_k != d_v`` (MLA)   ``[blk, b, h_kv, d_k + d_v]`` (side by      ``x[..., :d_k]``,
                       side on the head dim)                       ``x[..., d_k:]``
=====================  ==========================================  ===========================

Both carry exactly ``blk * b * h_kv * (d_k + d_v)`` elements: the wire never carries padding
(DeepSeek-V3's ``d_k = 192, d_v = 128`` moves 320 values per KV head and token, not 384). The
stacked form is kept for equal sizes so that path is unchanged bit for bit; the side-by-side
views keep a contiguous last dim (the fused ops' requirement), with a row stride of ``d_k + d_v``.
A dK/dV partial has the same form and shape as the block it belongs to. The two forms differ in
rank (5 against 4 dims), so :func:`split_kv` needs no flag.
"""

from __future__ import annotations

import torch

__all__ = ["pack_kv", "split_kv", "kv_block_shape", "kv_token_elems"]


def kv_block_shape(tokens: int, batch: int, h_kv: int, d_k: int, d_v: int) -> tuple[int, ...]:
    """Shape of the tensor a block of ``tokens`` keys travels in (Note [KV block tensors])."""
    if d_k == d_v:
        return (2, tokens, batch, h_kv, d_k)
    return (tokens, batch, h_kv, d_k + d_v)


def kv_token_elems(h_kv: int, d_k: int, d_v: int) -> int:
    """Elements of one token's K and V (per sequence of the batch): ``h_kv * (d_k + d_v)``."""
    return h_kv * (d_k + d_v)


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k [blk, b, h_kv, d_k], v [blk, b, h_kv, d_v] -> one block tensor (a new tensor)."""
    if k.shape[-1] == v.shape[-1]:
        return torch.stack([k, v])                                         # [2, blk, b, h_kv, d]
    return torch.cat([k, v], dim=-1)                                       # [blk, b, h_kv, d_k + d_v]


def split_kv(x: torch.Tensor, d_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block tensor -> (K [blk, b, h_kv, d_k], V [blk, b, h_kv, d_v]) as views."""
    if x.dim() == 5:
        return x[0], x[1]
    return x[..., :d_k], x[..., d_k:]
