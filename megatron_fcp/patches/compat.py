"""What the installed megatron-core offers, looked up in it rather than assumed from its version.

megatron-core moves names between releases (0.14-0.19 are declared): RoPE's CUDA move lives in
``RotaryEmbedding.forward`` up to 0.15 and in ``get_emb`` from 0.16; ``get_batch_on_this_cp_rank``
takes ``(batch)`` up to 0.15, ``(batch, cp_group=None)`` in 0.16-0.17 and ``(batch, is_hybrid_cp,
cp_group=None, ...)`` from 0.18. This module answers such questions by inspecting the installed
objects (``hasattr``, ``inspect.signature``, ``inspect.getsource``), so a release that renames or
fixes something is handled by what it *has*, not by a version table.

It also holds FCP's refusal of Megatron's hybrid (dynamic) context parallelism, which exists from
megatron-core 0.16 (``TransformerConfig.hybrid_context_parallel``, ``--hybrid-context-parallel``,
``PackedSeqParams.cp_group`` / ``local_cp_size``): hybrid CP picks a CP group per micro batch,
while FCP's plans belong to the fixed CP groups settled before the first step. Mixing the two
would run FCP's plan over a group it was not built for, so every entry point refuses it.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

from megatron_fcp.patches import PatchTargetError, megatron_core_version, resolve_target

__all__ = [
    "has_target",
    "source_mentions",
    "cp_batch_splitter",
    "HybridCPUnsupportedError",
    "HYBRID_CP_HELP",
    "refuse_hybrid_cp",
]

logger = logging.getLogger("megatron_fcp.patches")


# ---- looking things up -----------------------------------------------------------------------------
def has_target(target: str) -> bool:
    """True when ``"pkg.mod:Class.attr"`` resolves in the installed megatron-core."""
    try:
        resolve_target(target)
    except PatchTargetError:
        return False
    return True


def source_mentions(obj: Any, words: tuple[str, ...]) -> bool | None:
    """Whether the source of ``obj`` (unwrapping decorators) contains one of ``words``.

    ``None`` when the source cannot be read (a compiled build): callers then assume the worst.
    """
    try:
        source = inspect.getsource(inspect.unwrap(obj))
    except (OSError, TypeError):
        return None
    return any(word in source for word in words)


# ---- get_batch_on_this_cp_rank -----------------------------------------------------------------------
def cp_batch_splitter(fn: Callable[..., dict] | None = None) -> Callable[..., dict]:
    """Megatron's ``get_batch_on_this_cp_rank`` behind one calling convention.

    Returns ``split(batch, cp_group=None) -> batch`` (zigzag: CP rank r keeps chunks r and
    2cp-1-r of every sequence). The installed function's signature decides how it is called:
    ``(batch)``; ``(batch, cp_group=None)``; ``(batch, is_hybrid_cp, cp_group=None, ...)``, where
    ``is_hybrid_cp=False`` is passed (FCP refuses hybrid CP, see :func:`refuse_hybrid_cp`).
    Where the function accepts ``cp_group`` it always gets one: the given group, else
    ``parallel_state``'s CP group. (From 0.18 a missing ``cp_group`` means the *default* group to
    ``torch.distributed.get_world_size``, i.e. the whole world, not the CP group.) Older
    functions read ``parallel_state``'s CP group themselves, so a ``cp_group`` given there must be
    that group. Any other required parameter raises
    :class:`~megatron_fcp.patches.PatchTargetError` naming the signature.
    """
    if fn is None:
        from megatron.core.utils import get_batch_on_this_cp_rank as fn  # noqa: PLC0415
    params = inspect.signature(fn).parameters
    names = list(params)
    known = {names[0], "is_hybrid_cp", "cp_group"} if names else set()
    unknown = [n for n, p in params.items() if n not in known and p.default is inspect.Parameter.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not names or unknown:
        raise PatchTargetError(
            f"megatron.core.utils.get_batch_on_this_cp_rank{inspect.signature(fn)} in megatron-core "
            f"{megatron_core_version()} has parameters FCP does not know ({unknown or 'no batch'}); "
            "megatron_fcp supports (batch), (batch, cp_group=None) and (batch, is_hybrid_cp, cp_group=None)"
        )
    takes_hybrid = "is_hybrid_cp" in params
    takes_group = "cp_group" in params

    def split(batch: dict, cp_group: Any = None) -> dict:
        from megatron.core import parallel_state as ps  # noqa: PLC0415

        kwargs: dict[str, Any] = {}
        if takes_hybrid:
            kwargs["is_hybrid_cp"] = False
        if takes_group:
            kwargs["cp_group"] = cp_group if cp_group is not None else ps.get_context_parallel_group()
        elif cp_group is not None and cp_group is not ps.get_context_parallel_group(check_initialized=False):
            raise ValueError(
                f"get_batch_on_this_cp_rank in megatron-core {megatron_core_version()} takes no cp_group "
                "and splits over parallel_state's CP group; pass that group or none"
            )
        return fn(batch, **kwargs)

    split.__doc__ = f"get_batch_on_this_cp_rank{inspect.signature(fn)} called as split(batch, cp_group=None)"
    return split


# ---- hybrid / dynamic context parallelism ------------------------------------------------------------
HYBRID_CP_HELP = (
    "FCP does not serve Megatron's hybrid (dynamic) context parallelism: hybrid CP "
    "(--hybrid-context-parallel, TransformerConfig.hybrid_context_parallel) chooses a CP group per "
    "micro batch (PackedSeqParams.cp_group / local_cp_size), but FCP's communication plans belong to "
    "the fixed CP groups settled before the first step, so the two cannot be mixed. Either drop "
    "--hybrid-context-parallel and run FCP on a fixed --context-parallel-size, or keep hybrid CP and "
    "drop --fcp (Megatron's own Transformer Engine attention then runs it)."
)


class HybridCPUnsupportedError(NotImplementedError):
    """Megatron's hybrid/dynamic CP was requested together with FCP (message says what to do)."""


