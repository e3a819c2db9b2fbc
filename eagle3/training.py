"""The pieces of train.py's loop: the drafter and its loss as one forward, the per-step statistics
reduced over processes, the stop at a non-finite loss, and the metrics log with the run's progress
(rate, elapsed, time left)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle3.loss import ttt_loss
from eagle3.model import Eagle3Drafter
from eagle3.vocab import DraftVocab

RATE_WINDOW = 50   # steps the ETA's rate is taken over: recent enough to follow a change of pace


class Objective(torch.nn.Module):
    """The drafter and its TTT loss as one forward, so DDP and DeepSpeed wrappers see a forward call.
    The target's lm_head [V, Ht] is an argument, not a parameter: frozen, never saved."""

    def __init__(self, drafter: Eagle3Drafter, vocab: DraftVocab, ttt_steps: int, decay: float,
                 loss: str = "soft_ce"):
        super().__init__()
        self.drafter, self.vocab, self.ttt_steps, self.decay, self.loss = drafter, vocab, ttt_steps, decay, loss

    def forward(self, input_ids, loss_mask, attention_mask, aux, final, lm_head, teacher=None, norm=None,
                counted=None):
        out = ttt_loss(self.drafter, input_ids, loss_mask, attention_mask, aux, final, lm_head, self.vocab,
                       ttt_steps=self.ttt_steps, decay=self.decay, teacher=teacher, norm=norm,
                       loss=self.loss, counted=counted)
        # a plain tuple: ZeRO-3's backward hooks find tensors only in tuples, lists and dicts
        return out.loss, out.per_step_loss, out.correct, out.count, out.accepted, out.chained


class StepStats:
    """Sums of loss shares, per-TTT-step correct/count and chain acceptance (eagle3.loss: what an
    engine would accept) over micro batches, reduced over processes.

    The sums stay on the device until `reduce`: copying a micro-batch's counts to the host would make
    the host wait for the GPU after every forward, and the GPU then idles while the host queues the
    next one."""

    def __init__(self, ttt_steps: int, device="cpu"):
        self.k = ttt_steps
        # [loss, correct[S], count[S], accepted[S], chained]
        self.sums = torch.zeros(3 * ttt_steps + 2, dtype=torch.float64, device=device)

    def add(self, out) -> None:
        parts = [out.loss.detach().reshape(1), out.correct.detach(), out.count.detach(), out.accepted.detach(),
                 torch.as_tensor(out.chained).detach().reshape(1)]
        self.sums += torch.cat([t.to(self.sums.device, torch.float64) for t in parts])

    def reduce(self, acc, batches: int) -> dict:
        """batches: how many global batches the shares cover (their losses are averaged).
        accept[s]: the share of chains accepted through draft position s; tau3 = 1 + accept[0..2]
        estimates tau at a chain of 3 (eagle3.loss's module doc says when it holds)."""
        t = acc.reduce(self.sums.to(acc.device), reduction="sum").cpu()
        k = self.k
        correct, count, accepted, chained = t[1:1 + k], t[1 + k:1 + 2 * k], t[1 + 2 * k:1 + 3 * k], t[-1]
        accept = [float(a) for a in accepted / chained.clamp(min=1)]
        return {"loss": float(t[0]) / max(batches, 1),
                "acc": [float(a) for a in (correct / count.clamp(min=1))],
                "tokens": int(count[0]), "accept": accept, "tau3": 1 + sum(accept[:3])}


def stop_if_not_finite(losses: list, sample_ids: list, step: int, run_dir: Path) -> None:
    """Stop at a step whose micro-batch losses are not all finite, naming the first such micro-batch's
    samples, before the optimizer steps on its gradients (DeepSpeed steps inside the last backward)."""
    finite = torch.isfinite(torch.stack(losses)).tolist()
    if not all(finite):
        j = finite.index(False)
        sys.exit(f"error: non-finite loss {float(losses[j])} at step {step} on samples {sample_ids[j]}; "
                 f"the last good checkpoint in {run_dir / 'checkpoints'} is kept")


class Logger:
    """metrics.jsonl (what the plots read) and wandb, on the main process only."""

    def __init__(self, run_dir: Path, enabled: bool, use_wandb: bool, cfg):
        self.enabled, self.wandb = enabled, None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a")
        if use_wandb:
            import wandb
            self.wandb = wandb.init(project="eagle3", dir=str(run_dir), mode=wandb_mode(),
                                    name=run_dir.name, config=OmegaConf.to_container(cfg, resolve=True))

    def write(self, row: dict, total: int, elapsed: float = 0.0) -> None:
        """The console line opens with steps done/total; a train row's adds tokens/s, elapsed and ETA."""
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        lists, head = ("acc", "accept"), f"step {row['step'] + 1}/{total}"
        if "eta_s" in row:
            head += f" {row['tok_s']:,.0f} tok/s elapsed {duration(elapsed)} eta {duration(row['eta_s'])}"
        shown = ("step", "split", *lists, *(("tok_s", "eta_s") if "eta_s" in row else ()))
        msg = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k not in shown)
        print(f"[{row['split']}] {head} {msg} " + " ".join(f"{k}=[{', '.join(f'{a:.3f}' for a in row[k])}]"
                                                          for k in lists if k in row), flush=True)
        if self.wandb is not None:
            flat = {f"{row['split']}/{k}": v for k, v in row.items() if k not in ("split", "step", *lists)}
            flat.update({f"{row['split']}/{k}_{s}": a for k in lists for s, a in enumerate(row.get(k, []))})
            self.wandb.log(flat, step=row["step"])

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


def wandb_mode() -> str:
    """Online only when the user is logged in; WANDB_MODE wins when set."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    logged_in = bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    return "online" if logged_in else "offline"


def eta_seconds(recent, step: int, total: int) -> float:
    """Seconds left after `step` of `total` (0-based), at the mean step time between the oldest and
    newest of `recent` (step, time it ended) points."""
    (s0, t0), (s1, t1) = recent[0], recent[-1]
    return (total - 1 - step) * (t1 - t0) / max(s1 - s0, 1)


def duration(seconds: float) -> str:
    """1h02m, 3m20s, 42s."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
