"""Swap Megatron's context-parallel core attention for FCP: monkey patch or spec route.

Two integration modes (as Liger-Kernel offers for its kernels):

* **spec route** -- put :class:`FCPCoreAttention` in the ``core_attention`` slot of a layer spec::

      spec = get_gpt_layer_local_spec()
      spec.submodules.self_attention.submodules.core_attention = FCPCoreAttention

* **patch route** -- :func:`apply_fcp` replaces the core attention class in the bindings that
  megatron-core's GPT spec builders look up *when a spec is built*, so every spec built afterwards
  (local or Transformer Engine) gets FCP for CP > 1:

  =======================================================================  =====================
  binding (megatron-core 0.14-0.19)                                         read by
  =======================================================================  =====================
  ``megatron.core.models.backends:DotProductAttention``                    ``LocalSpecProvider
                                                                           .core_attention()``
  ``megatron.core.extensions.transformer_engine_spec_provider:              ``TESpecProvider
  TEDotProductAttention``                                                   .core_attention()``
  ``megatron.core.models.gpt.gpt_layer_specs:DotProductAttention`` /        spec builders of
  ``...:TEDotProductAttention`` (only where that module imports them)      releases that do
  ``megatron.core.models.backends:TEDotProductAttention``                  ``InferenceSpecProvider``
  =======================================================================  =====================

  Each replacement is a subclass of :class:`FCPCoreAttention` whose constructor hands back the
  *original* class's instance when the CP group has one rank, so cp = 1 runs exactly Megatron's
  attention. The originals' ``forward`` are guarded while FCP is applied: an attention module
  built *before* :func:`apply_fcp` with CP > 1 (it would silently run Transformer Engine's ring)
  raises :class:`~megatron_fcp.patches.runtime.FCPStateError` on its first call instead.

Note [No silent fallbacks]
--------------------------
A layer FCP cannot serve (attention bias, dropout in training, a mask, window or softmax it does
not support) raises ``NotImplementedError`` with the reason, unless the user allowed
``--fcp-fallback megatron``: then that layer runs *Megatron's own attention class* (the original
the patch replaced, or for the spec route Transformer Engine's attention where installed, else the
local one), and a WARNING says so once per reason. The value is called ``megatron`` rather than
``ring`` because that is what runs: Megatron's class with Megatron's ``cp_comm_type`` (Transformer
Engine's p2p ring by default, but a2a or all-gather if configured), not a ring of ours. Megatron's
local ``DotProductAttention`` asserts cp = 1, so with CP > 1 on CPU there is nothing to fall back
to and the error says so. Every FCP attention module reports what serves it
(``FCPRuntime.layer_report``, logged at start-up; the example's ``--metrics-json`` records it), so
a layer that silently runs without FCP -- or without CP -- shows in the log and the metrics.

All patches go through :data:`megatron_fcp.patches.REGISTRY` (group ``"megatron"``): idempotent by
identity, exact revert, each patched path logged, ``ImportError`` naming the symbol and the
installed megatron-core version when a required binding is missing.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterator

import torch

from megatron_fcp.attention.function import FCPNumericsError
from megatron_fcp.config import FCPConfig
from megatron_fcp.contract.mask import Mask
from megatron_fcp.patches import REGISTRY, PatchTargetError, check_megatron_version, megatron_core_version
from megatron_fcp.patches.compat import refuse_hybrid_cp
from megatron_fcp.patches.packed import ROPE_TARGET, make_rope, packed_attention, window_mask
from megatron_fcp.patches.runtime import FCPStateError, current_runtime, reset_fcp, setup_fcp
from megatron_fcp.patches.sinks import dense_sink_attention, make_softmax_offset, softmax_offset_sharded_state_dict
from megatron_fcp.patches.te_spec import (
    TE_ATTENTION,
    check_cp_comm_type,
    check_te_signature,
    layer_refusal,
    layer_window,
    mask_is_causal,
    model_windows,
    refuse_cp_comm_type_args,
)

__all__ = [
    "FCPCoreAttention",
    "apply_fcp",
    "revert_fcp",
    "fcp_patched",
    "is_fcp_applied",
    "assert_model_uses_fcp",
    "LOCAL_ATTENTION",
    "TE_ATTENTION",
]

logger = logging.getLogger("megatron_fcp.patches")

GROUP = "megatron"
#: Where the originals are defined (required: their absence is a version error).
LOCAL_ATTENTION = "megatron.core.transformer.dot_product_attention:DotProductAttention"

#: Spec-time bindings of each original: (module, attribute, required).
_SPEC_BINDINGS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    LOCAL_ATTENTION: (
        ("megatron.core.models.backends", "DotProductAttention", True),
        ("megatron.core.models.gpt.gpt_layer_specs", "DotProductAttention", False),
    ),
    TE_ATTENTION: (
        ("megatron.core.extensions.transformer_engine_spec_provider", "TEDotProductAttention", False),
        ("megatron.core.models.backends", "TEDotProductAttention", False),
        ("megatron.core.models.gpt.gpt_layer_specs", "TEDotProductAttention", False),
    ),
}

_STATE: dict[str, Any] = {"config": None}


# ---- the core attention ----------------------------------------------------------------------------
def _cp_group_from(pg_collection: Any) -> Any:
    if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
        return pg_collection.cp
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    return ps.get_context_parallel_group(check_initialized=False)


def _tp_size_from(pg_collection: Any) -> int:
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp.size()
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    return ps.get_tensor_model_parallel_world_size()


def _tp_group_from(pg_collection: Any) -> Any:
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    return ps.get_tensor_model_parallel_group(check_initialized=False)


def _group_size(group: Any) -> int:
    return 1 if group is None else int(group.size())


class FCPCoreAttention(torch.nn.Module):
    """Drop-in for Megatron's ``core_attention`` slot running FCP's graph-scheduled CP attention.

    Constructor: Megatron's keyword arguments (``config``, ``layer_number``, ``attn_mask_type``,
    ``attention_type``, ``attention_dropout``, ``softmax_scale``, ``cp_comm_type``,
    ``pg_collection``; ``model_comm_pgs`` of older releases is accepted as ``pg_collection``).
    With CP > 1 the CP group's plan is settled here (:func:`setup_fcp` if not done yet).

    forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None):
        query ``[s, b, h, d]`` and key/value ``[s, b, h_kv, d]`` (local heads, this CP rank's
        zigzag shard of the sequence); returns ``[s, b, h*d]``. Causal or unmasked; the causal
        mask is implied by ``attn_mask_type`` (``attention_mask`` is then ignored, as Transformer
        Engine does). CP = 1 computes plain local attention without communication.

    Packed batches (``packed_seq_params`` with ``qkv_format="thd"``): query ``[t, h, d]`` in FCP's
    placement of the documents (lay the batch out with
    :func:`megatron_fcp.patches.packed.shard_packed_batch`); returns ``[t, h*d]``.

    Attention sinks (``config.softmax_type`` ``"off-by-one"`` / ``"learnable"``): the module holds
    ``softmax_offset`` exactly as megatron-core's ``DotProductAttention`` does (a parameter of
    ``[heads / tp]`` for learnable, same name, init and sharded state dict:
    :mod:`megatron_fcp.patches.sinks`) and hands it to the engine, which merges it once per row.

    Unsupported (raise ``NotImplementedError`` naming the option, or with ``--fcp-fallback
    megatron`` run Megatron's own attention class for that layer and log it once per reason; see
    Note [No silent fallbacks]): attention bias, padding/arbitrary masks outside THD, packed formats
    other than THD, attention dropout > 0 in training, and what
    :func:`~megatron_fcp.patches.te_spec.layer_refusal` lists (an unknown softmax_type,
    FP8 attention, QK-clip, batch-invariant mode, cross attention). K and V head sizes may differ
    (multi-latent attention: ``k_channels != v_channels``; the output has ``v_channels`` per head).
    A per-layer ``cp_comm_type`` list with different values raises
    :class:`~megatron_fcp.patches.te_spec.CPCommTypeError`. Always refused:
    padded THD variants and Megatron's hybrid/dynamic CP (``config.hybrid_context_parallel``, or
    ``packed_seq_params`` with a per-micro-batch ``cp_group``), refused at construction, before
    any plan is settled or any communication happens
    (:class:`~megatron_fcp.patches.compat.HybridCPUnsupportedError`).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        model_comm_pgs: Any = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        if unused:
            logger.debug("FCPCoreAttention ignores constructor arguments %s", sorted(unused))
        # What Megatron passed, to build its own attention class should --fcp-fallback need it.
        self._megatron_kwargs = dict(
            config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
            attention_type=attention_type, attention_dropout=attention_dropout, softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type, **unused)
        for name, value in (("pg_collection", pg_collection), ("model_comm_pgs", model_comm_pgs),
                            ("k_channels", k_channels), ("v_channels", v_channels)):
            if value is not None:
                self._megatron_kwargs[name] = value
        self._fallback_reason: str | None = None
        self.config = config
        self.layer_number = max(1, int(layer_number))
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type  # ignored: FCP replaces the CP communication altogether
        pg_collection = pg_collection if pg_collection is not None else model_comm_pgs
        self.pg_collection = pg_collection
        self.cp_group = _cp_group_from(pg_collection)
        self.cp_size = _group_size(self.cp_group)
        tp = _tp_size_from(pg_collection)
        head_dim = k_channels or getattr(config, "kv_channels", None) or config.hidden_size // config.num_attention_heads
        self.hidden_size_per_attention_head = int(head_dim)
        self.v_head_dim = int(v_channels or head_dim)  # MLA: V (and the output) has its own head size
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.num_query_groups_per_partition = max(1, _kv_heads(config) // tp)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)
        self.current_max_attn_logits = None  # read by Megatron's qk-clip; FCP refuses qk-clip
        self.window = layer_window(config, self.layer_number)  # None: full length (Note [Per-layer plans])
        self._check_config(config, cp_comm_type, attention_type, k_channels, v_channels)
        # where megatron-core's DotProductAttention creates it, so the same seed draws the same init
        make_softmax_offset(self, config, self.num_attention_heads_per_partition)
        if self.cp_size > 1:
            runtime = _ensure_runtime(config, head_dim=head_dim,  # plans settled before the first step
                                      v_head_dim=self.v_head_dim if self.v_head_dim != head_dim else None)
            runtime.report_layer(self.layer_number, self._fallback_reason, cp_group=self.cp_group,
                                 window=self.window)

    def _check_config(self, config: Any, cp_comm_type: Any, attention_type: str, k_channels: int | None,
                      v_channels: int | None) -> None:
        """Refusals decided from the config alone, before any plan or message (te_spec's Note)."""
        refuse_hybrid_cp("FCPCoreAttention", config=config, check_process_groups=True)
        if self.cp_size > 1:
            check_cp_comm_type(config, cp_comm_type, layer_number=self.layer_number,
                               logged=_STATE.setdefault("cp_comm_logged", set()))
        reason = layer_refusal(config, layer_number=self.layer_number, attention_type=attention_type,
                               k_channels=k_channels, v_channels=v_channels)
        if reason is None and self.window is not None:
            try:
                Mask.of(mask_is_causal(self.attn_mask_type, packed=True), self.window)
            except NotImplementedError:
                pass  # a mask type FCP refuses: said at forward time with its own reason
            except ValueError as exc:
                reason = f"FCPCoreAttention: --window-size {self.window} with {self.attn_mask_type}: {exc}"
        if reason is not None:
            self._fallback_reason = self._unsupported(reason)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: Any = (), metadata: dict | None = None) -> Any:
        """As megatron-core's ``DotProductAttention``: a learnable ``softmax_offset`` sharded over TP
        along dim 0 (:func:`~megatron_fcp.patches.sinks.softmax_offset_sharded_state_dict`)."""
        return softmax_offset_sharded_state_dict(self, prefix, sharded_offsets, metadata,
                                                 _tp_group_from(self.pg_collection))

    def _unsupported(self, reason: str) -> str:
        """Raise ``NotImplementedError(reason)`` unless ``--fcp-fallback megatron`` allows running
        Megatron's own attention for this layer; then return the reason."""
        if _fallback_mode() != "megatron":
            raise NotImplementedError(
                f"{reason} [layer {self.layer_number}]; or pass --fcp-fallback megatron (fcp.fallback) to run "
                "Megatron's own attention for such layers")
        return reason

    def _megatron_forward(self, reason: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run Megatron's own attention class for this layer (built on first use; Note [No silent
        fallbacks]) and log it once per reason."""
        module = getattr(self, "_fallback_module", None)
        if module is None:
            cls = getattr(type(self), "fcp_original", None) or _megatron_attention_class()
            try:
                module = cls(**self._megatron_kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised with the reason and the fix
                raise NotImplementedError(
                    f"{reason} [layer {self.layer_number}], and --fcp-fallback megatron cannot serve it: "
                    f"Megatron's {cls.__name__} failed to build here ({type(exc).__name__}: {exc}). Megatron's "
                    "local DotProductAttention runs cp = 1 only; with CP > 1 the fallback needs Transformer "
                    "Engine's attention (the TE spec on GPU)") from exc
            module._fcp_fallback = True  # the forward guard lets it run
            if isinstance(getattr(self, "softmax_offset", None), torch.nn.Parameter):
                module.softmax_offset = self.softmax_offset  # one sink parameter: the one the optimizer holds
            self._fallback_module = module
        logged = _STATE.setdefault("fallback_logged", set())
        if reason not in logged:
            logged.add(reason)
            logger.warning("megatron_fcp: %s -> layer %d (and every later layer with this reason) runs "
                           "Megatron's %s (--fcp-fallback megatron)", reason, self.layer_number,
                           type(module).__name__)
        runtime = current_runtime()
        if runtime is not None:
            runtime.report_layer(self.layer_number, reason, cp_group=self.cp_group, window=self.window)
        return module(*args, **kwargs)

    def _causal(self, attn_mask_type: Any, packed_seq_params: Any = None) -> bool:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return mask_is_causal(mask_type, packed=packed_seq_params is not None)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        """``num_splits`` (TE's, megatron-core 0.16+) is ignored: FCP's blocks fix its arithmetic."""
        if packed_seq_params is not None:
            refuse_hybrid_cp("FCPCoreAttention.forward", packed_seq_params=packed_seq_params)
        reason = self._fallback_reason or self._forward_reason(attn_mask_type, attention_bias, packed_seq_params)
        if reason is not None:
            extra = {} if num_splits is None else {"num_splits": num_splits}  # 0.14/0.15 TE lacks it
            return self._megatron_forward(reason, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                          attention_bias=attention_bias, packed_seq_params=packed_seq_params, **extra)
        del attention_mask  # causal/no_mask only: the mask type says everything
        causal = self._causal(attn_mask_type, packed_seq_params)
        try:
            return self._fcp_forward(query, key, value, causal, packed_seq_params)
        except FCPNumericsError as exc:  # --fcp-check-numerics: say which layer
            raise FCPNumericsError(f"layer {self.layer_number}: {exc}") from exc

    def _forward_reason(self, attn_mask_type: Any, attention_bias: Any, packed_seq_params: Any) -> str | None:
        """Why FCP cannot serve this call (None: it can); raises unless --fcp-fallback allows it."""
        reason = None
        if attention_bias is not None:
            reason = "FCPCoreAttention: attention_bias is not supported"
        elif packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) != "thd":
            reason = (f"FCPCoreAttention: packed_seq_params with qkv_format="
                      f"{getattr(packed_seq_params, 'qkv_format', None)!r}; FCP packs documents as 'thd'")
        elif self.training and self.dropout_p > 0:
            reason = (f"FCPCoreAttention: attention dropout {self.dropout_p} in training is not supported; "
                      "set --attention-dropout 0")
        else:
            try:
                self._causal(attn_mask_type, packed_seq_params)
            except NotImplementedError as exc:
                reason = str(exc)
        return None if reason is None else self._unsupported(reason)

    def _fcp_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                     packed_seq_params: Any) -> torch.Tensor:
        if packed_seq_params is not None:  # q [t, h, d] -> [t, h*d]; Note in megatron_fcp.patches.packed
            return packed_attention(self, query, key, value, packed_seq_params, causal=causal, transport=_transport,
                                    window=self.window)
        s, b, h, _ = query.shape  # [s, b, h, d]; key [s, b, h_kv, d], value [s, b, h_kv, d_v] (MLA: d_v != d)
        d_v = value.shape[-1]
        if self.cp_size == 1:
            out = _local_attention(query, key, value, causal=causal, scale=self.softmax_scale,
                                   softmax_offset=self.softmax_offset, window=self.window)
        else:
            from megatron_fcp.attention.function import fcp_attention_with_lse  # noqa: PLC0415

            runtime = current_runtime()
            if runtime is None:
                raise FCPStateError("FCP runtime was reset after this model was built; rebuild the model")
            plan = runtime.plan_for_group(self.cp_group, causal=causal, s_local=s, window=self.window)
            kw = dict(causal=causal, window=self.window, softmax_scale=self.softmax_scale, kernel=runtime.config.kernel,
                      backward_kv=runtime.config.backward_kv, kv_memory_budget=runtime.config.kv_memory_budget,
                      stats=runtime.layer_stats(self.layer_number), timeout_s=runtime.config.timeout_s,
                      check_numerics=runtime.config.check_numerics, agreement=runtime.plan_agreement,
                      softmax_offset=self.softmax_offset)
            hp = runtime.head_parallel(self.cp_group, causal=causal, s_local=s, heads=h, kv_heads=key.shape[2],
                                       window=self.window)
            if hp is None:
                out, _ = fcp_attention_with_lse(query, key, value, cp_group=self.cp_group, plan=plan,
                                                transport=_transport(runtime, self.cp_group), **kw)
            else:  # the head-parallel stage (--fcp-head-parallel > 1): Note in attention.head_parallel
                from megatron_fcp.attention.head_parallel import fcp_head_parallel_attention  # noqa: PLC0415

                hp_plan, groups = hp
                stage = None if groups.kv_group is None else _transport(runtime, groups.kv_group)
                out = fcp_head_parallel_attention(query, key, value, cp_group=self.cp_group, hp_plan=hp_plan,
                                                  groups=groups, transport=stage, **kw)
        return out.reshape(s, b, h * d_v)  # [s, b, h*d_v]


def _fallback_mode() -> str:
    """``--fcp-fallback`` of the settled runtime, else of the applied config, else ``"none"``."""
    runtime = current_runtime()
    config = runtime.config if runtime is not None else _STATE["config"]
    return getattr(config, "fallback", "none") if config is not None else "none"


def _megatron_attention_class() -> type:
    """Megatron's own core attention for the spec route's fallback: Transformer Engine's where
    installed, else the local ``DotProductAttention`` (cp = 1 only)."""
    found = _original_classes()
    return found[TE_ATTENTION] or found[LOCAL_ATTENTION]


def _transport(runtime: Any, group: Any) -> Any:
    """The transport for one call: ``runtime.transport_factory(group)`` when set (called per
    attention call, e.g. a counting transport in tests), else the backend's default transport,
    created once per CP group and kept (an NCCL transport owns a side stream); serialised when
    ``--no-fcp-overlap`` is set."""
    from megatron_fcp.attention.comm import SerialTransport, default_transport  # noqa: PLC0415

    factory = runtime.transport_factory
    if factory is not None:
        transport = factory(group)
    else:
        transport = runtime.transports.get(id(group))
        if transport is None or transport.group is not group:
            transport = runtime.transports[id(group)] = default_transport(group, runtime.config.timeout_s)
    return transport if runtime.config.overlap else SerialTransport(transport)


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                     softmax_offset: torch.Tensor | None = None, window: tuple[int, int] | None = None) -> torch.Tensor:
    """Single-rank attention, ``q [s, b, h, d]``, ``k [s, b, h_kv, d]``, ``v [s, b, h_kv, d_v]`` ->
    ``[s, b, h, d_v]`` (torch's SDPA takes d_v != d: its math path runs it; with a sink:
    :func:`~megatron_fcp.patches.sinks.dense_sink_attention`); a ``window`` becomes an explicit mask
    from :class:`~megatron_fcp.contract.mask.Mask`'s rule."""
    if softmax_offset is not None:
        return dense_sink_attention(q, k, v, softmax_offset, causal=causal, scale=scale, window=window)
    group = q.shape[2] // k.shape[2]
    if group > 1:  # GQA: each KV head serves `group` query heads
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    qh, kh, vh = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [b, h, s, d]
    mask = None if window is None else window_mask(q.shape[0], causal, window, q.device)
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal and mask is None,
                                                           attn_mask=mask, scale=scale)
    return out.permute(2, 0, 1, 3)  # [s, b, h, d_v]


