"""The per-row losses `train.loss` chooses from (eagle3/loss.py applies one to the counted rows).

For a counted row: z [Vd] the drafter's logits, q = softmax(z); p [Vd] the teacher, the target's
softmax restricted to the draft vocab and renormalised; c the target's probability mass on the
draft vocab (full-vocab softmax), so c * p is the target's own probability of each draft token.
A chain drafter's token is accepted with probability alpha = sum_v min(c p_v, q_v) (speculative
sampling; 1 - alpha is the total variation between the target's full distribution and q, which
puts nothing outside the draft vocab). docs/ttt.md has the choices side by side.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# soft_ce: the fused default (eagle3.loss._SoftCrossEntropy); the others are computed here.
LOSSES = ("soft_ce", "kl", "tv", "jsd", "lk", "lk_alpha")
# Losses that need c (the target's mass on the draft vocab): those built on alpha.
NEEDS_MASS = ("tv", "lk", "lk_alpha")
LK_ETA = 3.0          # LK^lambda's eta: the value its paper recommends (arXiv 2602.23881)
_TINY = 1e-8          # floor under alpha before the log (a row the drafter gives no overlap)


def check_loss(name: str, teacher_temperature: float = 1.0) -> None:
    """A loss train.py can run: a known name, and a teacher temperature it applies to
    (train.teacher_temperature tempers p; the losses built on alpha need the target's own p)."""
    if name not in LOSSES:
        raise ValueError(f"train.loss={name!r}: choose one of {', '.join(LOSSES)}")
    if not teacher_temperature > 0:
        raise ValueError(f"train.teacher_temperature={teacher_temperature}: must be above 0 "
                         f"(1 is the target's own distribution; below 1 sharpens it)")
    if teacher_temperature != 1.0 and name in NEEDS_MASS:
        raise ValueError(f"train.teacher_temperature={teacher_temperature} with train.loss={name}: "
                         f"that loss measures acceptance against the target's own probabilities; "
                         f"temper the teacher of soft_ce, kl or jsd only")


def row_losses(name: str, z: torch.Tensor, p: torch.Tensor, mass: torch.Tensor | None,
               step: torch.Tensor, steps: int, lam: torch.Tensor | None = None) -> torch.Tensor:
    """z [N, Vd] logits (any float dtype), p [N, Vd] teacher rows (fp32, fp64 in tests), mass [N]
    (c; NEEDS_MASS only), step [N] each row's TTT step -> the loss of each row [N] in p's dtype
    (at least fp32). Every choice is a function of its own row, except lk's weight (see there),
    which `lam` [N] gives instead when the rows are a part of the batch."""
    zf = z.to(torch.promote_types(z.dtype, p.dtype))
    logq = zf.log_softmax(-1)
    if name == "kl":
        return _kl(p, logq)
    if name == "jsd":
        return _jsd(p, logq)
    alpha = _alpha(p, logq, mass)
    if name == "tv":
        return 1.0 - alpha
    if name == "lk_alpha":
        return -alpha.clamp(min=_TINY).log()
    if name == "lk":
        lam = _lk_lambda(alpha, step, steps) if lam is None else lam
        return lam * _kl(p, logq) + (1.0 - lam) * (1.0 - alpha)
    raise ValueError(f"no per-row form for loss {name!r}")


def lean_row_losses(name: str, z: torch.Tensor, p: torch.Tensor, rows: torch.Tensor, mass: torch.Tensor | None,
                    step: torch.Tensor, steps: int, chunk_elems: int = 1 << 26) -> torch.Tensor:
    """row_losses(name, z, p[rows], mass, step, steps) with its gradient, in the memory of the
    gradient alone: a chunk of rows at a time, each chunk's loss and dloss/dz are found together,
    and only dloss/dz (in z's dtype, like soft_ce's) is kept for the backward, instead of every
    [N, Vd] fp32 intermediate autograd would keep (the gathered teacher rows, log q, q, min(c p, q)).
    mass [R] here is indexed by rows too. chunk_elems bounds a chunk's rows x Vd."""
    return _LeanRowLoss.apply(z, p, rows, mass, step, name, steps, chunk_elems)


class _LeanRowLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, p, rows, mass, step, name, steps, chunk_elems):
        n = z.shape[0]
        chunk = max(1, chunk_elems // max(1, z.shape[1]))
        spans = [slice(i, min(n, i + chunk)) for i in range(0, n, chunk)]
        m = None if mass is None else mass[rows]
        lam = None
        if name == "lk":                 # the weight depends on every row of a step: a pass first
            with torch.no_grad():
                alpha = torch.cat([_alpha(p[rows[s]], z[s].to(torch.promote_types(z.dtype, p.dtype)).log_softmax(-1),
                                          m[s]) for s in spans]) if n else z.new_zeros(0, dtype=p.dtype)
                lam = _lk_lambda(alpha, step, steps)
        out = torch.empty(n, dtype=torch.promote_types(torch.promote_types(z.dtype, p.dtype), torch.float32),
                          device=z.device)
        grad = torch.empty_like(z)
        for s in spans:
            with torch.enable_grad():
                zc = z[s].detach().requires_grad_(True)
                loss = row_losses(name, zc, p[rows[s]], None if m is None else m[s], step[s], steps,
                                  None if lam is None else lam[s])
                g, = torch.autograd.grad(loss.sum(), zc)
            out[s] = loss.detach()
            grad[s] = g.to(z.dtype)
        ctx.save_for_backward(grad)
        return out

    @staticmethod
    def backward(ctx, gout):
        grad, = ctx.saved_tensors
        return (grad.to(gout.dtype) * gout[:, None]).to(grad.dtype), None, None, None, None, None, None, None


def _alpha(p: torch.Tensor, logq: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """The acceptance probability of each row: sum_v min(c p_v, q_v)."""
    return torch.minimum(mass[:, None] * p, logq.exp()).sum(-1)


def _kl(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Forward KL(p || q) = sum_v p_v (log p_v - log q_v): soft CE minus p's entropy, a constant,
    so the same gradient as soft_ce (the same drafter, up to rounding)."""
    return (torch.xlogy(p, p) - p * logq).sum(-1)


def _jsd(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence: (KL(p || m) + KL(q || m)) / 2 with m = (p + q) / 2, in nats."""
    q = logq.exp()
    m = 0.5 * (p + q)
    return 0.5 * ((torch.xlogy(p, p) - torch.xlogy(p, m)).sum(-1) + (q * logq - torch.xlogy(q, m)).sum(-1))


def _lk_lambda(alpha: torch.Tensor, step: torch.Tensor, steps: int) -> torch.Tensor:
    """LK^lambda's weight of each row. The loss is lam * KL(p || q) + (1 - lam) * (1 - alpha),
    lam = exp(-eta * mean alpha) with the mean over the rows of the same TTT step in this
    (micro-)batch, held constant (no gradient): KL's strong gradient while the drafter overlaps the
    target little, acceptance itself as it learns."""
    with torch.no_grad():
        one_hot = F.one_hot(step, steps).to(alpha.dtype)                   # [N, S]
        mean = (one_hot * alpha[:, None]).sum(0) / one_hot.sum(0).clamp(min=1)
        return torch.exp(-LK_ETA * mean)[step]
