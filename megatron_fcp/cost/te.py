"""Transformer Engine's CP schedules (zigzag and packed THD, forward and backward) and the lower
bound, on the cost model of
:mod:`megatron_fcp.cost.model` (see its Note [Cost model]). Pure, no torch.

Baselines (forward pass, same model):

* ``te-p2p``: Transformer Engine's zigzag ring, cp-1 communication rounds each carrying one
  rank's whole KV pair (both chunks) to the next CP rank; cp compute steps of equal causal work
  (2L^2 pairs for chunk length L, plus the L diagonal pairs in step 0), step i+1 computed after
  round i arrives.
* ``te-a2a-p2p``: Ulysses all-to-all of Q, K, V inside each node (heads / g per rank), a ring of
  nodes-1 rounds over rail peers carrying the node-sequence KV of heads/g heads, an all-to-all of
  the output back. The all-to-alls are exposed (not overlapped).

Lower bound for one layer's KV all-gather (DESIGN.md §3), S = global KV bytes, N CP ranks on n
nodes: ``S * max((N-1)/(N*B_gpu), (n-1)/(n*B_out))`` with ``B_gpu`` the max-flow into a GPU
(:meth:`Topology.gpu_ingress_bandwidth`) and ``B_out`` a node's NIC ingress (per node, only the NICs
of the CP ranks it holds: :func:`member_nic_ingress`; an uneven group's half-filled node has half
the NICs). With even groups this is ``S * max((N-1)/(N*B_gpu), (n-1)/(n*B_out))``. The causal variant
replaces the byte counts by the need sets: the most any one rank needs, and the most any one node
needs from outside (each block counted once per node).

Note [Transformer Engine on a packed batch]
-------------------------------------------
TE's context parallelism on THD splits *every* document the way it splits one sequence: document
``d`` of ``L_d`` tokens is padded to ``P_d`` = the next multiple of ``2*cp`` (``cu_seqlens_padded``)
and cut into ``2*cp`` chunks of ``l_d = P_d / (2*cp)``; CP rank ``i`` holds chunks ``i`` and
``2*cp-1-i`` of every document (the zigzag per document). Padding sits at the end of a document,
so it lands in the last chunks (rank 0's second chunk first). For cp = 2 and documents [5, 3]::

    document 0 (P = 8, l = 2):  chunks [0,2) [2,4) [4,6) [6,8)   ranks 0 1 1 0   tokens 5..7 padding
    document 1 (P = 4, l = 1):  chunks [0,1) [1,2) [2,3) [3,4)   ranks 0 1 1 0   token 3 padding
    rank 0 holds 2+2 + 1+1 = 6 padded tokens (3 real), rank 1 holds 6 (6 real)

* ``te-p2p`` (THD): the ring carries each rank's whole padded KV (``sum_d P_d / cp`` tokens, both
  chunk halves of every document) to the next rank, ``cp-1`` rounds, whatever the documents need.
  Compute: TE gives every rank equal causal work per step per document in padded terms; the real
  work of rank ``i`` is its real query tokens against their documents (exact pair counts), and a
  step lasts ``max_i work_i / cp`` (ranks step together). Padding inflates bytes, not work.
* ``te-a2a-p2p`` (THD): Ulysses all-to-all of Q/K/V (padded tokens) inside a node, then the ring of
  node KV (``heads/g`` heads) across rail peers, the output all-to-all back; exposed all-to-alls.
  Heads split the node's work evenly, so a step lasts ``max over nodes of node work / (g * n)``.

Backward, ``backward_flop_ratio`` (``BACKWARD_FLOP_RATIO``, 2.5: flash-attention's backward does 5
matmuls to the forward's 2) times the forward FLOPs:

* TE's ring runs ``cp`` rounds: round 0 carries KV only, rounds 1..cp-2 KV and the dKV accumulated
  so far (twice the bytes), round cp-1 the dKV home (dKV in the KV dtype). Step ``i`` posts round
  ``i`` and computes; both start when round ``i-1`` and step ``i-1`` are done.
* ``te-a2a-p2p``: all-to-all of dO in, the same ring pattern across nodes, all-to-all of dQ/dK/dV out.
* FCP's backward: :mod:`megatron_fcp.cost.backward`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from megatron_fcp.contract.needs import causal_pairs, needs_chunk
from megatron_fcp.contract.placement import check_doc_lengths
from megatron_fcp.contract.plan import check_cp_ranks
from megatron_fcp.cost.floors import intra_ingress, member_nic_ingress
from megatron_fcp.cost.model import (
    BACKWARD_FLOP_RATIO,
    AttentionShape,
    ComputeModel,
    SimResult,
    kv_block_bytes,
    pad_for_zigzag,
    simulate_rounds,
)
from megatron_fcp.topology import Topology, load_topology

__all__ = ["simulate_te_p2p", "simulate_te_a2a_p2p", "lower_bound", "thd_padded_lengths", "thd_rank_work",
           "simulate_te_p2p_thd", "simulate_te_a2a_p2p_thd"]


def simulate_te_p2p(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    causal: bool = True,
    compute: bool = True,
    compute_model: ComputeModel | None = None,
    round_overhead_s: float = 0.0,
) -> SimResult:
    """Transformer Engine ``p2p`` (zigzag ring); see Note [Cost model]."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cm = compute_model or ComputeModel()
    cp = len(ranks)
    shape, _ = pad_for_zigzag(shape, cp)  # as Megatron pads
    pair_bytes = 2 * kv_block_bytes(shape.seq_len, cp, shape.kv_heads, shape.head_dim, shape.dtype_bytes,
                                    v_head_dim=shape.v_head_dim)
    rounds = [[(ranks[i], ranks[(i + 1) % cp], pair_bytes) for i in range(cp)] for _ in range(cp - 1)]
    res = simulate_rounds(topo, rounds, round_overhead_s, name="te-p2p")
    res.meta.update(graph="ring", steps=cp)
    if not compute:
        return res
    L = shape.seq_len // (2 * cp)
    step_pairs = 2 * L * L if causal else 4 * L * L
    step = float(cm.time(step_pairs, shape))
    diag = float(cm.time(step_pairs + (L if causal else 0), shape))  # step 0 includes the diagonal
    t = diag
    for e in res.timeline:
        t = max(t, e["end_s"]) + step
    res.compute_s = diag + step * (cp - 1)
    res.total_s = max(t, res.comm_s)
    return res


