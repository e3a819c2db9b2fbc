"""One draft step at batch 1, as an engine runs it: the drafter's decoder layer for one token over a
KV cache of `--context` tokens, the final norm, lm_head over the draft vocabulary and argmax. On a
GPU the step is replayed as a CUDA graph (SGLang captures its draft steps so); on a CPU it runs eagerly.

    python bench/draft_latency.py                                   # GPU: Kimi-K2.5 and SmolLM2 widths, bf16
    python bench/draft_latency.py --tp 8                            # one GPU's share at TP 8 (no all-reduce)
    python bench/draft_latency.py --device cpu --preset tiny        # seconds on a CPU (tests smoke this)
    python bench/draft_latency.py --device cpu --preset smollm2 --dtype bfloat16

Feeds eagle3/projection.py's draft_ms. Widths from eagle3.shape.DrafterShape: kimi = this repo's
Kimi-K2.5 drafter (hidden 7168, 64 x 128 heads, 64 KV heads, intermediate 18432, draft vocab
32000), smollm2 = results/smollm2-drafter (hidden 576, 9 heads, 3 KV heads, head_dim 64,
intermediate 1536, draft vocab 4096). Weights are random: the time of a step does not depend on them.
The step after the first of a chain does not run fc over the aux states (it reads the drafter's own
hidden), so fc is not in the step; the draft extend that starts a chain does run it, once per cycle.
--tp N divides heads, intermediate and draft vocab by N: one GPU's matmuls under tensor parallelism,
without the all-reduces that join them.
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
from eagle3.shape import DrafterShape  # noqa: E402

PRESETS = {
    "kimi": DrafterShape(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64,
                         head_dim=128, vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168),
    "smollm2": DrafterShape(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                            head_dim=64, vocab_size=49152, draft_vocab_size=4096, target_hidden_size=576),
    "tiny": DrafterShape(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=512, draft_vocab_size=256, target_hidden_size=64),
}


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w


class DraftStep:
    """Static buffers and weights of one draft step; __call__ runs it in place (graph-capturable)."""

    def __init__(self, s: DrafterShape, context: int, tp: int, device, dtype):
        def w(*shape):
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02
        H, d = s.hidden_size, s.head_dim
        self.nh, self.nkv = max(1, s.num_attention_heads // tp), max(1, s.num_key_value_heads // tp)
        self.d, self.ctx = d, context
        inter, vd = s.intermediate_size // tp, s.draft_vocab_size // tp
        self.embed = w(s.vocab_size, H)
        self.ln_in, self.ln_h, self.ln_post, self.ln_out = (torch.ones(H, device=device, dtype=dtype) for _ in range(4))
        self.qkv = w((self.nh + 2 * self.nkv) * d, 2 * H)     # reads cat[norm(embed), norm(h)]
        self.o = w(H, self.nh * d)
        self.gate_up = w(2 * inter, H)
        self.down = w(H, inter)
        self.lm_head = w(vd, H)
        self.k_cache = w(1, self.nkv, context + 1, d)
        self.v_cache = w(1, self.nkv, context + 1, d)
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.h = w(1, H)
        self.out = torch.zeros(1, dtype=torch.long, device=device)

    def __call__(self):
        x = torch.cat([rms(self.embed[self.token], self.ln_in), rms(self.h, self.ln_h)], dim=-1)
        q, k, v = (x @ self.qkv.t()).split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        self.k_cache[0, :, self.ctx] = k.view(self.nkv, self.d)
        self.v_cache[0, :, self.ctx] = v.view(self.nkv, self.d)
        a = F.scaled_dot_product_attention(q.view(1, self.nh, 1, self.d), self.k_cache, self.v_cache,
                                           enable_gqa=self.nh != self.nkv)
        h1 = self.h + a.reshape(1, -1) @ self.o.t()
        gate, up = (rms(h1, self.ln_post) @ self.gate_up.t()).chunk(2, dim=-1)
        h2 = h1 + (F.silu(gate) * up) @ self.down.t()
        logits = rms(h2, self.ln_out) @ self.lm_head.t()
        self.out.copy_(logits.argmax(-1))
        self.h.copy_(h2)


def time_step(step: DraftStep, device: str, iters: int, graph: bool) -> float:
    """Median ms per step over `iters` timed steps (5 batches)."""
    run = step
    if device.startswith("cuda"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            run = g.replay
    for _ in range(3):
        run()
    per_batch = []
    for _ in range(5):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            end.synchronize()
            per_batch.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            per_batch.append((time.perf_counter() - t0) * 1000 / iters)
    return statistics.median(per_batch)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description="one draft step at batch 1")
    ap.add_argument("--preset", nargs="+", default=["kimi", "smollm2"], choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 (GPU default) | float32 (CPU default)")
    ap.add_argument("--context", type=int, default=2048, help="tokens already in the draft's KV cache")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=None, help="steps per timed batch (GPU 200, CPU 20)")
    ap.add_argument("--no-graph", action="store_true", help="GPU: eager steps instead of a CUDA graph")
    a = ap.parse_args(argv)
    on_gpu = a.device.startswith("cuda")
    dtype = getattr(torch, a.dtype or ("bfloat16" if on_gpu else "float32"))
    iters = a.iters or (200 if on_gpu else 20)
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name in a.preset:
            s = PRESETS[name]
            step = DraftStep(s, a.context, a.tp, a.device, dtype)
            ms = time_step(step, a.device, iters, graph=on_gpu and not a.no_graph)
            rows.append({"preset": name, "ms": ms})
            how = "CUDA graph" if on_gpu and not a.no_graph else "eager"
            print(f"{name}: {ms:.3f} ms per draft step (hidden {s.hidden_size}, {s.num_attention_heads}x{s.head_dim} "
                  f"heads, {s.num_key_value_heads} KV heads, draft vocab {s.draft_vocab_size}, tp {a.tp}, context "
                  f"{a.context}, {str(dtype).replace('torch.', '')}, {a.device}, {how})", flush=True)
            del step
    return rows


if __name__ == "__main__":
    main()
