"""Head-parallel benchmark (issue 9): ``auto`` (degree, graph, block size chosen by predicted fwd+bwd
time) against Transformer Engine's ``p2p`` and ``a2a+p2p`` on the cost model, over the whole grid.

Writes ``benchmarks/results/head_parallel.json`` (committed; rewritten after every cell) and prints a
summary::

    python benchmarks/bench_head_parallel.py [--out PATH] [--quick] [--resume] [--skip-grid]
                                             [--section bound|runtime|runtime-grid]

Grid: presets dgx-a100, dgx-h100, pcie-box, single-uplink x nodes {1, 2, 3, 4, 8} x heads {MHA 32:32,
GQA 32:8, GQA 32:2} x sequence {32K, 128K, 1M}, cp = every GPU; plus, for nodes >= 2, an *uneven* CP
group (every GPU of the first nodes and half of the last node's). Per cell: fwd+bwd total of te-p2p,
te-a2a-p2p (or why TE cannot run it), auto's choice and its predicted total with FCP's dK/dV partials
in bf16, the input dtype, as the executor sends them (and as TE's ring sends dKV); ``auto_over_best_te``
must be <= 1.01. Then the geometric-mean speedup over each baseline, FCP comm against the lower bound
over families on the headline clusters (128K-256K), rounds vs the edge-colouring bound Delta for
every builder, and the head-parallel planning time at 1,024 ranks. ``--section runtime`` prices what
the Megatron runtime runs (its choice with the executor's backward: a ring streamed hop by hop, other
graphs in waves) on 36 cells (~2 min); ``--section runtime-grid`` the same on the whole grid (every
cell above; written after each cell, ``--resume`` continues).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fcp.cost.model import AttentionShape  # noqa: E402
from megatron_fcp.planner.builders import BUILDERS, build_graph
from megatron_fcp.planner.compile import compile_plan
from megatron_fcp.planner.choose import choose_schedule, head_parallel_candidates  # noqa: E402
from megatron_fcp.schedule.program import WaveBackward  # noqa: E402
from megatron_fcp.planner.choose import lower_bound_all
from megatron_fcp.cost.head_parallel import simulate_te
from megatron_fcp.cost.model import pick_best  # noqa: E402
from megatron_fcp.planner.rounds import plan_delta  # noqa: E402
from megatron_fcp.topology import load_topology  # noqa: E402

PRESETS = ("dgx-a100", "dgx-h100", "pcie-box", "single-uplink")
NODES = (1, 2, 3, 4, 8)
HEADS = ((32, 32), (32, 8), (32, 2))
SEQS = (32 * 1024, 128 * 1024, 1024 * 1024)
TOLERANCE = 1.01


def cell(preset: str, nodes: int, ranks: list[int], heads: int, kv: int, seq: int, compute_model=None) -> dict:
    """One grid cell: TE's two schedules and auto, dK/dV partials priced in the KV dtype (bf16: what
    the executor sends, as TE's ring sends dKV; the planner's default); ``compute_model``: how
    kernels are priced, for both (default the FLOP model)."""
    topo = load_topology(f"{preset}:{nodes}")
    shape = AttentionShape(seq, heads, kv, 128, 2)
    row: dict = {"preset": preset, "nodes": nodes, "cp": len(ranks), "heads": heads, "kv_heads": kv, "seq": seq}
    for name in ("te-p2p", "te-a2a-p2p"):
        try:
            row[f"{name}_total_s"] = simulate_te(name, topo, ranks, shape, compute_model=compute_model).total_s
        except ValueError as e:
            row[f"{name}_total_s"] = None
            row[f"{name}_error"] = str(e)
    best_te = min(v for k, v in row.items() if k.endswith("_total_s") and v is not None)
    t0 = time.perf_counter()
    res, _ = pick_best(head_parallel_candidates(topo, ranks, shape, compute_model=compute_model), "total")
    row["auto"] = res.meta["label"]
    row["auto_total_s"] = res.total_s
    row["auto_over_best_te"] = res.total_s / best_te
    row["plan_s"] = time.perf_counter() - t0
    return row


def groups(preset: str, nodes: int) -> list[tuple[str, list[int]]]:
    g = load_topology(f"{preset}:{nodes}").gpus_per_node
    out = [("even", list(range(g * nodes)))]
    if nodes >= 2:
        out.append(("uneven", list(range(g * (nodes - 1) + g // 2))))
    return out


def grid(quick: bool, out: Path, done: list[dict]) -> list[dict]:
    """Every cell (8-node cells last); the JSON is rewritten after each cell, so an interrupted run
    leaves what it measured (``summary.complete`` says whether the grid is whole)."""
    rows = list(done)
    seen = {(r["preset"], r["nodes"], r["group"], r["heads"], r["kv_heads"], r["seq"]) for r in rows}
    for nodes in ((1, 2) if quick else NODES):
        for preset in PRESETS:
            for kind, ranks in groups(preset, nodes):
                for heads, kv in HEADS:
                    for seq in ((128 * 1024,) if quick else SEQS):
                        if (preset, nodes, kind, heads, kv, seq) in seen:
                            continue
                        r = cell(preset, nodes, ranks, heads, kv, seq)
                        r["group"] = kind
                        rows.append(r)
                        print(f"{preset}:{nodes} {kind} cp={r['cp']} {heads}:{kv} seq={seq}: p2p "
                              f"{_ms(r['te-p2p_total_s'])}, a2a+p2p {_ms(r['te-a2a-p2p_total_s'])}; auto "
                              f"{r['auto']} {r['auto_over_best_te']:.3f}x best TE ({r['plan_s']:.1f} s)", flush=True)
                        _write(out, {"summary": summary(rows, quick), "grid": rows})
    return rows


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    old.update(result)
    path.write_text(json.dumps(old, indent=1))


def _ms(v):
    return "n/a" if v is None else f"{v * 1e3:.3f} ms"


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary(rows: list[dict], quick: bool = False) -> dict:
    full = len(PRESETS) * sum(len(groups(p, n)) for p in PRESETS[:1] for n in NODES) * len(HEADS) * len(SEQS)
    keys = ("preset", "nodes", "group", "cp", "heads", "kv_heads", "seq")
    ratio = "auto_over_best_te"
    worst = max(rows, key=lambda r: r[ratio])
    uneven = [r for r in rows if r["group"] == "uneven"]
    return {
        "cells": len(rows), "complete": not quick and len(rows) >= full, "grid_cells": full,
        "te_a2a_p2p_cells": sum(r["te-a2a-p2p_total_s"] is not None for r in rows),
        "grad_dtype": "bf16 (the input dtype, as the executor sends dK/dV partials)",
        "never_slower_within_1pct": all(r[ratio] <= TOLERANCE for r in rows),
        "violations": [{**{k: r[k] for k in keys}, "auto": r["auto"], "ratio": r[ratio]}
                       for r in rows if r[ratio] > TOLERANCE],
        "worst": {**{k: worst[k] for k in keys}, "auto": worst["auto"], "ratio": worst[ratio]},
        "geomean_speedup_over_te_p2p": geomean([r["te-p2p_total_s"] / r["auto_total_s"] for r in rows]),
        "geomean_speedup_over_te_a2a_p2p": geomean([r["te-a2a-p2p_total_s"] / r["auto_total_s"]
                                                    for r in rows if r["te-a2a-p2p_total_s"] is not None]),
        "geomean_speedup_over_best_te": geomean([1 / r[ratio] for r in rows]),
        "uneven_geomean_speedup_over_te_p2p": geomean([r["te-p2p_total_s"] / r["auto_total_s"] for r in uneven])
        if uneven else None,
        "plan_s_max": max(r["plan_s"] for r in rows),
    }


def runtime_choice(nodes_list=(1, 2, 4), seqs=(128 * 1024,), uneven: bool = False, out: Path | None = None,
                   key: str = "runtime_choice", done: list[dict] | None = None) -> dict:
    """The Megatron runtime's own choice (``choose_schedule`` with the backward the executor runs:
    a ring streamed hop by hop, other graphs in waves, keep or resend as ``auto`` decides; Note [The
    runtime runs the planner's choice]) against the faster TE schedule, on a subset of the grid
    (even groups; ``uneven``: the grid's uneven groups too). The grid above prices FCP's backward in
    one pass from kept KV; this section prices what runs. With ``out`` the JSON's ``key`` is
    rewritten after each cell (``done``: cells already measured, kept)."""
    rows = list(done or [])
    seen = {(r["preset"], r["nodes"], r.get("group", "even"), r["heads"], r["kv_heads"], r["seq"]) for r in rows}
    for nodes in nodes_list:
        for preset in PRESETS:
            topo = load_topology(f"{preset}:{nodes}")
            for kind, ranks in groups(preset, nodes)[:2 if uneven else 1]:
                for heads, kv in HEADS:
                    for seq in seqs:
                        if (preset, nodes, kind, heads, kv, seq) in seen:
                            continue
                        rows.append(_runtime_cell(topo, preset, nodes, kind, ranks, heads, kv, seq))
                        if out is not None:
                            _write(out, {key: _runtime_summary(rows)})
    return _runtime_summary(rows)


def _runtime_cell(topo, preset: str, nodes: int, kind: str, ranks: list[int], heads: int, kv: int, seq: int) -> dict:
    shape = AttentionShape(seq, heads, kv, 128, 2)
    te = {}
    for name in ("te-p2p", "te-a2a-p2p"):
        try:
            te[name] = simulate_te(name, topo, ranks, shape).total_s
        except ValueError:
            te[name] = None
    best = min(v for v in te.values() if v is not None)
    t0 = time.perf_counter()
    c = choose_schedule(topo, ranks, shape, backward=WaveBackward())
    r = {"preset": preset, "nodes": nodes, "group": kind, "cp": len(ranks), "heads": heads, "kv_heads": kv,
         "seq": seq, "choice": c.label, "backward_kv": c.backward_kv, "backward_form": c.backward_form,
         "choice_total_s": c.total_s, **{f"{k}_total_s": v for k, v in te.items()},
         "choice_over_best_te": c.total_s / best, "plan_s": time.perf_counter() - t0}
    print(f"runtime {preset}:{nodes} {kind} {heads}:{kv} seq={seq}: {c.label} ({c.backward_kv}, {c.backward_form}) "
          f"{r['choice_over_best_te']:.3f}x best TE ({r['plan_s']:.1f} s)", flush=True)
    return r


def _runtime_summary(rows: list[dict]) -> dict:
    ratio = [r["choice_over_best_te"] for r in rows]
    return {"cells": rows, "never_slower_within_1pct": all(x <= TOLERANCE for x in ratio),
            "violations": [r for r in rows if r["choice_over_best_te"] > TOLERANCE],
            "worst": max(rows, key=lambda r: r["choice_over_best_te"]),
            "geomean_speedup_over_best_te": geomean([1 / x for x in ratio]),
            "geomean_speedup_over_te_p2p": geomean([r["te-p2p_total_s"] / r["choice_total_s"] for r in rows]),
            "plan_s_max": max(r["plan_s"] for r in rows)}


def bound_ratios() -> dict:
    """FCP (auto, objective comm) comm over the lower bound over families, at 128K and 256K (and 240K,
    where 2*cp*parts divides the sequence on 3 nodes; at 128K and 256K it does not, and the chunks
    are cut into uneven parts: Note [Sub-block sizes]): forward, and forward+backward (dK/dV partials
    in the input dtype, the executor's)."""
    out = {}
    for spec in ("dgx-h100:2", "dgx-a100:2", "dgx-h100:4", "dgx-a100:3"):
        topo = load_topology(spec)
        for seq in (128 * 1024, 240 * 1024, 256 * 1024):
            shape = AttentionShape(seq, 32, 8, 128, 2)
            ranks = list(range(topo.world))
            row = {}
            for key, pass_ in (("fwd", "fwd"), ("fwd+bwd", "fwd+bwd")):
                res, _ = pick_best(head_parallel_candidates(topo, ranks, shape, pass_=pass_, objective="comm"), "comm")
                lb = lower_bound_all(topo, ranks, shape, pass_=pass_)
                row[key] = {"fcp": res.meta["label"], "fcp_comm_s": res.comm_s, "lower_bound_s": lb["lower_bound_s"],
                            "bound_degree": lb["degree"], "ratio": res.comm_s / lb["lower_bound_s"]}
            out[f"{spec}@{seq}"] = row
            print(spec, seq, {k: (v["fcp"], round(v["ratio"], 3)) for k, v in row.items()}, flush=True)
    return out


def rounds_vs_delta() -> dict:
    """Per preset (2 nodes, and 1 node) and builder: rounds of the default plan and of the plan
    packed under one send and one receive per rank per round, against Delta."""
    out = {}
    for preset in PRESETS:
        for nodes in (1, 2):
            topo = load_topology(f"{preset}:{nodes}")
            ranks = list(range(topo.world))
            for name, b in sorted(BUILDERS.items()):
                if getattr(b, "needs_kv_sizes", False):
                    continue
                cg = build_graph(topo, ranks, name)
                plan = compile_plan(cg)
                ported = compile_plan(cg, max_sends=1, max_recvs=1)
                coloured = compile_plan(cg, max_sends=1, max_recvs=1, packing="colour")
                out[f"{preset}:{nodes}/{name}"] = {"rounds": len(plan.rounds), "delta": plan_delta(plan),
                                                   "rounds_ports_1_list": len(ported.rounds),
                                                   "rounds_ports_1_colour": len(coloured.rounds)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "head_parallel.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--resume", action="store_true", help="keep the cells already in --out")
    ap.add_argument("--skip-grid", action="store_true", help="only the bound ratios and rounds vs Delta")
    ap.add_argument("--section", choices=("all", "bound", "runtime", "runtime-grid"), default="all",
                    help="bound: rewrite only bound_ratios in --out (every other key kept as it is); "
                         "runtime: only runtime_choice (the runtime's as-run choice vs TE, 36 cells); "
                         "runtime-grid: runtime_choice_grid, the same on the whole grid (--resume keeps cells)")
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.perf_counter()
    if args.section == "runtime":
        _write(out, {"runtime_choice": runtime_choice()})
        print(f"{time.perf_counter() - t0:.0f} s")
        return
    if args.section == "runtime-grid":
        done = json.loads(out.read_text()).get("runtime_choice_grid", {}).get("cells", []) \
            if args.resume and out.exists() else []
        res = runtime_choice(NODES, SEQS, uneven=True, out=out, key="runtime_choice_grid", done=done)
        print(json.dumps({k: v for k, v in res.items() if k not in ("cells", "violations")}, indent=1))
        print(f"{time.perf_counter() - t0:.0f} s")
        return
    if args.section == "bound":
        _write(out, {"bound_ratios": bound_ratios()})
        print(f"{time.perf_counter() - t0:.0f} s")
        return
    if not args.skip_grid:
        done = json.loads(out.read_text()).get("grid", []) if args.resume and out.exists() else []
        done = [r for r in done if "auto_total_s" in r]  # cells of this version of the grid only
        grid(args.quick, out, done)
    _write(out, {"bound_ratios": bound_ratios(), "rounds_vs_delta": rounds_vs_delta()})
    print(json.dumps(json.loads(out.read_text()).get("summary"), indent=1))
    print(json.dumps(json.loads(out.read_text())["bound_ratios"], indent=1))
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
