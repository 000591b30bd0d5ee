"""Where a packed batch's tokens go on a real CP group: a placement told the group's nodes.

One rule, used by the runtime, the degree choice, the cost comparisons, the emulator and the CLI:
a packed batch is placed *node-aware* over the topology's NVLink domains (Note [Node-aware
placement] in :mod:`megatron_fcp.contract.placement`), so a document that fits in one node stays
on it and its keys move over NVLink, not through a NIC. With a head-parallel stage the documents
are placed over the head groups, each group standing where its members are. The placement
balances the layer (:data:`PACKED_BALANCE`), not only its attention. Pure, no ``torch``.

That is the ``"fcp"`` layout. The ``"thd"`` layout is Transformer Engine's: every document cut into
``2n`` chunks, rank ``i`` holding chunks ``i`` and ``2n-1-i``
(:func:`~megatron_fcp.contract.placement.thd_placement`), its backward run on TE's ring (:func:`layout_graphs`).
FCP runs it only where TE's own schedule would beat FCP's plans (Note [TE's layout as a
candidate] in :mod:`megatron_fcp.planner.packed_choice`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

from megatron_fcp.contract.blocks import gc_paused
from megatron_fcp.contract.head_parallel_packed import place_packed_groups, split_group_placement
from megatron_fcp.contract.layer_placement import place_balanced
from megatron_fcp.contract.placement import PACKED_LAYOUTS, Placement, thd_placement
from megatron_fcp.topology import Topology, load_topology

__all__ = ["place_batch", "place_batch_groups", "cp_nodes", "layout_graphs", "LayoutGraphs", "check_layout", "PACKED_BALANCE",
           "PACKED_LAYOUTS", "LAYOUT_CHOICES", "THD_GRAPH"]

PACKED_BALANCE = "layer"
"""What a packed batch's placement balances unless told (``--fcp-packed-balance``): the layer's
attention pairs *and* tokens (Note [Layer-balanced placement]), since the projections and MLP run on
the placement's tokens too (Note [Layer work]); ``"attention"``: pairs alone."""


LAYOUT_CHOICES = ("auto",) + PACKED_LAYOUTS
"""``--fcp-packed-layout``: ``auto`` (FCP's layout, TE's where TE's schedule is faster: Note [TE's
layout as a candidate] in :mod:`megatron_fcp.planner.packed_choice`), ``fcp`` or ``thd``."""

THD_GRAPH = "ring"
"""The graph the ``thd`` layout's backward walks: TE's ring, whose backward streams as chains as
TE's does (Note [Streaming chain backward] in :mod:`megatron_fcp.schedule.chains`). Over that
layout a need-driven graph's backward packs more waves: ``hierarchical``'s took 464.7 ms in 18
waves against the ring's 460.9 ms in 16 steps at cp = 16 (1M tokens, median 32K, 64:8; 2026-12-07).
The forward does not need the ring: it moved the same KV in 80.7 ms on it, in 9.6 ms on
``hierarchical`` (Note [A backward on another graph] in :mod:`megatron_fcp.contract.plan`)."""


class LayoutGraphs(NamedTuple):
    """The graphs a packed batch's causal KV plan is built on: ``forward`` (a builder name or
    ``auto``) and ``backward``, the graph its backward walks (None: the forward's)."""

    forward: str
    backward: str | None = None


def layout_graphs(layout: str, graph: str) -> LayoutGraphs:
    """The graphs of a packed batch's causal KV plan (or a head-parallel stage's) under ``layout``,
    ``graph`` the configured one. ``fcp``: ``graph`` both ways. ``thd``: the forward on ``graph``,
    the backward on :data:`THD_GRAPH` (:func:`~megatron_fcp.planner.build.build_plan`'s
    ``backward_graph``)."""
    check_layout(layout)
    return LayoutGraphs(graph) if layout == "fcp" else LayoutGraphs(graph, THD_GRAPH)


def check_layout(layout: str) -> None:
    """ValueError naming the choices unless ``layout`` is one of :data:`PACKED_LAYOUTS`."""
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"packed layout {layout!r}: must be one of {', '.join(PACKED_LAYOUTS)}")


def cp_nodes(topology: "Topology | str", cp_ranks: Sequence[int]) -> tuple[int, ...]:
    """NVLink domain of each CP rank, in CP order (the ``nodes`` of the placements)."""
    return tuple(int(d) for d in load_topology(topology).domains_of(list(cp_ranks)))


@gc_paused()
def place_batch(topology: "Topology | str", cp_ranks: Sequence[int], doc_lengths: Sequence[int], *,
                balance: str = PACKED_BALANCE, layout: str = "fcp", **place_kw) -> Placement:
    """The placement FCP runs packed batch ``doc_lengths`` with on CP group ``cp_ranks`` (global
    ranks, CP order): under the ``fcp`` layout
    :func:`~megatron_fcp.contract.layer_placement.place_balanced` over the group's nodes, balancing
    ``balance`` (:data:`PACKED_BALANCE` unless told), ``place_kw`` going to it; under ``thd`` TE's
    per-document zigzag over the group (:func:`_thd`: ``causal`` and ``window`` read from
    ``place_kw``; TE's chunks, not ``block_tokens``, set the blocks)."""
    ranks = tuple(cp_ranks)
    check_layout(layout)
    if layout == "thd":
        return _thd(doc_lengths, len(ranks), None, place_kw)
    return place_balanced(doc_lengths, len(ranks), nodes=cp_nodes(topology, ranks), balance=balance, **place_kw)


@gc_paused()
def place_batch_groups(topology: "Topology | str", cp_ranks: Sequence[int], head_groups: Sequence[Sequence[int]],
                       doc_lengths: Sequence[int], *, balance: str = PACKED_BALANCE, layout: str = "fcp",
                       **place_kw) -> tuple[Placement, Placement]:
    """``(group placement, member placement)`` of a packed batch under a head-parallel stage
    (:func:`~megatron_fcp.contract.head_parallel_packed.place_packed_groups`): the head groups are
    the placement's virtual ranks, each on the node of its members (None where a group spans
    nodes: the group placement is then flat). Under the ``thd`` layout the group placement is TE's
    per-document zigzag over the groups, documents padded to a multiple of twice the CP size as TE's
    ``a2a+p2p`` pads them (with one group per node it is that schedule's layout)."""
    check_layout(layout)
    if layout == "thd":
        group = _thd(doc_lengths, len(head_groups), len(tuple(cp_ranks)), place_kw)
        return group, split_group_placement(group, tuple(cp_ranks), head_groups)
    topo = load_topology(topology)
    domains = [set(cp_nodes(topo, g)) for g in head_groups]
    nodes = None if any(len(d) != 1 for d in domains) else tuple(d.pop() for d in domains)
    return place_packed_groups(doc_lengths, tuple(cp_ranks), head_groups, nodes=nodes, balance=balance, **place_kw)


def _thd(doc_lengths: Sequence[int], n: int, pad_ranks: int | None, place_kw: dict) -> Placement:
    """TE's layout over ``n`` ranks or groups with the mask ``place_kw`` asks for (``causal``,
    ``window``): a window is kept on the placement, not dropped."""
    placement = thd_placement(doc_lengths, n, pad_ranks=pad_ranks, causal=place_kw.get("causal", True))
    window = place_kw.get("window")
    return placement if window is None else dataclasses.replace(placement, window=tuple(window))
