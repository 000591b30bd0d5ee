"""``megatron-fcp plan``: build and verify an FCP plan; print the topology, the graph and the rounds.

Examples::

    megatron-fcp plan dgx-h100:2 --graph hierarchical --cp 16
    megatron-fcp plan dgx-h100:2 --megatron-layout world=16,tp=2,pp=1,cp=8
    megatron-fcp plan my_cluster.yaml --ranks 0,2,4,6 --parts 2
    megatron-fcp plan dgx-h100:2 --doc-lengths lognormal:8,1.2,512k,0 --block-tokens 4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from megatron_fcp.contract.blocks import Block, PlanError, make_transfer
from megatron_fcp.contract.mask import parse_window
from megatron_fcp.contract.placement import lognormal_lengths
from megatron_fcp.planner.placing import place_batch
from megatron_fcp.cost.model import parse_tokens
from megatron_fcp.planner.build import NOMINAL_SHAPE, build_plan
from megatron_fcp.planner.builders import GRAPH_CHOICES, build_graph
from megatron_fcp.planner.compare import packed_need_stats
from megatron_fcp.planner.megatron_layout import MegatronLayout
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


DOC_LENGTHS_HELP = (
    "plan a packed batch (THD) of documents instead of one zigzag-split sequence: LIST = comma-separated "
    "token counts (e.g. 4096,100,30000); FILE = a text file of integers (separated by commas or white space) "
    "or a JSON list; lognormal:MEAN,SIGMA,TOTAL[,SEED] = seeded lognormal lengths (log-mean MEAN, log-sigma "
    "SIGMA, median exp(MEAN)) drawn until TOTAL tokens (e.g. 512k), the last one trimmed; SEED default 0")


def add_window_argument(p: argparse.ArgumentParser) -> None:
    """``--window L,R``: a sliding window in Megatron's convention (query i sees keys i-L..i+R)."""
    p.add_argument("--window", metavar="L,R", default=None,
                   help="sliding window (Megatron's --window-size): query i sees keys i-L..i+R, -1 = unbounded; "
                        "causal forces R=0 (e.g. 4096,0). Need sets, plans and work follow it")




def add_packed_arguments(p: argparse.ArgumentParser) -> None:
    """Packed-batch arguments shared by ``plan`` and ``simulate``."""
    p.add_argument("--doc-lengths", metavar="LIST|FILE|lognormal:MEAN,SIGMA,TOTAL[,SEED]", help=DOC_LENGTHS_HELP)
    p.add_argument("--block-tokens", type=int, default=4096, metavar="B",
                   help="with --doc-lengths: documents longer than B tokens are cut into blocks of at most B "
                        "(default 4096)")


def parse_doc_lengths(spec: str) -> list[int]:
    """Document lengths from ``--doc-lengths`` (see :data:`DOC_LENGTHS_HELP`); ValueError names the fix."""
    flag = "--doc-lengths"
    spec = (spec or "").strip()
    if not spec:
        raise ValueError(f"{flag}: empty; give e.g. 4096,100,30000, a file of integers or lognormal:8,1.2,512k")
    if spec.lower().startswith("lognormal:"):
        parts = [x.strip() for x in spec.split(":", 1)[1].split(",")]
        if len(parts) not in (3, 4):
            raise ValueError(f"{flag}: {spec!r}: expected lognormal:MEAN,SIGMA,TOTAL[,SEED], e.g. lognormal:8,1.2,512k")
        try:
            mean, sigma = float(parts[0]), float(parts[1])
            seed = int(parts[3]) if len(parts) == 4 else 0
        except ValueError:
            raise ValueError(f"{flag}: {spec!r}: MEAN and SIGMA must be numbers and SEED an integer, "
                             "e.g. lognormal:8,1.2,512k,0") from None
        try:
            total = parse_tokens(parts[2])
        except ValueError:
            raise ValueError(f"{flag}: {spec!r}: TOTAL must be a positive token count, e.g. 512k or 524288") from None
        try:
            return lognormal_lengths(mean, sigma, total, seed)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    source = "list"
    text = spec
    if os.path.isfile(spec):
        source = f"file {spec}"
        with open(spec, encoding="utf-8") as f:
            text = f.read().strip()
        if text.startswith("["):
            try:
                values = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag}: {source}: malformed JSON ({e.msg}, line {e.lineno}); "
                                 "write a JSON list of integers") from None
            text = ",".join(str(v) for v in values) if isinstance(values, list) else "?"
    elif "/" in spec or spec.endswith((".txt", ".json")):
        raise ValueError(f"{flag}: {spec!r}: no such file; give a readable file, a comma-separated list or "
                         "lognormal:MEAN,SIGMA,TOTAL[,SEED]")
    items = [x for x in text.replace(",", " ").split()]
    if not items:
        raise ValueError(f"{flag}: {source} holds no document lengths; give at least one positive integer")
    out = []
    for x in items:
        try:
            n = int(x)
        except ValueError:
            raise ValueError(f"{flag}: {source}: {x!r} is not an integer; give positive token counts such as "
                             "4096,100,30000 (or lognormal:MEAN,SIGMA,TOTAL[,SEED])") from None
        if n < 1:
            raise ValueError(f"{flag}: {source}: document length {n}: every document needs at least 1 token "
                             "(drop empty documents)")
        out.append(n)
    return out


