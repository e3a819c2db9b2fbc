"""The optimizer step that train.py takes and bench/train_speed.py times: AdamW, fused into one
kernel on a GPU, with gradient clipping by global norm folded into that kernel."""
from __future__ import annotations

from typing import Iterable

import torch


def adamw(params: list[torch.nn.Parameter], lr: float, betas, weight_decay: float,
          fused: bool) -> torch.optim.AdamW:
    """fp32 master weights and moments; `fused`: one kernel for the whole update (a GPU)."""
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=fused)


def clip_grad_norm(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
                   max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_(params, max_norm) for the coming optimizer.step(): gradients
    times min(1, max_norm / (norm + 1e-6)), the norm over all of them together (returned).

    A fused Adam(W) takes the factor inside its own kernel: it divides every gradient by its
    `grad_scale` (the hook torch.amp.GradScaler uses to unscale) instead of a separate pass over
    the gradients (-0.9 ms of a 183 ms step of the Kimi-size drafter, docs/perf.md). Other
    optimizers get the gradients scaled in place. (Under DeepSpeed train.py does not call this:
    DeepSpeed clips by itself.)"""
    opt = getattr(optimizer, "optimizer", optimizer)           # accelerate's AcceleratedOptimizer
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    # each group's own flag: a resumed state dict brings its groups' (a CPU run's may be unfused)
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and all(g.get("fused") for g in opt.param_groups):
        opt.grad_scale = 1.0 / coef
    else:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
