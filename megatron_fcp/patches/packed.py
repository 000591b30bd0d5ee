"""Packed (THD) batches in Megatron with FCP: the data path, RoPE and the attention call.

Note [How a packed batch reaches FCP]
-------------------------------------
Megatron describes a packed micro-batch by ``PackedSeqParams(qkv_format="thd", cu_seqlens_q,
cu_seqlens_kv, max_seqlen_q, ...)``; with CP, Transformer Engine cuts *every* document into
``2*cp`` pieces. FCP instead places the batch (:func:`~megatron_fcp.planning.place_packed`): short
documents stay whole on one rank and need no communication at all. So the tokens must be laid out
by the placement before the model runs, and everything that depends on a token's place must follow:

* **data** -- :func:`shard_packed_batch` replaces ``get_batch_on_this_cp_rank`` for packed batches:
  ``tokens``, ``labels``, ``loss_mask`` (any ``[1, t]`` tensor) become this rank's tokens, in the
  placement's order; ``position_ids`` become positions inside each document. The language-model
  loss is a sum over tokens, so any partition of the tokens is exact. It returns the
  ``PackedSeqParams`` to pass to the model (the *global* ``cu_seqlens``: the placement is computed
  from them, identically on every rank).
* **RoPE** -- Megatron rotates q and k in ``Attention.forward`` with TE's per-document CP split in
  mind. :func:`make_rope` replaces the ``apply_rotary_pos_emb`` binding of
  ``megatron.core.transformer.attention``: for a packed batch under FCP with CP > 1 it rotates each
  local token by its position inside its document (Megatron's own bshd rotation, with the table
  gathered at those positions); everything else goes to Megatron's function unchanged.
* **planning ahead** -- :func:`prefetch_packed_batch` makes a later micro-batch's plans in the
  background while the current one runs (Note [Planning a packed batch ahead] in
  :mod:`megatron_fcp.patches.runtime`); the data path and the attention then take them.
* **attention** -- ``FCPCoreAttention`` calls :func:`packed_attention` with q ``[t_local, h, d]``:
  the plan of this micro-batch's lengths (cached), one agreement per micro-batch across the CP
  group (the lengths, the placement and the plan), then
  :func:`~megatron_fcp.attention.function.fcp_attention_with_lse` over the placement.

The alternative -- keep TE's layout and reshuffle q, k, v and the output at the attention boundary --
would move nearly every token twice per layer, the very traffic FCP avoids for short documents.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_fcp.attention.function import fcp_attention_with_lse
from megatron_fcp.attention.head_parallel import HeadParallelGroups
from megatron_fcp.attention.head_parallel_thd import fcp_head_parallel_packed_attention
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.placement import check_doc_lengths
from megatron_fcp.patches import REGISTRY
from megatron_fcp.patches.runtime import FCPStateError, current_runtime

__all__ = ["doc_lengths_of", "shard_packed_batch", "prefetch_packed_batch", "packed_attention",
           "local_packed_attention", "make_rope", "window_mask", "ROPE_TARGET"]

ROPE_TARGET = "megatron.core.transformer.attention:apply_rotary_pos_emb"
"""The RoPE binding ``Attention.forward`` looks up (every supported megatron-core)."""


def _cu_lengths(cu: Any, name: str) -> tuple[int, ...]:
    values = [int(x) for x in (cu.tolist() if hasattr(cu, "tolist") else cu)]
    if len(values) < 2:
        raise ValueError(f"{name}: needs at least [0, n] (one document); got {values}")
    if values[0] != 0:
        raise ValueError(f"{name}: must start at 0 (cumulative document lengths), got {values[:4]}...")
    lengths = tuple(b - a for a, b in zip(values, values[1:]))
    bad = next((i for i, n in enumerate(lengths) if n <= 0), None)
    if bad is not None:
        raise ValueError(f"{name}: must increase strictly (document {bad} has {lengths[bad]} tokens); "
                         "drop empty documents")
    return lengths


def doc_lengths_of(packed_seq_params: Any) -> tuple[int, ...]:
    """Document lengths of a THD ``PackedSeqParams`` (checked; ValueError naming the fix)."""
    if getattr(packed_seq_params, "qkv_format", None) != "thd":
        raise ValueError(f"packed_seq_params.qkv_format must be 'thd' for packed batches, got "
                         f"{getattr(packed_seq_params, 'qkv_format', None)!r}")
    if packed_seq_params.cu_seqlens_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required for a packed (THD) batch")
    q = _cu_lengths(packed_seq_params.cu_seqlens_q, "cu_seqlens_q")
    if packed_seq_params.cu_seqlens_kv is not None and _cu_lengths(packed_seq_params.cu_seqlens_kv, "cu_seqlens_kv") != q:
        raise ValueError("cu_seqlens_kv must equal cu_seqlens_q (FCP runs self-attention)")
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        padded = getattr(packed_seq_params, name, None)
        if padded is not None and _cu_lengths(padded, name) != q:
            raise ValueError(f"{name} differs from cu_seqlens_q: FCP places documents without padding; "
                             "leave the padded variants unset (None)")
    return q


def _ranks_of(cp_group: Any) -> tuple[int, ...] | None:
    """The CP group's global ranks in CP order (None for a group object torch does not know)."""
    try:
        return tuple(dist.get_process_group_ranks(cp_group))
    except Exception:  # noqa: BLE001 - hand-made groups in tests: the runtime's layout decides
        return None