def placement_lines(plan, topo, shape=NOMINAL_SHAPE) -> list[str]:
    """Summary of a plan over a placement: per-rank tokens, work, blocks and need; bytes; rounds vs Δ."""
    pl = plan.placement
    st = packed_need_stats(plan, topo, shape)
    work = pl.work()
    need = pl.need_matrix()
    tok = pl.block_tokens()
    recv_tok = (need * tok[None, :]).sum(axis=1)
    moved = sum(pl.blocks[plan.cp_index(t.block.owner)][t.block.chunk].tokens for _, t in plan.transfers())
    cross = sum(pl.blocks[plan.cp_index(t.block.owner)][t.block.chunk].tokens for _, t in plan.transfers()
                if topo.domain_of(t.src) != topo.domain_of(t.dst))  # over NICs: between NVLink domains
    kv = shape.kv_bytes(1)
    lines = [pl.summary(),
             f"  block tokens <= {max(tok) if len(tok) else 0}; work max/mean {st['work_max_over_mean']:.3f}, "
             f"need max/mean {st['recv_max_over_mean']:.3f}",
             f"  KV moved: {moved} tokens = {moved * kv / 1e9:.3f} GB (exact need sets "
             f"{st['exact_need_bytes'] / 1e9:.3f} GB), across NICs {cross * kv / 1e9:.3f} GB (node need "
             f"{st['node_need_bytes'] / 1e9:.3f} GB); bytes at {shape.kv_heads} KV heads x {shape.head_dim} x "
             f"{shape.dtype_bytes} B",
             f"  rounds {len(plan.rounds)} vs delta {st['delta']} (the most blocks any rank sends or receives)",
             f"  {'cp':>4} {'rank':>5} {'tokens':>8} {'blocks':>6} {'work Mpairs':>12} {'need tokens':>12}"]
    for j, r in enumerate(plan.ranks):
        lines.append(f"  {j:>4} {r:>5} {pl.tokens(j):>8} {len(pl.blocks[j]):>6} {work[j] / 1e6:>12.2f} "
                     f"{int(recv_tok[j]):>12}")
    return lines


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
    add_packed_arguments(p)
    p.add_argument("--parts", type=int, default=1, metavar="P", help="sub-blocks per zigzag chunk (default 1)")
    p.add_argument("--megatron-layout", metavar="world=W,tp=T,pp=P,cp=C",
                   help="plan every CP group of a Megatron layout (order tp-cp-ep-dp-pp) and print its rank map")
    p.add_argument("--max-transfers", type=int, default=24, metavar="K",
                   help="transfers shown per round in the table (default 24; 0 = all)")
    p.add_argument("--backward", action="store_true", help="also print the backward (dK/dV reduction) rounds")
    add_window_argument(p)
    p.add_argument("--seq", default=None, help="global sequence length (128k, 1m, ...): needed with --window "
                                               "without --doc-lengths (windowed need sets depend on it)")


def _round_lines(rounds, limit: int) -> list[str]:
    """One line per round from ``(shown transfers, the round's count)`` pairs."""
    lines = []
    for k, (shown, n) in enumerate(rounds):
        more = "" if len(shown) == n else f", ... (+{n - len(shown)} more)"
        lines.append(f"  round {k} ({n}): " + ", ".join(str(t) for t in shown) + more)
    return lines