def _kv_heads(config: Any) -> int:
    """KV heads of the model: ``num_query_groups`` (GQA), but every query head's own under
    multi-latent attention (MLA's K and V have ``num_attention_heads`` heads; it ignores groups)."""
    if getattr(config, "multi_latent_attention", False):
        return config.num_attention_heads
    return config.num_query_groups or config.num_attention_heads


def _ensure_runtime(transformer_config: Any, *, head_dim: int, v_head_dim: int | None = None) -> Any:
    """The settled runtime, settling it now (at model build, on every rank) if needed."""
    runtime = current_runtime()
    config = _STATE["config"] or FCPConfig(enabled=True)
    if runtime is not None:
        if _STATE["config"] is not None and runtime.config != _STATE["config"]:
            raise FCPStateError(
                f"FCP was settled with {runtime.config} but apply_fcp() was given {_STATE['config']}; "
                "call setup_fcp() with the applied config before building the model"
            )
        return runtime
    return setup_fcp(
        config,
        seq_len=_megatron_training_arg("seq_length"),
        heads=transformer_config.num_attention_heads,
        kv_heads=_kv_heads(transformer_config),
        head_dim=head_dim, v_head_dim=v_head_dim,
        dtype_bytes=torch.tensor([], dtype=transformer_config.params_dtype).element_size(),
        micro_batch=_megatron_training_arg("micro_batch_size") or 1,
        windows=model_windows(transformer_config),
    )


