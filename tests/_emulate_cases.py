"""Rank functions for tests/test_emulate_dist.py (importable: run_gloo spawns processes)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_fcp.attention.kernels import reference_attention
from megatron_fcp.attention.comm import CountingTransport, GlooTransport
from megatron_fcp.emulate.sleep_kernel import SleepKernel
from megatron_fcp.emulate.te_ring import TeLayout, te_p2p_attention


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.double()).abs().max()) if a.numel() else 0.0


def _zigzag_case(rank: int, cp: int, causal: bool, heads=(4, 2), b=2, d=8, s_per_chunk=6) -> dict:
    h, hk = heads
    s = 2 * cp * s_per_chunk
    g = torch.Generator().manual_seed(7 + causal)
    q, k, v, do = (torch.randn(s, b, x, d, generator=g, dtype=torch.float64) for x in (h, hk, hk, h))
    ref = reference_attention(q, k, v, causal=causal, scale=1 / math.sqrt(d), dout=do)
    lay = TeLayout([s], cp)
    idx = torch.from_numpy(lay.token_index(rank))
    ql, kl, vl = (x[idx].clone().requires_grad_(True) for x in (q, k, v))
    tr = CountingTransport(GlooTransport(dist.group.WORLD, 60))
    out, lse = te_p2p_attention(ql, kl, vl, cp_group=dist.group.WORLD, layout=lay, causal=causal, transport=tr)
    out.backward(do[idx])
    kv_bytes = 2 * kl.numel() * kl.element_size()
    sent = {ph: [p.nbytes for p in tr.posted if p.phase == ph and p.kind == "send"]
            for ph in ("te-forward", "te-backward")}
    return {"out": _err(out, ref["out"][idx]), "lse": _err(lse, ref["lse"][..., idx]),
            "dq": _err(ql.grad, ref["dq"][idx]), "dk": _err(kl.grad, ref["dk"][idx]),
            "dv": _err(vl.grad, ref["dv"][idx]), "sent": sent, "kv_bytes": kv_bytes}


def _thd_case(rank: int, cp: int, docs=(5, 13, 8), heads=(2, 1), d=8) -> dict:
    h, hk = heads
    T = sum(docs)
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(T, x, d, generator=g, dtype=torch.float64) for x in (h, hk, hk, h))
    lay = TeLayout(docs, cp)
    idx = torch.from_numpy(lay.token_index(rank))
    real = idx >= 0
    ql, kl, vl, dol = (lay.shard(x, rank).requires_grad_(x is not do) for x in (q, k, v, do))
    out, lse = te_p2p_attention(ql, kl, vl, cp_group=dist.group.WORLD, layout=lay, causal=True)
    out.backward(dol)
    errs = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    start = 0
    for L in docs:  # reference per document
        sl = slice(start, start + L)
        ref = reference_attention(q[sl, None], k[sl, None], v[sl, None], causal=True, scale=1 / math.sqrt(d),
                                  dout=do[sl, None])
        mine = real & (idx >= start) & (idx < start + L)
        rows = idx[mine] - start
        for name, got in (("out", out), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad)):
            errs[name] = max(errs[name], _err(got[mine], ref[name][rows, 0]))
        start += L
    return errs


def _sleep_case(rank: int, cp: int) -> dict:
    """The sleep kernel through TE's ring: right shapes, finite, and the modelled seconds add up."""
    s, b, h, hk, d = 2 * cp * 4, 1, 4, 2, 8
    lay = TeLayout([s], cp)
    kern = SleepKernel(flops=4.0 * b * h * d / 1e-4)  # 1e-4 s per visible (query, key) pair
    x = torch.zeros(lay.tokens_per_rank, b, h, d, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.zeros(lay.tokens_per_rank, b, hk, d, dtype=torch.bfloat16, requires_grad=True)
    out, lse = te_p2p_attention(x, kv, kv, cp_group=dist.group.WORLD, layout=lay, causal=True, kernel=kern)
    fwd_s = kern.modelled_s
    out.sum().backward()
    pairs = s * (s + 1) // 2 // cp  # zigzag: every rank has the same causal work
    return {"shape": tuple(out.shape), "dtype": str(out.dtype), "finite": bool(torch.isfinite(lse).all()),
            "fwd_s": fwd_s, "bwd_s": kern.modelled_s - fwd_s, "expected_fwd_s": pairs * 1e-4,
            "grad_shape": tuple(x.grad.shape)}


def worker(rank: int, world: int) -> dict:
    res = {"zigzag_causal": _zigzag_case(rank, world, True), "zigzag_full": _zigzag_case(rank, world, False),
           "thd": _thd_case(rank, world), "sleep": _sleep_case(rank, world)}
    return res


def worker_job(rank: int, world: int, job: dict) -> dict:
    """The emulator's per-rank loop (megatron_fcp.emulate.worker.run) on plain loopback gloo."""
    from megatron_fcp.emulate.worker import run

    return run(job)


def head_parallel_worker(rank: int, world: int) -> dict:
    """te-a2a-p2p and fcp-hp runners (2 nodes x 2 ranks) in FP64 against single-device attention:
    out and dq/dk/dv through the runner, lse through the engine with the runner's plan and groups."""
    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.head_parallel import fcp_head_parallel_attention_with_lse
    from megatron_fcp.emulate.runners import make_runner
    from megatron_fcp.emulate.spec import ClusterSpec, emulated_topology
    from megatron_fcp.emulate.workloads import WorkloadShape, make_workloads

    topo = emulated_topology(ClusterSpec(2, 2))
    res = {}
    for name, causal in (("te-a2a-p2p", True), ("te-a2a-p2p", False), ("fcp-hp", True)):
        h, hk, d, s = 4, 2, 8, 2 * world * 6
        w = make_workloads([name], WorkloadShape(s, h, hk, d, causal), topo)[0]
        runner = make_runner(w, rank, dist.group.WORLD)                  # creates the head-parallel groups
        g = torch.Generator().manual_seed(3 + causal)
        q, k, v, do = (torch.randn(s, 1, x, d, generator=g, dtype=torch.float64) for x in (h, hk, hk, h))
        ref = reference_attention(q, k, v, causal=causal, scale=1 / math.sqrt(d), dout=do)
        idx = torch.from_numpy(TeLayout([s], world).token_index(rank))  # Megatron's zigzag shard
        runner.q, runner.k, runner.v = (x[idx].clone().requires_grad_(True) for x in (q, k, v))
        out = runner.attention("math", GlooTransport(dist.group.WORLD, 60))
        out.backward(do[idx])
        with torch.no_grad():
            if w.info["head_parallel"] > 1:
                _, lse = fcp_head_parallel_attention_with_lse(runner.q, runner.k, runner.v, cp_group=dist.group.WORLD,
                                                              hp_plan=w.hp_plan, groups=runner.groups, causal=causal,
                                                              kernel="math", agreement=None)
            else:  # fcp-hp at degree 1 runs plain FCP, as the plugin does
                _, lse = fcp_attention_with_lse(runner.q, runner.k, runner.v, cp_group=dist.group.WORLD, plan=w.plan,
                                                causal=causal, kernel="math", agreement=None)
        res[f"{name}-{causal}"] = {
            "degree": w.info["head_parallel"], "out": _err(out, ref["out"][idx]), "lse": _err(lse, ref["lse"][..., idx]),
            "dq": _err(runner.q.grad, ref["dq"][idx]), "dk": _err(runner.k.grad, ref["dk"][idx]),
            "dv": _err(runner.v.grad, ref["dv"][idx])}
    return res


def window_worker(rank: int, world: int) -> dict:
    """te-a2a, fcp-auto and fcp-hp runners under a sliding window (2 nodes x 2 ranks) in FP64 against
    single-device windowed attention: out and dq/dk/dv through the runner."""
    from megatron_fcp.emulate.runners import make_runner
    from megatron_fcp.emulate.spec import ClusterSpec, emulated_topology
    from megatron_fcp.emulate.workloads import WorkloadShape, make_workloads

    topo = emulated_topology(ClusterSpec(2, 2))
    h, hk, d, s, window = 4, 4, 8, 2 * world * 6, (5, 0)  # chunks of 6 tokens: a window into the neighbour's
    res = {}
    for name in ("te-a2a", "fcp-auto", "fcp-hp"):
        w = make_workloads([name], WorkloadShape(s, h, hk, d, True, window=window), topo)[0]
        runner = make_runner(w, rank, dist.group.WORLD)
        g = torch.Generator().manual_seed(5)
        q, k, v, do = (torch.randn(s, 1, x, d, generator=g, dtype=torch.float64) for x in (h, hk, hk, h))
        ref = reference_attention(q, k, v, causal=True, scale=1 / math.sqrt(d), dout=do, window=window)
        idx = torch.from_numpy(TeLayout([s], world).token_index(rank))  # Megatron's zigzag shard
        runner.q, runner.k, runner.v = (x[idx].clone().requires_grad_(True) for x in (q, k, v))
        out = runner.attention("math", GlooTransport(dist.group.WORLD, 60))
        out.backward(do[idx])
        res[name] = {"out": _err(out, ref["out"][idx]), "dq": _err(runner.q.grad, ref["dq"][idx]),
                     "dk": _err(runner.k.grad, ref["dk"][idx]), "dv": _err(runner.v.grad, ref["dv"][idx])}
    return res


def packed_head_parallel_worker(rank: int, world: int) -> dict:
    """fcp-hp on a packed batch (2 nodes x 2 ranks), whose chosen degree is 2: the packed
    head-parallel runner in FP64 against per-document single-device attention, out and dq/dk/dv
    through the runner, lse through the engine with the runner's plan and groups; then the worker's
    loop with it (every mode timed: the compute-only run with its all-to-alls replaced)."""
    from megatron_fcp.attention.head_parallel_thd import fcp_head_parallel_packed_attention_with_lse
    from megatron_fcp.emulate.runners import make_runner
    from megatron_fcp.emulate.spec import ClusterSpec, emulated_topology
    from megatron_fcp.emulate.workloads import WorkloadShape, make_workloads
    from megatron_fcp.emulate.worker import run

    topo = emulated_topology(ClusterSpec(2, 2))
    docs, (h, hk), d = (30, 7, 50, 9), (4, 2), 8
    shape = WorkloadShape(sum(docs), h, hk, d, True, docs, block_tokens=16)
    w = make_workloads(["fcp-hp"], shape, topo)[0]
    runner = make_runner(w, rank, dist.group.WORLD)                      # creates the head-parallel groups
    hp = w.hp_plan
    me = hp.ranks.index(rank)
    T = sum(docs)
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(T, x, d, generator=g, dtype=torch.float64) for x in (h, hk, hk, h))
    ref = {n: torch.zeros(T, h if n in ("out", "dq") else hk, d, dtype=torch.float64) for n in ("out", "dq", "dk", "dv")}
    ref_lse = torch.zeros(h, T, dtype=torch.float64)
    start = 0
    for L in docs:  # reference per document
        sl = slice(start, start + L)
        r = reference_attention(q[sl, None], k[sl, None], v[sl, None], causal=True, scale=1 / math.sqrt(d),
                                dout=do[sl, None])
        for n in ref:
            ref[n][sl] = r[n][:, 0]
        ref_lse[:, sl] = r["lse"][0]
        start += L
    idx = torch.from_numpy(hp.placement.token_index(me))
    runner.q, runner.k, runner.v = (x[idx].clone().requires_grad_(True) for x in (q, k, v))
    out = runner.attention("math", GlooTransport(dist.group.WORLD, 60))
    out.backward(do[idx])
    with torch.no_grad():
        _, lse = fcp_head_parallel_packed_attention_with_lse(runner.q, runner.k, runner.v, cp_group=dist.group.WORLD,
                                                             hp_plan=hp, groups=runner.groups, kernel="math",
                                                             agreement=None)
    errs = {"degree": hp.degree, "tokens": len(idx), "out": _err(out, ref["out"][idx]), "lse": _err(lse, ref_lse[:, idx]),
            "dq": _err(runner.q.grad, ref["dq"][idx]), "dk": _err(runner.k.grad, ref["dk"][idx]),
            "dv": _err(runner.v.grad, ref["dv"][idx])}
    job = {"workloads": [w], "repeats": 2, "component_repeats": 1, "warmup": 1, "compute": "sleep",
           "flops": 1e9, "timeout_s": 60}
    errs["times"] = run(job)["times"]["fcp-hp"]
    return errs
