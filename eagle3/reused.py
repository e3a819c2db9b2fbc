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

The buffer is in the compute dtype, and the cast's backward widens the sum to the weight's dtype
once, as a compiled kernel on a GPU (`_widen`: torch's own cast of those gradients ran at about
1.8 TB/s, 3.9 ms of a Kimi-size step on an H200). (Having cuBLAS write and sum fp32 itself,
`out_dtype`, made those GEMMs 4.1 ms slower, as much as the casts it saves: docs/perf.md.)

The cast itself is skipped where the optimizer already wrote the weight in the compute dtype
(`keep_copy`, eagle3/optim.AdamW): a copy counts only while the weight's version counter is the one
it was written at, so any other change to the weight (a loaded checkpoint, an in-place edit) makes
`reuse` cast again instead of reading a stale copy.

Same math as F.linear everywhere; the sum is only rounded differently (once per GEMM into the
buffer's dtype). tests/test_loss.py checks every gradient of the unrolled loss against a naive
reference in float64, tests/test_fused.py against F.linear, tests/test_optim.py the copies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from eagle3.fused import fused

_COPIES: WeakIdKeyDictionary = WeakIdKeyDictionary()     # weight -> (its copy, weight._version then)


def keep_copy(weight: torch.Tensor, copy: torch.Tensor) -> None:
    """copy == weight.to(copy.dtype) now: `reuse` may read it until the weight changes."""
    _COPIES[weight] = (copy, weight._version)


def kept_copy(weight: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The weight's kept copy in `dtype` if it is still current, else None."""
    kept = _COPIES.get(weight)
    if kept is None or kept[0].dtype != dtype or kept[1] != weight._version:
        return None
    return kept[0]


@dataclass
class _Sum:
    buf: Optional[torch.Tensor] = None      # the weight gradient summed over the uses so far

    def add_product(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """buf (+)= a @ b, in the compute dtype (the GEMM's own; the cast's backward widens the sum once)."""
        if self.buf is None:
            self.buf = a @ b
        else:
            self.buf.addmm_(a, b)


@dataclass
class Reused:
    """A weight in the compute dtype for one unroll, and its uses' gradient sum."""
    weight: torch.Tensor
    grad: _Sum


@fused
def _widen(g, dtype: torch.dtype):
    """g in `dtype` (the weight's): one kernel on a GPU."""
    return g.to(dtype)


class _Cast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, dtype, total):
        ctx.total, ctx.weight_dtype = total, w.dtype
        ctx.set_materialize_grads(False)     # the uses return no weight gradient: nothing to fill
        if w.dtype == dtype:
            return w.view_as(w)
        kept = kept_copy(w, dtype)
        return kept.view_as(kept) if kept is not None else w.to(dtype)

    @staticmethod
    def backward(ctx, g):
        buf, ctx.total.buf = ctx.total.buf, None
        if g is not None:                    # a use outside `linear` (there is none in this project)
            buf = g if buf is None else buf + g
        if buf is not None and buf.dtype != ctx.weight_dtype:
            buf = _widen(buf, ctx.weight_dtype)
        return buf, None, None


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
            ctx.total.add_product(dy.reshape(-1, dy.shape[-1]).T, x.reshape(-1, x.shape[-1]))
        return dx, None, None


def reuse(weight: torch.Tensor, dtype: torch.dtype) -> Reused:
    """weight (a parameter) in `dtype` for one unroll; every use must go through `linear`."""
    total = _Sum()
    return Reused(_Cast.apply(weight, dtype, total), total)


def linear(x: torch.Tensor, w: Reused) -> torch.Tensor:
    """F.linear(x, w.weight) (x cast to the weight's dtype), its weight gradient summed in w.grad."""
    return _Linear.apply(x, w.weight, w.grad)
