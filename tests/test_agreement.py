"""Agreement on gloo: ranks holding different plan inputs get a named error, never a hang."""

from __future__ import annotations

import pytest

from megatron_fcp.testing.launch import run_gloo

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron_fcp.attention.agreement import AgreementCache, FCPAgreementError, agree
    from megatron_fcp.contract.placement import place_packed

    out: dict = {}
    sub = dist.new_group([1, 2, 3])  # CP group whose CP ranks differ from global ranks
    same = {"doc_lengths": (5, 9, 2), "dtype": "torch.bfloat16", "shape": (16, 4, 64)}
    out["agreed"] = agree(same)
    lengths = (5, 9, 2) if rank != 2 else (5, 9, 3)  # rank 2 read another micro-batch
    fields = {"doc_lengths": lengths, "placement": place_packed(lengths, 3, block_tokens=4)}
    if rank in (1, 2, 3):
        try:
            agree(fields, sub, what="packed plan")
            out["mismatch"] = None
        except FCPAgreementError as e:
            out["mismatch"] = str(e)
    cache = AgreementCache()
    calls = []
    real = dist.all_gather

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.all_gather = counting
    try:
        for layer in range(3):  # one epoch = one micro-batch: one collective for all layers
            cache.ensure(same, epoch=0)
        cache.ensure(same, epoch=1)
        out["collectives"] = len(calls)
        try:
            cache.ensure({**same, "dtype": "torch.float32"}, epoch=1)
        except FCPAgreementError as e:
            out["changed"] = str(e)
        out["collectives_after"] = len(calls)
    finally:
        dist.all_gather = real
    return out


@pytest.fixture(scope="module")
def results():
    return run_gloo(_worker, 4, timeout_s=120)


def test_agreeing_ranks_get_one_digest(results):
    assert len({r["agreed"] for r in results}) == 1


def test_disagreeing_ranks_all_raise_naming_the_field_and_the_ranks(results):
    for rank in (1, 2, 3):
        msg = results[rank]["mismatch"]
        assert msg is not None and msg.startswith("packed plan: 'doc_lengths' differs across the CP group")
        assert "ranks [1, 3] hold" in msg and "ranks [2] hold" in msg
        assert "same micro-batch's document lengths" in msg


def test_one_collective_per_epoch_and_local_errors_inside_an_epoch(results):
    for r in results:
        assert r["collectives"] == 2  # epoch 0 once for three layers, epoch 1 once
        assert "'dtype' changed within one agreed epoch (1)" in r["changed"]
        assert r["collectives_after"] == 2  # the change was caught without a collective
