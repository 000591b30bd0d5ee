"""FCP inside Megatron-LM's own ``pretrain()``: the two hooks the zero-edit launcher installs.

:mod:`megatron_fcp.run` runs an unmodified ``pretrain_gpt.py``. It needs two things from
``megatron.training``, and both are module-global bindings that megatron-core 0.17, 0.18, 0.19
and Megatron-LM's main branch look up at call time (checked in each wheel's sources):

====================================================================  ===============================
binding                                                               why this one
====================================================================  ===============================
``megatron.training.arguments:add_megatron_arguments``                every parse entry point ends
                                                                      there: ``parse_args`` (0.17:
                                                                      called by ``pretrain`` ->
                                                                      ``initialize_megatron``;
                                                                      0.18+: by
                                                                      ``parse_and_validate_args``
                                                                      in the script). Wrapped to add
                                                                      the ``--fcp-*`` flags, so they
                                                                      land in ``get_args()``.
``megatron.training.training:setup_model_and_optimizer``              called by ``pretrain`` after
                                                                      ``initialize_megatron`` (the
                                                                      process groups exist) and
                                                                      before the model: through
                                                                      ``get_model(model_provider)``
                                                                      (0.17, 0.18) or
                                                                      ``GPTModelBuilder`` (0.19,
                                                                      which never calls
                                                                      ``get_model``). Wrapped to
                                                                      call
                                                                      :func:`enable_fcp_from_megatron_args`
                                                                      first.
====================================================================  ===============================

Both go through :data:`megatron_fcp.patches.REGISTRY` (group ``"megatron_lm"``): idempotent,
logged, exactly reverted by :func:`revert_launch_hooks`. megatron-core 0.14-0.16 wheels ship no
``megatron.training``: :func:`require_megatron_training` says so and names the fix.

Note [Why setup_model_and_optimizer]
------------------------------------
FCP must be applied after ``initialize_model_parallel`` (the plan is settled per CP group) and
before any layer spec is built (the patch route replaces the class bindings spec builders read).
``initialize_megatron`` is too early on 0.17 only if hooked before its own parse; ``get_model`` is
skipped by 0.19's builder path; the model provider is the user's. ``setup_model_and_optimizer``
is the one call of ``pretrain`` that sits between the two on every release line. A spec the
script built *before* ``pretrain()`` (a ``ModuleSpec`` object named by ``--spec``) is not reached
by the patch route; the attention guard makes such a model fail on its first call with CP > 1
(``FCPStateError``) instead of silently running Megatron's ring. Use :mod:`megatron_fcp.spec`
there.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from megatron_fcp.patches import REGISTRY, megatron_core_version

__all__ = [
    "MegatronTrainingMissingError",
    "require_megatron_training",
    "enable_fcp_from_megatron_args",
    "install_launch_hooks",
    "revert_launch_hooks",
    "ARGS_HOOK",
    "MODEL_HOOK",
]

logger = logging.getLogger("megatron_fcp.patches")

GROUP = "megatron_lm"
ARGS_HOOK = "megatron.training.arguments:add_megatron_arguments"
MODEL_HOOK = "megatron.training.training:setup_model_and_optimizer"


class MegatronTrainingMissingError(ImportError):
    """``megatron.training`` cannot be imported (megatron-core 0.14-0.16 wheels, or no Megatron)."""


def require_megatron_training() -> None:
    """Import ``megatron.training.{arguments,training}`` or raise naming the version and the fix."""
    try:
        import megatron.training.arguments  # noqa: F401,PLC0415
        import megatron.training.training  # noqa: F401,PLC0415
    except ImportError as exc:
        version = megatron_core_version()
        raise MegatronTrainingMissingError(
            f"megatron_fcp.run needs Megatron-LM's training loop (megatron.training), which "
            f"megatron-core {version} does not provide ({exc}). The megatron-core wheels ship it from "
            "0.17 on (pip install 'megatron-core>=0.17' on Python 3.12); with 0.14-0.16 put a "
            "Megatron-LM checkout of that release on PYTHONPATH, or call megatron_fcp.apply_fcp() "
            "in your own model provider (docs/megatron.md, 'Three ways in')"
        ) from exc


def enable_fcp_from_megatron_args(args: Any = None, config: Any = None) -> Any:
    """Apply FCP and settle the plans from Megatron-LM's parsed args (``get_args()``).

    ``config`` (an :class:`~megatron_fcp.config.FCPConfig`) defaults to the ``--fcp-*`` flags of
    ``args``. Call on every rank after ``initialize_megatron`` and before the model is built.
    Idempotent (virtual pipeline stages, a second model build). Returns the settled
    :class:`~megatron_fcp.patches.runtime.FCPRuntime`, or None when FCP is not enabled.
    """
    from megatron.training import get_args, print_rank_0  # noqa: PLC0415

    from megatron_fcp.patches.args import fcp_config_from_args  # noqa: PLC0415
    from megatron_fcp.patches.megatron import apply_fcp  # noqa: PLC0415
    from megatron_fcp.patches.runtime import current_runtime, setup_fcp  # noqa: PLC0415

    args = args if args is not None else get_args()
    config = config if config is not None else fcp_config_from_args(args)
    if not config.enabled:
        return None
    apply_fcp(config)
    runtime = current_runtime()
    if runtime is None or runtime.config != config:
        heads = args.num_attention_heads
        runtime = setup_fcp(
            config,
            seq_len=args.seq_length,
            heads=heads,
            kv_heads=args.num_query_groups if getattr(args, "group_query_attention", False) else heads,
            head_dim=args.kv_channels or args.hidden_size // heads,
            dtype_bytes=2 if (args.bf16 or args.fp16) else 4,
            micro_batch=args.micro_batch_size,
        )
        if args.context_parallel_size > 1:
            print_rank_0(runtime.summary(0))
    return runtime


def _make_args_hook(original: Callable) -> Callable:
    def add_megatron_arguments(parser: Any) -> Any:
        """Megatron-LM's arguments, then the ``--fcp-*`` flags (megatron_fcp.run)."""
        from megatron_fcp.patches.args import add_fcp_args  # noqa: PLC0415

        return add_fcp_args(original(parser))  # add_fcp_args is a no-op if the script adds them too

    return add_megatron_arguments


def _make_model_hook(original: Callable) -> Callable:
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        """FCP applied and settled from ``get_args()``, then Megatron-LM's own setup (megatron_fcp.run)."""
        enable_fcp_from_megatron_args()
        return original(*args, **kwargs)

    return setup_model_and_optimizer


def install_launch_hooks() -> list[str]:
    """Install both hooks of the module table (idempotent); returns the targets."""
    require_megatron_training()
    REGISTRY.install(ARGS_HOOK, _make_args_hook, group=GROUP)
    REGISTRY.install(MODEL_HOOK, _make_model_hook, group=GROUP)
    return REGISTRY.targets(GROUP)


def revert_launch_hooks() -> list[str]:
    """Restore both bindings exactly; returns the restored targets."""
    return REGISTRY.revert(GROUP)
