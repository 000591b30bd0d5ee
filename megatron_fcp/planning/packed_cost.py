"""Packed batches (THD) on the cost model: TE's schedules on padded documents, FCP's backward.

Pure, no torch. The model is :mod:`megatron_fcp.planning.cost`'s (see its Note [Cost model]);
this module adds what a packed batch changes and the backward pass of every schedule.

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

Backward (all schedules), ``backward_flop_ratio`` (2.5: flash-attention's backward does 5 matmuls
to the forward's 2) times the forward FLOPs:

* TE's ring runs ``cp`` rounds: round 0 carries KV only, rounds 1..cp-2 KV and the dKV accumulated
  so far (twice the bytes), round cp-1 the dKV home (dKV in the KV dtype). Step ``i`` posts round
  ``i`` and computes; both start when round ``i-1`` and step ``i-1`` are done.
* ``te-a2a-p2p``: all-to-all of dO in, the same ring pattern across nodes, all-to-all of dQ/dK/dV out.
* FCP: the plan's rounds reversed with every transfer flipped (:meth:`Plan.backward_rounds`); each
  carries the block's partial dK/dV in FP32 (``grad_dtype_bytes`` = 4: twice bf16 KV), as the
  executor sends (docs/attention.md). A rank computes the blocks it received in reverse plan order,
  then its own; a backward round starts when the previous one is done and every partial it sends
  has been computed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from megatron_fcp.planning.baselines import simulate_te_a2a_p2p, simulate_te_p2p
from megatron_fcp.planning.cost import AttentionShape, ComputeModel, SimResult, causal_pairs, simulate_rounds
from megatron_fcp.planning.graph import check_cp_ranks
from megatron_fcp.planning.placement import check_doc_lengths
from megatron_fcp.planning.plan import Plan
from megatron_fcp.topology import Topology, load_topology

__all__ = [
    "BACKWARD_FLOP_RATIO",
    "thd_padded_lengths",
    "thd_rank_work",
    "simulate_te_p2p_thd",
    "simulate_te_a2a_p2p_thd",
    "simulate_plan_backward",
]

BACKWARD_FLOP_RATIO = 2.5
"""Backward attention FLOPs over forward (flash-attention: 5 matmuls vs 2)."""


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
    flop_s = 4.0 * shape.heads * shape.head_dim / cm.flops
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
    (see :func:`~megatron_fcp.planning.baselines.simulate_te_a2a_p2p`)."""
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
    flop_s = 4.0 * shape.heads * shape.head_dim / cm.flops
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
        pre = [(a, b, tshape.q_bytes(L2) / g) for m in groups.values() for a in m for b in m if a != b]
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


def simulate_plan_backward(
    plan: Plan,
    topology: "Topology | str",
    shape: AttentionShape,
    *,
    compute_model: ComputeModel | None = None,
    backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
    grad_dtype_bytes: int = 4,
    round_overhead_s: float = 0.0,
    name: str = "fcp",
) -> SimResult:
    """Backward pass of a plan over a placement: the dK/dV reduction along the reversed rounds;
    see Note [Transformer Engine on a packed batch] (the FCP item)."""
    pl = plan.placement
    if pl is None:
        raise ValueError("simulate_plan_backward: needs a plan over a placement (build_plan(..., placement=pl))")
    topo = load_topology(topology)
    cm = compute_model or ComputeModel()
    check_cp_ranks(topo, plan.ranks)
    pos = {r: i for i, r in enumerate(plan.ranks)}
    tokens = {(plan.ranks[i], b): s.tokens for i, b, s in pl.block_list()}
    per_token = 2 * shape.kv_heads * shape.head_dim * grad_dtype_bytes
    brounds = plan.backward_rounds()
    res = simulate_rounds(topo, [[(t.src, t.dst, tokens[(t.block.owner, t.block.chunk)] * per_token) for t in rnd]
                                 for rnd in brounds], round_overhead_s, name=name)
    flop_s = 4.0 * shape.heads * shape.head_dim / cm.flops * backward_flop_ratio

    def block_time(j: int, owner: int, b: int) -> float:
        p = pl.pairs(j, pos[owner], b)
        return p * flop_s + cm.kernel_overhead_s if p else 0.0

    # per rank: received blocks in reverse forward order, then its own blocks
    ready: dict[tuple[int, object], float] = {}
    busy = np.zeros(plan.cp)
    for rnd in reversed(plan.rounds):
        for t in reversed(rnd):
            j = pos[t.dst]
            busy[j] += block_time(j, t.block.owner, t.block.chunk)
            ready[(t.dst, t.block)] = busy[j]
    for j, r in enumerate(plan.ranks):
        busy[j] += sum(block_time(j, r, b) for b in range(len(pl.blocks[j])))
    t_end = 0.0
    for k, rnd in enumerate(brounds):
        e = res.timeline[k]
        dur = e["end_s"] - e["start_s"]
        start = max([t_end] + [ready.get((t.src, t.block), 0.0) for t in rnd])
        e["start_s"], e["end_s"] = start, start + dur
        t_end = start + dur
    res.compute_s = float(busy.max()) if plan.cp else 0.0
    res.total_s = max(t_end, res.compute_s)
    res.meta.update(graph=plan.name, grad_dtype_bytes=grad_dtype_bytes, transfers=plan.num_transfers())
    return res
