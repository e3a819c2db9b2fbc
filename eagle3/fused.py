"""One switch that runs the drafter's elementwise chains as fused kernels (torch.compile).

The drafter step is matmuls plus chains of elementwise ops that eager PyTorch runs as one kernel
per op, each reading and writing its whole tensor (often an fp32 copy): RMSNorm, rope, silu*up,
the attention's log-sum-exp merge and the soft cross-entropy. Each chain is ONE pure tensor
function beside its user (eagle3/layers.py, eagle3/loss.py), decorated with `@fused`: on a GPU it
runs through torch.compile (inductor writes one Triton kernel per chain, intermediates stay in
registers), elsewhere it is the plain function. Same function, same math; the two differ only by
float rounding (a fused kernel rounds once where eager rounds after each op).

    set_enabled(None)    # default: compile where the inputs are on CUDA, unless EAGLE3_COMPILE=0
    set_enabled(True)    # compile on every device (tests check compiled against eager on the CPU)
    set_enabled(False)   # eager everywhere (bench/train_speed.py --compile off)

EAGLE3_COMPILE=1 forces compile on every device, EAGLE3_COMPILE=0 turns it off; set_enabled wins
over the variable. On the CPU the default is eager: compiling costs seconds per function, more
than a CPU run saves.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import torch

_ENABLED: Optional[bool] = None

# dynamic=True: sequence length and counted rows change every batch; one graph per function (per
# rank, dtype and list length) then serves them all instead of a recompile per new length.
# The merge functions of the attention take one tensor per earlier TTT step, so each step count
# is its own graph (7 for TTT 7, forward and backward, plus the cached-inference variants):
# dynamo's default of 8 graphs per function would silently fall back to eager past that.
# fullgraph=True: a graph break would split the chain into several kernels (or eager ops)
# without a word; it raises instead.
_RECOMPILE_LIMIT = 64
# Except the last dim of every tensor argument of 2+ dims: in this project that is always a width
# of the model (hidden, vocab, heads, head_dim), fixed for a run, never a count of tokens or rows.
# Compiled as a constant it turns the kernels' per-element row and column index math (x // W,
# x % W: the broadcast of a row statistic, the gathered teacher rows) from divisions by a runtime
# value into multiplies (the gain is in docs/perf.md). A new width compiles a new graph, as a new
# model would anyway.


def set_enabled(flag: Optional[bool]) -> Optional[bool]:
    """True: compile on every device; False: never; None: the default (see the module doc).
    Returns the previous setting, so a caller can restore it."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, flag
    return previous


def _compiling(x: torch.Tensor) -> bool:
    if _ENABLED is not None:
        return _ENABLED
    env = os.environ.get("EAGLE3_COMPILE", "")
    if env in ("0", "1"):
        return env == "1"
    return x.is_cuda


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def fused(fn: Callable) -> Callable:
    """fn(x, ...) -> torch.compile(fn)(x, ...) when compiling is on for x's device, else fn itself.
    fn must be a tensor function without data-dependent Python control flow, either pure or
    updating its tensor arguments in place (the optimizer's step, eagle3/optim.py); its first
    argument is a tensor and decides the device."""
    compiled = None

    @functools.wraps(fn)
    def run(x, *args):
        nonlocal compiled
        if not _compiling(x):
            return fn(x, *args)
        if compiled is None:
            cfg = torch._dynamo.config
            cfg.cache_size_limit = max(cfg.cache_size_limit, _RECOMPILE_LIMIT)
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        for t in _tensors((x, *args)):
            if t.dim() >= 2:
                torch._dynamo.mark_static(t, t.dim() - 1)
        return compiled(x, *args)

    return run
