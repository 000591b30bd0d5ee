"""Where a packed batch's tokens go on a real CP group: a placement told the group's nodes.

One rule, used by the runtime, the degree choice, the cost comparisons, the emulator and the CLI:
a packed batch is placed *node-aware* over the topology's NVLink domains (Note [Node-aware
placement] in :mod:`megatron_fcp.contract.placement`), so a document that fits in one node stays
on it and its keys move over NVLink, not through a NIC. With a head-parallel stage the documents
are placed over the head groups, each group standing where its members are. The placement
balances the layer (:data:`PACKED_BALANCE`), not only its attention. Pure, no ``torch``.
"""

from __future__ import annotations

from typing import Sequence

from megatron_fcp.contract.blocks import gc_paused
from megatron_fcp.contract.head_parallel_packed import place_packed_groups
from megatron_fcp.contract.layer_placement import place_balanced
from megatron_fcp.contract.placement import Placement
from megatron_fcp.topology import Topology, load_topology

__all__ = ["place_batch", "place_batch_groups", "cp_nodes", "PACKED_BALANCE"]

PACKED_BALANCE = "layer"
"""What a packed batch's placement balances unless told (``--fcp-packed-balance``): the layer's
attention pairs *and* tokens (Note [Layer-balanced placement]), since the projections and MLP run on
the placement's tokens too (Note [Layer work]); ``"attention"``: pairs alone."""


def cp_nodes(topology: "Topology | str", cp_ranks: Sequence[int]) -> tuple[int, ...]:
    """NVLink domain of each CP rank, in CP order (the ``nodes`` of the placements)."""
    return tuple(int(d) for d in load_topology(topology).domains_of(list(cp_ranks)))


@gc_paused()
def place_batch(topology: "Topology | str", cp_ranks: Sequence[int], doc_lengths: Sequence[int], *,
                balance: str = PACKED_BALANCE, **place_kw) -> Placement:
    """The placement FCP runs packed batch ``doc_lengths`` with on CP group ``cp_ranks`` (global
    ranks, CP order): :func:`~megatron_fcp.contract.layer_placement.place_balanced` over the
    group's nodes, balancing ``balance`` (:data:`PACKED_BALANCE` unless told);
    ``place_kw`` go to it."""
    ranks = tuple(cp_ranks)
    return place_balanced(doc_lengths, len(ranks), nodes=cp_nodes(topology, ranks), balance=balance, **place_kw)


@gc_paused()
def place_batch_groups(topology: "Topology | str", cp_ranks: Sequence[int], head_groups: Sequence[Sequence[int]],
                       doc_lengths: Sequence[int], *, balance: str = PACKED_BALANCE,
                       **place_kw) -> tuple[Placement, Placement]:
    """``(group placement, member placement)`` of a packed batch under a head-parallel stage
    (:func:`~megatron_fcp.contract.head_parallel_packed.place_packed_groups`): the head groups are
    the placement's virtual ranks, each on the node of its members (None where a group spans
    nodes: the group placement is then flat)."""
    topo = load_topology(topology)
    domains = [set(cp_nodes(topo, g)) for g in head_groups]
    nodes = None if any(len(d) != 1 for d in domains) else tuple(d.pop() for d in domains)
    return place_packed_groups(doc_lengths, tuple(cp_ranks), head_groups, nodes=nodes, balance=balance, **place_kw)
