"""The optimizer step that train.py takes and bench/train_speed.py times: AdamW over fp32 master
weights that also writes each weight's compute-dtype copy (bf16) for the next forward, with
gradient clipping by global norm folded into the same pass.

torch's fused AdamW reads and writes the fp32 weights, moments and gradients (28 bytes per
weight), and then every forward casts the weights to bf16 again (6 more). Here one elementwise
function (`_adamw_`, a single fused kernel on a GPU through eagle3/fused.py) updates the weight and
its moments and writes the bf16 copy as it goes (2 more bytes instead of 6); eagle3/reused.py
hands that copy to the forward for as long as the weight is unchanged. The math is torch's AdamW
(decoupled weight decay, bias corrections), and the state dict is torch.optim.AdamW's, so a run
can resume across the two."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from eagle3.fused import fused
from eagle3.reused import keep_copy, kept_copy


@fused
def _adamw_(p, g, m, v, hp, copy):
    """One AdamW step in place on the flat p, m, v (fp32) for gradient g * hp[7]; copy <- p in its
    own dtype (None: no copy). hp = [lr, beta1, beta2, eps, weight_decay, 1 - beta1^t,
    sqrt(1 - beta2^t), gradient factor] (a tensor, so new values compile nothing new)."""
    lr, b1, b2, eps, wd, c1, c2, scale = hp.unbind()
    g = g.to(p.dtype) * scale
    p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).add_(g * g * (1 - b2))
    p.sub_(lr / c1 * m / (v.sqrt() / c2 + eps))
    if copy is not None:
        copy.copy_(p)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW's update, state and state dict; see the module doc. copy_dtype: write
    each weight's copy in it for the forward (None, or the weights' own dtype: no copies)."""

    def __init__(self, params, lr: float, betas, weight_decay: float,
                 copy_dtype: Optional[torch.dtype] = None):
        super().__init__(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=False)
        self.copy_dtype = copy_dtype
        self.grad_factor: Optional[torch.Tensor] = None     # set by clip_grad_norm for one step

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "AdamW.step takes no closure"
        factor, self.grad_factor = self.grad_factor, None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            hps = {}                                  # (step count, device) -> hp: one per group, as a rule
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if st["step"].device.type != "cpu":    # a fused run's state: the count stays here
                    st["step"] = st["step"].cpu()
                st["step"] += 1
                t = float(st["step"])
                hp = hps.get((t, p.device))
                if hp is None:
                    hp = torch.tensor([group["lr"], b1, b2, group["eps"], group["weight_decay"],
                                       1 - b1 ** t, (1 - b2 ** t) ** 0.5, 1.0], dtype=torch.float32)
                    hp = hps[t, p.device] = hp.to(p.device, non_blocking=True)
                    if factor is not None:
                        hp[7] = factor
                copy = None
                if self.copy_dtype not in (None, p.dtype):
                    copy = kept_copy(p, self.copy_dtype)
                    if copy is None:
                        copy = torch.empty_like(p, dtype=self.copy_dtype)
                _adamw_(p.view(-1), p.grad.view(-1), st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1),
                        hp, None if copy is None else copy.view(-1))
                if copy is not None:
                    keep_copy(p, copy)
        return None


def adamw(params: list[torch.nn.Parameter], lr: float, betas, weight_decay: float,
          copy_dtype: Optional[torch.dtype] = None) -> AdamW:
    """fp32 master weights and moments; copy_dtype: the forward's compute dtype (bf16 under
    autocast), whose copies the step writes. DeepSpeed steps its own flat partitions: give None."""
    return AdamW(params, lr, betas, weight_decay, copy_dtype)


def clip_grad_norm(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
                   max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_(params, max_norm) for the coming optimizer.step(): gradients
    times min(1, max_norm / (norm + 1e-6)), the norm over all of them together (returned).

    Our AdamW takes the factor inside its own pass (`grad_factor`) instead of a separate pass
    over the gradients (-0.9 ms of a 183 ms step of the Kimi-size drafter, docs/perf.md). Other
    optimizers get the gradients scaled in place. (Under DeepSpeed train.py does not call this:
    DeepSpeed clips by itself.)"""
    opt = getattr(optimizer, "optimizer", optimizer)           # accelerate's AcceleratedOptimizer
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if isinstance(opt, AdamW):
        opt.grad_factor = coef
    else:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
