"""What greedy chain drafting (eagle3/specdec.py `spec_decode`) serves, without running it: the
target's greedy decode once, then one teacher-forced drafter forward over every row at once.

    runs = [greedy_run(model, ids, max_new_tokens, stop, past=max(chains)) for ids in prompts]
    counts = replay_counts(model, drafter, aux_layers, runs, chains)     # [{k: SpecCounts}] per run
    out = replay(model, drafter, aux_layers, prompts, chains, max_new_tokens, stop)  # both at once

Why it is exact: an accepted draft equals the target's greedy token, so along an accepted chain the
drafter reads what training-time test feeds it (eagle3/loss.py: step s at row t reads x_{t+1+s}
and its own step s-1 hidden, sees step-0 keys causally and later steps' keys of its own row). So
accept(r), the leading steps of the chain started at row r whose draft equals the greedy token
x_{r+2+s}, comes for every row from one `ttt_hits` forward, and the decode is a walk: the first
token x_L comes from the prefill; the chain starts at row L-1; each verify counts a = accept(r)
(counts.add(a, k)), emits a+1 tokens, and the next chain starts a+1 rows further, until the
output reaches a stop id or max_new_tokens. The drafts of the last verify are judged against
tokens past that end, so the greedy decode runs `past` = k tokens further, stop ids ignored.

The greedy decode is specdec.greedy_decode, one prompt at a time with a KV cache: padded batches
would change the target's arithmetic and could flip a near-tie argmax, and the greedy output is
the one thing every count depends on. `GreedyCache` keeps each greedy run on disk, keyed by all it
depends on, so judging more drafters later decodes no prompt twice. The hidden states
(eagle3.hidden.capture_batch) and the drafter forward run padded batches of prompts. Counts match
spec_decode's up to such near ties: its verify reads k+1 rows per forward, a third way to add the
same numbers.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

from eagle3.durable import write_text
from eagle3.hidden import capture_batch, pad_right
from eagle3.loss import ttt_hits
from eagle3.specdec import Eagle3ChainDrafter, SpecCounts, greedy_decode
from eagle3.targets import cache_root, fingerprint


@dataclass
class GreedyRun:
    prompt: List[int]
    tokens: List[int]          # the greedy output (its stop token included), then `past` more greedy tokens
    num_out: int               # the output's length

    @property
    def output(self) -> List[int]:
        return self.tokens[:self.num_out]


@torch.no_grad()
def greedy_run(model, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int],
               past: int) -> GreedyRun:
    out, _ = greedy_decode(model, prompt_ids, max_new_tokens, stop_ids)
    more, _ = greedy_decode(model, list(prompt_ids) + out, past, []) if past else ([], 0.0)
    return GreedyRun(list(prompt_ids), out + more, len(out))


class GreedyCache:
    """Greedy runs on disk, one JSON file each under `root`, named by a hash of everything the greedy
    tokens depend on: `model_key` (the target's weights, dtype, device and library versions: the
    caller's), the prompt, max_new_tokens and the stop ids. A run decoded `past` tokens further serves
    any shorter `past` (those tokens are a prefix of it); a longer one decodes again and replaces it."""

    def __init__(self, root: Path, model_key: str):
        self.root, self.model_key = Path(root), model_key
        self.hits = self.misses = 0

    def path(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]) -> Path:
        key = json.dumps([self.model_key, list(prompt_ids), max_new_tokens, sorted(stop_ids)])
        return self.root / f"{hashlib.blake2b(key.encode(), digest_size=12).hexdigest()}.json"

    def run(self, model, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int],
            past: int) -> GreedyRun:
        path = self.path(prompt_ids, max_new_tokens, stop_ids)
        if path.exists():
            kept = json.loads(path.read_text())
            if kept["past"] >= past and kept["prompt"] == list(prompt_ids):
                self.hits += 1
                return GreedyRun(kept["prompt"], kept["tokens"][:kept["num_out"] + past], kept["num_out"])
        self.misses += 1
        r = greedy_run(model, prompt_ids, max_new_tokens, stop_ids, past)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps({"prompt": r.prompt, "tokens": r.tokens, "num_out": r.num_out, "past": past}))
        return r


def greedy_cache(target_dir: Path, model) -> GreedyCache:
    """The GreedyCache under cache_root()/greedy for this target as loaded (weights, dtype, device
    and library versions): evaluate.py's replay backend and the benches share its runs."""
    import transformers
    p = next(model.parameters())
    where = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else "cpu"
    return GreedyCache(cache_root() / "greedy", f"{fingerprint(Path(target_dir))} {p.dtype} {where} "
                                                f"torch {torch.__version__} transformers {transformers.__version__}")


def walk(accept: List[int], prompt_len: int, num_out: int, k: int) -> SpecCounts:
    """spec_decode's verify loop on known accept lengths: accept[r] for the chain started at row r
    (row r reads token r+1). The output ends after num_out tokens (stop or budget) whatever the
    last verify accepted; that verify's drafts still count, as the engines count them."""
    counts = SpecCounts()
    n = 1                                 # tokens out: the prefill's x_L
    while n < num_out:
        a = accept[prompt_len - 2 + n]    # the last emitted token x_{L-1+n} is read by row L-2+n
        counts.add(a, k)
        n += a + 1
    return counts


@torch.no_grad()
def chain_hits(model, drafter: Eagle3ChainDrafter, aux_layers: Sequence[int], batch: Sequence[GreedyRun],
               num_steps: int) -> torch.Tensor:
    """[S, B, T] bool for a batch of runs laid out as prompt + tokens, right padded: does step s of
    the chain started at row t draft the greedy token x_{t+2+s} (rows before the prompt's last token
    and padding never hit)."""
    device = next(model.parameters()).device
    draft_ids = drafter.d2t + torch.arange(drafter.d2t.numel(), device=drafter.d2t.device)
    ids, att = pad_right([r.prompt + r.tokens for r in batch], device)
    bt = capture_batch(model, ids, att, att, aux_layers, [str(j) for j in range(len(batch))])
    # the token each row's drafts are judged by: the greedy next token (-1: none)
    nxt = torch.cat([ids[:, 1:], ids.new_full((len(batch), 1), -1)], dim=1).masked_fill(~att.bool(), -1)
    nxt[torch.arange(len(batch)), att.sum(1) - 1] = -1
    pos = torch.arange(ids.shape[1], device=device)[None]
    rows = (pos >= torch.tensor([len(r.prompt) - 1 for r in batch], device=device)[:, None]) & att.bool()
    return ttt_hits(drafter.model, bt.input_ids, bt.aux, nxt, draft_ids, num_steps, rows)


@torch.no_grad()
def replay_counts(model, drafter: Eagle3ChainDrafter, aux_layers: Sequence[int], runs: Sequence[GreedyRun],
                  num_steps: Sequence[int], batch_size: int = 8) -> List[Dict[int, SpecCounts]]:
    """{k: SpecCounts} per run, for each chain length k in num_steps, from one forward of
    max(num_steps) steps per batch of runs; each run's tokens must reach max(num_steps) past its
    output."""
    S = max(num_steps)
    short = [i for i, r in enumerate(runs) if len(r.tokens) < r.num_out + S]
    if short:
        raise ValueError(f"runs {short}: the greedy decode must run {S} tokens past the output")
    out = []
    for i in range(0, len(runs), batch_size):
        batch = runs[i:i + batch_size]
        hits = chain_hits(model, drafter, aux_layers, batch, S)
        lead = hits.int().cumprod(0).cpu()                        # [S, B, T]: steps 0..s all hit
        for b, r in enumerate(batch):
            out.append({k: walk(lead[:k, b].sum(0).tolist(), len(r.prompt), r.num_out, k) for k in num_steps})
    return out


def replay(model, drafter: Eagle3ChainDrafter, aux_layers: Sequence[int], prompts: Sequence[Sequence[int]],
           num_steps: Sequence[int], max_new_tokens: int,
           stop_ids: Sequence[int]) -> List[Tuple[List[int], Dict[int, SpecCounts]]]:
    """(greedy output, {k: SpecCounts}) per prompt: what spec_decode returns for each chain length."""
    runs = [greedy_run(model, p, max_new_tokens, stop_ids, max(num_steps)) for p in prompts]
    return [(r.output, c) for r, c in zip(runs, replay_counts(model, drafter, aux_layers, runs, num_steps))]