def _megatron_training_arg(name: str) -> int | None:
    """``--seq-length`` (``seq_length``) or another integer argument of a Megatron-LM run when
    ``megatron.training`` holds parsed args, else None."""
    try:
        from megatron.training import get_args  # noqa: PLC0415
    except ImportError:
        return None
    try:
        return int(getattr(get_args(), name))
    except (AssertionError, AttributeError, TypeError):
        return None


# ---- patch route -----------------------------------------------------------------------------------
def _make_replacement(original: type) -> type:
    """A subclass of FCPCoreAttention standing in for ``original`` (cp = 1 -> the original)."""

    def __new__(cls, *args: Any, **kwargs: Any):  # noqa: N807
        config = kwargs.get("config", args[0] if args else None)
        refuse_hybrid_cp(f"FCP in place of {original.__name__}", config=config, check_process_groups=True)
        pg = kwargs.get("pg_collection", kwargs.get("model_comm_pgs"))
        if _group_size(_cp_group_from(pg)) == 1:
            return original(*args, **kwargs)  # not an instance of cls: __init__ is skipped
        return torch.nn.Module.__new__(cls)

    name = f"FCPCoreAttention_{original.__name__}"
    return type(name, (FCPCoreAttention,), {"__new__": __new__, "__module__": __name__,
                                              "__qualname__": name, "fcp_original": original})


