"""THE attention of this project, `attend`, for training-time test and cached inference.

A query row sees a causal block of keys and, in TTT, S more keys of its own (its keys of the later
draft steps). The causal block runs as a fused attention kernel (no [T, T] scores in memory):
cuDNN's on a GPU, torch's flash kernel on the CPU; the S own keys are S dot products per row,
merged with the block by log-sum-exp. This replaces one SDPA over [K_0 | K_1 .. K_s] with a dense
[T, (s+1)T] mask, which scored s*T*T keys to use s*T.

Backward without a gradient through the block's log-sum-exp: for merged probabilities
P = w * P_block (w = exp(lse_block - lse)), the kernel's backward given grad_out' = w * dOut and the
MERGED output computes dS = P_block * (w dOut.v - w dOut.out) = P * (dOut.v - D), exactly the
merged softmax's gradient (D = dOut.out), and dV = P_block^T (w dOut) = P^T dOut.
"""
from __future__ import annotations

import torch

from eagle3.fused import fused


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _backend(q: torch.Tensor) -> str:
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return "cuda"
    return "math"                              # e.g. fp32 on a GPU: the fused kernels need 16-bit


# On a GPU, cuDNN's fused attention rather than torch's flash attention (FA2): faster at the
# Kimi-size drafter's 64 x 128 heads (docs/perf.md; bench/attention_speed.py times both and checks
# that both backwards agree given the same out and lse, as `_Attention` feeds them).
# Its lse is [B, n, Tq, 1]; both keep out in [B, Tq, n, d] memory.


def _block_forward(q, k, v, causal: bool, scale: float):
    """softmax(q k^T * scale) v over one block of keys (causal: query i sees keys j <= i; the
    block is square then). q [B, n, Tq, d]; k, v [B, n, Tk, d] -> (out [B, n, Tq, d],
    lse [B, n, Tq] fp32+, state for _block_backward)."""
    backend = _backend(q)
    if backend == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse, None
    if backend == "cuda":
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out, lse[..., 0], (cq, ck, mq, mk, seed, offset)
    scores = _masked_scores(q, k, causal, scale)
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp().to(v.dtype) @ v, lse, None


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, state):
    """(dq, dk, dv) of one block given `out` and `lse` (see the note above on what they are)."""
    backend = _backend(q)
    if backend == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if backend == "cuda":
        cq, ck, mq, mk, seed, offset = state
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse[..., None], seed, offset, None, cq, ck, mq, mk, 0.0, causal, scale=scale)
    p = (_masked_scores(q, k, causal, scale) - lse[..., None]).exp()          # [B, n, Tq, Tk]
    dsum = (dout * out).sum(-1, keepdim=True)
    ds = p * (dout @ v.transpose(-1, -2) - dsum)
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout


