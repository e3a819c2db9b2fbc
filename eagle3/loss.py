"""Training-time test (TTT): the drafter unrolled for `ttt_steps` draft steps, as the engines run it.

Step s at row t reads the hidden of step s-1 at row t (step 0: fc(aux_t)) and token x_{t+1+s}, sits
at position t+s, attends to the step-0 keys of rows <= t and to its own keys of steps 1..s, and is
taught by the target's distribution at row t+1+s (the prediction of x_{t+2+s}). A row counts when
x_{t+2+s} is a real assistant token the drafter can draft. Per step, the loss (`train.loss`,
eagle3/losses.py) is averaged over that step's counted rows and weighted decay**s. docs/ttt.md
explains each rule, the acceptance estimate and how the work is ordered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from eagle3.fused import fused
from eagle3.losses import NEEDS_MASS, check_loss, lean_row_losses
from eagle3.model import Eagle3Drafter
from eagle3.vocab import DraftVocab


@dataclass
class TTTOutput:
    loss: torch.Tensor            # scalar, differentiable: sum_s decay**s * per_step_loss[s]
    per_step_loss: torch.Tensor   # [S] fp32, detached: mean loss over step s's counted rows
    correct: torch.Tensor         # [S] int64: counted rows where draft argmax == target argmax
    count: torch.Tensor           # [S] int64: counted rows
    accepted: torch.Tensor        # [S] int64: chain rows whose steps 0..s all hit
    chained: torch.Tensor         # int64: rows a chain starts at (every assistant token)

    @property
    def acc(self) -> List[float]:
        """Per-step accuracy of this batch (0.0 for a step with nothing counted)."""
        return [c / n if n else 0.0 for c, n in zip(self.correct.tolist(), self.count.tolist())]


@torch.no_grad()
def target_teacher(final: torch.Tensor, target_lm_head: torch.Tensor, draft_ids: torch.Tensor,
                   chunk_rows: Optional[int] = None, temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """final [B, T, Ht], target_lm_head [V, Ht], draft_ids [Vd] -> (p [B, T, Vd] fp32 softmax of
    the target logits over the draft columns, divided by `temperature` first (train.teacher_temperature),
    top [B, T] int64 full-vocab argmax)."""
    B, T, _ = final.shape
    dt = torch.promote_types(target_lm_head.dtype, torch.float32)      # fp32 (fp64 in tests)
    p = torch.empty(B * T, draft_ids.numel(), dtype=dt, device=final.device)
    top = torch.empty(B * T, dtype=torch.int64, device=final.device)
    for span, logits in _target_logits(final, target_lm_head, chunk_rows):
        top[span], p[span] = _teacher_rows(logits, draft_ids, dt, 1.0 / temperature)
    return p.view(B, T, -1), top.view(B, T)


@torch.no_grad()
def batch_teacher(batch, target_lm_head: torch.Tensor, draft_ids: torch.Tensor, temperature: float = 1.0) -> tuple:
    """The teacher of a batch.Batch, as ttt_loss's `teacher`: target_teacher of its final states
    (p, top), or a compact dataset's stored teacher (p, top, mass), its top-K probabilities spread
    over the draft vocab and renormalised (eagle3/codec.py stores it). At a temperature other than 1
    a stored probability p becomes p ** (1 / temperature) before the renormalisation: the same
    tempered softmax, over the K kept columns."""
    if batch.teacher is None:
        return target_teacher(batch.final, target_lm_head, draft_ids, temperature=temperature)
    t = batch.teacher
    p = t.p if temperature == 1.0 else t.p.float().pow(1.0 / temperature)
    return dense_teacher(t.ids, p, draft_ids.numel()), t.top, t.mass


def dense_teacher(ids: torch.Tensor, p: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """(ids [..., K], p [..., K]) -> [..., Vd] fp32: the K probabilities at their draft ids, the rest
    0, renormalised to sum to 1 (soft_ce's gradient needs a distribution); an all-zero row (padding)
    stays zero."""
    pf = p.float()
    out = torch.zeros(*p.shape[:-1], draft_vocab_size, dtype=torch.float32, device=p.device)
    out.scatter_(-1, ids.long(), pf)
    return out / pf.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)


@torch.no_grad()
def draft_mass(final: torch.Tensor, target_lm_head: torch.Tensor, draft_ids: torch.Tensor,
               chunk_rows: Optional[int] = None) -> torch.Tensor:
    """[B, T] (fp32+): the target's full-vocab probability mass on the draft columns, row by row
    (c in eagle3/losses.py), a chunk of rows at a time like target_teacher."""
    B, T, _ = final.shape
    dt = torch.promote_types(target_lm_head.dtype, torch.float32)
    mass = torch.empty(B * T, dtype=dt, device=final.device)
    for span, logits in _target_logits(final, target_lm_head, chunk_rows):
        logits = logits.to(dt)
        mass[span] = (logits[:, draft_ids].logsumexp(-1) - logits.logsumexp(-1)).exp()
    return mass.view(B, T)


def _target_logits(final: torch.Tensor, target_lm_head: torch.Tensor, chunk_rows: Optional[int]):
    """(slice of the B*T rows, their full-vocab logits [c, V]), a chunk of rows at a time: about
    2^28 logits alive at once (the whole [B*T, V] would not fit at a large vocab and length)."""
    rows = final.reshape(-1, final.shape[-1]).to(target_lm_head.dtype)
    chunk = chunk_rows or max(1, (1 << 28) // target_lm_head.shape[0])
    for i in range(0, rows.shape[0], chunk):
        yield slice(i, i + chunk), rows[i:i + chunk] @ target_lm_head.T


# One kernel on a GPU (eagle3/fused.py): the argmax and the draft columns' softmax read the logits
# once, instead of an argmax pass, a gathered copy of the draft columns and a softmax over it.
@fused
def _teacher_rows(logits, draft_ids, dt: torch.dtype, inv_temperature: float = 1.0):
    """logits [c, V] -> (full-vocab argmax [c], softmax of the draft columns times inv_temperature
    [c, Vd] in dt)."""
    return logits.argmax(-1), (logits[:, draft_ids].to(dt) * inv_temperature).softmax(-1)


def ttt_mask(real: torch.Tensor, step: int) -> torch.Tensor:
    """[B, T] bool real -> [B, 1, T, (step+1)*T] bool over the keys [K_0 | K_1 | ... | K_step]:
    causal (real keys, and always itself) over K_0, the diagonal over each later K_r. What
    `attend` computes, as a dense mask (the tests' reference; training never builds it)."""
    B, T = real.shape
    i = torch.arange(T, device=real.device)[:, None]
    j = torch.arange(T, device=real.device)[None, :]
    causal = (j <= i) & (real[:, None, :] | (j == i))                   # [B, T, T]
    eye = torch.eye(T, dtype=torch.bool, device=real.device).expand(B, T, T)
    return torch.cat([causal] + [eye] * step, dim=-1)[:, None]


class _SoftCrossEntropy(torch.autograd.Function):
    """ce[i] = -sum_v p[rows[i], v] log_softmax(z[i])_v = lse(z[i]) - p[rows[i]] . z[i]
    (p sums to 1), and argmax(z) [N] (no gradient). The forward's one pass over z also writes the
    gradient's row part d[i] = softmax(z[i]) - p[rows[i]] in z's dtype and saves it instead of z;
    the backward only scales its rows by the upstream gradient, dz = g[:, None] * d, reading and
    writing bf16 instead of re-reading z and the gathered fp32 teacher rows. The accuracy's
    argmax, too, comes from this pass, not a pass of its own."""

    @staticmethod
    def forward(ctx, z, p, rows):
        ce, top, d = _soft_ce(z, p, rows)
        ctx.save_for_backward(d)
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, g, _):
        d, = ctx.saved_tensors
        return _scale_rows(d, g), None, None


# One kernel each on a GPU (eagle3/fused.py): the fp32 work over [N, Vd] and the gather of the
# teacher rows stay inside the kernel instead of fp32 copies of z and of p[rows].
@fused
def _soft_ce(z, p, rows):
    """z [N, Vd], p [R, Vd], rows [N] -> (ce [N] in fp32+, argmax(z) [N], d [N, Vd] in z's dtype:
    softmax(z) - p[rows], dce/dz)."""
    zf = z.to(torch.promote_types(z.dtype, p.dtype))
    lse = zf.logsumexp(-1)
    pr = p[rows]
    return lse - (pr * zf).sum(-1), z.argmax(-1), ((zf - lse[:, None]).exp() - pr).to(z.dtype)


@fused
def _scale_rows(d, g):
    """g[:, None] * d in d's dtype, for d [N, Vd] and g [N]."""
    return (d.to(g.dtype) * g[:, None]).to(d.dtype)


def ttt_loss(drafter: Eagle3Drafter, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             attention_mask: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
             target_lm_head: torch.Tensor, vocab: DraftVocab, ttt_steps: int = 7,
             decay: float = 0.8, teacher: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
             norm: Optional[torch.Tensor] = None, loss: str = "soft_ce",
             counted: Optional["CountedRows"] = None) -> TTTOutput:
    """input_ids, loss_mask, attention_mask [B, T] (right padding); aux [B, T, k*Ht];
    final [B, T, Ht] (post-norm target hidden); target_lm_head [V, Ht]. See the module doc.
    loss: one of eagle3.losses.LOSSES; soft_ce runs fused, the others in plain torch over the
    counted rows' logits.

    teacher: target_teacher's (p, top) when the caller computed it already, or batch_teacher's
    (p, top, mass) of a stored teacher, when final may be None. norm [S]: divide step s's
    summed loss by norm[s] instead of this batch's count, so micro-batches and data-parallel ranks add
    up to the loss of the whole global batch (train.py passes the global counts); per_step_loss
    stays this batch's mean. counted: this batch's CountedRows, when the caller built it earlier
    (train.py builds a whole step's at its start, so that no micro-batch but the first waits for it)."""
    check_loss(loss)
    B, T = input_ids.shape
    dev = input_ids.device
    real = attention_mask.bool()
    draft_ids = vocab.draft_ids.to(dev)
    p, top, *stored = teacher if teacher is not None else target_teacher(final, target_lm_head, draft_ids)
    mass = None
    if loss in NEEDS_MASS:
        mass = (stored[0] if stored else draft_mass(final, target_lm_head, draft_ids)).reshape(B * T)
    t2d = vocab.t2d.to(dev)
    w = drafter.weights()
    p_rows = p.reshape(B * T, -1)
    top_rows = top.reshape(B * T)

    # Rows to count are data, and shapes follow them: how many there are reaches the host without
    # a wait (CountedRows), long after the GPU found them, as all layer steps are queued first.
    if counted is None:
        counted = CountedRows(loss_mask, real, top, t2d, ttt_steps)
    hs, h = _unroll(drafter, input_ids, aux, ttt_steps, w)

    # The heads of all steps at once: each op runs once over every step's counted rows (step-major)
    # instead of once per step, so the host queues a few large kernels, not a dozen small ones
    # per step while the GPU waits for them.
    step, b, t = counted.rows()                                            # [M] each
    rows = b * T + t                                                       # [M] into one step's B*T rows
    h_rows = torch.stack(hs).reshape(ttt_steps * B * T, -1)[step * (B * T) + rows]
    # row_loss [M] against teacher row t+1+s. Every loss keeps not the logits [M, Vd] but their
    # gradient (soft_ce in one fused pass, the others a chunk of rows at a time).
    z, teacher_rows = drafter.logits(h_rows, w), rows + 1 + step
    if loss == "soft_ce":
        row_loss, drafted = _SoftCrossEntropy.apply(z, p_rows, teacher_rows)
    else:
        row_loss = lean_row_losses(loss, z, p_rows, teacher_rows, mass, step, ttt_steps)
        drafted = z.detach().argmax(-1)
    # per-step sums by a reduction over a one-hot [M, S], not index_add: a GPU's atomic adds
    # would make the logged loss differ in its last bits from run to run
    loss_sum = (F.one_hot(step, ttt_steps).to(row_loss.dtype) * row_loss[:, None]).sum(0)   # [S]
    per_step = loss_sum / counted.count.clamp(min=1)
    weight = decay ** torch.arange(ttt_steps, device=dev, dtype=row_loss.dtype)
    total = (weight * (per_step if norm is None else loss_sum / norm)).sum() + h.sum() * 0.0
    # (the zero term keeps backward() working when nothing is counted at all)
    with torch.no_grad():
        hit = draft_ids[drafted] == top_rows[rows + 1 + step]             # [M]
        correct = torch.zeros(ttt_steps, dtype=torch.int64, device=dev).index_add(0, step, hit.long())
        # a chain drafted at row t is accepted up to step s only if steps 0..s all hit there;
        # uncounted rows (undraftable, past the answer) end it
        alive = (loss_mask.bool() & real)[:, 2:]            # [B, T-2]: chains start at every assistant token
        hits = torch.zeros(ttt_steps, *alive.shape, dtype=torch.int32, device=dev)
        hits[step, b, t] = hit.int()
        accepted = (hits.cumprod(0).bool() & alive).sum((1, 2))
    return TTTOutput(loss=total, per_step_loss=per_step.detach().float(), correct=correct,
                     count=counted.count, accepted=accepted, chained=alive.sum())


def _unroll(drafter: Eagle3Drafter, input_ids: torch.Tensor, aux: torch.Tensor, ttt_steps: int, w):
    """The drafter unrolled for ttt_steps steps over every row (the module doc) -> (h_out of each
    step, [S] x [B, T, H]; the hidden a further step would read)."""
    B, T = input_ids.shape
    dev = input_ids.device
    # RoPE: step s at row t is at position t+s (see the module doc): angles once for all steps
    cos, sin = drafter.rope_angles(torch.arange(T - 1 + ttt_steps, device=dev).expand(B, -1))
    # step s at row t reads token x_{t+1+s} (0 past the end, never counted): rows s..s+T-1 of
    # ext; the embedding's part of q/k/v is projected once for all steps.
    ext = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, ttt_steps)], dim=1)  # [B, T-1+S]
    e_qkv = drafter.embed_qkv(ext, w)
    h = drafter.project(aux)
    # per layer (each has its own attention): step-0 keys, seen causally by every step, and the
    # later steps' keys, each row its own
    keys, extra, hs = None, [([], []) for _ in range(drafter.shape.num_layers)], []
    for s in range(ttt_steps):
        h_out, ks, vs = drafter.layer(e_qkv, h, (cos[:, s:s + T], sin[:, s:s + T]), w, keys,
                                      extra if s else None, start=s)
        h = drafter.carry(h_out)                        # what step s+1 reads
        if s == 0:
            keys = list(zip(ks, vs))
        else:
            for (ek, ev), k, v in zip(extra, ks, vs):
                ek.append(k)
                ev.append(v)
        hs.append(h_out)
    return hs, h


