"""One GPU check: FCP's CUDA block kernels, their numerics, speed and memory, in minutes on one GPU.

    python benchmarks/gpu_check.py --json gpu_check.json           # all sections (bash gpu_check.sh)
    python benchmarks/gpu_check.py --sections numerics --device cpu   # the same code on CPU (tests)

Sections (each skipped with a reason when what it needs is absent; nothing is installed):

* ``env``       torch, CUDA, the GPU, and which block kernels can run which dtype (or why not).
* ``numerics``  every installed fused kernel (``cuda-flash``, ``flash-attn``) at cp = 4, fixed length
  (zigzag, MHA and GQA, causal and not) and packed (``place_packed`` over a lognormal mix): out, lse,
  dq, dk, dv of the blockwise computation (each rank's queries against every KV block it needs,
  merged with the engine's ``LseAccumulator``, backward from the final out and lse) against an FP64
  reference. Rule (flash-attn's): error <= 2 x the error of plain PyTorch attention in the same
  dtype + 1e-5 (FP16/BF16; FP32 against plain FP32 attention).
* ``harness``   the same through the real executor in the in-process multi-rank harness (one thread
  and CUDA stream per rank), when :mod:`megatron_fcp.harness` is present.
* ``speed``     blockwise vs one fused call of the same kernel over the same tokens (32K-128K tokens,
  d = 128, BF16, causal, GQA 32:8), forward and backward: CUDA-event medians, and their ratio.
* ``memory``    peak GPU memory of one rank's blockwise forward + backward vs sequence length, next to
  the bytes of its inputs and of one ``s x s`` score matrix (which must never appear).
* ``gpt``       the tiny GPT example on CUDA for a few steps at cp = 1 vs FCP, when megatron-core is
  importable (see gpu_check.sh).
* ``pretrain``  Megatron-LM's own ``pretrain()`` loop on CUDA with tests/megatron_driver's
  ``pretrain_gpt.py``-shaped driver: cp = 1 (one rank) against FCP at cp = 2 through
  ``python -m megatron_fcp.run`` (two gloo ranks sharing the GPU), 5 steps, the loop's own loss
  dict; skipped when ``megatron.training`` is not importable (megatron-core < 0.17).

The blockwise computation here is the executor's arithmetic without the transport: the same kernel
calls, the same merge, the same backward; the harness section adds the transport and streams.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback

import torch

from megatron_fcp.attention.dispatch import BLOCK_KERNELS, resolve_kernel
from megatron_fcp.attention.fused import FusedPiecesKernel
from megatron_fcp.attention.kernels import compute_dtype_for, reference_attention
from megatron_fcp.attention.layout import ZigzagLayout, zigzag_split, zigzag_unsplit
from megatron_fcp.attention.merge import LseAccumulator
from megatron_fcp.contract.blocks import blocks_of
from megatron_fcp.contract.needs import needs_chunk
from megatron_fcp.contract.placement import lognormal_lengths, place_packed

QUANT = ("out", "lse", "dq", "dk", "dv")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


# ---------------------------------------------------------------------------------------------
# blockwise attention of a CP group, rank by rank (the executor's arithmetic, no transport)
# ---------------------------------------------------------------------------------------------
def zigzag_shards(q, k, v, dout, cp: int) -> list[dict]:
    """Every rank's zigzag shard of q, k, v and dout (what Megatron hands each rank)."""
    return [{n: zigzag_split(x, cp, i) for n, x in (("q", q), ("k", k), ("v", v), ("do", dout))} for i in range(cp)]


