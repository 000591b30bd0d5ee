"""Compute overhead of blockwise attention + LSE merge vs one fused torch attention call (CPU).

The FCP engine computes a rank's attention as one block-kernel call per KV block followed by an
FP32 log-sum-exp merge. This benchmark measures what that costs compared with attending to the
same keys in one call, on the same local work, for each block kernel
(:data:`megatron_fcp.attention.kernels.BLOCK_KERNELS`, ``--kernels``):

* ``blockwise[K]`` — kernel K per block + ``LseAccumulator`` (what FCP runs with ``kernel=K``);
* ``one_call[K]``  — kernel K once over all keys (same kernel, no blocking);
* ``sdpa``         — ``torch.nn.functional.scaled_dot_product_attention`` once (torch's fused CPU
  flash kernel), the issue's yardstick.

Reported ratios per kernel: ``blockwise / sdpa`` (the issue's target: <= 1.25x at 8K local tokens,
d=64) and ``blockwise / one_call`` (the pure blocking + merge overhead of that kernel). Medians of
``--repeats`` runs, alternating the variants. Writes JSON to ``benchmarks/results/`` and prints the
ratios. Run it alone on the machine (e.g. under ``flock``) with a fixed thread count. ``--suite``
runs the configurations of docs/attention.md's table one after another.

    python benchmarks/bench_block_overhead.py --local-tokens 8192 --blocks 8 --head-dim 64
    python benchmarks/bench_block_overhead.py --suite
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_fcp.attention.dispatch import BLOCK_KERNELS, resolve_kernel
from megatron_fcp.attention.kernels import BlockKernel
from megatron_fcp.attention.merge import LseAccumulator

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}

#: ``--suite``: (label, extra argv) run in order with the shared options.
SUITE = [
    ("forward, 8 blocks, 8 heads", []),
    ("forward, 8 blocks, GQA 8/2 heads", ["--kv-heads", "2"]),
    ("forward, 2 blocks (the zigzag pair)", ["--blocks", "2"]),
    ("forward, BF16 inputs", ["--dtype", "bf16"]),
    ("forward, causal", ["--causal"]),
    ("forward + backward", ["--backward"]),
    ("forward + backward, causal", ["--backward", "--causal"]),
]


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local-tokens", type=int, default=8192, help="query tokens on this rank")
    p.add_argument("--kv-tokens", type=int, default=None, help="key tokens (default: = local tokens)")
    p.add_argument("--blocks", type=int, default=8, help="KV blocks the keys are cut into")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: = heads (MHA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    p.add_argument("--causal", action="store_true", help="causal self-attention (q, kv at positions 0..n-1)")
    p.add_argument("--backward", action="store_true", help="time forward+backward instead of forward")
    p.add_argument("--kernels", default=",".join(sorted(BLOCK_KERNELS, reverse=True)),
                   help=f"comma-separated block kernels to time (default: all of {sorted(BLOCK_KERNELS)}; "
                        f"kernels that cannot run --dtype are skipped with a note)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--suite", action="store_true", help="run the SUITE configurations (other options shared)")
    return p.parse_args(argv)


def _blockwise(kernel: BlockKernel, q, k, v, dout, q_pos, k_pos, bounds, causal, scale, backward):
    """What the FCP executor runs: per-shard preparation once, one kernel call per block, LSE merge."""
    hk = k.shape[2]
    prep = kernel.prepare_forward(q, hk, scale)
    acc = LseAccumulator()
    for a, z in bounds:
        acc.add(*kernel.forward(q, k[a:z], v[a:z], q_pos, k_pos[a:z], causal, scale, **prep))
    out, lse = acc.result()                                                       # [n,b,h,d], [b,h,n]
    if backward:
        dout_c = dout.to(out.dtype)
        prep = kernel.prepare_backward(q, dout_c, out, hk)
        dq = torch.zeros_like(out)
        for a, z in bounds:
            dq_b, _, _ = kernel.backward(dout_c, q, k[a:z], v[a:z], out, lse, q_pos, k_pos[a:z], causal, scale,
                                         **prep)
            dq += dq_b
    return out


def _one_call(kernel: BlockKernel, q, k, v, dout, q_pos, k_pos, causal, scale, backward):
    out, lse = kernel.forward(q, k, v, q_pos, k_pos, causal, scale)
    if backward:
        kernel.backward(dout.to(out.dtype), q, k, v, out, lse, q_pos, k_pos, causal, scale)
    return out


def _sdpa(q, k, v, dout, causal, scale, backward):
    g = q.shape[2] // k.shape[2]
    qb = q.permute(1, 2, 0, 3).detach().requires_grad_(backward)                  # [b, h, n, d]
    kb = k.permute(1, 2, 0, 3).detach().requires_grad_(backward)                  # [b, h_kv, m, d]
    vb = v.permute(1, 2, 0, 3).detach().requires_grad_(backward)
    out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=scale, enable_gqa=g > 1)
    if backward:
        out.backward(dout.permute(1, 2, 0, 3))
    return out.permute(2, 0, 1, 3)                                                # [n, b, h, d]


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_config(a: argparse.Namespace) -> dict:
    """Time one configuration; write its JSON; return the result dict."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    n, m = a.local_tokens, a.kv_tokens or a.local_tokens
    if m % a.blocks:
        raise SystemExit(f"--kv-tokens {m} must be a multiple of --blocks {a.blocks}")
    if a.causal and m != n:
        raise SystemExit("--causal needs --kv-tokens == --local-tokens")
    hk = a.kv_heads or a.heads
    dt = _DTYPES[a.dtype]
    q = torch.randn(n, a.batch, a.heads, a.head_dim, dtype=dt)                       # [n, b, h, d]
    k = torch.randn(m, a.batch, hk, a.head_dim, dtype=dt)                            # [m, b, h_kv, d]
    v = torch.randn(m, a.batch, hk, a.head_dim, dtype=dt)
    dout = torch.randn_like(q)
    q_pos, k_pos = torch.arange(n), torch.arange(m)
    blk = m // a.blocks
    bounds = [(i * blk, (i + 1) * blk) for i in range(a.blocks)]
    scale = a.head_dim ** -0.5
    kernels, skipped = {}, {}
    for name in [x.strip() for x in a.kernels.split(",") if x.strip()]:
        try:
            kernels[name] = resolve_kernel(name, dt, "cpu")
        except ValueError as e:
            if name not in BLOCK_KERNELS:
                raise SystemExit(f"--kernels: {e}")
            skipped[name] = str(e)
    variants = {"sdpa": lambda: _sdpa(q, k, v, dout, a.causal, scale, a.backward)}
    for name, kern in kernels.items():
        variants[f"blockwise[{name}]"] = (lambda kern=kern: _blockwise(
            kern, q, k, v, dout, q_pos, k_pos, bounds, a.causal, scale, a.backward))
        variants[f"one_call[{name}]"] = (lambda kern=kern: _one_call(
            kern, q, k, v, dout, q_pos, k_pos, a.causal, scale, a.backward))
    # sanity: the variants compute the same attention
    ref = variants["sdpa"]().double()
    for name in [x for x in variants if x != "sdpa"]:
        err = (variants[name]().double() - ref).abs().max().item()
        tol = 2e-2 if dt == torch.bfloat16 else 1e-4
        if err > tol:
            raise SystemExit(f"{name} disagrees with sdpa: max abs error {err:.3g} > {tol}")
    times: dict[str, list[float]] = {x: [] for x in variants}
    for _ in range(a.repeats):
        for name, fn in variants.items():
            times[name].append(_time(fn))
    med = {x: statistics.median(t) for x, t in times.items()}
    ratios = {name: {"blockwise_vs_sdpa": med[f"blockwise[{name}]"] / med["sdpa"],
                     "blockwise_vs_one_call": med[f"blockwise[{name}]"] / med[f"one_call[{name}]"],
                     "one_call_vs_sdpa": med[f"one_call[{name}]"] / med["sdpa"]} for name in kernels}
    config = {x: (str(y) if isinstance(y, Path) else y) for x, y in vars(a).items() if x != "suite"}
    result = {
        "benchmark": "block_overhead", "config": config,
        "torch": torch.__version__, "machine": platform.machine(), "threads": torch.get_num_threads(),
        "times_s": times, "median_s": med, "ratios": ratios, "skipped_kernels": skipped,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    tag = f"n{n}_m{m}_blk{a.blocks}_h{a.heads}x{hk}_d{a.head_dim}_{a.dtype}" + \
          ("_causal" if a.causal else "") + ("_bwd" if a.backward else "")
    path = a.out / f"block_overhead_{tag}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"{'fwd+bwd' if a.backward else 'forward'} {tag}: sdpa {med['sdpa']:.3f} s  -> {path}")
    for name in kernels:
        r = ratios[name]
        print(f"  kernel {name:9s}: blockwise {med[f'blockwise[{name}]']:.3f} s, one call "
              f"{med[f'one_call[{name}]']:.3f} s | blockwise/sdpa = {r['blockwise_vs_sdpa']:.3f}  "
              f"blockwise/one_call = {r['blockwise_vs_one_call']:.3f}")
    for name, why in skipped.items():
        print(f"  kernel {name:9s}: skipped ({why})")
    return result


def main(argv=None) -> int:
    argv = list(argv) if argv is not None else None
    a = _parse(argv)
    if not a.suite:
        run_config(a)
        return 0
    import sys
    base = [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--suite"]
    for label, extra in SUITE:
        print(f"== {label}")
        run_config(_parse(base + extra))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
