"""The optimizer step that train.py takes and bench/train_speed.py times: AdamW that keeps fp32
master weights for bf16 parameters (SpecForge's and DeepSpeed's layout), with gradient clipping by
global norm folded into the same pass.

Under bf16 mixed precision the drafter's parameters are bf16 (train.py): the forward reads them as
they are and backward's GEMMs write their gradients in bf16 (eagle3/reused.py). The state of such a
parameter holds `master` (its fp32 weight), `exp_avg` and `exp_avg_sq` (fp32, shaped like it) and
`step` (a CPU count). One elementwise function (`_adamw_`, a single fused kernel on a GPU through
eagle3/fused.py) reads the bf16 gradient, updates master and moments in fp32 and writes the
parameter as the master rounded to bf16: per weight, master 4 + 4, moments 8 + 8, gradient 2 and
parameter 2 = 28 bytes, with no other pass over weights or gradients. (fp32 parameters under
autocast need their gradients widened to fp32 in a pass of their own, then read 4-byte gradients
here and in the norm, and need a bf16 copy of each weight for the forward.) Gradients of micro-batches add up in bf16 in .grad, as the GEMMs already sum
the TTT steps' contributions to each weight in bf16.

fp32 parameters (fp32 and fp16 runs, DeepSpeed's flat partitions) are updated in place, with no
master. The math is torch's AdamW (decoupled weight decay, bias corrections) and the state dict is
torch.optim.AdamW's, plus `master`: a run resumes across the two with fp32 parameters. A bf16
parameter whose loaded state has no master (a checkpoint written with fp32 parameters) starts its
master from the loaded weight, i.e. rounded to bf16."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from eagle3.fused import fused

_NARROW = (torch.bfloat16, torch.float16)     # parameter dtypes whose fp32 weight is a master in the state


@fused
def _adamw_(p, g, m, v, hp, copy):
    """One AdamW step in place on the flat p, m, v (fp32) for gradient g * hp[7] (g in any float
    dtype, widened here); copy <- p rounded to copy's dtype (the bf16 parameter whose master p is;
    None: p is the parameter). hp = [lr, beta1, beta2, eps, weight_decay, 1 - beta1^t,
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
    """torch.optim.AdamW's update, state and state dict, with fp32 masters for bf16/fp16
    parameters; see the module doc."""

    def __init__(self, params, lr: float, betas, weight_decay: float):
        super().__init__(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=False)
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
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                if p.dtype in _NARROW and "master" not in st:   # new, or loaded from a state without one
                    st["master"] = p.float()
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
                m, v = st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)
                if "master" in st:
                    _adamw_(st["master"].view(-1), p.grad.view(-1), m, v, hp, p.view(-1))
                else:
                    _adamw_(p.view(-1), p.grad.view(-1), m, v, hp, None)
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that a bf16/fp16 parameter's floating state (master, moments) is loaded
        in fp32, only moved to the parameter's device. torch casts every floating state tensor but
        `step` to its parameter's dtype, which would round masters and moments to bf16 on resume;
        it does so in Optimizer._process_value_according_to_param_policy, which it calls through
        the class Optimizer itself (torch 2.13), so overriding that staticmethod changes nothing:
        those tensors are held back from torch's load and put in afterwards."""
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        state, held = dict(state_dict["state"]), {}
        for i, p in zip(ids, params):                # torch's load checks that the groups match
            if p.dtype in _NARROW and i in state:
                held[p] = {k: v for k, v in state[i].items()
                           if k != "step" and torch.is_tensor(v) and v.is_floating_point()}
                state[i] = {k: v for k, v in state[i].items() if k not in held[p]}
        super().load_state_dict({**state_dict, "state": state})
        for p, tensors in held.items():
            self.state[p].update({k: v.to(p.device, torch.float32) for k, v in tensors.items()})


def adamw(params: list[torch.nn.Parameter], lr: float, betas, weight_decay: float) -> AdamW:
    """fp32 moments, and fp32 masters for bf16 parameters (module doc). DeepSpeed steps its own
    fp32 flat partitions with it."""
    return AdamW(params, lr, betas, weight_decay)


def clip_grad_norm(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
                   max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_(params, max_norm) for the coming optimizer.step(): gradients
    times min(1, max_norm / (norm + 1e-6)), the norm over all of them together (returned, fp32).

    The norm is taken in fp32 whatever the gradients' dtype: torch's on bf16 gradients is a bf16
    number (3 significant digits). Our AdamW takes the factor inside its own pass (`grad_factor`)
    instead of a separate pass over the gradients. Other optimizers get the gradients scaled in
    place. (Under DeepSpeed
    train.py does not call this: DeepSpeed clips by itself.)"""
    opt = getattr(optimizer, "optimizer", optimizer)           # accelerate's AcceleratedOptimizer
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if isinstance(opt, AdamW):
        opt.grad_factor = coef
    else:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