def _cp_group_and_index(cp_group: Any) -> tuple[Any, int, int]:
    if cp_group is None:
        from megatron.core import parallel_state as ps  # noqa: PLC0415

        cp_group = ps.get_context_parallel_group()
    return cp_group, cp_group.size(), cp_group.rank()


def prefetch_packed_batch(cu_seqlens: Any, *, cp_group: Any = None, causal: bool = True) -> Any:
    """Plan a packed micro-batch that :func:`shard_packed_batch` will see later, in the background,
    while the current step runs (Note [Planning a packed batch ahead] in
    :mod:`megatron_fcp.patches.runtime`): call it with the next micro-batch's ``cu_seqlens`` as soon
    as the data loader has them. The same plans as planning on the spot; call it on every rank of
    the CP group (each plans alone: no communication). Returns the planning's future, or None with
    CP = 1 (nothing to plan). Bad ``cu_seqlens`` raise here (ValueError naming the fix)."""
    lengths = _cu_lengths(cu_seqlens, "cu_seqlens")
    check_doc_lengths(lengths)
    cp_group, cp, _ = _cp_group_and_index(cp_group)
    if cp == 1:
        return None
    runtime = current_runtime()
    if runtime is None:
        raise FCPStateError("prefetch_packed_batch with CP > 1 needs FCP set up: call apply_fcp() and setup_fcp() first")
    return runtime.prefetch_packed(_ranks_of(cp_group), lengths, causal=causal)   # None: this rank's group


def shard_packed_batch(batch: dict[str, torch.Tensor], cu_seqlens: Any, *, cp_group: Any = None,
                       causal: bool = True) -> tuple[dict[str, torch.Tensor], Any]:
    """This CP rank's part of a packed micro-batch, and the ``PackedSeqParams`` for the model.

    batch: ``[1, t]`` tensors of the whole packed micro-batch (``tokens``, ``labels``,
    ``loss_mask``, ...); ``position_ids`` (if present) is replaced by positions inside documents.
    cu_seqlens: ``[n_docs + 1]`` cumulative document lengths (ints), ending at ``t``. With CP > 1
    (FCP set up), tensors are laid out by the run's placement of these lengths (see the Note);
    with CP = 1 they are returned whole. Advances the runtime's agreement epoch: call it once per
    micro-batch on every rank.
    """
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: PLC0415

    lengths = _cu_lengths(cu_seqlens, "cu_seqlens")
    check_doc_lengths(lengths)
    total = sum(lengths)
    for name, x in batch.items():
        if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != total:
            raise ValueError(f"batch[{name!r}]: expected [1, {total}] (one packed sequence of the documents "
                             f"in cu_seqlens), got {list(x.shape)}")
    cp_group, cp, index = _cp_group_and_index(cp_group)
    doc_pos = torch.cat([torch.arange(n) for n in lengths])[None, :]  # [1, t] positions inside documents
    if cp > 1:
        runtime = current_runtime()
        if runtime is None:
            raise FCPStateError("shard_packed_batch with CP > 1 needs FCP set up: call apply_fcp() and setup_fcp() first")
        placement = runtime.packed_placement(lengths, causal=causal, cp_ranks=_ranks_of(cp_group))
        runtime.packed_epoch = (runtime.packed_epoch or 0) + 1
        take = torch.as_tensor(placement.token_index(index))
        out = {name: x[:, take].contiguous() for name, x in batch.items()}
        if "position_ids" in batch:
            out["position_ids"] = torch.as_tensor(placement.positions(index))[None, :]
    else:
        out = {name: x for name, x in batch.items()}
        if "position_ids" in batch:
            out["position_ids"] = doc_pos
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    return out, params


