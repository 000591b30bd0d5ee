"""Values derived from an object, kept on the object: :func:`memo`.

Note [Caches live with their object]
------------------------------------
Per-batch planning derives much from one plan object -- its waves, chain steps, kept blocks,
backward program, a head-parallel stage's merged plan and all-to-all routing -- and asks for each
several times (the degree choice, the floors, the runtime). Until 2026-12-07 these answers sat in
module dicts keyed by ``id(plan)``, holding a weak reference to the plan and a strong one to the
answer, and emptied only when 256-1,024 entries had piled up; so the answers outlived their plans
by hundreds of batches. Measured (``choose_packed_plan`` on a new batch each step, cp = 256, 2,048
documents, ``gc.collect()`` between): the process grew 245 -> 916 MB over 14 batches, about 50 MB a
batch; and the planning bench's degree choice at 2,048 documents, run after its other rows in one
process, took 0.55-0.63 s a repeat with nine repeats per row against 0.39-0.49 s with five.

Now each answer is kept in its object's own ``__dict__`` (under ``"_memo"``, a dict keyed by what
the answer depends on besides the object): it lives exactly as long as the object. An answer that
refers back to its object (a backward program holds its plan, and the cost model and the
executor must get the same program object) makes a cycle, which the cyclic collector frees with the
object: the young-generation pass after a degree choice collects the batch before it (12K objects
at cp = 64, 512 documents: 3 ms against 1.3 ms for that pass when the caches held everything; 47K
at cp = 256 with 2,048 documents: 13-28 ms), a price paid once per batch instead of memory that
grows with every batch. The objects are frozen dataclasses with a ``__dict__``
(``Plan``, ``PackedHeadParallelPlan``); writing to ``__dict__`` does not touch
their fields, equality or hash. Pickling drops the memo (:func:`without_memo`): a copy in another
process derives its own.

An answer that depends on a second object as well (a topology) is stored with a weak reference to
it and checked on reading, since that object's id may be reused once it dies.
"""

from __future__ import annotations

from typing import Any

__all__ = ["memo", "without_memo", "MEMO_ATTR"]

MEMO_ATTR = "_memo"
"""The ``__dict__`` entry :func:`memo` keeps an object's answers under."""


def memo(obj: Any) -> dict:
    """The dict of answers derived from ``obj`` and kept with it (created on first use; safe
    across threads: ``setdefault`` keeps the first dict if two threads create one at once)."""
    d = obj.__dict__.get(MEMO_ATTR)
    if d is None:
        d = obj.__dict__.setdefault(MEMO_ATTR, {})
    return d


def without_memo(state: dict) -> dict:
    """``state`` (an object's ``__dict__`` copy, for ``__getstate__``) without its memo."""
    state.pop(MEMO_ATTR, None)
    return state