def _make_forward_guard(original_forward: Any) -> Any:
    def forward(self, *args: Any, **kwargs: Any):
        cfg = getattr(self, "config", None)
        if (_STATE["config"] is not None and getattr(cfg, "context_parallel_size", 1) > 1
                and not getattr(self, "_fcp_fallback", False)):  # allowed by --fcp-fallback megatron
            raise FCPStateError(
                f"{type(self).__name__} (layer {getattr(self, 'layer_number', '?')}) was built before "
                "apply_fcp() and would run Megatron's own CP communication; build the model after "
                "apply_fcp() (see docs/megatron.md, 'Order of setup')"
            )
        return original_forward(self, *args, **kwargs)

    return forward


def _original_classes() -> dict[str, type | None]:
    """Resolve the attention classes; the local one is required, TE's optional at import."""
    from megatron_fcp.patches import resolve_target  # noqa: PLC0415

    found: dict[str, type | None] = {}
    for target in (LOCAL_ATTENTION, TE_ATTENTION):
        try:
            owner, attr = resolve_target(target)
            found[target] = getattr(owner, attr)
        except PatchTargetError:
            if target == LOCAL_ATTENTION:
                raise
            found[target] = None
        if not isinstance(found[target], type):
            # megatron-core binds a MagicMock when Transformer Engine is not installed: no TE spec
            # can be built then, so there is nothing to patch.
            if target == LOCAL_ATTENTION:
                raise PatchTargetError(f"{target} is not a class in megatron-core {megatron_core_version()}")
            logger.info("megatron_fcp: Transformer Engine not installed; %s left alone", target)
            found[target] = None
    return found


