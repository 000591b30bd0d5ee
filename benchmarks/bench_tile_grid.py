"""The fixed-length 324-cell grid re-run with tile-priced kernels (issue 28, must-show 3): every cell of
``bench_head_parallel.py``'s grid priced twice in one run, kernels by FLOPs (the default model) and by
tiles (``ComputeModel.tiled("h200-fa2")``, Note [Tile-priced kernels] in :mod:`megatron_fcp.cost.tiles`;
the H200 calibration for every preset, since it is the only one fitted), TE's schedules and ``auto``
under the same model. Per cell: auto's choice and its total over the faster TE schedule under each
model, and whether the choice changed. Writes ``benchmarks/results/tile_grid.json`` (committed;
rewritten after every cell)::

    python benchmarks/bench_tile_grid.py [--out PATH] [--quick] [--resume]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_head_parallel import HEADS, NODES, PRESETS, SEQS, TOLERANCE, cell, geomean, groups  # noqa: E402

from megatron_fcp.cost.model import ComputeModel  # noqa: E402

CALIBRATION = "h200-fa2"
KEYS = ("preset", "nodes", "group", "cp", "heads", "kv_heads", "seq")


def summary(rows: list[dict]) -> dict:
    tile = [r["tiles"]["auto_over_best_te"] for r in rows]
    flop = [r["flops"]["auto_over_best_te"] for r in rows]
    return {
        "cells": len(rows), "calibration": CALIBRATION,
        "tiles_never_slower_within_1pct": all(x <= TOLERANCE for x in tile),
        "tiles_cells_slower_than_1pct": sum(x > TOLERANCE for x in tile),
        "tiles_worst": max(tile, default=None), "tiles_geomean_speedup_over_best_te": geomean([1 / x for x in tile]),
        "flops_never_slower_within_1pct": all(x <= TOLERANCE for x in flop),
        "flops_worst": max(flop, default=None), "flops_geomean_speedup_over_best_te": geomean([1 / x for x in flop]),
        "choice_changed": [{**{k: r[k] for k in KEYS}, "flops": r["flops"]["auto"], "tiles": r["tiles"]["auto"],
                            "tiles_over_best_te": r["tiles"]["auto_over_best_te"]}
                           for r in rows if r["flops"]["auto"] != r["tiles"]["auto"]],
        "tiles_slower": [{**{k: r[k] for k in KEYS}, "auto": r["tiles"]["auto"], "ratio": r["tiles"]["auto_over_best_te"],
                          "faster_te": r["tiles"]["faster_te"]}
                         for r in rows if r["tiles"]["auto_over_best_te"] > TOLERANCE],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "tile_grid.json"))
    ap.add_argument("--quick", action="store_true", help="1 and 2 nodes, 128K only")
    ap.add_argument("--resume", action="store_true", help="keep the cells already in --out")
    args = ap.parse_args()
    out = Path(args.out)
    rows = json.loads(out.read_text())["grid"] if args.resume and out.exists() else []
    seen = {tuple(r[k] for k in KEYS if k != "cp") for r in rows}
    models = {"flops": None, "tiles": ComputeModel.tiled(CALIBRATION)}
    t0 = time.perf_counter()
    for nodes in ((1, 2) if args.quick else NODES):
        for preset in PRESETS:
            for kind, ranks in groups(preset, nodes):
                for heads, kv in HEADS:
                    for seq in ((128 * 1024,) if args.quick else SEQS):
                        if (preset, nodes, kind, heads, kv, seq) in seen:
                            continue
                        row = {"preset": preset, "nodes": nodes, "group": kind, "cp": len(ranks), "heads": heads,
                               "kv_heads": kv, "seq": seq}
                        for name, cm in models.items():
                            r = cell(preset, nodes, ranks, heads, kv, seq, cm)
                            te = {k: r[f"{k}_total_s"] for k in ("te-p2p", "te-a2a-p2p") if r[f"{k}_total_s"] is not None}
                            row[name] = {"auto": r["auto"], "auto_total_s": r["auto_total_s"], "te_total_s": te,
                                         "faster_te": min(te, key=te.get), "auto_over_best_te": r["auto_over_best_te"],
                                         "plan_s": r["plan_s"]}
                        rows.append(row)
                        print(f"{preset}:{nodes} {kind} {heads}:{kv} {seq >> 10}K: flops {row['flops']['auto']} "
                              f"{row['flops']['auto_over_best_te']:.3f}; tiles {row['tiles']['auto']} "
                              f"{row['tiles']['auto_over_best_te']:.3f} ({row['tiles']['faster_te']})", flush=True)
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.write_text(json.dumps({"command": "python benchmarks/bench_tile_grid.py"
                                                   + (" --quick" if args.quick else ""),
                                                   "date": time.strftime("%Y-%m-%d", time.gmtime()),
                                                   "summary": summary(rows), "grid": rows}, indent=1) + "\n")
    s = summary(rows)
    print(json.dumps({k: v for k, v in s.items() if k not in ("choice_changed", "tiles_slower")}, indent=1))
    print(f"{len(s['choice_changed'])} cells change their choice; wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