def local_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...], *,
                           causal: bool, scale: float, softmax_offset: torch.Tensor | None = None,
                           window: tuple[int, int] | None = None) -> torch.Tensor:
    """Single-rank attention of a packed batch, each document alone: q ``[t, h, d]``, k ``[t, h_kv,
    d]``, v ``[t, h_kv, d_v]`` -> ``[t, h, d_v]`` (torch SDPA per document; with a sink ``[h]``,
    :func:`~megatron_fcp.patches.sinks.dense_sink_attention` per document; a ``window`` inside each
    document)."""
    if softmax_offset is not None:
        from megatron_fcp.patches.sinks import dense_sink_attention  # noqa: PLC0415

        bounds = [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()]
        return torch.cat([dense_sink_attention(*(x[a:z, None] for x in (q, k, v)), softmax_offset, causal=causal,
                                               scale=scale, window=window)[:, 0] for a, z in zip(bounds, bounds[1:])])
    group = q.shape[1] // k.shape[1]
    if group > 1:  # GQA: each KV head serves `group` query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    outs, start = [], 0
    for n in lengths:
        qh, kh, vh = (x[start:start + n].transpose(0, 1) for x in (q, k, v))  # [h, n, d]
        mask = None if window is None else window_mask(n, causal, window, q.device)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal and mask is None,
                                                                     attn_mask=mask, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


def packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     packed_seq_params: Any, *, causal: bool, transport: Callable[[Any], Any],
                     window: tuple[int, int] | None = None) -> torch.Tensor:
    """``FCPCoreAttention``'s packed path: q ``[t_local, h, d]`` -> ``[t_local, h*d]``; ``window``: the
    layer's sliding window inside each document (its plan over the batch's placement, Note
    [Per-layer plans] in :mod:`megatron_fcp.patches.runtime`)."""
    lengths = doc_lengths_of(packed_seq_params)
    if query.dim() != 3:
        raise ValueError(f"packed (THD) attention expects q [t, h, d] (Megatron squeezes the batch of 1), "
                         f"got {list(query.shape)}")
    t = query.shape[0]
    if module.cp_size == 1:
        if t != sum(lengths):
            raise ValueError(f"q has {t} tokens but cu_seqlens describes {sum(lengths)}")
        out = local_packed_attention(query, key, value, lengths, causal=causal, scale=module.softmax_scale,
                                     softmax_offset=getattr(module, "softmax_offset", None), window=window)
        return out.reshape(t, -1)
    runtime = current_runtime()
    if runtime is None:
        raise FCPStateError("FCP runtime was reset after this model was built; rebuild the model")
    if ROPE_TARGET not in REGISTRY.targets("megatron"):
        raise NotImplementedError(f"packed (THD) batches with CP > 1 need FCP's RoPE binding ({ROPE_TARGET}), "
                                  "which apply_fcp() could not install in this megatron-core")
    ranks = tuple(dist.get_process_group_ranks(module.cp_group))
    hp = None
    degree = runtime.packed_degree(ranks, lengths, causal=causal)   # Note [Head-parallel degree of a packed batch]
    if window is None and degree > 1:  # windowed layers run without the stage
        hp = runtime.packed_head_parallel(ranks, lengths, causal=causal, heads=query.shape[1], kv_heads=key.shape[1])
        plan = hp.kv_plan
        placement = hp.placement
    else:
        plan = runtime.packed_plan(ranks, lengths, causal=causal, window=window)
        placement = plan.placement
    index = ranks.index(dist.get_rank())
    if t != placement.tokens(index):
        raise ValueError(f"this rank holds {t} tokens but FCP's placement of the batch gives it "
                         f"{placement.tokens(index)}: lay the batch out with "
                         "megatron_fcp.patches.packed.shard_packed_batch (not get_batch_on_this_cp_rank)")
    # One agreement per micro-batch covers every layer: the plans of all the model's masks over this
    # batch's placement (Note [Per-layer plans] in megatron_fcp.patches.runtime), so each layer's
    # call checks the same facts and the windowed layers add no collective.
    masks = sorted({None, *runtime.windows, window}, key=lambda w: (w is not None, w))
    if degree > 1 and hp is None:  # a windowed layer: the full layers' stage too
        hp = runtime.packed_head_parallel(ranks, lengths, causal=causal, heads=query.shape[1], kv_heads=key.shape[1])
    stage = None if hp is None else (hp.degree, hp.head_groups, None if hp.kv_plan is None else hp.kv_plan.rounds)
    plans = tuple((w, None if (w is None and hp is not None) else
                   plan.rounds if w == window else runtime.packed_plan(ranks, lengths, causal=causal, window=w).rounds)
                  for w in masks)
    runtime.agreement.ensure(
        {"doc_lengths": lengths, "placement": placement.blocks, "plans": plans, "head_parallel": stage,
         "causal": causal,
         "q": (tuple(query.shape[1:]), str(query.dtype)), "kv": (tuple(key.shape[1:]), value.shape[-1], str(key.dtype)),
         "sink": getattr(module, "softmax_offset", None) is not None},
        module.cp_group, epoch=runtime.packed_epoch, what="FCP packed plan", timeout_s=runtime.config.timeout_s)
    if hp is not None and window is None:  # Note [Head-parallel execution on packed batches]
        groups = runtime.packed_groups(ranks, degree) or HeadParallelGroups.of_cp_group(hp, module.cp_group)
        if groups is None:
            raise FCPStateError(f"the head-parallel process groups of CP group {list(ranks)} were not created: "
                                "call setup_fcp() on every rank of the job (it creates them collectively)")
        out = fcp_head_parallel_packed_attention(
            query, key, value, cp_group=module.cp_group, hp_plan=hp, groups=groups, causal=causal,
            softmax_scale=module.softmax_scale, kernel=runtime.config.kernel,
            transport=None if groups.kv_group is None else transport(runtime, groups.kv_group),
            backward_kv=runtime.config.backward_kv, kv_memory_budget=runtime.config.kv_memory_budget,
            stats=runtime.layer_stats(module.layer_number), timeout_s=runtime.config.timeout_s,
            check_numerics=runtime.config.check_numerics, agreement=None,  # agreed above, once per micro-batch
            softmax_offset=getattr(module, "softmax_offset", None))
        return out.reshape(t, -1)
    out, _ = fcp_attention_with_lse(query, key, value, cp_group=module.cp_group, plan=plan, placement=placement,
                                    causal=causal, window=window, softmax_scale=module.softmax_scale,
                                    transport=transport(runtime, module.cp_group), kernel=runtime.config.kernel,
                                    backward_kv=runtime.config.backward_kv,
                                    kv_memory_budget=runtime.config.kv_memory_budget,
                                    stats=runtime.layer_stats(module.layer_number),
                                    timeout_s=runtime.config.timeout_s, check_numerics=runtime.config.check_numerics,
                                    agreement=None,  # agreed above, once per micro-batch
                                    softmax_offset=getattr(module, "softmax_offset", None))
    return out.reshape(t, -1)


