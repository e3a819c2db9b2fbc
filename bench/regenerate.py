"""Greedy regeneration speed: transformers' generate against capture/fastgen.py, same prompts, same run.

    python bench/regenerate.py --target smollm2 --prompts 4096 --batch 4096 --new 256   # on a GPU
    python bench/regenerate.py --target tiny_llama --prompts 16 --batch 16 --new 32     # CPU smoke run

Prompts are ShareGPT first turns (SmolLM2's chat template). Prints generated tokens per second for
both, and how many answers agree token for token (bf16 on GPU: a near-tie can flip either way).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capture import fastgen  # noqa: E402
from capture.regenerate import cut_at_stop  # noqa: E402
from eagle3.chat import render_prompt, stop_ids  # noqa: E402
from eagle3.data import iter_conversations  # noqa: E402
from eagle3.targets import load_target_model, load_tokenizer, resolve_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "tiny_llama"])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tdir = (resolve_target("gguf", "", "smollm2") if args.target == "smollm2" else
            resolve_target("random", "", "tiny_llama", "llama", {"hidden_size": 64, "intermediate_size": 128,
                           "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2}, 0))
    tok = load_tokenizer(tdir)
    model = load_target_model(tdir, dtype, device)
    stop = stop_ids(tok)
    prompts = []
    for _, msgs in iter_conversations("sharegpt"):
        users = [m for m in msgs or [] if isinstance(m, dict) and m.get("role") == "user"
                 and isinstance(m.get("content"), str) and 0 < len(m["content"]) < 1500]
        if users:
            prompts.append(render_prompt(tok, users[:1]))
        if len(prompts) == args.prompts:
            break
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    batches = [[prompts[i] for i in order[b:b + args.batch]] for b in range(0, len(order), args.batch)]

    def timed(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = [row for batch in batches for row in fn(batch)]
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    def hf(batch):
        ids, att = fastgen.left_pad(batch, stop[0])
        with torch.no_grad():
            seq = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), do_sample=False,
                                 max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=stop[0])
        return seq[:, ids.shape[1]:].tolist()

    dec = fastgen.StaticGreedy(model, args.new, pad_id=stop[0])
    fast_out, fast_s = timed(dec.generate)
    hf_out, hf_s = timed(hf)
    n = len(prompts) * args.new
    # generate is told not to stop (min_new_tokens masks the stop token), fastgen just never stops:
    # compare each answer up to fastgen's first end-of-turn token
    cut = [cut_at_stop(a, stop)[0] for a in fast_out]
    same = sum(b[:len(a)] == a for a, b in zip(cut, hf_out))
    print(f"{args.target} on {device} ({dtype}), {len(prompts)} prompts x {args.new} new tokens, batch {args.batch}")
    print(f"  generate : {hf_s:8.1f} s  {n / hf_s:10.0f} tok/s")
    print(f"  fastgen  : {fast_s:8.1f} s  {n / fast_s:10.0f} tok/s   ({hf_s / fast_s:.2f}x)")
    print(f"  identical answers: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
