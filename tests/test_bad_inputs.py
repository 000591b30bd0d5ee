"""A bad-input suite: malformed config, YAML topology, graph, plan, tensors, process-group layout
and packed-sequence metadata. Each raises the error docs/errors.md catalogues for it, with a
message naming the fix, before any communication; each is bounded in time (an alarm fails a case
that takes more than 20 s) and none starts a process. Cases that need a process group live in
tests/_attention_cases.py (``_bad_inputs``) and tests/_reliability_cases.py; docs/errors.md lists
those too.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace as NS

import pytest
import torch

from megatron_fcp.attention.agreement import FCPAgreementError
from megatron_fcp.attention.function import FCPNumericsError, check_finite, resolve_plan
from megatron_fcp.attention.dispatch import resolve_kernel
from megatron_fcp.attention.kernels import block_attention_forward
from megatron_fcp.config import FCPConfig
from megatron_fcp.patches.packed import doc_lengths_of
from megatron_fcp.patches.runtime import FCPStateError, reset_fcp, resolve_topology, setup_fcp
from megatron_fcp.contract.blocks import Block, PlanError, Transfer
from megatron_fcp.contract.placement import place_packed
from megatron_fcp.contract.plan import Plan, ring_plan
from megatron_fcp.planner.build import build_plan
from megatron_fcp.planner.megatron_layout import MegatronLayout
from megatron_fcp.contract.placement import check_doc_lengths
from megatron_fcp.topology import TopologyError, load_topology

BOUND_S = 20


@pytest.fixture(autouse=True)
def bounded():
    """Fail (never hang) a case that runs longer than BOUND_S."""
    def expire(*_):
        raise TimeoutError(f"bad-input case ran longer than {BOUND_S} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(BOUND_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        reset_fcp()  # cases that settle a runtime must not leak it into later tests


def _topo():
    return load_topology("dgx-h100:1")


def _runtime():
    return setup_fcp(FCPConfig(enabled=True, topology="dgx-h100:1"), layout=MegatronLayout(world=4, cp=2),
                     groups={}, seq_len=8)


def _packed(**over):
    base = dict(qkv_format="thd", cu_seqlens_q=[0, 3, 7], cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None)
    base.update(over)
    return NS(**base)


def _yaml(tmp_path, text):
    p = tmp_path / "topo.yaml"
    p.write_text(text)
    return str(p)


def _q(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


PLAN_PLACEMENT = place_packed((3, 4), 2, block_tokens=2)

CASES = {
    # ---- config -----------------------------------------------------------------------------------
    "config-unknown-graph": (lambda tp: FCPConfig(graph="mesh"), ValueError, "--fcp-graph"),
    "config-negative-block-tokens": (lambda tp: FCPConfig(block_tokens=-1), ValueError, "--fcp-block-tokens"),
    "config-zero-timeout": (lambda tp: FCPConfig(timeout_s=0), ValueError, "--fcp-timeout-s"),
    "config-nan-timeout": (lambda tp: FCPConfig(timeout_s=float("nan")), ValueError, "--fcp-timeout-s"),
    "config-fallback-ring": (lambda tp: FCPConfig(fallback="ring"), ValueError, "--fcp-fallback"),
    "config-check-numerics-not-bool": (lambda tp: FCPConfig(check_numerics="yes"), ValueError,
                                       "--fcp-check-numerics"),
    "config-unknown-yaml-key": (lambda tp: FCPConfig.from_dict({"grpah": "ring"}), ValueError, "unknown key"),
    "config-missing-topology-file": (lambda tp: FCPConfig(topology="nowhere/topo.yaml"), ValueError,
                                     "topology file not found"),
    "config-block-tokens-not-dividing": (lambda tp: FCPConfig(block_tokens=3).parts_per_chunk(8), ValueError,
                                         "must divide the zigzag chunk"),
    # ---- YAML topology ----------------------------------------------------------------------------------
    "topology-malformed-yaml": (lambda tp: load_topology(_yaml(tp, "nodes: [1, 2\nnode: {")), TopologyError,
                                "malformed YAML"),
    "topology-no-node": (lambda tp: load_topology(_yaml(tp, "nodes: 2\n")), TopologyError, "node: missing"),
    "topology-unknown-preset": (lambda tp: load_topology("nosuch:2"), TopologyError, "neither a preset"),
    "topology-zero-nodes": (lambda tp: load_topology("dgx-h100:0"), TopologyError, "nodes: must be"),
    "topology-smaller-than-world": (lambda tp: resolve_topology("dgx-h100:1", 16), ValueError, "describes 8 ranks"),
    # ---- graph ---------------------------------------------------------------------------------------------
    "graph-unknown-builder": (lambda tp: build_plan(_topo(), (0, 1, 2, 3), "mesh"), ValueError, "unknown builder"),
    "graph-rank-outside-topology": (lambda tp: build_plan(_topo(), (0, 1, 2, 99), "ring"), TopologyError,
                                    "rank 99 is missing"),
    "graph-duplicate-rank": (lambda tp: build_plan(_topo(), (0, 1, 1, 3), "ring"), ValueError, "appears twice"),
    "graph-empty-group": (lambda tp: build_plan(_topo(), (), "ring"), ValueError, "CP group is empty"),
    # ---- plan -----------------------------------------------------------------------------------------------
    "plan-endpoint-outside-group": (lambda tp: Plan((0, 1), ((Transfer(1, 5, Block(1, 0)),),), True).verify(),
                                    PlanError, "outside the CP group"),
    "plan-forward-before-arrival": (lambda tp: Plan((0, 1, 2), ((Transfer(2, 0, Block(1, 0)),),
                                                                (Transfer(1, 2, Block(1, 0)),)), False).verify(),
                                    PlanError, "before it has arrived"),
    "plan-received-twice": (lambda tp: Plan((0, 1), ((Transfer(1, 0, Block(1, 0)),),
                                                     (Transfer(1, 0, Block(1, 0)),)), True).verify(),
                            PlanError, "more than once"),
    "plan-missing-block": (lambda tp: Plan((0, 1), (), True).verify(), PlanError, "never receives"),
    "plan-other-group": (lambda tp: resolve_plan(ring_plan((1, 0)), (0, 1), True), ValueError,
                         "not the CP group's ranks"),
    "plan-ring-over-placement": (lambda tp: resolve_plan("ring", (0, 1), True, PLAN_PLACEMENT), ValueError,
                                 "zigzag shards only"),
    # ---- tensors ------------------------------------------------------------------------------------------------
    "tensor-3d-query-to-kernel": (lambda tp: block_attention_forward(_q(4, 2, 8), _q(4, 1, 2, 8), _q(4, 1, 2, 8),
                                                                     torch.arange(4), torch.arange(4), True, 1.0),
                                  ValueError, "expected q \\[n,b,h,d\\]"),
    "tensor-positions-length": (lambda tp: block_attention_forward(_q(4, 1, 2, 8), _q(4, 1, 2, 8), _q(4, 1, 2, 8),
                                                                   torch.arange(3), torch.arange(4), True, 1.0),
                                ValueError, "one entry per token"),
    "tensor-one-sided-doc-ids": (lambda tp: block_attention_forward(_q(4, 1, 2, 8), _q(4, 1, 2, 8), _q(4, 1, 2, 8),
                                                                    torch.arange(4), torch.arange(4), True, 1.0,
                                                                    q_doc=torch.zeros(4, dtype=torch.int64)),
                                 ValueError, "pass both q_doc and k_doc"),
    "tensor-kernel-fp64-cpu-flash": (lambda tp: resolve_kernel("cpu-flash", torch.float64, "cpu"), ValueError,
                                     "float32 / bfloat16 only"),
    "tensor-non-finite-output": (lambda tp: check_finite(torch.full((2, 1, 1, 4), float("nan")),
                                                         torch.zeros(1, 1, 2), "layer 1"),
                                 FCPNumericsError, "layer 1: out has 8 non-finite"),
    # ---- process groups and Megatron layout ---------------------------------------------------------------------
    "layout-world-not-divisible": (lambda tp: MegatronLayout(world=6, cp=4), ValueError, "not divisible"),
    "layout-zero-tp": (lambda tp: MegatronLayout(world=4, tp=0), ValueError, "--tensor-model-parallel-size"),
    "setup-seq-length-7-at-cp2": (lambda tp: setup_fcp(FCPConfig(enabled=True, topology="dgx-h100:1"),
                                                       layout=MegatronLayout(world=2, cp=2), groups={}, seq_len=7),
                                  ValueError, "--seq-length 7 must be divisible by 2 x"),
    "runtime-group-not-settled": (lambda tp: _runtime().plan((0, 3), causal=True), FCPStateError,
                                  "no FCP plan was settled for CP group \\[0, 3\\]"),
    "runtime-packed-group-not-in-layout": (lambda tp: _runtime().packed_plan((0, 3), (3, 4)), FCPStateError,
                                           "not a CP group of this run's layout"),
    "agreement-without-process-group": (lambda tp: _agree_without_group(), ValueError, "init_process_group"),
    # ---- packed-sequence metadata ----------------------------------------------------------------------------------
    "packed-cu-seqlens-not-from-0": (lambda tp: doc_lengths_of(_packed(cu_seqlens_q=[1, 5])), ValueError,
                                     "must start at 0"),
    "packed-cu-seqlens-decreasing": (lambda tp: doc_lengths_of(_packed(cu_seqlens_q=[0, 5, 5, 9])), ValueError,
                                     "must increase strictly"),
    "packed-one-entry": (lambda tp: doc_lengths_of(_packed(cu_seqlens_q=[0])), ValueError, "at least \\[0, n\\]"),
    "packed-kv-differs": (lambda tp: doc_lengths_of(_packed(cu_seqlens_kv=[0, 2, 7])), ValueError,
                          "cu_seqlens_kv must equal"),
    "packed-padded-variant": (lambda tp: doc_lengths_of(_packed(cu_seqlens_q_padded=[0, 4, 8])), ValueError,
                              "cu_seqlens_q_padded differs"),
    "packed-not-thd": (lambda tp: doc_lengths_of(_packed(qkv_format="sbhd")), ValueError, "must be 'thd'"),
    "packed-no-documents": (lambda tp: check_doc_lengths([]), ValueError, "the batch is empty"),
    "packed-empty-document": (lambda tp: check_doc_lengths([3, 0, 2]), ValueError, "at least 1 token"),
    "packed-shard-wrong-length": (lambda tp: PLAN_PLACEMENT.shard(torch.zeros(5), 0), ValueError,
                                  "has 5 tokens, the batch has 7"),
    "packed-cp-zero": (lambda tp: place_packed((3, 4), 0), ValueError, "cp: must be a positive integer"),
}


def _agree_without_group():
    import torch.distributed as dist

    from megatron_fcp.attention.agreement import agree

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    agree({"plan": 1})


def test_the_suite_has_at_least_30_distinct_malformed_inputs():
    assert len(CASES) >= 30
    areas = {name.split("-")[0] for name in CASES}
    assert {"config", "topology", "graph", "plan", "tensor", "layout", "packed"} <= areas


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_raises_its_catalogued_error(name, tmp_path):
    fn, error, words = CASES[name]
    with pytest.raises(error, match=words):
        fn(tmp_path)


def test_agreement_errors_are_runtime_errors_not_value_errors():
    """Catalogue contract: input mistakes are ValueError (or subclasses: PlanError, TopologyError);
    state and distributed failures are RuntimeError subclasses."""
    from megatron_fcp.attention.comm import CommTimeout

    assert issubclass(PlanError, ValueError) and issubclass(TopologyError, ValueError)
    assert issubclass(FCPAgreementError, RuntimeError) and issubclass(CommTimeout, RuntimeError)
    assert issubclass(FCPStateError, RuntimeError) and issubclass(FCPNumericsError, FloatingPointError)
