"""``megatron-fcp demo``: FCP attention on a local gloo CP group, checked against one device.

Starts ``--cp`` gloo processes on this machine, gives each its Megatron zigzag shard of one
random sequence, runs ``fcp_attention`` forward and backward with the chosen plan, gathers the
shards and compares out, lse, dq, dk, dv with single-device attention computed in FP64 (torch
autograd, :func:`~megatron_fcp.attention.kernels.reference_attention`). Prints the errors and the
communication / compute / total times, and exits non-zero when an error exceeds the tolerance:
max-abs error <= tol * max(1, max|ref|), tol = 1e-10 (fp64), 1e-5 (fp32), 2^-6 (bf16: a few BF16
ulps, what FP32 accumulation with one final rounding gives).

    megatron-fcp demo                              # cp=4, 4096 tokens, 8 heads / 2 KV heads, d=64
    megatron-fcp demo --plan full --dtype bf16
    megatron-fcp demo --kernel cpu-flash           # torch's fused CPU flash ops as block kernel
"""

from __future__ import annotations

import argparse
import math
import time

from megatron_fcp.contract.plan import SIMPLE_PLANS

NAME = "demo"
HELP = "run FCP attention fwd+bwd on a local gloo CP group and check it against single-device attention"

_DTYPES = ("fp32", "bf16", "fp64")
_TOL = {"fp64": 1e-10, "fp32": 1e-5, "bf16": 2.0 ** -6}
_QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp", type=int, default=4, help="context-parallel size = gloo processes (default 4)")
    p.add_argument("--seq", type=int, default=4096, help="global sequence length, a multiple of 2*cp (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads, dividing --heads (default 2: GQA)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--plan", choices=sorted(SIMPLE_PLANS), default="ring",
                   help="communication plan: ring (TE's p2p ring, the default) or full (each block straight to its readers)")
    p.add_argument("--dtype", choices=_DTYPES, default="fp32", help="input dtype (default fp32)")
    p.add_argument("--kernel", default="math",
                   help="block kernel: 'math' (default, pure torch, any dtype), 'cpu-flash' (torch's fused "
                        "CPU flash ops, fp32/bf16) or 'auto'; see megatron_fcp.attention.dispatch")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="attend to every token (no causal mask)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the gloo group is killed")


