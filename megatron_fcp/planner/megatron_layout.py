"""Megatron's rank layout: which global ranks form each CP and TP group. Pure, no ``torch``.

The one place the ``tp-cp-ep-dp-pp`` rank order is written down; the runtime, the CLI and the
tests all use :class:`MegatronLayout` (a test checks it against megatron-core's own
``RankGenerator``).

Note [Megatron's rank order and CP groups]
------------------------------------------
megatron-core lays ranks out in the order ``tp-cp-ep-dp-pp`` (``RankGenerator(order=
"tp-cp-ep-dp-pp")``): TP varies fastest, then CP, then DP, then PP (EP only splits the
data-parallel extent for MoE layers and does not change attention's CP groups). So global rank
``r = t + tp*(c + cp*(d + dp*p))`` and the CP group of ``(t, d, p)`` is strided by ``tp``. With
world 8, tp 2, cp 2, dp 2::

    global rank   0  1  2  3  4  5  6  7
    tp rank       0  1  0  1  0  1  0  1
    cp rank       0  0  1  1  0  0  1  1
    dp rank       0  0  0  0  1  1  1  1
    CP groups     {0,2} {1,3} {4,6} {5,7}      TP groups {0,1} {2,3} {4,5} {6,7}

A CP group meets each TP group in at most one rank, so a verified plan (every endpoint inside the
CP group) can never make a TP peer an endpoint.

Global ranks are topology ranks (torchrun puts ``LOCAL_WORLD_SIZE`` consecutive ranks on a
node): a CP group of the example above on a 2-GPU-per-node topology has one rank per node, on a
4-GPU-per-node topology both ranks share a node; the planner sees the real links either way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MegatronLayout"]


@dataclass(frozen=True)
class MegatronLayout:
    """World size and parallel sizes of a Megatron run (order ``tp-cp-ep-dp-pp``)."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name, flag in (("world", "world size"), ("tp", "--tensor-model-parallel-size"),
                           ("pp", "--pipeline-model-parallel-size"), ("cp", "--context-parallel-size")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        model = self.tp * self.pp * self.cp
        if self.world % model:
            raise ValueError(
                f"world size {self.world} is not divisible by tensor x pipeline x context parallel "
                f"size = {self.tp} x {self.pp} x {self.cp} = {model}; change "
                "--context-parallel-size (or --tensor-model-parallel-size / "
                "--pipeline-model-parallel-size, or the number of processes)"
            )

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    def rank(self, t: int, c: int, d: int, p: int) -> int:
        """Global rank of (tp, cp, dp, pp) coordinates; see the Note."""
        return t + self.tp * (c + self.cp * (d + self.dp * p))

    def cp_groups(self) -> list[tuple[int, ...]]:
        """Every CP group's global ranks in CP-rank order, listed as ``parallel_state`` creates
        them (by pp, then dp, then tp)."""
        return [
            tuple(self.rank(t, c, d, p) for c in range(self.cp))
            for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)
        ]

    def tp_groups(self) -> list[tuple[int, ...]]:
        return [
            tuple(self.rank(t, c, d, p) for t in range(self.tp))
            for p in range(self.pp) for d in range(self.dp) for c in range(self.cp)
        ]

    def cp_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.cp_groups() if rank in g)

    def tp_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.tp_groups() if rank in g)

    @classmethod
    def parse(cls, text: str) -> "MegatronLayout":
        """``"world=16,tp=2,pp=1,cp=8"`` (``--megatron-layout``); world and cp are required, tp and pp
        default to 1."""
        values: dict[str, int] = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("world", "tp", "pp", "cp") or not re.fullmatch(r"\d+", value):
                raise ValueError(f"--megatron-layout item {item!r}: expected world=N, tp=N, pp=N or cp=N "
                                 "(e.g. world=16,tp=2,pp=1,cp=8)")
            values[key] = int(value)
        for key in ("world", "cp"):
            if key not in values:
                raise ValueError(f"--megatron-layout: {key}=N is required (e.g. world=16,tp=2,pp=1,cp=8)")
        return cls(**values)