def simulate_te_a2a_p2p(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    causal: bool = True,
    compute: bool = True,
    compute_model: ComputeModel | None = None,
    round_overhead_s: float = 0.0,
) -> SimResult:
    """Transformer Engine ``a2a+p2p``: Ulysses inside nodes, ring across rail peers.

    Raises ValueError when it does not apply: nodes hold different numbers of CP ranks, or heads
    / kv_heads are not divisible by the ranks per node (TE's own requirement).
    """
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cm = compute_model or ComputeModel()
    cp = len(ranks)
    shape, _ = pad_for_zigzag(shape, cp)  # as Megatron pads
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(topo.node_of(r), []).append(r)
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1:
        raise ValueError(f"te-a2a-p2p: nodes hold different numbers of CP ranks {sorted(sizes)}")
    g = sizes.pop()
    if shape.heads % g or shape.kv_heads % g:
        raise ValueError(
            f"te-a2a-p2p: heads ({shape.heads}) and kv_heads ({shape.kv_heads}) must divide by the "
            f"{g} CP ranks per node"
        )
    nodes = list(groups)
    n = len(nodes)
    L2 = shape.seq_len / cp  # tokens per rank (two zigzag chunks)
    a2a_in = [(a, b, (shape.q_bytes(L2) + shape.kv_bytes(L2)) / g) for m in groups.values() for a in m for b in m if a != b]
    a2a_out = [(a, b, shape.o_bytes(L2) / g) for m in groups.values() for a in m for b in m if a != b]
    ring_bytes = shape.kv_bytes(L2)  # node sequence (g*L2 tokens) of heads/g KV heads
    ring = [[(groups[nodes[x]][k], groups[nodes[(x + 1) % n]][k], ring_bytes) for x in range(n) for k in range(g)]
            for _ in range(n - 1)]
    rounds = ([a2a_in] if g > 1 else []) + ring + ([a2a_out] if g > 1 else [])
    res = simulate_rounds(topo, rounds, round_overhead_s, name="te-a2a-p2p")
    res.meta.update(graph="a2a+ring", ranks_per_node=g, nodes=n)
    if not compute:
        return res
    L = shape.seq_len // (2 * cp)
    total_pairs = (2 * L * L * cp + L) if causal else 4 * L * L * cp  # same work per rank as p2p
    step = float(cm.time(total_pairs / n, shape))
    dur = [e["end_s"] - e["start_s"] for e in res.timeline]
    d_in, d_out = (dur[0], dur[-1]) if g > 1 else (0.0, 0.0)
    ring_d = dur[1:-1] if g > 1 else dur
    t = d_in + step  # attention starts after the exposed all-to-all
    arrived = d_in
    for d in ring_d:
        arrived += d
        t = max(t, arrived) + step
    res.compute_s = step * n
    res.total_s = max(t + d_out, res.comm_s)  # the output all-to-all is exposed too
    return res


