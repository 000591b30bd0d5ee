"""Cases of tests/test_attention_thd.py: THD attention over placements (packed batches).

Every case runs in the in-process harness (:func:`harness_case`: groups (0..3), (0, 2) and
(1, 3), (0, 1, 2), the reference computed once per group); a smaller set also runs on gloo
(:func:`worker`), with the bad-input probes. One world of 4 processes hosts the gloo cases:
cp = 4 on the world group, cp = 2 on the subgroups {0, 2} and {1, 3} side by side, and cp = 3 on
{0, 1, 2} (rank 3 sits those out). Each rank builds the packed batch from the case's seed, the placement with ``place_packed`` and the FP64 reference
per document (plain torch, every document attended alone), runs ``fcp_attention_with_lse`` on its
shard and reports its local errors; the parent takes maxima over ranks and asserts.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _attention_cases import count_problems, probe_bad_inputs  # the same checks, per-block bytes

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")
TOPOLOGY_2X2 = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "topology_2x2.yaml")

DOCS = {
    # many short and a few long documents, lengths divisible by nothing, total 227 (prime)
    "mix": (1, 37, 3, 5, 90, 2, 1, 7, 13, 61, 4, 1, 2),
    "one": (53,),                      # a single document, cut into blocks across all ranks
    "tiny": (1,),                      # one token: every rank but one holds nothing
    "short": (1, 1, 2, 1, 3, 1),       # short documents only: nothing to communicate
    "two-long": (29, 31),
    "twelve": (12,),                   # one document; "relay" places it by hand on two ranks, two empty
}


@dataclass(frozen=True)
class ThdCase:
    group: str            # "cp4" (world), "cp2" ({0,2} and {1,3}), "cp3" ({0,1,2})
    docs: str             # key of DOCS
    plan: str             # "none" (plan=None), "full" (by name), "full-plan" (a full_plan Plan), "hier",
                          # "relay" (every block routed through a rank without tokens)
    causal: bool
    dtype: str            # key of DTYPES
    kernel: str = "math"
    heads: tuple = (4, 2)
    isolate: bool = False  # also check that changing one document leaves the others bit-identical
    block_tokens: int = 8

    @property
    def name(self) -> str:
        return (f"{self.group}-{self.docs}-{self.plan}-{'causal' if self.causal else 'full'}-"
                f"h{self.heads[0]}kv{self.heads[1]}-{self.dtype}-{self.kernel}")


# the process-group path: relays, a compiled plan in BF16, cp = 2 side by side with isolation, cp = 3
GLOO_CASES = [
    ThdCase("cp4", "mix", "hier", True, "bf16"),
    ThdCase("cp4", "twelve", "relay", False, "fp64"),
    ThdCase("cp2", "mix", "full", True, "fp64", isolate=True),
    ThdCase("cp3", "one", "full-plan", True, "bf16", kernel="cpu-flash"),
]


def _packed(case: ThdCase, salt: str = ""):
    """Packed q, k, v, dout [T, h(_kv), d] in FP64 (same on every rank)."""
    h, hk = case.heads
    t, d = sum(DOCS[case.docs]), 8
    g = torch.Generator().manual_seed(zlib.crc32((case.name + salt).encode()))
    return [torch.randn(t, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h)]


def per_document_reference(q, k, v, do, lengths, causal: bool, scale: float) -> dict:
    """Each document attended alone by plain torch autograd (megatron_fcp.testing.harness)."""
    from megatron_fcp.testing.harness import per_document_reference as reference

    return reference(q, k, v, do, lengths, causal, scale)


def _plan_for(case: ThdCase, pl, ranks: tuple):
    from megatron_fcp.contract.plan import full_plan
    from megatron_fcp.planner.build import build_plan

    if case.plan == "none":
        return None
    if case.plan == "full":
        return "full"
    if case.plan == "full-plan":
        return full_plan(ranks, case.causal, placement=pl)
    if case.plan == "hier":
        return build_plan(TOPOLOGY_2X2, ranks, "hierarchical", causal=case.causal, placement=pl)
    if case.plan == "relay":  # round 0: owners -> an empty rank; round 1: it forwards to the readers
        from megatron_fcp.contract.blocks import Transfer
        from megatron_fcp.contract.plan import Plan

        relay = next(r for i, r in enumerate(ranks) if pl.tokens(i) == 0)
        direct = full_plan(ranks, case.causal, placement=pl)
        blocks = sorted({t.block for _, t in direct.transfers()})
        first = tuple(Transfer(b.owner, relay, b) for b in blocks)
        second = tuple(Transfer(relay, t.dst, t.block) for _, t in direct.transfers())
        return Plan(ranks, (first, second), case.causal, name="relay", placement=pl).verify()
    raise ValueError(case.plan)


def _shard(pl, x, idx: int, lse: bool = False):
    return pl.shard(x.transpose(0, 1), idx).transpose(0, 1) if lse else pl.shard(x, idx)


def _placement(case: ThdCase, cp: int):
    from megatron_fcp.contract.placement import place_packed

    lengths = DOCS[case.docs]
    if case.plan == "relay":  # by hand: two ranks hold the document, the others nothing (relays)
        from megatron_fcp.contract.placement import Placement, Span

        (n,) = lengths
        blocks = ((Span(0, 0, n // 2),), (Span(0, n // 2, n),)) + ((),) * (cp - 2)
        return Placement(tuple(lengths), blocks, case.causal)
    return place_packed(lengths, cp, block_tokens=case.block_tokens, causal=case.causal)


def _reference(case: ThdCase, pl) -> dict:
    """The FP64 per-document reference of the packed batch and (BF16) plain-BF16 attention."""
    q, k, v, do = _packed(case)
    scale = 1.0 / math.sqrt(q.shape[-1])
    lengths = DOCS[case.docs]
    ref = per_document_reference(q, k, v, do, lengths, case.causal, scale)
    base = None
    if case.dtype == "bf16":
        base = per_document_reference(*(x.to(DTYPES[case.dtype]) for x in (q, k, v, do)), lengths, case.causal, scale)
    return {"inputs": (q, k, v, do), "ref": ref, "base": base}


def _rank_report(case: ThdCase, setup: dict, pl, ranks: tuple, idx: int, got: dict, transport, plan) -> dict:
    """One rank's errors against its shard of the reference, shapes, dtypes, transfer problems."""
    dt = DTYPES[case.dtype]
    q = setup["inputs"][0]
    local = {n: _shard(pl, x, idx, n == "lse") for n, x in setup["ref"].items()}
    res = {"rank": ranks[idx], "tokens": pl.tokens(idx), "plan_name": plan.name,
           "ref_max": {n: local[n].abs().max().item() if local[n].numel() else 0.0 for n in QUANTITIES}}
    if setup["base"] is not None:
        res["base_err"] = {n: _err(_shard(pl, setup["base"][n], idx, n == "lse"), local[n]) for n in QUANTITIES}
        res["atol"] = {n: 2 * _err((local[n].to(dt) + 0.3 - 0.3), local[n].to(dt)) for n in QUANTITIES}
    res["shapes"] = {n: tuple(t.shape) for n, t in got.items()}
    res["want_shapes"] = {n: tuple(t.shape) for n, t in local.items()}
    res["dtypes"] = {n: str(t.dtype) for n, t in got.items()}
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in got.values())
    res["err"] = {n: _err(got[n], local[n]) for n in QUANTITIES}
    h, hk = case.heads
    elems = lambda b: 2 * pl.blocks[ranks.index(b.owner)][b.chunk].tokens * hk * q.shape[-1]  # noqa: E731
    itemsize = got["out"].element_size()  # KV and dK/dV partials both travel in the input dtype
    res["sent"] = len([p for p in transport.posted if p.kind == "send"])
    from megatron_fcp.schedule.program import BackwardPolicy, compile_backward
    program = compile_backward(plan, 2 * hk * q.shape[-1] * itemsize, BackwardPolicy())  # the API's default
    res["count_problems"] = count_problems(transport, plan, ranks[idx], lambda b: elems(b) * itemsize,
                                           lambda b: elems(b) * itemsize, wire_dtype=got["out"].dtype,
                                           program=program)
    return res


