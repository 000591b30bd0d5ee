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

Note [Transformer Engine's kernel calls]
---------------------------------------
Under a tiled compute model (:meth:`~megatron_fcp.cost.model.ComputeModel.tiled`) TE's compute is
priced from the calls TE makes (:func:`te_ring_steps_s`): ring step 0 is one causal call of a rank's
two chunks (causal in their local order: the zigzag's own diagonal); step ``k`` receives the KV of
rank ``s = r - k``: an earlier rank's first chunk against all the rank's rows, or, from a later
rank, both its chunks against the rank's second chunk only (full-mask calls), one varlen call per
step over every document (THD: each document's real tokens of those chunks, padding not
computed; a 2K-token document at cp = 64 is 16-token chunks, each paying whole tiles). The
a2a+p2p ring is the same over nodes, with ``heads / g`` heads and node chunks of ``g`` rank
chunks. Under a window, ``a2a`` is one fused call over the whole sequence (``heads / cp``
heads), ``all_gather`` a call per query chunk against the sequence.

Note [Transformer Engine under a sliding window]
------------------------------------------------
TE runs a sliding window (``window_size``) under context parallelism only with two of its four
``cp_comm_type`` values; ``p2p`` and ``a2a+p2p`` refuse it ("Context parallelism does not support
sliding window attention with cp_comm_type=..."). So do :func:`simulate_te_p2p`,
:func:`simulate_te_a2a_p2p` and their THD forms here: given a window they **raise** ValueError with
TE's reason, rather than price a schedule TE cannot run. What TE does run, priced with the
window's real work (:meth:`~megatron_fcp.contract.mask.Mask.pairs`, the busiest rank's):

* ``te-a2a`` (:func:`simulate_te_a2a`, Ulysses over the whole CP group; heads and KV heads must
  divide by ``cp``, else ValueError as TE refuses): all-to-all of Q, K, V in (each rank keeps
  ``heads/cp`` heads of the whole sequence), local windowed attention (the whole sequence's pairs
  over ``cp``), all-to-all of O out; the all-to-alls are exposed. Backward: dO in, ``2.5x`` the
  work, dQ, dK, dV out.
* ``te-all-gather`` (:func:`simulate_te_all_gather`): every rank all-gathers K and V of the whole
  sequence (one round, every ordered pair carrying one shard), then computes its own queries'
  windowed work; not overlapped. Backward: the all-gather again, ``2.5x`` the work, a
  reduce-scatter of dK, dV (the same bytes as the all-gather).

Beside TE, the halo ring (:func:`simulate_halo_ring`, Megatron-LM PR #5597's ``swa_p2p`` idea):
each rank receives exactly the ``ceil(W / chunk)`` neighbour chunks its window reaches, p2p from
their owners, nearest first (:func:`~megatron_fcp.contract.plan.halo_plan`), overlapped with
compute as FCP's plans are (:func:`~megatron_fcp.cost.model.simulate_plan`; backward
:func:`~megatron_fcp.cost.backward.simulate_plan_backward`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Sequence

import numpy as np

from megatron_fcp.contract.mask import Mask
from megatron_fcp.contract.needs import causal_pairs, chunk_need_matrix
from megatron_fcp.contract.placement import check_doc_lengths, thd_padded_lengths
from megatron_fcp.contract.plan import check_cp_ranks, halo_plan
from megatron_fcp.cost.backward import simulate_plan_backward
from megatron_fcp.cost.floors import intra_ingress, member_nic_ingress, rank_pairs
from megatron_fcp.cost.model import (
    BACKWARD_FLOP_RATIO,
    AttentionShape,
    ComputeModel,
    SimResult,
    kv_block_bytes,
    pad_for_zigzag,
    simulate_plan,
    simulate_rounds,
)
from megatron_fcp.topology import Topology, load_topology

__all__ = ["simulate_te_p2p", "simulate_te_a2a_p2p", "lower_bound", "thd_padded_lengths", "thd_rank_work",
           "simulate_te_p2p_thd", "simulate_te_a2a_p2p_thd", "simulate_te_a2a", "simulate_te_all_gather",
           "simulate_halo_ring", "te_refuses_window", "TE_WINDOW_TYPES", "te_ring_steps_s", "te_thd_floor",
           "te_a2a_p2p_ranks_per_node"]

TE_WINDOW_TYPES = ("a2a", "all_gather")
"""TE's ``cp_comm_type`` values that run a sliding window (Note [Transformer Engine under a sliding window])."""


def te_refuses_window(cp_comm_type: str, causal: bool, window) -> None:
    """Raise ValueError, as TE does, when ``cp_comm_type`` cannot run ``window`` (``p2p``, ``a2a+p2p``)."""
    mask = Mask.of(causal, window)
    if mask.windowed and cp_comm_type not in TE_WINDOW_TYPES:
        raise ValueError(f"te-{cp_comm_type}: Transformer Engine refuses a sliding window {mask.window} with "
                         f"cp_comm_type={cp_comm_type!r} (only {' and '.join(TE_WINDOW_TYPES)} run it): price "
                         "simulate_te_a2a / simulate_te_all_gather instead")


def simulate_te_p2p(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    causal: bool = True,
    compute: bool = True,
    compute_model: ComputeModel | None = None,
    round_overhead_s: float = 0.0,
    window=None,
) -> SimResult:
    """Transformer Engine ``p2p`` (zigzag ring); see Note [Cost model]. Raises ValueError under a
    sliding ``window``, as TE does (Note [Transformer Engine under a sliding window])."""
    te_refuses_window("p2p", causal, window)
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cm = compute_model or ComputeModel()
    cp = len(ranks)
    shape, _ = pad_for_zigzag(shape, cp)  # as Megatron pads
    pair_bytes = 2 * kv_block_bytes(shape.seq_len, cp, shape.kv_heads, shape.head_dim, shape.dtype_bytes,
                                    v_head_dim=shape.v_head_dim)
    hop = [(ranks[i], ranks[(i + 1) % cp], pair_bytes) for i in range(cp)]
    rounds = [hop] * (cp - 1)                    # one round object, routed once (simulate_rounds)
    res = simulate_rounds(topo, rounds, round_overhead_s, name="te-p2p")
    res.meta.update(graph="ring", steps=cp)
    if not compute:
        return res
    if cm.kernel is not None:  # TE's calls by tiles (Note [Transformer Engine's kernel calls])
        steps = te_ring_steps_s(cm, shape, [shape.seq_len], cp, 1, causal)
    else:
        L = shape.seq_len // (2 * cp)
        step_pairs = 2 * L * L if causal else 4 * L * L
        step = float(cm.time(step_pairs, shape))
        diag = float(cm.time(step_pairs + (L if causal else 0), shape))  # step 0 includes the diagonal
        steps = [diag] + [step] * (cp - 1)
    t = steps[0]
    for e, step in zip(res.timeline, steps[1:]):
        t = max(t, e["end_s"]) + step
    res.compute_s = float(sum(steps))
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
    window=None,
) -> SimResult:
    """Transformer Engine ``a2a+p2p``: Ulysses inside nodes, ring across rail peers.

    Raises ValueError when it does not apply: nodes hold different numbers of CP ranks, or heads
    / kv_heads are not divisible by the ranks per node (TE's own requirement), or under a sliding
    ``window`` (TE refuses it).
    """
    te_refuses_window("a2a+p2p", causal, window)
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cm = compute_model or ComputeModel()
    cp = len(ranks)
    shape, _ = pad_for_zigzag(shape, cp)  # as Megatron pads
    groups, g = _a2a_p2p_nodes(topo, ranks, shape)
    nodes = list(groups)
    n = len(nodes)
    L2 = shape.seq_len / cp  # tokens per rank (two zigzag chunks)
    a2a_in = [(a, b, (shape.q_bytes(L2) + shape.kv_bytes(L2)) / g) for m in groups.values() for a in m for b in m if a != b]
    a2a_out = [(a, b, shape.o_bytes(L2) / g) for m in groups.values() for a in m for b in m if a != b]
    ring_bytes = shape.kv_bytes(L2)  # node sequence (g*L2 tokens) of heads/g KV heads
    ring = [[(groups[nodes[x]][k], groups[nodes[(x + 1) % n]][k], ring_bytes) for x in range(n) for k in range(g)]
            ] * (n - 1)                          # one round object, routed once (simulate_rounds)
    rounds = ([a2a_in] if g > 1 else []) + ring + ([a2a_out] if g > 1 else [])
    res = simulate_rounds(topo, rounds, round_overhead_s, name="te-a2a-p2p")
    res.meta.update(graph="a2a+ring", ranks_per_node=g, nodes=n)
    if not compute:
        return res
    if cm.kernel is not None:  # TE's calls by tiles (Note [Transformer Engine's kernel calls])
        steps = te_ring_steps_s(cm, shape, [shape.seq_len], n, g, causal)
    else:
        L = shape.seq_len // (2 * cp)
        total_pairs = (2 * L * L * cp + L) if causal else 4 * L * L * cp  # same work per rank as p2p
        steps = [float(cm.time(total_pairs / n, shape))] * n
    dur = [e["end_s"] - e["start_s"] for e in res.timeline]
    d_in, d_out = (dur[0], dur[-1]) if g > 1 else (0.0, 0.0)
    ring_d = dur[1:-1] if g > 1 else dur
    t = d_in + steps[0]  # attention starts after the exposed all-to-all
    arrived = d_in
    for d, step in zip(ring_d, steps[1:]):
        arrived += d
        t = max(t, arrived) + step
    res.compute_s = float(sum(steps))
    res.total_s = max(t + d_out, res.comm_s)  # the output all-to-all is exposed too
    return res


def lower_bound(topology: "Topology | str", cp_ranks: Sequence[int], shape: AttentionShape,
                causal: bool = False, window=None) -> dict:
    """Lower bound on one layer's KV exchange time; see Note [Cost model]. Returns a dict with
    ``lower_bound_s`` and its ingredients (``S``, ``N``, ``n``, ``B_gpu``, ``B_out``). Under a
    sliding ``window`` the need-set bound counts the window's need sets (Note [Windowed need sets])."""
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
    mask = Mask.of(causal, window)
    if not causal and not mask.windowed:
        # every node receives the KV of every other node's ranks through its own members' NICs
        t_node = max(S * (1 - sum(1 for r in ranks if topo.node_of(r) == x) / N) /
                     member_nic_ingress(topo, [r for r in ranks if topo.node_of(r) == x]) for x in nodes) \
            if n > 1 else 0.0
        t = max(S * (N - 1) / (N * b_gpu), t_node)
        return {"lower_bound_s": t, "S": S, "N": N, "n": n, "B_gpu": b_gpu, "B_out": b_out, "causal": False}
    # need-set aware: need[j, c*N + i] = CP rank j needs chunk c of CP rank i (the need rule)
    need = chunk_need_matrix(N, mask, shape.seq_len)
    per_rank = int(need.sum(axis=1).max()) * chunk
    t_gpu = per_rank / b_gpu
    t_node = 0.0
    if n > 1:
        node_of = np.array([topo.node_of(r) for r in ranks])
        for x in nodes:
            members = node_of == x
            # a block crosses into node x once if any member needs it, through its members' NICs
            outside = np.concatenate([~members, ~members])
            into = int((need[members].any(axis=0) & outside).sum())
            b_in = member_nic_ingress(topo, [r for r, m in zip(ranks, members) if m])
            t_node = max(t_node, into * chunk / b_in)
    return {"lower_bound_s": max(t_gpu, t_node), "S": S, "N": N, "n": n, "B_gpu": b_gpu, "B_out": b_out,
            "causal": bool(causal), "window": mask.window}


def thd_rank_work(doc_lengths: Sequence[int], cp: int, causal: bool = True) -> np.ndarray:
    """Real attention work (query-key pairs under the document mask) of each CP rank (int64 ``[cp]``)
    under TE's per-document zigzag; see Note [Transformer Engine on a packed batch]. The last few
    batches' answers are kept (TE's forward and backward of one batch both ask)."""
    check_doc_lengths(doc_lengths)
    return _thd_rank_work(tuple(map(int, doc_lengths)), int(cp), bool(causal)).copy()


@functools.lru_cache(maxsize=8)
def _thd_rank_work(doc_lengths: tuple[int, ...], cp: int, causal: bool) -> np.ndarray:
    L = np.asarray(doc_lengths, dtype=np.int64)
    P = thd_padded_lengths(doc_lengths, cp)
    l = P // (2 * cp)
    c = np.arange(2 * cp, dtype=np.int64)[:, None]                           # [2cp, 1]: chunk
    q0, q1 = np.minimum(c * l, L), np.minimum((c + 1) * l, L)                 # [2cp, D]
    chunk = causal_pairs(q0, q1, 0, L, causal).sum(axis=1)                    # [2cp]: every document's
    return chunk[:cp] + chunk[2 * cp - 1:cp - 1:-1]                           # rank i: chunks i, 2cp-1-i


def _full_work(c, heads: int, n: np.ndarray, m: np.ndarray, merged: bool) -> np.ndarray:
    """Tile-priced work of full-mask calls of ``n`` rows against ``m`` keys (vectorised): every
    tile pair touched is all visible (Note [Tile-priced kernels])."""
    qt, kt = -(-n // c.q_tile), -(-m // c.k_tile)
    w = c.tile_s * qt * kt + c.q_tile_s * qt + c.k_tile_s * kt + (c.merge_s * n if merged else 0.0)
    return np.where((n > 0) & (m > 0), heads * w, 0.0)


def te_ring_steps_s(cm: ComputeModel, shape: AttentionShape, doc_lengths: Sequence[int], ring: int, group: int,
                    causal: bool, flop_ratio: float = 1.0) -> list[float]:
    """Seconds of each step of TE's ring under a tiled compute model (Note [Transformer Engine's
    kernel calls]): ``ring`` ranks in the ring (``cp`` for p2p, the nodes for a2a+p2p) each holding
    ``shape.heads / group`` heads; every document padded to a multiple of ``2 * ring * group`` and
    cut into ``2 * ring`` chunks, padding at its end (not computed). A step lasts its busiest
    rank's varlen call: its work over every document plus one launch."""
    c = cm.tile_costs(shape, flop_ratio)
    hshape = replace(shape, heads=shape.heads // group, kv_heads=max(shape.kv_heads // group, 1))
    heads, merged = hshape.heads, ring > 1
    Ld = np.asarray(doc_lengths, dtype=np.int64)
    l = thd_padded_lengths(doc_lengths, ring * group) // (2 * ring)                    # [D] chunk tokens
    real = np.clip(Ld[None, :] - np.arange(2 * ring)[:, None] * l[None, :], 0, l[None, :])  # [2R, D]
    r = np.arange(ring)
    lo, hi = real[r], real[2 * ring - 1 - r]                                           # [R, D] each
    launch = cm.launch_s(flop_ratio)
    mask = Mask.of(causal)
    if causal:  # step 0: the rank's two chunks, causal in their local order
        memo: dict[int, float] = {}
        for x in np.unique(lo + hi).tolist():
            memo[x] = cm.work_s(x, 0, x, 0, hshape, mask, flop_ratio, merged)
        first = np.vectorize(memo.__getitem__, otypes=[float])(lo + hi).sum(axis=1)
    else:
        first = _full_work(c, heads, lo + hi, lo + hi, merged).sum(axis=1)
    steps = [float(first.max()) + launch]
    for k in range(1, ring):
        s = (r - k) % ring
        if causal:  # an earlier rank: all rows on its first chunk; a later one: the second half on both
            w = np.where((s < r)[:, None], _full_work(c, heads, lo + hi, lo[s], merged),
                         _full_work(c, heads, hi, lo[s] + hi[s], merged))
        else:
            w = _full_work(c, heads, lo + hi, lo[s] + hi[s], merged)
        steps.append(float(w.sum(axis=1).max()) + launch)
    return steps


def _thd_shape(doc_lengths: Sequence[int], cp: int, shape: AttentionShape) -> AttentionShape:
    return replace(shape, seq_len=int(thd_padded_lengths(doc_lengths, cp).sum()))


def _ring_backward_rounds(hops: list[tuple[int, int]], steps: int, kv_bytes: float) -> list:
    """TE's backward ring's rounds: round 0 KV, rounds 1..steps-2 KV and dKV, the last dKV home;
    the repeated rounds are one object each (routed once: :func:`~megatron_fcp.cost.model.simulate_rounds`)."""
    kv, both = ([(a, b, kv_bytes * m) for a, b in hops] for m in (1, 2))
    return [kv] + [both] * (steps - 2) + [kv] if hops and steps > 1 else []


def _ring_backward(topo: Topology, hops: list[tuple[int, int]], steps: int, kv_bytes: float, step_s,
                   round_overhead_s: float, name: str, pre: list | None = None,
                   post: list | None = None) -> SimResult:
    """TE's backward ring of ``steps`` steps over ``hops`` (one ``(src, dst)`` per rank): round ``k``
    is posted with step ``k``; round 0 carries KV, rounds 1..steps-2 KV and dKV, the last dKV home.
    ``pre``/``post``: exposed all-to-all rounds before and after. ``step_s``: seconds of every step,
    or a list of each step's."""
    step_list = [float(step_s)] * steps if np.isscalar(step_s) else [float(x) for x in step_s]
    ring = _ring_backward_rounds(hops, steps, kv_bytes)
    rounds = ([pre] if pre else []) + ring + ([post] if post else [])
    res = simulate_rounds(topo, rounds, round_overhead_s, name=name)
    dur = [e["end_s"] - e["start_s"] for e in res.timeline]
    d_pre = dur[0] if pre else 0.0
    d_post = dur[-1] if post else 0.0
    ring_d = dur[(1 if pre else 0):len(dur) - (1 if post else 0)]
    r_end = c_end = d_pre
    for k in range(steps):
        s = max(r_end, c_end)
        c_end = s + step_list[k]
        r_end = s + (ring_d[k] if k < len(ring_d) else 0.0)
    res.compute_s = float(sum(step_list)) if not np.isscalar(step_s) else step_s * steps
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
    window=None,
) -> SimResult:
    """TE ``p2p`` on a packed batch (forward, or ``backward=True``); ``shape.seq_len`` is not used.
    See Note [Transformer Engine on a packed batch]. ``meta``: ``padded_tokens``, ``padding_overhead``
    (padded tokens over real tokens, minus 1), ``work_max_over_mean``. Refuses a ``window`` as TE does."""
    te_refuses_window("p2p", causal, window)
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cm = compute_model or ComputeModel()
    cp = len(ranks)
    tshape = _thd_shape(doc_lengths, cp, shape)
    work = thd_rank_work(doc_lengths, cp, causal)
    flop_s = shape.pair_flops / cm.flops
    ratio = backward_flop_ratio if backward else 1.0
    if cm.kernel is not None:  # TE's calls by tiles (Note [Transformer Engine's kernel calls])
        step = te_ring_steps_s(cm, shape, doc_lengths, cp, 1, causal, ratio)
    else:
        step = float(work.max()) / cp * flop_s * ratio + cm.kernel_overhead_s
    steps = [step] * cp if np.isscalar(step) else step
    if not backward:
        res = simulate_te_p2p(topo, ranks, tshape, causal=causal, compute=False, round_overhead_s=round_overhead_s)
        t = steps[0]
        for e, st in zip(res.timeline, steps[1:]):
            t = max(t, e["end_s"]) + st
        res.compute_s = float(sum(steps)) if not np.isscalar(step) else step * cp
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
    window=None,
) -> SimResult:
    """TE ``a2a+p2p`` on a packed batch (padded THD layout); raises ValueError where TE cannot run it
    (see :func:`~megatron_fcp.cost.te.simulate_te_a2a_p2p`), a sliding ``window`` included."""
    te_refuses_window("a2a+p2p", causal, window)
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
    if cm.kernel is not None:  # TE's calls by tiles (Note [Transformer Engine's kernel calls])
        step = te_ring_steps_s(cm, shape, doc_lengths, n, g, causal, ratio)
    else:
        step = node_work / (g * n) * flop_s * ratio + cm.kernel_overhead_s
    steps = [step] * n if np.isscalar(step) else step
    groups = _node_ranks(topo, ranks)
    L2 = tshape.seq_len / cp
    if not backward:
        res = fwd
        dur = [e["end_s"] - e["start_s"] for e in res.timeline]
        d_in, d_out = (dur[0], dur[-1]) if g > 1 else (0.0, 0.0)
        t = arrived = d_in
        t += steps[0]
        for d, st in zip(dur[1:-1] if g > 1 else dur, steps[1:]):
            arrived += d
            t = max(t, arrived) + st
        res.compute_s = float(sum(steps)) if not np.isscalar(step) else step * n
        res.total_s = max(t + d_out, res.comm_s)
    else:
        pre, post, hops = _a2a_p2p_backward_messages(groups, tshape, g)
        res = _ring_backward(topo, hops, n, tshape.kv_bytes(L2), step, round_overhead_s, "te-a2a-p2p",
                             pre if g > 1 else None, post if g > 1 else None)
        res.meta.update(graph="a2a+ring", ranks_per_node=g, nodes=n)
    _thd_meta(res, doc_lengths, tshape, work)
    return res


def _node_ranks(topo: Topology, ranks: Sequence[int]) -> dict[int, list[int]]:
    """The CP ranks of every node, nodes in the order they first appear in CP order."""
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(topo.node_of(r), []).append(r)
    return groups


def te_a2a_p2p_ranks_per_node(topology: "Topology | str", cp_ranks: Sequence[int], shape: AttentionShape) -> int:
    """The CP ranks per node TE's ``a2a+p2p`` exchanges heads among (its all-to-all degree), or
    ValueError naming why TE does not run it on this group and shape (:func:`_a2a_p2p_nodes`)."""
    topo = load_topology(topology)
    return _a2a_p2p_nodes(topo, check_cp_ranks(topo, cp_ranks), shape)[1]


def _a2a_p2p_nodes(topo: Topology, ranks: Sequence[int], shape: AttentionShape) -> tuple[dict[int, list[int]], int]:
    """TE ``a2a+p2p``'s nodes (:func:`_node_ranks`) and CP ranks per node; ValueError where TE does
    not run it: nodes holding different numbers of CP ranks, or heads / kv_heads not divisible by
    the ranks per node (TE's own requirement)."""
    groups = _node_ranks(topo, ranks)
    sizes = {len(m) for m in groups.values()}
    if len(sizes) != 1:
        raise ValueError(f"te-a2a-p2p: nodes hold different numbers of CP ranks {sorted(sizes)}")
    g = sizes.pop()
    if shape.heads % g or shape.kv_heads % g:
        raise ValueError(
            f"te-a2a-p2p: heads ({shape.heads}) and kv_heads ({shape.kv_heads}) must divide by the "
            f"{g} CP ranks per node"
        )
    return groups, g


def _rail_hops(groups: dict[int, list[int]], g: int) -> list[tuple[int, int]]:
    """The hops of TE ``a2a+p2p``'s ring: rank ``k`` of each node to rank ``k`` of the next."""
    nodes = list(groups)
    n = len(nodes)
    return [(groups[nodes[x]][k], groups[nodes[(x + 1) % n]][k]) for x in range(n) for k in range(g)] if n > 1 else []


def _a2a_p2p_backward_messages(groups: dict[int, list[int]], tshape: AttentionShape, g: int) -> tuple[list, list, list]:
    """TE ``a2a+p2p``'s backward on the padded THD shape ``tshape``: the dO all-to-all in, the
    dQ/dK/dV all-to-all out (messages) and the ring's hops across rail peers."""
    L2 = tshape.seq_len / (len(groups) * g)                   # a rank's padded tokens
    pre = [(a, b, tshape.o_bytes(L2) / g) for m in groups.values() for a in m for b in m if a != b]
    post = [(a, b, (tshape.q_bytes(L2) + tshape.kv_bytes(L2)) / g) for m in groups.values() for a in m for b in m
            if a != b]
    return pre, post, _rail_hops(groups, g)


def te_thd_floor(topology: "Topology | str", cp_ranks: Sequence[int], doc_lengths: Sequence[int],
                 shape: AttentionShape, cp_comm_type: str, *, round_overhead_s: float = 0.0) -> float:
    """A floor on TE's forward + backward seconds on a packed batch (``cp_comm_type`` ``"p2p"``:
    :func:`simulate_te_p2p_thd`, ``"a2a+p2p"``: :func:`simulate_te_a2a_p2p_thd`), from its messages
    alone: each pass lasts at least its rounds back to back (the forward's ``total_s`` is at least
    its ``comm_s``; the backward's ring steps each wait for their round). No compute is priced, so it
    costs a few rounds' routing (the ring's rounds repeat one object), not the document work: what a
    search uses to leave TE's layout out where TE cannot be fast (Note [TE's layout as a candidate] in
    :mod:`megatron_fcp.planner.packed_choice`). Raises ValueError where TE cannot run it."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cp = len(ranks)
    tshape = _thd_shape(doc_lengths, cp, shape)
    if cp_comm_type == "p2p":
        hops, n = ([(ranks[i], ranks[(i + 1) % cp]) for i in range(cp)] if cp > 1 else []), cp
    elif cp_comm_type == "a2a+p2p":
        groups, g = _a2a_p2p_nodes(topo, ranks, tshape)
        hops, n = _rail_hops(groups, g), len(groups)
    else:
        raise ValueError(f"te_thd_floor: cp_comm_type 'p2p' or 'a2a+p2p', got {cp_comm_type!r}")
    kv = tshape.kv_bytes(tshape.seq_len / cp)          # a rank's padded shard (a2a+p2p: its node's, h/g heads)
    forward = [(a, b, kv) for a, b in hops]
    rounds = [forward] * (n - 1) + _ring_backward_rounds(hops, n, kv)
    return simulate_rounds(topo, rounds, round_overhead_s).comm_s


def _thd_meta(res: SimResult, doc_lengths, tshape: AttentionShape, work: np.ndarray) -> None:
    real = int(sum(doc_lengths))
    res.meta.update(padded_tokens=tshape.seq_len, padding_overhead=tshape.seq_len / real - 1.0,
                    work_max_over_mean=float(work.max() / work.mean()) if work.mean() > 0 else 1.0)


def _exposed(topo: Topology, rounds: list, work_s: float, round_overhead_s: float, name: str, meta: dict) -> SimResult:
    """Rounds back to back with ``work_s`` of compute after all rounds but the last (an exposed
    all-to-all / all-gather before the attention, one after it; ``rounds[-1]`` may be empty)."""
    pre, post = rounds[:-1], rounds[-1:]
    a = simulate_rounds(topo, [r for r in pre if r], round_overhead_s, name=name)
    b = simulate_rounds(topo, [r for r in post if r], round_overhead_s, name=name)
    res = SimResult(name, a.comm_s + b.comm_s, work_s, a.comm_s + work_s + b.comm_s, a.bytes + b.bytes,
                    a.rounds + b.rounds, {k: a.resource_bytes.get(k, 0.0) + b.resource_bytes.get(k, 0.0)
                                          for k in {**a.resource_bytes, **b.resource_bytes}},
                    {**a.resource_bandwidth, **b.resource_bandwidth}, a.timeline + b.timeline, meta)
    return res


def _window_inputs(topology, cp_ranks, shape: AttentionShape, causal: bool, window, compute_model):
    """What every TE schedule under a window starts from: the topology, the checked ranks, the
    compute model, the shape padded as Megatron pads (``2*cp``) and the mask."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    return topo, ranks, compute_model or ComputeModel(), pad_for_zigzag(shape, len(ranks))[0], Mask.of(causal, window)


def _window_work_s(cp: int, shape: AttentionShape, mask: Mask, cm: ComputeModel, ratio: float) -> tuple[float, float]:
    """``(the busiest zigzag rank's seconds, the whole sequence's seconds over cp)`` of windowed work."""
    if cm.kernel is not None:  # tiles: a rank's two chunks against the sequence; one fused call over cp's heads
        S, L = shape.seq_len, shape.seq_len // (2 * cp)
        per = max(sum(cm.work_s(L, c * L, S, 0, shape, mask, ratio, merged=False) for c in (j, 2 * cp - 1 - j))
                  for j in range(cp)) + 2 * cm.launch_s(ratio)
        a2a_shape = replace(shape, heads=max(shape.heads // cp, 1), kv_heads=max(shape.kv_heads // cp, 1))
        return per, cm.work_s(S, 0, S, 0, a2a_shape, mask, ratio, merged=False) + cm.launch_s(ratio)
    per_rank = rank_pairs(None, cp, shape.seq_len, mask)
    total = float(mask.pairs(0, shape.seq_len, 0, shape.seq_len)) if mask.windowed else float(per_rank.sum())
    flop = shape.pair_flops / cm.flops * ratio
    return float(per_rank.max()) * flop + cm.kernel_overhead_s, total / cp * flop + cm.kernel_overhead_s


def simulate_te_a2a(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    causal: bool = True,
    window=None,
    backward: bool = False,
    compute_model: ComputeModel | None = None,
    backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
    round_overhead_s: float = 0.0,
) -> SimResult:
    """Transformer Engine ``a2a`` (Ulysses over the CP group) under ``causal`` and ``window``,
    forward or ``backward``; see Note [Transformer Engine under a sliding window]. Raises ValueError
    unless ``heads`` and ``kv_heads`` divide by the CP size (TE's requirement)."""
    topo, ranks, cm, shape, mask = _window_inputs(topology, cp_ranks, shape, causal, window, compute_model)
    cp = len(ranks)
    if shape.heads % cp or shape.kv_heads % cp:
        raise ValueError(f"te-a2a: heads ({shape.heads}) and kv_heads ({shape.kv_heads}) must divide by the CP "
                         f"size {cp} (Transformer Engine's a2a splits heads over the CP group)")
    L2 = shape.seq_len / cp
    pairs = [(a, b) for a in ranks for b in ranks if a != b]
    qkv = [(a, b, (shape.q_bytes(L2) + shape.kv_bytes(L2)) / cp) for a, b in pairs]
    q = [(a, b, shape.q_bytes(L2) / cp) for a, b in pairs]
    _, work = _window_work_s(cp, shape, mask, cm, backward_flop_ratio if backward else 1.0)
    rounds = [q, qkv] if backward else [qkv, q]
    return _exposed(topo, rounds, work, round_overhead_s, "te-a2a",
                    {"graph": "a2a", "window": mask.window, "pass": "bwd" if backward else "fwd"})


def simulate_te_all_gather(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    causal: bool = True,
    window=None,
    backward: bool = False,
    compute_model: ComputeModel | None = None,
    backward_flop_ratio: float = BACKWARD_FLOP_RATIO,
    round_overhead_s: float = 0.0,
) -> SimResult:
    """Transformer Engine ``all_gather`` under ``causal`` and ``window``, forward or ``backward``
    (KV all-gathered, not overlapped; backward: the all-gather again and a reduce-scatter of dK/dV);
    see Note [Transformer Engine under a sliding window]."""
    topo, ranks, cm, shape, mask = _window_inputs(topology, cp_ranks, shape, causal, window, compute_model)
    cp = len(ranks)
    shard = shape.kv_bytes(shape.seq_len / cp)
    gather = [(a, b, shard) for a in ranks for b in ranks if a != b]
    work, _ = _window_work_s(cp, shape, mask, cm, backward_flop_ratio if backward else 1.0)
    rounds = [gather, gather] if backward else [gather, []]  # backward: gather, work, reduce-scatter
    return _exposed(topo, rounds, work, round_overhead_s, "te-all-gather",
                    {"graph": "all_gather", "window": mask.window, "pass": "bwd" if backward else "fwd"})


def simulate_halo_ring(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    causal: bool = True,
    window=None,
    backward: bool = False,
    compute_model: ComputeModel | None = None,
    round_overhead_s: float = 0.0,
) -> SimResult:
    """The halo ring (PR #5597's ``swa_p2p`` idea: :func:`~megatron_fcp.contract.plan.halo_plan`,
    whole chunks) under ``causal`` and ``window``, forward or ``backward``; see Note [Transformer
    Engine under a sliding window]."""
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    shape, _ = pad_for_zigzag(shape, len(ranks))
    plan = halo_plan(ranks, causal, 1, window=window, seq_len=shape.seq_len)
    kw = dict(compute_model=compute_model, round_overhead_s=round_overhead_s, name="halo-ring")
    res = simulate_plan_backward(plan, topo, shape, **kw) if backward else simulate_plan(plan, topo, shape, **kw)
    res.meta.update(graph="halo", window=plan.window, transfers=plan.num_transfers())
    return res