def _install_patches() -> None:
    """Install the spec-binding replacements and the forward guards (see the module note)."""
    from megatron_fcp.patches import resolve_target  # noqa: PLC0415

    for target, original in _original_classes().items():
        if original is None:
            continue
        if target == TE_ATTENTION:
            check_te_signature(original)  # a release with parameters FCP does not know is refused here
        patched_any = False
        for module, attr, required in _SPEC_BINDINGS[target]:
            spec_target = f"{module}:{attr}"
            try:
                owner, name = resolve_target(spec_target)
            except PatchTargetError:
                if required:
                    raise
                continue
            bound = getattr(owner, name)
            if bound is not original and not getattr(bound, "__fcp_patched__", False):
                continue  # that module binds something else under this name: not ours to touch
            REGISTRY.install(spec_target, _make_replacement, group=GROUP)
            patched_any = True
        if not patched_any:
            logger.warning(
                "megatron_fcp: no spec binding of %s found in megatron-core %s; specs keep Megatron's "
                "attention there (its forward is guarded, so CP > 1 fails loudly). Use the spec route: "
                "core_attention=FCPCoreAttention", target, megatron_core_version())
        REGISTRY.install(f"{target}.forward", _make_forward_guard, group=GROUP)
    try:  # packed batches: RoPE by FCP's placement (every supported megatron-core has the binding)
        resolve_target(ROPE_TARGET)
    except PatchTargetError:
        logger.warning("megatron_fcp: %s not found in megatron-core %s; packed (THD) batches with CP > 1 "
                       "would be rotated by Megatron's own layout, so FCPCoreAttention refuses them",
                       ROPE_TARGET, megatron_core_version())
        return
    REGISTRY.install(ROPE_TARGET, make_rope, group=GROUP)


