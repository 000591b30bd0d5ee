"""One gloo world of 4 processes for the Megatron end-to-end tests.

tests/test_gpt_e2e.py (dense batches), tests/test_recompute_e2e.py (activation recomputation) and
tests/test_gpt_packed_e2e.py (packed THD batches), tests/test_sinks_e2e.py (attention sinks),
tests/test_window_e2e.py (sliding windows) and tests/test_gpt_mla_e2e.py (multi-latent attention)
all train the example's tiny megatron-core GPT
(examples/pretrain_gpt_fcp.py, FP32, 10 steps) on 4 gloo processes and compare FCP with Megatron's
own cp = 1 attention. They share this one world: the processes start and import megatron-core once,
and the dense cp = 1 reference, whose arguments the dense and the recompute parts share, is trained
once for both.

A *part* is one file's set of trainings. The session fixture ``megatron_e2e_world``
(tests/conftest.py) runs only the parts that the selected tests ask for (``E2E_PARTS`` of their
modules), so ``pytest tests/test_gpt_e2e.py`` (what the version matrix runs) trains only the dense
runs. Inside a rank the parts run one after another; every training sets up and tears down its own
Megatron and FCP state (the example's ``train``), as the files' own workers did before.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TINY = os.path.join(EXAMPLES, "configs", "tiny_cpu_cp4.yaml")  # its topology is topology_2x2.yaml
TOPO_2X2 = os.path.join(EXAMPLES, "configs", "topology_2x2.yaml")
PACKED = os.path.join(EXAMPLES, "configs", "tiny_cpu_cp4_packed.yaml")

STEPS = 10
# The arguments every dense training shares (GQA: 4 query heads share 2 KV heads). The tiny config's
# topology already is TOPO_2X2; the flag only makes it explicit for the dense part's checks.
BASE = ["--config", TINY, "--no-progress", "--train-iters", str(STEPS), "--micro-batch-size", "1",
        "--global-batch-size", "4", "--num-query-groups", "2"]
CP1 = ["--no-fcp", "--context-parallel-size", "1"]

# dense part (tests/test_gpt_e2e.py)
DENSE = BASE + ["--fcp-topology", TOPO_2X2]
BLOCK_TOKENS = 8  # tp2/cp2 run: 64 tokens / cp 2 = 2 zigzag chunks of 16 = 4 blocks of 8 per rank

# recompute part (tests/test_recompute_e2e.py): name -> extra flags on BASE
RECOMPUTE = {
    "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "selective-keep": ["--recompute-granularity", "selective", "--fcp-backward-kv", "keep"],
    "none": [],
}

# packed part (tests/test_gpt_packed_e2e.py)
PACKED_COMMON = ["--config", PACKED, "--no-progress", "--train-iters", str(STEPS), "--global-batch-size", "4",
                 "--num-query-groups", "2"]

# sinks part (tests/test_sinks_e2e.py): name -> (flags; the dense runs' arguments with sinks)
SINKS = {
    "cp1": BASE + CP1 + ["--softmax-type", "learnable"],
    "cp4": DENSE + ["--softmax-type", "learnable"],
    "tp2cp1": BASE + CP1 + ["--softmax-type", "learnable", "--tensor-model-parallel-size", "2"],
    "tp2cp2": DENSE + ["--softmax-type", "learnable", "--tensor-model-parallel-size", "2",
                       "--context-parallel-size", "2", "--fcp-block-tokens", str(BLOCK_TOKENS)],
    "cp4hp2": DENSE + ["--softmax-type", "learnable", "--fcp-head-parallel", "2"],
    "cp1-off-by-one": BASE + CP1 + ["--softmax-type", "off-by-one"],
    "cp4-off-by-one": DENSE + ["--softmax-type", "off-by-one", "--fcp-backward-kv", "resend"],
    "packed-cp1": PACKED_COMMON + CP1 + ["--softmax-type", "learnable"],
    "packed-cp4": PACKED_COMMON + ["--softmax-type", "learnable"],
}

# window part (tests/test_window_e2e.py): gpt-oss-like interleaving, layer 1 windowed (16 tokens: two
# zigzag chunks at cp = 4, one at cp = 2), layer 2 full (Megatron's window_attn_skip_freq rule), with
# learnable sinks on both (GPT_OSS); packed batches with the window alone
WINDOW = ["--window-size", "16,0", "--window-attn-skip-freq", "2"]
GPT_OSS = WINDOW + ["--softmax-type", "learnable"]

# MLA part (tests/test_gpt_mla_e2e.py): megatron-core's MLASelfAttention on the local spec (the
# example's defaults: qk 32 + RoPE 16 = d_qk 48, d_v 24, KV rank 32)
MLA = BASE + ["--multi-latent-attention", "--fcp-topology", TOPO_2X2]

#: part -> seconds its trainings may take on 2 shared cores (the world's timeout is their sum)
PARTS = {"dense": 540, "recompute": 420, "packed": 540, "sinks": 600, "window": 600, "mla": 480}


def _example():
    import warnings

    warnings.filterwarnings("ignore")
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import pretrain_gpt_fcp

    return pretrain_gpt_fcp


def _quiet(msg: str) -> None:
    pass


def _posted(counters) -> list[tuple]:
    return [(p.phase, p.kind, p.transfer.src, p.transfer.dst) for t in counters for p in t.posted]


def _dense(example, cp1: dict, metrics_path: str) -> dict:
    """cp = 1; cp = 4 hierarchical without overlap; tp = 2 at cp = 1; tp = 2 x cp = 2 with 2 blocks
    per chunk, transfers counted; cp = 4 with a head-parallel stage of degree 2, transfers counted."""
    import torch.distributed as dist

    from megatron_fcp.attention.comm import CountingTransport, default_transport

    out = {"cp1": cp1}
    out["cp4"] = example.train(*example.parse_args(DENSE + ["--metrics-json", metrics_path, "--no-fcp-overlap"]),
                               log=_quiet)
    out["tp2cp1"] = example.train(*example.parse_args(DENSE + CP1 + ["--tensor-model-parallel-size", "2"]),
                                  log=_quiet)
    counters: list[CountingTransport] = []
    group_ranks: list[tuple[int, ...]] = []  # read when the transport is made: train() destroys its groups

    def counting(group):
        transport = CountingTransport(default_transport(group))
        counters.append(transport)
        group_ranks.append(tuple(dist.get_process_group_ranks(group)))
        return transport

    args, fcp = example.parse_args(DENSE + ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                                            "--fcp-block-tokens", str(BLOCK_TOKENS)])
    out["tp2cp2"] = example.train(args, fcp, transport_factory=counting, log=_quiet)
    out["tp2cp2"]["posted"] = _posted(counters)
    out["tp2cp2"]["calls"] = len(counters)
    counters.clear()  # cp = 4 with a head-parallel stage of degree 2: head groups {0,1}, {2,3} (the nodes)
    group_ranks.clear()
    args, fcp = example.parse_args(DENSE + ["--fcp-head-parallel", "2"])
    out["cp4hp2"] = example.train(args, fcp, transport_factory=counting, log=_quiet)
    out["cp4hp2"]["posted"] = _posted(counters)
    out["cp4hp2"]["stage_groups"] = sorted(set(group_ranks))
    return out


def _recompute(example, cp1: dict) -> dict:
    """cp = 4 under each recomputation of RECOMPUTE, the transports (one per attention call) counted."""
    from megatron_fcp.attention.comm import default_transport

    out = {"cp1": cp1}
    for name, extra in RECOMPUTE.items():
        calls = []

        def counting(group):
            calls.append(1)
            return default_transport(group)

        args, fcp = example.parse_args(BASE + extra)
        out[name] = example.train(args, fcp, transport_factory=counting, log=_quiet)
        out[name]["calls"] = len(calls)
    return out


def _packed(example) -> dict:
    """Packed batches: cp = 1 (SDPA per document), cp = 4 with the agreements counted, cp = 4 with the
    head-parallel stage (a = 2), cp = 4 in Transformer Engine's layout, tp = 2 at cp = 1 and tp = 2 x cp = 2."""
    from megatron_fcp.attention import agreement

    out = {"cp1": example.train(*example.parse_args(PACKED_COMMON + CP1), log=_quiet)}
    calls = []
    real = agreement.agree  # what AgreementCache calls once per micro-batch (setup_fcp's agreement not counted)

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    agreement.agree = counting
    try:
        out["cp4"] = example.train(*example.parse_args(PACKED_COMMON), log=_quiet)
    finally:
        agreement.agree = real
    out["cp4"]["agreements"] = len(calls)
    out["cp4hp2"] = example.train(*example.parse_args(PACKED_COMMON + ["--fcp-head-parallel", "2"]), log=_quiet)
    out["cp4thd"] = example.train(*example.parse_args(PACKED_COMMON + ["--fcp-packed-layout", "thd"]), log=_quiet)
    out["tp2cp1"] = example.train(*example.parse_args(PACKED_COMMON + CP1 + ["--tensor-model-parallel-size", "2"]),
                                  log=_quiet)
    out["tp2cp2"] = example.train(*example.parse_args(
        PACKED_COMMON + ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]), log=_quiet)
    return out