def _nic_crossings(plan, topo) -> tuple[int, int]:
    """(transfers, transfers whose route leaves through a NIC) from the plan's columns: a route
    crosses a NIC exactly when its ends lie in different NVLink domains (Topology.domains_of), so a
    1,024-rank plan's ~1.5M transfers are counted without building a route."""
    _, src, dst, *_ = plan.transfer_columns()
    return int(len(src)), int(np.count_nonzero(topo.domains_of(src) != topo.domains_of(dst)))


def _shown_rounds(plan, limit: int):
    """``plan.rounds`` cut to ``limit`` transfers per round, as ``(shown, total)`` pairs; a
    table-backed plan (Note [Columnar plans]) builds only the transfers shown, not its ~1.5M."""
    if plan.table is None or limit <= 0:
        return [(rnd if limit <= 0 else rnd[:limit], len(rnd)) for rnd in plan.rounds]
    rnd, src, dst, owner, chunk, part = plan.transfer_columns()
    counts = np.bincount(rnd, minlength=plan.num_rounds)
    starts = np.concatenate([[0], np.cumsum(counts)])
    out = []
    for k in range(plan.num_rounds):
        sl = slice(int(starts[k]), int(starts[k]) + min(limit, int(counts[k])))
        shown = tuple(make_transfer(s, d, Block(o, c, p)) for s, d, o, c, p in
                      zip(src[sl].tolist(), dst[sl].tolist(), owner[sl].tolist(), chunk[sl].tolist(), part[sl].tolist()))
        out.append((shown, int(counts[k])))
    return out


def _describe_plan(plan, topo, limit: int, backward: bool) -> list[str]:
    win = f", window={plan.window}" if plan.mask.windowed else ""
    lines = [f"plan: graph {plan.name!r}, cp={plan.cp}, causal={plan.causal}{win}, "
             f"parts/chunk={plan.parts_per_chunk}, rounds={len(plan.rounds)}, transfers={plan.num_transfers()} "
             f"({plan.chunks_moved():g} chunks; ring moves {2 * plan.cp * (plan.cp - 1)}), verified"]
    if plan.auto is not None:
        lines.append("  auto: predicted " + plan.auto.metric + ": " + ", ".join(
            f"{k} {v * 1e3:.3f} ms" for k, v in sorted(plan.auto.times, key=lambda kv: kv[1])))
    lines.append("  CP rank -> global rank (node.local): " + ", ".join(
        f"{i}:{r}(n{topo.node_of(r)}.{topo.local_rank_of(r)})" for i, r in enumerate(plan.ranks)))
    n_moves, over_nic = _nic_crossings(plan, topo)
    lines.append(f"  transfers over NICs: {over_nic} of {n_moves} (all between NVLink domains; "
                 f"{topo.domains} domain(s) of {topo.nvlink_domain} node(s))")
    lines.extend(_round_lines(_shown_rounds(plan, limit), limit))
    if backward:
        lines.append("  backward (reversed rounds, transfers flipped: partial dK/dV flow back to owners):")
        lines.extend(_round_lines([(r if limit <= 0 else r[:limit], len(r)) for r in plan.backward_rounds()], limit))
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
        lengths = parse_doc_lengths(args.doc_lengths) if args.doc_lengths is not None else None
        if lengths is not None and args.parts != 1:
            raise ValueError("--parts: not used with --doc-lengths; cut blocks with --block-tokens")
        if args.block_tokens < 1:
            raise ValueError(f"--block-tokens: must be >= 1, got {args.block_tokens}")
        window = parse_window(args.window)
        seq = parse_tokens(args.seq) if args.seq is not None else None
        if window is not None and seq is None and lengths is None:
            raise ValueError("--window: a zigzag plan under a window needs the sequence length: add --seq (e.g. 128k)")
        for gi, ranks in enumerate(groups):
            pl = None if lengths is None else place_batch(topo, ranks, lengths, block_tokens=args.block_tokens,
                                                         causal=args.causal, window=window)
            plan = build_plan(topo, ranks, args.graph, causal=args.causal, parts_per_chunk=args.parts, placement=pl,
                              window=window, seq_len=seq)
            print()
            if len(groups) > 1:
                print(f"CP group {gi}/{len(groups)}: global ranks {ranks}")
            if plan.cp > 1:
                print(build_graph(topo, ranks, plan.name).summary())
            if pl is not None:
                print("\n".join(placement_lines(plan, topo)))
            print("\n".join(_describe_plan(plan, topo, args.max_transfers, args.backward)))
        return 0
    except (ValueError, TopologyError, PlanError) as e:
        print(f"megatron-fcp plan: error: {e}", file=sys.stderr)
        return 2
