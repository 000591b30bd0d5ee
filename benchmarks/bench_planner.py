"""Planner benchmark: simulated FCP vs Transformer Engine baselines, lower-bound ratios, compile speed.

Writes ``benchmarks/results/planner.json`` (not committed; the setup section is, as
``--setup-only --out benchmarks/results/setup.json``) and prints a summary. Pure CPU, no
processes; about a minute on a quiet 2-core machine::

    python benchmarks/bench_planner.py [--out benchmarks/results/planner.json] [--quick] [--scale-only]

Sections of the JSON:

* ``headline``: dgx-h100x2, dgx-a100x2, dgx-h100x4 (cp = all GPUs, 128K tokens, 32 heads, 8 KV
  heads, head dim 128, bf16): FCP's plan chosen for communication time vs the lower bound and
  vs TE p2p / a2a+p2p; the issue asks for <= 1.15x the bound and >= 2x faster than the ring.
* ``headline_total``: the same with FCP chosen for the overlapped total (compute at 400 TFLOP/s).
* ``single_node``: FCP vs the ring on one NVSwitch node (must never be slower).
* ``bytes``: bytes moved by each builder's causal plan relative to the ring.
* ``round_overhead``: sensitivity of the headline ratios to a fixed per-round launch cost.
* ``scale_1024``: compile + verify time of a 1,024-rank plan (``total_s``, ``compile_s``,
  ``verify_s``: runs, best and median of 3; one fresh-process run; target < 2 s) and the
  DESIGN.md extrapolation (128 x 8 DGX-H100, 4 MB blocks, no compute): flat ring vs rail-striped.
* ``scale_8192``: the same timings for 8,192 ranks (1,024 x dgx-h100, ~100M transfers kept as a
  columnar table, docs/planner.md), the fresh process's peak RSS and the table's bytes; target < 10 s.
  ``--scale-only`` runs just the two scale sections and merges them into an existing JSON.
* ``other_presets``: pcie-box and single-uplink for reference.
* ``setup``: setup times (issue 25, item 5). ``runtime_choice``: the Megatron runtime's schedule
  choice (``choose_schedule`` with the executor's backward, as ``settle_schedule`` calls it) on the
  runtime grid's cells at cp = 64 (8 nodes of each preset, every head shape and length of
  ``bench_head_parallel.py``) and cp = 256 (32 nodes; 128K tokens, GQA 32:8), each cell's
  label, wall and CPU seconds, with targets 2 s and 10 s; ``cli_plan_1024``: ``megatron-fcp plan
  --topology dgx-h100:128 --cp 1024`` as a whole fresh process (imports included; target < 5 s)
  and whether it imported torch. ``--setup-only`` runs just this section and merges it into the
  JSON at ``--out`` (rewritten after each cell); ``--setup-cells N`` / ``--setup-cells-256 N``
  keep the first N cells at cp = 64 / 256 (a quick look; ``complete`` says whether all ran).
  ``runtime_choice_shared`` (``--shared-only``): the same cells with the search shared over the CP
  group's ranks as the runtime shares it (Note [Sharing the search]): the busiest rank's CPU
  seconds against the same targets, and whether every rank chose what one process alone chooses.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fcp.contract.plan import ring_plan  # noqa: E402
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.compile import compile_plan  # noqa: E402
from megatron_fcp.planner.compare import compare
from megatron_fcp.cost.model import AttentionShape, simulate_plan
from megatron_fcp.planner.builders import BUILDERS, build_graph  # noqa: E402
from megatron_fcp.topology import load_topology  # noqa: E402

SHAPE = AttentionShape(131072, heads=32, kv_heads=8, head_dim=128, dtype_bytes=2)
HEADLINE = ("dgx-h100:2", "dgx-a100:2", "dgx-h100:4")


def _row(out: dict) -> dict:
    s = out["schedules"]
    lb = out["lower_bound_s"]
    fcp, p2p = s["fcp"], s["te-p2p"]
    a2a = s.get("te-a2a-p2p", {})
    return {
        "lower_bound_s": lb,
        "fcp_graph": fcp["graph"],
        "fcp_parts_per_chunk": fcp["parts_per_chunk"],
        "fcp_rounds": fcp["rounds"],
        "fcp_comm_s": fcp["comm_s"],
        "fcp_total_s": fcp["total_s"],
        "fcp_comm_over_lower_bound": fcp["comm_s"] / lb,
        "te_p2p_comm_s": p2p["comm_s"],
        "te_p2p_total_s": p2p["total_s"],
        "te_p2p_comm_over_fcp_comm": p2p["comm_s"] / fcp["comm_s"],
        "te_a2a_p2p_comm_s": a2a.get("comm_s"),
        "te_a2a_p2p_total_s": a2a.get("total_s"),
        "fcp_bytes_over_te_p2p_bytes": fcp["bytes"] / p2p["bytes"],
        "fcp_inter_node_bytes": fcp["inter_node_bytes"],
        "te_p2p_inter_node_bytes": p2p["inter_node_bytes"],
    }


def headline(objective: str, round_overhead_s: float = 0.0) -> dict:
    return {p: _row(compare(p, None, SHAPE, objective=objective, round_overhead_s=round_overhead_s))
            for p in HEADLINE}


def single_node(quick: bool) -> dict:
    res = {}
    for preset in ("dgx-h100:1", "dgx-a100:1"):
        for seq in ((16384, 131072) if quick else (16384, 65536, 131072, 262144)):
            out = compare(preset, None, AttentionShape(seq), objective="comm")
            s = out["schedules"]
            res[f"{preset}@{seq}"] = {"fcp_comm_s": s["fcp"]["comm_s"], "te_p2p_comm_s": s["te-p2p"]["comm_s"],
                                      "fcp_graph": s["fcp"]["graph"],
                                      "fcp_not_slower": s["fcp"]["comm_s"] <= s["te-p2p"]["comm_s"] * (1 + 1e-9)}
    return res


def bytes_ratios() -> dict:
    res = {}
    for preset in ("dgx-h100:2", "pcie-box:2", "single-uplink:2"):
        topo = load_topology(preset)
        ring = ring_plan(range(16), causal=True)
        res[preset] = {name: build_plan(topo, range(16), name).num_transfers() / ring.num_transfers()
                       for name in sorted(BUILDERS)}
    return res


COMPILE_VERIFY_TARGET_S = 2.0
"""Target: compiling and verifying a 1,024-rank plan takes under 2 s on the 2-core dev machine."""

COMPILE_VERIFY_8192_TARGET_S = 10.0
"""Target: compiling and verifying an 8,192-rank plan takes under 10 s on the same machine."""

_FRESH = (
    "import resource, sys, time; from megatron_fcp.planning import build_plan; "
    "from megatron_fcp.topology import load_topology; cp = int(sys.argv[1]); "
    "t = load_topology(f'dgx-h100:{cp // 8}'); t0 = time.perf_counter(); build_plan(t, range(cp), 'hierarchical'); "
    "print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
)


def _stats(times: list[float]) -> dict:
    return {"runs": times, "best": min(times), "median": statistics.median(times)}


def _scale(cp: int, repeats: int, target_s: float) -> tuple[dict, object]:
    """``cp`` ranks (``cp / 8`` x dgx-h100, hierarchical, causal): ``total_s`` is ``build_plan``
    (compile + verify, as the plugin calls it), ``compile_s`` / ``verify_s`` the two halves timed
    apart; each best and median of ``repeats`` in this process, plus one run in a fresh
    interpreter (cold allocator, as a training job meets it) with its peak resident memory."""
    topo = load_topology(f"dgx-h100:{cp // 8}")
    ranks = tuple(range(cp))
    total, comp, ver = [], [], []
    plan = None
    for _ in range(repeats):
        plan = None
        gc.collect()
        t0 = time.perf_counter()
        plan = build_plan(topo, ranks, "hierarchical")
        total.append(time.perf_counter() - t0)
        plan = None
        gc.collect()
        t0 = time.perf_counter()
        plan = compile_plan(build_graph(topo, ranks, "hierarchical"), verify=False)
        t1 = time.perf_counter()
        plan.verify()
        comp.append(t1 - t0)
        ver.append(time.perf_counter() - t1)
    fresh = subprocess.run([sys.executable, "-c", _FRESH, str(cp)], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[1])
    fresh_s, fresh_rss = fresh.stdout.split()
    total_s = _stats(total)
    return {
        "total_s": total_s,
        "compile_s": _stats(comp),
        "verify_s": _stats(ver),
        "fresh_process_total_s": float(fresh_s),
        "fresh_process_peak_rss_bytes": int(fresh_rss),
        "target_s": target_s,
        "under_target": total_s["best"] < target_s,
        "transfers": plan.num_transfers(),
        "rounds": plan.num_rounds,
        "columnar": plan.table is not None,
        "table_bytes": plan.table.nbytes if plan.table is not None else None,
        "cpus": os.cpu_count(),
        "loadavg_1min": os.getloadavg()[0],
    }, topo


def scale_1024(repeats: int) -> dict:
    """:func:`_scale` at 1,024 ranks, and DESIGN.md's extrapolation (flat ring vs rail-striped)."""
    out, topo = _scale(1024, repeats, COMPILE_VERIFY_TARGET_S)
    # DESIGN.md's extrapolation: 4 MB blocks (1,024 tokens x 8 KV heads x 128 x bf16 x K,V), no compute
    shape = AttentionShape(2 * 1024 * 1024, heads=8, kv_heads=8)
    hier = build_plan(topo, range(1024), "hierarchical", causal=False)
    t0 = time.perf_counter()
    r_h = simulate_plan(hier, topo, shape, compute=False)
    sim_s = time.perf_counter() - t0
    r_r = simulate_plan(ring_plan(range(1024), causal=False), topo, shape, compute=False)
    out["extrapolation_4MB_blocks"] = {"ring_comm_s": r_r.comm_s, "hierarchical_comm_s": r_h.comm_s,
                                       "ratio": r_r.comm_s / r_h.comm_s, "simulate_s": sim_s}
    return out