def _sinks(example) -> dict:
    """Learnable sinks: cp = 1 (Megatron's DotProductAttention with its SoftmaxOne), cp = 4, tp = 2
    at cp = 1 and tp = 2 x cp = 2, cp = 4 with a head-parallel stage of degree 2; off-by-one at cp = 1
    and cp = 4 (backward re-sending KV); packed at cp = 1 and cp = 4."""
    return {name: example.train(*example.parse_args(argv), log=_quiet) for name, argv in SINKS.items()}


def _window(example) -> dict:
    """gpt-oss-like (GPT_OSS: interleaved window / full layers, learnable sinks): cp = 1 (Megatron's own
    windowed attention with its SoftmaxOne), cp = 4 with every transfer counted, tp = 2 at cp = 1 and
    tp = 2 x cp = 2; packed batches with the window inside each document at cp = 1 and cp = 4, and at
    tp = 2 with cp = 1 and cp = 2."""
    from megatron_fcp.attention.comm import CountingTransport, default_transport

    counters: list[CountingTransport] = []

    def counting(group):
        transport = CountingTransport(default_transport(group))
        counters.append(transport)
        return transport

    out = {"cp1": example.train(*example.parse_args(BASE + CP1 + GPT_OSS), log=_quiet)}
    args, fcp = example.parse_args(BASE + GPT_OSS)
    out["cp4"] = example.train(args, fcp, transport_factory=counting, log=_quiet)
    # per attention call, in call order (layer 1 windowed, layer 2 full, per micro-batch): forward receives
    out["cp4"]["forward_recvs"] = [sum(1 for p in t.posted if p.kind == "recv" and p.phase == "forward")
                                   for t in counters]
    out["tp2cp1"] = example.train(*example.parse_args(BASE + CP1 + GPT_OSS + ["--tensor-model-parallel-size", "2"]),
                                  log=_quiet)
    out["tp2cp2"] = example.train(*example.parse_args(
        BASE + GPT_OSS + ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]), log=_quiet)
    out["packed_cp1"] = example.train(*example.parse_args(PACKED_COMMON + CP1 + WINDOW), log=_quiet)
    from megatron_fcp.attention import agreement

    calls, real = [], agreement.agree

    def counting_agree(*a, **k):
        calls.append(1)
        return real(*a, **k)

    agreement.agree = counting_agree
    try:
        out["packed_cp4"] = example.train(*example.parse_args(PACKED_COMMON + WINDOW), log=_quiet)
    finally:
        agreement.agree = real
    out["packed_cp4"]["agreements"] = len(calls)
    tp2 = ["--tensor-model-parallel-size", "2"]
    out["packed_tp2cp1"] = example.train(*example.parse_args(PACKED_COMMON + CP1 + WINDOW + tp2), log=_quiet)
    out["packed_tp2cp2"] = example.train(*example.parse_args(PACKED_COMMON + WINDOW + tp2 + ["--context-parallel-size",
                                                                                            "2"]), log=_quiet)
    return out


