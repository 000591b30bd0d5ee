"""The emulated benchmark's JSON entries, its table and its plot. Pure apart from the plot (matplotlib).

One entry of ``runs`` per workload (the issue's keys; seconds, forward + backward):

    workload, available (and reason), median_s, min_s, max_s, times_s (every repeat, in run order),
    comm_s, compute_s (medians of the communication-only and compute-only runs), predicted_s,
    predicted_comm_s, predicted_compute_s (FCP: also predicted_bwd_waves, predicted_resend_s), all on
    the Topology with the link probe's per-message latency, and predicted_nominal_s (without it),
    prediction_error (median / predicted - 1), lower_bound_s, of_lower_bound (median / lower_bound_s),
    of_lower_bound_all_families (median / the bounds' lower_bound_all_families_s; None without it),
    compute_to_comm (predicted compute over predicted communication: the regime),
    speedup_vs_te_p2p, the cluster (nodes, ranks_per_node, nic, intra, inter) and the workload
    (seq, heads, kv_heads, head_dim, causal, doc_lengths) named like the flags, and ``info``
    (graph, rounds, transfers, backward KV mode, auto's candidates).
"""

from __future__ import annotations

import statistics
from typing import Sequence

__all__ = ["assemble", "table", "link_probe_line", "plot", "progress_printer"]


def _stats(xs: Sequence[float]) -> dict:
    if not xs:
        return {"median_s": None, "min_s": None, "max_s": None}
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}


def assemble(cluster, shape, workloads, predictions: dict, bounds: dict, measured: dict, meta: dict) -> dict:
    """The result dict: ``runs`` (module docstring), ``cluster``, ``workload``, bounds, assumptions, times."""
    params = {**{k: v for k, v in cluster.describe().items() if k != "time_scale"}, **shape.describe()}
    runs = []
    for w in workloads:
        t = measured.get("times", {}).get(w.name, {})
        pred = predictions.get(w.name, {})
        e = {"workload": w.name, "available": w.unavailable is None and bool(t.get("overlap"))}
        if w.unavailable:
            e["reason"] = w.unavailable
        e.update(_stats(t.get("overlap", [])))
        e["times_s"] = t.get("overlap", [])
        e["comm_s"] = statistics.median(t["comm"]) if t.get("comm") else None
        e["compute_s"] = statistics.median(t["compute"]) if t.get("compute") else None
        e["comm_times_s"], e["compute_times_s"] = t.get("comm", []), t.get("compute", [])
        e.update({k: v for k, v in pred.items()})
        p = pred.get("predicted_s")
        e["prediction_error"] = e["median_s"] / p - 1 if e["median_s"] and p else None
        e["lower_bound_s"] = bounds["lower_bound_s"]
        e["of_lower_bound"] = e["median_s"] / bounds["lower_bound_s"] if e["median_s"] else None
        fam = bounds.get("lower_bound_all_families_s")
        e["of_lower_bound_all_families"] = e["median_s"] / fam if e["median_s"] and fam else None
        pc, pm = pred.get("predicted_compute_s"), pred.get("predicted_comm_s")
        e["compute_to_comm"] = pc / pm if pc is not None and pm else None
        e["modelled_compute_s"] = measured.get("modelled_compute_s", {}).get(w.name)
        e["info"] = dict(w.info)
        e.update(params)
        runs.append(e)
    te = next((r["median_s"] for r in runs if r["workload"] == "te-p2p" and r["median_s"]), None)
    for r in runs:
        r["speedup_vs_te_p2p"] = te / r["median_s"] if te and r["median_s"] else None
    return {"cluster": cluster.describe(), "workload": shape.describe(), "bounds": bounds, **meta, "runs": runs}


