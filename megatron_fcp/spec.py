"""The ``--spec`` route: FCP layer specs for Megatron-LM's ``--spec MODULE NAME``.

    pretrain_gpt.py ... --context-parallel-size 8 --spec megatron_fcp.spec fcp_layer_spec
    MEGATRON_FCP_CONFIG=fcp.yaml pretrain_gpt.py ... --spec megatron_fcp.spec fcp_layer_spec

Two names, for the two ways Megatron-LM resolves ``--spec`` (``spec_utils.import_module`` returns
``vars(module)[NAME]``):

* :func:`fcp_layer_spec` ``(config, vp_stage=None)`` -- a callable. megatron-core 0.19's
  ``GPTModelBuilder.build_model`` calls it at model build (process groups exist) with the
  ``GPTModelConfig`` and, since the signature has it, ``vp_stage``. It applies FCP first, then
  builds *Megatron's own default spec* for that config (``megatron.training.models.gpt.
  default_layer_spec``: the local or Transformer Engine layer spec, or the MoE block spec with its
  ``layer_specs``), so every core attention of it is FCP's for CP > 1. MTP layers are derived by
  the builder from the returned spec after FCP is applied, so they get FCP too. Without
  ``megatron.training.models`` (0.17), or when called with a bare ``TransformerConfig``, the
  local/TE/MoE spec is built from the config's own fields.
* ``fcp_local_layer_spec`` -- a ``ModuleSpec`` object (megatron-core's local GPT layer with
  :class:`FCPSpecAttention` in the ``core_attention`` slot), for builders that use the imported
  object as the spec itself. It is built at import (no process group needed); FCP is applied and
  settled when the first attention module is constructed.

Options: the ``--fcp-*`` flags where the run registered them (``megatron_fcp.run``, or the
script's ``extra_args_provider``), else the YAML file named by ``$MEGATRON_FCP_CONFIG`` (its
``fcp:`` section), else the defaults. The spec route always enables FCP (naming the spec is the
opt-in); ``--fcp-config`` itself is a flag, so it needs the flags registered.

Caveats (docs/megatron.md, "The --spec route"):

* ``--attention-backend local`` makes 0.19's builder overwrite every ``core_attention`` with
  megatron-core's local ``DotProductAttention`` *after* the spec function ran (and that class
  asserts cp = 1): with CP > 1 the spec route refuses it up front. Use the default ``auto``.
* A spec module is imported by name: a driver that names *itself* (``--spec pretrain_gpt fn``) is
  imported a second time, apart from ``__main__``; keep FCP's state out of the driver.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from megatron_fcp.config import FCPConfig
from megatron_fcp.patches.megatron import FCPCoreAttention

__all__ = ["CONFIG_ENV", "spec_route_config", "fcp_layer_spec", "fcp_local_layer_spec", "FCPSpecAttention",
           "use_fcp_attention"]

#: environment variable naming a YAML file whose ``fcp:`` section configures the spec route
CONFIG_ENV = "MEGATRON_FCP_CONFIG"


def _training_args() -> Any:
    """Megatron-LM's parsed args, or None (no megatron.training, or nothing parsed yet)."""
    try:
        from megatron.training import get_args  # noqa: PLC0415

        return get_args()
    except (ImportError, AssertionError):
        return None


def spec_route_config(args: Any = None) -> FCPConfig:
    """The FCP options of a ``--spec`` run: flags where registered, else ``$MEGATRON_FCP_CONFIG``."""
    args = args if args is not None else _training_args()
    if args is not None and hasattr(args, "fcp"):
        from megatron_fcp.patches.args import fcp_config_from_args  # noqa: PLC0415

        return fcp_config_from_args(args, base=FCPConfig(enabled=True)).replace(enabled=True)
    path = os.environ.get(CONFIG_ENV)
    if path:
        return FCPConfig.from_yaml(path).replace(enabled=True)
    return FCPConfig(enabled=True)


