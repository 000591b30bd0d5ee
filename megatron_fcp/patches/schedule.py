"""The Megatron runtime's schedule: head-parallel degree, KV-stage graph and block size, settled at setup.

Note [The runtime runs the planner's choice]
--------------------------------------------
:func:`settle_schedule` runs in :func:`~megatron_fcp.patches.runtime.setup_fcp` on every rank, for
CP group 0, with the run's shape (``--seq-length``, query and KV heads per tensor-parallel rank,
head dim, the parameters' dtype). It asks
:func:`~megatron_fcp.planner.choose.choose_schedule` for the best candidate of
Note [Choosing the head-parallel degree] by predicted forward + backward time, the backward priced
as the executor will run it: a ring streamed hop by hop (Note [Streaming chain backward]), other
graphs wave by wave (Note [Backward waves]), KV kept or re-sent as
``--fcp-backward-kv`` / ``--fcp-kv-memory-budget`` decide for each candidate's plan
(:class:`~megatron_fcp.schedule.program.WaveBackward`). The flags are the constraints:

============================ ==================================================================
flag                         effect on the search
============================ ==================================================================
``--fcp-head-parallel auto`` every degree whose head groups fit inside nodes (the default)
``--fcp-head-parallel N``    that degree only; a degree the topology cannot place inside nodes
                             gets no choice: the flags as given, today's defaults for the rest
``--fcp-graph auto``         every graph of ``AUTO_CANDIDATES`` (the default)
``--fcp-graph NAME``         that graph for the zigzag plan or the KV stage
``--fcp-block-tokens 0``     parts per chunk (a = 1) and stagger (a > 1) chosen (the default)
``--fcp-block-tokens B``     that many parts per chunk, so a = 1 when B cuts chunks (a stage
                             moves whole chunks); with an explicit degree > 1 B does not apply
============================ ==================================================================

The runtime then runs exactly the choice at the settled length: the plain plan is built with the
chosen graph and parts (a = 1, the same plan the planner timed, on each CP group's ranks), the
KV stage with the chosen graph and stagger over head groups of consecutive CP ranks (a > 1; the
planner's head groups, one node's CP ranks in rail order, are the same for Megatron's rank order
and a logged warning says when not). Other sequence lengths keep the chosen degree, graph and
stagger; their parts come from ``FCPRuntime.parts_per_chunk``'s rule. The choice is a pure
function of the flags, the topology and the shapes, so every rank settles the same one (the
setup agreement compares it). In a job of several processes the search is shared (Note [Sharing
the search] in :mod:`megatron_fcp.planner.choose`): :func:`search_share` splits it over the job's
ranks (the default group, when it spans the layout's world), each pricing its part, one bounded
gather per round, the same answer on every rank. Without the shapes at setup (``heads``,
``head_dim`` or ``seq_len`` unknown, packed batches) there is no choice at setup: the configured
graph and the parts rule; under ``auto`` each packed batch then chooses its head-parallel degree
(Note [Head-parallel degree of a packed batch] in :mod:`megatron_fcp.patches.runtime`), and zigzag
batches run degree 1.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_fcp.config import FCPConfig
from megatron_fcp.contract.head_parallel import head_groups_for
from megatron_fcp.cost.model import AttentionShape
from megatron_fcp.planner.choose import ScheduleChoice, SearchShare, choose_schedule
from megatron_fcp.planner.megatron_layout import MegatronLayout
from megatron_fcp.schedule.program import WaveBackward

__all__ = ["settle_schedule", "search_share", "schedule_report"]

logger = logging.getLogger("megatron_fcp.runtime")

def search_share(layout: MegatronLayout, groups: dict, timeout_s: float = 300.0) -> SearchShare | None:
    """The schedule search's share of this process (Note [Sharing the search]): over the default
    process group when it is initialised, spans the layout's world, has more than one rank and
    this rank has a live CP group in ``groups`` (ranks that agree at setup; the caller agrees on
    the search's inputs over the default group first); None otherwise (the search runs whole
    here). Every rank decides alike: it reads only the groups.
    Each gather waits at most ``timeout_s`` (``--fcp-timeout-s``): a rank that failed before the
    search makes the others raise, as the setup agreement does."""
    import torch.distributed as dist  # noqa: PLC0415

    from megatron_fcp.attention.agreement import gather_json  # noqa: PLC0415

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != layout.world \
            or layout.world < 2:
        return None
    if not any(dist.get_rank() in ranks and group is not None for ranks, group in groups.items()):
        return None
    return SearchShare(dist.get_rank(), dist.get_world_size(),
                       lambda obj: gather_json(obj, what="FCP schedule search", timeout_s=timeout_s))


def settle_schedule(config: FCPConfig, layout: MegatronLayout, topology: Any, *, seq_len: int | None,
                    heads: int | None, kv_heads: int | None, head_dim: int | None, dtype_bytes: int,
                    micro_batch: int = 1, v_head_dim: int | None = None,
                    window: tuple[int, int] | None = None, share: SearchShare | None = None) -> ScheduleChoice | None:
    """The schedule this run settles (Note [The runtime runs the planner's choice]), or None when
    there is nothing to choose (CP off, shapes unknown) or an explicit degree does not fit the
    topology. ``heads`` / ``kv_heads``: the model's (split here by tensor parallelism); ``v_head_dim``:
    V's head size when it differs from ``head_dim`` (MLA), which prices the KV bytes; ``window``: a
    windowed layer's schedule (degree 1, the window's need sets and work: Note [Per-layer plans] in
    :mod:`megatron_fcp.patches.runtime`); ``share``: this rank's part of a shared search
    (:func:`search_share`; every rank of it must call this alike). Raises
    ValueError naming the flag when ``--fcp-block-tokens`` does not divide the zigzag chunk."""
    if layout.cp == 1 or seq_len is None or heads is None or head_dim is None:
        return None
    tp_heads, tp_kv = heads // layout.tp, max(1, (kv_heads or heads) // layout.tp)
    shape = AttentionShape(seq_len, tp_heads, tp_kv, head_dim, dtype_bytes, v_head_dim)
    degree = config.head_parallel if window is None else 1   # windowed layers run without the stage
    parts: int | str = "auto"
    if config.block_tokens and not (degree != "auto" and degree > 1):
        parts = config.parts_per_chunk(seq_len // (2 * layout.cp))  # ValueError naming the flag
    cp_ranks = layout.cp_groups()[0]
    flags = (f"--fcp-head-parallel {config.head_parallel} --fcp-graph {config.graph} "
             f"--fcp-block-tokens {config.block_tokens} --fcp-backward-kv {config.backward_kv}")
    try:
        choice = choose_schedule(topology, cp_ranks, shape, degree=degree, graph=config.graph, parts_per_chunk=parts,
                                 causal=True, grad_dtype_bytes=dtype_bytes,  # partials travel in the params dtype
                                 backward=WaveBackward(config.backward_kv, config.kv_memory_budget, micro_batch),
                                 window=window, share=share)
    except ValueError as exc:  # an explicit degree the topology cannot place inside nodes
        logger.info("FCP schedule (%s): no planner choice (%s); the flags as given, defaults for the rest", flags, exc)
        return None
    if choice.degree > 1 and choice.plan.head_groups != head_groups_for(topology, cp_ranks, choice.degree):
        raise AssertionError(f"the planner's head groups {choice.plan.head_groups} are not the runtime's "
                             f"(head_groups_for): one rule must decide them")   # an invariant, not user input
    logger.info("FCP schedule (%s)%s for %d tokens, %d/%d heads per TP rank, cp %d on %s: %s", flags,
                "" if window is None else f" of window {tuple(window)}", seq_len, tp_heads, tp_kv, layout.cp,
                getattr(topology, "name", topology), choice.describe())
    return choice


def schedule_report(choice: ScheduleChoice | None) -> dict | None:
    """The settled schedule as plain data (layer report, metrics): degree, graph, parts, stagger,
    predicted milliseconds and the runner-up; None without a choice."""
    if choice is None:
        return None
    return {"label": choice.label, "head_parallel": choice.degree, "graph": choice.graph, "parts": choice.parts,
            "stagger": choice.stagger, "seq_len": choice.seq_len, "backward_kv": choice.backward_kv,
            "backward_form": choice.backward_form,
            "predicted_ms": round(choice.total_s * 1e3, 4), "predicted_fwd_ms": round(choice.fwd_s * 1e3, 4),
            "predicted_bwd_ms": round(choice.bwd_s * 1e3, 4),
            "runner_up": None if choice.runner_up is None else
            {"label": choice.runner_up[0], "predicted_ms": round(choice.runner_up[1] * 1e3, 4)}}
