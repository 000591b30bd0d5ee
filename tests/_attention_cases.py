"""Cases of tests/test_attention_dist.py, run two ways with the same per-rank reports.

* In process (:func:`harness_case`): the whole numerics matrix runs in the in-process harness
  (:mod:`megatron_fcp.testing.harness`): cp = 4 on ranks 0..3, cp = 2 on the pairs (0, 2)
  and (1, 3), the FP64 reference computed once per group.
* On gloo (:func:`worker`): one world of 4 processes hosts a smaller set of cases (cp = 4 on the
  world group, cp = 2 on subgroups {0, 2} and {1, 3} side by side, so CP ranks differ from global
  ranks, as with TP > 1), the bad-input probes, the bounded-wait probe, and the cases the harness
  must reproduce bit for bit (tests/_harness_cases.py). Each rank rebuilds the global tensors from
  the case's seed, computes the FP64 reference (and, for BF16, plain PyTorch attention in BF16)
  itself, runs fcp_attention through autograd on its zigzag shard and reports its local errors.

The parent takes maxima over ranks and asserts.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")


@dataclass(frozen=True)
class Case:
    group: str            # "cp4" (world) or "cp2" (pairs {0,2} and {1,3})
    plan: str             # "ring" | "full"
    causal: bool
    heads: tuple          # (h, h_kv)
    dtype: str            # key of DTYPES
    parts: int = 1        # parts_per_chunk (1: plan given by name, >1: Plan object)
    extreme: bool = False  # logits spread over ~1e4 between blocks (softmax_scale = 1)
    tokens_per_part: int = 4
    kernel: str = "math"  # block kernel (megatron_fcp.attention.kernels.BLOCK_KERNELS)

    @property
    def name(self) -> str:
        return (f"{self.group}-{self.plan}-{'causal' if self.causal else 'full'}-h{self.heads[0]}kv{self.heads[1]}"
                f"-{self.dtype}" + (f"-p{self.parts}" if self.parts > 1 else "") + ("-extreme" if self.extreme else "")
                + (f"-{self.kernel}" if self.kernel != "math" else ""))


# the process-group path: every kind of case once (cp 4 / 2, ring / full, parts, both kernels, BF16 extreme)
GLOO_CASES = [
    Case("cp4", "ring", True, (4, 2), "fp64"),
    Case("cp2", "full", False, (4, 4), "fp32"),
    Case("cp2", "ring", True, (4, 2), "fp32", parts=2),
    Case("cp4", "full", True, (4, 2), "bf16", extreme=True, kernel="cpu-flash"),
    Case("cp2", "ring", True, (4, 2), "bf16", parts=2, kernel="cpu-flash"),
]


def assert_within_tolerance(err: dict, ref: dict, base: dict | None, atol: dict | None, dtype: str,
                            dtypes: dict) -> None:
    """The numerics rule of every attention test, per tensor of ``QUANTITIES``: FP64 within 1e-12 and
    FP32 within 1e-5 of the FP64 reference (relative to max(1, max|ref|)); BF16 within 2 x plain
    BF16 attention's error + ``atol`` and under 2^-6 relative. ``dtypes``: the results' dtypes."""
    want = {"fp64": "torch.float64", "fp32": "torch.float32", "bf16": "torch.bfloat16"}[dtype]
    assert dtypes["out"] == dtypes["dq"] == dtypes["dk"] == dtypes["dv"] == want
    assert dtypes["lse"] == ("torch.float64" if dtype == "fp64" else "torch.float32")
    for n in QUANTITIES:
        if dtype in ("fp64", "fp32"):
            tol = 1e-12 if dtype == "fp64" else 1e-5
            assert err[n] <= tol * max(1.0, ref[n]), f"{n}: error {err[n]:.3g} vs max|ref| {ref[n]:.3g}"
        else:
            assert err[n] <= 2 * base[n] + atol[n], (
                f"{n}: error {err[n]:.3g} > 2 x plain-BF16 error {base[n]:.3g} + {atol[n]:.3g}")
            assert err[n] <= 2 ** -6 * max(1.0, ref[n]), f"{n}: error {err[n]:.3g} vs max|ref| {ref[n]:.3g}"


def _inputs(case: Case, cp: int):
    """Global q, k, v, dout [s, b, h(_kv), d] in the case dtype (same on every rank)."""
    h, hk = case.heads
    b, d = 2, 16
    s = 2 * cp * case.parts * case.tokens_per_part
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))  # same on every rank
    q = torch.randn(s, b, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(s, b, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(s, b, hk, d, generator=g, dtype=torch.float64)
    do = torch.randn(s, b, h, d, generator=g, dtype=torch.float64)
    if case.extreme:
        # score = q.k with scale 1: component 0 adds 1e4 * c / (2cp - 1) for keys in global chunk c
        chunk = s // (2 * cp)
        q[..., 0] = 1.0
        for c in range(2 * cp):
            k[c * chunk:(c + 1) * chunk, :, :, 0] = 1e4 * c / (2 * cp - 1)
    dt = DTYPES[case.dtype]
    return [x.to(dt) for x in (q, k, v, do)]


def count_problems(transport, plan, rank, kv_bytes, grad_bytes, wire_dtype=None, program=None) -> list[str]:
    """Compare what the transport saw with the plan: forward ``plan.sends/recvs`` per round (in plan
    order); backward every posted round (phase, round, sends, receives, in post order) against the
    backward program the executor compiled (``program.posts(rank)``: Note [Backward program]).
    ``kv_bytes``/``grad_bytes``: bytes of every message, or a function of its block (blocks of a
    packed batch differ in size). ``wire_dtype``: the dtype every message must travel in, KV and
    dK/dV partials alike (the input dtype)."""
    from megatron_fcp.schedule.program import ProgramPost

    problems = []
    expected_total = 0
    for r in range(len(plan.rounds)):
        for kind, expected in (("send", plan.sends(rank, r)), ("recv", plan.recvs(rank, r))):
            got = transport.transfers("forward", r, kind)
            expected_total += len(expected)
            if got != expected:
                problems.append(f"rank {rank} forward round {r} {kind}: got {got}, plan says {expected}")
    posted = [ProgramPost(ph, i, sd, rv) for ph, i, sd, rv in transport.rounds if ph != "forward"]
    want = list(program.posts(rank)) if program is not None else []
    expected_total += sum(len(p.sends) + len(p.recvs) for p in want)
    if posted != want:
        bad = next(i for i, (a, b) in enumerate(zip(posted + [None] * len(want), want + [None] * len(posted)))
                   if a != b)
        problems.append(f"rank {rank} backward post {bad}: got {posted[bad] if bad < len(posted) else None}, "
                        f"the program says {want[bad] if bad < len(want) else None}")
    if len(transport.posted) != expected_total:
        problems.append(f"rank {rank}: {len(transport.posted)} ops posted, plan lists {expected_total}")
    for p in transport.posted:
        want_bytes = grad_bytes if p.phase == "backward" else kv_bytes
        want_bytes = want_bytes(p.transfer.block) if callable(want_bytes) else want_bytes
        if p.nbytes != want_bytes:
            problems.append(f"rank {rank}: {p} moves {p.nbytes} bytes, expected {want_bytes}")
        if wire_dtype is not None and p.dtype != wire_dtype:
            problems.append(f"rank {rank}: {p} travels in {p.dtype}, expected {wire_dtype}")
    return problems


def _reference(case: Case, cp: int) -> dict:
    """The case's global inputs, FP64 reference and (BF16) plain-BF16 attention and rounding slack."""
    from megatron_fcp.attention.kernels import reference_attention

    q, k, v, do = _inputs(case, cp)
    scale = 1.0 if case.extreme else None
    ref_scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ref = reference_attention(q.double(), k.double(), v.double(), causal=case.causal, scale=ref_scale,
                              dout=do.double())
    base = None
    if case.dtype != "fp64" and case.dtype != "fp32":
        base = reference_attention(q, k, v, causal=case.causal, scale=ref_scale, dout=do)
    return {"inputs": (q, k, v, do), "scale": scale, "ref": ref, "base": base}