def apply_fcp(config: FCPConfig | None = None) -> list[str]:
    """Patch Megatron so specs built from now on use FCP attention for CP > 1.

    Idempotent (a second call patches nothing and returns the same targets); ``config`` defaults
    to ``FCPConfig(enabled=True)``. A disabled config patches nothing. Megatron's hybrid/dynamic
    CP (``initialize_model_parallel(hybrid_context_parallel=True)`` or Megatron-LM's
    ``--hybrid-context-parallel``) is refused here with
    :class:`~megatron_fcp.patches.compat.HybridCPUnsupportedError`, before anything is patched. The
    plan itself is settled by :func:`~megatron_fcp.patches.runtime.setup_fcp` (or automatically when
    the first FCP attention
    module is built). Returns the patched targets.
    """
    config = config if config is not None else FCPConfig(enabled=True)
    if not config.enabled:
        logger.info("megatron_fcp: FCP disabled (--fcp not given); Megatron's attention unchanged")
        return []
    previous = _STATE["config"]
    if previous is not None and previous != config:
        raise FCPStateError(f"apply_fcp() already applied with {previous}; call revert_fcp() first")
    check_megatron_version()
    refuse_hybrid_cp("apply_fcp()", check_process_groups=True, check_training_args=True)
    refuse_cp_comm_type_args()  # Megatron-LM's --cp-comm-type, where parsed
    try:
        _install_patches()
    except BaseException:
        if previous is None:
            REGISTRY.revert(GROUP)  # all or nothing: no half-patched megatron-core
        raise
    _STATE["config"] = config
    return REGISTRY.targets(GROUP)


