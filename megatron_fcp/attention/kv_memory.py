"""Which received KV a rank holds between forward and backward: ``keep`` or ``resend``.

Note [Backward KV modes]
------------------------
Backward recomputes each block's scores from its K and V (flash-attn's recipe), so a rank needs
every block it computed on again. Two ways to have them:

* ``keep`` -- the forward saves every received block it needs until backward. Fastest backward
  (no KV traffic), but a rank holds its whole need set between the two passes: under causal zigzag
  CP rank 0 keeps ``2*(cp-1)`` of the ``2*cp`` chunks, ``cp-1`` times its own KV; for every layer.
* ``resend`` -- nothing received is saved: backward re-sends the KV *wave by wave* (Note [Backward
  waves] in :mod:`megatron_fcp.attention.backward_waves`): each wave brings every rank at most half
  a shard's K and V along the plan's transfers (owner and relays send, readers keep what they need
  until computed), its dK/dV go back along those transfers reversed, and the next wave's re-send
  and the previous wave's reduction overlap its compute. Between the passes a rank holds only its
  own K and V; within backward at most two waves, i.e. one shard's K and V: what Transformer
  Engine's ring holds in flight beside its own KV (a packed batch: the largest shard's, unless one
  block is larger than half of it). ``keep`` walks the same waves (without the re-send), so the
  arithmetic and its order are the same: ``resend`` and ``keep`` give bitwise identical outputs
  and gradients for a fixed plan. Cost (:func:`~megatron_fcp.planning.packed_cost.simulate_backward_waves`,
  128K tokens on ``dgx-h100:2``): fwd+bwd 1.07x keep's one-pass backward with two parts per
  chunk, 1.33x with whole chunks (causal zigzag: per wave some ranks have twice the work of others).
* ``auto`` -- ``keep`` while the kept bytes fit the budget on *every* rank of the group, else
  ``resend``. The choice must be the same on all ranks (re-sending needs the senders), so it is
  taken from the plan, which every rank holds whole, not from one rank's own needs.

A ring plan's backward does not run in waves: it streams one hop per step as Transformer Engine's
ring does (Note [Streaming chain backward] in :mod:`megatron_fcp.planning.chains`), and under
``auto`` keeps what each rank receives in the first sub-round when that fits the budget (one
shard: TE's ring saves its last received shard for its backward), which saves one step.

The default budget (``RING_BUDGET``) is what the ring holds in flight beyond its own KV: one more
KV pair the size of the rank's own shard. So ``auto`` never holds more received KV between the
passes than the ring holds at any time; with cp = 2 causal it keeps (rank 0 needs exactly one
shard's worth), with larger groups it re-sends.

In both modes the forward frees a received block as soon as it is computed on and forwarded (a
relay drops what it only passes on), and :class:`~megatron_fcp.attention.function.FCPStats`
records the bytes: ``saved_kv_bytes`` (received KV held from forward to backward),
``peak_kv_bytes`` (received KV alive at once within the call), ``backward_peak_kv_bytes`` (within
backward: kept, or the re-sent waves), ``backward_waves`` and ``resend_bytes_sent``.
"""

from __future__ import annotations

# The decision is pure planning (it reads only the plan): it lives in megatron_fcp.planning.waves,
# where the planner prices candidates with the backward the executor will run.
from megatron_fcp.planning.waves import BACKWARD_KV_MODES, RING_BUDGET, choose_backward_kv, kept_bytes_per_rank

__all__ = ["BACKWARD_KV_MODES", "RING_BUDGET", "kept_bytes_per_rank", "choose_backward_kv"]