def _masked_scores(q, k, causal, scale):
    s = (q @ k.transpose(-1, -2)).to(at_least_fp32(q.dtype)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, n, T, ...] <-> [B, T, n, ...] (a view)."""
    return x.transpose(1, 2)


class _Attention(torch.autograd.Function):
    """The merge runs on [B, T, n, d] views (`_rows`): the attention kernels keep their out and
    read their gradients in that memory layout (their [B, n, T, d] tensors are transposed views of
    it), and so do rope's output and the o projection's input. Merging in [B, n, T, d] memory
    instead made the kernel's wrapper, the o projection and rope's compiled backward each copy out
    or dOut into the other layout: 40 copies per unroll."""

    @staticmethod
    def forward(ctx, q, k, v, *extra):
        """q [B, n, Tq, d]; k, v [B, n, Tk, d], Tk >= Tq; extra: S keys then S values
        [B, n, Tq, d] each. Query i sees keys j <= Tk - Tq + i and its own row of every extra key."""
        S, (Tq, d), Tk = len(extra) // 2, q.shape[2:], k.shape[2]
        scale, L = d ** -0.5, Tk - Tq
        blocks = [(0, L, False)] if L else []            # cached rows: all visible
        blocks.append((L, Tk, True))                     # this call's rows: causal
        outs, lses, states = [], [], []
        for a, b, causal in blocks:
            o, lse, st = _block_forward(q, k[:, :, a:b], v[:, :, a:b], causal, scale)
            outs, lses, states = outs + [_rows(o)], lses + [_rows(lse)], states + [st]
        out, lse = _merge(_rows(q), lses, outs, [_rows(x) for x in extra[:S]],
                          [_rows(x) for x in extra[S:]], scale)
        ctx.save_for_backward(q, k, v, out, lse, *lses, *extra)
        ctx.blocks, ctx.states, ctx.S, ctx.scale = blocks, states, S, scale
        return _rows(out)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        nb, S, scale = len(ctx.blocks), ctx.S, ctx.scale
        lses, ek, ev = rest[:nb], rest[nb:nb + S], rest[nb + S:]
        dout = _rows(dout)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dqs, dk, dv = [], [], []
        for (a, b, causal), l, st, g in zip(ctx.blocks, lses, ctx.states,
                                            _merge_grads(dout, lse, list(lses))):
            dqb, dkb, dvb = _block_backward(_rows(g), q, k[:, :, a:b], v[:, :, a:b], _rows(out),
                                            _rows(l), causal, scale, st)
            dqs, dk, dv = dqs + [_rows(dqb)], dk + [dkb], dv + [dvb]
        dq, dek, dev = _merge_backward(dout, out, _rows(q), lse, dqs, [_rows(x) for x in ek],
                                       [_rows(x) for x in ev], scale)
        return (_rows(dq), torch.cat(dk, 2) if nb > 1 else dk[0],
                torch.cat(dv, 2) if nb > 1 else dv[0], *map(_rows, dek), *map(_rows, dev))


# The merge's elementwise work, fused on a GPU (eagle3/fused.py): all in (at least) fp32 over
# [B, Tq, n, d], one kernel instead of an fp32 copy per operand and per op.
@fused
def _merge(q, lses, outs, eks, evs, scale: float):
    """Blocks' (lse [B, Tq, n], out [B, Tq, n, d]) and the own keys/values eks, evs [B, Tq, n, d]
    -> (out [B, Tq, n, d] in q's dtype, lse [B, Tq, n] fp32+) of the softmax over all of them."""
    f = at_least_fp32(q.dtype)
    qf = q.to(f)
    own = [(qf * ek.to(f)).sum(-1) * scale for ek in eks]                  # S x [B, Tq, n]
    lse = torch.stack(lses + own, -1).logsumexp(-1)                        # [B, Tq, n]
    out = sum((l - lse).exp()[..., None] * o.to(f) for l, o in zip(lses, outs))
    out = out + sum((s - lse).exp()[..., None] * ev.to(f) for s, ev in zip(own, evs))
    return out.to(q.dtype), lse


@fused
def _merge_grads(dout, lse, lses):
    """w * dOut per block (w = exp(lse_block - lse)), in dout's dtype: its kernel's backward input."""
    f = lse.dtype
    return [((l - lse).exp()[..., None] * dout.to(f)).to(dout.dtype) for l in lses]


@fused
def _merge_backward(dout, out, q, lse, dqs, eks, evs, scale: float):
    """dqs: the blocks' dq -> (dq, dks, dvs of the own keys/values), dq summed in fp32+; all
    [B, Tq, n, ..]."""
    f = lse.dtype
    qf, df = q.to(f), dout.to(f)
    dsum = (df * out.to(f)).sum(-1)                                        # D [B, Tq, n]
    dq = sum(d.to(f) for d in dqs)
    dek, dev = [], []
    for kr, vr in zip(eks, evs):
        p = ((qf * kr.to(f)).sum(-1) * scale - lse).exp()                    # [B, Tq, n]
        ds = p * ((df * vr.to(f)).sum(-1) - dsum)
        dq = dq + scale * ds[..., None] * kr.to(f)
        dek.append((scale * ds[..., None] * qf).to(kr.dtype))
        dev.append((p[..., None] * df).to(vr.dtype))
    return dq.to(q.dtype), dek, dev


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra_k=(), extra_v=()) -> torch.Tensor:
    """THE attention of this project. q [B, nh, Tq, d]; k, v [B, nkv, Tk, d] (already rotated),
    Tk >= Tq: causal aligned at the end, query i sees keys j <= Tk - Tq + i (with a KV cache the
    first Tk - Tq keys are the cached rows, seen by every new row). extra_k, extra_v: lists of
    [B, nkv, Tq, d], more keys that only their own row sees (TTT: the row's keys of draft steps
    1..s). Returns [B, nh, Tq, d]. Scale 1/sqrt(d), as SGLang's LlamaAttention."""
    g = q.shape[1] // k.shape[1]
    if g > 1:                                       # GQA: autograd sums the copies' gradients
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        extra_k = [x.repeat_interleave(g, 1) for x in extra_k]
        extra_v = [x.repeat_interleave(g, 1) for x in extra_v]
    return _Attention.apply(q, k, v, *extra_k, *extra_v)
