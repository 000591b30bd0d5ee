"""Routes as integer columns: the resources of many ``(src, dst)`` pairs at once. Pure, no torch.

Note [Route ids]
----------------
The cost model and the compiler's leaf balancing load every message's bytes onto the resources
of its route. Looked up pair by pair (``Topology.route``, then each resource's name mapped to a
dense id), a 256-rank packed plan's ~15K distinct pairs cost ~30 ms per plan priced, and a batch's
``auto`` prices three plans and balances three more. A :class:`RouteIds` (one per topology,
:meth:`~megatron_fcp.topology.model.Topology.route_ids`) keeps every route it has been asked for
as a row of flat columns over *topology-wide* resource ids: ``ptr``/``ids`` (CSR: the route's
resources in order), ``latency`` and ``bandwidth`` (its bottleneck) per row. :meth:`RouteIds.rows`
answers an array of pairs with their rows, looking up in Python only the pairs it has not seen
(sorted keys, ``searchsorted``): a batch's routes are found again on the next batch.

Callers that number resources densely in *their own* order of first use (the cost model's
``_ResourceIndex``, whose order names the timeline's resources and breaks its ties) renumber
with :func:`first_use_ids`, which gives the numbering a loop over the same routes would give.

Invariant: a row never changes once made (routes of a topology are fixed), so arrays handed out
stay valid, but :meth:`RouteIds.rows` may replace the column arrays: read a column *after* asking
for its rows (``table.bandwidth[table.rows(s, d)]`` reads the old, possibly shorter, array); rows are only appended, under a lock (a batch may be planned on a background thread
while the step plans another, Note [Planning a packed batch ahead]).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from megatron_fcp.jit import jit

if TYPE_CHECKING:
    from megatron_fcp.topology.model import Topology

__all__ = ["ResourceIds", "RouteIds", "first_use_ids"]


class ResourceIds:
    """Resources numbered densely in order of first use: ``names[i]`` and ``bandwidths[i]`` of id
    ``i``, ``index`` a name's id. The one numbering rule of :class:`RouteIds` (topology-wide) and of
    the cost model's resource index (per pricing)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []
        self.bandwidths: list[float] = []

    def id(self, name: str, bandwidth: float) -> int:
        """``name``'s id, numbered next (with ``bandwidth``) the first time it is seen."""
        i = self.index.get(name)
        if i is None:
            i = self.index[name] = len(self.names)
            self.names.append(name)
            self.bandwidths.append(bandwidth)
        return i

    def ids(self, names: list[str], bandwidths: list[float]) -> list[int]:
        """:meth:`id` of distinct ``names`` in order: the ids calling it name by name gives; the
        names none of which is known yet (a fresh numbering's first routes) numbered at once."""
        if self.index.keys().isdisjoint(names):
            start = len(self.names)
            self.names.extend(names)
            self.bandwidths.extend(bandwidths)
            self.index.update(zip(names, range(start, start + len(names))))
            return list(range(start, start + len(names)))
        return [self.id(n, b) for n, b in zip(names, bandwidths)]


DENSE_ROWS_MAX_WORLD = 1024
"""The largest world whose :class:`RouteIds` keeps a ``world x world`` table of rows (8 MB)."""


