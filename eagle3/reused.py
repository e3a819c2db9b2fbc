"""Weights used at every TTT step, with their gradient summed inside the GEMMs.

Training-time test runs the drafter's layers and its lm_head S times (eagle3/loss.py), so each
of those weights gets S gradient contributions. Plain autograd writes each contribution as its
own weight-sized tensor and adds them one by one: S writes plus S-1 read-read-write passes over
every weight. Here the weight is cast
to the compute dtype once per unroll (`reuse`), every use goes through `linear`, and each use's
backward adds its contribution into ONE buffer with the GEMM itself (addmm_, beta = 1): S GEMMs,
the first writing and the rest reading and writing the buffer, and nothing else. The cast's own
backward, which autograd runs only after every use's backward (it depends on all of them), hands
the sum to the weight.

The buffer is in the compute dtype. Under bf16 mixed precision the weights are bf16 themselves
(train.py; their fp32 masters live in eagle3/optim.AdamW's state), so the cast is a view and the
sum is the weight's gradient as it is. An fp32 weight under autocast (an fp16 run) gets the sum
widened to fp32 once, as a compiled kernel on a GPU (`_widen`, faster than torch's cast). (Having
cuBLAS write and sum fp32 itself, `out_dtype`, slows those GEMMs by as much as the casts it saves:
docs/perf.md.)

The token embedding's part of q/k/v is such a tensor too (`shared`): every TTT step reads a window
of its rows (`window`), and each window's gradient is added into one buffer of its shape, which
the root's backward hands on, where autograd would give every window a zero-filled gradient of the
whole tensor and add those up.

`linear(x, w, add=y)` adds y inside the GEMM (cuBLAS's epilogue reads it): the residual adds of
the layer and the window of q/k/v's token part, each otherwise a pass of its own that reads two
[T, N] tensors and writes a third (21 such passes per unroll).

Same math as F.linear everywhere; the sum is only rounded differently (once per GEMM into the
buffer's dtype). tests/test_loss.py checks every gradient of the unrolled loss against a naive
reference in float64, tests/test_fused.py against F.linear.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from eagle3.fused import fused


@dataclass
class _Sum:
    buf: Optional[torch.Tensor] = None      # the gradient summed over the uses so far

    def add_window(self, shape: torch.Size, start: int, g: torch.Tensor) -> None:
        """buf[:, start:start + len] (+)= g, buf [B, L, ..] of `shape` (zeros before the first)."""
        if self.buf is None:
            self.buf = g.new_zeros(shape)
        self.buf[:, start:start + g.shape[1]].add_(g)     # (`+=` on a slice would copy it back too)

    def add_product(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """buf (+)= a @ b, in the compute dtype (the GEMM's own; the cast's backward widens the sum once
        where the weight is wider)."""
        if self.buf is None:
            self.buf = a @ b
        else:
            self.buf.addmm_(a, b)


@dataclass
class Reused:
    """A weight in the compute dtype for one unroll (or an activation every TTT step reads a window
    of, `shared`), and its uses' gradient sum."""
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
        return w.view_as(w) if w.dtype == dtype else w.to(dtype)

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
    def forward(ctx, x, w, total, add):
        x = x.to(w.dtype)
        ctx.save_for_backward(x, w)
        ctx.total = total
        if add is not None and add.dtype == w.dtype:                # the add inside the GEMM
            y = torch.addmm(add.reshape(-1, add.shape[-1]), x.reshape(-1, x.shape[-1]), w.T)
            return y.view(add.shape)
        y = F.linear(x, w)
        return y if add is None else y + add                         # (another dtype: `+`'s promotion)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dg = dy.to(w.dtype)                        # (a wider add widened the output: not the GEMM's)
        dx = dg @ w if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            ctx.total.add_product(dg.reshape(-1, dg.shape[-1]).T, x.reshape(-1, x.shape[-1]))
        return dx, None, None, dy if ctx.needs_input_grad[3] else None


def reuse(weight: torch.Tensor, dtype: torch.dtype) -> Reused:
    """weight (a parameter) in `dtype` for one unroll; every use must go through `linear`."""
    total = _Sum()
    return Reused(_Cast.apply(weight, dtype, total), total)


class _Window(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, start, length, total):
        ctx.shape, ctx.start, ctx.total = x.shape, start, total
        return x[:, start:start + length]

    @staticmethod
    def backward(ctx, g):
        ctx.total.add_window(ctx.shape, ctx.start, g)
        return None, None, None, None


def shared(x: torch.Tensor) -> Reused:
    """x [B, L, ..], of which every TTT step reads a window of rows through `window`."""
    total = _Sum()
    return Reused(_Cast.apply(x, x.dtype, total), total)


def window(x: Reused, start: int, length: int) -> torch.Tensor:
    """x.weight[:, start:start + length] (a view). Its gradient goes into ONE buffer of x's shape
    for all windows; autograd would give each window's use a zero-filled x-sized gradient and add
    those up (the tokens' q/k/v part, [B, T+S-1, N])."""
    return _Window.apply(x.weight, start, length, x.grad)


def linear(x: torch.Tensor, w: Reused, add: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, w.weight) (x cast to the weight's dtype), its weight gradient summed in w.grad;
    + add [.., out] (a residual, a window of `shared` rows), inside the GEMM (addmm, which reads it
    in its epilogue) when add is in the weight's dtype, else as `+`."""
    return _Linear.apply(x, w.weight, w.grad, add)
