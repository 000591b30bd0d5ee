"""Plans and placements checked against a CP group, before anything is posted.

:func:`resolve_plan` turns what a caller passes as ``plan`` (a name, ``None`` or a
:class:`~megatron_fcp.planning.Plan`) into a verified plan over the group's ranks;
:func:`check_placement` checks a packed batch's placement against the group and this rank's
tokens. Errors are ``ValueError`` naming the fix (docs/errors.md).
"""

from __future__ import annotations

import warnings
from typing import Union

from megatron_fcp.contract.placement import Placement
from megatron_fcp.contract.plan import SIMPLE_PLANS, Plan, full_plan

__all__ = ["resolve_plan", "check_placement", "PLAN_ALIASES", "PlanLike"]

PlanLike = Union[str, Plan]

#: Old plan names still accepted (with a FutureWarning): name -> name in ``SIMPLE_PLANS``.
PLAN_ALIASES = {"all-to-all": "full"}


def resolve_plan(plan: PlanLike | None, group_ranks: tuple[int, ...], causal: bool,
                 placement: Placement | None = None) -> Plan:
    """A :class:`Plan` for this group: build a named plan, or check a given one against the group.

    ``None`` is ``"ring"`` for zigzag shards and ``"full"`` over a ``placement`` (the only named
    plan there: :func:`~megatron_fcp.contract.plan.full_plan` with ``placement=``)."""
    if plan is None:
        plan = "ring" if placement is None else "full"
    if isinstance(plan, str):
        if plan in PLAN_ALIASES:
            warnings.warn(f"plan {plan!r} is deprecated; use {PLAN_ALIASES[plan]!r} (the same schedule)",
                          FutureWarning, stacklevel=3)
            plan = PLAN_ALIASES[plan]
        if plan not in SIMPLE_PLANS:
            raise ValueError(f"unknown plan {plan!r}; use one of {sorted(SIMPLE_PLANS)} or pass a Plan")
        if placement is None:
            return SIMPLE_PLANS[plan](group_ranks, causal=causal, parts_per_chunk=1).verify()
        if plan != "full":
            raise ValueError(f"plan {plan!r} runs zigzag shards only; over a placement use plan='full' (or None) "
                             f"or a Plan from build_plan(..., placement=placement)")
        return full_plan(group_ranks, causal, placement=placement).verify()
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a name {sorted(SIMPLE_PLANS)} or a megatron_fcp.planning.Plan, "
                         f"got {type(plan).__name__}")
    if tuple(plan.ranks) != group_ranks:
        raise ValueError(
            f"plan ranks {list(plan.ranks)} are not the CP group's ranks {list(group_ranks)} (in CP order); "
            f"build the plan from dist.get_process_group_ranks(cp_group)"
        )
    if plan.causal != causal:
        raise ValueError(f"plan was built with causal={plan.causal} but attention runs with causal={causal}; "
                         f"rebuild the plan with causal={causal} (need sets differ)")
    if placement is None and plan.placement is not None:
        raise ValueError("plan is over a placement (a packed batch); pass placement=plan.placement and THD "
                         "tensors [t_local, heads, head_dim]")
    if placement is not None and plan.placement is None:
        raise ValueError("plan is a zigzag plan; build it over the placement: full_plan(ranks, causal, "
                         "placement=placement) or build_plan(..., placement=placement)")
    if placement is not None and plan.placement is not placement and plan.placement != placement:
        raise ValueError("plan was built for a different placement than the one given; rebuild the plan "
                         "with placement=<this placement> (or pass plan.placement)")
    return plan.verify()  # at once for a plan already verified (every plan build_plan returns)


def check_placement(placement, group_ranks: tuple[int, ...], rank: int, causal: bool, t_local: int) -> None:
    """Check a packed batch's ``placement`` against the group and this rank's ``t_local`` tokens."""
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a megatron_fcp.planning.Placement (e.g. place_packed(doc_lengths, "
                         f"cp)), got {type(placement).__name__}")
    if placement.cp != len(group_ranks):
        raise ValueError(f"placement is for cp={placement.cp} but cp_group has {len(group_ranks)} ranks; "
                         f"place the batch with place_packed(doc_lengths, cp={len(group_ranks)})")
    if placement.causal != causal:
        raise ValueError(f"placement was built with causal={placement.causal} but attention runs with "
                         f"causal={causal}; rebuild it with place_packed(..., causal={causal}) (need sets differ)")
    idx = group_ranks.index(rank)
    if t_local != placement.tokens(idx):
        raise ValueError(f"this rank (CP index {idx}) holds {placement.tokens(idx)} tokens of the placement but "
                         f"q/k/v have {t_local}; pass placement.shard(x, {idx}) of the packed batch")