def scale_8192(repeats: int) -> dict:
    """:func:`_scale` at 8,192 ranks (1,024 x dgx-h100; ~100M transfers in a columnar table)."""
    return _scale(8192, repeats, COMPILE_VERIFY_8192_TARGET_S)[0]


def _print_scale(cp: int, s: dict) -> None:
    print(f"{cp} ranks, {s['transfers']} transfers: compile+verify best {s['total_s']['best']:.2f} s, median "
          f"{s['total_s']['median']:.2f} s (compile {s['compile_s']['best']:.2f}, verify {s['verify_s']['best']:.2f}; "
          f"fresh process {s['fresh_process_total_s']:.2f} s, peak RSS "
          f"{s['fresh_process_peak_rss_bytes'] / 2 ** 30:.2f} GiB; target < {s['target_s']:.0f} s: "
          f"{'met' if s['under_target'] else 'MISSED'}; load {s['loadavg_1min']:.1f} on {s['cpus']} cpus)")


RUNTIME_CHOICE_TARGET_S = {64: 2.0, 256: 10.0}
"""Targets: the runtime's schedule choice takes at most this long for any cell at that CP size."""

CLI_PLAN_TARGET_S = 5.0
"""Target: ``megatron-fcp plan`` at 1,024 ranks, whole process, torch import included."""