def _public_api(case: ThdCase, group, pl, idx: int, plan_arg, inputs, out) -> bool:
    """The public entry point computes the same output, with and without autograd."""
    import megatron_fcp

    q, k, v, _ = inputs
    public = megatron_fcp.fcp_attention(*(pl.shard(x, idx) for x in (q, k, v)), cp_group=group,
                                        placement=pl, plan=plan_arg, causal=case.causal)
    with torch.no_grad():
        inf = megatron_fcp.fcp_attention(*(pl.shard(x, idx).requires_grad_() for x in (q, k, v)),
                                         cp_group=group, placement=pl, plan=plan_arg, causal=case.causal)
    return bool(torch.equal(public, out)) and bool(torch.equal(inf, out))


def _run_case(case: ThdCase, group, ranks: tuple, rank: int) -> dict:
    """One gloo rank: fcp_attention_with_lse through autograd on the process group."""
    from megatron_fcp.attention.function import fcp_attention_with_lse, resolve_plan
    from megatron_fcp.attention.comm import CountingTransport, GlooTransport, SerialTransport

    cp, idx = len(ranks), ranks.index(rank)
    pl = _placement(case, cp)
    dt = DTYPES[case.dtype]
    setup = _reference(case, pl)
    plan_arg = _plan_for(case, pl, ranks)
    plan = resolve_plan(plan_arg, ranks, case.causal, pl)

    def run_once(inputs, serial: bool = False):
        transport = CountingTransport(GlooTransport(group, timeout_s=60))
        executed_by = SerialTransport(transport) if serial else transport
        ql, kl, vl = (pl.shard(x.to(dt), idx).requires_grad_() for x in inputs[:3])
        out, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=group, placement=pl, plan=plan_arg,
                                          causal=case.causal, transport=executed_by, kernel=case.kernel)
        out.backward(pl.shard(inputs[3].to(dt), idx))
        return {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}, transport

    got, transport = run_once(setup["inputs"])
    res = _rank_report(case, setup, pl, ranks, idx, got, transport, plan)
    again, _ = run_once(setup["inputs"], serial=True)
    res["bitwise_repeat"] = all(torch.equal(got[n], again[n]) for n in QUANTITIES)
    if case.dtype == "fp64":
        res["public_api_equal"] = _public_api(case, group, pl, idx, plan_arg, setup["inputs"], got["out"])
    if case.isolate:
        res["isolation"] = _isolation(case, pl, idx, lambda inputs: run_once(inputs)[0], got)
    return res


