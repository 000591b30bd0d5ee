"""Choosing the head-parallel degree, the KV-stage graph and the block size on the cost model.
Pure, no torch.

:func:`choose_head_parallel` is what the runtime calls (topology, CP ranks, an AttentionShape,
causal); :func:`build_head_parallel_plan` is the general entry point (``degree`` and ``graph``
fixed or ``"auto"``).

Note [Choosing the head-parallel degree]
----------------------------------------
Candidates: every degree ``a`` whose head groups fit inside nodes and whose head counts split
(:func:`~megatron_fcp.planning.head_parallel_compile.head_parallel_degrees`; ``a = 1`` is plain FCP),
times every graph of :data:`~megatron_fcp.planning.builders.AUTO_CANDIDATES` for the KV stage (one
candidate when ``a`` is the whole group: nothing left to distribute). Each is timed forward and
backward (:func:`~megatron_fcp.planning.head_parallel_cost.simulate_head_parallel`) and the best by
``objective`` is kept (:func:`~megatron_fcp.planning.cost.pick_best`: least total, ties within 0.1%
broken by communication). Then, for ``a = 1``, sub-blocks of 2, 4 and 8 parts per chunk (no smaller
than ``min_block_tokens``; a part count that does not divide the chunk cuts it into parts of
floor/ceil size, Note [Sub-block sizes] in :mod:`megatron_fcp.planning.blocks`, so sequence lengths
that are only a multiple of ``2 * cp`` are not held to whole chunks) are tried on the winning
graph; for ``a > 1`` (placements move whole chunks) the best graph of each degree is tried with its
chunks staggered over 2, 4 and 8 rounds (``stagger``), which pipelines them through relays as
sub-blocks do. The search contains Transformer Engine's schedules: ``a = 1`` with ``ring`` is
``p2p``, ``a`` = ranks per node with ``ring`` is ``a2a+p2p`` (the same prediction, tested),
``a = cp`` is ``a2a``; so the choice is never predicted slower than them beyond the difference of
their own models (the ring over groups prunes relays past the last reader; TE's ring sends every
block all the way round).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from megatron_fcp.planning.builders import AUTO_CANDIDATES
from megatron_fcp.planning.cost import AttentionShape, ComputeModel, SimResult, pad_for_zigzag, pick_best
from megatron_fcp.planning.graph import check_cp_ranks
from megatron_fcp.planning.head_parallel import HeadParallelPlan
from megatron_fcp.planning.head_parallel_compile import compile_head_parallel, head_parallel_degrees
from megatron_fcp.planning.head_parallel_cost import check_pass, simulate_head_parallel
from megatron_fcp.topology import Topology, load_topology

__all__ = ["build_head_parallel_plan", "choose_head_parallel", "head_parallel_candidates"]


def _label(hp: HeadParallelPlan, graph: str, parts: int, stagger: int = 1) -> str:
    return f"a={hp.degree} graph={graph} parts={parts}" + (f" stagger={stagger}" if stagger > 1 else "")


def head_parallel_candidates(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    degree: "int | str" = "auto",
    graph: str = "auto",
    parts_per_chunk: "int | str" = "auto",
    causal: bool = True,
    compute_model: ComputeModel | None = None,
    objective: str = "total",
    pass_: str = "fwd+bwd",
    round_overhead_s: float = 0.0,
    min_block_tokens: int = 256,
    grad_dtype_bytes: int | None = None,
) -> list[tuple[SimResult, HeadParallelPlan]]:
    """Every candidate of Note [Choosing the head-parallel degree] as ``(SimResult, plan)``, the
    sub-block candidates of the best ``a = 1`` plan last. ``grad_dtype_bytes``: the dK/dV partials'
    bytes per element (default ``shape.dtype_bytes``: the executor sends them in the input dtype)."""
    check_pass(pass_)
    if objective not in ("comm", "total"):
        raise ValueError(f"objective: must be 'comm' or 'total', got {objective!r}")
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cp = len(ranks)
    padded, _ = pad_for_zigzag(shape, cp)
    valid = head_parallel_degrees(topo, ranks, shape.heads, shape.kv_heads)
    if degree == "auto":  # sub-blocks asked for: only a = 1 cuts chunks (placements move whole chunks)
        degrees = [1] if isinstance(parts_per_chunk, int) and parts_per_chunk > 1 else valid
    else:
        if not isinstance(degree, int) or degree not in valid:
            raise ValueError(f"head_parallel: degree {degree!r} does not fit this CP group and head counts; "
                             f"use auto or one of {valid}")
        degrees = [degree]
    graphs = list(AUTO_CANDIDATES) if graph == "auto" else [graph]
    fixed_parts = parts_per_chunk if parts_per_chunk != "auto" else 1
    if not isinstance(fixed_parts, int) or fixed_parts < 1:
        raise ValueError(f"parts_per_chunk: must be an integer >= 1 or auto, got {parts_per_chunk!r}")
    kw = dict(pass_=pass_, causal=causal, compute_model=compute_model, round_overhead_s=round_overhead_s,
              grad_dtype_bytes=grad_dtype_bytes)
    out: list[tuple[SimResult, HeadParallelPlan]] = []
    for a in degrees:
        whole = a == cp or len(ranks) // a == 1
        for g in (graphs[:1] if whole else graphs):
            if cp == 1 and g != "ring":
                continue
            parts = fixed_parts if a == 1 else 1
            hp = compile_head_parallel(topo, ranks, padded, a, g, causal=causal, parts_per_chunk=parts)
            res = simulate_head_parallel(hp, topo, padded, **kw)
            res.meta["label"] = _label(hp, res.meta["graph"], parts)
            out.append((res, hp))
    if parts_per_chunk == "auto":  # a > 1: the best graph of each degree with its chunks staggered
        for a in degrees:
            mine = [c for c in out if c[1].degree == a and c[1].kv_plan is not None]
            if a == 1 or not mine:
                continue
            best_res, _ = pick_best(mine, objective)
            for st in (2, 4, 8):
                if st > 2 * a:
                    continue
                hp = compile_head_parallel(topo, ranks, padded, a, best_res.meta["graph"], causal=causal, stagger=st)
                res = simulate_head_parallel(hp, topo, padded, **kw)
                res.meta["label"] = _label(hp, res.meta["graph"], 1, st)
                out.append((res, hp))
    ones = [c for c in out if c[1].degree == 1]
    if parts_per_chunk == "auto" and ones:
        best_res, best = pick_best(ones, objective)
        chunk = padded.seq_len // (2 * cp)
        for p in (2, 4, 8):  # p need not divide the chunk: parts of floor/ceil size (Note [Sub-block sizes])
            if chunk // p < min_block_tokens:
                continue
            hp = compile_head_parallel(topo, ranks, padded, 1, best_res.meta["graph"], causal=causal,
                                       parts_per_chunk=p)
            res = simulate_head_parallel(hp, topo, padded, **kw)
            res.meta["label"] = _label(hp, res.meta["graph"], p)
            out.append((res, hp))
    return out


def build_head_parallel_plan(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    shape: AttentionShape,
    *,
    degree: "int | str" = "auto",
    graph: str = "auto",
    parts_per_chunk: "int | str" = "auto",
    causal: bool = True,
    compute_model: ComputeModel | None = None,
    objective: str = "total",
    pass_: str = "fwd+bwd",
    round_overhead_s: float = 0.0,
    min_block_tokens: int = 256,
    grad_dtype_bytes: int | None = None,
) -> HeadParallelPlan:
    """A verified :class:`HeadParallelPlan` for the CP group ``cp_ranks`` on ``topology``.

    ``degree``: an int (must fit: :func:`head_parallel_degrees`) or ``"auto"``; ``graph``: the KV
    stage's builder name or ``"auto"``; ``parts_per_chunk``: sub-blocks for ``a = 1`` or ``"auto"``.
    With everything fixed the plan is compiled directly; otherwise every candidate is timed for
    ``pass_`` and the best by ``objective`` is returned, with ``auto`` recording each candidate's
    predicted seconds (Note [Choosing the head-parallel degree]). ``shape.seq_len`` is padded to a
    multiple of ``2 * cp`` as Megatron pads."""
    if degree != "auto" and graph != "auto" and parts_per_chunk != "auto":
        topo = load_topology(topology)
        padded, _ = pad_for_zigzag(shape, len(check_cp_ranks(topo, cp_ranks)))
        return compile_head_parallel(topo, cp_ranks, padded, degree, graph, causal=causal,
                                     parts_per_chunk=parts_per_chunk)
    cands = head_parallel_candidates(topology, cp_ranks, shape, degree=degree, graph=graph,
                                     parts_per_chunk=parts_per_chunk, causal=causal, compute_model=compute_model,
                                     objective=objective, pass_=pass_, round_overhead_s=round_overhead_s,
                                     min_block_tokens=min_block_tokens, grad_dtype_bytes=grad_dtype_bytes)
    _, best = pick_best(cands, objective)
    metric = "total_s" if objective == "total" else "comm_s"
    return _with_auto(best, tuple((r.meta["label"], getattr(r, metric)) for r, _ in cands))


def choose_head_parallel(topology: "Topology | str", cp_ranks: Sequence[int], shape: AttentionShape,
                         causal: bool = True, grad_dtype_bytes: int | None = None) -> HeadParallelPlan:
    """The runtime's entry point: degree, graph and block size chosen by predicted forward+backward
    time at the default compute model (Note [Choosing the head-parallel degree]). ``grad_dtype_bytes``:
    the dK/dV partials' bytes per element (default ``shape.dtype_bytes``: the executor returns them
    in the input dtype, as TE's ring returns dKV)."""
    return build_head_parallel_plan(topology, cp_ranks, shape, causal=causal, grad_dtype_bytes=grad_dtype_bytes)


def _with_auto(hp: HeadParallelPlan, auto: tuple) -> HeadParallelPlan:
    return replace(hp, auto=auto)
