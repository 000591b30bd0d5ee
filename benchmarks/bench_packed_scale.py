"""Packed batches at scale (issue 28 items 4 and 6): the plugin's packed plan against Transformer
Engine's faster THD schedule, its communication against the need-set bound, the busiest receiver
against the placement lower bound (Note [Busiest receiver lower bound] in
:mod:`megatron_fcp.contract.placement`), and per-batch planning time.

Writes ``benchmarks/results/packed_scale.json`` (committed) and prints a summary. Pure CPU, cost
model only (TE as priced by :mod:`megatron_fcp.cost.te` at the time of the run)::

    python benchmarks/bench_packed_scale.py [--out benchmarks/results/packed_scale.json] [--quick] [--planning-repeats N]
    python benchmarks/bench_packed_scale.py --planning-only [--planning-repeats N]

``--planning-only`` re-measures the per-batch planning rows alone and writes them into the existing
JSON (``planning_speed``, with its own ``planning_command`` and ``planning_date``), leaving the grid
as its own run measured it: planning changes that leave every plan and price the same (checked)
need no 15-minute grid run.

Grid: lognormal mixes (log-sigma 1.0, medians 2K, 8K, 32K tokens, seed 0) of 1M tokens per batch,
cp = 16, 64, 256 on dgx-h100:2, :8, :32 (all ranks of the cluster), GQA 64:8 and 32:4, head size
128, bf16, causal, forward + one-pass backward (``compare_packed``) and, as the executor runs it,
forward + backward in waves (``simulate_backward_waves``, ``backward_kv="auto"``), of ``a = 1`` over
the runtime's placement (``place_batch``: node-aware, layer-balanced). ``plugin``: the plugin's
default, ``--fcp-head-parallel auto --fcp-packed-balance layer --fcp-packed-layout auto``: the degree and
layout ``choose_packed_plan`` picks for the batch (priced as the executor runs it, as the runtime
picks it; TE's layout on TE's ring where TE's schedule beats FCP's plans, Note [TE's layout as a
candidate]) and that plan's forward + backward (``PackedAsRun``), with its forward's communication
against its own placement's need-set bound (``packed_lower_bound_all`` at its degree, forward
pass: for a > 1 the two all-to-alls and the KV stage); ``plugin_attention_balance`` the
same with ``--fcp-packed-balance attention``. Each also prices the *layer* (Note [Layer work]): the
attention plus the busiest rank's projections and MLP (``LINEAR`` dimensions, GEMMs at
``LINEAR_FLOPS``, forward + backward = 3x the forward), against TE's attention plus its even share of the padded batch
(THD pads every document to a multiple of ``2 * cp``).
The summary's ``plugin_*`` rows are the issue's yardstick.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fcp.contract.head_parallel import head_parallel_degrees  # noqa: E402
from megatron_fcp.contract.placement import lognormal_lengths, thd_padded_lengths  # noqa: E402
from megatron_fcp.cost.head_parallel_packed import PackedAsRun  # noqa: E402
from megatron_fcp.cost.backward import simulate_backward_waves  # noqa: E402
from megatron_fcp.cost.model import AttentionShape, layer_pairs_per_token  # noqa: E402
from megatron_fcp.planner.build import build_plan  # noqa: E402
from megatron_fcp.planner.compare import compare_packed, packed_lower_bound_all  # noqa: E402
from megatron_fcp.planner.packed_choice import choose_packed_plan  # noqa: E402
from megatron_fcp.planner.placing import PACKED_BALANCE, place_batch  # noqa: E402
from megatron_fcp.schedule.program import compile_backward  # noqa: E402
from megatron_fcp.topology import load_topology  # noqa: E402

MEDIANS = (2048, 8192, 32768)
SIGMA = 1.0
TOKENS = 1 << 20
SEED = 0
CPS = {16: "dgx-h100:2", 64: "dgx-h100:8", 256: "dgx-h100:32"}
GQA = ((64, 8), (32, 4))
TE = ("te-p2p", "te-a2a-p2p")
# linear layers of the layer rows: Llama-3-70B-like for 64:8, 8B-like for 32:4 (SwiGLU), TP 1
LINEAR = {(64, 8): (8192, 28672), (32, 4): (4096, 14336)}
TIE = 1e-9
"""A ratio within this of 1.0 is a tie, not a cell below 1: where the plugin runs TE's own layout
and ring (Note [TE's layout as a candidate]) the two prices are the same schedule summed in a
different order (0.9999999999999997 at cp = 16, median 32K, 64:8)."""
LINEAR_FLOPS = 600e12
"""Sustained dense BF16 GEMM FLOP/s of the layer rows (about 60% of an H100's peak)."""


def _fcp_row(out: dict) -> dict:
    f = out["schedules"]["fcp"]
    fwd = f["fwd"]
    keys = ("recv_max_bytes", "recv_bound_bytes", "recv_max_over_bound", "node_recv_max_bytes",
            "node_recv_bound_bytes", "node_recv_max_over_bound", "work_max_over_mean", "recv_max_over_mean",
            "bytes_over_exact", "inter_node_over_need")
    return {"graph": f["graph"], "fwd_bwd_total_s": f["fwd_bwd"]["total_s"],
            "fwd_bwd_compute_s": f["fwd_bwd"]["compute_s"], "fwd_bwd_comm_s": f["fwd_bwd"]["comm_s"],
            "fwd_total_s": fwd["total_s"], "fwd_compute_s": fwd["compute_s"], "fwd_comm_s": fwd["comm_s"],
            # where the overlapped forward sits between max(compute, comm) (1.0) and their sum
            "fwd_total_over_max": fwd["total_s"] / max(fwd["compute_s"], fwd["comm_s"]),
            "fwd_total_over_sum": fwd["total_s"] / (fwd["compute_s"] + fwd["comm_s"]),
            "fwd_comm_over_need_bound": f["comm_vs_lower_bound"], "need_bound_s": out["lower_bound_s"],
            **{k: f[k] for k in keys}}


def cell(median: int, cp: int, heads: int, kv_heads: int) -> dict:
    topo = CPS[cp]
    lengths = lognormal_lengths(math.log(median), SIGMA, TOKENS, SEED)
    shape = AttentionShape(1, heads=heads, kv_heads=kv_heads, head_dim=128, dtype_bytes=2)
    row = {"median": median, "sigma": SIGMA, "seed": SEED, "tokens": TOKENS, "documents": len(lengths),
           "longest": max(lengths), "cp": cp, "topology": topo, "heads": heads, "kv_heads": kv_heads}
    out = compare_packed(topo, None, lengths, shape)
    s = out["schedules"]
    row["te"] = {k: ({"fwd_bwd_total_s": s[k]["fwd_bwd"]["total_s"], "fwd_bwd_comm_s": s[k]["fwd_bwd"]["comm_s"],
                      "fwd_bwd_compute_s": s[k]["fwd_bwd"]["compute_s"]} if "error" not in s[k] else s[k])
                 for k in TE if k in s}
    best = min((k for k in TE if k in s and "error" not in s[k]), key=lambda k: s[k]["fwd_bwd"]["total_s"])
    row["fcp"] = _fcp_row(out)
    row["best_te"] = best
    row["speedup_vs_best_te"] = s[best]["fwd_bwd"]["total_s"] / row["fcp"]["fwd_bwd_total_s"]
    # as the executor runs the backward: in waves, keep or re-send as --fcp-backward-kv auto decides
    waves = simulate_backward_waves(out["plan"], topo, shape, backward_kv="auto")
    run = row["fcp"]["fwd_total_s"] + waves["bwd_s"]
    row["fcp_as_run"] = {"backward": f"{waves['waves']} waves, {waves['backward_kv']}", "bwd_s": waves["bwd_s"],
                         "fwd_bwd_total_s": run, "speedup_vs_best_te": s[best]["fwd_bwd"]["total_s"] / run}
    te_s = s[best]["fwd_bwd"]["total_s"]
    # the plugin's default (--fcp-head-parallel auto, --fcp-packed-balance layer): each packed batch's
    # degree, chosen as the runtime chooses it (priced as run: backward in waves), and the same with
    # --fcp-packed-balance attention
    for key, balance in (("plugin", PACKED_BALANCE), ("plugin_attention_balance", "attention")):
        plans: dict = {}
        choice, priced = choose_packed_plan(topo, range(cp), lengths, shape, graph="auto", plans=plans,
                                            placement_balance=balance)
        degree, chosen = choice.degree, plans[choice]
        as_run = PackedAsRun(chosen, topo, shape)
        run_d = as_run.result()
        # its forward's communication against its own placement's need-set bound (degree a > 1:
        # the forward's two all-to-alls and its KV stage; Note [Packed lower bound over degrees])
        need_s = packed_lower_bound_all({degree: chosen}, topo, shape, pass_="fwd")["lower_bound_s"]
        pl = chosen.placement
        tokens = np.array([pl.tokens(i) for i in range(cp)], dtype=np.float64)
        # priced_s: the choices simulated, "degree-layout" (Note [Pruning the packed degree choice],
        # Note [TE's layout as a candidate])
        row[key] = {"balance": balance, "degree": degree, "layout": choice.layout,
                    "priced_s": {f"{c.degree}-{c.layout}": t for c, t in priced.items()},
                    "graph": chosen.name if degree == 1 else chosen.kv_plan.name if chosen.kv_plan else "none",
                    # the graph its backward walks where not the forward's (Note [A backward on another graph])
                    "backward_graph": chosen.backward.name if degree == 1 and chosen.backward is not None else None,
                    "fwd_s": run_d["fwd_s"], "bwd_s": run_d["bwd_s"], "fwd_bwd_total_s": run_d["total_s"],
                    "backward": f"{run_d['waves']} waves, {run_d['backward_kv']}",
                    "fwd_comm_s": as_run.forward.comm_s, "need_bound_s": need_s,
                    "fwd_comm_over_need_bound": as_run.forward.comm_s / need_s if need_s else None,
                    "tokens_max_over_mean": float(tokens.max() / tokens.mean()),
                    "speedup_vs_best_te": te_s / run_d["total_s"],
                    **_layer(shape, tokens.max(), run_d["total_s"], te_s, _te_tokens(lengths, cp))}
    return row


def _te_tokens(lengths: list[int], cp: int) -> float:
    """Tokens on each of TE's CP ranks under THD: the batch with every document padded to a multiple
    of ``2 * cp`` (``cu_seqlens_padded``), split evenly; the padding runs through every layer. (Before
    2026-12-07 the real tokens over cp: up to 1% less, which put the plugin running TE's own layout
    at 0.997x TE's layer.)"""
    return float(thd_padded_lengths(lengths, cp).sum()) / cp


def _layer(shape: AttentionShape, tokens_max: float, attention_s: float, te_attention_s: float,
           te_tokens: float) -> dict:
    """A layer's forward + backward where ranks meet at the attention (Note [Layer work]): the
    busiest rank's projections and MLP (``LINEAR`` dimensions, GEMMs at ``LINEAR_FLOPS``), plus the
    attention; TE's ranks all hold ``te_tokens`` (:func:`_te_tokens`)."""
    hidden, ffn = LINEAR[(shape.heads, shape.kv_heads)]
    per_token_s = 3 * layer_pairs_per_token(shape, hidden, ffn, gated=True) * shape.pair_flops / LINEAR_FLOPS
    fcp = tokens_max * per_token_s + attention_s
    te = te_tokens * per_token_s + te_attention_s
    return {"layer_linear_s": float(tokens_max * per_token_s), "layer_total_s": float(fcp),
            "te_layer_total_s": float(te), "layer_speedup_vs_best_te": float(te / fcp)}


def planning_speed(repeats: int = 3) -> list[dict]:
    """Per-batch planning as the runtime does it: place_packed, build_plan (graph auto, the default;
    and entry alone), the backward program (compile_backward); and, a row of its own, the degree
    choice that ``--fcp-head-parallel auto`` makes before them; best of ``repeats``. The topology
    is loaded once per row, as the runtime loads it once at setup."""
    rows = []
    shape = AttentionShape(1, heads=64, kv_heads=8, head_dim=128, dtype_bytes=2)
    for cp, docs, bound in ((64, 512, 0.1), (256, 512, 0.5), (256, 2048, 0.5)):
        rng = np.random.default_rng(1)
        lengths = np.maximum(1, rng.lognormal(8.0, 1.2, docs).astype(int)).tolist()
        # one Topology for every batch, as the runtime holds one from setup (FCPRuntime.topology):
        # its routes are worked out once, not per batch (before 2026-12-06 a preset string per call
        # rebuilt them every time: 0.1-0.2 s of cp = 256's plan)
        topo = load_topology(f"dgx-h100:{cp // 8}")
        for graph in ("auto", "entry"):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                pl = place_batch(topo, range(cp), lengths)
                t1 = time.perf_counter()
                plan = build_plan(topo, range(cp), graph, placement=pl, heads=64, kv_heads=8, head_dim=128)
                t2 = time.perf_counter()
                compile_backward(plan, shape.kv_bytes(1))
                t3 = time.perf_counter()
                times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
            best = min(times)
            rows.append({"cp": cp, "documents": docs, "tokens": sum(lengths), "graph": graph, "chosen": plan.name,
                         "best_s": best[0], "target_s": bound, "met": bool(best[0] <= bound),
                         "median_s": statistics.median(t[0] for t in times),
                         "place_s": best[1], "plan_s": best[2], "backward_program_s": best[3]})
            print(f"speed cp={cp} docs={docs} {graph}->{plan.name}: {best[0]:.3f} s (place {best[1]:.3f}, plan "
                  f"{best[2]:.3f}, program {best[3]:.3f}); target {bound}", flush=True)
        # --fcp-head-parallel auto (the default) also chooses each packed batch's degree and layout
        # first (Note [Head-parallel degree of a packed batch]): every degree's plan built and priced
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            choice, priced = choose_packed_plan(topo, range(cp), lengths, shape, graph="auto")
            times.append(time.perf_counter() - t0)
        # the choices whose backward was simulated (the others' floors ruled them out: Note [Pruning
        # the packed degree choice]; TE's layout only past its gates: Note [TE's layout as a candidate])
        rows.append({"cp": cp, "documents": docs, "tokens": sum(lengths), "graph": "auto", "step": "degree choice",
                     "chosen_degree": choice.degree, "chosen_layout": choice.layout,
                     "degrees": head_parallel_degrees(topo, range(cp), 64, 8),
                     "simulated": [f"{c.degree}-{c.layout}" for c in priced], "best_s": min(times),
                     "median_s": statistics.median(times), "target_s": bound})
        print(f"speed cp={cp} docs={docs} degree choice -> {choice}, simulated {rows[-1]['simulated']}: "
              f"{min(times):.3f} s", flush=True)
    return rows


def _plain(x):
    """numpy scalars as Python numbers (JSON)."""
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def _r(x) -> str:
    return "n/a (bound 0)" if x is None else f"{x:.2f}"


def _geomean(xs: list[float]) -> float:
    return float(np.exp(np.mean(np.log(xs))))


def _ratios(grid: list[dict], key: str) -> list[float]:
    return [r[key]["recv_max_over_bound"] for r in grid if r[key]["recv_max_over_bound"] is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "packed_scale.json"))
    ap.add_argument("--quick", action="store_true", help="cp 16 and 64 only, one GQA (a smoke run)")
    ap.add_argument("--planning-repeats", type=int, default=3, metavar="N",
                    help="per-batch planning: best of N runs (this machine's run-to-run spread is wide)")
    ap.add_argument("--planning-only", action="store_true",
                    help="re-measure the per-batch planning rows alone, into the existing --out JSON")
    args = ap.parse_args()
    if args.planning_repeats < 1:
        ap.error(f"--planning-repeats must be at least 1, got {args.planning_repeats}")
    if args.planning_only:
        if not Path(args.out).exists():
            ap.error(f"--planning-only updates an existing result; {args.out} does not exist (run the grid first)")
        res = json.loads(Path(args.out).read_text())
        res["planning_speed"] = planning_speed(args.planning_repeats)
        res["planning_command"] = ("python benchmarks/bench_packed_scale.py --planning-only"
                                   + (f" --planning-repeats {args.planning_repeats}" if args.planning_repeats != 3 else ""))
        res["planning_date"] = time.strftime("%Y-%m-%d", time.gmtime())
        Path(args.out).write_text(json.dumps(res, indent=1, default=_plain) + "\n")
        print(f"wrote the planning rows of {args.out}")
        return
    t0 = time.perf_counter()
    cps = (16, 64) if args.quick else tuple(CPS)
    gqa = GQA[:1] if args.quick else GQA
    grid = []
    for cp in cps:
        for heads, kv in gqa:
            for median in MEDIANS:
                t = time.perf_counter()
                r = cell(median, cp, heads, kv)
                grid.append(r)
                f, p, q = r["fcp"], r["plugin"], r["plugin_attention_balance"]
                print(f"cp={cp} {heads}:{kv} median {median}: plugin a={p['degree']} {p['layout']} {p['graph']} "
                      f"{p['speedup_vs_best_te']:.3f}x as run ({p['backward']}), comm/need bound "
                      f"{p['fwd_comm_over_need_bound']:.2f}, layer "
                      f"{p['layer_speedup_vs_best_te']:.3f}x, tokens {p['tokens_max_over_mean']:.2f}; attention "
                      f"balance a={q['degree']} {q['speedup_vs_best_te']:.3f}x, layer {q['layer_speedup_vs_best_te']:.3f}x, "
                      f"tokens {q['tokens_max_over_mean']:.2f}; a=1 fcp/{r['best_te']} {r['speedup_vs_best_te']:.3f}x "
                      f"(as run {r['fcp_as_run']['speedup_vs_best_te']:.3f}x); comm/need bound "
                      f"{f['fwd_comm_over_need_bound']:.2f}; busiest/bound {_r(f['recv_max_over_bound'])}, node "
                      f"{_r(f['node_recv_max_over_bound'])}; work {f['work_max_over_mean']:.3f}; fwd total/max "
                      f"{f['fwd_total_over_max']:.3f}  [{time.perf_counter() - t:.1f} s]", flush=True)

    def column(key: str, field: str) -> list[float]:
        return [r[key][field] for r in grid]

    ratios = [r["speedup_vs_best_te"] for r in grid]
    run = [r["fcp_as_run"]["speedup_vs_best_te"] for r in grid]
    summary = {}
    for key in ("plugin", "plugin_attention_balance"):
        att, lay = column(key, "speedup_vs_best_te"), column(key, "layer_speedup_vs_best_te")
        summary.update({f"{key}_speedup_vs_best_te_geomean": _geomean(att), f"{key}_speedup_vs_best_te_min": min(att),
                        f"{key}_cells_below_1": sum(x < 1.0 - TIE for x in att),
                        f"{key}_cells_tied": sum(abs(x - 1.0) <= TIE for x in att),
                        f"{key}_layer_speedup_vs_best_te_geomean": _geomean(lay),
                        f"{key}_layer_speedup_vs_best_te_min": min(lay),
                        f"{key}_layer_cells_below_1": sum(x < 1.0 - TIE for x in lay),
                        f"{key}_tokens_max_over_mean_max": max(column(key, "tokens_max_over_mean")),
                        f"{key}_fwd_comm_over_need_bound_max": max(column(key, "fwd_comm_over_need_bound")),
                        f"{key}_fwd_comm_over_need_bound_min": min(column(key, "fwd_comm_over_need_bound")),
                        f"{key}_degrees": column(key, "degree"), f"{key}_layouts": column(key, "layout")})
    summary.update({"a1_speedup_vs_best_te_geomean": _geomean(ratios), "a1_speedup_vs_best_te_min": min(ratios),
                    "a1_as_run_speedup_vs_best_te_geomean": _geomean(run), "a1_as_run_speedup_vs_best_te_min": min(run),
                    "fwd_comm_over_need_bound_max": max(r["fcp"]["fwd_comm_over_need_bound"] for r in grid),
                    "fwd_comm_over_need_bound_min": min(r["fcp"]["fwd_comm_over_need_bound"] for r in grid),
                    "recv_max_over_bound_max": max(_ratios(grid, "fcp")),
                    "recv_max_over_bound_geomean": _geomean(_ratios(grid, "fcp"))})
    res = {"command": "python benchmarks/bench_packed_scale.py" + (" --quick" if args.quick else "")
           + (f" --planning-repeats {args.planning_repeats}" if args.planning_repeats != 3 else ""),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "head_dim": 128, "dtype_bytes": 2, "causal": True,
           "linear_flops": LINEAR_FLOPS, "linear_dims": {f"{h}:{k}": v for (h, k), v in LINEAR.items()},
           "grid": grid, "summary": summary,
           "planning_speed": planning_speed(args.planning_repeats),
           }
    res["wall_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=_plain) + "\n")
    print(json.dumps(res["summary"], indent=1, default=_plain))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
