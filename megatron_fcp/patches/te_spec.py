"""Transformer Engine's layer spec under FCP: what ``TEDotProductAttention``'s callers rely on.

``get_gpt_layer_with_transformer_engine_spec()`` puts ``TEDotProductAttention`` (megatron-core's
wrapper of TE's ``DotProductAttention``) in the ``core_attention`` slot through
``TESpecProvider.core_attention()``; :func:`~megatron_fcp.patches.megatron.apply_fcp` replaces that
binding (the table in ``megatron.py``). This module holds what is specific to TE's class: the
signatures FCP's replacement must accept, what FCP keeps, and what it refuses -- all decided from
the config and the constructor's arguments, before any plan is settled or any message is sent.

Note [TEDotProductAttention across megatron-core 0.14-0.19]
-----------------------------------------------------------
Read from NVIDIA/Megatron-LM's release tags (core_v0.14.0, 0.15.3, 0.16.1, 0.17.1, 0.18.2,
0.19.0). Every release starts ``__init__(config, layer_number, attn_mask_type, attention_type,
attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None, ...)`` and
``forward(query, key, value, attention_mask, attn_mask_type, attention_bias=None,
packed_seq_params=None, ...)``; the tails differ:

  ============  ==========================================================  ===================
  release       ``__init__`` tail                                           ``forward`` tail
  ============  ==========================================================  ===================
  0.14          ``cp_comm_type="p2p", model_comm_pgs=None``                  --
  0.15          ``cp_comm_type="p2p", pg_collection=None``                   --
  0.16 - 0.19   ``num_splits=None, cp_comm_type="p2p", pg_collection=None``  ``num_splits=None``
  ============  ==========================================================  ===================

``Attention.__init__`` builds it with keywords (``config``, ``layer_number``, ``attn_mask_type``,
``attention_type``, ``cp_comm_type``, ``softmax_scale``, ``model_comm_pgs``/``pg_collection``) and
calls it with ``attn_mask_type``, ``attention_bias`` and ``packed_seq_params`` as keywords.
:func:`check_te_signature` compares the installed class with these names: a ``forward`` parameter
or a required ``__init__`` parameter FCP does not know raises
:class:`~megatron_fcp.patches.PatchTargetError` naming it and the release, so a release that adds
one is refused at ``apply_fcp()`` instead of failing inside the first step.

Note [What FCP keeps and refuses from the TE spec]
--------------------------------------------------
Kept: every other submodule of the spec (only the ``core_attention`` binding changes);
``attn_mask_type`` (causal, ``causal_bottom_right``, ``no_mask``; with packed THD batches also
``padding_causal`` and ``padding``, whose padding is the documents' ``cu_seqlens``);
``softmax_scale``; ``attention_dropout`` (0 in training); GQA (``num_query_groups``);
``k_channels`` and ``v_channels``, equal or not (multi-latent attention: K and V travel at their own
head sizes, Note [KV block tensors] in :mod:`megatron_fcp.attention.kv_block`; fused block kernels
pad V to K's size around the op, as megatron-core pads V for THD); attention sinks (``softmax_type``
``off-by-one`` and ``learnable``: FCP's module holds ``softmax_offset`` under TE's name and shape,
:mod:`megatron_fcp.patches.sinks`); sliding windows (``window_size`` on the layers megatron-core's
``window_attn_skip_freq`` rule selects, :func:`layer_window`: each distinct window runs its own
plan); ``packed_seq_params`` in THD through FCP's packed path; ``pg_collection`` /
``model_comm_pgs``; ``num_splits`` is accepted and ignored (FCP's own blocks fix the order of its
arithmetic); FP8 *linear layers* (``config.fp8`` alone: TE's attention then runs in BF16 too).

Refused, each with ``NotImplementedError`` naming the option and the fix (with ``--fcp-fallback
megatron`` that layer runs TE's own ``TEDotProductAttention`` instead, logged once per reason):
FP8 attention (``fp8_dot_product_attention``, ``fp8_multi_head_attention``), a ``softmax_type``
megatron-core does not define, QK-clip
(``qk_clip``, ``log_max_attention_logit``: TE reports max logits, FCP does not), batch-invariant
mode, cross attention, and, at forward time, attention bias,
padding or arbitrary masks without a THD batch.

``cp_comm_type``: FCP *is* the CP communication, so it replaces the value of every layer it
serves. ``None`` and ``"p2p"`` (TE's ring, Megatron-LM's default) pass silently; any other single
value (``"a2a"``, ``"all_gather"``, ``"a2a+p2p"``, or a list whose entries are all equal) is logged
once at INFO. A per-layer list with *different* values is refused with
:class:`CPCommTypeError`: FCP would run the same kind of schedule on every layer, so the per-layer
choice cannot be honoured. Layers that fall back keep their own value (it is handed to TE's
class). We refuse rather than override because a mixed list is a deliberate per-layer decision
(typically ``a2a`` on sliding-window layers, which TE's ``p2p`` ring cannot run); one value plus
``--fcp-fallback megatron`` expresses that case exactly.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from megatron_fcp.patches import PatchTargetError, megatron_core_version

__all__ = [
    "TE_ATTENTION",
    "TE_INIT_PARAMETERS",
    "TE_FORWARD_PARAMETERS",
    "CPCommTypeError",
    "layer_window",
    "model_windows",
    "check_te_signature",
    "layer_refusal",
    "check_cp_comm_type",
    "refuse_cp_comm_type_args",
    "mask_is_causal",
]

logger = logging.getLogger("megatron_fcp.patches")

TE_ATTENTION = "megatron.core.extensions.transformer_engine:TEDotProductAttention"
"""Where megatron-core defines TE's core attention (a MagicMock there when TE is not installed)."""