def _plan_arg(case: Case, group_ranks: tuple):
    from megatron_fcp.contract.plan import full_plan, ring_plan

    if case.parts > 1:
        builder = ring_plan if case.plan == "ring" else full_plan
        return builder(group_ranks, causal=case.causal, parts_per_chunk=case.parts)
    return case.plan


def _rank_report(case: Case, setup: dict, cp: int, idx: int, rank: int, got: dict, transport, plan) -> dict:
    """One rank's errors against its shard of the reference, dtypes, and transfer problems."""
    from megatron_fcp.attention.layout import zigzag_split

    q = setup["inputs"][0]
    local = {n: zigzag_split(x, cp, idx, seq_dim=2 if n == "lse" else 0) for n, x in setup["ref"].items()}
    res = {"rank": rank, "ref_max": {n: local[n].abs().max().item() for n in QUANTITIES}}
    if setup["base"] is not None:
        base = setup["base"]
        res["base_err"] = {n: (zigzag_split(base[n], cp, idx, seq_dim=2 if n == "lse" else 0).double()
                               - local[n]).abs().max().item() for n in QUANTITIES}
        dt = DTYPES[case.dtype]
        res["atol"] = {n: 2 * ((local[n].to(dt) + 0.3 - 0.3) - local[n].to(dt)).abs().max().item()
                       for n in QUANTITIES}
    res["dtypes"] = {n: str(t.dtype) for n, t in got.items()}
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in got.values())
    res["err"] = {n: (got[n].double() - local[n]).abs().max().item() for n in QUANTITIES}
    h, hk = case.heads
    blk = q.shape[0] // cp // (2 * case.parts)
    elems = 2 * blk * q.shape[1] * hk * q.shape[3]
    # dK/dV partials travel in the input dtype, like the KV (Note [Backward pipeline])
    from megatron_fcp.schedule.program import BackwardPolicy, compile_backward
    program = compile_backward(plan, 2 * q.shape[1] * hk * q.shape[3] * q.element_size(), BackwardPolicy(),
                               seq_len=q.shape[0])                       # what the API's default compiles
    res["count_problems"] = count_problems(transport, plan, rank, elems * q.element_size(), elems * q.element_size(),
                                           wire_dtype=q.dtype, program=program)
    return res