def window_mask(n: int, causal: bool, window: tuple[int, int], device: Any = None) -> torch.Tensor:
    """``[n, n]`` booleans, True = visible, of ``window`` over positions 0..n-1 of one sequence or
    document (SDPA's ``attn_mask`` for the single-rank paths), by :class:`Mask`'s rule."""
    pos = np.arange(n)
    return torch.from_numpy(Mask.of(causal, window).visible(pos[:, None], pos[None, :])).to(device)


def _packed_positions(cu_seqlens: Any, cp_group: Any, tokens: int) -> torch.Tensor | None:
    """Positions inside documents of this rank's tokens when RoPE must follow FCP's placement, else None."""
    runtime = current_runtime()
    if cu_seqlens is None or runtime is None:
        return None
    cp_group, cp, index = _cp_group_and_index(cp_group)
    if cp == 1:
        return None
    lengths = _cu_lengths(cu_seqlens, "cu_seqlens")
    placement = runtime.packed_placement(lengths, cp_ranks=_ranks_of(cp_group))
    if tokens != placement.tokens(index):
        raise ValueError(f"RoPE: this rank holds {tokens} tokens but FCP's placement gives it "
                         f"{placement.tokens(index)}: lay the batch out with shard_packed_batch")
    return torch.as_tensor(placement.positions(index))


def make_rope(original: Callable) -> Callable:
    """Replacement of Megatron's ``apply_rotary_pos_emb``; see Note [How a packed batch reaches FCP]."""
    signature = inspect.signature(original)

    def apply_rotary_pos_emb(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(*args, **kwargs)
        t, freqs = bound.arguments["t"], bound.arguments["freqs"]
        pos = _packed_positions(bound.arguments.get("cu_seqlens"), bound.arguments.get("cp_group"), t.shape[0])
        if pos is None:
            return original(*args, **kwargs)
        bound.arguments["t"] = t.unsqueeze(1)                    # [t, h, d] -> [t, 1, h, d] (bshd)
        bound.arguments["freqs"] = freqs[pos.to(freqs.device)]   # [max_s, 1, 1, d] -> [t, 1, 1, d]
        bound.arguments["cu_seqlens"] = None
        return original(*bound.args, **bound.kwargs).squeeze(1)

    return apply_rotary_pos_emb
