"""``FCPStats``: what one ``fcp_attention`` call on this rank took (times) and moved or held (bytes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["FCPStats"]


@dataclass
class FCPStats:
    """Times (seconds, host clock) and bytes of one ``fcp_attention`` call on this rank.

    ``*_compute_s``: block kernels + merges; ``*_wait_s``: time blocked waiting for transfers
    (the communication that compute did not hide); ``*_total_s``: the whole pass. ``comm_only_s``
    is filled by :func:`measure_comm_only` (the plan's transfers with no compute at all). On CUDA
    the host clock only sees launches unless the caller synchronises.
    """

    forward_total_s: float = 0.0
    forward_compute_s: float = 0.0
    forward_wait_s: float = 0.0
    backward_total_s: float = 0.0
    backward_compute_s: float = 0.0
    backward_wait_s: float = 0.0
    forward_bytes_sent: int = 0
    backward_bytes_sent: int = 0
    comm_only_s: float | None = None
    backward_kv: str | None = None   # "keep" or "resend" (Note [Backward KV modes] in schedule.program)
    saved_kv_bytes: int = 0          # received KV held from forward to backward
    peak_kv_bytes: int = 0           # received KV alive at once within the call (forward or backward)
    backward_peak_kv_bytes: int = 0  # received KV alive at once within backward (kept, or re-sent waves)
    backward_waves: int = 0          # waves the backward ran (Note [Backward waves] in backward_waves)
    backward_form: str | None = None  # "chain" (a ring's streaming steps) or "waves" (Note [Streaming chain backward])
    ring_kv_bytes: int = 0           # what TE's p2p ring holds in flight beside its own KV: one shard's K and V
    resend_bytes_sent: int = 0       # KV this rank re-sent in backward (resend mode)
    head_parallel_bytes_sent: int = 0  # head-parallel all-to-alls, forward and backward (attention.head_parallel)

    def as_dict(self) -> dict:
        return asdict(self)
