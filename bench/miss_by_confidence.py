"""Where a drafter misses: acceptance by how sure the target is of the token the drafter must guess.

On an evaluation set's greedy answers, every answer token a chain can draft (all but the first,
which the prefill gives) is put in a bin by the target's probability of it: the top-1 probability
of the greedy step that chose it. Per bin and drafter: the share of tokens, how often the first
draft of a chain started just before the token hits it, the mean accepted length of a chain of
--num-steps started there, and the share of all first-draft misses that fall in the bin.

    python bench/miss_by_confidence.py --drafter results/smollm2-drafter --drafter RUN/export/vllm

A drafter that misses mostly where the target itself is unsure (a near-tie the target breaks by a
small margin) has little left to learn from the same features; misses on tokens the target is
sure of are the ones more training, a larger draft vocabulary or more capacity can still win.
The greedy decodes come from the replay backend's cache (eval.backend=replay decodes and keeps
them), so a prompt is decoded at most once; chains are counted as eagle3.replay counts them.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3.chat import render_prompt  # noqa: E402
from eagle3.evaluation import load_prompts  # noqa: E402
from eagle3.hidden import pad_right  # noqa: E402
from eagle3.replay import chain_hits, greedy_cache  # noqa: E402
from eagle3.specdec import load_drafter_and_vocab, load_smollm2  # noqa: E402

EDGES = [0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", type=Path, action="append", required=True, help="export dir or run dir (repeat)")
    ap.add_argument("--prompts", default="mt_bench", help="mt_bench | sharegpt_heldout | a .jsonl")
    ap.add_argument("--num-prompts", type=int, default=0, help="0: all")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-steps", type=int, default=3, help="draft chain length")
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    target = load_smollm2()
    model, tok, stop, aux_layers = target.model, target.tokenizer, target.stop_ids, target.aux_layers
    S = args.num_steps
    t0 = time.time()
    cache = greedy_cache(target.model_dir, model)
    prompts = load_prompts(args.prompts, args.num_prompts)
    runs = [cache.run(model, render_prompt(tok, p.messages), args.max_new_tokens, stop, S) for p in prompts]
    print(f"[bench] {len(runs)} greedy runs: {cache.hits} from {cache.root}, {cache.misses} decoded "
          f"({time.time() - t0:.0f}s)", file=sys.stderr)

    # the target's probability of each drafted answer token x_j (j = L+1 .. L+num_out-1): the top-1
    # of its logits at row j-1
    sure = []
    for i in range(0, len(runs), args.batch_size):
        batch = runs[i:i + args.batch_size]
        ids, att = pad_right([r.prompt + r.tokens for r in batch], "cpu")
        top = model(input_ids=ids, attention_mask=att).logits.float().softmax(-1).amax(-1)   # [B, T]
        sure += [top[b, len(r.prompt):len(r.prompt) + r.num_out - 1] for b, r in enumerate(batch)]
    sure = torch.cat(sure)
    bins = torch.bucketize(sure, torch.tensor(EDGES[1:-1]), right=True)            # [N]
    names = [f"[{a:.2f}, {b:.2f})" if b < 1 else f"[{a:.2f}, 1]" for a, b in zip(EDGES, EDGES[1:])]
    share = torch.bincount(bins, minlength=len(names)).float()

    print(f"{len(prompts)} prompts of {args.prompts}, {sure.numel()} drafted answer tokens, chain {S}")
    for path in args.drafter:
        _, drafter = load_drafter_and_vocab(path, model)
        first, lead = [], []
        for i in range(0, len(runs), args.batch_size):
            batch = runs[i:i + args.batch_size]
            hits = chain_hits(model, drafter, aux_layers, batch, S)             # [S, B, T]
            accepted = hits.int().cumprod(0).sum(0)                             # [B, T]
            for b, r in enumerate(batch):
                # the chain started at row t drafts x_{t+2} first: rows L-1 .. L+num_out-3
                rows = slice(len(r.prompt) - 1, len(r.prompt) + r.num_out - 2)
                first.append(hits[0, b, rows])
                lead.append(accepted[b, rows])
        first, lead = torch.cat(first).float(), torch.cat(lead).float()
        n = share.clamp(min=1.0)
        hit, acc, misses = (torch.bincount(bins, weights=w, minlength=len(names)) for w in (first, lead, 1 - first))
        print(f"\n{path}: first draft hits {first.mean():.3f}, mean accepted {lead.mean():.3f} of {S}")
        print(f"  {'target p(token)':16s} {'tokens':>7s} {'first hits':>10s} {'accepted':>9s} {'of misses':>10s}")
        for k, name in enumerate(names):
            print(f"  {name:16s} {share[k] / sure.numel():7.3f} {hit[k] / n[k]:10.3f} {acc[k] / n[k]:9.3f} "
                  f"{misses[k] / max(misses.sum().item(), 1.0):10.3f}")


if __name__ == "__main__":
    main()
