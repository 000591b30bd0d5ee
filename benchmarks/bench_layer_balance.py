"""The layer's balance on packed batches (Note [Layer work] in :mod:`megatron_fcp.contract.placement`):
the attention work FCP's placement balances, against the tokens that the layer's projections and
MLP run on, which follow the same placement.

Writes ``benchmarks/results/layer_balance.json`` (committed) and prints one line a cell. Pure CPU,
no cost model (counts only), about 30 s::

    python benchmarks/bench_layer_balance.py [--out benchmarks/results/layer_balance.json]

Grid: the packed grid of ``bench_packed_scale.py`` (lognormal mixes, medians 2K, 8K, 32K, 1M tokens,
cp = 16, 64, 256 on dgx-h100:2, :8, :32) for two models: Llama-3-70B-like (GQA 64:8, hidden 8192,
ffn 28672, SwiGLU) and an 8B-like one (GQA 32:4, hidden 4096, ffn 14336, SwiGLU), tensor parallel 1.
``lam`` = :func:`~megatron_fcp.cost.model.layer_pairs_per_token`: a token's linear layers in
attention pairs. Per placement, max over mean across ranks of

* ``attention``: attention pairs (what ``place_packed`` balances by default);
* ``tokens``: tokens (the projections' and MLP's work);
* ``layer_sum``: pairs + lam x tokens, the layer's work where no rank waits for another;
* ``layer_phases``: (max pairs + lam x max tokens) over (mean pairs + lam x mean tokens), the layer
  where ranks wait for each other at every attention (they exchange KV there).

Placements: FCP degree 1 (``place_batch``) and FCP's head-parallel member placement at a = 8
(``place_batch_groups``; a member's attention is its group's over 8 head shards), each balancing
the layer (``balance="layer"``, the default: Note [Layer-balanced placement]), the attention alone
(``balance="attention"``) and the attention with ``token_weight`` lam (their weighted sum); and
TE's THD layout (every document in 2 cp chunks, tokens and pairs even up to padding).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fcp.contract.head_parallel import head_groups_for  # noqa: E402
from megatron_fcp.contract.placement import Placement, lognormal_lengths  # noqa: E402
from megatron_fcp.cost.model import AttentionShape, layer_pairs_per_token  # noqa: E402
from megatron_fcp.cost.te import thd_padded_lengths, thd_rank_work  # noqa: E402
from megatron_fcp.planner.placing import place_batch, place_batch_groups  # noqa: E402
from megatron_fcp.topology import load_topology  # noqa: E402

MEDIANS = (2048, 8192, 32768)
CPS = {16: "dgx-h100:2", 64: "dgx-h100:8", 256: "dgx-h100:32"}
MODELS = {"llama70b-like": (AttentionShape(1, 64, 8, 128), 8192, 28672),
          "llama8b-like": (AttentionShape(1, 32, 4, 128), 4096, 14336)}
DEGREE = 8


def ratios(pairs: np.ndarray, tokens: np.ndarray, lam: float) -> dict:
    """max/mean of attention, tokens, their lam-weighted sum, and the phases' sum of maxima."""
    pairs, tokens = np.asarray(pairs, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    layer = pairs + lam * tokens
    return {"attention": float(pairs.max() / pairs.mean()), "tokens": float(tokens.max() / tokens.mean()),
            "layer_sum": float(layer.max() / layer.mean()),
            "layer_phases": float((pairs.max() + lam * tokens.max()) / (pairs.mean() + lam * tokens.mean()))}


def of_placement(pl: Placement) -> tuple[np.ndarray, np.ndarray]:
    return pl.work(), np.array([pl.tokens(i) for i in range(pl.cp)])


def cell(model: str, median: int, cp: int) -> dict:
    shape, hidden, ffn = MODELS[model]
    lam = layer_pairs_per_token(shape, hidden, ffn, gated=True)
    topo = load_topology(CPS[cp])
    lengths = lognormal_lengths(math.log(median), 1.0, 1 << 20, 0)
    ranks = tuple(range(cp))
    groups = head_groups_for(topo, ranks, DEGREE)
    row = {"model": model, "median": median, "cp": cp, "topology": CPS[cp], "documents": len(lengths),
           "lam_pairs_per_token": lam}
    te_tokens = thd_padded_lengths(lengths, cp).sum() / cp  # every rank the same padded share
    row["te_thd"] = ratios(thd_rank_work(lengths, cp), np.full(cp, te_tokens), lam)
    for key, kw in (("layer", {"balance": "layer"}), ("attention", {"balance": "attention"}),
                    ("token_weight_lam", {"balance": "attention", "token_weight": lam})):
        row[f"fcp_a1_{key}"] = ratios(*of_placement(place_batch(topo, ranks, lengths, **kw)), lam)
        gp, mp = place_batch_groups(topo, ranks, groups, lengths, **kw)
        g_pairs, _ = of_placement(gp)
        member_pairs = np.array([g_pairs[g] / DEGREE for g, grp in enumerate(groups) for _ in grp])
        member_tokens = np.array([mp.tokens(ranks.index(r)) for grp in groups for r in grp])
        row[f"fcp_a{DEGREE}_{key}"] = ratios(member_pairs, member_tokens, lam)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "layer_balance.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    grid = []
    for model in MODELS:
        for cp in CPS:
            for median in MEDIANS:
                r = cell(model, median, cp)
                grid.append(r)
                print(f"{model} cp={cp} median {median}: lam {r['lam_pairs_per_token']:.0f}; "
                      + "; ".join(f"{k} tok {r[k]['tokens']:.2f} attn {r[k]['attention']:.2f} "
                                  f"phases {r[k]['layer_phases']:.2f}"
                                  for k in ("te_thd", "fcp_a1_layer", "fcp_a1_attention", "fcp_a1_token_weight_lam",
                                            f"fcp_a{DEGREE}_layer", f"fcp_a{DEGREE}_attention")), flush=True)
    keys = [k for k in grid[0] if k.startswith(("te_", "fcp_"))]
    summary = {k: {m: [min(r[k][m] for r in grid), max(r[k][m] for r in grid)]
                   for m in ("attention", "tokens", "layer_sum", "layer_phases")} for k in keys}
    res = {"command": "python benchmarks/bench_layer_balance.py", "date": time.strftime("%Y-%m-%d", time.gmtime()),
           "grid": grid, "summary_min_max": summary, "wall_s": time.perf_counter() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
