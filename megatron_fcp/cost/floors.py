"""Lower bounds ("floors") on a candidate's time on the cost model, for pruning the schedule search. Pure, no torch.

Note [Backward floors]
----------------------
:func:`~megatron_fcp.planner.choose.choose_schedule` prices a candidate's forward
exactly (cheap) and runs its backward timeline (the expensive part: waves are packed, chains
stepped) only when ``forward + backward_floor`` can still win. A floor must never exceed what
any of the three backward timelines returns for the plan
(:func:`~megatron_fcp.cost.backward.simulate_plan_backward`, the one pass;
:func:`~megatron_fcp.cost.timeline.wave_timeline`, waves;
:func:`~megatron_fcp.schedule.chains.chain_timeline`, a chain), so it takes the largest of the
things all of them respect:

* **compute**: a rank runs its gradient jobs one after another, and it computes every block its
  queries attend to exactly once (a block with work reaches it, or is its own), so the busiest
  rank's total work -- its queries against every key the mask allows, at the backward FLOP ratio
  -- is a floor; and every model launches at least one kernel per owner whose blocks a rank
  computes on (the one pass per owner and round, a chain per owner and step, the waves per
  block, the forward per owner and round), so each rank's work plus that many launches is one
  too (:func:`rank_owners`); a backward in waves launches once per job, every block a rank needs
  and each of its own (:func:`rank_jobs`), which at fine sub-blocks is many times the owners. Where
  compute hides communication the launches are most of the gap between the floor and the priced
  time.
* **reduction** (not for a chain: its partials travel the forward's direction): every delivery of
  a block to a rank whose queries attend to it returns one dK/dV partial along the reversed hop
  (one pass: every reversed round; waves: every hop of a wave's paths), and each model
  serialises a resource's messages (a round lasts at least each resource's busy time; the
  timelines keep a resource busy until its previous message is through). So for every resource,
  the partials' bytes over its bandwidth is a floor. A backward in waves that re-sends KV (known
  before its waves are packed: :func:`~megatron_fcp.schedule.program.resend_keep_limits`) also
  carries every reader delivery's KV again, in the wave that computes it, except what the reader
  kept from the forward for its first wave; so each resource also holds that KV less the keep
  limits of the ranks receiving through it (the wave timeline's messages hold a resource one at a
  time, Note [Wave timeline floor]).

* **chain steps** (a chain only, once its backward program is compiled:
  :func:`~megatron_fcp.cost.backward.chain_compute_floor`): the lock-step chain timeline adds,
  step by step, the longer of the busiest rank's jobs and the step's messages, so the sum over
  steps of the busiest rank's jobs is a floor; it is above the compute floor where the steps
  compute unevenly (a staggered stage ring).
* **the wave loop** (waves only, once they are packed:
  :func:`~megatron_fcp.cost.backward.wave_backward_floor`): the longest path through the loop's
  posts, completions and each rank's queued messages (Note [Wave timeline floor] in
  :mod:`megatron_fcp.cost.timeline`); it sees a wave waiting on one sender's NIC.

The **forward's KV floor** (:func:`kv_floor`, for a degree before any of its plans is compiled):
the forward's rounds last at least each resource's busy time, so no plan over a placement moves
its KV faster than the most bytes any rank needs over its GPU's ingress max-flow, nor than the most
bytes any node needs from other nodes (each block once) over its CP ranks' NICs (a block enters a
node through a member's NIC). It is the need-set bound of
:func:`~megatron_fcp.cost.te.lower_bound`, taken per rank.

The floors are loose by design (no latency, no launches, no pipeline fill); they are exact
bounds, so a candidate pruned by one could not have been chosen (nor been the runner-up).
"""

from __future__ import annotations

import weakref

from typing import Sequence

import numpy as np

from megatron_fcp.contract.blocks import part_span
from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.needs import causal_pairs, chunk_need_matrix
from megatron_fcp.contract.placement import Placement
from megatron_fcp.contract.plan import Plan
from megatron_fcp.cost.model import AttentionShape, ComputeModel, _ResourceIndex, block_pairs
from megatron_fcp.topology import Topology

__all__ = ["rank_pairs", "rank_owners", "rank_jobs", "compute_floor", "reduction_floor", "kv_floor", "graph_kv_floor",
           "star_kv_floor", "edge_kv_floor", "backward_compute_floor", "member_nic_ingress"]