def harness_case(case: ThdCase) -> list[dict]:
    """The same per-rank reports as the gloo workers', from the in-process harness: cp = 4 on
    ranks 0..3, cp = 2 on the pairs (0, 2) and (1, 3), cp = 3 on (0, 1, 2)."""
    from megatron_fcp.attention.function import resolve_plan
    from megatron_fcp.testing.harness import harness_attention
    from megatron_fcp.attention.comm import CountingTransport, SerialTransport
    from megatron_fcp.testing.inprocess import run_ranks

    groups = {"cp4": [(0, 1, 2, 3)], "cp2": [(0, 2), (1, 3)], "cp3": [(0, 1, 2)]}[case.group]
    dt = DTYPES[case.dtype]
    reports = []
    for ranks in groups:
        pl = _placement(case, len(ranks))
        setup = _reference(case, pl)
        plan_arg = _plan_for(case, pl, ranks)
        plan = resolve_plan(plan_arg, ranks, case.causal, pl)

        def run_once(inputs, serial: bool = False):
            wrap = (lambda r, t: SerialTransport(CountingTransport(t))) if serial else \
                (lambda r, t: CountingTransport(t))
            return harness_attention(*(x.to(dt) for x in inputs), ranks=ranks, placement=pl, plan=plan_arg,
                                     causal=case.causal, kernel=case.kernel, transport=wrap).ranks

        got = run_once(setup["inputs"])
        again = run_once(setup["inputs"], serial=True)
        public = None
        if case.dtype == "fp64":
            public = run_ranks(ranks, lambda h: _public_api(case, h, pl, h.index, plan_arg, setup["inputs"],
                                                            got[h.index].out), timeout_s=60)
        changed: list = []  # the run with one document replaced, shared by the ranks' isolation checks

        def changed_run(inputs, idx):
            if not changed:
                changed.append(run_once(inputs))
            return changed[0][idx].tensors()

        for idx, r in enumerate(got):
            rep = _rank_report(case, setup, pl, ranks, idx, r.tensors(), r.transport, plan)
            rep["bitwise_repeat"] = all(torch.equal(r.tensors()[n], again[idx].tensors()[n]) for n in QUANTITIES)
            if public is not None:
                rep["public_api_equal"] = public[idx]
            if case.isolate:
                rep["isolation"] = _isolation(case, pl, idx, lambda inputs: changed_run(inputs, idx), r.tensors())
            reports.append(rep)
    return reports