def _mla(example) -> dict:
    """MLA: cp = 1 (FCPCoreAttention at cp = 1 is torch's SDPA: Megatron's local attention refuses
    MLA's k_channels), cp = 4 under the settled schedule, cp = 4 without a head-parallel stage (the
    KV blocks of d_qk + d_v channels travel), tp = 2 at cp = 1 and tp = 2 x cp = 2."""
    tp2 = ["--tensor-model-parallel-size", "2"]
    return {
        "cp1": example.train(*example.parse_args(MLA + CP1), log=_quiet),
        "cp4": example.train(*example.parse_args(MLA), log=_quiet),
        "cp4hp1": example.train(*example.parse_args(MLA + ["--fcp-head-parallel", "1"]), log=_quiet),
        "tp2cp1": example.train(*example.parse_args(MLA + CP1 + tp2), log=_quiet),
        "tp2cp2": example.train(*example.parse_args(MLA + tp2 + ["--context-parallel-size", "2"]), log=_quiet),
    }


def worker(rank: int, world: int, parts: list[str], metrics_path: str) -> dict:
    """Per rank: part -> run name -> the example's report of that training."""
    example = _example()
    out: dict = {}
    if "dense" in parts or "recompute" in parts:
        cp1 = example.train(*example.parse_args(BASE + CP1), log=_quiet)
        if "dense" in parts:
            out["dense"] = _dense(example, cp1, metrics_path)
        if "recompute" in parts:
            out["recompute"] = _recompute(example, cp1)
    if "packed" in parts:
        out["packed"] = _packed(example)
    if "sinks" in parts:
        out["sinks"] = _sinks(example)
    if "window" in parts:
        out["window"] = _window(example)
    if "mla" in parts:
        out["mla"] = _mla(example)
    return out


def run(parts: list[str], metrics_path: str) -> list[dict]:
    """Train ``parts`` (keys of PARTS) on one gloo world of 4 processes; per rank, :func:`worker`'s dict."""
    from megatron_fcp.testing.launch import run_gloo

    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown end-to-end parts {unknown}; known: {sorted(PARTS)}")
    return run_gloo(worker, 4, sorted(parts), metrics_path, timeout_s=sum(PARTS[p] for p in set(parts)))