def member_nic_ingress(topo: Topology, members: Sequence[int]) -> float:
    """Ingress (bytes/s) of the distinct NICs the CP ranks ``members`` of one node use: traffic for a
    rank enters its node through that rank's NIC (``gpu_nic``), so a node holding only some CP ranks
    (an uneven CP group) cannot use the other GPUs' NICs. The whole node's NICs when all are used."""
    nics = {topo.layout.gpu_nic[topo.local_rank_of(r)] for r in members} if topo.layout.gpu_nic else set()
    return sum(topo.layout.nics[k].bandwidth for k in nics) if nics else topo.node_ingress_bandwidth()


def intra_ingress(topo: Topology, r: int) -> float:
    """Ingress max-flow into rank r's GPU from GPUs of its own node only."""
    one = Topology(topo.name, topo.layout, 1, (), topo.fabric_latency)
    return one.gpu_ingress_bandwidth(topo.local_rank_of(r))


def kv_floor(topo: Topology, ranks: Sequence[int], placement: "Placement | None", seq_len: int,
             causal: "bool | Mask", kv_bytes_per_token: float) -> float:
    """The forward's KV floor of Note [Backward floors] for the CP ranks ``ranks`` holding
    ``placement`` (None: Megatron's zigzag split of ``seq_len`` tokens; ``causal`` may be a
    windowed :class:`~megatron_fcp.contract.mask.Mask`: its need sets)."""
    _, recv, into, rank_in, node_in = _need_tokens(topo, tuple(ranks), placement, seq_len, causal)
    t = float((recv / rank_in).max()) * kv_bytes_per_token
    if len(into) > 1:
        t = max(t, max(into[x] / node_in[x] for x in into) * kv_bytes_per_token)
    return t


def _need_tokens(topo: Topology, ranks: tuple[int, ...], placement: "Placement | None", seq_len: int,
                 causal: "bool | Mask") -> tuple[np.ndarray, np.ndarray, dict[int, float], np.ndarray, dict[int, float]]:
    """What the KV floors read of the need sets, in tokens, and the ingress they meet: each CP rank's
    node (``[cp]``), the tokens each rank needs (``[cp]``), per node (sorted) the tokens its ranks
    need from other nodes (each block once), each rank's ingress (its NIC's across nodes, else its
    intra-node ingress; ``[cp]``) and each node's NICs' ingress. It depends only on the placement
    (or the zigzag split), the ranks' nodes and the mask, not on a graph or the bytes per token:
    over a placement it is computed once and kept on it (``auto`` floors six graphs per degree over
    one placement: at cp = 256, 512 documents, a seventh of the degree choice before 2026-12-07)."""
    key = ("need tokens", id(topo), ranks, Mask.of(causal) if isinstance(causal, bool) else causal)
    if placement is not None:
        got = placement._cache.get(key)
        if got is not None and got[0]() is topo:
            return got[1]
    need, owner, tokens = _kv_needs(len(ranks), placement, seq_len, causal)
    node_of = np.array([topo.node_of(r) for r in ranks])
    recv = need.astype(np.float64) @ tokens                                    # [cp]
    into = {x: float((need[node_of == x].any(axis=0) & (node_of[owner] != x)) @ tokens)
            for x in sorted(set(node_of.tolist()))}
    multi = len(into) > 1
    rank_in = np.array([topo.gpu_ingress_bandwidth(r) if multi else intra_ingress(topo, r) for r in ranks])
    node_in = {x: member_nic_ingress(topo, [r for r, m in zip(ranks, node_of == x) if m]) for x in into} \
        if multi else {}
    out = (node_of, recv, into, rank_in, node_in)
    if placement is not None:
        placement._cache[key] = (weakref.ref(topo), out)
    return out