_CLI = ("import runpy, sys, time; t0 = time.perf_counter(); sys.argv = ['megatron-fcp', 'plan', '--topology', "
        "'dgx-h100:128', '--cp', '1024']; import megatron_fcp.cli as c; rc = c.main(sys.argv[1:]); "
        "print('@@', rc, 'torch' in sys.modules, file=sys.stderr)")


def _runtime_cells(cp: int) -> list[tuple[str, int, int, int, int]]:
    """(preset, nodes, heads, KV heads, tokens) of the runtime grid at ``cp`` ranks (8 per node)."""
    heads = ((32, 32), (32, 8), (32, 2)) if cp <= 64 else ((32, 8),)
    seqs = (32 * 1024, 128 * 1024, 1024 * 1024) if cp <= 64 else (128 * 1024,)
    return [(p, cp // 8, h, kv, s) for p in ("dgx-a100", "dgx-h100", "pcie-box", "single-uplink")
            for h, kv in heads for s in seqs]


def runtime_choice(cells: dict[int, int | None], progress=None) -> dict:
    """``choose_schedule`` as the runtime calls it, timed per cell (wall and this process's CPU);
    ``cells``: per CP size, how many of its cells (None: all); ``progress(out)`` after each cell."""
    from megatron_fcp.planner.choose import choose_schedule
    from megatron_fcp.schedule.program import WaveBackward

    out = {}
    for cp, target in RUNTIME_CHOICE_TARGET_S.items():
        rows = []
        for preset, nodes, h, kv, seq in _runtime_cells(cp)[:cells.get(cp)]:
            topo = load_topology(f"{preset}:{nodes}")
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            c = choose_schedule(topo, range(cp), AttentionShape(seq, h, kv, 128, 2), backward=WaveBackward())
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            rows.append({"preset": preset, "nodes": nodes, "cp": cp, "heads": h, "kv_heads": kv, "seq": seq,
                         "choice": c.label, "runner_up": c.runner_up[0] if c.runner_up else None, "total_s": c.total_s,
                         "total_s": c.total_s, "priced": len(c.plan.auto), "wall_s": wall, "cpu_s": cpu})
            print(f"runtime choice {preset}:{nodes} cp={cp} {h}:{kv} seq={seq}: {c.label} ({len(c.plan.auto)} priced) "
                  f"{wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
            out[f"cp{cp}"] = {"cells": rows, "target_s": target, "wall_s_max": max(r["wall_s"] for r in rows),
                              "cpu_s_max": max(r["cpu_s"] for r in rows),
                              "under_target_wall": all(r["wall_s"] <= target for r in rows),
                              "under_target_cpu": all(r["cpu_s"] <= target for r in rows),
                              "complete": False}
            if progress is not None:
                progress(out)
        if rows:
            out[f"cp{cp}"]["complete"] = len(rows) == len(_runtime_cells(cp))
    return out


def runtime_choice_shared(cells: dict[int, int | None], progress=None, alone_up_to: int = 64) -> dict:
    """The same cells with the search shared over the CP group's ranks (Note [Sharing the search]
    in planner/choose.py): ``run_shared_search`` runs every rank's part on its own thread here;
    a rank's CPU seconds (its thread's) are what it spends at setup. Per cell: the busiest rank's
    CPU seconds, the mean rank's, the choice (the one-process search's, checked) and the wall time
    of all the ranks' parts run on this machine's cores. Above ``alone_up_to`` ranks the one-process
    search is not run (``same_as_alone`` null): at cp = 256 it takes minutes per cell here."""
    from megatron_fcp.planner.choose import choose_schedule
    from megatron_fcp.schedule.program import WaveBackward
    from megatron_fcp.testing.shared_search import run_shared_search

    out = {}
    for cp, target in RUNTIME_CHOICE_TARGET_S.items():
        rows = []
        for preset, nodes, h, kv, seq in _runtime_cells(cp)[:cells.get(cp)]:
            topo = load_topology(f"{preset}:{nodes}")
            shape = AttentionShape(seq, h, kv, 128, 2)
            # as in a fresh process per rank: earlier cells' objects are not scanned again by the
            # collector (a collection's time is charged to the thread that triggers it)
            gc.collect()
            gc.freeze()
            t0 = time.perf_counter()
            run = run_shared_search(cp, topo, range(cp), shape, backward=WaveBackward())
            wall = time.perf_counter() - t0
            c = run.choices[0]
            same = all((x.label, x.total_s, x.runner_up) == (c.label, c.total_s, c.runner_up) for x in run.choices)
            if cp <= alone_up_to:
                alone = choose_schedule(topo, range(cp), shape, backward=WaveBackward())
                same = same and (alone.label, alone.total_s, alone.runner_up) == (c.label, c.total_s, c.runner_up)
            else:
                same = None if same else False   # every rank agreed; the one-process search not run
            rows.append({"preset": preset, "nodes": nodes, "cp": cp, "heads": h, "kv_heads": kv, "seq": seq,
                         "choice": c.label, "runner_up": c.runner_up[0] if c.runner_up else None, "total_s": c.total_s,
                         "same_as_alone": same, "priced": len(c.plan.auto), "gathers": len(run.sent[0]),
                         "rank_cpu_s_max": max(run.cpu_s), "rank_cpu_s_mean": sum(run.cpu_s) / cp, "wall_s": wall})
            print(f"shared choice {preset}:{nodes} cp={cp} {h}:{kv} seq={seq}: {c.label} (same: {same}) busiest rank "
                  f"{max(run.cpu_s):.2f} s CPU, mean {sum(run.cpu_s) / cp:.2f} s", flush=True)
            out[f"cp{cp}"] = {"cells": rows, "target_s": target,
                              "rank_cpu_s_max": max(r["rank_cpu_s_max"] for r in rows),
                              "under_target_cpu": all(r["rank_cpu_s_max"] <= target for r in rows),
                              "all_same_as_alone": all(r["same_as_alone"] is not False for r in rows),
                              "complete": len(rows) == len(_runtime_cells(cp))}
            if progress is not None:
                progress(out)
    return out


def cli_plan_1024(repeats: int) -> dict:
    """The CLI plan at 1,024 ranks as a whole fresh process (wall; CPU of the child from rusage)."""
    import resource

    runs, cpus, torch = [], [], None
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", _CLI], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[1])
        runs.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        torch = p.stderr.split("@@")[-1].split()[1] == "True"
    return {"command": "megatron-fcp plan --topology dgx-h100:128 --cp 1024", "wall_s": _stats(runs),
            "cpu_s": _stats(cpus), "imports_torch": torch, "target_s": CLI_PLAN_TARGET_S,
            "under_target": min(runs) < CLI_PLAN_TARGET_S, "cpus": os.cpu_count(), "loadavg_1min": os.getloadavg()[0]}


def setup(cells: dict[int, int | None], repeats: int, progress=None) -> dict:
    """The CLI first (one process), then the runtime choice cell by cell (``progress(section)``)."""
    out = {"cli_plan_1024": cli_plan_1024(repeats), "cpus": os.cpu_count()}
    out["runtime_choice"] = runtime_choice(cells, None if progress is None else
                                           lambda rc: progress({**out, "runtime_choice": rc}))
    out["loadavg_1min"] = os.getloadavg()[0]
    return out


def _print_setup(s: dict) -> None:
    for key, r in s["runtime_choice"].items():
        print(f"runtime choice {key}: max {r['wall_s_max']:.2f} s wall / {r['cpu_s_max']:.2f} s CPU over "
              f"{len(r['cells'])} cells (target {r['target_s']:.0f} s)")
    c = s["cli_plan_1024"]
    print(f"CLI plan at 1,024 ranks: best {c['wall_s']['best']:.2f} s wall, {c['cpu_s']['best']:.2f} s CPU, "
          f"torch imported: {c['imports_torch']} (target < {c['target_s']:.0f} s)")


def other_presets() -> dict:
    res = {}
    for p in ("pcie-box:1", "pcie-box:2", "single-uplink:2", "single-uplink:4"):
        res[p] = _row(compare(p, None, SHAPE, objective="comm"))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "planner.json"))
    ap.add_argument("--quick", action="store_true", help="fewer sequence lengths and one 1,024-rank repeat")
    ap.add_argument("--scale-only", action="store_true",
                    help="only the scale_1024 and scale_8192 sections, merged into the JSON at --out")
    ap.add_argument("--setup-only", action="store_true", help="only the setup section, merged into the JSON at --out")
    ap.add_argument("--shared-only", action="store_true",
                    help="only the shared search's timings (setup.runtime_choice_shared), merged into --out")
    ap.add_argument("--shared-alone-up-to", type=int, default=64, metavar="CP",
                    help="--shared-only: check the choice against one process alone up to this many ranks")
    ap.add_argument("--setup-cells", type=int, default=None, metavar="N",
                    help="setup: the first N runtime-grid cells at cp = 64 (default all 36)")
    ap.add_argument("--setup-cells-256", type=int, default=None, metavar="N",
                    help="setup: the first N cells at cp = 256 (default all 4)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    repeats = 1 if args.quick else 3
    if args.shared_only:
        out = Path(args.out)
        result = json.loads(out.read_text()) if out.exists() else {}

        def shared_progress(section: dict) -> None:   # merged per CP size: a cp = 256 run keeps cp = 64's
            result.setdefault("setup", {}).setdefault("runtime_choice_shared", {}).update(section)
            result["setup"]["runtime_choice_shared_loadavg_1min"] = os.getloadavg()[0]
            out.write_text(json.dumps(result, indent=1))

        shared_progress(runtime_choice_shared({64: args.setup_cells, 256: args.setup_cells_256}, shared_progress,
                                              args.shared_alone_up_to))
        print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
        return 0
    if args.setup_only:
        out = Path(args.out)
        result = json.loads(out.read_text()) if out.exists() else {}
        out.parent.mkdir(parents=True, exist_ok=True)

        def progress(section: dict) -> None:  # rewritten after each cell: an interrupted run keeps its cells
            result["setup"] = section
            out.write_text(json.dumps(result, indent=1))

        progress(setup({64: args.setup_cells, 256: args.setup_cells_256}, repeats, progress))
        _print_setup(result["setup"])
        print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
        return 0
    if args.scale_only:
        out = Path(args.out)
        result = json.loads(out.read_text()) if out.exists() else {}
        result["scale_1024"] = scale_1024(repeats)
        result["scale_8192"] = scale_8192(repeats)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        _print_scale(1024, result["scale_1024"])
        _print_scale(8192, result["scale_8192"])
        print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
        return 0
    result = {
        "shape": {"seq_len": SHAPE.seq_len, "heads": SHAPE.heads, "kv_heads": SHAPE.kv_heads,
                  "head_dim": SHAPE.head_dim, "dtype_bytes": SHAPE.dtype_bytes},
        "model": "per-round bottleneck alpha-beta (megatron_fcp.cost.model Note [Cost model]); 400 TFLOP/s compute",
        "headline": headline("comm"),
        "headline_total": headline("total"),
        "single_node": single_node(args.quick),
        "bytes": bytes_ratios(),
        "round_overhead": {f"{us}us": {p: r["fcp_comm_over_lower_bound"] for p, r in headline("comm", us * 1e-6).items()}
                           for us in (2, 5)},
        "scale_1024": scale_1024(repeats),
        "scale_8192": scale_8192(repeats),
        "other_presets": other_presets(),
        "setup": setup({64: args.setup_cells, 256: args.setup_cells_256}, repeats),
    }
    result["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    print(f"{'topology':<12}{'LB ms':>8}{'fcp ms':>8}{'fcp/LB':>8}{'p2p ms':>8}{'p2p/fcp':>9}{'a2a ms':>8}"
          f"{'bytes':>7}  fcp plan")
    for p, r in result["headline"].items():
        print(f"{p:<12}{r['lower_bound_s'] * 1e3:>8.3f}{r['fcp_comm_s'] * 1e3:>8.3f}{r['fcp_comm_over_lower_bound']:>8.3f}"
              f"{r['te_p2p_comm_s'] * 1e3:>8.3f}{r['te_p2p_comm_over_fcp_comm']:>9.2f}"
              f"{(r['te_a2a_p2p_comm_s'] or 0) * 1e3:>8.3f}{r['fcp_bytes_over_te_p2p_bytes']:>7.2f}  "
              f"{r['fcp_graph']} x{r['fcp_parts_per_chunk']} parts, {r['fcp_rounds']} rounds")
    print("objective=total (overlapped, 400 TFLOP/s):")
    for p, r in result["headline_total"].items():
        print(f"  {p}: fcp total {r['fcp_total_s'] * 1e3:.3f} ms (comm {r['fcp_comm_over_lower_bound']:.2f}x LB, "
              f"{r['fcp_graph']} x{r['fcp_parts_per_chunk']}) vs te-p2p {r['te_p2p_total_s'] * 1e3:.3f} ms, "
              f"te-a2a-p2p {(r['te_a2a_p2p_total_s'] or 0) * 1e3:.3f} ms")
    print("single node, fcp never slower than ring:",
          all(v["fcp_not_slower"] for v in result["single_node"].values()))
    print("causal bytes / ring bytes (dgx-h100:2):",
          {k: round(v, 3) for k, v in result["bytes"]["dgx-h100:2"].items()})
    print("fcp/LB with per-round overhead:", result["round_overhead"])
    s = result["scale_1024"]
    _print_scale(1024, s)
    print(f"  4 MB blocks at 1024 ranks: ring {s['extrapolation_4MB_blocks']['ring_comm_s'] * 1e3:.1f} ms vs "
          f"hierarchical {s['extrapolation_4MB_blocks']['hierarchical_comm_s'] * 1e3:.1f} ms "
          f"({s['extrapolation_4MB_blocks']['ratio']:.1f}x)")
    _print_scale(8192, result["scale_8192"])
    _print_setup(result["setup"])
    print(f"wrote {out} in {result['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
