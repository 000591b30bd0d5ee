"""Rounds against the edge-colouring bound Delta, and packing one-hop transfers into exactly Delta
rounds. Pure, no torch.

Note [Optimal rounds]
---------------------
With one send and one receive per rank per round (the FCP paper's congestion-free rounds), a plan
needs at least ``Delta`` rounds: the most blocks any rank sends, or receives (:func:`plan_delta`).
When every transfer leaves its block's owner (one-hop trees: the ``full`` graph, and
``hierarchical`` on one node), the transfers form a bipartite multigraph senders x receivers of
maximum degree Delta, and König's theorem gives a proper edge colouring with exactly Delta colours:
:func:`bipartite_edge_colouring` builds it edge by edge (a colour free at both ends, else flip the
two-coloured alternating path from the receiver, which in a bipartite graph never returns to the
sender), so the plan reaches Delta rounds. Multicast relays add depth (a relay forwards a block
only a round after it arrived), so multi-hop plans (``ring``, ``leader``, ``spanning``,
``hierarchical`` across nodes) are list-scheduled and can exceed Delta; :func:`plan_delta` lets
every report set the two side by side.
"""

from __future__ import annotations

from typing import Sequence

from megatron_fcp.contract.blocks import Transfer

__all__ = ["plan_delta", "bipartite_edge_colouring", "colour_rounds"]


def plan_delta(plan) -> int:
    """Delta: the most transfers any rank of ``plan`` sends or receives over the whole plan."""
    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    for rnd in plan.rounds:
        for t in rnd:
            sends[t.src] = sends.get(t.src, 0) + 1
            recvs[t.dst] = recvs.get(t.dst, 0) + 1
    return max([0, *sends.values(), *recvs.values()])


def bipartite_edge_colouring(edges: Sequence[tuple[int, int]]) -> list[int]:
    """A proper colouring of the bipartite multigraph ``edges`` (sender ``u`` -> receiver ``v``; a
    rank may appear on both sides, as two vertices) with Delta colours; see Note [Optimal rounds]."""
    at_u: dict[tuple[int, int], int] = {}  # (sender, colour) -> edge
    at_v: dict[tuple[int, int], int] = {}  # (receiver, colour) -> edge
    colour = [-1] * len(edges)

    def free(side: dict, x: int) -> int:
        c = 0
        while (x, c) in side:
            c += 1
        return c

    for e, (u, v) in enumerate(edges):
        a, b = free(at_u, u), free(at_v, v)
        if (v, a) in at_v:  # a is taken at v: flip the a/b path that starts at v with colour a
            path, x, on_v, c = [], v, True, a
            while True:
                f = (at_v if on_v else at_u).get((x, c))
                if f is None:
                    break
                path.append(f)
                x = edges[f][0] if on_v else edges[f][1]
                on_v, c = not on_v, (b if c == a else a)
            for f in path:
                del at_u[(edges[f][0], colour[f])], at_v[(edges[f][1], colour[f])]
            for f in path:
                colour[f] = b if colour[f] == a else a
                at_u[(edges[f][0], colour[f])] = f
                at_v[(edges[f][1], colour[f])] = f
        colour[e] = a
        at_u[(u, a)] = e
        at_v[(v, a)] = e
    return colour


def colour_rounds(transfers: Sequence[Transfer]) -> tuple[tuple[Transfer, ...], ...]:
    """One-hop ``transfers`` packed into Delta rounds of one send and one receive per rank (in input
    order within a round)."""
    colours = bipartite_edge_colouring([(t.src, t.dst) for t in transfers])
    n = max(colours, default=-1) + 1
    rounds: list[list[Transfer]] = [[] for _ in range(n)]
    for t, c in zip(transfers, colours):
        rounds[c].append(t)
    return tuple(tuple(r) for r in rounds)
