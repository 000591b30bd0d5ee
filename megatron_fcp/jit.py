"""Compiled loops for per-batch planning: :func:`jit` compiles a pure loop over numpy arrays with
numba when it is installed, and otherwise runs the same function as Python.

Note [Compiled planning loops]
------------------------------
Per-batch planning (issue 28 item 6) is a handful of greedy loops that visit every (block, reader)
of a plan once per wave or round: at cp = 256 the backward's wave packing alone makes 137K
deliveries and turns away 650K a packing, several packings a plan, and in Python each visit's
bookkeeping costs a few hundred nanoseconds. These loops are written once, over flat numpy arrays
and scalars only (no dicts, sets or objects), so that numba compiles them to machine code; the
planner's decisions stay in the one function, whichever runs it:

* **The same answer either way.** The functions use integer and IEEE double arithmetic in a fixed
  order, without ``fastmath``, so the compiled and the Python run give the same bits (tested:
  ``tests/test_jit.py`` runs each kernel both ways on the same plans).
* **numba is a dependency** (``setup.py``); where it cannot be imported (a Python it does not
  support yet) the functions run as Python, slower and with the same result, and this is logged
  once (``megatron_fcp.jit``) -- a fallback that keeps the plan.
* **Compiled once per machine**: ``cache=True`` keeps the machine code beside the module
  (``__pycache__``) so that later processes load it (tens of ms) instead of compiling (seconds).
* **nogil**: a compiled loop releases the GIL, so a batch planned ahead in the background (Note
  [Planning a packed batch ahead] in :mod:`megatron_fcp.patches.runtime`) runs beside the step's
  Python instead of taking turns with it.

The loops compiled (2026-12-06; docs/planner.md, "Per-batch planning, fifth pass"): the backward's
wave packing (``schedule.waves._pack_kernel``), the layer placement's greedy and search
(``contract.layer_placement._assign_kernel``), the compiler's leaf rounds
(``planner.compile._leaf_rounds``), the wave timeline floor's chains
(``cost.timeline._chain_floor``) and the mask's pair count (``contract.mask.pair_count``, with the
placement's pair matrix, ``contract.placement._span_pair_matrix``). Added 2026-12-07 (docs/planner.md,
"Per-batch planning, twelfth pass"): the packing's busiest-rank total (``schedule.waves._row_totals``),
the placement's need matrix (``contract.placement._need_table``), the ring's farthest readers
(``planner.builders._farthest_reader``), the resources' first-use numbering
(``topology.route_ids._first_use``) and :func:`unique_ints`'s table (``_unique_table``): numpy's
``unique`` of keys bounded by a small span (the planner's ``(sender, receiver)`` and ``(block,
rank)`` keys) as one pass over a table (:func:`isin_ints` is the same idea for ``isin``, a numpy
lookup). Inputs are built by numpy; :func:`csr` turns
lists of ints into the flat pair the loops read.

``MEGATRON_FCP_NO_JIT=1`` runs every loop as Python (for debugging, and for the test that holds the
two runs equal; ``tests/test_jit.py`` also calls each kernel's ``py_func``).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence, TypeVar

import numpy as np

__all__ = ["jit", "COMPILED", "csr", "unique_ints", "isin_ints"]

_log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable)

try:
    if os.environ.get("MEGATRON_FCP_NO_JIT", "") not in ("", "0"):
        raise ImportError("MEGATRON_FCP_NO_JIT is set")
    import numba as _numba
except ImportError as exc:   # the Python run of the same functions: same plans, slower
    _numba = None
    _reason = str(exc)
else:
    _reason = ""

COMPILED = _numba is not None
"""Whether :func:`jit` compiles (numba imported) or returns the functions as they are."""

_warned = False


def jit(fn: F) -> F:
    """``fn`` compiled by numba (``nopython``, ``nogil``, cached on disk), or ``fn`` itself where
    numba is not importable (logged once): Note [Compiled planning loops]."""
    global _warned
    if _numba is None:
        if not _warned:
            _warned = True
            _log.warning("megatron_fcp: numba not available (%s); the planner's loops run as Python, "
                         "with the same plans, several times slower (pip install numba)", _reason)
        return fn
    return _numba.njit(cache=True, nogil=True)(fn)


def csr(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ints as the flat pair the compiled loops read: ``(ptr, ids)``, int64, list ``j``
    being ``ids[ptr[j]:ptr[j + 1]]``."""
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in lists], out=ptr[1:])
    return ptr, np.fromiter((i for x in lists for i in x), dtype=np.int64, count=int(ptr[-1]))


def unique_ints(keys: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(keys, return_index=True, return_inverse=True)`` for int64 ``keys`` in ``[0,
    span)``: ``(sorted distinct keys, each one's first index, each key's place among them)``. Where
    ``span`` is small next to the keys (the planner's ``(sender, receiver)`` pairs: at most
    ``cp^2``) it is one compiled pass over a table of ``span`` entries (:func:`_unique_table`);
    otherwise numpy's sort. The same arrays either way."""
    keys = np.asarray(keys, dtype=np.int64)
    if len(keys) and (keys.min() < 0 or keys.max() >= span):
        raise ValueError(f"unique_ints: keys must lie in [0, {span}), got {int(keys.min())}..{int(keys.max())}")
    if span > 16 * len(keys) + (1 << 20):                      # a table of at most ~16 MB
        uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        return uniq, first, inv.reshape(-1)
    return _unique_table(keys, int(span))


@jit
def _unique_table(keys, span):
    """:func:`unique_ints` over a table: each key's first index, then the keys present in order."""
    first = np.full(span, -1, dtype=np.int64)
    for i in range(keys.shape[0]):
        if first[keys[i]] < 0:
            first[keys[i]] = i
    slot = np.empty(span, dtype=np.int64)
    m = 0
    for k in range(span):
        if first[k] >= 0:
            slot[k] = m
            m += 1
    uniq = np.empty(m, dtype=np.int64)
    at = np.empty(m, dtype=np.int64)
    for k in range(span):
        if first[k] >= 0:
            uniq[slot[k]] = k
            at[slot[k]] = first[k]
    inv = np.empty(keys.shape[0], dtype=np.int64)
    for i in range(keys.shape[0]):
        inv[i] = slot[keys[i]]
    return uniq, at, inv


def isin_ints(keys: np.ndarray, values: np.ndarray, span: int) -> np.ndarray:
    """``np.isin(keys, values)`` for int ``keys`` and ``values`` in ``[0, span)``: a lookup in a table
    of ``span`` flags where that is at most a few MB (numpy sorts both arrays otherwise)."""
    keys, values = np.asarray(keys, dtype=np.int64), np.asarray(values, dtype=np.int64)
    if span > 16 * (len(keys) + len(values)) + (1 << 22):
        return np.isin(keys, values)
    for a in (keys, values):
        if len(a) and (a.min() < 0 or a.max() >= span):
            raise ValueError(f"isin_ints: keys must lie in [0, {span}), got {int(a.min())}..{int(a.max())}")
    table = np.zeros(span, dtype=bool)
    table[values] = True
    return table[keys]