def revert_fcp() -> list[str]:
    """Undo :func:`apply_fcp` exactly and forget the settled plans; returns the restored targets."""
    _STATE["config"] = None
    for logged in ("cp_comm_logged", "fallback_logged"):  # a later apply_fcp logs afresh
        _STATE.pop(logged, None)
    reset_fcp()
    return REGISTRY.revert(GROUP)


def is_fcp_applied() -> bool:
    return _STATE["config"] is not None


@contextlib.contextmanager
def fcp_patched(config: FCPConfig | None = None) -> Iterator[list[str]]:
    """``with fcp_patched(cfg): build_model()`` -- patches inside, exact revert in ``finally``."""
    already = is_fcp_applied()
    targets = apply_fcp(config)
    try:
        yield targets
    finally:
        if not already:
            revert_fcp()


def assert_model_uses_fcp(model: torch.nn.Module) -> int:
    """Raise :class:`FCPStateError` if a CP > 1 attention module of ``model`` is not FCP's.

    Returns how many FCP attention modules the model has. Checks ``core_attention`` children by
    the CP size they were built with, so cp = 1 models (Megatron's own attention) pass.
    """
    count = 0
    for name, module in model.named_modules():
        if not name.endswith("core_attention"):
            continue
        if isinstance(module, FCPCoreAttention):
            count += module.cp_size > 1
            continue
        cfg = getattr(module, "config", None)
        if getattr(cfg, "context_parallel_size", 1) > 1:
            raise FCPStateError(
                f"{name} is {type(module).__name__}, built without FCP (megatron-core "
                f"{megatron_core_version()}); call apply_fcp() before building the model"
            )
    return count
