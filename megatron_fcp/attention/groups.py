"""CP group membership: a ``torch.distributed`` process group, or a virtual group inside one process.

The attention engine needs three things from its CP group: the group's global ranks in CP order
and the caller's own rank (validation, plans), a transport for the plan's transfers, and a small
all-gather for the agreement step (:mod:`megatron_fcp.attention.agreement`). A real process group provides
them through ``torch.distributed``; a :class:`VirtualGroup` provides them itself, so the same
engine runs several CP ranks as threads of one process (:mod:`megatron_fcp.testing.inprocess`) without
touching ``torch.distributed`` at all (nothing is monkeypatched).
"""

from __future__ import annotations

from typing import Any

__all__ = ["VirtualGroup", "group_membership"]


class VirtualGroup:
    """One rank's handle on a CP group that is not a ``torch.distributed`` process group.

    Pass it as ``cp_group`` to :func:`~megatron_fcp.attention.function.fcp_attention_with_lse`.
    Subclasses set ``ranks`` (the group's global ranks in CP order) and ``rank`` (the caller's
    global rank) and implement :meth:`transport` and :meth:`all_gather_object`.
    """

    ranks: tuple[int, ...]
    rank: int

    def transport(self, timeout_s: float):
        """The :class:`~megatron_fcp.attention.comm.Transport` this rank posts its transfers on."""
        raise NotImplementedError

    def all_gather_object(self, obj: Any, timeout_s: float, what: str) -> list[Any]:
        """Every rank's ``obj`` in CP order (each rank calls it once); bounded by ``timeout_s``."""
        raise NotImplementedError


def group_membership(cp_group) -> tuple[tuple[int, ...], int]:
    """``(global ranks of cp_group in CP order, this caller's global rank)``; ValueError naming
    the fix when there is no group or ``torch.distributed`` is not initialised."""
    if isinstance(cp_group, VirtualGroup):
        return tuple(cp_group.ranks), cp_group.rank
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("torch.distributed is not initialised; call dist.init_process_group first "
                         "(or run the ranks in one process: megatron_fcp.testing.inprocess.run_ranks)")
    if cp_group is None:
        raise ValueError("cp_group is required (e.g. parallel_state.get_context_parallel_group())")
    return tuple(dist.get_process_group_ranks(cp_group)), dist.get_rank()