def _run_case(case: Case, group, group_ranks: tuple, rank: int) -> dict:
    """One gloo rank: fcp_attention_with_lse through autograd on the process group."""
    from megatron_fcp.attention.function import fcp_attention_with_lse, resolve_plan
    from megatron_fcp.attention.layout import zigzag_split
    from megatron_fcp.attention.comm import CountingTransport, GlooTransport, SerialTransport

    cp, idx = len(group_ranks), group_ranks.index(rank)
    setup = _reference(case, cp)
    q, k, v, do = setup["inputs"]
    scale = setup["scale"]
    plan_arg = _plan_arg(case, group_ranks)
    plan = resolve_plan(plan_arg, group_ranks, case.causal)

    def run_once(serial: bool = False):
        transport = CountingTransport(GlooTransport(group, timeout_s=60))
        # serial: every round waited for as soon as it is posted (--no-fcp-overlap)
        executed_by = SerialTransport(transport) if serial else transport
        ql, kl, vl = (zigzag_split(x, cp, idx).requires_grad_() for x in (q, k, v))
        out, lse = fcp_attention_with_lse(ql, kl, vl, cp_group=group, plan=plan_arg, causal=case.causal,
                                          softmax_scale=scale, transport=executed_by, kernel=case.kernel)
        out.backward(zigzag_split(do, cp, idx))
        got = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        return got, transport

    got, transport = run_once()
    res = _rank_report(case, setup, cp, idx, rank, got, transport, plan)
    if case.dtype == "fp64" and case.parts == 1:
        res.update(_public_api(case, group, cp, idx, setup, got["out"]))
    if case.dtype in ("fp32", "bf16"):
        # same plan again, without overlap this time: timing must never change the arithmetic
        again, _ = run_once(serial=True)
        res["bitwise_repeat"] = all(torch.equal(got[n], again[n]) for n in QUANTITIES)
    return res


def _public_api(case: Case, group, cp: int, idx: int, setup: dict, out) -> dict:
    """The public entry point (lazily exported by megatron_fcp) computes the same output, with
    and without autograd (inference keeps no blocks for a backward)."""
    import megatron_fcp
    from megatron_fcp.attention.layout import zigzag_split

    q, k, v, _ = setup["inputs"]
    public = megatron_fcp.fcp_attention(*(zigzag_split(x, cp, idx) for x in (q, k, v)), cp_group=group,
                                        plan=case.plan, causal=case.causal, softmax_scale=setup["scale"])
    with torch.no_grad():
        ql, kl, vl = (zigzag_split(x, cp, idx).requires_grad_() for x in (q, k, v))
        inf = megatron_fcp.fcp_attention(ql, kl, vl, cp_group=group, plan=case.plan, causal=case.causal,
                                         softmax_scale=setup["scale"])
    return {"public_api_equal": bool(torch.equal(public, out)),
            "no_grad_equal": bool(torch.equal(inf, out)) and inf.grad_fn is None}


