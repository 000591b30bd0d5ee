"""Attention sinks: one logit per head in every query row's softmax denominator.

Megatron's ``softmax_type`` (megatron-core 0.15+, ``TransformerConfig``) ``"off-by-one"`` and
``"learnable"`` give each attention head ``h`` a logit ``sink_h`` (``softmax_offset``, shape
``[heads of this call]``: zeros for off-by-one, a parameter for learnable) that joins every row's
softmax as one more key with no value (megatron-core's ``SoftmaxOne`` concatenates it to the
*scaled* scores, so the softmax scale does not apply to it)::

    p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))          s_ij = scale * q_i . k_j
    out_i = sum_j p_ij v_j

Note [A sink enters once, after the merge]
------------------------------------------
FCP's blocks merge into ``(out, lse)`` over the real keys (:mod:`megatron_fcp.attention.merge`);
the sink is one more disjoint "block" with ``lse = sink_h`` and ``out = 0``, merged once, after
all of them::

    lse_t = logaddexp(lse, sink_h)
    out_t = out * exp(lse - lse_t)            # = out * sigmoid(lse - sink_h); 0 where lse = -inf

It must enter exactly once per row: not per block, not per rank's partial. The executor applies it
to its merged result (:func:`apply_sink`); the head-parallel stage applies it on the rank that
holds the head after the all-to-all (each rank holds each of its heads' rows once).

Backward. With ``lse_t`` and ``out_t`` saved in place of ``lse`` and ``out``, the existing block
backward is already exact: it recomputes ``p_ij = exp(s_ij - lse_t)`` (the sink-normalised
probabilities) and ``ds_ij = p_ij (dp_ij - delta_i)`` with ``delta_i = dout_i . out_t_i``, which
is the softmax Jacobian over the real keys *and* the sink (the sink's value is 0, so its
``dp`` is 0 and ``delta_i = sum_j p_ij dp_ij`` over the real keys alone). The sink's gradient::

    d out_t_i / d sink_h = -out_t_i * exp(sink_h - lse_t_i)        (only Z_i depends on sink_h)
    dsink_h = sum_i dout_i . d out_t_i / d sink_h = -sum_i exp(sink_h - lse_t_i) * delta_i

summed over this call's rows of head ``h`` (all batch entries): :func:`sink_grad`. ``lse`` is not
differentiable (as everywhere in FCP), so nothing flows through it.

Note [The sink's gradient across ranks]
---------------------------------------
Each CP rank returns only its own rows' contribution to ``dsink``; the full gradient is the sum
over the CP ranks (and over data-parallel replicas). That is exactly the reduction every other
non-sharded parameter gets: megatron-core's DDP reduces each parameter's gradient over
``get_data_parallel_group(with_context_parallel=True)`` (its grad buffers are built over the
data-parallel x context-parallel group), and the CPU example sums over the same group. So FCP adds
no collective of its own: an extra all-reduce over CP would count each row ``cp`` times. Under
tensor parallelism each TP rank holds ``heads / tp`` heads and all of their rows (the attention
runs after the sequence-parallel gather), so no TP reduction is needed either, as megatron-core
sets none on ``softmax_offset``.
"""

from __future__ import annotations

import torch

__all__ = ["check_softmax_offset", "sink_logits", "apply_sink", "sink_grad"]


def check_softmax_offset(softmax_offset, heads: int, device: torch.device, *, what: str = "q") -> None:
    """Raise ValueError (before any communication) unless ``softmax_offset`` is None or a finite
    floating tensor of shape ``[heads]`` on ``device`` (``heads``: the query heads of ``what``)."""
    if softmax_offset is None:
        return
    if not isinstance(softmax_offset, torch.Tensor) or not softmax_offset.is_floating_point():
        raise ValueError(f"softmax_offset must be a floating-point tensor of shape [{heads}] (one sink logit per "
                         f"query head), got {type(softmax_offset).__name__}"
                         f"{'' if not isinstance(softmax_offset, torch.Tensor) else ' ' + str(softmax_offset.dtype)}")
    if tuple(softmax_offset.shape) != (heads,):
        raise ValueError(f"softmax_offset has shape {tuple(softmax_offset.shape)} but {what} has {heads} query heads; "
                         f"pass one sink logit per query head of this call, shape [{heads}] (under tensor "
                         f"parallelism: this rank's heads)")
    if softmax_offset.device != device:
        raise ValueError(f"softmax_offset is on {softmax_offset.device} but q is on {device}; move it to q's device")
    if not bool(torch.isfinite(softmax_offset.detach()).all()):
        raise ValueError("softmax_offset has non-finite values; a sink logit must be finite (check the "
                         "parameter's initialisation and the optimizer step)")


def sink_logits(softmax_offset: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The sink logits ``[h]`` detached, in the accumulation ``dtype`` (FP32, FP64 for FP64 inputs)."""
    return None if softmax_offset is None else softmax_offset.detach().to(dtype)


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_t, lse_t)``: the merged result over the real keys with the sink merged in once.

    out ``[n, b, h, d]``, lse ``[b, h, n]`` (accumulation dtype), sink ``[h]`` (same dtype)."""
    lse_t = torch.logaddexp(lse, sink.view(1, -1, 1))                     # [b, h, n]; = sink where lse = -inf
    w = torch.exp(lse - lse_t)                                            # [b, h, n], in [0, 1]
    return out * w.permute(2, 0, 1).unsqueeze(-1), lse_t                  # [n, b, h, d], [b, h, n]


def sink_grad(dout: torch.Tensor, out_t: torch.Tensor, lse_t: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``dsink [h]`` of this call's rows: ``-sum_{b, n} exp(sink_h - lse_t) * (dout . out_t)``.

    dout, out_t ``[n, b, h, d]``; lse_t ``[b, h, n]``; sink ``[h]``; all in the accumulation dtype."""
    delta = (dout * out_t).sum(dim=-1).permute(1, 2, 0)                   # [b, h, n]
    p_sink = torch.exp(sink.view(1, -1, 1) - lse_t)                       # [b, h, n]
    return -(p_sink * delta).sum(dim=(0, 2))                              # [h]
