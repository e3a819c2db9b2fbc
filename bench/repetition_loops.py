"""How much of the training answers, and of the served text, is repetition loops.

A small target answering greedily falls into loops: the same line again and again until the token
budget ends. Loop tails are the easiest tokens there are to draft. Where the training answers hold
many more of them than the served text, they fill the loss and lift the held-out accept figures
above what decoding the served prompts measures. `data.loop_tokens=K` takes every loop's tail
after its first K repeating tokens out of the loss (eagle3.loops.mask_loops: a token repeats when
the 16 tokens ending at it occurred earlier in the same answer). For each K this prints the share
of answer tokens it leaves out, in the training answers (all turns and first turns alone) and in
the greedy outputs of an evaluation run, whose outputs are counted as one answer each:

    python bench/repetition_loops.py --answers ANSWERS.jsonl \
        --report results/evaluations/final_mt_bench_80 --keep 1,16,64

K = 1 leaves out nearly every repeating token (all but each loop's first). The answers are
rendered and cut as training does (eagle3.data.build_samples, data.max_length 2,048). The report's outputs are its `baseline`
records, or the first drafter's when it ran without one.

With --drafter (repeatable) it also prints what the loops do to the training's held-out figures:
each drafter's chain acceptance per TTT step (eagle3.loss.ttt_loss, as train.py's held-out rows
count it) and `tau3` on the first --heldout conversations of the held-out split, with every answer
token starting a chain and with loop tails left out at data.loop_tokens=--loop-tokens. The target
runs in fp32 on the CPU (about 10 s a conversation on 2 cores, for two drafters):

    python bench/repetition_loops.py --answers ANSWERS.jsonl --keep 16 \
        --drafter results/smollm2-drafter --drafter RUN/export/vllm --heldout 128
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.vocab_coverage import served_outputs  # noqa: E402
from eagle3.data import build_samples  # noqa: E402
from eagle3.loops import answer_runs, mask_loops  # noqa: E402
from eagle3.targets import load_tokenizer, resolve_target  # noqa: E402


def first_answer(mask: list[int]) -> list[int]:
    """The mask of a conversation's first answer alone."""
    out = [0] * len(mask)
    for i, j in answer_runs(mask)[:1]:
        out[i:j] = [1] * (j - i)
    return out


def left_out(pairs, keep: int) -> tuple[int, int]:
    """(answer tokens, of them out of the loss mask at data.loop_tokens=keep) over (ids, mask) pairs."""
    total = out = 0
    for ids, mask in pairs:
        total += sum(mask)
        out += sum(mask) - sum(mask_loops(ids, mask, keep))
    return total, out


def heldout_estimates(held, drafters: list[Path], loop_tokens: int, ttt_steps: int = 4) -> None:
    """Print, per drafter, held-out chain acceptance and tau3 with every answer token and without
    loop tails, on the same conversations and the same target forward."""
    from eagle3.hidden import capture_batch
    from eagle3.loss import ttt_loss
    from eagle3.specdec import load_drafter_and_vocab, load_smollm2
    from eagle3.targets import load_head

    torch.set_grad_enabled(False)
    target = load_smollm2()
    model, aux_layers = target.model, target.aux_layers
    _, lm_head = load_head(target.model_dir)
    loaded = [(d, *load_drafter_and_vocab(d, model)) for d in drafters]
    sums = {(d, k): [torch.zeros(ttt_steps), 0] for d, *_ in loaded for k in (0, loop_tokens)}
    for n, s in enumerate(held, 1):
        seq = torch.tensor([s.input_ids])
        masks = {0: torch.tensor([s.loss_mask]),
                 loop_tokens: torch.tensor([mask_loops(s.input_ids, s.loss_mask, loop_tokens)])}
        bt = capture_batch(model, seq, torch.ones_like(seq), masks[0], aux_layers, [s.id])
        for d, vocab, drafter in loaded:
            for k, m in masks.items():
                o = ttt_loss(drafter.model, bt.input_ids, m, bt.attention_mask, bt.aux, bt.final, lm_head, vocab,
                             ttt_steps=ttt_steps)
                sums[(d, k)][0] += o.accepted.float()
                sums[(d, k)][1] += int(o.chained)
        print(f"[held-out {n}/{len(held)}] {len(s.input_ids)} tokens", file=sys.stderr, flush=True)
    print(f"\n{len(held)} held-out conversations, chain acceptance per TTT step as training counts it")
    print("| drafter | answer tokens | chain starts | accept per step | tau3 |")
    print("|---|---|---|---|---|")
    for (d, k), (acc, chained) in sums.items():
        per = (acc / max(chained, 1)).tolist()
        which = "all" if k == 0 else f"loop tails out (data.loop_tokens={k})"
        print(f"| {d} | {which} | {chained:,} | " + " / ".join(f"{a:.3f}" for a in per)
              + f" | {1 + sum(per[:3]):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--answers", type=Path, required=True, help="the training conversations (jsonl)")
    ap.add_argument("--report", type=Path, help="an evaluation's output dir (per_prompt.jsonl)")
    ap.add_argument("--keep", default="1,16,64", help="data.loop_tokens values, each at least 1")
    ap.add_argument("--max-length", type=int, default=2048, help="tokens per conversation, as training cuts them")
    ap.add_argument("--drafter", type=Path, action="append", default=[], help="an export or run dir (repeatable)")
    ap.add_argument("--heldout", type=int, default=128, help="--drafter: held-out conversations read")
    ap.add_argument("--loop-tokens", type=int, default=16, help="--drafter: data.loop_tokens of the second row")
    args = ap.parse_args()

    tok = load_tokenizer(resolve_target("gguf", "", "smollm2", "llama", {}, 0))
    train, held, report = build_samples(tok, "jsonl", str(args.answers), 0, args.max_length, 0.02)
    convs = [(s.input_ids, s.loss_mask) for s in [*train, *held]]
    firsts = [(ids, first_answer(mask)) for ids, mask in convs]
    served = [(list(o.output_ids[0]), [1] * len(o.output_ids[0])) for o in served_outputs(args.report)] \
        if args.report else []
    print(f"{len(convs)} conversations of {args.answers}" + (f"; {len(served)} outputs of {args.report}" if served else ""))
    print("| data.loop_tokens | training answers, all turns | first turns | " + ("served outputs |" if served else ""))
    print("|---|---|---|" + ("---|" if served else ""))
    keeps = [int(k) for k in args.keep.split(",")]
    if min(keeps) < 1:
        raise SystemExit(f"error: --keep {args.keep}: each value must be at least 1 (data.loop_tokens=0 leaves out nothing)")
    for keep in keeps:
        row = [left_out(convs, keep), left_out(firsts, keep)] + ([left_out(served, keep)] if served else [])
        cells = " | ".join(f"{o / max(t, 1):.1%} of {t:,}" for t, o in row)
        print(f"| {keep} | {cells} |")
    if args.drafter:
        heldout_estimates(held[:args.heldout], args.drafter, args.loop_tokens)


if __name__ == "__main__":
    main()
