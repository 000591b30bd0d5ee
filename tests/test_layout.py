"""Zigzag layout: identical to Megatron's get_batch_on_this_cp_rank; positions and block ranges."""

from __future__ import annotations

import pytest
import torch

from megatron_fcp.attention.layout import (
    block_local_slice,
    block_positions,
    zigzag_positions,
    zigzag_split,
    zigzag_unsplit,
)
from megatron_fcp.contract.blocks import blocks_of


class _FakeCPGroup:
    """Rank ``r`` of a CP group of ``cp`` ranks, without processes (size()/rank() only)."""

    def __init__(self, cp: int, r: int) -> None:
        self._cp, self._r = cp, r

    def size(self) -> int:
        return self._cp

    def rank(self) -> int:
        return self._r


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_matches_megatron_get_batch_on_this_cp_rank(cp, monkeypatch):
    """Megatron's own split, through whichever signature the installed release has.

    Releases read the CP size/rank from ``parallel_state`` (0.14-0.15), from ``group.size()``
    (0.16-0.17) or from ``torch.distributed.get_world_size(group)`` (0.18+): all three are pointed
    at one fake group per rank, so no process group is needed.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_fcp.patches.compat import cp_batch_splitter

    s = 8 * cp
    tokens = torch.arange(3 * s).view(3, s)                   # [b, s]: Megatron's batch has seq dim 1
    hidden = torch.randn(3, s, 5)                             # [b, s, hidden]
    split = cp_batch_splitter()
    world_size, rank = dist.get_world_size, dist.get_rank
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for r in range(cp):
        group = _FakeCPGroup(cp, r)
        monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda r=r: r)
        monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda check_initialized=True, g=group: g)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: group.size() if isinstance(
            group, _FakeCPGroup) else world_size(group))
        monkeypatch.setattr(dist, "get_rank", lambda group=None: group.rank() if isinstance(
            group, _FakeCPGroup) else rank(group))
        batch = split({"tokens": tokens.clone(), "hidden": hidden.clone()})
        assert torch.equal(zigzag_split(tokens, cp, r, seq_dim=1), batch["tokens"])
        assert torch.equal(zigzag_split(hidden, cp, r, seq_dim=1), batch["hidden"])


@pytest.mark.parametrize("seq_dim", [0, 2])
def test_unsplit_inverts_split(seq_dim):
    cp = 4
    x = torch.randn(24, 3, 5) if seq_dim == 0 else torch.randn(3, 5, 24)
    shards = [zigzag_split(x, cp, r, seq_dim=seq_dim) for r in range(cp)]
    assert all(sh.shape[seq_dim] == x.shape[seq_dim] // cp for sh in shards)
    assert torch.equal(zigzag_unsplit(shards, seq_dim=seq_dim), x)


def test_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    cp, chunk = 4, 3
    pos = torch.arange(2 * cp * chunk)
    for r in range(cp):
        shard = zigzag_split(pos, cp, r)
        assert shard[:chunk].tolist() == list(range(r * chunk, (r + 1) * chunk))
        late = 2 * cp - 1 - r
        assert shard[chunk:].tolist() == list(range(late * chunk, (late + 1) * chunk))


@pytest.mark.parametrize("cp", [1, 3, 4])
def test_positions_are_the_split_of_arange_and_partition_the_sequence(cp):
    s = 2 * cp * 5
    seen = []
    for r in range(cp):
        p = zigzag_positions(s // cp, cp, r)
        assert p.dtype == torch.int64
        assert torch.equal(p, zigzag_split(torch.arange(s), cp, r))
        seen += p.tolist()
    assert sorted(seen) == list(range(s))


@pytest.mark.parametrize("parts,chunk", [(1, 4), (2, 8), (3, 12), (2, 7), (3, 7), (4, 10), (7, 7)])
def test_block_positions_and_slices_agree_with_the_owner_shard(parts, chunk):
    """Equal parts, and parts that do not divide the chunk (floor/ceil sizes at the cuts p*L//P):
    the slices tile each shard in order, positions are the shard's, sizes differ by at most one."""
    from megatron_fcp.attention.layout import ZigzagLayout

    ranks = (5, 2, 7)                       # global ranks in CP order; CP index = position here
    cp, s_local = len(ranks), 2 * chunk
    covered = []
    for i, owner in enumerate(ranks):
        shard_pos = zigzag_positions(s_local, cp, i)
        layout = ZigzagLayout(ranks, owner, s_local, parts, causal=True)
        stops = []
        for blk in blocks_of(owner, parts):
            sl = block_local_slice(blk, s_local, parts)
            bp = block_positions(blk, ranks, s_local, parts)
            assert torch.equal(bp, shard_pos[sl])
            assert layout.block_tokens(blk) == sl.stop - sl.start == len(bp) in (chunk // parts, -(-chunk // parts))
            assert layout.local_slice(blk) == sl and torch.equal(layout.k_pos(blk), bp)
            stops.append((sl.start, sl.stop))
            covered += bp.tolist()
        assert [a for a, _ in stops] == [0] + [z for _, z in stops[:-1]] and stops[-1][1] == s_local
    assert sorted(covered) == list(range(cp * s_local))
    if chunk == 10 and parts == 4:      # the Note's example: sizes 2, 3, 2, 3
        assert [block_local_slice(b, s_local, parts).stop - block_local_slice(b, s_local, parts).start
                for b in blocks_of(0, parts)[:parts]] == [2, 3, 2, 3]


def test_layout_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 8"):
        zigzag_split(torch.zeros(12), 4, 0)
    with pytest.raises(ValueError, match="cp_index"):
        zigzag_split(torch.zeros(16), 4, 4)
    with pytest.raises(ValueError, match="even"):
        zigzag_positions(5, 2, 0)
    from megatron_fcp.contract.blocks import Block
    with pytest.raises(ValueError, match="not in the CP group"):
        block_positions(Block(9, 0), (0, 1), 4)
    with pytest.raises(ValueError, match="cannot be cut into 4 parts.*parts_per_chunk between 1 and 3"):
        block_local_slice(Block(0, 0), 6, 4)    # 3-token chunks, 4 parts: an empty block
    with pytest.raises(ValueError, match="even"):
        block_local_slice(Block(0, 0), 7, 1)