@torch.no_grad()
def ttt_hits(drafter: Eagle3Drafter, input_ids: torch.Tensor, aux: torch.Tensor, top: torch.Tensor,
             draft_ids: torch.Tensor, ttt_steps: int, rows: Optional[torch.Tensor] = None,
             chunk_rows: int = 4096) -> torch.Tensor:
    """[S, B, T] bool: does step s at row t, unrolled as ttt_loss unrolls it, draft top[b, t+1+s]
    (its argmax mapped to a target id by draft_ids [Vd]; False past the end and outside `rows`
    [B, T] bool, default all). top [B, T]: the target's argmax per row, or any token the drafts
    are judged by (a negative id is never hit). The drafter's logits, a chunk of rows at a time."""
    B, T = input_ids.shape
    dev = input_ids.device
    w = drafter.weights()
    hs, _ = _unroll(drafter, input_ids, aux, ttt_steps, w)
    hits = torch.zeros(ttt_steps, B, T, dtype=torch.bool, device=dev)
    want = torch.ones(B, T, dtype=torch.bool, device=dev) if rows is None else rows.bool()
    draft_ids = draft_ids.to(dev)
    b, t = want.nonzero(as_tuple=True)
    for s, h_out in enumerate(hs):
        judged = torch.cat([top[:, 1 + s:], top.new_full((B, min(1 + s, T)), -1)], dim=1)[:, :T]  # [B, T]
        for i in range(0, b.numel(), chunk_rows):
            bi, ti = b[i:i + chunk_rows], t[i:i + chunk_rows]
            drafted = draft_ids[drafter.logits(h_out[bi, ti], w).argmax(-1)]
            hits[s, bi, ti] = drafted == judged[bi, ti]
    return hits


