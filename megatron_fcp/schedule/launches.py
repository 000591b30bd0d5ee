"""Which blocks a rank computes in one kernel call: the one rule the executor runs and the cost
model prices. Pure data, no ``torch``.

Note [One launch per owner and stage]
-------------------------------------
In a pass (the forward, the one-pass backward, a chain backward) a rank computes its blocks in
*stages*: its own blocks first (stage :data:`OWN`), then the blocks received in each forward round
(the round's index), or, in a chain backward, the jobs of each step (the step's index). The rule:

    one kernel call per (stage, owner) among the blocks the rank computes (work > 0)

so a rank's own blocks are one call, and the blocks of one owner reaching it in one round (a
ring's KV pair, the sub-blocks of a chunk, a packed rank's spans) are one call, as Transformer
Engine computes one step's KV pair in one call. The call's keys are the group's blocks
concatenated in plan order, each with its own positions (and document ids); its query rows the
union of the rows that can see them. A block that no query row sees is not computed and joins no
call (Note [Windowed attention in the executor] in :mod:`megatron_fcp.attention.function`); a
group none of whose blocks is computed makes no call. For a rank of cp = 4, causal ring with
``parts_per_chunk = 2`` (4 blocks per owner)::

    stage          blocks                                  calls
    OWN            its own 4                               1
    round k        owner's 4 (those its queries see)       1 per round
    total                                                  1 + (cp - 1) = 4   (per block: 16)

A backward in waves (Note [Backward waves] in :mod:`megatron_fcp.attention.backward_waves`)
computes one delivery per job, and a job is one call: :func:`~megatron_fcp.schedule.waves.loop_jobs`
lists each rank's jobs, which the executor runs and the wave timeline prices (one launch per job
with work; :func:`~megatron_fcp.cost.floors.rank_jobs` counts them for the floors). Its polling
between jobs is what paces the reductions, so the waves keep one block per call.

:func:`launch_ids` is the rule, vectorised over ``(stage, rank, owner)`` entries; the executor's
calls (:func:`group_blocks`, used by :mod:`megatron_fcp.attention.function` and
:mod:`megatron_fcp.attention.backward_chain`) and the cost model's launches
(:func:`~megatron_fcp.cost.model.simulate_plan`,
:func:`~megatron_fcp.cost.backward.simulate_plan_backward`,
:func:`~megatron_fcp.cost.timeline.chain_step_compute`) all read it, so what runs is what is
priced; ``tests/test_launches.py`` counts a counting kernel's calls against the model's.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from megatron_fcp.contract.blocks import Block
from megatron_fcp.contract.head_parallel import LOCAL_STAGE
from megatron_fcp.contract.plan import Plan
from megatron_fcp.jit import unique_ints

__all__ = ["OWN", "local_stage", "launch_ids", "launch_starts", "group_blocks", "forward_launches"]


def local_stage(plan: Plan) -> bool:
    """True for a head-parallel stage plan at ``a = cp``: each rank's one kernel call over the whole
    sequence (``_LocalAttention`` in :mod:`megatron_fcp.attention.head_parallel`) is its answer and
    goes through no LSE merge; every other plan's calls do (the executor's accumulator)."""
    return not plan.rounds and plan.name.startswith("hp") and plan.name.endswith("-" + LOCAL_STAGE)

OWN = -1
"""The stage of a rank's own blocks (before the first round's)."""


def launch_ids(stage, rank, owner, live=None) -> np.ndarray:
    """The kernel call each entry belongs to (Note [One launch per owner and stage]): entries
    ``(stage, rank, owner)`` (array-likes of one length) with the same triple share a call;
    ``live`` (bool array, default all): entries with work; the others get -1 (no call). Calls are
    numbered 0.. in order of their first live entry."""
    return _launches(stage, rank, owner, live)[0]


def launch_starts(stage, rank, owner, live=None) -> np.ndarray:
    """Indices of the entries that start a call (the first live entry of each; :func:`launch_ids`),
    in entry order: where a model adds one launch."""
    return _launches(stage, rank, owner, live)[1]


def _launches(stage, rank, owner, live) -> tuple[np.ndarray, np.ndarray]:
    """``(launch_ids, launch_starts)``: one integer key per triple, its distinct values found once
    (:func:`~megatron_fcp.jit.unique_ints`: a table over the keys' span where that is small)."""
    st, rk, ow = (np.asarray(x, dtype=np.int64).ravel() for x in (stage, rank, owner))
    n = st.size
    live = np.ones(n, dtype=bool) if live is None else np.asarray(live, dtype=bool).ravel()
    ids = np.full(n, -1, dtype=np.int64)
    idx = np.flatnonzero(live)
    if not idx.size:
        return ids, idx
    s0, r0, o0 = st[idx] - st[idx].min(), rk[idx] - rk[idx].min(), ow[idx] - ow[idx].min()
    n_r, n_o = int(r0.max()) + 1, int(o0.max()) + 1
    key = (s0 * n_r + r0) * n_o + o0                                        # one integer per triple
    _, first, inv = unique_ints(key, (int(s0.max()) + 1) * n_r * n_o)
    order = np.argsort(first, kind="stable")
    rank_of = np.empty(len(first), dtype=np.int64)
    rank_of[order] = np.arange(len(first))                                  # numbered by first entry
    ids[idx] = rank_of[inv]
    return ids, idx[first[order]]


def group_blocks(entries: Sequence[tuple[int, Block]], rank: int = 0,
                 live: Callable[[Block], bool] | None = None) -> list[tuple[int, tuple[Block, ...]]]:
    """One rank's ``(stage, block)`` entries in the order it handles them -> its calls ``(stage,
    blocks)`` in order of each call's first entry, a call's blocks in entry order (Note [One launch
    per owner and stage]); ``live(block)``: whether the block is computed (default: all)."""
    entries = list(entries)
    alive = [live is None or live(b) for _, b in entries]
    ids = launch_ids([s for s, _ in entries], [rank] * len(entries), [b.owner for _, b in entries], alive)
    calls: dict[int, tuple[int, list[Block]]] = {}
    for (s, b), g in zip(entries, ids.tolist()):
        if g >= 0:
            calls.setdefault(g, (s, []))[1].append(b)
    return [(s, tuple(bs)) for s, bs in (calls[g] for g in sorted(calls))]


def forward_launches(plan: Plan, rank: int, live: Callable[[Block], bool] | None = None
                     ) -> list[tuple[int, tuple[Block, ...]]]:
    """``rank``'s calls in a forward pass of ``plan`` (and in its one-pass backward): its own
    blocks (stage :data:`OWN`), then per round the blocks it receives *and needs*, one call per
    owner (:func:`group_blocks`). ``live``: whether the rank's queries see the block (default:
    every block it needs)."""
    needs = plan.needs(rank)
    entries: list[tuple[int, Block]] = [(OWN, b) for b in plan.local_blocks(rank)]
    entries += [(r, t.block) for r, rnd in enumerate(plan.rounds) for t in rnd
                if t.dst == rank and t.block in needs]
    return group_blocks(entries, rank, live)
