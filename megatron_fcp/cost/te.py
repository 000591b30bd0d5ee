"""Transformer Engine's CP schedules and the lower bound, on the cost model of
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
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_fcp.contract.needs import needs_chunk
from megatron_fcp.contract.plan import check_cp_ranks
from megatron_fcp.cost.floors import intra_ingress, member_nic_ingress
from megatron_fcp.cost.model import (
    AttentionShape,
    ComputeModel,
    SimResult,
    kv_block_bytes,
    pad_for_zigzag,
    simulate_rounds,
)
from megatron_fcp.topology import Topology, load_topology

__all__ = ["simulate_te_p2p", "simulate_te_a2a_p2p", "lower_bound"]


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
    pair_bytes = 2 * kv_block_bytes(shape.seq_len, cp, shape.kv_heads, shape.head_dim, shape.dtype_bytes)
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
    a2a_out = [(a, b, shape.q_bytes(L2) / g) for m in groups.values() for a in m for b in m if a != b]
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