#: ``__init__`` parameters of TEDotProductAttention in 0.14-0.19 (Note [TEDotProductAttention ...]).
TE_INIT_PARAMETERS = frozenset({
    "self", "config", "layer_number", "attn_mask_type", "attention_type", "attention_dropout",
    "softmax_scale", "k_channels", "v_channels", "num_splits", "cp_comm_type", "pg_collection",
    "model_comm_pgs"})
#: ``forward`` parameters of TEDotProductAttention in 0.14-0.19 (all accepted by FCPCoreAttention).
TE_FORWARD_PARAMETERS = frozenset({
    "self", "query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias",
    "packed_seq_params", "num_splits"})

#: CP communication types FCP replaces without a word: none given, or TE's ring (Megatron-LM's default).
_QUIET_CP_COMM = (None, "p2p")


class CPCommTypeError(ValueError):
    """A per-layer ``cp_comm_type`` list FCP cannot honour (message names the fix)."""


# ---- signatures -------------------------------------------------------------------------------------
def check_te_signature(cls: type) -> None:
    """Raise :class:`PatchTargetError` if ``cls`` (TEDotProductAttention) takes what FCP does not know.

    Refused: a ``forward`` parameter outside :data:`TE_FORWARD_PARAMETERS` (Megatron could pass it
    and FCP would drop its meaning) and a required ``__init__`` parameter outside
    :data:`TE_INIT_PARAMETERS`. An unknown optional ``__init__`` parameter is accepted: Megatron's
    ``Attention`` does not pass it, and the fallback hands TE's class its default.
    """
    problems = []
    for method, known in (("__init__", TE_INIT_PARAMETERS), ("forward", TE_FORWARD_PARAMETERS)):
        try:
            params = inspect.signature(getattr(cls, method)).parameters
        except (TypeError, ValueError, AttributeError) as exc:
            problems.append(f"{method} has no readable signature ({exc})")
            continue
        for name, p in params.items():
            if name in known or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if method == "forward" or p.default is inspect.Parameter.empty:
                problems.append(f"{method}({name}{'' if p.default is inspect.Parameter.empty else '=...'})")
    if problems:
        raise PatchTargetError(
            f"cannot put FCP in place of {TE_ATTENTION}: in megatron-core {megatron_core_version()} it takes "
            f"{', '.join(problems)}, which FCP does not know (megatron_fcp follows the signatures of 0.14-0.19, "
            "see megatron_fcp/patches/te_spec.py). Use a supported megatron-core, or put FCPCoreAttention "
            "in the spec's core_attention slot yourself (docs/megatron.md, 'Transformer Engine spec')")


# ---- per-layer refusals -------------------------------------------------------------------------------
def layer_window(config: Any, layer_number: int) -> tuple[int, int] | None:
    """This layer's sliding window ``(left, right)`` in Megatron's convention, or None for full-length
    attention: ``config.window_size`` on the layers megatron-core's own rule
    (``is_layer_window_attention``, with ``window_attn_skip_freq``) windows; every layer where the
    installed megatron-core has no such rule (0.14 and stubs), as its attention does."""
    window = getattr(config, "window_size", None)
    if not window:
        return None
    try:
        from megatron.core.transformer.utils import is_layer_window_attention  # noqa: PLC0415 - 0.15+
    except ImportError:
        return tuple(int(x) for x in window)  # 0.14 (and stubs): the window applies to every layer
    if not is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number):
        return None
    return tuple(int(x) for x in window)


def model_windows(config: Any) -> tuple[tuple[int, int], ...]:
    """The distinct sliding windows of the model's layers (1..``config.num_layers``), sorted; ``()``
    without ``window_size``. What :func:`~megatron_fcp.patches.runtime.setup_fcp` settles plans for."""
    layers = int(getattr(config, "num_layers", 0) or 0)
    return tuple(sorted({w for n in range(1, layers + 1) if (w := layer_window(config, n)) is not None}))


