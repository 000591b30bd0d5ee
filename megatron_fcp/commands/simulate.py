"""``megatron-fcp simulate``: predicted time of TE p2p, TE a2a+p2p and FCP side by side.

Examples::

    megatron-fcp simulate dgx-h100:2 --seq 128k
    megatron-fcp simulate dgx-h100:4 --seq 256k --heads 64 --kv-heads 8 --json
    megatron-fcp simulate cluster.yaml --cp 8 --plot fcp.png
    megatron-fcp simulate dgx-h100:8 --cp 64 --heads 64 --doc-lengths lognormal:8,1.2,2m,0
    megatron-fcp simulate dgx-h100:2 --seq 128k --window 4096,0

With ``--window L,R`` (a sliding-window layer) the schedules are what Transformer Engine runs there
(``a2a`` where heads divide by cp, ``all_gather``; it refuses ``p2p`` and ``a2a+p2p``), the halo
ring and FCP's windowed plan, forward and backward (:func:`megatron_fcp.planner.compare.compare_window`).

With ``--doc-lengths`` (a packed batch) the schedules are TE's on the padded THD layout and FCP's
plan over ``place_packed``, forward and backward (:func:`megatron_fcp.planning.compare_packed`).

The model is :mod:`megatron_fcp.cost.model` (per-round bottleneck alpha-beta with contention on
shared resources; see its Note [Cost model]). ``comm/LB`` is communication time over the lower
bound (1.00 = optimal; TE a2a+p2p may go below 1 because Ulysses moves Q/O instead of all KV).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_fcp.commands.plan import (
    add_packed_arguments,
    add_topology_arguments,
    add_window_argument,
    parse_doc_lengths,
    resolve_ranks,
    resolve_topology,
)
from megatron_fcp.contract.blocks import PlanError
from megatron_fcp.contract.mask import parse_window
from megatron_fcp.cost.model import AttentionShape, ComputeModel, parse_tokens
from megatron_fcp.planner.builders import build_graph
from megatron_fcp.planner.compare import compare, compare_packed, compare_window
from megatron_fcp.topology import TopologyError

NAME = "simulate"
HELP = "predict comm / compute / overlapped time of te-p2p, te-a2a-p2p and FCP (and the lower bound)"

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_topology_arguments(p)
    add_packed_arguments(p)
    add_window_argument(p)
    p.add_argument("--seq", default="128k", help="global sequence length in tokens, e.g. 131072, 128k, 1m (default 128k)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="KV element type (default bf16)")
    p.add_argument("--parts", default="auto", help="sub-blocks per chunk for FCP: an integer or auto (default: best "
                                                    "of 1,2,4,8,16 with blocks >= --min-block-tokens)")
    p.add_argument("--min-block-tokens", type=int, default=256, help="smallest sub-block auto may choose (default 256)")
    p.add_argument("--objective", choices=("comm", "total"), default=None,
                   help="what FCP's choice of graph, parts and head-parallel degree minimises: comm, or total = "
                        "overlapped time, ties broken by comm (default: total, or comm with --pass fwd "
                        "--head-parallel 1, the forward KV-distribution comparison)")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "fwd+bwd"), default="fwd+bwd",
                   help="which pass to predict (default fwd+bwd); the JSON adds \"pass\"")
    p.add_argument("--head-parallel", default="auto",
                   help="FCP's head-parallel degree: an integer (ranks per head group, inside a node) or auto "
                        "(default: chosen by predicted time; 1 = KV distribution only)")
    p.add_argument("--tflops", type=float, default=400.0, help="sustained attention TFLOP/s per GPU (default 400)")
    p.add_argument("--kernel-model", metavar="CALIBRATION", default=None,
                   help="price block kernels by the tiles they touch with this calibration (e.g. h200-fa2; Note "
                        "[Tile-priced kernels]), FCP and TE alike; default: FLOPs at --tflops")
    p.add_argument("--round-overhead-us", type=float, default=0.0,
                   help="fixed launch/sync cost per round in microseconds, on top of route latency (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw FCP's graph and per-resource timeline (needs matplotlib)")


def _compute_model(args) -> ComputeModel:
    """The FLOP model at ``--tflops``, or the ``--kernel-model`` calibration (ValueError names it)."""
    if args.kernel_model:
        return ComputeModel.tiled(args.kernel_model, flops=args.tflops * 1e12)
    return ComputeModel(flops=args.tflops * 1e12)


def _shape(args):
    return AttentionShape(parse_tokens(args.seq), args.heads, args.kv_heads, args.head_dim, DTYPE_BYTES[args.dtype])


def _table(out: dict, shape, topo, ranks) -> str:
    lb = out["lower_bound"]
    lines = [
        f"pass: {out.get('pass', 'fwd')}",
        f"{topo.name}: cp={len(ranks)} over {lb['n']} node(s), seq={shape.seq_len} tokens, heads={shape.heads}, "
        f"kv_heads={shape.kv_heads}, head_dim={shape.head_dim}, {shape.dtype_bytes} B/elem; "
        f"KV per layer S={lb['S'] / 1e6:.1f} MB",
        *([f"seq {shape.seq_len} is not a multiple of 2*cp = {2 * len(ranks)}: every schedule runs it padded "
           f"to {out['padded_seq_len']} tokens, as Megatron pads"] if out["padded_seq_len"] else []),
        (f"lower bound ({out['pass']}): {lb['lower_bound_s'] * 1e3:.3f} ms over every family compared (head-parallel "
         f"degree {lb['degree']} attains it; Note [Lower bound over schedule families]); B_gpu={lb['B_gpu'] / 1e9:g} "
         f"GB/s, B_out={lb['B_out'] / 1e9:g} GB/s" if "per_degree" in lb else
         f"lower bound: {lb['lower_bound_s'] * 1e3:.3f} ms  (S*max((N-1)/(N*B_gpu), (n-1)/(n*B_out))"
         f"{', causal need sets' if lb['causal'] else ''}; B_gpu={lb['B_gpu'] / 1e9:g} GB/s, "
         f"B_out={lb['B_out'] / 1e9:g} GB/s)"),
        "",
        f"{'schedule':<12}{'comm ms':>10}{'compute ms':>12}{'total ms':>10}{'GB moved':>10}{'inter GB':>10}"
        f"{'comm/LB':>9}  plan",
    ]
    for name, d in out["schedules"].items():
        if "error" in d:
            lines.append(f"{name:<12}{'n/a':>10}  ({d['error']})")
            continue
        extra = ""
        if name == "fcp":
            extra = f"graph={d['graph']} parts={d['parts_per_chunk']} rounds={d['rounds']}"
            if "head_parallel" in d:
                extra += f" delta={d['delta']} head-parallel={d['head_parallel']} kv-rep={d['kv_replication']}"
        else:
            extra = f"{d.get('graph', '')} rounds={d['rounds']}"
        lines.append(
            f"{name:<12}{d['comm_s'] * 1e3:>10.3f}{d['compute_s'] * 1e3:>12.3f}{d['total_s'] * 1e3:>10.3f}"
            f"{d['bytes'] / 1e9:>10.3f}{d['inter_node_bytes'] / 1e9:>10.3f}{d['comm_vs_lower_bound']:>9.2f}  {extra}"
        )
    s = out["schedules"]
    kv = s.get("fcp", {}).get("backward_kv")
    if isinstance(kv, dict):
        lines.append("")
        lines.append(
            f"backward KV (fcp, per rank per layer): keep holds {kv['keep']['held_kv_bytes_max'] / 1e6:.1f} MB "
            f"between forward and backward, fwd+bwd {kv['keep']['fwd_bwd_s'] * 1e3:.3f} ms; resend holds 0, "
            f"{kv['resend']['backward_held_kv_bytes_max'] / 1e6:.1f} MB within backward "
            f"({kv['resend']['waves']} waves), fwd+bwd {kv['resend']['fwd_bwd_s'] * 1e3:.3f} ms "
            f"({kv['resend_vs_keep']:.3f}x keep, {kv['resend_vs_one_pass_keep']:.3f}x keep's one-pass backward "
            f"{kv['keep']['one_pass_fwd_bwd_s'] * 1e3:.3f} ms); "
            f"TE's ring saves its last received shard ({kv['ring_in_flight_kv_bytes'] / 1e6:.1f} MB)")
    if "fcp" in s and "te-p2p" in s and s["fcp"]["comm_s"] > 0:
        lines.append("")
        lines.append(f"fcp vs te-p2p: comm {s['te-p2p']['comm_s'] / s['fcp']['comm_s']:.2f}x faster, "
                     f"{s['fcp']['bytes'] / s['te-p2p']['bytes']:.2f}x the bytes; total "
                     f"{s['te-p2p']['total_s'] / s['fcp']['total_s']:.2f}x")
    return "\n".join(lines)


def _packed_table(out: dict, shape, topo, ranks) -> str:
    pl = out["placement"]
    lb = out["lower_bound"]
    lines = [
        f"{topo.name}: cp={len(ranks)}, packed batch of {len(pl.doc_lengths)} documents, {pl.total_tokens} tokens "
        f"(longest {max(pl.doc_lengths)}), heads={shape.heads}, kv_heads={shape.kv_heads}, head_dim={shape.head_dim}, "
        f"{shape.dtype_bytes} B/elem",
        f"TE THD pads every document to a multiple of 2*cp = {2 * len(ranks)}: {out['padded_seq_len']} tokens "
        f"(+{out['schedules']['te-p2p']['padding_overhead'] * 100:.2f}%)",
        f"need-set lower bound (forward): {lb['lower_bound_s'] * 1e3:.3f} ms (B_gpu={lb['B_gpu'] / 1e9:g} GB/s, "
        f"B_out={lb['B_out'] / 1e9:g} GB/s)" + (f"; over every family compared: least with head-parallel degree "
                                                 f"{lb['degree']} (Note [Lower bound over schedule families])"
                                                 if "degree" in lb else ""),
        "",
        f"{'schedule':<12}{'fwd comm':>10}{'fwd comp':>10}{'fwd tot':>10}{'bwd comm':>10}{'bwd comp':>10}"
        f"{'bwd tot':>10}{'total ms':>10}{'fwd GB':>8}{'inter GB':>9}{'work m/m':>9}  plan",
    ]
    for name, d in out["schedules"].items():
        if "error" in d:
            lines.append(f"{name:<12}{'n/a':>10}  ({d['error']})")
            continue
        f, b, t = d["fwd"], d["bwd"], d["fwd_bwd"]
        if name == "fcp":
            extra = (f"graph={d['graph']} rounds={d['rounds']} delta={d['delta']} bytes/need="
                     f"{d['bytes_over_exact']:.3f} inter/need={d['inter_node_over_need']:.3f}")
        else:
            extra = f"{d.get('graph', '')} rounds={d['rounds']} padding +{d['padding_overhead'] * 100:.2f}%"
        lines.append(
            f"{name:<12}{f['comm_s'] * 1e3:>10.3f}{f['compute_s'] * 1e3:>10.3f}{f['total_s'] * 1e3:>10.3f}"
            f"{b['comm_s'] * 1e3:>10.3f}{b['compute_s'] * 1e3:>10.3f}{b['total_s'] * 1e3:>10.3f}"
            f"{t['total_s'] * 1e3:>10.3f}{f['bytes'] / 1e9:>8.3f}{f['inter_node_bytes'] / 1e9:>9.3f}"
            f"{d['work_max_over_mean']:>9.3f}  {extra}")
    s = out["schedules"]
    lines.append("")
    for base in ("te-p2p", "te-a2a-p2p"):
        if base in s and "error" not in s[base]:
            lines.append(f"fcp vs {base}: fwd+bwd {s[base]['fwd_bwd']['total_s'] / s['fcp']['fwd_bwd']['total_s']:.2f}x "
                         f"faster (fwd {s[base]['fwd']['total_s'] / s['fcp']['fwd']['total_s']:.2f}x, bwd "
                         f"{s[base]['bwd']['total_s'] / s['fcp']['bwd']['total_s']:.2f}x), "
                         f"{s['fcp']['fwd_bwd']['bytes'] / s[base]['fwd_bwd']['bytes']:.3f}x the bytes")
    return "\n".join(lines)


def plot(path: str, topo, plan, result, graph) -> None:
    """Two panels: the CommGraph (ranks grouped by node, edges coloured by kind) and the busy time of
    the most loaded resources per round (one bar per round and resource)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'megatron_fcp[plot]'") from None
    import math

    fig, (ax_g, ax_t) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1, 1.5]})
    nodes = sorted({topo.node_of(r) for r in plan.ranks})
    pos = {}
    for x, node in enumerate(nodes):
        members = [r for r in plan.ranks if topo.node_of(r) == node]
        cx, cy = math.cos(2 * math.pi * x / len(nodes)) * 3, math.sin(2 * math.pi * x / len(nodes)) * 3
        if len(nodes) == 1:
            cx = cy = 0.0
        for i, r in enumerate(members):
            a = 2 * math.pi * i / max(len(members), 1)
            pos[r] = (cx + math.cos(a), cy + math.sin(a))
    colours = {"nvswitch": "tab:green", "nvlink": "tab:green", "pcie": "tab:orange", "ib": "tab:blue",
               "ethernet": "tab:purple", "loopback": "grey"}
    for u, v, kind in graph.graph.edges(data="kind"):
        (x0, y0), (x1, y1) = pos[u], pos[v]
        ax_g.plot([x0, x1], [y0, y1], color=colours.get(kind, "black"), lw=0.6, alpha=0.5)
    for r, (x, y) in pos.items():
        ax_g.scatter([x], [y], s=120, color="white", edgecolor="black", zorder=3)
        ax_g.annotate(str(r), (x, y), ha="center", va="center", fontsize=7, zorder=4)
    for kind, c in colours.items():
        if any(k == kind for _, _, k in graph.graph.edges(data="kind")):
            ax_g.plot([], [], color=c, label=kind)
    ax_g.legend(loc="lower center", fontsize=8, ncol=3, bbox_to_anchor=(0.5, -0.08))
    ax_g.set_title(f"graph {graph.name!r}: {len(plan.ranks)} ranks on {len(nodes)} node(s)")
    ax_g.set_axis_off()
    top = sorted(result.resource_bytes, key=lambda k: -result.resource_bytes[k])[:24]
    for y, name in enumerate(top):
        for e in result.timeline:
            busy = e["busy"].get(name)
            if busy:
                ax_t.barh(y, busy * 1e3, left=e["start_s"] * 1e3, height=0.7,
                          color=colours.get(result_kind(name, topo), "grey"), edgecolor="black", lw=0.3)
    for e in result.timeline:
        ax_t.axvline(e["end_s"] * 1e3, color="black", lw=0.4, ls=":")
    ax_t.set_yticks(range(len(top)), top, fontsize=6)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("time (ms)")
    ax_t.set_title(f"fcp: busy time of the {len(top)} most loaded resources per round (dotted: round ends)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def result_kind(resource_name: str, topo) -> str:
    if ">net" in resource_name or "net>" in resource_name:
        return topo.layout.nics[0].kind if topo.layout.nics else "ib"
    local = resource_name.split(":", 1)[1]
    u, _, v = local.partition(">")
    for ln in topo.layout.links:
        if {ln.a, ln.b} == {u, v}:
            return ln.kind
    return "loopback"


def run(args) -> int:
    try:
        topo = resolve_topology(args)
        ranks = resolve_ranks(args, topo)
        shape = _shape(args)
        if args.tflops <= 0:
            raise ValueError(f"--tflops: must be > 0, got {args.tflops}")
        if args.round_overhead_us < 0:
            raise ValueError(f"--round-overhead-us: must be >= 0, got {args.round_overhead_us}")
        parts = args.parts if args.parts == "auto" else _int_arg(args.parts, "--parts")
        window = parse_window(args.window)
        if window is not None and args.doc_lengths is not None:
            raise ValueError("--window: not available with --doc-lengths yet (plan it with megatron-fcp plan "
                             "--doc-lengths ... --window L,R)")
        if window is not None:
            return _run_window(args, topo, ranks, shape, parts, window)
        if args.doc_lengths is not None:
            return _run_packed(args, topo, ranks, shape, parts)
        hp = args.head_parallel if args.head_parallel == "auto" else _int_arg(args.head_parallel, "--head-parallel")
        objective = args.objective or ("comm" if (args.pass_, hp) == ("fwd", 1) else "total")
        out = compare(topo, ranks, shape, graph=args.graph, parts_per_chunk=parts, causal=args.causal,
                      compute_model=_compute_model(args), min_block_tokens=args.min_block_tokens,
                      objective=objective, round_overhead_s=args.round_overhead_us * 1e-6, pass_=args.pass_,
                      head_parallel=hp)
        if args.plot and out.get("head_parallel_plan") is not None and out["head_parallel_plan"].degree != 1:
            raise ValueError("--plot: draws a KV-distribution plan; add --head-parallel 1")
        if args.plot:
            plan = out["plan"]
            plot(args.plot, topo, plan, out["results"]["fcp"], build_graph(topo, ranks, plan.name))
        if args.json:
            sched = {}
            for name, d in out["schedules"].items():
                if "error" in d:
                    sched[name] = {"comm_s": None, "compute_s": None, "total_s": None, "bytes": None, **d}
                else:
                    sched[name] = d
            print(json.dumps({"lower_bound_s": out["lower_bound_s"], "schedules": sched,
                              "lower_bound": out["lower_bound"], "topology": topo.name, "cp_ranks": ranks,
                              "seq_len": shape.seq_len, "padded_seq_len": out["padded_seq_len"],
                              "pass": out.get("pass", "fwd")}, indent=1, default=_json_default))
        else:
            print(_table(out, shape, topo, ranks))
            if args.plot:
                print(f"plot written to {args.plot}")
        return 0
    except (ValueError, TopologyError, PlanError) as e:
        print(f"megatron-fcp simulate: error: {e}", file=sys.stderr)
        return 2


def _run_packed(args, topo, ranks, shape, parts) -> int:
    lengths = parse_doc_lengths(args.doc_lengths)
    if parts != "auto":
        raise ValueError("--parts: not used with --doc-lengths; cut blocks with --block-tokens")
    if args.plot:
        raise ValueError("--plot: not available with --doc-lengths yet")
    if args.block_tokens < 1:
        raise ValueError(f"--block-tokens: must be >= 1, got {args.block_tokens}")
    out = compare_packed(topo, ranks, lengths, shape, graph=args.graph, block_tokens=args.block_tokens,
                         causal=args.causal, compute_model=_compute_model(args),
                         objective=args.objective, round_overhead_s=args.round_overhead_us * 1e-6)
    if args.json:
        sched = {}
        for name, d in out["schedules"].items():
            sched[name] = {"comm_s": None, "compute_s": None, "total_s": None, "bytes": None, **d} if "error" in d else d
        pl = out["placement"]
        print(json.dumps({"lower_bound_s": out["lower_bound_s"], "schedules": sched, "lower_bound": out["lower_bound"],
                          "topology": topo.name, "cp_ranks": ranks, "seq_len": out["seq_len"],
                          "padded_seq_len": out["padded_seq_len"], "documents": len(pl.doc_lengths),
                          "block_tokens": args.block_tokens}, indent=1))
    else:
        print(_packed_table(out, shape, topo, ranks))
    return 0


def _run_window(args, topo, ranks, shape, parts, window) -> int:
    if args.plot:
        raise ValueError("--plot: not available with --window yet")
    out = compare_window(topo, ranks, shape, window=window, causal=args.causal, graph=args.graph,
                         parts_per_chunk=parts, compute_model=_compute_model(args),
                         min_block_tokens=args.min_block_tokens, objective=args.objective or "total",
                         round_overhead_s=args.round_overhead_us * 1e-6)
    if args.json:
        keep = ("window", "mask", "seq_len", "padded_seq_len", "lower_bound_s", "lower_bound", "exact_need_bytes",
                "schedules", "best_te", "fcp_vs_best_te", "a2a_bytes_over_fcp")
        print(json.dumps({**{k: out[k] for k in keep}, "topology": topo.name, "cp_ranks": ranks}, indent=1,
                         default=_json_default))
    else:
        print(_window_table(out, shape, topo, ranks))
    return 0


def _window_table(out: dict, shape, topo, ranks) -> str:
    s = out["schedules"]
    lines = [
        f"{topo.name}: cp={len(ranks)}, seq={shape.seq_len} tokens, {out['mask']}, heads={shape.heads}, "
        f"kv_heads={shape.kv_heads}, head_dim={shape.head_dim}, {shape.dtype_bytes} B/elem",
        *([f"padded to {out['padded_seq_len']} tokens (a multiple of 2*cp), as Megatron pads"]
          if out["padded_seq_len"] else []),
        f"window need set: {out['exact_need_bytes'] / 1e9:.3f} GB (each block to each rank its window reaches); "
        f"need-set lower bound (forward KV): {out['lower_bound_s'] * 1e3:.3f} ms",
        "",
        f"{'schedule':<14}{'fwd comm':>10}{'fwd tot':>10}{'bwd comm':>10}{'bwd tot':>10}{'total ms':>10}"
        f"{'fwd GB':>9}{'inter GB':>9}  plan",
    ]
    for name, d in s.items():
        if "error" in d or "refused" in d:
            lines.append(f"{name:<14}{'n/a':>10}  ({d.get('error') or 'refused: ' + d['refused']})")
            continue
        f, b, t = d["fwd"], d["bwd"], d["fwd_bwd"]
        extra = (f"graph={d['graph']} parts={d['parts_per_chunk']} bytes/need={d['bytes_over_exact']:.3f}"
                 if name == "fcp" else f"{d.get('graph', '')} rounds={d['rounds']}")
        lines.append(f"{name:<14}{f['comm_s'] * 1e3:>10.3f}{f['total_s'] * 1e3:>10.3f}{b['comm_s'] * 1e3:>10.3f}"
                     f"{b['total_s'] * 1e3:>10.3f}{t['total_s'] * 1e3:>10.3f}{f['bytes'] / 1e9:>9.3f}"
                     f"{f['inter_node_bytes'] / 1e9:>9.3f}  {extra}")
    lines.append("")
    lines.append(f"fcp vs TE's best here ({out['best_te']}): fwd+bwd {out['fcp_vs_best_te']:.2f}x faster"
                 + (f"; te-a2a moves {out['a2a_bytes_over_fcp']:.2f}x fcp's bytes" if out["a2a_bytes_over_fcp"]
                    else ""))
    return "\n".join(lines)


def _json_default(x):
    if isinstance(x, dict):
        return {str(k): v for k, v in x.items()}
    return float(x)


def _int_arg(value: str, flag: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise ValueError(f"{flag}: expected an integer or auto, got {value!r}") from None
    if v < 1:
        raise ValueError(f"{flag}: must be >= 1, got {v}")
    return v