def zigzag_blockwise(q, k, v, dout, cp: int, kernel, causal: bool, scale: float, backward: bool = True,
                     shards: list | None = None, gather: bool = True):
    """q [s,b,h,d], k/v [s,b,hk,d] (global) -> dict of global out [s,b,h,d], lse [b,h,s] and dq, dk,
    dv, each rank computing its zigzag shard against its own and every needed KV block.
    ``shards``: :func:`zigzag_shards` made beforehand; ``gather`` False skips re-assembling."""
    s_local = q.shape[0] // cp
    ranks = tuple(range(cp))
    shard = shards if shards is not None else zigzag_shards(q, k, v, dout, cp)
    res = {n: [] for n in QUANT}
    dkv = [[torch.zeros(x.shape, dtype=compute_dtype_for(q.dtype), device=q.device) for x in (sh["k"], sh["v"])]
           for sh in shard]
    for i in ranks:
        q_i = shard[i]["q"]
        lay = ZigzagLayout(ranks, i, s_local, 1, causal)                   # the executor's row ranges
        blocks = [(j, blk) for j in ranks for blk in blocks_of(j)
                  if j == i or needs_chunk(i, j, blk.chunk, causal)]
        acc = LseAccumulator.empty(*q_i.shape, compute_dtype_for(q.dtype), q.device)
        preps: dict = {}
        for j, blk in blocks:
            sl = slice(blk.chunk * s_local // 2, (blk.chunk + 1) * s_local // 2)
            rows = lay.q_rows(blk) or slice(0, s_local)
            if (rows.start, "f") not in preps:
                preps[rows.start, "f"] = kernel.prepare_forward(q_i[rows], k.shape[2], scale)
            acc.add(*kernel.forward(q_i[rows], shard[j]["k"][sl], shard[j]["v"][sl], lay.q_pos[rows], lay.k_pos(blk),
                                    causal, scale, **preps[rows.start, "f"]), rows=rows)
        out, lse = acc.result()
        res["out"].append(out)
        res["lse"].append(lse)
        if not backward:
            continue
        do = shard[i]["do"].to(out.dtype)
        dq = torch.zeros(out.shape, dtype=out.dtype, device=q.device)
        for j, blk in blocks:
            sl = slice(blk.chunk * s_local // 2, (blk.chunk + 1) * s_local // 2)
            rows = lay.q_rows(blk) or slice(0, s_local)
            if (rows.start, "b") not in preps:
                preps[rows.start, "b"] = kernel.prepare_backward(q_i[rows], do[rows], out[rows], k.shape[2])
            g = kernel.backward(do[rows], q_i[rows], shard[j]["k"][sl], shard[j]["v"][sl], out[rows], lse[:, :, rows],
                                lay.q_pos[rows], lay.k_pos(blk), causal, scale, **preps[rows.start, "b"])
            dq[rows].add_(g[0])
            dkv[j][0][sl].add_(g[1])
            dkv[j][1][sl].add_(g[2])
        res["dq"].append(dq)
    if not gather:
        return res
    out = {"out": zigzag_unsplit(res["out"]), "lse": zigzag_unsplit(res["lse"], seq_dim=2)}
    if backward:
        out.update(dq=zigzag_unsplit(res["dq"]), dk=zigzag_unsplit([d[0] for d in dkv]),
                   dv=zigzag_unsplit([d[1] for d in dkv]))
    return out


def packed_blockwise(q, k, v, dout, placement, kernel, causal: bool, scale: float):
    """Packed batch q [t,h,d], k/v [t,hk,d] over ``placement``: every rank's queries against every
    block (rows of other documents stay empty), merged; returns global out [t,h,d], lse [h,t], dq, dk, dv."""
    cp = placement.cp
    dev = q.device
    sh = [{n: placement.shard(x, i).unsqueeze(1) for n, x in (("q", q), ("k", k), ("v", v), ("do", dout))}
          for i in range(cp)]                                              # [t_i, 1, h, d]
    pos = [torch.as_tensor(placement.positions(i)) for i in range(cp)]
    doc = [torch.as_tensor(placement.doc_ids(i)) for i in range(cp)]
    cd = compute_dtype_for(q.dtype)
    dkv = [[torch.zeros(x["k"].shape, dtype=cd, device=dev), torch.zeros(x["v"].shape, dtype=cd, device=dev)]
           for x in sh]
    blocks = []                                                           # (owner, local slice)
    for j in range(cp):
        for start, span in zip(placement.block_starts(j), placement.blocks[j]):
            blocks.append((j, slice(start, start + span.tokens)))
    res = {n: [] for n in ("out", "lse", "dq")}
    for i in range(cp):
        n_i = sh[i]["q"].shape[0]
        acc = LseAccumulator.empty(n_i, 1, q.shape[1], q.shape[2], cd, dev)
        if n_i:
            prep = kernel.prepare_forward(sh[i]["q"], k.shape[1], scale)
            for j, sl in blocks:
                acc.add(*kernel.forward(sh[i]["q"], sh[j]["k"][sl], sh[j]["v"][sl], pos[i], pos[j][sl], causal, scale,
                                        q_doc=doc[i], k_doc=doc[j][sl], **prep))
        out, lse = acc.result()
        dq = torch.zeros(out.shape, dtype=cd, device=dev)
        if n_i:
            do = sh[i]["do"].to(cd)
            bprep = kernel.prepare_backward(sh[i]["q"], do, out, k.shape[1])
            for j, sl in blocks:
                g = kernel.backward(do, sh[i]["q"], sh[j]["k"][sl], sh[j]["v"][sl], out, lse, pos[i], pos[j][sl],
                                    causal, scale, q_doc=doc[i], k_doc=doc[j][sl], **bprep)
                dq.add_(g[0])
                dkv[j][0][sl].add_(g[1])
                dkv[j][1][sl].add_(g[2])
        res["out"].append(out[:, 0])
        res["lse"].append(lse[0].t())
        res["dq"].append(dq[:, 0])
    return {"out": placement.unshard(res["out"]), "lse": placement.unshard(res["lse"]).t(),
            "dq": placement.unshard(res["dq"]), "dk": placement.unshard([d[0][:, 0] for d in dkv]),
            "dv": placement.unshard([d[1][:, 0] for d in dkv])}


def packed_reference(q, k, v, dout, doc_lengths, causal: bool, scale: float):
    """Per-document plain attention (in the inputs' dtype) over a packed batch [t, h, d]."""
    parts = {n: [] for n in QUANT}
    a = 0
    for L in doc_lengths:
        r = reference_attention(q[a:a + L, None], k[a:a + L, None], v[a:a + L, None], causal=causal, scale=scale,
                                dout=dout[a:a + L, None])
        for n in QUANT:
            parts[n].append(r[n][0] if n == "lse" else r[n][:, 0])
        a += L
    return {n: torch.cat(parts[n], dim=1 if n == "lse" else 0) for n in QUANT}


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item()


def compare(got: dict, ref64: dict, plain: dict, atol: float = 1e-5) -> dict:
    """Per tensor: our error, plain attention's error (same dtype), and the 2x rule's verdict."""
    out = {}
    for n in QUANT:
        e, p = _err(got[n], ref64[n]), _err(plain[n], ref64[n])
        out[n] = {"err": e, "plain_err": p, "ok": bool(e <= 2 * p + atol)}
    return out


# ---------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------
def section_env(device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   capability=list(torch.cuda.get_device_capability(device)))
    kernels = {}
    for name in BLOCK_KERNELS:
        kernels[name] = {}
        for dn, dt in DTYPES.items():
            try:
                resolve_kernel(name, dt, device, head_dim=128)
                kernels[name][dn] = "ok"
            except ValueError as exc:
                kernels[name][dn] = str(exc)
        try:
            kernels[name]["auto_bf16"] = resolve_kernel("auto", torch.bfloat16, device, head_dim=128).name
        except ValueError as exc:
            kernels[name]["auto_bf16"] = str(exc)
    env["kernels"] = kernels
    return env


def fused_kernels(device, dtypes) -> list[tuple[str, torch.dtype]]:
    pairs = []
    for name in BLOCK_KERNELS:
        for dt in dtypes:
            if name == "math" and device.type == "cuda":
                continue
            try:
                resolve_kernel(name, dt, device, head_dim=128)
            except ValueError:
                continue
            pairs.append((name, dt))
    return pairs


def section_numerics(device, dtypes, small: bool = False) -> list[dict]:
    """Fixed-length and packed cp = 4 numerics of every runnable (kernel, dtype) against FP64."""
    cp, rows = 4, []
    s, b, d = (64, 1, 16) if small else (2048, 2, 128)
    heads = [(4, 4), (4, 2)] if small else [(8, 8), (8, 2)]
    for name, dt in fused_kernels(device, dtypes):
        kernel = BLOCK_KERNELS[name]
        for h, hk in heads:
            for causal in (True, False):
                g = torch.Generator(device="cpu").manual_seed(h * 10 + hk + causal)
                x64 = [torch.randn(s, b, hh, d, generator=g, dtype=torch.float64).to(device) for hh in (h, hk, hk, h)]
                scale = d ** -0.5
                ref64 = reference_attention(*x64[:3], causal=causal, scale=scale, dout=x64[3])
                xs = [x.to(dt) for x in x64]
                plain = reference_attention(*xs[:3], causal=causal, scale=scale, dout=xs[3])
                got = zigzag_blockwise(*xs, cp, kernel, causal, scale)
                rows.append({"kernel": name, "dtype": str(dt)[6:], "case": "fixed", "seq": s, "batch": b, "heads": h,
                             "kv_heads": hk, "head_dim": d, "causal": causal, "cp": cp,
                             **compare(got, ref64, plain)})
        total = 96 if small else 6144
        lengths = lognormal_lengths(mean=total / 8, sigma=1.0, total=total, seed=1)
        placement = place_packed(lengths, cp, block_tokens=16 if small else 512, causal=True)
        h, hk = heads[-1]
        g = torch.Generator(device="cpu").manual_seed(7)
        t = sum(lengths)
        x64 = [torch.randn(t, hh, d, generator=g, dtype=torch.float64).to(device) for hh in (h, hk, hk, h)]
        scale = d ** -0.5
        ref64 = packed_reference(*x64, lengths, True, scale)
        xs = [x.to(dt) for x in x64]
        plain = packed_reference(*xs, lengths, True, scale)
        got = packed_blockwise(*xs, placement, kernel, True, scale)
        rows.append({"kernel": name, "dtype": str(dt)[6:], "case": "packed", "docs": len(lengths), "tokens": t,
                     "heads": h, "kv_heads": hk, "head_dim": d, "causal": True, "cp": cp,
                     **compare(got, ref64, plain)})
    return rows


def _time(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn`` (CUDA events on a CUDA device; wall clock on CPU) after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            z.record()
            z.synchronize()
            times.append(a.elapsed_time(z) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def section_speed(device, seqs, repeats: int, heads=(32, 8), d=128, cp: int = 4) -> list[dict]:
    """Blockwise (cp = 4 zigzag, every rank) vs one fused call over the same tokens, fwd and bwd."""
    rows = []
    for name, dt in fused_kernels(device, [torch.bfloat16]):
        kernel = BLOCK_KERNELS[name]
        if not isinstance(kernel, FusedPiecesKernel):
            continue
        ops = kernel.ops_for(dt)
        od = ops.op_dtype(dt)
        for s in seqs:
            g = torch.Generator(device="cpu").manual_seed(0)
            h, hk = heads
            q, do = (torch.randn(s, 1, h, d, generator=g).to(device, dt) for _ in range(2))
            k, v = (torch.randn(s, 1, hk, d, generator=g).to(device, dt) for _ in range(2))
            scale = d ** -0.5
            bshd = [x.to(od).permute(1, 0, 2, 3) for x in (q, k, v, do)]
            shards = zigzag_shards(q, k, v, do, cp)
            state = {}

            def fused_fwd():
                state["o"], state["l"] = ops.forward(bshd[0], bshd[1], bshd[2], True, scale)

            def fused_bwd():
                ops.backward(bshd[3], bshd[0], bshd[1], bshd[2], state["o"], state["l"], True, scale)

            def block_fwd():
                zigzag_blockwise(q, k, v, do, cp, kernel, True, scale, backward=False, shards=shards, gather=False)

            def block_all():
                zigzag_blockwise(q, k, v, do, cp, kernel, True, scale, backward=True, shards=shards, gather=False)

            t_ff = _time(fused_fwd, repeats, device)
            t_fb = _time(fused_bwd, repeats, device)
            t_bf = _time(block_fwd, repeats, device)
            t_ba = _time(block_all, repeats, device)
            t_bb = t_ba - t_bf
            rows.append({"kernel": name, "dtype": str(dt)[6:], "seq": s, "heads": h, "kv_heads": hk, "head_dim": d,
                         "cp": cp, "fused_fwd_s": t_ff, "fused_bwd_s": t_fb, "blockwise_fwd_s": t_bf,
                         "blockwise_bwd_s": t_bb, "fwd_ratio": t_bf / t_ff, "bwd_ratio": t_bb / t_fb,
                         "fwd_ok": bool(t_bf / t_ff <= 1.10), "bwd_ok": bool(t_bb / t_fb <= 1.10)})
            del q, k, v, do, bshd, state, shards
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def section_memory(device, seqs, heads=(32, 8), d=128, cp: int = 4) -> list[dict]:
    """Peak memory of rank 0's blockwise forward + backward (all its KV blocks resident)."""
    rows = []
    for name, dt in fused_kernels(device, [torch.bfloat16]):
        kernel = BLOCK_KERNELS[name]
        for s in seqs:
            h, hk = heads
            g = torch.Generator(device="cpu").manual_seed(0)
            q, do = (torch.randn(s, 1, h, d, generator=g).to(device, dt) for _ in range(2))
            k, v = (torch.randn(s, 1, hk, d, generator=g).to(device, dt) for _ in range(2))
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            zigzag_blockwise(q, k, v, do, cp, kernel, True, d ** -0.5)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            inputs = sum(x.numel() * x.element_size() for x in (q, k, v, do))
            rows.append({"kernel": name, "seq": s, "heads": h, "kv_heads": hk, "head_dim": d, "cp": cp,
                         "peak_extra_bytes": peak, "input_bytes": inputs,
                         "one_score_matrix_bytes_fp32": 4 * h * (s // cp) * s,
                         "no_s_by_s": bool(peak < 4 * h * (s // cp) * s / 4)})
            del q, k, v, do
            torch.cuda.empty_cache()
    return rows


def section_harness(device, dtypes, seq: int = 32768) -> dict:
    """The real executor for cp = 4 ranks in one process (one thread and CUDA stream per rank):
    numerics of every runnable (kernel, dtype) via ``check_numerics_cases``, then one BF16 GQA
    32:8 call of ``seq`` tokens per backward-KV mode: per-rank peak received KV (``FCPStats``)
    beside what TE's ring holds, and wall time."""
    from megatron_fcp.testing import harness

    out: dict = {"numerics": []}
    for name, dt in fused_kernels(device, dtypes):
        for row in harness.check_numerics_cases(device=device, dtype=dt, kernel=name, tokens=2048, head_dim=128,
                                                heads=8):
            out["numerics"].append({"kernel": name, "dtype": str(dt)[6:], **row})
    if device.type != "cuda":
        return out
    g = torch.Generator(device="cpu").manual_seed(0)
    h, hk, d = 32, 8, 128
    q, do = (torch.randn(seq, 1, h, d, generator=g).to(device, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(seq, 1, hk, d, generator=g).to(device, torch.bfloat16) for _ in range(2))
    out["memory"] = []
    for mode in ("keep", "resend", "auto"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = harness.harness_attention(q, k, v, do, cp=4, plan="full", causal=True, kernel="auto",
                                        backward_kv=mode, device=device, stats=True, timeout_s=120.0)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        out["memory"].append({
            "mode": mode, "seq": seq, "wall_s": wall, "backward_kv": [r.backward_kv for r in res.ranks],
            "kept_bytes": [r.kept_bytes for r in res.ranks],
            "peak_kv_bytes": [r.stats.peak_kv_bytes for r in res.ranks],
            "backward_peak_kv_bytes": [r.stats.backward_peak_kv_bytes for r in res.ranks],
            "ring_kv_bytes": [r.stats.ring_kv_bytes for r in res.ranks],
            "kept_le_ring": all(r.kept_bytes <= r.stats.ring_kv_bytes for r in res.ranks)})
        del res
    return out


_ERROR_LINE = re.compile(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*$")


def first_traceback(text: str, keep: int = 3000) -> str | None:
    """The first Python traceback in a run's output, cut to its last ``keep`` characters so that the
    exception line (what failed) survives; None when there is none. A rank's traceback ends at its
    first ``...Error: ...`` line; torchrun's own report that follows it is dropped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if _ERROR_LINE.match(lines[i])), len(lines) - 1)
    block = "\n".join(lines[start:end + 1])
    return block if len(block) <= keep else "...\n" + block[-keep:]


def section_gpt(device, timeout_s: int = 90) -> dict:
    """The tiny GPT example on one GPU: cp = 1 (Megatron's own attention, one process) against FCP at
    cp = 4 (four processes sharing the GPU over gloo, KV staged through host memory: NCCL refuses
    two ranks on one GPU), a few steps in FP32 (memory-efficient kernel) and BF16 (FlashAttention),
    losses side by side."""
    import importlib.util
    import subprocess
    import tempfile

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return {"skipped": "megatron-core is not importable (carry its wheel, see gpu_check.sh)"}
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "examples", "pretrain_gpt_fcp.py")
    config = os.path.join(here, "..", "examples", "configs", "tiny_cpu_cp4.yaml")
    common = ["--config", config, "--device", "cuda", "--dist-backend", "gloo", "--train-iters", "6",
              "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "256", "--fcp-kernel", "auto"]
    res: dict = {}
    for precision in ("fp32", "bf16"):
        extra = ["--bf16"] if precision == "bf16" else []
        runs = {}
        for label, nproc, flags in (("cp1_megatron", 1, ["--context-parallel-size", "1", "--no-fcp"]),
                                    ("cp4_fcp", 4, ["--context-parallel-size", "4"])):
            path = os.path.join(tempfile.mkdtemp(), "metrics.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   script, *common, *flags, *extra, "--metrics-json", path]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
                text = p.stdout + p.stderr
                run = {"rc": p.returncode, "tail": text[-1500:],
                       "traceback": first_traceback(text) if p.returncode else None}
                if p.returncode == 0 and os.path.exists(path):
                    with open(path) as f:
                        m = json.load(f)
                    run.update(losses=m["losses"], grad_norms=m["grad_norms"], kernel=m.get("fcp", {}).get("kernel"))
            except subprocess.TimeoutExpired:
                run = {"rc": None, "tail": f"timed out after {timeout_s} s"}
            runs[label] = run
        a, b = runs["cp1_megatron"].get("losses"), runs["cp4_fcp"].get("losses")
        if a and b:
            runs["max_loss_rel_diff"] = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        res[precision] = runs
    return res


def section_pretrain(device, timeout_s: int = 240) -> dict:
    """Megatron-LM's ``pretrain()`` with FCP (launcher, cp = 2) vs cp = 1 (tests/megatron_driver)."""
    import importlib.util
    import tempfile
    from pathlib import Path

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
        return {"skipped": "megatron.training not importable (megatron-core wheels ship it from 0.17 on)"}
    if device.type != "cuda":
        return {"skipped": "CPU (tests/test_megatron_pretrain.py runs this on CPU)"}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "megatron_driver"))
    from pretrain_runs import RUNS, max_rel, run_pretrain  # noqa: PLC0415

    tmp = Path(tempfile.mkdtemp(prefix="fcp-pretrain-"))
    res: dict = {}
    for name in ("cp1", "launcher"):
        run = run_pretrain(name, tmp, timeout_s=timeout_s, **RUNS[name])
        res[name] = {k: run.get(k) for k in ("returncode", "seconds", "losses", "grad_norms", "layer_report",
                                             "standins", "cuda", "megatron_core", "error")}
        if run["returncode"] != 0:
            res[name]["traceback"] = first_traceback(run["log"]) or run["log_tail"][-1500:]
    a, b = res["cp1"].get("losses"), res["launcher"].get("losses")
    if a and b and len(a) == len(b):
        res["max_loss_rel_diff"] = max_rel(b, a)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="gpu_check.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sections", default="env,numerics,harness,speed,memory,gpt,pretrain")
    p.add_argument("--seqs", default="32768,65536,131072", help="tokens for speed and memory")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtypes = [torch.bfloat16, torch.float16, torch.float32] if device.type == "cuda" else [torch.float32]
    seqs = [int(x) for x in args.seqs.split(",") if x]
    result: dict = {"argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    runners = {
        "env": lambda: section_env(device),
        "numerics": lambda: section_numerics(device, dtypes, small=args.small),
        "harness": lambda: section_harness(device, dtypes),
        "speed": lambda: section_speed(device, seqs, args.repeats),
        "memory": lambda: section_memory(device, seqs) if device.type == "cuda" else {"skipped": "CPU"},
        "gpt": lambda: section_gpt(device) if device.type == "cuda" else {"skipped": "CPU"},
        "pretrain": lambda: section_pretrain(device),
    }
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            result[name] = runners[name]()
        except Exception as exc:  # one broken section must not hide the others' results
            result[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        result.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 2)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"[gpu_check] {name}: {result['seconds'][name]} s", flush=True)
    summary = summarize(result)
    result["summary"] = summary
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(summary, indent=1))
    return 0


def summarize(result: dict) -> dict:
    s = {}
    hn = result.get("harness")
    if isinstance(hn, dict) and "numerics" in hn:
        s["harness_cases"] = len(hn["numerics"])
        s["harness_all_ok"] = all(r["ok"] for r in hn["numerics"])
        s["harness_memory"] = [(m["mode"], m["backward_kv"][0], max(m["kept_bytes"]), max(m["ring_kv_bytes"]),
                                round(m["wall_s"], 3)) for m in hn.get("memory", [])]
    num = result.get("numerics")
    if isinstance(num, list):
        s["numerics_cases"] = len(num)
        s["numerics_all_ok"] = all(r[n]["ok"] for r in num for n in QUANT)
        s["numerics_failures"] = [(r["kernel"], r["dtype"], r["case"], n, r[n]) for r in num for n in QUANT
                                  if not r[n]["ok"]]
    sp = result.get("speed")
    if isinstance(sp, list):
        s["speed"] = [(r["kernel"], r["seq"], round(r["fwd_ratio"], 3), round(r["bwd_ratio"], 3)) for r in sp]
    mem = result.get("memory")
    if isinstance(mem, list):
        s["memory_no_s_by_s"] = all(r["no_s_by_s"] for r in mem)
    pre = result.get("pretrain")
    if isinstance(pre, dict):
        s["pretrain"] = pre.get("skipped") or pre.get("max_loss_rel_diff", "failed (see pretrain)")
    return s


if __name__ == "__main__":
    raise SystemExit(main())
