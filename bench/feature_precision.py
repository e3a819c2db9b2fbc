"""What smaller feature storage would cost: fp8 (e4m3, one fp32 scale per row of each stored state)
against the bf16 that feature datasets store, on real captured features and a trained drafter.

    .venv/bin/python bench/feature_precision.py ~/.cache/eagle3/features/smollm2-sharegpt-n200-L384-regen_False
    .venv/bin/python bench/feature_precision.py DIR --drafter results/smollm2-drafter/export/vllm --samples 64

Prints bytes per token at the dataset's dims and at Kimi-K2.5's; the relative error the fp8 round
trip puts on aux and final; what it does to the teacher (the target's softmax over the draft vocab:
top-1 agreement, KL); and the drafter's TTT loss and per-step accuracy on the same samples read
back from bf16, with only aux in fp8, and with aux and final in fp8 (same weights, no training).
Feature datasets offer fp8 for aux only (`capture.aux_dtype=float8_e4m3fn`): final is the teacher,
and this shows what fp8 would do to it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3.export import find_export, load_export  # noqa: E402
from eagle3.features import FeatureDataset  # noqa: E402
from eagle3.shards import dequantize_fp8, quantize_fp8  # noqa: E402
from eagle3.loss import target_teacher, ttt_loss  # noqa: E402
from eagle3.model import Eagle3Drafter  # noqa: E402
from eagle3.shape import DrafterShape  # noqa: E402
from eagle3.targets import load_head, resolve_target  # noqa: E402
from eagle3.vocab import DraftVocab  # noqa: E402

KIMI_HIDDEN, KIMI_AUX = 7168, 3


def fp8_round_trip(x: torch.Tensor, num_states: int = 1) -> torch.Tensor:
    """[T, n*H] bf16 -> the same values stored as the feature dataset stores fp8 aux (e4m3, one
    fp32 scale per row of each [T, H] state), read back as bf16."""
    return dequantize_fp8(*quantize_fp8(x, num_states))


def bytes_per_token(hidden: int, num_aux: int, fp8_aux: bool, fp8_final: bool) -> int:
    aux = num_aux * (hidden + 4) if fp8_aux else num_aux * hidden * 2       # e4m3 + an fp32 scale
    final = hidden + 4 if fp8_final else hidden * 2
    return aux + final + 5                          # + input_ids int32 + loss_mask uint8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("features", type=Path)
    ap.add_argument("--drafter", type=Path, default=Path("results/smollm2-drafter"))
    ap.add_argument("--samples", type=int, default=64)
    args = ap.parse_args()

    ds = FeatureDataset(args.features)
    m = ds.manifest
    H, k = m["hidden_size"], len(m["aux_layers"])
    tensors, cfg = load_export(find_export(args.drafter, "vllm"))
    target_dir = resolve_target("gguf", "", m["target"]["name"], "llama", {}, 0)
    embed, lm_head = load_head(target_dir)
    drafter = Eagle3Drafter(DrafterShape.from_hf_config(cfg))
    weights = {n: t for n, t in tensors.items() if n not in ("d2t", "t2d")}
    weights["embed_tokens.weight"] = embed
    drafter.load_state_dict(weights)
    drafter.float().eval()
    vocab = DraftVocab(tensors["d2t"].long(), tensors["t2d"].bool())
    head = lm_head.float()

    print(f"features      {args.features} ({len(ds)} samples, H {H}, {k} aux states, stored {m['dtypes']['aux']})")
    for name, h, n in ((m["target"]["name"], H, k), ("Kimi-K2.5", KIMI_HIDDEN, KIMI_AUX)):
        b16 = bytes_per_token(h, n, False, False)
        mixed, b8 = bytes_per_token(h, n, True, False), bytes_per_token(h, n, True, True)
        print(f"bytes/token   {name:12s} bf16 {b16:,}   fp8 aux + bf16 final {mixed:,} ({mixed / b16:.1%})   "
              f"all fp8 {b8:,} ({b8 / b16:.1%})")

    err_aux, err_final, agree, kl, n_rows = [], [], 0, [], 0
    modes = ("bf16", "fp8 aux", "fp8 all")
    loss = {name: [] for name in modes}
    hits = {name: torch.zeros(7) for name in modes}
    counts = torch.zeros(7)
    for i in range(min(args.samples, len(ds))):
        s = ds[i]
        aux8, final8 = fp8_round_trip(s["aux"], k), fp8_round_trip(s["final"])
        err_aux.append(rel(aux8, s["aux"]))
        err_final.append(rel(final8, s["final"]))
        draft_ids = vocab.draft_ids
        p16, top16 = target_teacher(s["final"][None].float(), head, draft_ids)
        p8, top8 = target_teacher(final8[None].float(), head, draft_ids)
        agree += int((top16 == top8).sum())
        n_rows += top16.numel()
        kl.append(float((p16 * (p16.clamp_min(1e-30).log() - p8.clamp_min(1e-30).log())).sum(-1).mean()))
        for name, aux, final in zip(modes, (s["aux"], aux8, aux8), (s["final"], s["final"], final8)):
            with torch.no_grad():
                out = ttt_loss(drafter, s["input_ids"][None], s["loss_mask"][None],
                               torch.ones_like(s["loss_mask"][None]), aux[None].float(), final[None].float(),
                               head, vocab, ttt_steps=7)
            loss[name].append(float(out.loss))
            hits[name] += out.correct.float()
            if name == "bf16":
                counts += out.count.float()
    n = len(err_aux)
    print(f"round trip    relative L2 error: aux {statistics.median(err_aux):.4f}, final "
          f"{statistics.median(err_final):.4f} (median of {n} samples)")
    print(f"teacher       full-vocab argmax unchanged on {agree / n_rows:.2%} of {n_rows:,} rows; "
          f"KL(bf16 || fp8) over the draft vocab {statistics.mean(kl):.2e} nats/row")
    base = statistics.mean(loss["bf16"])
    for name in modes:
        d = statistics.mean(b - a for a, b in zip(loss["bf16"], loss[name]))
        acc = hits[name] / counts.clamp(min=1)
        print(f"{name:8s}      TTT loss {statistics.mean(loss[name]):.4f} ({d / base:+.2%} vs bf16), accuracy "
              "per TTT step " + " ".join(f"{a:.3f}" for a in acc.tolist()))


if __name__ == "__main__":
    main()
