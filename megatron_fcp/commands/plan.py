"""``megatron-fcp plan``: build and verify an FCP plan; print the topology, the graph and the rounds.

Examples::

    megatron-fcp plan dgx-h100:2 --graph hierarchical --cp 16
    megatron-fcp plan dgx-h100:2 --megatron-layout world=16,tp=2,pp=1,cp=8
    megatron-fcp plan my_cluster.yaml --ranks 0,2,4,6 --parts 2
"""

from __future__ import annotations

import argparse
import sys

from megatron_fcp.planning import GRAPH_CHOICES, MegatronLayout, PlanError, build_graph, build_plan
from megatron_fcp.topology import TopologyError, load_topology

NAME = "plan"
HELP = "build and verify an FCP plan for a topology and CP group; print topology, graph and round table"


def add_topology_arguments(p: argparse.ArgumentParser) -> None:
    """Topology and CP-group arguments shared by ``plan`` and ``simulate``."""
    p.add_argument("topology", nargs="?", metavar="PRESET:NODES|FILE.yaml",
                   help="a preset (dgx-a100, dgx-h100, pcie-box, single-uplink) with a node count, e.g. "
                        "dgx-h100:2, or a topology YAML file")
    p.add_argument("--topology", dest="topology_opt", metavar="PRESET:NODES|FILE.yaml",
                   help="same as the positional argument")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--cp", type=int, metavar="N", help="CP group = global ranks 0..N-1 (default: all ranks)")
    g.add_argument("--ranks", metavar="R0,R1,...", help="CP group as explicit global ranks in CP order")
    p.add_argument("--graph", default="auto", choices=GRAPH_CHOICES,
                   help="communication graph (default auto: the best of the others on the cost model)")
    p.add_argument("--no-causal", dest="causal", action="store_false",
                   help="no causal mask: every rank needs every block")


def resolve_topology(args):
    spec = args.topology_opt or args.topology
    if not spec:
        raise ValueError("topology: give PRESET:NODES (e.g. dgx-h100:2) or a YAML path")
    return load_topology(spec)


def resolve_ranks(args, topo) -> list[int]:
    if args.ranks:
        try:
            ranks = [int(x) for x in args.ranks.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(f"--ranks: expected comma-separated integers, got {args.ranks!r}") from None
        return ranks
    cp = args.cp if args.cp is not None else topo.world
    if cp < 1 or cp > topo.world:
        raise ValueError(f"--cp: must be between 1 and the topology's {topo.world} ranks, got {cp}")
    return list(range(cp))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_topology_arguments(p)
    p.add_argument("--parts", type=int, default=1, metavar="P", help="sub-blocks per zigzag chunk (default 1)")
    p.add_argument("--megatron-layout", metavar="world=W,tp=T,pp=P,cp=C",
                   help="plan every CP group of a Megatron layout (order tp-cp-ep-dp-pp) and print its rank map")
    p.add_argument("--max-transfers", type=int, default=24, metavar="K",
                   help="transfers shown per round in the table (default 24; 0 = all)")
    p.add_argument("--backward", action="store_true", help="also print the backward (dK/dV reduction) rounds")


def _round_lines(rounds, limit: int) -> list[str]:
    lines = []
    for k, rnd in enumerate(rounds):
        shown = rnd if limit <= 0 else rnd[:limit]
        more = "" if len(shown) == len(rnd) else f", ... (+{len(rnd) - len(shown)} more)"
        lines.append(f"  round {k} ({len(rnd)}): " + ", ".join(str(t) for t in shown) + more)
    return lines


def _describe_plan(plan, topo, limit: int, backward: bool) -> list[str]:
    lines = [f"plan: graph {plan.name!r}, cp={plan.cp}, causal={plan.causal}, "
             f"parts/chunk={plan.parts_per_chunk}, rounds={len(plan.rounds)}, transfers={plan.num_transfers()} "
             f"({plan.chunks_moved():g} chunks; ring moves {2 * plan.cp * (plan.cp - 1)}), verified"]
    if plan.auto is not None:
        lines.append("  auto: predicted " + plan.auto.metric + ": " + ", ".join(
            f"{k} {v * 1e3:.3f} ms" for k, v in sorted(plan.auto.times, key=lambda kv: kv[1])))
    lines.append("  CP rank -> global rank (node.local): " + ", ".join(
        f"{i}:{r}(n{topo.node_of(r)}.{topo.local_rank_of(r)})" for i, r in enumerate(plan.ranks)))
    lines.extend(_round_lines(plan.rounds, limit))
    if backward:
        lines.append("  backward (reversed rounds, transfers flipped: partial dK/dV flow back to owners):")
        lines.extend(_round_lines(plan.backward_rounds(), limit))
    return lines


def run(args) -> int:
    try:
        topo = resolve_topology(args)
        print(topo.summary())
        if args.megatron_layout:
            layout = MegatronLayout.parse(args.megatron_layout)
            if layout.world != topo.world:
                raise ValueError(f"--megatron-layout: world={layout.world} but topology {topo.name!r} has "
                                 f"{topo.world} ranks")
            groups = [list(g) for g in layout.cp_groups()]
        else:
            groups = [resolve_ranks(args, topo)]
        for gi, ranks in enumerate(groups):
            plan = build_plan(topo, ranks, args.graph, causal=args.causal, parts_per_chunk=args.parts)
            print()
            if len(groups) > 1:
                print(f"CP group {gi}/{len(groups)}: global ranks {ranks}")
            if plan.cp > 1:
                print(build_graph(topo, ranks, plan.name).summary())
            print("\n".join(_describe_plan(plan, topo, args.max_transfers, args.backward)))
        return 0
    except (ValueError, TopologyError, PlanError) as e:
        print(f"megatron-fcp plan: error: {e}", file=sys.stderr)
        return 2
