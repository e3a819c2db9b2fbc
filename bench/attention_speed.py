"""The causal attention block of a TTT step on a GPU: torch's flash attention (FA2) against cuDNN's
fused attention, forward + backward, at the Kimi-size drafter's heads (64 x 128, bf16).

    python bench/attention_speed.py --seq 2048 4096

Both are called the way eagle3/attention.py calls a block: q, k, v [B, n, T, d] as transposed views
of [B, T, n, d] memory, the backward given an out and a log-sum-exp it did not compute itself (the
merged output and the block's own lse, see that module's doc). So besides the time, it prints how
far the two kernels' results are apart given the same inputs (out, lse and dq, dk, dv relative to
their norms): our backward relies on both using `out` and `lse` as given.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

A = torch.ops.aten


def flash(q, k, v, scale):
    out, lse, *state = A._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    return out, lse, state[:6]


def flash_bwd(dout, q, k, v, out, lse, state, scale):
    cq, ck, mq, mk, seed, offset = state
    return A._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True,
                                                         seed, offset, scale=scale)


def cudnn(q, k, v, scale):
    out, lse, cq, ck, mq, mk, seed, offset, _ = A._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return out, lse, (cq, ck, mq, mk, seed, offset)


def cudnn_bwd(dout, q, k, v, out, lse, state, scale):
    cq, ck, mq, mk, seed, offset = state
    return A._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse, seed, offset, None, cq, ck,
                                                         mq, mk, 0.0, True, scale=scale)


def timed(fn, reps=20):
    ts = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[3:])


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--new-lengths", type=int, default=0,
                    help="also time cuDNN's first forward+backward at this many lengths just below each --seq "
                         "against a repeated call: it builds a plan per new shape, and real batches have many")
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  cudnn {torch.backends.cudnn.version()}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in args.seq:
        n, d = args.heads, args.head_dim
        q, k, v, dout = (torch.randn(1, T, n, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
                         for _ in range(4))
        scale = d ** -0.5
        fo, fl, fs = flash(q, k, v, scale)
        co, cl, cs = cudnn(q, k, v, scale)
        print(f"T={T}: layouts  flash out {tuple(fo.stride())} lse {tuple(fl.shape)}; "
              f"cudnn out {tuple(co.stride())} lse {tuple(cl.shape)} {tuple(cl.stride())}")
        print(f"T={T}: forward  out rel {rel(co, fo):.2e}, lse rel {rel(cl.reshape(fl.shape), fl):.2e}")
        # the same out and lse (flash's) into both backwards, as our merged backward feeds them
        fg = flash_bwd(dout, q, k, v, fo, fl, fs, scale)
        cg = cudnn_bwd(dout, q, k, v, fo, fl.reshape(cl.shape).contiguous() if cl.dim() == 4 else fl, cs, scale)
        print(f"T={T}: backward dq/dk/dv rel " + " ".join(f"{rel(c, f):.2e}" for c, f in zip(cg, fg)))
        tf = timed(lambda: flash(q, k, v, scale))
        tc = timed(lambda: cudnn(q, k, v, scale))
        tfb = timed(lambda: flash_bwd(dout, q, k, v, fo, fl, fs, scale))
        tcb = timed(lambda: cudnn_bwd(dout, q, k, v, co, cl, cs, scale))
        print(f"T={T}: ms     forward flash {tf:.3f} cudnn {tc:.3f} | backward flash {tfb:.3f} cudnn {tcb:.3f} "
              f"| x7 TTT steps: flash {7 * (tf + tfb):.1f} cudnn {7 * (tc + tcb):.1f}")
        if args.new_lengths:
            new_lengths(T, args.new_lengths, n, d, g)


def new_lengths(T, count, n, d, g):
    """Wall time of cuDNN's forward + backward at `count` lengths not seen before, then repeated."""
    def call(q, k, v, dout):
        out, lse, state = cudnn(q, k, v, d ** -0.5)
        cudnn_bwd(dout, q, k, v, out, lse, state, d ** -0.5)

    first = []
    for L in range(T - count, T):
        args = [torch.randn(1, L, n, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(4)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call(*args)
        torch.cuda.synchronize()
        first.append(1e3 * (time.perf_counter() - t0))
    again = timed(lambda: call(*args))
    med = statistics.median(first)
    print(f"T={T}: new lengths {T - count}..{T - 1}: first call {med:.1f} ms median (min {min(first):.1f}, "
          f"max {max(first):.1f}), repeated {again:.2f} ms: {med - again:.1f} ms per new length and layer step")


if __name__ == "__main__":
    main()