def _kv_needs(cp: int, placement: "Placement | None", seq_len: int,
              causal: "bool | Mask") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``need`` [cp, blocks] (bool: the CP rank reads the block), each block's owner (CP index) and
    tokens, for ``placement`` or (None) Megatron's zigzag split of ``seq_len`` tokens."""
    if placement is None:
        idx = np.arange(cp)
        return (chunk_need_matrix(cp, causal, seq_len), np.concatenate([idx, idx]),
                np.full(2 * cp, seq_len // (2 * cp), dtype=np.float64))
    return placement.need_matrix(), placement.block_owners(), placement.block_tokens().astype(np.float64)


def rank_pairs(placement: "Placement | None", cp: int, seq_len: int, causal: "bool | Mask") -> np.ndarray:
    """``[cp]`` query-key pairs each CP rank's queries attend to (every key the mask allows), for
    Megatron's zigzag split of ``seq_len`` tokens (``placement`` None; a multiple of ``2 * cp``) or
    a placement."""
    if placement is None:
        L = seq_len // (2 * cp)
        j = np.arange(cp, dtype=np.int64)
        out = np.zeros(cp, dtype=np.int64)
        for g in (j, 2 * cp - 1 - j):  # the rank's two zigzag query chunks against the whole sequence
            out = out + causal_pairs(g * L, (g + 1) * L, 0, seq_len, causal)
        return out
    doc, start, end = placement.block_spans()                 # [blocks]: each span against its whole document
    pairs = causal_pairs(start, end, 0, np.asarray(placement.doc_lengths, dtype=np.int64)[doc], placement.mask)
    out = np.zeros(cp, dtype=np.int64)
    np.add.at(out, placement.block_owners(), np.asarray(pairs, dtype=np.int64))
    return out


def compute_floor(placement: "Placement | None", cp: int, shape: AttentionShape, causal: "bool | Mask",
                  compute_model: ComputeModel, flop_ratio: float, launches: "bool | np.ndarray" = False) -> float:
    """The busiest rank's work in seconds at ``flop_ratio`` times the forward's FLOPs (Note
    [Backward floors]), from :func:`rank_pairs`; ``launches``: each rank's plus one kernel launch
    per owner whose blocks its queries attend to (:func:`rank_owners`), or per rank the launches
    given (``[cp]``: a backward in waves launches once per job, :func:`rank_jobs`)."""
    pairs = rank_pairs(placement, cp, shape.seq_len, causal).astype(np.float64)
    t = pairs * compute_model.pair_s(shape, flop_ratio)        # tiles: a per-pair lower bound (Note [Cost model])
    if isinstance(launches, np.ndarray):
        t = t + launches * compute_model.launch_s(flop_ratio)
    elif launches:
        t = t + rank_owners(placement, cp, causal, shape.seq_len) * compute_model.launch_s(flop_ratio)
    return float(t.max(initial=0))


def rank_jobs(plan: Plan, seq_len: int | None) -> np.ndarray:
    """``[cp]`` gradient jobs of each CP rank in a backward that runs in waves: every block it needs
    and every own block holding tokens, each computed once as one job with one kernel launch (Note
    [Backward waves] in :mod:`megatron_fcp.attention.backward_waves`); a block's work is never zero
    there (a need is a visible pair, an own block holds its diagonal). ``seq_len``: a zigzag plan's."""
    needs = plan.need_matrix().sum(axis=1)
    if plan.placement is not None:   # a placement's spans are never empty
        own = np.bincount(plan.placement.block_owners(), minlength=plan.cp)
    else:
        own = [sum(plan.block_tokens(b, seq_len) > 0 for b in plan.local_blocks(r)) for r in plan.ranks]
    return needs.astype(np.float64) + np.asarray(own, dtype=np.float64)


def backward_compute_floor(plan: Plan, shape: AttentionShape, compute_model: ComputeModel, flop_ratio: float, *,
                           waves: bool) -> float:
    """:func:`compute_floor` of ``plan``'s backward: the busiest rank's work plus its launches, once
    per job where the backward runs in waves (:func:`rank_jobs`), else at least once per owner (a
    chain's step, the one pass; Note [Backward floors]). ``shape``: the plan's (zigzag: its
    ``seq_len``). The one rule of which launches a backward floor counts. Reads the plan's
    :attr:`~megatron_fcp.contract.plan.Plan.backward_plan`."""
    plan = plan.backward_plan
    launches = rank_jobs(plan, None if plan.placement is not None else shape.seq_len) if waves else True
    return compute_floor(plan.placement, plan.cp, shape, plan.mask, compute_model, flop_ratio, launches=launches)


def rank_owners(placement: "Placement | None", cp: int, causal: "bool | Mask", seq_len: int | None = None) -> np.ndarray:
    """``[cp]`` owners (the rank itself included) of the blocks each CP rank's queries attend to:
    every model launches at least one kernel per such owner in each pass (the forward per owner and
    round, the chain backward per owner and step, the waves per block; Note [Backward floors]).
    Zigzag: by chunk under ``causal`` (a :class:`~megatron_fcp.contract.mask.Mask` with a window needs
    ``seq_len``: the windowed chunk need rule)."""
    idx = np.arange(cp)
    if placement is None:
        need = chunk_need_matrix(cp, causal, seq_len).reshape(cp, 2, cp).any(axis=1)  # chunk-major columns
    else:
        owner = placement.block_owners()
        need = np.zeros((cp, cp), dtype=bool)
        rows, cols = np.nonzero(placement.need_matrix())
        need[rows, owner[cols]] = True
    # its own blocks, where it holds any: its queries attend to their diagonal
    need[idx, idx] = True if placement is None else [placement.tokens(j) > 0 for j in range(cp)]
    return need.sum(axis=1)


def reduction_floor(plan: Plan, topo: Topology, shape: AttentionShape, grad_dtype_bytes: int, *,
                    resend_limits: "dict[int, float] | None" = None, kv_dtype_bytes: int | None = None) -> float:
    """The most any resource is busy with the dK/dV partials of reader deliveries, reversed (Note
    [Backward floors]); ``shape``: the plan's (zigzag: ``seq_len`` a multiple of ``2 * cp``).

    ``resend_limits`` (a backward in waves that re-sends KV: per global rank, the most received KV
    bytes of one sequence it may start from, :func:`~megatron_fcp.cost.backward.resend_limits`):
    each resource also carries every reader delivery's KV again, less what
    the ranks receiving those deliveries may have kept (``kv_dtype_bytes`` per element, default the
    shape's). The deliveries are the plan's :attr:`~megatron_fcp.contract.plan.Plan.backward_plan`'s."""
    plan = plan.backward_plan
    rnd, src, dst, owner, chunk, part = plan.transfer_columns()
    if not len(rnd):
        return 0.0
    cp = plan.cp
    pos = np.full(max(plan.ranks) + 1, -1, dtype=np.int64)
    pos[list(plan.ranks)] = np.arange(cp)
    s_i, d_i, o_i = pos[src], pos[dst], pos[owner]
    pl = plan.placement
    per_token = shape.kv_token_elems * grad_dtype_bytes
    if pl is None:
        L = shape.seq_len // (2 * cp)
        read = block_pairs(cp, shape.seq_len, plan.parts_per_chunk, d_i, o_i, chunk, part, plan.mask) > 0
        p0, p1 = part_span(L, plan.parts_per_chunk, part)
        tokens = (p1 - p0).astype(np.float64)
        if plan.kv_sizes:
            w = np.asarray(plan.kv_sizes, dtype=np.float64)
            tokens = tokens * (w / w.mean())[o_i]
    else:
        offset = np.concatenate([[0], np.cumsum([len(b) for b in pl.blocks])]).astype(np.int64)
        n = offset[o_i] + chunk
        read = pl.need_matrix()[d_i, n]
        tokens = pl.block_tokens().astype(np.float64)[n]
    if not read.any():
        return 0.0
    idx = _ResourceIndex(topo)

    def loads(key: np.ndarray, nbytes: np.ndarray, route) -> tuple[list, list, list[tuple[np.ndarray, int]]]:
        """The messages ``key`` (position pairs, summed per pair): route ids and bytes per hop, in
        pair order, and each pair's (route ids, pair key)."""
        uk, inv = np.unique(key, return_inverse=True)
        per_pair = np.bincount(inv, weights=nbytes)
        ids, wts, hops = [], [], []
        for k, b in zip(uk.tolist(), per_pair.tolist()):
            rid, _ = idx.route(*route(k))
            ids.append(rid)
            wts.append(np.full(len(rid), b))
            hops.append((rid, k))
        return ids, wts, hops

    def total(ids: list, wts: list) -> np.ndarray:
        return np.bincount(np.concatenate(ids), weights=np.concatenate(wts), minlength=len(idx.bw))

    pair = lambda k: (plan.ranks[k // cp], plan.ranks[k % cp])  # noqa: E731   key a * cp + b: a sends to b
    ids, wts, _ = loads(d_i[read] * cp + s_i[read], tokens[read] * per_token, pair)   # the reader returns it
    again = None
    if resend_limits is not None and not plan.kv_sizes:   # the KV again; each resource less its receivers' keep limits
        kv_token = shape.kv_token_elems * (kv_dtype_bytes or shape.dtype_bytes)
        block = o_i * (2 * plan.parts_per_chunk) + chunk * plan.parts_per_chunk + part if pl is None else n
        once = np.zeros(len(read), dtype=bool)     # a (block, reader) delivered twice is re-sent once
        once[np.unique(block * cp + d_i, return_index=True)[1]] = True
        sent = read & once
        kv_ids, kv_wts, hops = loads(s_i[sent] * cp + d_i[sent], tokens[sent] * kv_token, pair)
        receivers: dict[int, set[int]] = {}          # resource -> CP positions receiving through it
        for rid, k in hops:
            for r in rid.tolist():
                receivers.setdefault(r, set()).add(k % cp)
        again = total(kv_ids, kv_wts)
        for r, xs in receivers.items():
            again[r] = max(again[r] - sum(resend_limits[plan.ranks[x]] for x in xs), 0.0)
    load = total(ids, wts)
    if again is not None:
        load = load + again
    return float((load / np.asarray(idx.bw, dtype=np.float64)).max())


def star_kv_floor(topo: Topology, ranks: Sequence[int], placement: "Placement | None", seq_len: int,
                  causal: "bool | Mask", kv_bytes_per_token: float) -> float:
    """A floor on the forward communication of a plan that sends every block straight from its owner
    to each reader (the ``full`` builder's trees): those messages, whatever rounds hold them, put
    their bytes on every resource of their routes, and the rounds take at least the most loaded
    resource's bytes over its bandwidth (Note [Cost model]: a round takes its most loaded
    resource's time)."""
    ranks = tuple(ranks)
    need, owner, tokens = _kv_needs(len(ranks), placement, seq_len, causal)      # [cp, blocks]
    reader, block = np.nonzero(need)
    if not len(reader):
        return 0.0
    return edge_kv_floor(topo, ranks, owner[block], reader, tokens[block], kv_bytes_per_token)


def edge_kv_floor(topo: Topology, ranks: Sequence[int], src: np.ndarray, dst: np.ndarray, tokens: np.ndarray,
                  kv_bytes_per_token: float) -> float:
    """A floor on the forward communication of a plan that sends ``tokens[i]`` tokens of KV from
    ``src[i]`` to ``dst[i]`` (CP indices into ``ranks``; a pair may repeat), over whatever rounds:
    the rounds take at least the most loaded resource's bytes over its bandwidth (Note [Cost
    model]). The messages of a star (:func:`star_kv_floor`), of a builder's fixed paths
    (:meth:`~megatron_fcp.planner.builders.GraphBuilder.edge_loads`) or of a candidate's trees."""
    if not len(src):
        return 0.0
    cp = len(ranks)
    # one load per (sender, receiver) pair, summed in message order: each route looked up once
    key = np.asarray(src, dtype=np.int64) * cp + dst                                  # [messages]
    pair = np.flatnonzero(np.bincount(key, minlength=cp * cp))                        # [pairs], sorted
    per_pair = np.bincount(key, weights=np.asarray(tokens, dtype=np.float64) * kv_bytes_per_token,
                           minlength=cp * cp)[pair]
    rank_of = np.asarray(ranks, dtype=np.int64)
    table = topo.route_ids()                  # topology-wide resource ids: only the maximum is read
    rows = table.rows(rank_of[pair // cp], rank_of[pair % cp])
    hops, ids = table.gather(rows)
    bw = table.resource_bandwidth             # read after rows() (Note [Route ids])
    load = np.bincount(ids, weights=np.repeat(per_pair, hops), minlength=len(bw))
    return float((load / bw).max())


def graph_kv_floor(cg, topo: Topology, seq_len: int, causal: "bool | Mask", kv_bytes_per_token: float,
                   placement: "Placement | None" = None) -> float:
    """A floor on the forward communication of any plan compiled from the CommGraph ``cg`` (over
    ``placement``, or Megatron's zigzag split of ``seq_len`` tokens): :func:`kv_floor`, and per
    node the KV its CP ranks need from other nodes over the NICs of the ranks the graph lets blocks
    enter through (a block crosses into a node on one of the graph's edges from another node,
    through its receiver's NIC): a graph that enters each node at one rank (``leader``, ``ring``)
    is held to that rank's NIC."""
    ranks = cg.ranks
    cp = len(ranks)
    t = kv_floor(topo, ranks, placement, seq_len, causal, kv_bytes_per_token)
    node_of = np.array([topo.node_of(r) for r in ranks])
    if len(set(node_of.tolist())) < 2 or not topo.layout.gpu_nic:
        return t
    edges = cg.edge_array()
    pos = np.full(max(ranks) + 1, -1, dtype=np.int64)
    pos[list(ranks)] = np.arange(cp)
    u, v = pos[edges[:, 0]], pos[edges[:, 1]]
    cross = node_of[u] != node_of[v]
    entry = np.zeros(cp, dtype=bool)
    entry[v[cross]] = True                                  # ranks a block may enter its node through
    entry_nics: dict[int, set] = {}                         # per node, its entry ranks' NICs (rank order)
    for i in np.flatnonzero(entry).tolist():
        entry_nics.setdefault(int(node_of[i]), set()).add(topo.layout.gpu_nic[topo.local_rank_of(ranks[i])])
    for x, into in _need_tokens(topo, tuple(ranks), placement, seq_len, causal)[2].items():
        if not into:
            continue
        nics = entry_nics.get(x, set())
        if not nics:
            return float("inf")                             # the graph never reaches this node's readers
        t = max(t, into * kv_bytes_per_token / sum(topo.layout.nics[k].bandwidth for k in nics))
    return t
