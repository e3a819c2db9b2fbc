"""How much of the served text a draft vocabulary can draft at all.

A drafter's vocab is the Vd most frequent answer tokens of its training data. Every token of the
served text outside it ends a draft chain, so the share inside (evaluate.py's `draftable` column)
caps the acceptance of every chain position. This prints, for each Vd, that share on the training
answers themselves and on the greedy outputs of an evaluation run, and the committed drafter's own
vocab beside them:

    python bench/vocab_coverage.py --answers ANSWERS.jsonl \
        --report results/evaluations/final_mt_bench_80 --drafter results/smollm2-drafter

ANSWERS.jsonl: the regenerated conversations the drafter trains on (`python -m capture
+experiment=smollm2_committed capture.regenerate_only=true` writes them); their assistant tokens are
counted as training counts them (eagle3.data.build_samples' loss mask, eagle3.vocab.count_tokens).
The report's outputs are its `baseline` records, or the first drafter's when it ran without one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3.data import build_samples  # noqa: E402
from eagle3.evaluation import DecodeStats, draftable  # noqa: E402
from eagle3.export import find_export, load_export  # noqa: E402
from eagle3.targets import load_tokenizer, resolve_target  # noqa: E402
from eagle3.vocab import build_vocab, count_tokens, coverage_curve  # noqa: E402

SIZES = (2048, 4096, 8192, 12288, 16384, 32768)


def served_outputs(report_dir: Path) -> list:
    """DecodeStats of the report's baseline outputs (else its first drafter's, at its first chain)."""
    path = report_dir / "per_prompt.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: pass an evaluation's output dir (<run_dir>/eval)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first = next((r for r in records if r["drafter"] == "baseline"), records[0])
    keep = [r for r in records if (r["drafter"], r["num_steps"]) == (first["drafter"], first["num_steps"])]
    return [DecodeStats(r["prompt_id"], r["output_ids"], 0.0) for r in keep]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--answers", type=Path, required=True, help="the training conversations (jsonl)")
    ap.add_argument("--report", type=Path, required=True, help="an evaluation's output dir (per_prompt.jsonl)")
    ap.add_argument("--drafter", type=Path, help="an export or run dir: its own vocab's row")
    ap.add_argument("--max-length", type=int, default=2048, help="tokens per conversation, as training cuts them")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = ap.parse_args()

    target_dir = resolve_target("gguf", "", "smollm2", "llama", {}, 0)
    tok = load_tokenizer(target_dir)
    train, _, report = build_samples(tok, "jsonl", str(args.answers), 0, args.max_length, 0.02)
    print(f"{len(train)} training conversations of {args.answers} ({report.read} read)", file=sys.stderr)
    counts = count_tokens((s.input_ids for s in train), (s.loss_mask for s in train), len(tok))
    served = served_outputs(args.report)
    n_served = sum(len(t) - 1 for s in served for t in s.output_ids if t)

    print(f"| draft vocab | training answers ({int(counts.sum()):,} tokens) | "
          f"{args.report.name} outputs ({n_served:,} tokens) |")
    print("|---|---|---|")
    for size, cov in coverage_curve(counts, [int(x) for x in args.sizes.split(",")]):
        print(f"| top {size:,} | {cov:.1%} | {draftable(served, build_vocab(counts, size).t2d):.1%} |")
    if args.drafter:
        tensors, _ = load_export(find_export(args.drafter, "vllm"))
        t2d = tensors["t2d"].bool()
        train_cov = float(counts[: t2d.numel()][t2d].sum()) / float(counts.sum())
        print(f"| {args.drafter} ({int(t2d.sum()):,}) | {train_cov:.1%} | {draftable(served, t2d):.1%} |")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
