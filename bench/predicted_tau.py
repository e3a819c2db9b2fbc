"""Does the training-side estimate of tau predict what decoding measures?

For each prompt of an evaluation set: the exported drafter drafts for the target through
eagle3.specdec.spec_decode (our reference engine: greedy chain drafting, the engines' counting) and
that gives the served tau; eagle3.replay gives it again from one greedy decode and one drafter
forward (it must equal the served figure); then the target's answer is captured the way training
captures it (eagle3.hidden.capture_batch) and read by the same drafter through eagle3.loss.ttt_loss,
whose chain acceptance (`accepted` / `chained`) gives the training-side estimate
1 + sum_s accept[s]. All three are printed per draft position, on the same prompts and the same
answer tokens.

    python bench/predicted_tau.py --drafter runs/smollm2_committed --prompts mt_bench --num-prompts 20
    python bench/predicted_tau.py --drafter results/smollm2-drafter --prompts sharegpt_heldout

The two count different starts: decoding starts a chain only after each verify, the estimate at
every answer token. They agree when acceptance does not depend much on where a chain starts.
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
from eagle3.hidden import capture_batch  # noqa: E402
from eagle3.loss import ttt_loss  # noqa: E402
from eagle3.replay import replay  # noqa: E402
from eagle3.specdec import load_drafter_and_vocab, load_smollm2, spec_decode  # noqa: E402
from eagle3.targets import load_head  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", type=Path, required=True, help="export dir or run dir")
    ap.add_argument("--prompts", default="mt_bench", help="mt_bench | sharegpt_heldout | a .jsonl")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-steps", type=int, default=3, help="draft chain length")
    ap.add_argument("--heldout-fraction", type=float, default=0.02, help="sharegpt_heldout: the split")
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    target = load_smollm2()
    model, tok, stop, aux_layers = target.model, target.tokenizer, target.stop_ids, target.aux_layers
    vocab, drafter = load_drafter_and_vocab(args.drafter, model)
    _, lm_head = load_head(target.model_dir)
    S = args.num_steps

    served = torch.zeros(S)
    verifies = 0
    accepted = torch.zeros(S)
    chained = 0
    t0 = time.time()
    prompts = load_prompts(args.prompts, args.num_prompts, heldout_fraction=args.heldout_fraction)
    outputs = []
    for n, p in enumerate(prompts, 1):
        ids = render_prompt(tok, p.messages)
        out, counts, _ = spec_decode(model, drafter, ids, aux_layers, S, args.max_new_tokens, stop)
        outputs.append(out)
        served += torch.tensor(counts.accepted_per_pos, dtype=torch.float32)
        verifies += counts.num_drafts
        seq = torch.tensor([ids + out])
        loss_mask = torch.zeros_like(seq)
        loss_mask[0, len(ids):] = 1
        bt = capture_batch(model, seq, torch.ones_like(seq), loss_mask, aux_layers, [p.id])
        o = ttt_loss(drafter.model, bt.input_ids, bt.loss_mask, bt.attention_mask, bt.aux, bt.final, lm_head, vocab,
                     ttt_steps=S)
        accepted += o.accepted.float()
        chained += int(o.chained)
        print(f"[{n}/{len(prompts)}] {len(out)} tokens, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    replayed = replay(model, drafter, aux_layers, [render_prompt(tok, p.messages) for p in prompts], [S],
                      args.max_new_tokens, stop)
    differ = sum(out != r_out for out, (r_out, _) in zip(outputs, replayed))
    r_verifies = sum(c[S].num_drafts for _, c in replayed)
    per_served = (served / max(verifies, 1)).tolist()
    per_replay = [sum(c[S].accepted_per_pos[j] for _, c in replayed) / max(r_verifies, 1) for j in range(S)]
    per_est = (accepted / max(chained, 1)).tolist()
    print(f"drafter {args.drafter}, {len(prompts)} prompts of {args.prompts}, chain {S}, {args.max_new_tokens} new tokens")
    print(f"served (spec_decode):          tau {1 + sum(per_served):.3f}  per position "
          + " / ".join(f"{a:.3f}" for a in per_served) + f"  ({verifies} verifies)")
    print(f"replay (greedy + one forward): tau {1 + sum(per_replay):.3f}  per position "
          + " / ".join(f"{a:.3f}" for a in per_replay) + f"  ({r_verifies} verifies"
          + (f"; {differ} outputs differ from spec_decode's)" if differ else ")"))
    print(f"estimate (ttt_loss chain acc): tau {1 + sum(per_est):.3f}  per position "
          + " / ".join(f"{a:.3f}" for a in per_est) + f"  ({chained} chain starts)")


if __name__ == "__main__":
    main()