def _isolation(case: ThdCase, pl, idx: int, run_once, got) -> dict:
    """Replace every token of one long document (q, k, v and dout); the other documents' out, lse,
    dq, dk, dv must stay bit-identical on every rank and the changed document's must change."""
    lengths = DOCS[case.docs]
    changed = max(range(len(lengths)), key=lambda d: lengths[d])
    q, k, v, do = _packed(case)
    q2, k2, v2, do2 = _packed(case, salt="other")
    start = sum(lengths[:changed])
    sl = slice(start, start + lengths[changed])
    for x, y in ((q, q2), (k, k2), (v, v2), (do, do2)):
        x[sl] = y[sl]
    other = run_once((q, k, v, do))
    docs = torch.from_numpy(pl.doc_ids(idx))
    keep, moved = docs != changed, docs == changed
    same = all(torch.equal(_rows(got[n], keep, n), _rows(other[n], keep, n)) for n in QUANTITIES)
    differs = bool(moved.any()) and not torch.equal(_rows(got["out"], moved, "out"), _rows(other["out"], moved, "out"))
    return {"others_bit_identical": same, "changed_doc_differs": differs, "rank_holds_changed": bool(moved.any())}


def _rows(x, mask, name):
    return x[:, mask] if name == "lse" else x[mask]


def _err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


class _NoDocumentKernel:
    """Stand-in for a third-party block kernel without document masks (built lazily: spawn-safe)."""

    @staticmethod
    def make():
        from megatron_fcp.attention.kernels import MathKernel

        class NoDocs(MathKernel):
            name = "no-docs"
            documents = False

        return NoDocs()


def _bad_inputs(group, ranks: tuple, rank: int) -> dict:
    """Each bad THD call must raise ValueError naming the fix, before posting anything."""
    from megatron_fcp.contract.placement import place_packed
    from megatron_fcp.contract.plan import full_plan, ring_plan

    cp, idx = len(ranks), ranks.index(rank)
    pl = place_packed(DOCS["mix"], cp, block_tokens=8)
    other = place_packed(DOCS["two-long"], cp, block_tokens=8)
    n = pl.tokens(idx)

    def t(tokens=n, heads=4, dtype=torch.float32):
        return torch.randn(tokens, heads, 8, dtype=dtype)

    ok = dict(q=t(), k=t(heads=2), v=t(heads=2))
    cases = {
        "tokens": (dict(q=t(n + 1), k=t(n + 1, 2), v=t(n + 1, 2)), {}, r"holds \d+ tokens.*placement\.shard"),
        "plan_other_placement": (ok, dict(plan=full_plan(ranks, True, placement=other)), "different placement"),
        "zigzag_plan": (ok, dict(plan=ring_plan(ranks)), "zigzag plan.*placement=placement"),
        "ring_by_name": (ok, dict(plan="ring"), "zigzag shards only.*plan='full'"),
        "causal": (ok, dict(causal=False), r"causal=True.*place_packed\(\.\.\., causal=False\)"),
        "plan_causal": (ok, dict(plan=full_plan(ranks, False, placement=place_packed(DOCS["mix"], cp, block_tokens=8,
                                                                                      causal=False))),
                        "causal=False"),
        "4d": (dict(q=t()[:, None], k=t(heads=2)[:, None], v=t(heads=2)[:, None]), {}, "3-D tensor.*THD"),
        "cp": (ok, dict(placement=place_packed(DOCS["mix"], cp + 1)), f"cp={cp + 1}.*place_packed"),
        "not_a_placement": (ok, dict(placement=[1, 2]), "must be a megatron_fcp.planning.Placement"),
        "kernel": (ok, dict(kernel=_NoDocumentKernel.make()), "no document mask.*kernel='auto'"),
        "dtype": (dict(q=t(), k=t(heads=2, dtype=torch.float64), v=t(heads=2)), {}, "dtypes differ"),
        "heads": (dict(q=t(), k=t(heads=3), v=t(heads=3)), {}, "multiple of KV heads"),
        "zigzag_call_with_placement_plan": (dict(q=t(8)[:, None], k=t(8, 2)[:, None], v=t(8, 2)[:, None]),
                                            dict(placement=None, plan=full_plan(ranks, True, placement=pl)),
                                            "over a placement.*placement=plan.placement"),
    }
    return probe_bad_inputs(cases, group, placement=pl, plan=None, causal=True)


def worker(rank: int, world: int, cases: list) -> dict:
    torch.manual_seed(1234 + rank)
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    trio = dist.new_group([0, 1, 2])
    groups = {"cp4": (dist.group.WORLD, tuple(range(world))),
              "cp2": (pairs[rank % 2], (0, 2) if rank % 2 == 0 else (1, 3)),
              "cp3": (trio, (0, 1, 2)) if rank < 3 else None}
    results = {}
    for case in cases:
        if groups[case.group] is None:
            continue
        group, ranks = groups[case.group]
        results[case.name] = _run_case(case, group, ranks, rank)
    results["bad_inputs_cp4"] = _bad_inputs(*groups["cp4"], rank)
    return results
