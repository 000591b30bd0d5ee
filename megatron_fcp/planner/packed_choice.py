"""A packed batch's plan choice: the head-parallel degree and the layout. Pure, no torch.

Note [TE's layout as a candidate]
---------------------------------
FCP's placements (the ``fcp`` layout, :func:`~megatron_fcp.planner.placing.place_batch`) keep
short documents whole and cut long ones into blocks, so a packed step moves only what the mask
needs. Where the step is compute-bound, that gains nothing. Transformer Engine's per-document zigzag
(the ``thd`` layout, :func:`~megatron_fcp.contract.placement.thd_placement`) then does at least as
well: every rank holds the same causal work of every document, and a ring step costs one kernel
call. FCP's placements balance the work to about 1.001 and launch per block. Measured on the
packed grid (docs/planner.md, eighth pass), the plugin's choice sat at 0.990x TE's ``p2p`` in
both cp = 16 cells with median 32K. At cp = 256 (64:8, median 32K) it sat at 0.885x TE's
``a2a+p2p``: there FCP's one-round KV stage waits for its busiest member's bytes, which TE's ring
spreads over its steps.

FCP runs TE's layout on its own engine, its backward over TE's ring
(:func:`~megatron_fcp.planner.placing.layout_graphs`):

* the backward streams as chains, which is TE's ring backward (Note [Streaming chain backward] in
  :mod:`megatron_fcp.schedule.chains`), with the first sub-round kept and each rank's own blocks
  in one call;
* the forward (at degree 1, or a head-parallel stage's KV plan) moves each block to its readers
  over the configured graph (``auto``: the candidates' best forward), plus the ring's first-round
  relays that the backward keeps (Note [A backward on another graph] in
  :mod:`megatron_fcp.contract.plan`), where that forward is predicted no slower than the ring's;
  else the ring's, one call per owner and round, which is TE's step.

At degree 1 that is TE's ``p2p`` backward. At degree ``g``, the ranks per node, with one head group
per node, it is TE's ``a2a+p2p``. Priced as run (:class:`~megatron_fcp.cost.head_parallel_packed.PackedAsRun`),
it comes out at TE's price, or below it where the ring stops at a block's last reader. In the
three cells above it equals TE's price to the microsecond (2026-12-07). In the two cp = 16 cells
the ring's forward moved its KV in 10x the placement's need-set bound, hidden behind compute; the
forward on ``hierarchical`` moves it in 1.19x, at the same total (thirteenth pass, 2026-12-07).

**When it is tried.** :func:`choose_packed_plan` first makes FCP's degree choice
(:func:`~megatron_fcp.planner.head_parallel.choose_packed_head_parallel`). Then, for each TE
schedule the group can run, at its degree (:func:`te_degrees`), it goes through three gates, each
cheaper than the next:

1. TE's ring floor (:func:`~megatron_fcp.cost.te.te_thd_floor`: the ring's rounds, no compute;
   a few ms at cp = 256) at or above FCP's best: skip.
2. TE's priced forward + backward at or above it: skip.
3. Otherwise, FCP's plan of TE's layout at that degree is built and priced as run. It replaces the
   choice only if strictly faster; a tie keeps FCP's own layout.

So the layout is a safety net, not a search dimension. A ``thd`` plan that would beat FCP's plans
where TE itself does not is never tried. That is deliberate: elsewhere, cutting every document into
``2n`` chunks costs a plan of ``D * 2n`` blocks (cp = 256, 316 documents: 160K blocks, each relayed
around the ring), and FCP's own layout moves less. ``layout="fcp"`` turns the net off;
``layout="thd"`` prices TE's layout at every candidate degree and takes the fastest.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from megatron_fcp.contract.blocks import gc_paused
from megatron_fcp.contract.head_parallel import head_parallel_degrees
from megatron_fcp.contract.placement import DEFAULT_BLOCK_TOKENS
from megatron_fcp.contract.plan import check_cp_ranks
from megatron_fcp.cost.head_parallel_packed import PackedAsRun
from megatron_fcp.cost.model import AttentionShape, ComputeModel
from megatron_fcp.cost.te import (simulate_te_a2a_p2p_thd, simulate_te_p2p_thd, te_a2a_p2p_ranks_per_node,
                                  te_thd_floor)
from megatron_fcp.planner.head_parallel import choose_packed_head_parallel, packed_degree_plan
from megatron_fcp.planner.placing import LAYOUT_CHOICES, PACKED_BALANCE
from megatron_fcp.schedule.waves import RING_BUDGET
from megatron_fcp.topology import Topology, load_topology

__all__ = ["PackedChoice", "LAYOUT_CHOICES", "te_degrees", "choose_packed_plan"]


class PackedChoice(NamedTuple):
    """What a packed batch runs: its head-parallel degree and its layout (``fcp`` or ``thd``)."""

    degree: int
    layout: str = "fcp"


_TE = {"p2p": simulate_te_p2p_thd, "a2a+p2p": simulate_te_a2a_p2p_thd}


def te_degrees(topology: "Topology | str", cp_ranks: Sequence[int], shape: AttentionShape,
               degrees: Sequence[int]) -> dict[int, str]:
    """``{degree: TE's cp_comm_type}`` for the TE schedules the group runs, as FCP degrees among
    ``degrees``: ``p2p`` is degree 1; ``a2a+p2p`` is its all-to-all degree, the ranks per node
    (:func:`~megatron_fcp.cost.te.te_a2a_p2p_ranks_per_node`, TE's own rule), where that is above 1."""
    out = {1: "p2p"} if 1 in degrees else {}
    try:
        g = te_a2a_p2p_ranks_per_node(topology, cp_ranks, shape)
    except ValueError:                    # TE does not run a2a+p2p here
        return out
    if g > 1 and g in degrees:
        out[g] = "a2a+p2p"
    return out


@gc_paused()
def choose_packed_plan(
    topology: "Topology | str",
    cp_ranks: Sequence[int],
    doc_lengths: Sequence[int],
    shape: AttentionShape,
    *,
    layout: str = "auto",
    degrees: Sequence[int] | None = None,
    graph: str = "hierarchical",
    causal: bool = True,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    compute_model: ComputeModel | None = None,
    plans: dict | None = None,
    placement_balance: str = PACKED_BALANCE,
    backward_kv: str = "auto",
    kv_memory_budget: int = RING_BUDGET,
    prune: bool = True,
    buffered_sends: bool = False,
    held_routes: bool = False,
) -> tuple[PackedChoice, dict[PackedChoice, float]]:
    """The :class:`PackedChoice` of least predicted forward + backward time on one packed batch, and
    the seconds of every choice priced (Note [TE's layout as a candidate]). ``layout``: ``auto``
    (FCP's degree choice, :func:`~megatron_fcp.planner.head_parallel.choose_packed_head_parallel`,
    with TE's layout as a safety net), ``fcp`` (the degree choice alone) or ``thd`` (TE's layout at
    every candidate degree). ``plans``: filled with each priced choice's compiled plan, keyed by
    :class:`PackedChoice`. The other arguments are the degree choice's, and apply to every choice."""
    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"packed layout {layout!r}: must be one of {', '.join(LAYOUT_CHOICES)}")
    topo = load_topology(topology)
    ranks = check_cp_ranks(topo, cp_ranks)
    cands = list(degrees) if degrees is not None else head_parallel_degrees(topo, ranks, shape.heads, shape.kv_heads)
    if not cands:
        raise ValueError("choose_packed_plan: no candidate degree")
    common = dict(graph=graph, causal=causal, block_tokens=block_tokens, placement_balance=placement_balance)
    as_run = dict(compute_model=compute_model, backward_kv=backward_kv, kv_memory_budget=kv_memory_budget,
                  buffered_sends=buffered_sends, held_routes=held_routes)
    times: dict[PackedChoice, float] = {}

    def price_thd(a: int) -> float:
        plan = packed_degree_plan(topo, ranks, doc_lengths, shape, a, layout="thd", **common)
        if plans is not None:
            plans[PackedChoice(a, "thd")] = plan
        t = times[PackedChoice(a, "thd")] = PackedAsRun(plan, topo, shape, **as_run).result()["total_s"]
        return t

    if layout == "thd":
        for a in sorted(set(cands)):
            price_thd(a)
        best = min(times, key=lambda c: (times[c], c.degree))
        return best, times
    fcp_plans: dict | None = {} if plans is not None else None
    degree, fcp_times = choose_packed_head_parallel(topo, ranks, doc_lengths, shape, degrees=cands, plans=fcp_plans,
                                                    prune=prune, **common, **as_run)
    times.update({PackedChoice(a, "fcp"): t for a, t in fcp_times.items()})
    if plans is not None:
        plans.update({PackedChoice(a, "fcp"): p for a, p in fcp_plans.items()})
    best = PackedChoice(degree, "fcp")
    if layout == "fcp":
        return best, dict(sorted(times.items()))
    for a, kind in sorted(te_degrees(topo, ranks, shape, cands).items()):
        bar = times[best]
        if te_thd_floor(topo, ranks, doc_lengths, shape, kind) >= bar:
            continue                      # gate 1: TE's ring alone takes longer than FCP's plan
        te = sum(_TE[kind](topo, ranks, doc_lengths, shape, causal=causal, backward=b,
                           compute_model=compute_model).total_s for b in (False, True))
        if te >= bar:
            continue                      # gate 2: TE's schedule is not faster
        if price_thd(a) < bar:            # gate 3: FCP's run of TE's layout; a tie keeps FCP's own
            best = PackedChoice(a, "thd")
    return best, dict(sorted(times.items()))