def lower_bound(topology: "Topology | str", cp_ranks: Sequence[int], shape: AttentionShape,
                causal: bool = False) -> dict:
    """Lower bound on one layer's KV exchange time; see Note [Cost model]. Returns a dict with
    ``lower_bound_s`` and its ingredients (``S``, ``N``, ``n``, ``B_gpu``, ``B_out``)."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    N = len(ranks)
    shape, _ = pad_for_zigzag(shape, N)  # as Megatron pads
    nodes = sorted({topo.node_of(r) for r in ranks})
    n = len(nodes)
    S = shape.kv_bytes(shape.seq_len)
    chunk = S / (2 * N)
    b_gpu = min(topo.gpu_ingress_bandwidth(r) if n > 1 else intra_ingress(topo, r) for r in ranks)
    b_out = topo.node_ingress_bandwidth() if n > 1 else float("inf")
    if not causal:
        # every node receives the KV of every other node's ranks through its own members' NICs
        t_node = max(S * (1 - sum(1 for r in ranks if topo.node_of(r) == x) / N) /
                     member_nic_ingress(topo, [r for r in ranks if topo.node_of(r) == x]) for x in nodes) \
            if n > 1 else 0.0
        t = max(S * (N - 1) / (N * b_gpu), t_node)
        return {"lower_bound_s": t, "S": S, "N": N, "n": n, "B_gpu": b_gpu, "B_out": b_out, "causal": False}
    # need-set aware: count[j, i] = chunks of CP rank i that CP rank j needs (the need rule)
    idx = np.arange(N)
    count = sum(needs_chunk(idx[:, None], idx[None, :], c, True).astype(np.int64) for c in (0, 1))
    per_rank = int(count.sum(axis=1).max()) * chunk
    t_gpu = per_rank / b_gpu
    t_node = 0.0
    if n > 1:
        node_of = np.array([topo.node_of(r) for r in ranks])
        for x in nodes:
            members = node_of == x
            # a block crosses into node x once if any member needs it, through its members' NICs
            need = sum(int(needs_chunk(idx[members][:, None], idx[~members][None, :], c, True).any(axis=0).sum())
                       for c in (0, 1))
            b_in = member_nic_ingress(topo, [r for r, m in zip(ranks, members) if m])
            t_node = max(t_node, need * chunk / b_in)
    return {"lower_bound_s": max(t_gpu, t_node), "S": S, "N": N, "n": n, "B_gpu": b_gpu, "B_out": b_out,
            "causal": True}


def thd_padded_lengths(doc_lengths: Sequence[int], cp: int) -> np.ndarray:
    """Each document's length rounded up to a multiple of ``2*cp`` (int64), as TE pads THD."""
    check_doc_lengths(doc_lengths)
    L = np.asarray(doc_lengths, dtype=np.int64)
    return -(-L // (2 * cp)) * (2 * cp)


def thd_rank_work(doc_lengths: Sequence[int], cp: int, causal: bool = True) -> np.ndarray:
    """Real attention work (query-key pairs under the document mask) of each CP rank (int64 ``[cp]``)
    under TE's per-document zigzag; see Note [Transformer Engine on a packed batch]."""
    L = np.asarray(doc_lengths, dtype=np.int64)
    P = thd_padded_lengths(doc_lengths, cp)
    l = P // (2 * cp)
    work = np.zeros(cp, dtype=np.int64)
    for i in range(cp):
        for c in (i, 2 * cp - 1 - i):
            q0 = np.minimum(c * l, L)
            q1 = np.minimum((c + 1) * l, L)
            work[i] += int(causal_pairs(q0, q1, 0, L, causal).sum())
    return work


def _thd_shape(doc_lengths: Sequence[int], cp: int, shape: AttentionShape) -> AttentionShape:
    return replace(shape, seq_len=int(thd_padded_lengths(doc_lengths, cp).sum()))


def _ring_backward(topo: Topology, hops: list[tuple[int, int]], steps: int, kv_bytes: float, step_s: float,
                   round_overhead_s: float, name: str, pre: list | None = None,
                   post: list | None = None) -> SimResult:
    """TE's backward ring of ``steps`` steps over ``hops`` (one ``(src, dst)`` per rank): round ``k``
    is posted with step ``k``; round 0 carries KV, rounds 1..steps-2 KV and dKV, the last dKV home.
    ``pre``/``post``: exposed all-to-all rounds before and after."""
    ring = [[(a, b, kv_bytes * (1 if k in (0, steps - 1) else 2)) for a, b in hops] for k in range(steps)] \
        if hops and steps > 1 else []
    rounds = ([pre] if pre else []) + ring + ([post] if post else [])
    res = simulate_rounds(topo, rounds, round_overhead_s, name=name)
    dur = [e["end_s"] - e["start_s"] for e in res.timeline]
    d_pre = dur[0] if pre else 0.0
    d_post = dur[-1] if post else 0.0
    ring_d = dur[(1 if pre else 0):len(dur) - (1 if post else 0)]
    r_end = c_end = d_pre
    for k in range(steps):
        s = max(r_end, c_end)
        c_end = s + step_s
        r_end = s + (ring_d[k] if k < len(ring_d) else 0.0)
    res.compute_s = step_s * steps
    res.total_s = max(r_end, c_end) + d_post
    return res


def simulate_te_p2p_thd(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    doc_lengths: Sequence[int],
    shape: AttentionShape,
    *,
    causal: bool = True,
    backward: bool = False,
    compute_model: ComputeModel | None = None,
    backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
    round_overhead_s: float = 0.0,
) -> SimResult:
    """TE ``p2p`` on a packed batch (forward, or ``backward=True``); ``shape.seq_len`` is not used.
    See Note [Transformer Engine on a packed batch]. ``meta``: ``padded_tokens``, ``padding_overhead``
    (padded tokens over real tokens, minus 1), ``work_max_over_mean``."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cm = compute_model or ComputeModel()
    cp = len(ranks)
    tshape = _thd_shape(doc_lengths, cp, shape)
    work = thd_rank_work(doc_lengths, cp, causal)
    flop_s = shape.pair_flops / cm.flops
    ratio = backward_flop_ratio if backward else 1.0
    step = float(work.max()) / cp * flop_s * ratio + cm.kernel_overhead_s
    if not backward:
        res = simulate_te_p2p(topo, ranks, tshape, causal=causal, compute=False, round_overhead_s=round_overhead_s)
        t = step
        for e in res.timeline:
            t = max(t, e["end_s"]) + step
        res.compute_s = step * cp
        res.total_s = max(t, res.comm_s)
    else:
        kv = tshape.kv_bytes(tshape.seq_len / cp)
        hops = [(ranks[i], ranks[(i + 1) % cp]) for i in range(cp)] if cp > 1 else []
        res = _ring_backward(topo, hops, cp, kv, step, round_overhead_s, "te-p2p")
        res.meta.update(graph="ring", steps=cp)
    _thd_meta(res, doc_lengths, tshape, work)
    return res


def simulate_te_a2a_p2p_thd(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    doc_lengths: Sequence[int],
    shape: AttentionShape,
    *,
    causal: bool = True,
    backward: bool = False,
    compute_model: ComputeModel | None = None,
    backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
    round_overhead_s: float = 0.0,
) -> SimResult:
    """TE ``a2a+p2p`` on a packed batch (padded THD layout); raises ValueError where TE cannot run it
    (see :func:`~megatron_fcp.cost.te.simulate_te_a2a_p2p`)."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cm = compute_model or ComputeModel()
    cp = len(ranks)
    tshape = _thd_shape(doc_lengths, cp, shape)
    fwd = simulate_te_a2a_p2p(topo, ranks, tshape, causal=causal, compute=False, round_overhead_s=round_overhead_s)
    g, n = fwd.meta["ranks_per_node"], fwd.meta["nodes"]
    work = thd_rank_work(doc_lengths, cp, causal)
    node_of = np.array([topo.node_of(r) for r in ranks])
    node_work = max(int(work[node_of == x].sum()) for x in set(node_of.tolist()))
    flop_s = shape.pair_flops / cm.flops
    ratio = backward_flop_ratio if backward else 1.0
    step = node_work / (g * n) * flop_s * ratio + cm.kernel_overhead_s
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(topo.node_of(r), []).append(r)
    nodes = list(groups)
    L2 = tshape.seq_len / cp
    if not backward:
        res = fwd
        dur = [e["end_s"] - e["start_s"] for e in res.timeline]
        d_in, d_out = (dur[0], dur[-1]) if g > 1 else (0.0, 0.0)
        t = arrived = d_in
        t += step
        for d in (dur[1:-1] if g > 1 else dur):
            arrived += d
            t = max(t, arrived) + step
        res.compute_s = step * n
        res.total_s = max(t + d_out, res.comm_s)
    else:
        pre = [(a, b, tshape.o_bytes(L2) / g) for m in groups.values() for a in m for b in m if a != b]
        post = [(a, b, (tshape.q_bytes(L2) + tshape.kv_bytes(L2)) / g) for m in groups.values() for a in m for b in m
                if a != b]
        hops = [(groups[nodes[x]][k], groups[nodes[(x + 1) % n]][k]) for x in range(n) for k in range(g)] \
            if n > 1 else []
        res = _ring_backward(topo, hops, n, tshape.kv_bytes(L2), step, round_overhead_s, "te-a2a-p2p",
                             pre if g > 1 else None, post if g > 1 else None)
        res.meta.update(graph="a2a+ring", ranks_per_node=g, nodes=n)
    _thd_meta(res, doc_lengths, tshape, work)
    return res


def _thd_meta(res: SimResult, doc_lengths, tshape: AttentionShape, work: np.ndarray) -> None:
    real = int(sum(doc_lengths))
    res.meta.update(padded_tokens=tshape.seq_len, padding_overhead=tshape.seq_len / real - 1.0,
                    work_max_over_mean=float(work.max() / work.mean()) if work.mean() > 0 else 1.0)
