"""FCP against Transformer Engine's faster schedule under the FLOP model and the tile-priced model
(Note [Tile-priced kernels]; :meth:`megatron_fcp.cost.model.ComputeModel.tiled`), same cells, one run.

Cells: one zigzag sequence (dgx-h100 presets, GQA 32:8, d 128, fwd+bwd; FCP's choice by
:func:`~megatron_fcp.planner.compare.compare_head_parallel`) and packed lognormal mixes (THD for TE,
:func:`~megatron_fcp.planner.compare.compare_packed` for FCP at 4,096-token blocks and at the kernel
model's block sizes at 80 % and 90 % efficiency, :func:`~megatron_fcp.cost.model.kernel_block_tokens`). Each cell stores, per
compute model, TE's faster total over FCP's (``> 1``: FCP faster) and both totals. Pure CPU::

    python benchmarks/bench_tiles.py [--out benchmarks/results/tile_pricing.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fcp.contract.placement import lognormal_lengths  # noqa: E402
from megatron_fcp.cost.model import AttentionShape, ComputeModel, kernel_block_tokens  # noqa: E402
from megatron_fcp.planner.compare import compare_head_parallel, compare_packed  # noqa: E402

CALIBRATION = "h200-fa2"
TOPO = {16: "dgx-h100:2", 64: "dgx-h100:8"}
ZIGZAG = ((16, 131072), (16, 524288), (64, 524288))
PACKED = ((16, 7.6, 1.0, 1 << 19), (16, 9.0, 1.0, 1 << 19), (64, 7.6, 1.0, 1 << 19))  # medians ~2K, ~8K tokens


def _best_te(sched: dict, key) -> tuple[str, float]:
    te = {k: key(v) for k, v in sched.items() if k.startswith("te-") and "error" not in v}
    name = min(te, key=te.get)
    return name, te[name]


def run(quick: bool) -> dict:
    models = {"flops": ComputeModel(), "tiles": ComputeModel.tiled(CALIBRATION)}
    shape = AttentionShape(1, 32, 8, 128, 2)
    cells = []
    for cp, seq in ZIGZAG[:1] if quick else ZIGZAG:
        cell = {"kind": "zigzag", "topology": TOPO[cp], "cp": cp, "seq": seq}
        for label, cm in models.items():
            t0 = time.perf_counter()
            out = compare_head_parallel(TOPO[cp], range(cp), AttentionShape(seq, 32, 8, 128, 2), compute_model=cm)
            s = out["schedules"]
            te, te_s = _best_te(s, lambda v: v["total_s"])
            cell[label] = {"best_te": te, "te_total_s": te_s, "fcp_total_s": s["fcp"]["total_s"],
                           "fcp_label": s["fcp"].get("label"), "te_over_fcp": te_s / s["fcp"]["total_s"],
                           "seconds": time.perf_counter() - t0}
        cells.append(cell)
        print(json.dumps(cell))
    for cp, mu, sigma, total in PACKED[:1] if quick else PACKED:
        docs = lognormal_lengths(mu, sigma, total, seed=0)
        cell = {"kind": "packed", "topology": TOPO[cp], "cp": cp, "log_mean": mu, "log_sigma": sigma,
                "tokens": sum(docs), "documents": len(docs), "median": sorted(docs)[len(docs) // 2]}
        for label, cm in models.items():
            sizes = sorted({4096, kernel_block_tokens(cm, shape), kernel_block_tokens(cm, shape, 0.9)})
            for blocks in ((4096,) if label == "flops" else sizes):
                t0 = time.perf_counter()
                out = compare_packed(TOPO[cp], range(cp), docs, shape, block_tokens=blocks, compute_model=cm)
                s = out["schedules"]
                te, te_s = _best_te(s, lambda v: v["fwd_bwd"]["total_s"])
                f = s["fcp"]["fwd_bwd"]["total_s"]
                cell[f"{label}@{blocks}"] = {"best_te": te, "te_total_s": te_s, "fcp_total_s": f, "te_over_fcp": te_s / f,
                                             "seconds": time.perf_counter() - t0}
        cells.append(cell)
        print(json.dumps(cell))
    return {"command": "python benchmarks/bench_tiles.py" + (" --quick" if quick else ""), "calibration": CALIBRATION,
            "shape": "GQA 32:8, d 128, bf16, fwd+bwd", "cells": cells}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "tile_pricing.json"))
    ap.add_argument("--quick", action="store_true", help="one zigzag and one packed cell")
    args = ap.parse_args()
    res = run(args.quick)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
