"""Megatron's attention sinks (``TransformerConfig.softmax_type``) as FCP's core attention holds them.

megatron-core 0.15+ (0.14 has no ``softmax_type``: every layer is ``vanilla``) gives its core
attention a ``softmax_offset`` (read from ``megatron/core/transformer/dot_product_attention.py``
and ``extensions/transformer_engine.py`` of 0.16.1, the same through 0.19.2):

  ============  =============================================================================
  vanilla       ``softmax_offset = None``
  off-by-one    a plain tensor (not a parameter, not in the state dict): zeros
                ``[num_attention_heads / tp]`` in ``params_dtype``
  learnable     ``register_parameter("softmax_offset", Parameter(empty([heads / tp],
                params_dtype)))``, then ``config.init_method(...)`` when
                ``config.perform_initialization``; no TP attributes; ``sharded_state_dict``
                shards it over TP along dim 0 (``{'softmax_offset': 0}``)
  ============  =============================================================================

Transformer Engine's ``DotProductAttention`` (TE >= 2.8, wrapped by ``TEDotProductAttention``)
registers a parameter of the same name and shape, so FCP's module keeps one name,
``...core_attention.softmax_offset``, and one shape for every spec: checkpoints load across the
local spec, the TE spec and FCP (TE creates its parameter in FP32 where the local spec uses
``params_dtype``; a load casts). The gradient needs nothing of FCP's own: Note [The sink's
gradient across ranks] in :mod:`megatron_fcp.attention.sinks`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from megatron_fcp.contract.mask import Mask

__all__ = ["SOFTMAX_TYPES", "softmax_type_of", "make_softmax_offset", "softmax_offset_sharded_state_dict",
           "dense_sink_attention"]

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def softmax_type_of(config: Any) -> str:
    """The config's ``softmax_type`` (``"vanilla"`` where the release has none)."""
    return getattr(config, "softmax_type", "vanilla") or "vanilla"


def _device() -> torch.device:
    """Where megatron-core puts it (``torch.cuda.current_device()``), the CPU without CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def make_softmax_offset(module: torch.nn.Module, config: Any, heads_per_partition: int,
                        device: torch.device | None = None) -> None:
    """Give ``module`` its ``softmax_offset`` exactly as megatron-core's ``DotProductAttention``
    does (table above): None, zeros, or a registered parameter initialised by ``config.init_method``
    (the same draw at the same point of construction, so the same seed gives the same value)."""
    kind = softmax_type_of(config)
    device = device if device is not None else _device()
    dtype = getattr(config, "params_dtype", torch.float32)
    if kind == "vanilla":
        module.softmax_offset = None
    elif kind == "off-by-one":
        module.softmax_offset = torch.zeros(heads_per_partition, device=device, dtype=dtype)
    elif kind == "learnable":
        module.register_parameter("softmax_offset", torch.nn.Parameter(
            torch.empty(heads_per_partition, device=device, dtype=dtype)))
        if getattr(config, "perform_initialization", False):
            module.softmax_offset = config.init_method(module.softmax_offset)
    else:
        raise ValueError(f"softmax_type={kind!r} is not one of {list(SOFTMAX_TYPES)}")


def softmax_offset_sharded_state_dict(module: torch.nn.Module, prefix: str, sharded_offsets: Any,
                                      metadata: dict | None, tp_group: Any) -> Any:
    """``module``'s sharded state dict as megatron-core's ``DotProductAttention`` makes it: a
    learnable offset sharded over TP along dim 0; every other entry (none, unless a fallback
    module holds state) replicated, as ``sharded_state_dict_default`` treats a module without
    this method."""
    import inspect  # noqa: PLC0415

    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint  # noqa: PLC0415

    state = module.state_dict(prefix="", keep_vars=True)
    axis = {"softmax_offset": 0} if isinstance(getattr(module, "softmax_offset", None), torch.nn.Parameter) else {}
    params = inspect.signature(make_sharded_tensors_for_checkpoint).parameters
    kwargs = {}
    if "tp_group" in params:
        kwargs["tp_group"] = tp_group
    if "dp_cp_group" in params:
        kwargs["dp_cp_group"] = (metadata or {}).get("dp_cp_group")
    return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets, **kwargs)


def dense_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_offset: torch.Tensor, *,
                         causal: bool, scale: float, window: tuple[int, int] | None = None) -> torch.Tensor:
    """Single-rank attention with a sink, as megatron-core's ``SoftmaxOne`` computes it: the
    unscaled sink logit as one more column of the scaled scores, softmax in FP32 (FP64 for FP64),
    the column dropped. q ``[s, b, h, d]``, k/v ``[s, b, h_kv, d]``, offset ``[h]`` -> ``[s, b, h, d]``
    in q's dtype (FCP's cp = 1 path; with CP the engine merges the sink: attention.sinks). ``window``:
    a sliding window by :class:`~megatron_fcp.contract.mask.Mask`'s rule."""
    s, b, h, _ = q.shape
    group = h // k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kr = k.repeat_interleave(group, dim=2).permute(1, 2, 3, 0).to(acc)          # [b, h, d, s]
    vr = v.repeat_interleave(group, dim=2).permute(1, 2, 0, 3).to(acc)          # [b, h, s, d]
    scores = torch.matmul(q.permute(1, 2, 0, 3).to(acc), kr) * scale            # [b, h, s, s]
    if window is not None:
        pos = np.arange(s)
        visible = torch.from_numpy(Mask.of(causal, window).visible(pos[:, None], pos[None, :])).to(q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    elif causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    column = softmax_offset.to(acc).view(1, h, 1, 1).expand(b, h, s, 1)         # not scaled
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, vr).permute(2, 0, 1, 3).to(q.dtype)              # [s, b, h, d]
