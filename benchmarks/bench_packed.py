"""Packed-batch benchmark: place_packed balance, bytes against the need sets, modelled time of FCP vs
Transformer Engine's THD schedules (forward + backward), planning speed.

Writes ``benchmarks/results/packed.json`` (committed) and prints a summary. Pure CPU, no
processes; about a minute on a quiet 2-core machine::

    python benchmarks/bench_packed.py [--out benchmarks/results/packed.json]

Document lengths are seeded lognormal mixes (:func:`megatron_fcp.planning.lognormal_lengths`,
log-mean MEAN, log-sigma SIGMA) of 32K tokens per CP rank; every target is stored with its value
and a ``met`` flag.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fcp.contract.placement import lognormal_lengths, place_packed
from megatron_fcp.planner.compare import compare_packed
from megatron_fcp.cost.model import AttentionShape, simulate_rounds
from megatron_fcp.cost.backward import simulate_plan_backward
from megatron_fcp.cost.te import thd_padded_lengths, thd_rank_work
from megatron_fcp.planner.build import build_plan
from megatron_fcp.cost.backward import simulate_backward_waves  # noqa: E402
from megatron_fcp.topology import load_topology  # noqa: E402

TOKENS_PER_RANK = 32768
MIXES = ((7.0, 1.0), (8.0, 1.2), (8.5, 1.5))  # (log-mean, log-sigma): medians 1.1K, 3.0K, 4.9K tokens
SEED = 0
SHAPE = AttentionShape(1, heads=64, kv_heads=8, head_dim=128, dtype_bytes=2)  # GQA 64:8, bf16
TOPO = {8: "dgx-h100:1", 16: "dgx-h100:2", 64: "dgx-h100:8"}


def _target(value: float, op: str, bound: float) -> dict:
    met = value <= bound if op == "<=" else value >= bound
    return {"value": value, "target": f"{op} {bound}", "met": bool(met)}


def balance() -> list[dict]:
    rows = []
    for mean, sigma in MIXES:
        for cp in (8, 16, 64):
            lengths = lognormal_lengths(mean, sigma, TOKENS_PER_RANK * cp, SEED)
            pl = place_packed(lengths, cp)
            work = pl.work()
            tok = np.array([s.tokens for _, _, s in pl.block_list()])
            recv = (pl.need_matrix() * tok[None, :]).sum(axis=1)
            te_work = thd_rank_work(lengths, cp)
            rows.append({
                "mix": {"mean": mean, "sigma": sigma, "seed": SEED}, "cp": cp, "documents": len(lengths),
                "longest": max(lengths), "blocks": len(tok),
                "fcp_work_max_over_mean": _target(float(work.max() / work.mean()), "<=", 1.05),
                "fcp_recv_max_over_mean": _target(float(recv.max() / recv.mean()) if recv.mean() else 1.0, "<=", 1.10),
                "fcp_recv_tokens_max": int(recv.max()), "fcp_recv_tokens_mean": float(recv.mean()),
                "fcp_recv_tokens_total_over_tokens": float(recv.sum() / sum(lengths)),
                "te_thd_padding_overhead": float(thd_padded_lengths(lengths, cp).sum() / sum(lengths) - 1),
                "te_thd_work_max_over_mean": float(te_work.max() / te_work.mean()),
                "te_thd_recv_max_over_mean": 1.0,  # the ring brings every rank all other KV
            })
    return rows


def _compare(topo: str, ranks, lengths, objective: str = "total", graph: str = "auto") -> dict:
    return compare_packed(topo, ranks, lengths, SHAPE, objective=objective, graph=graph)


def bytes_section() -> list[dict]:
    rows = []
    for mean, sigma in MIXES:
        for cp in (16, 64):
            lengths = lognormal_lengths(mean, sigma, TOKENS_PER_RANK * cp, SEED)
            # objective comm: with compute hiding communication, "total" ties and may keep a plan
            # with relays (hierarchical); the least-communication plan is the bytes question
            s = _compare(TOPO[cp], list(range(cp)), lengths, "comm")["schedules"]
            f = s["fcp"]
            e = _compare(TOPO[cp], list(range(cp)), lengths, "comm", "entry")["schedules"]["fcp"]
            rows.append({
                "entry_bytes_over_need": e["bytes_over_exact"], "entry_inter_node_over_node_need":
                    e["inter_node_over_need"], "entry_fwd_comm_s": e["comm_s"], "auto_fwd_comm_s": f["comm_s"],
                "mix": {"mean": mean, "sigma": sigma, "seed": SEED}, "cp": cp, "topology": TOPO[cp],
                "fcp_graph": f["graph"],
                "fcp_bytes_over_need": _target(f["bytes_over_exact"], "<=", 1.02),
                "fcp_inter_node_over_node_need": _target(f["inter_node_over_need"], "<=", 1.02),
                "fcp_bytes_over_te_p2p_thd": _target(f["bytes"] / s["te-p2p"]["bytes"], "<=", 0.5),
            })
    return rows


def _time_row(name: str, topo: str, ranks, lengths, targets: dict) -> dict:
    out = _compare(topo, ranks, lengths)
    s = out["schedules"]
    row = {"case": name, "topology": topo, "cp": len(ranks), "documents": len(lengths), "tokens": sum(lengths),
           "fcp_graph": s["fcp"]["graph"], "schedules": {}}
    for k, d in s.items():
        if "error" in d:
            row["schedules"][k] = {"error": d["error"]}
            continue
        fb = d["fwd_bwd"]
        row["schedules"][k] = {
            "fwd_total_s": d["fwd"]["total_s"], "bwd_total_s": d["bwd"]["total_s"], "fwd_bwd_total_s": fb["total_s"],
            "fwd_bwd_comm_s": fb["comm_s"], "fwd_bwd_compute_s": fb["compute_s"],
            "compute_over_comm": fb["compute_s"] / fb["comm_s"] if fb["comm_s"] else None,
            "bytes": fb["bytes"],
        }
    fcp = s["fcp"]["fwd_bwd"]["total_s"]
    for base, bound in targets.items():
        if base in s and "error" not in s[base]:
            row[f"speedup_vs_{base}"] = _target(s[base]["fwd_bwd"]["total_s"] / fcp, ">=", bound)
            # FCP's total is never below its compute: the most any model of FCP could reach
            row[f"ceiling_vs_{base}"] = s[base]["fwd_bwd"]["total_s"] / s["fcp"]["fwd_bwd"]["compute_s"]
    # what runs: the executor's backward wave by wave (Note [Backward waves]; keep or resend as the
    # plugin's default ``auto`` decides), priced by following every rank (Note [Wave pipeline timeline])
    waves = simulate_backward_waves(out["plan"], topo, SHAPE, backward_kv="auto")
    run = s["fcp"]["fwd"]["total_s"] + waves["bwd_s"]
    kept = f", first wave kept on {waves['first_kept_ranks']} of {len(ranks)} ranks" if waves["first_kept_ranks"] \
        else ""
    row["fcp_as_run"] = {"backward": f"waves ({waves['waves']}, {waves['backward_kv']}{kept})",
                         "bwd_total_s": waves["bwd_s"],
                         "fwd_bwd_total_s": run, **{f"speedup_vs_{b}": _target(s[b]["fwd_bwd"]["total_s"] / run, ">=", bound)
                                                   for b, bound in targets.items() if b in s and "error" not in s[b]}}
    # what-if: an executor that sends each dK/dV partial as soon as it is complete (not what runs)
    eager = simulate_plan_backward(out["plan"], topo, SHAPE, order="eager").total_s + s["fcp"]["fwd"]["total_s"]
    row["fcp_eager_backward_what_if"] = {"fwd_bwd_total_s": eager, **{
        f"speedup_vs_{b}": s[b]["fwd_bwd"]["total_s"] / eager for b in targets if b in s and "error" not in s[b]}}
    row["reshuffle"] = reshuffle(topo, ranks, lengths, out["placement"], s["fcp"])
    return row


def reshuffle(topo: str, ranks, lengths, pl, fcp: dict) -> dict:
    """Issue 8 item 6: keep TE's THD layout in Megatron and reshuffle at the attention boundary.

    TE's layout: document d padded to P_d (a multiple of 2*cp), cut in 2*cp chunks of l_d = P_d/(2cp);
    CP rank r holds chunks r and 2cp-1-r. FCP computes on its placement, so every token whose TE
    owner differs from its placement owner moves, every layer: q, k, v in and o out (forward), dO in
    and dq, dk, dv out (backward), each an exposed all-to-all (one round each) on the topology."""
    cp = len(ranks)
    cp_of = np.zeros((cp, cp))                        # [TE owner, placement owner] tokens
    P = thd_padded_lengths(lengths, cp)
    for owner, rank_blocks in enumerate(pl.blocks):
        for sp in rank_blocks:
            l = int(P[sp.doc]) // (2 * cp)
            c = np.arange(sp.start // l, (sp.end - 1) // l + 1)
            toks = np.minimum((c + 1) * l, sp.end) - np.maximum(c * l, sp.start)
            te = np.where(c < cp, c, 2 * cp - 1 - c)
            np.add.at(cp_of, (te, owner), toks)
    moved = cp_of.sum() - np.trace(cp_of)
    q, kv = SHAPE.q_bytes(1), SHAPE.kv_bytes(1)     # q (= o, dO, dq) and k+v (= dk+dv) bytes per token
    pairs = [(a, b) for a in range(cp) for b in range(cp) if a != b and cp_of[a, b]]
    to_pl = lambda per_tok: [(ranks[a], ranks[b], cp_of[a, b] * per_tok) for a, b in pairs]  # noqa: E731
    to_te = lambda per_tok: [(ranks[b], ranks[a], cp_of[a, b] * per_tok) for a, b in pairs]  # noqa: E731
    rounds = [to_pl(q + kv), to_te(q), to_pl(q), to_te(q + kv)]  # fwd: qkv in, o out; bwd: dO in, dq dk dv out
    sim = simulate_rounds(load_topology(topo), rounds, name="reshuffle")
    fcp_bytes = fcp["fwd_bwd"]["bytes"]
    return {"moved_tokens_over_tokens": float(moved / sum(lengths)), "bytes_per_layer": sim.bytes,
            "fcp_kv_bytes_per_layer": fcp_bytes, "bytes_over_fcp_kv_bytes": sim.bytes / fcp_bytes if fcp_bytes else None,
            "time_s": sim.comm_s, "time_over_fcp_fwd_bwd_total": sim.comm_s / fcp["fwd_bwd"]["total_s"],
            "inter_node_bytes": sim.inter_node_bytes}


def modelled_time() -> list[dict]:
    mean, sigma = 8.0, 1.2
    rows = []
    lengths = lognormal_lengths(mean, sigma, TOKENS_PER_RANK * 64, SEED)
    rows.append(_time_row("cp=64 on dgx-h100:8", "dgx-h100:8", list(range(64)), lengths,
                          {"te-p2p": 3.0, "te-a2a-p2p": 1.0}))
    lengths = lognormal_lengths(mean, sigma, TOKENS_PER_RANK * 8, SEED)
    rows.append(_time_row("cp=8, one rank per node (TP=8 fills each node), dgx-h100:8", "dgx-h100:8",
                          list(range(0, 64, 8)), lengths, {"te-p2p": 3.0}))
    lengths = lognormal_lengths(mean, sigma, TOKENS_PER_RANK * 16, SEED)
    rows.append(_time_row("cp=16 on dgx-h100:2", "dgx-h100:2", list(range(16)), lengths, {}))
    for r in rows:
        r["mix"] = {"mean": mean, "sigma": sigma, "seed": SEED}
    return rows


def one_rank_per_node_arithmetic() -> list[dict]:
    """cp=8, one CP rank per node: TE's ring moves each rank's whole KV over one NIC per step, and
    FCP's total is never below its compute, so te-p2p total / FCP compute bounds the speedup."""
    rows = []
    topo = load_topology("dgx-h100:8")
    nic = topo.gpu_ingress_bandwidth(0)
    for mean, sigma in MIXES:
        lengths = lognormal_lengths(mean, sigma, TOKENS_PER_RANK * 8, SEED)
        s = _compare("dgx-h100:8", list(range(0, 64, 8)), lengths)["schedules"]
        te, f = s["te-p2p"]["fwd_bwd"], s["fcp"]["fwd_bwd"]
        kv_rank = SHAPE.kv_bytes(float(thd_padded_lengths(lengths, 8).sum()) / 8)
        rows.append({"mix": {"mean": mean, "sigma": sigma, "seed": SEED}, "nic_bytes_per_s": nic,
                     "te_kv_bytes_per_rank": kv_rank, "te_fwd_step_comm_s": kv_rank / nic,
                     "te_fwd_bwd_comm_s": te["comm_s"], "te_fwd_bwd_compute_s": te["compute_s"],
                     "te_fwd_bwd_total_s": te["total_s"], "fcp_fwd_bwd_compute_s": f["compute_s"],
                     "fcp_fwd_bwd_total_s": f["total_s"], "speedup": te["total_s"] / f["total_s"],
                     "ceiling": te["total_s"] / f["compute_s"],
                     "target_3x_possible": bool(te["total_s"] / f["compute_s"] >= 3.0)})
    return rows


