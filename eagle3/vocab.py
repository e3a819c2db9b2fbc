"""The draft vocabulary: which Vd of the target's V tokens the drafter's lm_head can emit.

Chosen once per feature dataset as the Vd most frequent ASSISTANT tokens (loss_mask == 1) of the
training split, saved with every checkpoint and export, never recomputed from other data.

Engine convention (SGLang `hot_token_id = d2t + arange`, vLLM `draft_id_to_target_id`):
    d2t [Vd] int64   target_id - draft_id, so target_id = draft_id + d2t[draft_id]
    t2d [V]  bool    True where the target token is in the draft vocab
Draft ids are ordered by ascending target id, so d2t is non-decreasing. Neither engine needs the
order (both index through d2t), but SpecForge selects teacher columns with the boolean mask
`logits[..., t2d]`, which yields ascending target ids: with this order a checkpoint means the same
thing under either selection, and `t2d.nonzero()` == `draft_ids`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
from safetensors.torch import load_file

from eagle3.durable import save_safetensors


@dataclass
class DraftVocab:
    d2t: torch.Tensor                       # [Vd] int64, target_id - draft_id
    t2d: torch.Tensor                       # [V] bool
    counts: Optional[torch.Tensor] = None   # [V] int64 assistant-token counts it was built from

    @property
    def draft_ids(self) -> torch.Tensor:
        """[Vd] int64: the target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    @property
    def size(self) -> int:
        return self.d2t.numel()

    @property
    def vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def coverage(self) -> float:
        """Fraction of the counted assistant tokens that the draft vocab contains."""
        if self.counts is None:
            raise ValueError("coverage needs the counts the vocab was built from")
        total = int(self.counts.sum())
        return float(self.counts[self.t2d].sum()) / total if total else 0.0

    def to(self, device) -> "DraftVocab":
        counts = None if self.counts is None else self.counts.to(device)
        return DraftVocab(self.d2t.to(device), self.t2d.to(device), counts)

    def save(self, path) -> None:
        tensors = {"d2t": self.d2t.to("cpu", torch.int64).contiguous(),
                   "t2d": self.t2d.to("cpu", torch.bool).contiguous()}
        if self.counts is not None:
            tensors["counts"] = self.counts.to("cpu", torch.int64).contiguous()
        save_safetensors(tensors, path)          # train.py's resume reads it back: never half a file

    @classmethod
    def load(cls, path) -> "DraftVocab":
        t = load_file(str(Path(path)))
        vocab = cls(t["d2t"], t["t2d"], t.get("counts"))
        check_vocab(vocab)
        return vocab


def check_vocab(vocab: DraftVocab) -> None:
    """d2t and t2d must describe the same set, in ascending target-id order."""
    ids = vocab.draft_ids
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab.vocab_size):
        raise ValueError(f"draft vocab maps outside the target vocab of {vocab.vocab_size}")
    if not torch.equal(torch.nonzero(vocab.t2d).flatten(), ids):
        raise ValueError("d2t and t2d disagree (or draft ids are not in ascending target-id order)")


def count_tokens(token_ids_iter: Iterable[torch.Tensor], loss_masks_iter: Iterable[torch.Tensor],
                 vocab_size: int) -> torch.Tensor:
    """[V] int64 counts of the tokens where the loss mask is 1 (assistant tokens), over all
    samples: token_ids_iter and loss_masks_iter yield one [T] tensor per sample, in step."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in zip(token_ids_iter, loss_masks_iter, strict=True):
        ids = torch.as_tensor(ids).reshape(-1).long()
        mask = torch.as_tensor(mask).reshape(-1).bool()
        if ids.shape != mask.shape:
            raise ValueError(f"token ids {tuple(ids.shape)} and loss mask {tuple(mask.shape)} differ")
        seen = ids[mask]
        if seen.numel() and (seen.min() < 0 or seen.max() >= vocab_size):
            raise ValueError(f"token id {int(seen.max())} outside the target vocab of {vocab_size}")
        counts += torch.bincount(seen, minlength=vocab_size)
    return counts


def _by_frequency(counts: torch.Tensor) -> torch.Tensor:
    """Token ids sorted by count descending; ties (zero counts included) by ascending id."""
    # A stable sort on the negated counts keeps equal counts in id order.
    return torch.sort(-counts.long(), stable=True).indices


def build_vocab(counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """The top-Vd tokens by count (Vd capped at V). When fewer than Vd tokens were seen, the rest
    are the lowest unseen ids, so the drafter always has exactly min(Vd, V) outputs."""
    counts = counts.long().cpu()
    size = min(draft_vocab_size, counts.numel())
    chosen = torch.sort(_by_frequency(counts)[:size]).values      # ascending target ids
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(size)
    return DraftVocab(d2t=d2t, t2d=t2d, counts=counts)


def coverage_curve(counts: torch.Tensor, sizes: Sequence[int]) -> List[Tuple[int, float]]:
    """[(Vd, fraction of counted tokens inside the top-Vd)] for each requested size."""
    counts = counts.long().cpu()
    total = int(counts.sum())
    cumulative = torch.cumsum(counts[_by_frequency(counts)], 0)
    out = []
    for size in sizes:
        n = min(int(size), counts.numel())
        covered = int(cumulative[n - 1]) if n > 0 else 0
        out.append((int(size), covered / total if total else 0.0))
    return out


def mapped_rows(rows: torch.Tensor, row_ids: torch.Tensor, new_ids: torch.Tensor, target_head: torch.Tensor,
                ridge: float = 1e-4) -> torch.Tensor:
    """A draft head for the draft vocab new_ids [Vd'] from one trained over row_ids [Vd] (rows [Vd, H]):
    the rows of tokens both vocabs hold are copied; every other row is the target's head row of its
    token carried by the one linear map A that best carries the target's rows of row_ids onto the
    trained rows (ridge least squares, rows ~ target_head[row_ids] @ A.T; ridge is relative to the
    mean of diag(X^T X)). -> [Vd', H] fp32.

    The target's head already places every token in its own output space; A translates that space
    into the drafter's, so a token the drafter never drafted starts where its neighbours are."""
    X = target_head[row_ids.long()].float()
    Y = rows.float()
    gram = X.T @ X
    lam = ridge * float(gram.diagonal().mean())
    A = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), X.T @ Y).T   # [H, Ht]
    out = target_head[new_ids.long()].float() @ A.T
    where = torch.full((target_head.shape[0],), -1, dtype=torch.long)
    where[row_ids.long()] = torch.arange(row_ids.numel())
    old = where[new_ids.long()]
    out[old >= 0] = Y[old[old >= 0]]
    return out
