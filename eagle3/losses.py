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


def check_loss(name: str) -> None:
    if name not in LOSSES:
        raise ValueError(f"train.loss={name!r}: choose one of {', '.join(LOSSES)}")


def row_losses(name: str, z: torch.Tensor, p: torch.Tensor, mass: torch.Tensor | None,
               step: torch.Tensor, steps: int) -> torch.Tensor:
    """z [N, Vd] logits (any float dtype), p [N, Vd] teacher rows (fp32, fp64 in tests), mass [N]
    (c; NEEDS_MASS only), step [N] each row's TTT step -> the loss of each row [N] in p's dtype
    (at least fp32). Every choice is a function of its own row, except lk's weight (see there)."""
    zf = z.to(torch.promote_types(z.dtype, p.dtype))
    logq = zf.log_softmax(-1)
    if name == "kl":
        return _kl(p, logq)
    if name == "jsd":
        return _jsd(p, logq)
    alpha = torch.minimum(mass[:, None] * p, logq.exp()).sum(-1)
    if name == "tv":
        return 1.0 - alpha
    if name == "lk_alpha":
        return -alpha.clamp(min=_TINY).log()
    if name == "lk":
        return _lk(_kl(p, logq), alpha, step, steps)
    raise ValueError(f"no per-row form for loss {name!r}")


def _kl(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Forward KL(p || q) = sum_v p_v (log p_v - log q_v): soft CE minus p's entropy, a constant,
    so the same gradient as soft_ce (the same drafter, up to rounding)."""
    return (torch.xlogy(p, p) - p * logq).sum(-1)


def _jsd(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence: (KL(p || m) + KL(q || m)) / 2 with m = (p + q) / 2, in nats."""
    q = logq.exp()
    m = 0.5 * (p + q)
    return 0.5 * ((torch.xlogy(p, p) - torch.xlogy(p, m)).sum(-1) + (q * logq - torch.xlogy(q, m)).sum(-1))


def _lk(kl: torch.Tensor, alpha: torch.Tensor, step: torch.Tensor, steps: int) -> torch.Tensor:
    """LK^lambda: lam * KL(p || q) + (1 - lam) * (1 - alpha), lam = exp(-eta * mean alpha) with the
    mean over the rows of the same TTT step in this (micro-)batch, held constant (no gradient):
    KL's strong gradient while the drafter overlaps the target little, acceptance itself as it
    learns."""
    with torch.no_grad():
        one_hot = F.one_hot(step, steps).to(alpha.dtype)                   # [N, S]
        mean = (one_hot * alpha[:, None]).sum(0) / one_hot.sum(0).clamp(min=1)
        lam = torch.exp(-LK_ETA * mean)[step]
    return lam * kl + (1.0 - lam) * (1.0 - alpha)
