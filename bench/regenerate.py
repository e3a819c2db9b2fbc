"""Greedy regeneration speed: transformers' generate against capture/fastgen.py, same prompts, same run.

    python bench/regenerate.py --target smollm2 --prompts 4096 --batch 4096 --new 256   # on a GPU
    python bench/regenerate.py --target smollm2 --prompts 4096 --batch 4096 --new 256 --stop
    python bench/regenerate.py --target smollm2 --conversations 4096 --batch 4096 --new 256 --max-length 2048
    python bench/regenerate.py --target tiny_llama --prompts 16 --batch 16 --new 32     # CPU smoke run
    python bench/regenerate.py --target smollm2 --step-rows 1024,256 --step-prompt 2047,512

Prompts are ShareGPT first turns (SmolLM2's chat template). Prints generated tokens per second for
generate, StaticGreedy (length-sorted batches) and ContinuousGreedy (--batch rows, refilled), and
how many answers agree token for token (bf16 on GPU: a near-tie can flip either way). Without --stop
every answer runs to --new tokens (nothing for refills to gain); with it answers end at the end of
turn, as regeneration's do, and the rate counts the tokens up to there.
--step-rows R,... --step-prompt P,...: the time of one ContinuousGreedy decode step (graph replays)
at R rows and a cache of P + --new slots, every row busy with a random prompt: what a step costs at
each batch and context length (a step reads every row's whole cache, busy or not).
--conversations N: every user turn of N ShareGPT conversations through regenerate_conversations,
round by round (StaticGreedy, chunk = --batch) against continuous (--batch rows at most, as many as
fit half the free memory, and at most --batch conversations in flight).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capture import fastgen  # noqa: E402
from capture.answer_engines import cut_at_stop  # noqa: E402
from eagle3.chat import render_prompt, stop_ids  # noqa: E402
from eagle3.data import iter_conversations  # noqa: E402
from eagle3.targets import load_target_model, load_tokenizer, resolve_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "tiny_llama"])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--stop", action="store_true", help="answers end at the end-of-turn token")
    ap.add_argument("--conversations", type=int, default=0, help="multi-turn: rounds against continuous")
    ap.add_argument("--max-length", type=int, default=2048, help="multi-turn: data.max_length")
    ap.add_argument("--step-rows", default="", help="decode-step timing: comma-separated row counts")
    ap.add_argument("--step-prompt", default="2047", help="decode-step timing: comma-separated prompt lengths")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tdir = (resolve_target("gguf", "", "smollm2") if args.target == "smollm2" else
            resolve_target("random", "", "tiny_llama", "llama", {"hidden_size": 64, "intermediate_size": 128,
                           "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2}, 0))
    tok = load_tokenizer(tdir)
    model = load_target_model(tdir, dtype, device)
    stop = stop_ids(tok)
    print(f"{args.target} on {device} ({dtype})")
    if args.step_rows:
        return decode_steps(args, model, stop, device)
    if args.conversations:
        return multi_turn(args, tok, model, stop)
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

    def timed(fn, batches=batches):
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
                                 max_new_tokens=args.new, pad_token_id=stop[0],
                                 **({"eos_token_id": stop} if args.stop else {"min_new_tokens": args.new}))
        return seq[:, ids.shape[1]:].tolist()

    ends = stop if args.stop else []

    def static(batch):
        return fastgen.StaticGreedy(model, args.new, pad_id=stop[0]).generate(batch, stop_ids=ends)

    # the continuous decoder takes every prompt at once (longest first) into --batch rows: it refills
    # only when there are more prompts than rows
    def continuous(every):
        rows = min(args.batch, len(every))
        return fastgen.ContinuousGreedy(model, args.new, max(map(len, every)), rows, stop[0], ends).generate(every)

    outs = {"StaticGreedy": timed(static), "continuous": timed(continuous, [[p for b in batches for p in b]]),
            "generate": timed(hf)}
    # without --stop generate is told not to stop (min_new_tokens masks the stop token): every answer
    # is compared up to its first end-of-turn token
    answers = {name: [cut_at_stop(a, stop)[0] for a in out] for name, (out, _) in outs.items()}
    n = sum(len(a) for a in answers["StaticGreedy"]) if args.stop else len(prompts) * args.new
    print(f"{len(prompts)} prompts x {args.new} new tokens{' (to the end of turn)' if args.stop else ''}, "
          f"batch {args.batch}; {n} tokens")
    hf_s = outs["generate"][1]
    for name, (_, sec) in outs.items():
        print(f"  {name:12s}: {sec:8.1f} s  {n / sec:10.0f} tok/s   ({hf_s / sec:.2f}x generate)")
    for name in ("StaticGreedy", "continuous"):
        same = sum(b[:len(a)] == a for a, b in zip(answers[name], outs["generate"][0]))
        print(f"  {name} answers identical to generate's: {same}/{len(prompts)}")
    same = sum(a == b for a, b in zip(answers["StaticGreedy"], answers["continuous"]))
    print(f"  continuous answers identical to StaticGreedy's: {same}/{len(prompts)}")


def decode_steps(args, model, stop, device, repeats: int = 40) -> None:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"{'rows':>6s} {'slots':>6s} {'ms/step':>8s} {'tok/s':>9s}")
    for rows in map(int, args.step_rows.split(",")):
        for max_prompt in map(int, args.step_prompt.split(",")):
            dec = fastgen.ContinuousGreedy(model, args.new, max_prompt, rows, stop[0])
            lengths = torch.randint(1, max_prompt + 1, (rows,), generator=g).tolist()
            dec.add([(r, torch.randint(0, vocab, (n,), generator=g).tolist()) for r, n in enumerate(lengths)])
            for _ in range(3):
                dec._replay()
            sync()
            t = time.perf_counter()
            for _ in range(repeats):
                dec._replay()
            sync()
            ms = (time.perf_counter() - t) / repeats * 1e3
            print(f"{rows:6d} {dec.arange.shape[0]:6d} {ms:8.2f} {rows / ms * 1e3:9.0f}", flush=True)
            del dec
            if device == "cuda":
                torch.cuda.empty_cache()


def multi_turn(args, tok, model, stop) -> None:
    import json
    import tempfile

    from capture import answer_engines as E
    from capture import regenerate as R
    from eagle3.config import DataConfig
    from eagle3.data import Source

    data = DataConfig(source="sharegpt", num_samples=args.conversations, max_length=args.max_length)
    convs = R.source_conversations(Source("", "sharegpt", ""), data)
    engines = [("rounds", lambda: E.hf_generate(model, stop, args.new, args.batch)),   # built in turn: each
               ("continuous", lambda: E.hf_continuous(model, stop, args.new, args.max_length - 1, args.batch))]
    records = {}                                                                  # sizes itself to free memory
    with tempfile.TemporaryDirectory() as tmp:
        for name, engine in engines:
            gen = engine()
            path = Path(tmp) / f"{name}.jsonl"
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            R.regenerate_conversations(convs, tok, gen, path, args.max_length, progress=False, chunk=args.batch)
            sec = time.perf_counter() - t
            records[name] = {r["id"]: r for r in map(json.loads, open(path))}
            answers = sum(len(r["regen"]["new_tokens"]) for r in records[name].values())
            tokens = sum(sum(r["regen"]["new_tokens"]) for r in records[name].values())
            rows = f", {gen.rows} rows" if name == "continuous" else ""
            print(f"  {name:10s}: {sec:8.1f} s  {len(convs) / sec:7.1f} conv/s  {answers / sec:7.1f} answers/s  "
                  f"{tokens / sec:9.0f} answer tok/s{rows}")
    same = sum(records["rounds"].get(cid) == r for cid, r in records["continuous"].items())
    print(f"  {len(convs)} conversations; continuous records identical to the rounds': {same}/{len(convs)}")


if __name__ == "__main__":
    main()
