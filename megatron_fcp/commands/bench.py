"""``megatron-fcp bench --emulate``: measure FCP against Transformer Engine's schedules on an emulated cluster.

Examples (as root; needs ``ip`` and ``tc``)::

    megatron-fcp bench --emulate --nodes 2 --ranks-per-node 4 --nic rail --intra 360mbit --inter 40mbit \\
        --seq 4k --heads 4 --kv-heads 4 --head-dim 64 --workloads te-p2p,te-a2a-p2p,fcp-auto,fcp-hp --repeats 5
    megatron-fcp bench --emulate --nodes 2 --ranks-per-node 4 --doc-lengths lognormal:6,1.0,16k --json out.json
    megatron-fcp bench --emulate --seq 4k --heads 8 --kv-heads 8 --window 512,0 --workloads te-a2a,fcp-auto,fcp-full

Every rank is a network namespace, links are shaped veth pairs, the ranks run real gloo; the block
kernel is a sleep of the cost model's GPU time stretched by the cluster's time scale, on an
emulated GPU stream that leaves the host free (``--compute blocking-sleep``: inside the call;
``--compute cpu`` runs the real CPU kernels instead; never the headline). Prints a table (with a
progress bar while it runs) and, with ``--json``, writes every run (docs/emulator.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_fcp.commands.plan import DOC_LENGTHS_HELP, parse_doc_lengths
from megatron_fcp.contract.mask import parse_window
from megatron_fcp.cost.model import parse_tokens
from megatron_fcp.emulate.spec import ClusterSpec, parse_rate
from megatron_fcp.emulate.workloads import WORKLOAD_NAMES, WorkloadShape

NAME = "bench"
HELP = "measure FCP against TE's schedules on an emulated multi-node cluster (--emulate; root, ip, tc)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--emulate", action="store_true",
                   help="run on an emulated cluster: network namespaces, shaped veth links, gloo (root)")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=4, help="ranks (GPUs) per node (default 4)")
    p.add_argument("--nic", choices=("rail", "shared"), default="rail",
                   help="rail: one NIC per rank, rail aligned (DGX); shared: one uplink per node (default rail)")
    p.add_argument("--intra", default="360mbit", help="intra-node rate per rank and direction, tc notation "
                                                       "(default 360mbit: stands for NVLink4's 450 GB/s)")
    p.add_argument("--inter", default="40mbit", help="inter-node rate per NIC and direction (default 40mbit: "
                                                      "9:1 like NVLink4 to NDR IB)")
    p.add_argument("--seq", default="4k", help="global sequence length in tokens (default 4k)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: = --heads, MHA)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask (default on)")
    p.add_argument("--doc-lengths", metavar="LIST|FILE|lognormal:MEAN,SIGMA,TOTAL[,SEED]",
                   help="a packed batch (THD) instead of one sequence; " + DOC_LENGTHS_HELP)
    p.add_argument("--window", metavar="L,R", default=None,
                   help="a sliding window (Megatron's --window-size: query i sees keys i-L..i+R, -1 unbounded; "
                        "causal: R = 0); te-p2p and te-a2a-p2p are then refused, as TE refuses them")
    p.add_argument("--block-tokens", type=int, default=4096, help="with --doc-lengths: FCP's block size (default 4096)")
    p.add_argument("--parts", type=int, default=1, help="FCP sub-blocks per zigzag chunk (default 1)")
    p.add_argument("--backward-kv", choices=("auto", "keep", "resend"), default="auto",
                   help="FCP's backward KV mode, as --fcp-backward-kv (default auto)")
    p.add_argument("--workloads", default="te-p2p,te-a2a-p2p,fcp-auto,fcp-hp",
                   help=f"comma-separated, from: {', '.join(WORKLOAD_NAMES)} (default te-p2p,te-a2a-p2p,fcp-auto,fcp-hp; fcp-hp: the schedule the plugin's runtime settles; te-a2a: TE's Ulysses over the CP group)")
    p.add_argument("--repeats", type=int, default=5, help="timed forward+backward runs per workload, alternating "
                                                           "between workloads (default 5)")
    p.add_argument("--component-repeats", type=int, default=2,
                   help="communication-only and compute-only runs per workload (default 2)")
    p.add_argument("--compute", choices=("sleep", "blocking-sleep", "cpu"), default="sleep",
                   help="sleep: the modelled GPU time on an emulated GPU stream, the host free meanwhile (default); "
                        "blocking-sleep: the host sleeps inside each kernel call; cpu: the real CPU kernels "
                        "(not comparable)")
    p.add_argument("--tflops", type=float, default=400.0,
                   help="GPU attention TFLOP/s the sleep stands for, before the time scale (default 400)")
    p.add_argument("--kernel-model", metavar="CALIBRATION", default=None,
                   help="price and sleep block kernels by tiles with this calibration (e.g. h200-fa2; "
                        "Note [Tile-priced kernels]); default: FLOPs at --tflops")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the run is killed (default 1800)")
    p.add_argument("--json", metavar="PATH", help="write the results (runs, bounds, assumptions) as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="bar chart of measured, predicted and the lower bound")




def config_from_args(args):
    """The :class:`~megatron_fcp.emulate.bench.BenchConfig` of the parsed flags (ValueError names the flag)."""
    from megatron_fcp.emulate.bench import BenchConfig

    cluster = ClusterSpec(args.nodes, args.ranks_per_node, args.nic, parse_rate(args.intra, "--intra"),
                          parse_rate(args.inter, "--inter"))
    docs = tuple(parse_doc_lengths(args.doc_lengths)) if args.doc_lengths else None
    shape = WorkloadShape(parse_tokens(args.seq), args.heads, args.kv_heads or args.heads, args.head_dim,
                          args.causal, docs, args.parts, args.block_tokens, args.backward_kv,
                          parse_window(args.window))
    shape.attention()  # validates heads / kv_heads
    names = tuple(n.strip() for n in args.workloads.split(",") if n.strip())
    return BenchConfig(cluster, shape, names, args.repeats, args.component_repeats, 1, args.compute, args.tflops,
                       args.timeout, getattr(args, "kernel_model", None))


def run(args) -> int:
    if not args.emulate:
        print("megatron-fcp bench: only --emulate is available (an emulated cluster on this machine); "
              "add --emulate", file=sys.stderr)
        return 2
    from megatron_fcp.emulate.bench import run_bench
    from megatron_fcp.emulate.netns import EmulatorUnavailable
    from megatron_fcp.emulate.report import plot, progress_printer, table

    try:
        cfg = config_from_args(args)
        result = run_bench(cfg, progress_printer(sys.stderr, sys.stderr.isatty()))
    except (ValueError, EmulatorUnavailable) as e:
        print(f"megatron-fcp bench: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmegatron-fcp bench: interrupted; every rank process and namespace of the run is gone",
              file=sys.stderr)
        return 130
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0
