"""The attention mask by position: causal, full, and sliding windows. Pure, no ``torch``.

Note [Masks by position]
------------------------
Every mask FCP serves is a rule on a (query position ``q``, key position ``k``) pair inside one
document (zigzag: the whole sequence is one document; packed: positions count from each document's
start, and pairs of two documents are never visible). A :class:`Mask` is that rule::

    visible(q, k)  <=>  q - left <= k <= q + right'          right' = 0 if causal
                                                               left, right = -1: unbounded

This is the convention of Megatron's ``window_size=(left, right)``, Transformer Engine's
``window_size`` and flash-attn's ``window_size_left/right``: query ``i`` sees keys
``i - left .. i + right`` inclusive, so a causal window ``(W, 0)`` sees ``W + 1`` keys (itself and
the ``W`` before it). ``(-1, -1)`` is no window: plain causal or full attention. Under a causal mask
the right side is 0 (``-1`` is accepted and means the same); ``right > 0`` with ``causal`` is refused,
as Transformer Engine refuses it: Megatron's local attention would apply such a window *instead of*
the causal mask, TE's never, so no silent choice between the two is made here.

The visible keys of query ``q`` are the interval ``[q - left, q + right']``, so the number of
visible pairs between a query range and a key range is a difference of two clamped ramps
(:meth:`Mask.pairs`): the keys at most ``q + right'`` minus the keys before ``q - left``. Need rules
(a rank needs a block iff it has a visible pair with it), work (pairs are FLOPs) and the kernels'
tile classes (:meth:`Mask.classify`) all derive from this one rule; a test checks
:meth:`Mask.pairs` and :meth:`Mask.classify` against :meth:`Mask.visible` on token grids.

Every query of a windowed causal mask sees at least itself, so no row of a whole sequence is ever
fully masked; a row *can* see nothing inside one block (its window ends before the block), which
the kernels skip, and which the log-sum-exp merge takes as ``lse = -inf`` (Note [Masked rows] in
:mod:`megatron_fcp.attention.merge`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_fcp.jit import jit

__all__ = ["Mask", "CAUSAL", "FULL", "as_mask", "check_window", "parse_window", "FULL_PAIRS", "PARTIAL_PAIRS",
           "NO_PAIRS"]

FULL_PAIRS, PARTIAL_PAIRS, NO_PAIRS = "full", "partial", "masked"
"""Classes of a (query range, key range) pair: every pair visible, some, none."""

_INF = np.iinfo(np.int64).max // 4  # an unbounded side: far beyond any position, no overflow in q +/- it


def check_window(window: Sequence[int] | None) -> tuple[int, int]:
    """``window`` as ``(left, right)`` ints >= -1 (None: ``(-1, -1)``), or a ValueError naming the fix."""
    if window is None:
        return (-1, -1)
    try:
        left, right = (int(x) for x in window)
    except (TypeError, ValueError):
        raise ValueError(f"window={window!r}: pass window=(left, right), two ints (-1 = unbounded), "
                         "as Megatron's --window-size") from None
    if left < -1 or right < -1:
        raise ValueError(f"window={window!r}: each side must be >= 0, or -1 for unbounded")
    return (left, right)


def parse_window(text: str | None, flag: str = "--window") -> tuple[int, int] | None:
    """A command line's ``"L,R"`` (e.g. ``"4096,0"``) as ``(left, right)``, checked; None stays
    None. ValueError naming ``flag`` and the form otherwise (every CLI and the example parse here)."""
    if text is None:
        return None
    try:
        left, right = (int(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected L,R (two integers, -1 = unbounded; e.g. {flag} 4096,0), "
                         f"got {text!r}") from None
    return check_window((left, right))


@dataclass(frozen=True)
class Mask:
    """Which keys a query sees, by position inside a document (Note [Masks by position]).

    causal: keys after the query are masked.
    left, right: the sliding window ``q - left <= k <= q + right`` (-1: that side unbounded);
        ``right`` is 0 under ``causal`` whatever was asked (the causal bound is tighter).
    """

    causal: bool = True
    left: int = -1
    right: int = -1

    def __post_init__(self) -> None:
        left, right = check_window((self.left, self.right))
        if self.causal and right > 0:
            raise ValueError(f"window=({left}, {right}) with a causal mask: a causal query sees no later key, so "
                             "the right side must be 0 (e.g. --window-size W,0); a two-sided window needs a "
                             "non-causal mask (attn_mask_type no_mask)")
        if self.causal:
            right = 0 if left >= 0 else -1  # causal: right is implied; (-1, -1) stays plain causal
        object.__setattr__(self, "left", left)
        object.__setattr__(self, "right", right)
        object.__setattr__(self, "causal", bool(self.causal))

    @classmethod
    def of(cls, causal: bool, window: Sequence[int] | None = None) -> "Mask":
        """The mask of an attention call's ``causal`` and ``window`` arguments."""
        left, right = check_window(window)
        return cls(bool(causal), left, right)

    # ---- facts ----------------------------------------------------------------------------
    @property
    def windowed(self) -> bool:
        """Whether a window bounds either side (beyond what ``causal`` alone does)."""
        return self.left >= 0 or (not self.causal and self.right >= 0)

    @property
    def window(self) -> tuple[int, int]:
        """``(left, right)`` in Megatron's convention (-1: unbounded)."""
        return (self.left, self.right)

    @property
    def offsets(self) -> tuple[int, int]:
        """``(lo, hi)``: key ``k`` is visible to query ``q`` iff ``lo <= k - q <= hi`` (huge = unbounded)."""
        lo = -self.left if self.left >= 0 else -_INF
        hi = 0 if self.causal else (self.right if self.right >= 0 else _INF)
        return lo, hi

    def describe(self) -> str:
        """Short label for reports: ``causal``, ``full``, ``causal window (4096, 0)``."""
        base = "causal" if self.causal else "full"
        return f"{base} window ({self.left}, {self.right})" if self.windowed else base

    # ---- the rule ---------------------------------------------------------------------------
    def visible(self, q_pos, k_pos) -> np.ndarray:
        """Booleans ``[..., n, m]``-broadcast: whether key position ``k_pos`` is visible to ``q_pos``
        (numpy arrays or ints; callers broadcast, e.g. ``q[:, None]`` against ``k[None, :]``)."""
        d = np.asarray(k_pos, dtype=np.int64) - np.asarray(q_pos, dtype=np.int64)
        lo, hi = self.offsets
        return (d >= lo) & (d <= hi)

    def pairs(self, q0, q1, k0, k1) -> np.ndarray:
        """Visible (q, k) pairs with q in ``[q0, q1)`` and k in ``[k0, k1)`` (exact, int64; the
        arguments broadcast): :func:`pair_count` of each."""
        q0, q1, k0, k1 = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (q0, q1, k0, k1)))
        lo, hi = self.offsets
        return _pair_counts(q0.ravel(), q1.ravel(), k0.ravel(), k1.ravel(), lo, hi).reshape(q0.shape)

    def classify(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> str:
        """Class of query positions ``[q_lo, q_hi]`` (an increasing run: every position in between)
        against keys whose positions lie in ``[k_lo, k_hi]`` (inclusive bounds): ``full`` if every
        such pair is visible, ``masked`` if none of the run's queries sees any position of the key
        range, else ``partial``."""
        lo, hi = self.offsets
        if k_hi - q_lo <= hi and k_lo - q_hi >= lo:       # the farthest pairs on both sides are inside
            return FULL_PAIRS
        if k_lo - q_hi > hi or k_hi - q_lo < lo:           # every key after the last window / before the first
            return NO_PAIRS
        return PARTIAL_PAIRS

    def key_range(self, q_lo: int, q_hi: int) -> tuple[int, int]:
        """Inclusive key positions any query of ``[q_lo, q_hi]`` can see (clip key chunks to it)."""
        lo, hi = self.offsets
        return (q_lo + lo if lo > -_INF else -_INF, q_hi + hi if hi < _INF else _INF)


CAUSAL = Mask(True)
FULL = Mask(False)


def as_mask(causal: bool | Mask, window: Sequence[int] | None = None) -> Mask:
    """A :class:`Mask` from either a Mask or the ``causal`` flag plus a ``window`` (checked)."""
    if isinstance(causal, Mask):
        if window is not None and check_window(window) != (-1, -1) and check_window(window) != causal.window:
            raise ValueError(f"mask {causal.describe()} and window={tuple(window)} disagree: pass one of them")
        return causal
    return Mask.of(causal, window)


@jit
def pair_count(q0, q1, k0, k1, lo, hi):
    """Visible (q, k) pairs with q in ``[q0, q1)`` and k in ``[k0, k1)`` under offsets ``(lo, hi)``
    (:attr:`Mask.offsets`; compiled, Note [Compiled planning loops] in :mod:`megatron_fcp.jit`).

    Per query the visible keys are ``[q + lo, q + hi]`` clipped to the range, so the count is
    (keys ``<= q + hi``) - (keys ``< q + lo``), each a clamped ramp summed in closed form
    (:func:`_keys_at_most`); exact in int64."""
    n = max(q1 - q0, 0)
    L = max(k1 - k0, 0)
    if n == 0 or L == 0:
        return 0
    upper = n * L if hi >= _INF else _keys_at_most(q0 + hi, q1 + hi, k0, L)
    lower = 0 if lo <= -_INF else _keys_at_most(q0 + lo - 1, q1 + lo - 1, k0, L)
    return upper - lower


@jit
def _pair_counts(q0, q1, k0, k1, lo, hi):
    """:func:`pair_count` of each entry of four int64 ``[n]`` arrays."""
    out = np.empty(q0.shape[0], dtype=np.int64)
    for i in range(q0.shape[0]):
        out[i] = pair_count(q0[i], q1[i], k0[i], k1[i], lo, hi)
    return out


@jit
def _keys_at_most(a0, a1, k0, L):
    """``sum over t in [a0, a1) of clamp(t - k0 + 1, 0, L)``: for each threshold ``t``, the keys of
    ``[k0, k0 + L)`` at positions ``<= t`` (the difference of the ramp's running sums)."""
    return _ramp_sum(a1 - 1, k0, L) - _ramp_sum(a0 - 1, k0, L)


@jit
def _ramp_sum(x, k0, L):
    """``sum over t <= x (from -inf) of clamp(t - k0 + 1, 0, L)``."""
    m = x - k0 + 1
    ramp = min(max(m, 0), L)
    return ramp * (ramp + 1) // 2 + max(m - L, 0) * L