def harness_case(case: Case) -> list[dict]:
    """The same reports as the gloo workers', from the in-process harness: cp = 4 on ranks 0..3,
    cp = 2 on the pairs (0, 2) and (1, 3) (CP ranks differ from global ranks); the reference is
    computed once per group instead of once per rank."""
    from megatron_fcp.attention.function import resolve_plan
    from megatron_fcp.testing.harness import harness_attention
    from megatron_fcp.attention.comm import CountingTransport, SerialTransport
    from megatron_fcp.testing.inprocess import run_ranks

    reports = []
    for ranks in ([(0, 1, 2, 3)] if case.group == "cp4" else [(0, 2), (1, 3)]):
        cp = len(ranks)
        setup = _reference(case, cp)
        plan_arg = _plan_arg(case, ranks)
        plan = resolve_plan(plan_arg, ranks, case.causal)

        def run_once(serial: bool = False):
            wrap = (lambda r, t: SerialTransport(CountingTransport(t))) if serial else \
                (lambda r, t: CountingTransport(t))
            res = harness_attention(*setup["inputs"], ranks=ranks, plan=plan_arg, causal=case.causal,
                                    softmax_scale=setup["scale"], kernel=case.kernel, transport=wrap)
            return res.ranks

        got = run_once()
        again = run_once(serial=True) if case.dtype in ("fp32", "bf16") else None
        public = None
        if case.dtype == "fp64" and case.parts == 1:
            public = run_ranks(ranks, lambda h: _public_api(case, h, cp, h.index, setup, got[h.index].out),
                               timeout_s=60)
        for idx, (rank, r) in enumerate(zip(ranks, got)):
            counting = r.transport
            rep = _rank_report(case, setup, cp, idx, rank, r.tensors(), counting, plan)
            if again is not None:
                rep["bitwise_repeat"] = all(torch.equal(r.tensors()[n], again[idx].tensors()[n]) for n in QUANTITIES)
            if public is not None:
                rep.update(public[idx])
            reports.append(rep)
    return reports


def _bad_inputs(group, group_ranks: tuple, rank: int) -> dict:
    """Each bad call must raise ValueError naming the fix, before posting anything."""
    from megatron_fcp.contract.plan import ring_plan

    def t(s=8, b=2, h=4, d=8, dtype=torch.float32, device="cpu"):
        return torch.randn(s, b, h, d, dtype=dtype, device=device)

    ranks = group_ranks
    cases = {
        "odd_seq": (dict(q=t(s=5), k=t(s=5, h=2), v=t(s=5, h=2)), {}, "multiple of 2\\*cp"),
        # uneven parts are fine (Note [Sub-block sizes]); more parts than a chunk has tokens are not
        "more_parts_than_tokens": (dict(q=t(s=6), k=t(s=6), v=t(s=6)),
                                   dict(plan=ring_plan(ranks, True, parts_per_chunk=4)), "parts_per_chunk <= 3"),
        "heads": (dict(q=t(h=4), k=t(h=3), v=t(h=3)), {}, "multiple of KV heads"),
        "dtype": (dict(q=t(), k=t(dtype=torch.float64), v=t()), {}, "dtypes differ"),
        "device": (dict(q=t(), k=t(device="meta"), v=t()), {}, "different devices"),
        "seq_shape": (dict(q=t(s=8), k=t(s=10), v=t(s=10)), {}, "must agree on s_local"),
        "kv_shape": (dict(q=t(), k=t(h=2), v=t(h=4)), {}, "must agree on every dim but the head size"),
        "plan_ranks": (dict(q=t(), k=t(), v=t()), dict(plan=ring_plan(tuple(reversed(ranks)))),
                       "not the CP group's ranks"),
        "plan_causal": (dict(q=t(), k=t(), v=t()), dict(plan=ring_plan(ranks, causal=False)), "causal=False"),
        "plan_name": (dict(q=t(), k=t(), v=t()), dict(plan="tree"), "unknown plan"),
        "no_group": (dict(q=t(), k=t(), v=t()), dict(cp_group=None), "cp_group is required"),
        "not_4d": (dict(q=t()[0], k=t(), v=t()), {}, "4-D tensor"),
        "kernel_name": (dict(q=t(), k=t(), v=t()), dict(kernel="flash"), "unknown block kernel 'flash'"),
        "kernel_fp64": (dict(q=t(dtype=torch.float64), k=t(dtype=torch.float64), v=t(dtype=torch.float64)),
                        dict(kernel="cpu-flash"), "float32 / bfloat16 only.*kernel='math'"),
    }
    return probe_bad_inputs(cases, group, plan="ring", causal=True)