def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(result: dict) -> str:
    """A text table of the runs (seconds, forward + backward)."""
    c, w, b = result["cluster"], result["workload"], result["bounds"]
    docs = w["doc_lengths"]
    head = (f"emulated {c['nodes']} x {c['ranks_per_node']} ranks, {c['nic']} NICs, intra {c['intra']}, inter "
            f"{c['inter']} (time scale {c['time_scale']:.0f}); seq {w['seq']}"
            + (f" in {len(docs)} documents" if docs else "")
            + f", heads {w['heads']}/{w['kv_heads']}, head_dim {w['head_dim']}, "
            f"{'causal' if w['causal'] else 'full'}"
            + (f", window ({w['window'][0]}, {w['window'][1]})" if w.get("window") else "")
            + f"; lower bound {b['lower_bound_s']:.3f} s")
    cols = ("workload", "median", "min-max", "comm", "compute", "predicted", "err", "/LB", "vs te-p2p", "graph")
    rows = [cols]
    for r in result["runs"]:
        graph = r["info"].get("graph", "")
        if not r["available"]:
            rows.append((r["workload"], "n/a", "", "", "", _f(r.get("predicted_s")), "", "", "",
                         (r.get("reason") or "")[:60]))
            continue
        rows.append((r["workload"], _f(r["median_s"]), f"{r['min_s']:.3f}-{r['max_s']:.3f}", _f(r["comm_s"]),
                     _f(r["compute_s"]), _f(r.get("predicted_s")), _f(r["prediction_error"], "{:+.0%}"),
                     _f(r["of_lower_bound"], "{:.2f}"), _f(r["speedup_vs_te_p2p"], "{:.2f}x"), graph))
    width = [max(len(str(row[i])) for row in rows) for i in range(len(cols))]
    lines = [head] + ["  ".join(str(x).ljust(width[i]) for i, x in enumerate(row)).rstrip() for row in rows]
    probe = link_probe_line(result.get("link_probe", []), result.get("latency_fit"))
    return "\n".join(lines + ([probe] if probe else []))


def link_probe_line(probe: Sequence[dict], fit: "dict | None" = None) -> str:
    """One line: each probed link's isolated messages, measured over modelled (Note [Link probe]), and
    the per-message latency fitted from them that ``predicted`` includes (Note [Probe-fitted latency])."""
    by: dict[str, list[str]] = {}
    for e in probe:
        if e.get("ratio") is not None:
            by.setdefault(e["link"], []).append(f"{e['bytes'] // 1024}K {e['ratio']:.2f}x")
    if not by:
        return ""
    line = "links, one message alone, measured / modelled: " + "; ".join(f"{k} {', '.join(v)}" for k, v in by.items())
    if fit:
        line += (f"; fitted latency (in predicted) intra {fit['intra_latency_s'] * 1e3:.2f} ms, "
                 f"inter {fit['inter_latency_s'] * 1e3:.2f} ms")
    return line


def plot(results: "dict | list[dict]", path: str, titles: "Sequence[str] | None" = None) -> None:
    """Bars: measured median (min-max whiskers) per workload and configuration, predicted as a dot,
    the lower bound as a dashed line. ``results``: one result dict or several (one panel each),
    ``titles`` one per panel (default: the cluster and sequence)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [results] if isinstance(results, dict) else list(results)
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4), squeeze=False)
    for i, (ax, res) in enumerate(zip(axes[0], results)):
        runs = [r for r in res["runs"] if r["available"]]
        xs = range(len(runs))
        med = [r["median_s"] for r in runs]
        err = [[m - r["min_s"] for m, r in zip(med, runs)], [r["max_s"] - m for m, r in zip(med, runs)]]
        ax.bar(xs, med, yerr=err, color=["#c44" if r["workload"].startswith("te") else "#48c" for r in runs],
               capsize=3, label="measured (median, min-max)")
        ax.plot(xs, [r.get("predicted_s") for r in runs], "ko", label="cost model")
        ax.axhline(res["bounds"]["lower_bound_s"], ls="--", color="gray", label="lower bound")
        ax.set_xticks(list(xs), [r["workload"] for r in runs], rotation=30, ha="right")
        c = res["cluster"]
        ax.set_title(titles[i] if titles else f"{c['nodes']}x{c['ranks_per_node']} {c['nic']}, seq {res['workload']['seq']}",
                     fontsize=9)
        ax.set_ylabel("forward + backward (s, emulated)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def progress_printer(stream, tty: bool):
    """A callback for ``@progress done total workload mode seconds`` lines: a bar on a terminal,
    one line per run otherwise."""
    def show(line: str) -> None:
        _, done, total, name, mode, secs = line.split()
        done, total = int(done), int(total)
        bar = "#" * (30 * done // total) + "-" * (30 - 30 * done // total)
        text = f"[{bar}] {done}/{total} {name} {mode} {float(secs):.3f}s"
        stream.write(("\r" + text.ljust(90)) if tty else text + "\n")
        if tty and done == total:
            stream.write("\n")
        stream.flush()
    return show
