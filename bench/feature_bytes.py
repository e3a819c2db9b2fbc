"""Bytes per token of each feature format (computed from the shard layout itself) and what the compact
format (`capture.format=compact`, eagle3/codec.py) costs: aux reconstruction, the teacher's top-K
truncation, and a trained drafter's TTT loss, accuracy and acceptance estimate on the same samples.

    .venv/bin/python bench/feature_bytes.py                 # bytes/token; aux error on Kimi-like random data
    .venv/bin/python -m capture data.num_samples=32 data.features_dir=~/.cache/eagle3/features/smollm2-n32-bench
    .venv/bin/python bench/feature_bytes.py --features ~/.cache/eagle3/features/smollm2-n32-bench \
        --drafter results/smollm2-drafter --samples 32

Kimi-like random data: Gaussian aux with a log-normal scale per channel (sigma 0.5) and 4 channels per
aux state 30x larger (the massive activations real residual streams carry), at H 7168.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3 import codec  # noqa: E402
from eagle3.codec import Compact, dequantize_aux, quantize_aux  # noqa: E402
from eagle3.shards import dequantize_fp8, layout, quantize_fp8  # noqa: E402

SMOL, KIMI = (576, 49152, (4096, 8192, 32000)), (7168, 163840, (32000,))
K_AUX, TOPKS, GROUPS = 3, (8, 16, 32, 64), (16, 32, 64, 128)
CODES = {"nf4": codec.LEVELS, "int4": codec.INT4}


def per_token(num_aux: int, hidden: int, float_st: str, aux_st: str = None, compact=None) -> int:
    """Bytes one more token adds to a shard of this format (offsets and header excluded)."""
    return layout(1, 2, num_aux, hidden, float_st, aux_st, compact)[1] - layout(1, 1, num_aux, hidden, float_st,
                                                                                 aux_st, compact)[1]


def compact_params(vocab_size: int, draft_vocab_size: int, topk: int) -> dict:
    vocab = codec.build_vocab(torch.ones(vocab_size, dtype=torch.int64), draft_vocab_size)
    return Compact(vocab, topk).params()


def print_bytes() -> None:
    print("bytes/token (input_ids and loss_mask included; SpecForge: bf16 aux + final, its token ids not counted)")
    print(f"{'target':10s} {'Vd':>6s} {'SpecForge':>10s} {'bf16':>8s} {'fp8 aux':>8s} "
          + " ".join(f"{f'compact K={k}':>14s}" for k in TOPKS))
    for name, (H, V, vds) in (("SmolLM2", SMOL), ("Kimi-K2.5", KIMI)):
        for vd in vds:
            full, fp8 = per_token(K_AUX, H, "BF16"), per_token(K_AUX, H, "BF16", "F8_E4M3")
            comp = [per_token(K_AUX, H, "BF16", compact=compact_params(V, vd, k)) for k in TOPKS]
            assert comp == [codec.bytes_per_token(H, K_AUX, vd, k) for k in TOPKS]
            print(f"{name:10s} {vd:6d} {(K_AUX + 1) * H * 2:10,d} {full:8,d} {fp8:8,d} "
                  + " ".join(f"{c:8,d} ({c / full:4.1%})" for c in comp))


def errors(x: torch.Tensor, y: torch.Tensor, num_aux: int):
    """(mean per-row relative L2, pooled relative L2, mean cosine) over rows of each aux state."""
    xs, ys = x.float().view(len(x), num_aux, -1), y.float().view(len(x), num_aux, -1)
    rel = ((ys - xs).norm(dim=-1) / xs.norm(dim=-1).clamp(min=1e-30)).mean()
    return float(rel), float((ys - xs).norm() / xs.norm()), float(F.cosine_similarity(ys, xs, -1).mean())


def print_aux(name: str, x: torch.Tensor) -> None:
    print(f"\naux round trip, {name}: {x.shape[0]:,} tokens x {x.shape[1]:,} (relative L2 per row, mean | "
          f"pooled over all rows | cosine per row, mean)")
    rows = [("fp8 e4m3, row scale", errors(x, dequantize_fp8(*quantize_fp8(x, K_AUX)), K_AUX), 8)]
    for code, lv in CODES.items():
        for g in [g for g in GROUPS if (x.shape[1] // K_AUX) % g == 0]:
            rows.append((f"{code}, group {g}", errors(x, dequantize_aux(*quantize_aux(x, lv, g), lv), K_AUX),
                         4 + 16 / g))
    for label, (rel, pooled, cos), bits in rows:
        print(f"  {label:22s} {bits:5.2f} bits/value  rel L2 {rel:.4f} | {pooled:.4f} | cos {cos:.5f}")


def kimi_like(tokens: int = 512, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    H = KIMI[0]
    x = torch.randn(tokens, K_AUX, H, generator=g) * torch.exp(0.5 * torch.randn(1, K_AUX, H, generator=g))
    x[:, :, torch.randperm(H, generator=g)[:4]] *= 30
    return x.view(tokens, -1).bfloat16()


def print_speed() -> None:
    x = kimi_like(256).float()
    t = time.perf_counter()
    quantize_aux(x)
    dt = time.perf_counter() - t
    print(f"\nquantize_aux on this CPU at Kimi-K2.5 width: {256 / dt:,.0f} tokens/s ({torch.get_num_threads()} threads)")


def real_features(args):
    from eagle3.export import find_export, load_export
    from eagle3.features import FeatureDataset
    from eagle3.model import Eagle3Drafter
    from eagle3.shape import DrafterShape
    from eagle3.targets import load_head, resolve_target
    from eagle3.vocab import DraftVocab

    ds = FeatureDataset(args.features)
    m = ds.manifest
    if ds.compact:
        sys.exit(f"{args.features} is a compact dataset: the bench compares storages against the full format's "
                 f"values; capture one with capture.format=full")
    samples = [ds[i] for i in range(min(args.samples, len(ds)))]
    print_aux(f"{m['target']['name']} (real, {args.features.name})", torch.cat([s["aux"] for s in samples]))
    embed, lm_head = load_head(resolve_target("gguf", "", m["target"]["name"], "llama", {}, 0))
    head = lm_head.float()
    tensors, cfg = load_export(find_export(args.drafter, "vllm"))
    vocab = DraftVocab(tensors["d2t"].long(), tensors["t2d"].bool())
    drafter = Eagle3Drafter(DrafterShape.from_hf_config(cfg))
    weights = {n: t for n, t in tensors.items() if n not in ("d2t", "t2d")}
    weights["embed_tokens.weight"] = embed
    drafter.load_state_dict(weights)
    drafter.float().eval()

    from eagle3.loss import dense_teacher, target_teacher, ttt_loss
    print(f"\nteacher top-K over the drafter's draft vocab ({vocab.size}): share of the draft distribution kept "
          f"(= 1 - total variation to the renormalised top-K), mean and 1st percentile over rows")
    for K in TOPKS:
        kept = torch.cat([target_teacher(s["final"][None].float(), head, vocab.draft_ids)[0][0].topk(K, -1).values
                          .sum(-1) for s in samples])
        print(f"  K {K:3d}  kept {float(kept.mean()):.4f} (p1 {float(kept.quantile(0.01)):.4f})")

    print(f"\ndrafter {args.drafter} on {len(samples)} samples: TTT loss (soft_ce, 7 steps), accuracy per step, "
          f"tau3 estimate (1 + chain acceptance of steps 0..2)")
    # Without training, the teacher's probabilities move only the loss: accuracy and acceptance
    # compare the drafter's argmax with the stored full-vocab argmax, which is exact.
    modes = [("full bf16", None, False), ("compact aux, full teacher", None, True), ("compact, K 16", 16, True)]
    base = None
    for label, K, quant_aux in modes:
        loss, correct, count, accepted, chained = [], torch.zeros(7), torch.zeros(7), torch.zeros(7), 0.0
        for s in samples:
            aux = dequantize_aux(*quantize_aux(s["aux"])) if quant_aux else s["aux"]
            teacher = None
            if K is not None:
                enc = codec.encode_teacher(s["final"].float(), head, vocab.draft_ids, K)
                teacher = (dense_teacher(enc["teacher_ids"].long(), enc["teacher_p"], vocab.size)[None],
                           enc["teacher_top"].long()[None], enc["teacher_mass"][None])
            with torch.no_grad():
                out = ttt_loss(drafter, s["input_ids"][None], s["loss_mask"][None], torch.ones_like(s["loss_mask"][None]),
                               aux[None].float(), s["final"][None].float(), head, vocab, ttt_steps=7, teacher=teacher)
            loss.append(float(out.loss))
            correct += out.correct.float()
            count += out.count.float()
            accepted += out.accepted.float()
            chained += float(out.chained)
        mean = statistics.mean(loss)
        base = base or mean
        acc = correct / count.clamp(min=1)
        tau3 = 1 + float((accepted / max(chained, 1))[:3].sum())
        print(f"  {label:26s} loss {mean:.4f} ({(mean - base) / base:+.2%})  tau3 {tau3:.3f}  acc "
              + " ".join(f"{a:.3f}" for a in acc.tolist()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=Path, help="a full-format feature dataset of real hidden states")
    ap.add_argument("--drafter", type=Path, default=Path("results/smollm2-drafter"))
    ap.add_argument("--samples", type=int, default=32)
    args = ap.parse_args()
    print_bytes()
    print_aux("Kimi-like random (H 7168)", kimi_like())
    print_speed()
    if args.features:
        real_features(args)


if __name__ == "__main__":
    main()
