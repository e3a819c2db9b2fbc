"""Weights used at every TTT step, with their gradient summed inside the GEMMs.

Training-time test runs the drafter's one layer and its lm_head S times (eagle3/loss.py), so each
of those weights gets S gradient contributions. Plain autograd writes each contribution as its
own weight-sized tensor and adds them one by one: S writes plus S-1 read-read-write passes over
every weight (7.2 ms of a 177 ms Kimi-size step on an H200, docs/perf.md). Here the weight is cast
to the compute dtype once per unroll (`reuse`), every use goes through `linear`, and each use's
backward adds its contribution into ONE buffer with the GEMM itself (addmm_, beta = 1): S GEMMs,
the first writing and the rest reading and writing the buffer, and nothing else. The cast's own
backward, which autograd runs only after every use's backward (it depends on all of them), hands
the sum to the weight.

Same math as F.linear everywhere; the sum is only rounded differently (once per GEMM into the
buffer's dtype, as autograd's adds round once per add). tests/test_loss.py checks every gradient
of the unrolled loss against a naive reference in float64, tests/test_fused.py against F.linear.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class _Sum:
    buf: Optional[torch.Tensor] = None      # the weight gradient summed over the uses so far


@dataclass
class Reused:
    """A weight in the compute dtype for one unroll, and its uses' gradient sum."""
    weight: torch.Tensor
    grad: _Sum = field(default_factory=_Sum)


class _Cast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, dtype, total):
        ctx.total = total
        ctx.set_materialize_grads(False)     # the uses return no weight gradient: nothing to fill
        return w.to(dtype) if w.dtype != dtype else w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        buf, ctx.total.buf = ctx.total.buf, None
        if g is not None:                    # a use outside `linear` (there is none in this project)
            buf = g if buf is None else buf + g
        return buf, None, None               # autograd casts it to the parameter's dtype


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, total):
        x = x.to(w.dtype)
        ctx.save_for_backward(x, w)
        ctx.total = total
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
            if ctx.total.buf is None:
                ctx.total.buf = dy2.T @ x2
            else:
                ctx.total.buf.addmm_(dy2.T, x2)
        return dx, None, None


def reuse(weight: torch.Tensor, dtype: torch.dtype) -> Reused:
    """weight (a parameter) in `dtype` for one unroll; every use must go through `linear`."""
    total = _Sum()
    return Reused(_Cast.apply(weight, dtype, total), total)


def linear(x: torch.Tensor, w: Reused) -> torch.Tensor:
    """F.linear(x, w.weight) (x cast to the weight's dtype), its weight gradient summed in w.grad."""
    return _Linear.apply(x, w.weight, w.grad)
