"""The cost model's communication rounds as columns, for plans of thousands of ranks. Pure, no torch.

Note [Columnar rounds]
---------------------
:func:`~megatron_fcp.cost.model.simulate_plan` loads every message's route onto the resources
of its round in a Python loop over ``(round, src, dst)`` groups; a 1,024-rank plan has ~1.5M of
them and ~1M distinct routes. The model is the same here (Note [Cost model]), computed from the
structure of a route: a message between nodes crosses its sender's side (the hops from its GPU to
its NIC and the NIC's wire out) and its receiver's side (the wire in and the hops to its GPU), so
a round's load is the bytes each rank sends across nodes on its sending side plus the bytes it
receives across nodes on its receiving side, plus each intra-node message on its own route. That
is two ``bincount`` calls over ``[round, resource]`` and one route per rank and side instead of
one per pair. Latency is the sum of the two sides'. Sums are taken in another order than the
loop's, so times agree to rounding (tests compare the two); the loop stays the reference for
smaller plans, whose predictions are pinned.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_fcp.topology import Topology

__all__ = ["round_loads"]


def _padded(lists: Sequence[Sequence[int]]) -> np.ndarray:
    width = max((len(x) for x in lists), default=0)
    out = np.full((len(lists), max(width, 1)), -1, dtype=np.int64)
    for i, x in enumerate(lists):
        out[i, :len(x)] = x
    return out


def round_loads(idx, topo: Topology, ranks: Sequence[int], rnd: np.ndarray, src: np.ndarray, dst: np.ndarray,
                nbytes: np.ndarray, n_rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """``(load[round, resource] bytes, max route latency per round)`` of messages ``(rnd, src,
    dst, nbytes)`` (``src``/``dst``: CP indices into ``ranks``; one entry per (round, src, dst)
    group), resource ids from ``idx`` (a :class:`~megatron_fcp.cost.model._ResourceIndex`, whose
    ``names``/``bw`` it extends); see Note [Columnar rounds]."""
    cp = len(ranks)
    node = np.array([topo.node_of(r) for r in ranks], dtype=np.int64)
    inter = node[src] != node[dst]
    lay = topo.layout
    # each rank's two sides, read off one route to (from) a rank of another node
    out_ids: list = [[] for _ in range(cp)]
    in_ids: list = [[] for _ in range(cp)]
    out_lat, in_lat = np.zeros(cp), np.zeros(cp)
    need_out, need_in = np.unique(src[inter]), np.unique(dst[inter])
    def elsewhere(i: int) -> int:
        return int(np.argmax(node != node[i]))

    for i in need_out.tolist():
        j = elsewhere(i)
        route = topo.route(ranks[i], ranks[j])
        k = len(lay.nic_path(topo.local_rank_of(ranks[i]))) + 1   # the sender's hops to its NIC, its wire out
        ids, _ = idx.route(ranks[i], ranks[j])
        out_ids[i] = ids[:k].tolist()
        out_lat[i] = sum(r.latency for r in route.resources[:k])
    for j in need_in.tolist():
        i = elsewhere(j)
        route = topo.route(ranks[i], ranks[j])
        k = len(lay.nic_path(topo.local_rank_of(ranks[i]))) + 1
        ids, _ = idx.route(ranks[i], ranks[j])
        in_ids[j] = ids[k:].tolist()
        in_lat[j] = sum(r.latency for r in route.resources[k:])
    # intra-node messages on their own routes (few distinct pairs: ranks x node size)
    intra = ~inter
    pair = src[intra] * cp + dst[intra]
    upair, pinv = np.unique(pair, return_inverse=True)
    p_ids, p_lat = [], np.zeros(len(upair))
    for n, p in enumerate(upair.tolist()):
        ids, lat = idx.route(ranks[p // cp], ranks[p % cp])
        p_ids.append(ids.tolist())
        p_lat[n] = lat
    R = len(idx.names)
    cells, weights = [], []

    def spread(rows: np.ndarray, table: np.ndarray, k: np.ndarray, w: np.ndarray) -> None:
        ids = table[rows]                                        # [entries, width], -1 padded
        live = ids >= 0
        cells.append((np.broadcast_to(k[:, None], ids.shape) * R + ids)[live])
        weights.append(np.broadcast_to(w[:, None], ids.shape)[live])

    if inter.any():
        ki, si, di, bi = rnd[inter], src[inter], dst[inter], nbytes[inter]
        for side, table in ((si, _padded(out_ids)), (di, _padded(in_ids))):
            key, inv = np.unique(ki * cp + side, return_inverse=True)   # bytes per (round, rank) on this side
            spread(key % cp, table, key // cp, np.bincount(inv, weights=bi))
    if intra.any():
        spread(pinv, _padded(p_ids), rnd[intra], nbytes[intra])
    load = np.bincount(np.concatenate(cells) if cells else np.zeros(0, np.int64),
                       weights=np.concatenate(weights) if weights else None,
                       minlength=n_rounds * R).reshape(n_rounds, R) if R else np.zeros((n_rounds, 0))
    lat = np.zeros(len(rnd))
    lat[inter] = out_lat[src[inter]] + in_lat[dst[inter]]
    lat[intra] = p_lat[pinv]
    lmax = np.zeros(n_rounds)
    np.maximum.at(lmax, rnd, lat)
    return load, lmax