def planning_speed() -> list[dict]:
    rows = []
    for cp, docs, bound in ((64, 512, 0.1), (256, 2048, 1.0)):
        rng = np.random.default_rng(1)
        lengths = np.maximum(1, rng.lognormal(8.0, 1.2, docs).astype(int)).tolist()
        topo = f"dgx-h100:{cp // 8}"
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            pl = place_packed(lengths, cp)
            t1 = time.perf_counter()
            plan = build_plan(topo, range(cp), "entry", placement=pl)  # compiles and verifies
            t2 = time.perf_counter()
            times.append((t2 - t0, t1 - t0, t2 - t1))
        best = min(t[0] for t in times)
        rows.append({"cp": cp, "documents": docs, "tokens": sum(lengths), "graph": "entry",
                     "transfers": plan.num_transfers(), "best_s": _target(best, "<=", bound),
                     "median_s": statistics.median(t[0] for t in times),
                     "place_s_best": min(t[1] for t in times), "plan_and_verify_s_best": min(t[2] for t in times)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "packed.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = {"shape": {"heads": SHAPE.heads, "kv_heads": SHAPE.kv_heads, "head_dim": SHAPE.head_dim,
                     "dtype_bytes": SHAPE.dtype_bytes, "causal": True},
           "tokens_per_rank": TOKENS_PER_RANK, "block_tokens": 4096, "tflops": 400}
    for name, fn in (("balance", balance), ("bytes", bytes_section), ("modelled_time", modelled_time),
                     ("one_rank_per_node", one_rank_per_node_arithmetic), ("planning_speed", planning_speed)):
        t = time.perf_counter()
        res[name] = fn()
        print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
    res["wall_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    _summary(res)
    print(f"wrote {args.out}")


def _fmt(t: dict) -> str:
    return f"{t['value']:.3f} ({'met' if t['met'] else 'NOT met'}, {t['target']})"


def _summary(res: dict) -> None:
    for r in res["balance"]:
        print(f"balance {r['mix']['mean']},{r['mix']['sigma']} cp={r['cp']}: work {_fmt(r['fcp_work_max_over_mean'])}, "
              f"recv {_fmt(r['fcp_recv_max_over_mean'])}; TE pad +{r['te_thd_padding_overhead'] * 100:.2f}% work "
              f"{r['te_thd_work_max_over_mean']:.3f}")
    for r in res["bytes"]:
        print(f"bytes {r['mix']['mean']},{r['mix']['sigma']} cp={r['cp']} {r['fcp_graph']}: need "
              f"{_fmt(r['fcp_bytes_over_need'])}, inter {_fmt(r['fcp_inter_node_over_node_need'])}, vs TE "
              f"{_fmt(r['fcp_bytes_over_te_p2p_thd'])}; entry: need {r['entry_bytes_over_need']:.3f}, comm "
              f"{r['entry_fwd_comm_s'] * 1e3:.2f} vs auto {r['auto_fwd_comm_s'] * 1e3:.2f} ms")
    for r in res["modelled_time"]:
        s = r["schedules"]
        print(f"time {r['case']}: " + "; ".join(
            f"{k} {v['fwd_bwd_total_s'] * 1e3:.1f} ms (compute/comm {v['compute_over_comm']:.2f})"
            for k, v in s.items() if "error" not in v) + "; " + ", ".join(
            f"{k} {_fmt(v)}" for k, v in r.items() if k.startswith("speedup")))
        a = r["fcp_as_run"]
        print(f"  as run ({a['backward']}): fcp {a['fwd_bwd_total_s'] * 1e3:.1f} ms; " + ", ".join(
            f"{k} {_fmt(v)}" for k, v in a.items() if k.startswith("speedup")))
        e, x = r["fcp_eager_backward_what_if"], r["reshuffle"]
        print(f"  eager-backward what-if {e['fwd_bwd_total_s'] * 1e3:.1f} ms; THD reshuffle "
              f"{x['bytes_over_fcp_kv_bytes']:.2f}x FCP's KV bytes, {x['time_s'] * 1e3:.1f} ms "
              f"({x['time_over_fcp_fwd_bwd_total']:.2f}x FCP's fwd+bwd), moves {x['moved_tokens_over_tokens']:.2f} of tokens")
    for r in res["one_rank_per_node"]:
        print(f"cp=8/node {r['mix']['mean']},{r['mix']['sigma']}: TE comm {r['te_fwd_bwd_comm_s'] * 1e3:.1f} compute "
              f"{r['te_fwd_bwd_compute_s'] * 1e3:.1f} total {r['te_fwd_bwd_total_s'] * 1e3:.1f}; FCP compute "
              f"{r['fcp_fwd_bwd_compute_s'] * 1e3:.1f} total {r['fcp_fwd_bwd_total_s'] * 1e3:.1f}; speedup "
              f"{r['speedup']:.2f}x, ceiling {r['ceiling']:.2f}x")
    for r in res["planning_speed"]:
        print(f"speed cp={r['cp']} docs={r['documents']}: best {_fmt(r['best_s'])}, median {r['median_s']:.3f} s")


if __name__ == "__main__":
    main()
