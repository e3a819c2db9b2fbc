"""Capture throughput against a plain forward over the same batches, and bytes per token on disk.

    .venv/bin/python bench/capture.py                      # tiny random Llama (conf/target/tiny_llama dims)
    .venv/bin/python bench/capture.py --smollm2            # SmolLM2-135M-Instruct
    python bench/capture.py --smollm2 --random --device cuda --num-samples 2000   # SmolLM2's shape, no files

Samples are real ShareGPT conversations rendered with SmolLM2's chat template (the tiny target uses
the same tokenizer). Timings are the best of --repeats passes (a shared CPU is noisy), passes of
the two methods interleaved. Three figures:
  plain    CausalLM forward (logits included, no cache): what "running the target" costs
  capture  capture_hidden + cast to the storage dtype + copy to host (to_host), same batches
  e2e      run_capture into a fresh dataset: capture + shard writes (a thread, overlapping the
           next batch) + fsync + manifest
It also measures packing (samples laid end to end in rows, block-diagonal attention from reset
position_ids) against the padded, length-sorted batches run_capture uses.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capture.hf import hf_meta, padded_tokens, run_capture, shard_batches, to_host
from eagle3.hidden import capture_hidden, decoder_parts, pad_right
from eagle3.features import FeatureDataset, plan_shards


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)   # conf/target/tiny_llama.yaml


def load(args):
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    name = "smollm2" if args.smollm2 else "tiny_llama"
    if args.random:   # nothing from disk: random weights of the shape, random tokens of ShareGPT-like lengths
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        shape = SMOLLM2_SHAPE if args.smollm2 else dict(TINY_SHAPE, vocab_size=49152)
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(args.device, dtype).eval()
        g = torch.Generator().manual_seed(0)
        lens = torch.randint(args.max_length // 8, args.max_length + 1, (args.num_samples,), generator=g)
        samples = [SimpleNamespace(id=f"r{k}", input_ids=torch.randint(3, 49152, (int(n),), generator=g).tolist(),
                                   loss_mask=[1] * int(n)) for k, n in enumerate(lens)]
        print(f"target {name} shape, random weights ({dtype}, {args.device}); {len(samples)} random samples")
        return model, samples
    from eagle3.data import build_samples
    from eagle3.targets import load_target_model, load_tokenizer, resolve_target
    tok_dir = resolve_target("gguf", "", "smollm2")
    path = tok_dir if args.smollm2 else resolve_target("random", "", "tiny_llama", "llama", TINY_SHAPE, 0)
    model = load_target_model(path, dtype, args.device)
    samples, _, report = build_samples(load_tokenizer(tok_dir), "sharegpt", "", args.num_samples,
                                       args.max_length, 0.0)
    print(f"target {name} ({dtype}, {args.device}); data: {report.summary()}")
    return model, samples


def best_of(fn, repeats, device):
    """(best wall seconds, best process CPU seconds) of `repeats` calls. On the shared CPU the CPU
    seconds (all threads of this process) are the steadier measure of work; on CUDA, wall time."""
    wall, cpu = [], []
    for _ in range(repeats):
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        sync(device)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu)


def in_order_batches(lengths, batch_tokens, shard_tokens):
    """The alternative to sorting: consecutive samples, B x longest <= batch_tokens."""
    batches = []
    for shard in plan_shards(lengths, shard_tokens):
        cur = []
        for i in shard:
            if cur and (len(cur) + 1) * max(lengths[j] for j in cur + [i]) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        batches.append(cur)
    return batches


def packed_rows(lengths, row_tokens, batch_tokens, shard_tokens):
    """Per shard, longest first, first-fit into rows of row_tokens; batch_tokens // row_tokens rows a batch."""
    batches = []
    for shard in plan_shards(lengths, shard_tokens):
        rows, room = [], []
        for i in sorted(shard, key=lambda i: -lengths[i]):
            r = next((r for r in range(len(rows)) if room[r] >= lengths[i]), None)
            if r is None:
                rows.append([]), room.append(row_tokens)
                r = len(rows) - 1
            rows[r].append(i)
            room[r] -= lengths[i]
        per = max(1, batch_tokens // row_tokens)
        batches += [rows[k:k + per] for k in range(0, len(rows), per)]
    return batches


def packed_forward(model, samples, batch, aux_layers, device):
    """One packed batch through capture_hidden's hooks: position ids restart at every sample."""
    T = max(sum(len(samples[i].input_ids) for i in row) for row in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    pos = torch.zeros(len(batch), T, dtype=torch.long)
    for b, row in enumerate(batch):
        at = 0
        for i in row:
            n = len(samples[i].input_ids)
            ids[b, at:at + n] = torch.tensor(samples[i].input_ids)
            pos[b, at:at + n] = torch.arange(n)
            at += n
        pos[b, at:] = torch.arange(T - at)           # the tail is one more "sample" of padding
    base, _ = decoder_parts(model)
    seen = {}
    hooks = [base.layers[i].register_forward_pre_hook(
        lambda m, a, k, i=i: seen.__setitem__(i, a[0] if a else k["hidden_states"]), with_kwargs=True)
        for i in aux_layers]
    try:
        with torch.no_grad():
            out = base(input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([seen[i] for i in aux_layers], -1), out.last_hidden_state


def bench_packing(model, samples, aux_layers, sdt, args, t_cap):
    """Time packed rows over the same samples and check a packed sample against capture_hidden."""
    lengths = [len(s.input_ids) for s in samples]
    real = sum(lengths)
    rows = packed_rows(lengths, args.max_length, args.batch_tokens, args.shard_tokens)
    computed = sum(len(b) * max(sum(lengths[i] for i in r) for r in b) for b in rows)

    def packed():
        for b in rows:
            aux, final = packed_forward(model, samples, b, aux_layers, args.device)
            host, event = to_host({"aux": aux, "final": final}, sdt)
            if event is None:
                aux.to(sdt), final.to(sdt)
            else:
                event.synchronize()

    packed()
    t_pack = best_of(packed, args.repeats, args.device)[0]
    # Packing must be exact to be an option: a sample that sits second in its row, against capture_hidden.
    row = next((r for b in rows for r in b if len(r) > 1), None)
    diff = float("nan")
    if row is not None:
        aux_p, _ = packed_forward(model, samples, [row], aux_layers, args.device)
        ids, att = pad_right([samples[row[1]].input_ids], args.device)
        aux_u, _ = capture_hidden(model, ids, att, aux_layers)
        at = lengths[row[0]]
        diff = (aux_p[0, at:at + ids.shape[1]] - aux_u[0]).abs().max().item()
    print(f"packing into rows of {args.max_length}: {computed - real} of {computed} computed tokens "
          f"padding ({1 - real / computed:.1%}); {real / t_pack:.0f} tok/s = {t_pack / t_cap:.3f}x the "
          f"padded capture's time; max |packed - padded| on a second-in-row sample {diff:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", action="store_true", help="the real SmolLM2-135M-Instruct instead of tiny_llama")
    ap.add_argument("--random", action="store_true",
                    help="random weights of the shape and random tokens: needs neither the GGUF nor ShareGPT")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-samples", type=int, default=48)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--shard-tokens", type=int, default=262144)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-packing", action="store_true")
    args = ap.parse_args()

    model, samples = load(args)
    n_layers, H = model.config.num_hidden_layers, model.config.hidden_size
    aux_layers = [2, n_layers // 2, n_layers - 3]       # docs/design.md's default
    lengths = [len(s.input_ids) for s in samples]
    real = sum(lengths)
    batches = shard_batches(lengths, args.shard_tokens, args.batch_tokens)
    inputs = [pad_right([samples[i].input_ids for i in b], args.device) for b in batches]
    sdt = getattr(torch, args.dtype)

    def plain():
        with torch.no_grad():
            for ids, att in inputs:
                model(input_ids=ids, attention_mask=att, use_cache=False)

    def capture():
        for ids, att in inputs:
            aux, final = capture_hidden(model, ids, att, aux_layers)
            host, event = to_host({"aux": aux, "final": final}, sdt)
            if event is None:
                aux.to(sdt), final.to(sdt)
            else:
                event.synchronize()

    tmp = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    meta = hf_meta(target_name="bench", target_fingerprint="", arch=model.config.model_type,
                   aux_layers=aux_layers, hidden_size=H, tokenizer_name="smollm2", chat_template="",
                   data={"source": "sharegpt", "num_samples": len(samples), "max_length": args.max_length})
    totals = {}

    def e2e():
        out = tmp / "ds"
        run_capture(model, samples, out, aux_layers=aux_layers, meta=meta, batch_tokens=args.batch_tokens,
                    shard_tokens=args.shard_tokens, dtype=args.dtype, progress=False)
        totals.update(FeatureDataset(out).manifest["totals"])
        shutil.rmtree(out)

    plain(), capture()                                   # warm-up (allocator, kernels)
    runs = {"plain": [], "capture": [], "e2e": []}
    for _ in range(args.repeats):                        # interleaved: load changes hit all three alike
        for name, fn in (("plain", plain), ("capture", capture), ("e2e", e2e)):
            runs[name].append(best_of(fn, 1, args.device))
    best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in runs.items()}
    shutil.rmtree(tmp)

    pad_sorted = padded_tokens(lengths, batches)
    pad_order = padded_tokens(lengths, in_order_batches(lengths, args.batch_tokens, args.shard_tokens))
    print(f"{len(samples)} samples, {real} tokens, {len(batches)} batches of <= {args.batch_tokens} padded tokens; "
          f"aux_layers {aux_layers}, hidden {H}")
    print(f"padding (length-sorted within a shard): {pad_sorted - real} of {pad_sorted} computed tokens "
          f"({1 - real / pad_sorted:.1%}); in dataset order it would be {1 - real / pad_order:.1%}")
    cuda = torch.device(args.device).type == "cuda"
    for name, label in (("plain", "plain forward    "), ("capture", "capture (compute)"), ("e2e", "capture (to disk)")):
        wall, cpu = best[name]
        line = f"{label} {real / wall:10.0f} tok/s"
        if name != "plain":
            line += f"   ratio to plain: wall {wall / best['plain'][0]:.3f}x"
            line += "" if cuda else f", CPU seconds {cpu / best['plain'][1]:.3f}x"
        print(line + ("   (goal <= 1.10x)" if name == "e2e" else ""))
    print(f"on disk: {totals['bytes_per_token']:.1f} bytes/token ({args.dtype}; {len(aux_layers)} x {H} aux + "
          f"{H} final = {(len(aux_layers) + 1) * H} values/token), {totals['num_bytes'] / 2**20:.1f} MiB")

    if not args.no_packing:
        bench_packing(model, samples, aux_layers, sdt, args, best["capture"][0])


if __name__ == "__main__":
    main()