class RouteIds:
    """Every route of ``topology`` asked for so far, as rows of columns (Note [Route ids])."""

    def __init__(self, topology: "Topology"):
        self.topology = topology
        self._lock = threading.Lock()
        self._resources = ResourceIds()
        self.names: list[str] = self._resources.names   # resource id -> name
        self.resource_bandwidth = np.zeros(0)
        # (sorted src * span + dst of the rows, each key's row): one tuple, replaced whole
        self._index = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        self.ptr = np.zeros(1, dtype=np.int64)    # [rows + 1]: row j's resources are ids[ptr[j]:ptr[j + 1]]
        self.ids = np.zeros(0, dtype=np.int64)
        self.latency = np.zeros(0)                # [rows]: Route.latency
        self.bandwidth = np.zeros(0)              # [rows]: Route.bandwidth (the bottleneck)
        self.span = topology.world
        # every (src, dst) key's row, -1 until asked: a lookup instead of a search where the
        # world is small enough (at most DENSE_ROWS_MAX_WORLD ranks: a table of at most 8 MB)
        self._dense = np.full(self.span * self.span, -1, dtype=np.int64) \
            if self.span <= DENSE_ROWS_MAX_WORLD else None

    def rows(self, src, dst) -> np.ndarray:
        """The row of each pair ``(src[i], dst[i])`` (global ranks; int64 ``[pairs]``), adding the
        routes not seen before (checked and built by ``Topology.route``)."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        for name, r in (("src", src), ("dst", dst)):
            bad = (r < 0) | (r >= self.span)
            if bad.any():
                self.topology.check_rank(int(r[bad][0]), name)   # raises, naming the rank
        key = src * self.span + dst
        if self._dense is not None:
            got = self._dense[key]
            if (got < 0).any():
                with self._lock:
                    self._add(np.unique(key[got < 0]))
                got = self._dense[key]
            return got
        keys, rows = self._index
        at = np.searchsorted(keys, key)
        hit = at < len(keys)
        hit[hit] = keys[at[hit]] == key[hit]
        if not hit.all():
            with self._lock:
                self._add(np.unique(key[~hit]))
            keys, rows = self._index
            at = np.searchsorted(keys, key)
        return rows[at]

    def _add(self, new_keys: np.ndarray) -> None:
        old_keys, old_rows = self._index
        new_keys = new_keys[~np.isin(new_keys, old_keys)]         # another thread may have added some
        if not len(new_keys):
            return
        lens, flat, lat, bw = [], [], [], []
        for k in new_keys.tolist():
            route = self.topology.route(k // self.span, k % self.span)
            flat.extend(self._resources.id(res.name, res.bandwidth) for res in route.resources)
            lens.append(len(route.resources))
            lat.append(route.latency)
            bw.append(route.bandwidth)
        first = len(self.latency)
        ptr = np.concatenate([self.ptr, self.ptr[-1] + np.cumsum(lens, dtype=np.int64)])
        ids = np.concatenate([self.ids, np.asarray(flat, dtype=np.int64)])
        latency = np.concatenate([self.latency, np.asarray(lat, dtype=np.float64)])
        bandwidth = np.concatenate([self.bandwidth, np.asarray(bw, dtype=np.float64)])
        keys = np.concatenate([old_keys, new_keys])
        row_of_key = np.concatenate([old_rows, np.arange(first, first + len(new_keys), dtype=np.int64)])
        order = np.argsort(keys, kind="stable")
        # publish the columns before the index that points into them (readers take the index
        # first, and columns only grow: a reader's rows are always in the columns it reads)
        self.ptr, self.ids, self.latency, self.bandwidth = ptr, ids, latency, bandwidth
        self.resource_bandwidth = np.asarray(self._resources.bandwidths, dtype=np.float64)
        self._index = (keys[order], row_of_key[order])
        if self._dense is not None:      # after the columns: a row found here is in them
            self._dense[new_keys] = row_of_key[len(old_rows):]

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths [rows], ids [sum of lengths])``: the resources of ``rows``, one route after
        another."""
        ptr = self.ptr
        start, lens = ptr[rows], ptr[rows + 1] - ptr[rows]
        at = np.concatenate([[0], np.cumsum(lens)])
        flat = np.repeat(start - at[:-1], lens) + np.arange(int(at[-1]), dtype=np.int64)
        return lens, self.ids[flat]


def first_use_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Renumber topology-wide resource ids densely in order of first appearance in ``ids``:
    ``(local ids [len(ids)], the topology id of each local id)`` -- the numbering a loop that gives
    each new resource the next id would make (that loop, compiled: :func:`_first_use`)."""
    ids = np.asarray(ids, dtype=np.int64)
    if not len(ids):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if ids.min() < 0:
        raise ValueError(f"first_use_ids: resource ids are >= 0, got {int(ids.min())}")
    return _first_use(ids, int(ids.max()) + 1)


@jit
def _first_use(ids, span):
    """:func:`first_use_ids` over ids in ``[0, span)``: one pass, a table of the local id given."""
    local_of = np.full(span, -1, dtype=np.int64)
    local = np.empty(ids.shape[0], dtype=np.int64)
    topo_of = np.empty(ids.shape[0], dtype=np.int64)
    n = 0
    for i in range(ids.shape[0]):
        x = ids[i]
        if local_of[x] < 0:
            local_of[x] = n
            topo_of[n] = x
            n += 1
        local[i] = local_of[x]
    return local, topo_of[:n].copy()