def _settle(transformer_config: Any = None) -> None:
    """Apply FCP (idempotent) and, where Megatron-LM's args exist, settle the plans from them."""
    from megatron_fcp.patches.megatron import apply_fcp, is_fcp_applied  # noqa: PLC0415

    args = _training_args()
    config = spec_route_config(args)
    cp = getattr(transformer_config, "context_parallel_size", None) or getattr(args, "context_parallel_size", 1)
    backend = getattr(args, "attention_backend", None)
    if cp > 1 and backend is not None and getattr(backend, "name", str(backend)).endswith("local"):
        raise ValueError(
            "--spec megatron_fcp.spec with --attention-backend local: Megatron's builder replaces every "
            "core_attention with its local DotProductAttention after the spec is built (cp = 1 only); "
            "drop --attention-backend local (the default, auto, keeps FCP's attention)")
    if not is_fcp_applied():
        apply_fcp(config)
    if args is not None:
        from megatron_fcp.patches.megatron_lm import enable_fcp_from_megatron_args  # noqa: PLC0415

        enable_fcp_from_megatron_args(args, config)


def use_fcp_attention(spec: Any) -> int:
    """Put FCP in every ``core_attention`` slot of ``spec`` (a layer ModuleSpec or a block spec
    with ``layer_specs``) that does not hold an FCP class yet; returns how many slots hold FCP."""
    layers = getattr(spec, "layer_specs", None)
    count = 0
    for layer in (layers if layers is not None else [spec]):
        attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
        sub = getattr(attention, "submodules", None)
        if sub is None or not hasattr(sub, "core_attention"):
            continue
        core = sub.core_attention
        if not (inspect.isclass(core) and issubclass(core, FCPCoreAttention)):
            sub.core_attention = FCPCoreAttention
        count += 1
    return count


def _spec_from_transformer_config(t: Any, vp_stage: int | None) -> Any:
    """Megatron's GPT spec for a bare ``TransformerConfig`` (local, TE, or the MoE block spec)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs  # noqa: PLC0415

    use_te = getattr(t, "transformer_impl", "local") == "transformer_engine"
    if getattr(t, "num_moe_experts", None):
        return specs.get_gpt_decoder_block_spec(t, use_transformer_engine=use_te,
                                                normalization=getattr(t, "normalization", None), vp_stage=vp_stage)
    build = specs.get_gpt_layer_with_transformer_engine_spec if use_te else specs.get_gpt_layer_local_spec
    kwargs = {} if use_te else {"normalization": getattr(t, "normalization", None)}
    return build(getattr(t, "num_moe_experts", None), getattr(t, "moe_grouped_gemm", False),
                 getattr(t, "qk_layernorm", False), getattr(t, "multi_latent_attention", False), **kwargs)


def fcp_layer_spec(config: Any, vp_stage: int | None = None) -> Any:
    """``--spec megatron_fcp.spec fcp_layer_spec``: Megatron's default GPT spec, FCP attention.

    ``config`` is 0.19's ``GPTModelConfig`` (``.transformer`` holds the TransformerConfig) or a
    TransformerConfig. Call at model build, after the process groups exist (0.19's builder does).
    """
    transformer = getattr(config, "transformer", config)
    _settle(transformer)
    spec = None
    if transformer is not config:
        try:
            from megatron.training.models.gpt import default_layer_spec  # noqa: PLC0415
        except ImportError:
            default_layer_spec = None
        if default_layer_spec is not None:
            spec = default_layer_spec(config, vp_stage)  # built after apply_fcp: patched bindings
    if spec is None:
        spec = _spec_from_transformer_config(transformer, vp_stage)
    use_fcp_attention(spec)
    return spec


class FCPSpecAttention(FCPCoreAttention):
    """:class:`FCPCoreAttention` that applies and settles FCP (:func:`spec_route_config`) when the
    first one is constructed -- for specs built before the process groups exist."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        _settle(config)
        super().__init__(config, *args, **kwargs)


def _local_spec_with_fcp() -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = FCPSpecAttention
    return spec


#: ``--spec megatron_fcp.spec fcp_local_layer_spec``: the local GPT layer spec, FCP attention
fcp_local_layer_spec = _local_spec_with_fcp()