class CountedRows:
    """The (step, batch, row) indices of the rows every TTT step trains on (counted_rows(..., s)),
    found for all steps at once on the device, in step-major order; `count` [S] on the device.

    The number of rows is data, so the host must learn it before it can shape the heads' work.
    Asking for it (`nonzero`, `.tolist()`) makes the host wait until the GPU has run everything
    queued so far, after which the GPU idles until the host queues more. Here the indices come
    from a stable sort (no wait) and their number is copied to pinned host memory as soon as it exists, with an event;
    `rows()` waits only for that event, which by then has long passed."""

    def __init__(self, loss_mask: torch.Tensor, attention_mask: torch.Tensor, top: torch.Tensor,
                 t2d: torch.Tensor, ttt_steps: int):
        every = counted_grid(loss_mask, attention_mask, top, t2d, ttt_steps)
        _, B, n = every.shape
        # counted entries first, each in its (step, batch, row) order
        order = torch.sort((~every).flatten().to(torch.uint8), stable=True).indices
        self.step = order.div(B * max(n, 1), rounding_mode="floor")
        self.b, self.t = order.div(max(n, 1), rounding_mode="floor") % B, order % max(n, 1)
        self.count = every.sum((1, 2))                      # [S] int64
        total = self.count.sum()
        self.event = None
        if total.is_cuda:
            self.total = torch.empty((), dtype=total.dtype, pin_memory=True)
            self.total.copy_(total, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.total = total

    def rows(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(step, b, t): int64 [M] each, M = count.sum(), ordered by step, then b, then t."""
        if self.event is not None:
            self.event.synchronize()
        m = int(self.total)
        return self.step[:m], self.b[:m], self.t[:m]


def counted_rows(loss_mask: torch.Tensor, attention_mask: torch.Tensor, top: torch.Tensor,
                 t2d: torch.Tensor, s: int) -> torch.Tensor:
    """[B, T-2-s] bool: the rows TTT step s trains on (docs/ttt.md): the predicted token
    x_{t+2+s} is a real assistant token and the teacher row's full-vocab argmax is draftable."""
    T = top.shape[1]
    wanted = loss_mask.bool() & attention_mask.bool()
    return wanted[:, 2 + s:] & t2d[top][:, 1 + s:T - 1]


def counted_grid(loss_mask: torch.Tensor, attention_mask: torch.Tensor, top: torch.Tensor,
                 t2d: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """[S, B, max(T-2, 0)] bool: counted_rows of every step s in its first T-2-s columns (the rows
    past them predict no token and are never counted)."""
    B, T = top.shape
    n = max(T - 2, 0)
    every = torch.zeros(ttt_steps, B, n, dtype=torch.bool, device=top.device)
    for s in range(min(ttt_steps, n)):
        every[s, :, :T - 2 - s] = counted_rows(loss_mask, attention_mask, top, t2d, s)
    return every


@torch.no_grad()
def unigram_correct(loss_mask: torch.Tensor, attention_mask: torch.Tensor, top: torch.Tensor,
                    vocab: DraftVocab, token: int) -> Tuple[int, int]:
    """(correct, count) of the baseline that always drafts `token` (the most frequent assistant token),
    over the rows TTT step 0 counts: what a drafter must beat to have learned anything."""
    counted = counted_rows(loss_mask, attention_mask, top, vocab.t2d.to(top.device), 0)
    return int((top[:, 1:-1][counted] == token).sum()), int(counted.sum())
