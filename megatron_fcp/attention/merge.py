"""Log-sum-exp merge of partial attention results (FP32 or FP64), order independent and stable.

Attention of a query over keys K = K_a ∪ K_b (disjoint) from the two partial results
``(out_a, lse_a)`` and ``(out_b, lse_b)``::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

zhuzilin/ring-flash-attention (PR #34) writes the same update in sigmoid form,
``out = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b)``, ``lse = lse_a - logsigmoid(lse_a - lse_b)``.
We use the max-subtraction form instead because it is symmetric in a and b (the merge of two
results is bitwise commutative) and handles empty sides directly:

    M  = max(lse_a, lse_b), with M := 0 when both are -inf
    wa = exp(lse_a - M), wb = exp(lse_b - M)         # both in [0, 1]: no overflow
    lse = M + log(wa + wb)                            # -inf when both sides are empty
    out = (wa * out_a + wb * out_b) / (wa + wb)       # 0 when both sides are empty

An empty side (a fully masked row: out 0, lse -inf) gets weight 0, so a block whose scores lie
1e4 above the running maximum, or a row that sees nothing yet, never produces NaN or inf.
Merging in a different order changes results only by rounding (exactly commutative, associative up
to rounding): the executor merges in plan order so a fixed plan is bitwise reproducible.

Shapes: out [n, b, h, d], lse [b, h, n]; both in the accumulation dtype (FP32, or FP64 for FP64).
"""

from __future__ import annotations

import torch

__all__ = ["merge_two", "merge_coefficients", "LseAccumulator"]


def merge_coefficients(lse_a: torch.Tensor, lse_b: torch.Tensor):
    """``(lse, ca, cb)`` with out = ca * out_a + cb * out_b, elementwise over lse's shape (any
    layout, e.g. [b, h, n]); the kernels reuse it for their online softmax over key chunks."""
    mx = torch.maximum(lse_a, lse_b)
    mx = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)  # both sides empty
    wa = torch.exp(lse_a - mx)                                       # in [0, 1]
    wb = torch.exp(lse_b - mx)
    w = wa + wb                                                      # in [1, 2], or 0 if empty
    inv = torch.where(w > 0, 1.0 / w, torch.zeros_like(w))
    return mx + torch.log(w), wa * inv, wb * inv


def _as_out_weight(w: torch.Tensor) -> torch.Tensor:
    """[b, h, n] -> [n, b, h, 1] to scale an out tensor [n, b, h, d]."""
    return w.permute(2, 0, 1).unsqueeze(-1)


def _check(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"cannot merge partial results of shapes {tuple(out_a.shape)}/{tuple(lse_a.shape)} "
                         f"and {tuple(out_b.shape)}/{tuple(lse_b.shape)}")


def merge_two(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results (see module docstring); returns new ``(out, lse)``."""
    _check(out_a, lse_a, out_b, lse_b)
    lse, ca, cb = merge_coefficients(lse_a, lse_b)
    return out_a * _as_out_weight(ca) + out_b * _as_out_weight(cb), lse


class LseAccumulator:
    """Running ``(out, lse)`` for one query shard; fold partial results in with :meth:`add`.

    The first result is copied; later ones are merged in place (``out = ca*out + cb*new``, two
    passes over ``out``), with the same coefficients as :func:`merge_two`, in the order given.
    An accumulator started by :meth:`empty` (out 0, lse -inf: nothing seen yet) also takes partial
    results of a row range (``add(..., rows=slice)``); merging into an empty side is exact, so
    the rows outside the range keep their values bit for bit.
    """

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    @classmethod
    def empty(cls, n: int, b: int, h: int, d: int, dtype: torch.dtype, device=None) -> "LseAccumulator":
        """An accumulator for ``n`` query rows that has seen no key: out 0 ``[n,b,h,d]``, lse -inf ``[b,h,n]``."""
        acc = cls()
        acc.out = torch.zeros(n, b, h, d, dtype=dtype, device=device)
        acc.lse = torch.full((b, h, n), float("-inf"), dtype=dtype, device=device)
        return acc

    def add(self, out: torch.Tensor, lse: torch.Tensor, rows: slice | None = None) -> None:
        if rows is not None:
            if self.out is None:
                raise ValueError("add(rows=...) needs an accumulator started with LseAccumulator.empty(...)")
            o, l = self.out[rows], self.lse[..., rows]                       # views
            _check(o, l, out, lse)
            new_lse, ca, cb = merge_coefficients(l, lse)
            self.lse[..., rows] = new_lse
            o.mul_(_as_out_weight(ca)).addcmul_(out, _as_out_weight(cb))
            return
        if self.out is None:
            self.out, self.lse = out.clone(), lse.clone()
            return
        _check(self.out, self.lse, out, lse)
        self.lse, ca, cb = merge_coefficients(self.lse, lse)
        self.out.mul_(_as_out_weight(ca)).addcmul_(out, _as_out_weight(cb))

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out is None:
            raise ValueError("no partial result was added")
        return self.out, self.lse
