"""Turn a trained SmolLM2 drafter export into the committed one: results/smollm2-drafter/export/{vllm,sglang}.

    python scripts/make_results_drafter.py SRC_EXPORT_DIR results/smollm2-drafter --keep 4096

The repository takes files of at most 5 MB and 25 MB in all. A drafter's largest tensor is lm_head
(draft vocab x 576 in bf16: 18.9 MB at 16,384), so the draft vocabulary is cut to the --keep most
frequent answer tokens (eagle3.export.prune_draft_vocab: kept logits unchanged), counted on the
ShareGPT first-turn answers of SpecForge's prompt selection (available from the ShareGPT package
alone, without the regenerated answers the drafter was trained on). The export is then resharded into <= 5 MB files; the
sglang directory differs only in config.json (its aux-layer ids), so its shards are links to the
vllm ones and the weights are stored once.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3.data import build_samples  # noqa: E402
from eagle3.export import INDEX_NAME, drafter_config, load_export, prune_draft_vocab, reshard_export  # noqa: E402
from eagle3.shape import DrafterShape  # noqa: E402
from eagle3.targets import load_tokenizer, resolve_target, target_info  # noqa: E402
from eagle3.vocab import count_tokens  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path, help="a vllm export dir of a SmolLM2 drafter")
    ap.add_argument("out", type=Path, help="results dir; export/vllm and export/sglang are written in it")
    ap.add_argument("--keep", type=int, default=4096)
    ap.add_argument("--max-mb", type=float, default=5.0)
    args = ap.parse_args()

    tensors, cfg = load_export(args.src)
    target_dir = resolve_target("gguf", "", "smollm2", "llama", {}, 0)
    tok = load_tokenizer(target_dir)
    train, _, report = build_samples(tok, "sharegpt", "", 8000, 512, 0.0, turns=1, max_prompt_chars=1500)
    counts = count_tokens([s.input_ids for s in train], [s.loss_mask for s in train], int(cfg["vocab_size"]))
    draft_ids = torch.nonzero(tensors["t2d"]).flatten()
    order = torch.sort(counts[draft_ids], descending=True, stable=True).indices   # ties: lower id first
    keep = draft_ids[order[:args.keep]]
    share = float(counts[keep].sum() / counts.sum())
    print(f"[results] {report.summary()}\n[results] keep {args.keep} of {draft_ids.numel()} draft tokens: "
          f"{share:.2%} of those answers' tokens")
    pruned, pcfg = prune_draft_vocab(tensors, cfg, keep)

    export = args.out / "export"
    with tempfile.TemporaryDirectory() as tmp:
        single = Path(tmp) / "vllm"
        single.mkdir()
        save_file(pruned, str(single / "model.safetensors"), metadata={"format": "pt"})
        (single / "config.json").write_text(json.dumps(pcfg, indent=2) + "\n")
        files = reshard_export(single, export / "vllm", int(args.max_mb * 1_000_000))
    sg = export / "sglang"
    if sg.exists():
        shutil.rmtree(sg)
    sg.mkdir(parents=True)
    for f in files:
        if f.suffix == ".safetensors" or f.name == INDEX_NAME:
            os.symlink(Path("..") / "vllm" / f.name, sg / f.name)
    record = pcfg["eagle3"]
    scfg = drafter_config(DrafterShape.from_hf_config(pcfg), record["aux_layers"], "sglang",
                          target_info(target_dir).architectures,
                          record["target"], record["target_fingerprint"])
    (sg / "config.json").write_text(json.dumps(scfg, indent=2) + "\n")
    total = sum(f.stat().st_size for f in (export / "vllm").iterdir())
    print(f"[results] {export}: {len(files) - 2} shards, {total / 1e6:.1f} MB stored once "
          f"(largest {max(f.stat().st_size for f in files) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
