"""Fit the tile-priced kernel model (Note [Tile-priced kernels] in megatron_fcp/cost/tiles.py).

Two sources, each fitted and checked on its own:

* the committed H200 run (``benchmarks/results/gpu_check.json``, section ``speed``: one fused
  ``cuda-flash`` call against the engine's blockwise computation over the same tokens, cp = 4,
  causal, GQA 32:8, d 128, BF16, 32K-256K tokens, forward and backward): the constants of each pass,
  and the predicted blockwise / fused ratios against the measured ones;
* published FlashAttention throughput curves (FlashAttention-3, Shah et al. 2024, arXiv 2407.08608,
  figure "Attention forward speed, head dim 128 (H100 80GB SXM5)": batch x length = 16K tokens,
  16 heads, no mask; FlashAttention-2 and FlashAttention-3 bars): the per-query-tile to per-tile-pair
  ratio that the curve's rise with length implies.

``python benchmarks/fit_tiles.py`` writes ``benchmarks/results/tile_fit.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_fcp.contract.mask import CAUSAL, FULL  # noqa: E402
from megatron_fcp.cost.tiles import Call, fit_tile_costs, fused_calls, zigzag_calls  # noqa: E402

# FlashAttention-3 paper (arXiv 2407.08608), forward, head dim 128, H100 SXM5, TFLOP/s by length
FA_CURVES = {
    "flash-attn-2 (H100, fwd, d128)": {512: 309, 1024: 350, 2048: 362, 4096: 368, 8192: 370, 16384: 370},
    "flash-attn-3 (H100, fwd, d128)": {512: 467, 1024: 565, 2048: 625, 4096: 638, 8192: 646, 16384: 648},
}
FA_TOKENS, FA_HEADS, FA_D = 16384, 16, 128


def fit_gpu_check(path: str, q_tile_ratio: float | None) -> dict:
    """Per pass: constants fitted to the H200 pairs (``q_tile_ratio``: the per-query-tile cost tied
    to the tile pair's by that ratio, from a published curve: the H200 runs are all >= 32K tokens
    and cannot show it) and the predicted blockwise / fused ratios against the measured ones."""
    with open(path, encoding="utf-8") as fh:
        speed = json.load(fh)["speed"]
    out = {}
    for phase in ("fwd", "bwd"):
        samples, rows = [], []
        for r in speed:
            seq, heads, cp = r["seq"], r["heads"], r["cp"]
            samples.append((fused_calls(seq), heads, False, r[f"fused_{phase}_s"]))
            samples.append((zigzag_calls(seq, cp), heads, True, r[f"blockwise_{phase}_s"]))
            rows.append((seq, heads, cp, r[f"fused_{phase}_s"], r[f"blockwise_{phase}_s"]))
        free = ("tile_s", "q_tile_s", "merge_s", "launch_s") + (("k_tile_s",) if phase == "bwd" else ())
        fit = fit_tile_costs(samples, free=free, q_tile_ratio=q_tile_ratio, label=f"H200 cuda-flash bf16 d128 {phase}")
        table = []
        for seq, heads, cp, fused, block in rows:
            p_fused = sum(fit.call_time(c, heads, CAUSAL, merged=False) for c in fused_calls(seq))
            p_block = sum(fit.call_time(c, heads, CAUSAL) for c in zigzag_calls(seq, cp))
            measured, predicted = block / fused, p_block / p_fused
            table.append({"seq": seq, "cp": cp, "fused_s": fused, "blockwise_s": block,
                          "predicted_fused_s": p_fused, "predicted_blockwise_s": p_block,
                          "measured_ratio": measured, "predicted_ratio": predicted,
                          "ratio_error": predicted / measured - 1})
        out[phase] = {"constants": {k: getattr(fit, k) for k in ("tile_s", "q_tile_s", "k_tile_s", "merge_s",
                                                                 "launch_s", "partial_cost", "q_tile", "k_tile")},
                      "cells": table,
                      "max_ratio_error": max(abs(c["ratio_error"]) for c in table)}
    return out


def fit_fa_curves() -> dict:
    """Per curve: the tile model's efficiency ``1 / (1 + r * k_tile / n)`` (n keys per query tile,
    no mask) fitted by least squares in relative error over (peak, r), and its largest error."""
    out = {}
    for name, curve in FA_CURVES.items():
        samples = []
        for n, tflops in curve.items():
            flop = 4.0 * FA_TOKENS * n * FA_HEADS * FA_D              # batch x n x n pairs, 4 FLOP each x d
            calls = [Call(n, 0, n, 0)] * (FA_TOKENS // n)
            samples.append((calls, FA_HEADS, False, flop / (tflops * 1e12)))
        fit = fit_tile_costs(samples, mask=FULL, free=("tile_s", "q_tile_s"), partial_costs=(1.0,), label=name)
        r = fit.q_tile_s / fit.tile_s
        peak = 4.0 * 128 * 128 * FA_D / fit.tile_s / 1e12
        cells = []
        for n, tflops in curve.items():
            predicted = peak / (1 + r * 128 / n)
            cells.append({"seq": n, "measured_tflops": tflops, "predicted_tflops": predicted,
                          "error": predicted / tflops - 1})
        out[name] = {"tile_pair_tflops": peak, "q_tile_over_tile": r, "cells": cells,
                     "max_error": max(abs(c["error"]) for c in cells)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-check", default=os.path.join(ROOT, "benchmarks", "results", "gpu_check.json"))
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "tile_fit.json"))
    args = p.parse_args(argv)
    published = fit_fa_curves()
    ratio = published["flash-attn-2 (H100, fwd, d128)"]["q_tile_over_tile"]  # PyTorch's flash SDPA is FA2
    result = {"command": "python benchmarks/fit_tiles.py", "source": os.path.relpath(args.gpu_check, ROOT),
              "q_tile_ratio_from": "flash-attn-2 (H100, fwd, d128)", "q_tile_ratio": ratio,
              "h200": fit_gpu_check(args.gpu_check, ratio), "h200_free_q_tile": fit_gpu_check(args.gpu_check, None),
              "published": published}
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    for phase, res in result["h200"].items():  # the q-tile cost tied to FA2's curve
        print(f"H200 {phase}: " + ", ".join(f"{k}={v:.3g}" for k, v in res["constants"].items()))
        for c in res["cells"]:
            print(f"  {c['seq']:>7} tokens cp {c['cp']}: blockwise/fused measured {c['measured_ratio']:.3f} "
                  f"predicted {c['predicted_ratio']:.3f} ({c['ratio_error']:+.1%})")
    for name, res in result["published"].items():
        print(f"{name}: tile-pair {res['tile_pair_tflops']:.0f} TFLOP/s, q-tile/tile {res['q_tile_over_tile']:.2f}, "
              f"max error {res['max_error']:.1%}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