def layer_refusal(config: Any, *, layer_number: int, attention_type: str = "self",
                  k_channels: int | None = None, v_channels: int | None = None) -> str | None:
    """The first reason FCP cannot serve this layer (None: it can); see Note [What FCP keeps ...].

    Pure: reads the config and the constructor's arguments, never a process group.
    """
    if attention_type != "self":
        return (f"FCPCoreAttention: attention_type={attention_type!r} is not supported (self-attention "
                "only; cross attention needs its own KV sequence)")
    fp8 = [name for name in ("fp8_dot_product_attention", "fp8_multi_head_attention") if getattr(config, name, False)]
    if fp8:
        return (f"FCPCoreAttention: FP8 attention ({' and '.join(fp8)}) is not supported; drop "
                "--fp8-dot-product-attention / --fp8-multi-head-attention (FP8 linear layers, --fp8-format, "
                "work with FCP)")
    softmax_type = getattr(config, "softmax_type", "vanilla") or "vanilla"  # sinks: served (patches.sinks)
    if softmax_type not in ("vanilla", "off-by-one", "learnable"):
        return (f"FCPCoreAttention: softmax_type={softmax_type!r} is not supported (vanilla, off-by-one and "
                "learnable are)")
    clip = [name for name in ("qk_clip", "log_max_attention_logit") if getattr(config, name, False)]
    if clip:
        return (f"FCPCoreAttention: {' and '.join(clip)} needs the max attention logit per head, which FCP "
                "does not compute; drop --qk-clip / --log-max-attention-logit")
    if getattr(config, "batch_invariant_mode", False):
        return ("FCPCoreAttention: batch_invariant_mode is not supported (FCP's blocks depend on the CP "
                "plan, not on one fixed split); drop --batch-invariant-mode")
    del k_channels, v_channels  # any sizes: MLA's differ (Note [What FCP keeps and refuses ...])
    return None


def mask_is_causal(mask_type: Any, *, packed: bool) -> bool:
    """Whether ``mask_type`` (an ``AttnMaskType``) is causal; NotImplementedError for masks FCP lacks.

    ``causal_bottom_right`` equals ``causal`` for self-attention (sq == sk). With a packed THD batch
    ``padding_causal`` / ``padding`` are the per-document causal / full masks TE uses for THD: the
    documents' ``cu_seqlens`` are the padding, and FCP's packed path masks by document.
    """
    from megatron.core.transformer.enums import AttnMaskType  # noqa: PLC0415

    causal = {AttnMaskType.causal, getattr(AttnMaskType, "causal_bottom_right", AttnMaskType.causal)}
    if packed:
        causal.add(getattr(AttnMaskType, "padding_causal", AttnMaskType.causal))
    if mask_type in causal:
        return True
    if mask_type == AttnMaskType.no_mask or (packed and mask_type == AttnMaskType.padding):
        return False
    raise NotImplementedError(
        f"FCPCoreAttention supports causal and no_mask attention (and padding_causal / padding with packed "
        f"THD batches), not {mask_type}; express padding as documents in a THD batch (packed_seq_params)")


# ---- cp_comm_type ------------------------------------------------------------------------------------------
def _distinct(values: Any) -> list:
    return list(dict.fromkeys(values)) if isinstance(values, (list, tuple)) else [values]


def _mixed_list_error(where: str, values: Any) -> CPCommTypeError:
    return CPCommTypeError(
        f"{where}: cp_comm_type is a per-layer list with different values {list(values)}; FCP replaces the CP "
        "communication of every layer it serves with one plan, so a per-layer choice cannot be honoured. Pass "
        "one value (--cp-comm-type p2p, or none) with --fcp; layers FCP cannot serve run Transformer Engine "
        "with that value under --fcp-fallback megatron (docs/megatron.md, 'Transformer Engine spec')")


def check_cp_comm_type(config: Any, cp_comm_type: Any, *, layer_number: int, logged: set) -> None:
    """Refuse a mixed per-layer ``config.cp_comm_type`` list; log once that another value is replaced.

    ``cp_comm_type`` is what Megatron handed this layer; ``logged`` remembers the values already
    logged (one INFO line per value and process).
    """
    for values in (getattr(config, "cp_comm_type", None), cp_comm_type):
        distinct = _distinct(values)
        if len(distinct) > 1:
            raise _mixed_list_error(f"FCPCoreAttention [layer {layer_number}]", values)
    value = cp_comm_type if cp_comm_type is not None else _distinct(getattr(config, "cp_comm_type", None))[0]
    value = _distinct(value)[0]  # a uniform list is its one value
    if value not in _QUIET_CP_COMM and value not in logged:
        logged.add(value)
        logger.info("megatron_fcp: cp_comm_type=%r is replaced by FCP's plan on every layer FCP serves "
                    "(layers that fall back to Transformer Engine keep it)", value)


def refuse_cp_comm_type_args(args: Any = None) -> None:
    """``apply_fcp()``'s early check of Megatron-LM's parsed ``--cp-comm-type``.

    ``args`` defaults to ``megatron.training``'s parsed args where they exist (None: nothing to check).
    """
    if args is None:
        from megatron_fcp.patches.compat import _megatron_training_args  # noqa: PLC0415, PLC2701

        args = _megatron_training_args()
    if args is not None and len(_distinct(getattr(args, "cp_comm_type", None))) > 1:
        raise _mixed_list_error("apply_fcp()", args.cp_comm_type)