def _hybrid_groups_exist() -> bool:
    """True when ``initialize_model_parallel(hybrid_context_parallel=True)`` built hybrid groups."""
    try:
        from megatron.core import parallel_state as ps  # noqa: PLC0415
    except ImportError:
        return False
    return bool(getattr(ps, "_HYBRID_DP_CP_GROUPS", None))


def _megatron_training_args() -> Any:
    """Megatron-LM's parsed args when ``megatron.training`` exists and has parsed them, else None."""
    try:
        from megatron.training import global_vars  # noqa: PLC0415
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def refuse_hybrid_cp(
    where: str,
    *,
    config: Any = None,
    args: Any = None,
    packed_seq_params: Any = None,
    check_process_groups: bool = False,
    check_training_args: bool = False,
) -> None:
    """Raise :class:`HybridCPUnsupportedError` if any given source asks for hybrid CP.

    ``where`` names the FCP entry point in the message. Sources: a ``TransformerConfig``
    (``hybrid_context_parallel``), parsed Megatron-LM ``args`` (``--hybrid-context-parallel``),
    a ``PackedSeqParams`` carrying a per-micro-batch ``cp_group`` or ``local_cp_size``, the hybrid
    DPxCP groups of ``parallel_state``, and ``megatron.training``'s global args. Pure lookups: no
    communication, so callers refuse before any plan or communicator exists.
    """
    reasons = []
    if getattr(config, "hybrid_context_parallel", False):
        reasons.append("TransformerConfig.hybrid_context_parallel=True")
    if getattr(args, "hybrid_context_parallel", False):
        reasons.append("--hybrid-context-parallel")
    if packed_seq_params is not None and (
        getattr(packed_seq_params, "cp_group", None) is not None
        or getattr(packed_seq_params, "local_cp_size", None) is not None
    ):
        reasons.append("packed_seq_params with a per-micro-batch cp_group/local_cp_size")
    if check_process_groups and _hybrid_groups_exist():
        reasons.append("parallel_state was initialised with hybrid_context_parallel=True")
    if check_training_args and getattr(_megatron_training_args(), "hybrid_context_parallel", False):
        reasons.append("megatron.training args have --hybrid-context-parallel")
    if reasons:
        raise HybridCPUnsupportedError(f"{where}: {'; '.join(reasons)}. {HYBRID_CP_HELP}")