def _inputs(cfg: dict):
    """Global q, k, v, dout [s, b, h(_kv), d] in the demo dtype (identical in every process)."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[cfg["dtype"]]
    g = torch.Generator().manual_seed(cfg["seed"])
    s, b, h, hk, d = cfg["seq"], cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    shapes = ((s, b, h, d), (s, b, hk, d), (s, b, hk, d), (s, b, h, d))
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(dt) for shape in shapes]


def _worker(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist

    from megatron_fcp.attention.comm_only import measure_comm_only
    from megatron_fcp.attention.function import FCPStats, fcp_attention_with_lse, resolve_plan
    from megatron_fcp.attention.layout import zigzag_split

    q, k, v, do = _inputs(cfg)
    group = dist.group.WORLD
    ql, kl, vl = (zigzag_split(x, world, rank).requires_grad_() for x in (q, k, v))
    stats = FCPStats()
    dist.barrier()
    out, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=group, plan=cfg["plan"], causal=cfg["causal"],
                                      stats=stats, kernel=cfg["kernel"])
    out.backward(zigzag_split(do, world, rank))
    plan = resolve_plan(cfg["plan"], tuple(range(world)), cfg["causal"])
    blk = ql.shape[0] // 2
    dist.barrier()
    stats.comm_only_s = measure_comm_only(plan, group, (2, blk, *kl.shape[1:]), kl.dtype)
    # numpy copies (exact in FP64): torch tensors would travel as shared-memory handles that die
    # with this process before the parent unpickles them
    shards = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    return {**{n: x.double().numpy() for n, x in shards.items()},
            "stats": stats.as_dict(), "rounds": len(plan.rounds), "transfers": plan.num_transfers()}


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_fcp.attention.dispatch import resolve_kernel
    from megatron_fcp.attention.kernels import reference_attention
    from megatron_fcp.attention.layout import zigzag_unsplit
    from megatron_fcp.testing.launch import run_gloo

    if args.cp < 1 or args.seq % (2 * args.cp) != 0:
        print(f"error: --seq {args.seq} must be a positive multiple of 2*cp = {2 * args.cp}")
        return 2
    if args.kv_heads < 1 or args.heads % args.kv_heads != 0:
        print(f"error: --heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
        return 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[args.dtype]
    try:  # a kernel that cannot run these inputs fails here, before any process starts
        resolve_kernel(args.kernel, dtype, "cpu")
    except ValueError as e:
        print(f"error: --kernel: {e}")
        return 2
    cfg = {k: getattr(args, k) for k in ("seq", "batch", "heads", "kv_heads", "head_dim", "plan", "dtype",
                                          "causal", "seed", "kernel")}
    print(f"megatron-fcp demo: cp={args.cp} seq={args.seq} batch={args.batch} heads={args.heads}/{args.kv_heads} "
          f"head_dim={args.head_dim} dtype={args.dtype} plan={args.plan} causal={args.causal} kernel={args.kernel}")
    t0 = time.perf_counter()
    results = run_gloo(_worker, args.cp, cfg, timeout_s=args.timeout)
    t_group = time.perf_counter() - t0
    got = {n: zigzag_unsplit([torch.from_numpy(r[n]) for r in results], seq_dim=2 if n == "lse" else 0)
           for n in _QUANTITIES}
    q, k, v, do = _inputs(cfg)
    t0 = time.perf_counter()
    ref = reference_attention(q.double(), k.double(), v.double(), causal=args.causal,
                              scale=1.0 / math.sqrt(args.head_dim), dout=do.double(), rows_per_tile=512)
    t_ref = time.perf_counter() - t0
    print(f"plan {args.plan!r}: {results[0]['rounds']} rounds, {results[0]['transfers']} block transfers; "
          f"gloo group {t_group:.1f} s (start-up included), FP64 reference {t_ref:.1f} s")
    tol = _TOL[args.dtype]
    ok = True
    print("max |error| vs single-device FP64 attention (tolerance: "
          f"{tol:g} x max(1, max|ref|)):")
    for n in _QUANTITIES:
        finite = bool(torch.isfinite(got[n]).all())
        err = (got[n].double() - ref[n]).abs().max().item()
        scale = max(1.0, ref[n].abs().max().item())
        good = finite and err <= tol * scale
        ok &= good
        print(f"  {n:4s} {err:10.3e}   max|ref| {ref[n].abs().max().item():9.3e}   {'ok' if good else 'FAIL'}"
              + ("" if finite else "  (NaN/inf)"))
    st = [r["stats"] for r in results]

    def worst(key: str) -> float:
        return max(s[key] for s in st)

    print("times (s, slowest rank; wait = communication compute did not hide):")
    print(f"  forward   total {worst('forward_total_s'):7.3f}   compute {worst('forward_compute_s'):7.3f}"
          f"   wait {worst('forward_wait_s'):7.3f}")
    print(f"  backward  total {worst('backward_total_s'):7.3f}   compute {worst('backward_compute_s'):7.3f}"
          f"   wait {worst('backward_wait_s'):7.3f}")
    print(f"  forward communication alone (no compute): {worst('comm_only_s'):.3f}")
    mb = sum(s["forward_bytes_sent"] for s in st) / 2 ** 20
    mbb = sum(s["backward_bytes_sent"] for s in st) / 2 ** 20
    print(f"  bytes sent (all ranks): forward {mb:.1f} MiB, backward {mbb:.1f} MiB")
    print("PASS" if ok else "FAIL: an error exceeds the tolerance")
    return 0 if ok else 1
