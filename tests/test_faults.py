"""Fault drills on real gloo processes: a CP rank SIGKILLed in the middle of attention.

One world of 6 processes, two CP groups of 3 side by side: in {0, 1, 2} rank 1 kills itself
(SIGKILL) as it posts forward round 1, in {3, 4, 5} rank 4 kills itself as it posts its first
backward round (the ring's streaming backward, step 0). Every other rank of each group must raise
CommTimeout naming phase, round, peer, block and plan within ``timeout + 10 s`` -- whether it
finds the peer gone while waiting or already when posting (gloo refuses a send to a closed
connection) -- and no process may be left behind. The warm-up call of
each group agrees on the plan, so the drill's call skips the agreement and dies in the transfers.
"""

from __future__ import annotations

import os
import time

import pytest

from megatron_fcp.testing.launch import run_gloo

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TIMEOUT_S = 4.0
GROUPS = ((0, 1, 2), (3, 4, 5))
VICTIMS = {1: ("forward", 1), 4: ("backward", 0)}  # rank -> (phase, round) at whose post it dies


def _worker(rank: int, world: int) -> dict:
    import signal

    import torch
    import torch.distributed as dist

    from megatron_fcp.attention.function import fcp_attention_with_lse
    from megatron_fcp.attention.layout import zigzag_split
    from megatron_fcp.attention.comm import CommTimeout, GlooTransport, TransportWrapper

    class Killer(TransportWrapper):
        def __init__(self, inner, at):
            super().__init__(inner)
            self.at = at

        def post(self, round_sends, round_recvs, *, round_index, phase="forward"):
            if (phase, round_index) == self.at:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().post(round_sends, round_recvs, round_index=round_index, phase=phase)

    groups = [dist.new_group(list(g)) for g in GROUPS]
    ranks = next(g for g in GROUPS if rank in g)
    group = groups[GROUPS.index(ranks)]
    cp, idx = len(ranks), ranks.index(rank)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2 * cp * 4, 1, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))

    def call(transport):
        ql, kl, vl = (zigzag_split(x, cp, idx).requires_grad_() for x in (q, k, v))
        out, _ = fcp_attention_with_lse(ql, kl, vl, cp_group=group, plan="ring", transport=transport,
                                        timeout_s=TIMEOUT_S)
        out.sum().backward()

    call(GlooTransport(group, timeout_s=TIMEOUT_S))  # warm-up: agrees on the plan, all alive
    transport = GlooTransport(group, timeout_s=TIMEOUT_S)
    if rank in VICTIMS:
        transport = Killer(transport, VICTIMS[rank])
    t0 = time.monotonic()
    try:
        call(transport)
    except CommTimeout as exc:
        return {"error": str(exc), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


@pytest.fixture(scope="module")
def outcomes():
    return run_gloo(_worker, 6, timeout_s=150, keep_going=True)


def test_killed_ranks_died_by_sigkill(outcomes):
    for rank in VICTIMS:
        assert outcomes[rank].ok is None and outcomes[rank].exitcode == -9, outcomes[rank]


@pytest.mark.parametrize("victim", sorted(VICTIMS))
def test_every_peer_raises_the_named_error_within_timeout(outcomes, victim):
    phase = VICTIMS[victim][0]
    group = next(g for g in GROUPS if victim in g)
    for rank in group:
        if rank == victim:
            continue
        o = outcomes[rank]
        assert o.ok, o.error
        msg = o.value["error"]
        assert msg is not None, f"rank {rank} finished although rank {victim} died"
        assert o.value["seconds"] <= TIMEOUT_S + 10, o.value
        assert "round" in msg and "rank " in msg and "B(r" in msg, msg          # round, peer, block
        assert "plan 'ring' over CP ranks" in msg, msg                          # plan
        assert msg.startswith(("forward", "backward")), msg                     # phase
        if phase == "backward":
            assert msg.startswith("backward"), msg  # forward had completed everywhere


def test_no_process_is_left_behind(outcomes):
    time.sleep(0.2)
    for o in outcomes:
        assert o.exitcode is not None, f"rank {o.rank} was still running"
        with pytest.raises(ProcessLookupError):
            os.kill(o.pid, 0)