def probe_bad_inputs(cases: dict, group, **defaults) -> dict:
    """Run each bad case through fcp_attention_with_lse (``defaults`` overridden by the case's
    kwargs) with a counting transport: name -> (error text or "no error", posts made, expected)."""
    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.comm import CountingTransport, GlooTransport

    out = {}
    for name, (tensors, kwargs, expect) in cases.items():
        transport = CountingTransport(GlooTransport(group, timeout_s=10))
        kw = dict(cp_group=group, transport=transport, **defaults)
        kw.update(kwargs)
        try:
            fcp_attention_with_lse(tensors["q"], tensors["k"], tensors["v"], **kw)
            out[name] = ("no error", transport.posts, expect)
        except ValueError as e:
            out[name] = (str(e), transport.posts, expect)
    return out


def expect_timeout(rank: int, probe) -> str | None:
    """Rank 0 runs ``probe`` (a wait on a peer that never answers) and returns the CommTimeout's
    message ("no timeout" if it returned); rank 1 stays alive meanwhile. A timed-out gloo exchange
    breaks the group (as an NCCL timeout breaks the communicator), so callers run this last."""
    import time

    from megatron_fcp.attention.comm import CommTimeout

    if rank == 0:
        try:
            probe()
            return "no timeout"
        except CommTimeout as e:
            return str(e)
    if rank == 1:
        time.sleep(2.0)
    return None


def _timeout_probe(rank: int) -> str | None:
    """Rank 0 waits for a block rank 1 never sends: the bounded wait must raise, naming round,
    peer and block."""
    from megatron_fcp.attention.comm import GlooTransport
    from megatron_fcp.contract.blocks import Block, Transfer

    def probe():
        transport = GlooTransport(dist.group.WORLD, timeout_s=0.5)
        transport.wait(transport.post([], [(Transfer(1, 0, Block(1, 0)), torch.zeros(4))], round_index=3))

    return expect_timeout(rank, probe)


def _test_probe(rank: int) -> dict | None:
    """Ranks 0 and 1 exchange 64 KB both ways, rank 1 posting 0.3 s late: ``test`` must say False
    before the peer posts and True once the bytes moved, without any ``wait`` (gloo's own
    ``is_completed`` stays False until ``wait``: Note [Testing a gloo round])."""
    import time

    from megatron_fcp.attention.comm import GlooTransport
    from megatron_fcp.contract.blocks import Block, Transfer

    dist.barrier()
    if rank > 1:
        return None
    peer = 1 - rank
    transport = GlooTransport(dist.group.WORLD, timeout_s=30)
    send = torch.full((16384,), float(rank + 1))
    recv = torch.zeros(16384)
    if rank == 1:
        time.sleep(0.3)
    h = transport.post([(Transfer(rank, peer, Block(rank, 0)), send)], [(Transfer(peer, rank, Block(peer, 0)), recv)],
                       round_index=0)
    early = transport.test(h)
    t0 = time.monotonic()
    while not transport.test(h) and time.monotonic() - t0 < 10:
        time.sleep(0.005)
    late = transport.test(h)
    transport.wait(h)  # returns at once; moves nothing more
    return {"early": early, "late": late, "received": float(recv[0]), "all_same": bool((recv == recv[0]).all())}


def worker(rank: int, world: int, cases: list) -> dict:
    torch.manual_seed(1234 + rank)
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = {"cp4": (dist.group.WORLD, tuple(range(world))),
              "cp2": (pairs[rank % 2], (0, 2) if rank % 2 == 0 else (1, 3))}
    results = {}
    for case in cases:
        group, ranks = groups[case.group]
        results[case.name] = _run_case(case, group, ranks, rank)
    results["bad_inputs_cp4"] = _bad_inputs(*groups["cp4"], rank)
    results["bad_inputs_cp2"] = _bad_inputs(*groups["cp2"], rank)
    try:
        from megatron_fcp.attention.comm import NcclTransport

        NcclTransport(dist.group.WORLD)
        results["nccl_gate"] = "constructed on a gloo group"
    except ValueError as e:
        results["nccl_gate"] = str(e)
    from _harness_cases import gloo_bitwise

    results["bitwise"] = gloo_bitwise(*groups["cp4"], rank)  # the harness must reproduce these bit for bit
    results["test"] = _test_probe(rank)
    results["timeout"] = _timeout_probe(rank)  # last: the group is unusable after a timeout
    return results
