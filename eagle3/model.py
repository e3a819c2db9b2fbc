"""The EAGLE-3 drafter, exactly SGLang 0.5.23's `LlamaForCausalLMEagle3` (models/llama_eagle3.py).

One step of the drafter, for rows of token ids x and hidden states h [.., H]:

    residual = h                                            # the UN-normed hidden
    a   = cat[input_layernorm(embed(x)), hidden_norm(h)]    # [.., 2H]; q/k/v take 2H inputs
    h1  = residual + o_proj(attention(rope(q(a)), rope(k(a)), v(a)))
    h2  = h1 + mlp(post_attention_layernorm(h1))            # h_out: the PRE-norm output
    logits = lm_head(norm(h2))                              # [.., Vd] over the draft vocab

h is fc(aux) [k*Ht -> H] for rows that come from the target (step 0) and the drafter's own h_out of
the previous step afterwards. SGLang writes the two residual adds as fused `RMSNorm(x, residual)`
calls (add, then norm, returning both); its `aux` output, fed back as the next step's hidden, is
the pre-norm sum h2 unless the config sets `norm_output` (we never do). Its fc is applied when the
hidden's width differs from the embedding's, i.e. only to the k*Ht aux concat: so H must differ
from k*Ht (true for every real target).

Parameter names are the export names (DESIGN.md "Drafter export"); `embed_tokens` is the frozen
target embedding, shared inside the engines and never exported.

One attention function, `attend`, serves training-time test (causal over the step-0 keys plus
each row's own later-step keys, see eagle3/loss.py) and inference with a KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.fused import fused


@dataclass
class DrafterShape:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                 # target vocab V (the shared embedding's rows)
    draft_vocab_size: int           # Vd (lm_head rows)
    target_hidden_size: int         # Ht (width of each aux state)
    num_aux: int = 3                # k
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"

    def to_hf_config(self) -> dict:
        """The Llama fields of the export's config.json (one decoder layer). The exporter adds
        `architectures`, `eagle_config` (engine aux ids) and dtype."""
        return {
            "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "num_aux_hidden_states": self.num_aux,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False,
        }

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "DrafterShape":
        """The shape of an exported drafter (config.json as a dict)."""
        rope = cfg.get("rope_parameters") or {}
        eagle = cfg.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            num_aux=cfg.get("num_aux_hidden_states") or (len(ids) if ids else 3),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            hidden_act=cfg.get("hidden_act", "silu"))

    def num_trainable(self) -> int:
        """Trainable parameter count (everything but the shared embedding)."""
        h, d = self.hidden_size, self.head_dim
        qkv = 2 * h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        layer = qkv + self.num_attention_heads * d * h + 3 * h * self.intermediate_size + 3 * h
        return self.num_aux * self.target_hidden_size * h + layer + h + h * self.draft_vocab_size


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# Attention that is not a Llama layer (DeepSeek's MLA): its head_dim says nothing about a Llama drafter's.
_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def drafter_shape(target, cfg, num_aux: int, draft_vocab_size: int) -> DrafterShape:
    """The drafter's shape: values given in `cfg` (eagle3.config.DrafterConfig; 0 = derive), the
    rest from `target` (eagle3.targets.TargetInfo): one decoder layer shaped like the target's.
    The hidden size must be the target's: the drafter embeds with the target's own table."""
    if cfg.hidden_size and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"drafter.hidden_size={cfg.hidden_size} but the target's is "
                         f"{target.hidden_size}: the drafter shares the target's embedding")
    heads = cfg.num_attention_heads or target.num_attention_heads
    mla = target.model_type in _MLA_TYPES
    same_heads = heads == target.num_attention_heads
    kv_heads = cfg.num_key_value_heads or (target.num_key_value_heads if same_heads and not mla
                                           else heads)
    head_dim = cfg.head_dim or (target.head_dim if same_heads and not mla
                                else target.hidden_size // heads)
    return DrafterShape(
        hidden_size=target.hidden_size,
        intermediate_size=cfg.intermediate_size or target.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size,
        target_hidden_size=target.hidden_size, num_aux=num_aux,
        rms_norm_eps=cfg.rms_norm_eps or target.rms_norm_eps,
        rope_theta=cfg.rope_theta or target.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings or target.max_position_embeddings or 4096)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in (at least) fp32 whatever the compute dtype, as SGLang's and HF's RMSNorm.
    xf = x.to(_at_least_fp32(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # the product rounded back to x's dtype: what its consumer (a bf16 matmul) reads anyway
    return (weight * xf.to(x.dtype)).to(x.dtype)


def rope_angles(positions: torch.Tensor, d: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, 1, T, d/2] of Llama's rotary angles (at least fp32), once per call for all heads
    of q and k: per element of q and k, pow, cos and sin cost far more than the rotation."""
    dt = _at_least_fp32(dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=positions.device, dtype=dt) / d))
    angles = positions.to(dt)[:, None, :, None] * inv_freq
    return angles.cos(), angles.sin()


@fused
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama (NeoX-style, rotate-half) rotary embedding. x [B, n, T, d]; cos, sin from rope_angles."""
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# ---- attention -------------------------------------------------------------------------------
# One function, `attend`, for training-time test and cached inference. A query row sees a causal
# block of keys and, in TTT, S more keys of its own (its keys of the later draft steps). The causal
# block runs as flash attention (no [T, T] scores in memory; the CPU has its own flash kernel); the
# S own keys are S dot products per row, merged with the block by log-sum-exp. This replaces one
# SDPA over [K_0 | K_1 .. K_s] with a dense [T, (s+1)T] mask, which scored s*T*T keys to use s*T.
#
# Backward without a gradient through the block's log-sum-exp: for merged probabilities
# P = w * P_block (w = exp(lse_block - lse)), the flash backward given grad_out' = w * dOut and the
# MERGED output computes dS = P_block * (w dOut.v - w dOut.out) = P * (dOut.v - D), exactly the
# merged softmax's gradient (D = dOut.out), and dV = P_block^T (w dOut) = P^T dOut.

def _flash_backend(q: torch.Tensor) -> str:
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return "cuda"
    return "math"                              # e.g. fp32 on a GPU: flash kernels need 16-bit


def _block_forward(q, k, v, causal: bool, scale: float):
    """softmax(q k^T * scale) v over one block of keys (causal: query i sees keys j <= i; the
    block is square then). q [B, n, Tq, d]; k, v [B, n, Tk, d] -> (out [B, n, Tq, d],
    lse [B, n, Tq] fp32+, state for _block_backward)."""
    backend = _flash_backend(q)
    if backend == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse, None
    if backend == "cuda":
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cq, ck, mq, mk, seed, offset)
    scores = _masked_scores(q, k, causal, scale)
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp().to(v.dtype) @ v, lse, None


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, state):
    """(dq, dk, dv) of one block given `out` and `lse` (see the note above on what they are)."""
    backend = _flash_backend(q)
    if backend == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if backend == "cuda":
        cq, ck, mq, mk, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale)
    p = (_masked_scores(q, k, causal, scale) - lse[..., None]).exp()          # [B, n, Tq, Tk]
    dsum = (dout * out).sum(-1, keepdim=True)
    ds = p * (dout @ v.transpose(-1, -2) - dsum)
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout


def _masked_scores(q, k, causal, scale):
    s = (q @ k.transpose(-1, -2)).to(_at_least_fp32(q.dtype)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


class _Attention(torch.autograd.Function):
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
            outs, lses, states = outs + [o], lses + [lse], states + [st]
        out, lse = _merge(q, lses, outs, list(extra[:S]), list(extra[S:]), scale)
        ctx.save_for_backward(q, k, v, out, lse, *lses, *extra)
        ctx.blocks, ctx.states, ctx.S, ctx.scale = blocks, states, S, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        nb, S, scale = len(ctx.blocks), ctx.S, ctx.scale
        lses, ek, ev = rest[:nb], rest[nb:nb + S], rest[nb + S:]
        dout = dout.contiguous()
        dqs, dk, dv = [], [], []
        for (a, b, causal), l, st, g in zip(ctx.blocks, lses, ctx.states,
                                            _merge_grads(dout, lse, list(lses))):
            dqb, dkb, dvb = _block_backward(g, q, k[:, :, a:b], v[:, :, a:b], out, l, causal,
                                            scale, st)
            dqs, dk, dv = dqs + [dqb], dk + [dkb], dv + [dvb]
        dq, dek, dev = _merge_backward(dout, out, q, lse, dqs, list(ek), list(ev), scale)
        return (dq, torch.cat(dk, 2) if nb > 1 else dk[0],
                torch.cat(dv, 2) if nb > 1 else dv[0], *dek, *dev)


# The merge's elementwise work, fused on a GPU (eagle3/fused.py): all in (at least) fp32 over
# [B, n, Tq, d], one kernel instead of an fp32 copy per operand and per op.
@fused
def _merge(q, lses, outs, eks, evs, scale: float):
    """Blocks' (lse [B, n, Tq], out [B, n, Tq, d]) and the own keys/values eks, evs [B, n, Tq, d]
    -> (out [B, n, Tq, d] in q's dtype, lse [B, n, Tq] fp32+) of the softmax over all of them."""
    f = _at_least_fp32(q.dtype)
    qf = q.to(f)
    own = [(qf * ek.to(f)).sum(-1) * scale for ek in eks]                  # S x [B, n, Tq]
    lse = torch.stack(lses + own, -1).logsumexp(-1)                        # [B, n, Tq]
    out = sum((l - lse).exp()[..., None] * o.to(f) for l, o in zip(lses, outs))
    out = out + sum((s - lse).exp()[..., None] * ev.to(f) for s, ev in zip(own, evs))
    return out.to(q.dtype), lse


@fused
def _merge_grads(dout, lse, lses):
    """w * dOut per block (w = exp(lse_block - lse)), in dout's dtype: its flash backward's input."""
    f = lse.dtype
    return [((l - lse).exp()[..., None] * dout.to(f)).to(dout.dtype) for l in lses]


@fused
def _merge_backward(dout, out, q, lse, dqs, eks, evs, scale: float):
    """dqs: the blocks' dq -> (dq, dks, dvs of the own keys/values), dq summed in fp32+."""
    f = lse.dtype
    qf, df = q.to(f), dout.to(f)
    dsum = (df * out.to(f)).sum(-1)                                        # D [B, n, Tq]
    dq = sum(d.to(f) for d in dqs)
    dek, dev = [], []
    for kr, vr in zip(eks, evs):
        p = ((qf * kr.to(f)).sum(-1) * scale - lse).exp()                    # [B, n, Tq]
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


@dataclass
class QKVWeights:
    """The q/k/v projections fused ([nh*d + 2*nkv*d] output rows) and split by input columns: `embed`
    reads input_layernorm(embed(x)), `hidden` reads hidden_norm(h), each [N, H]. Cast once per
    unroll: TTT reuses them for every draft step, and the embedding's part once for all steps."""
    embed: torch.Tensor
    hidden: torch.Tensor


class Attention(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.nh, self.nkv, self.d, self.theta = (s.num_attention_heads, s.num_key_value_heads,
                                                 s.head_dim, s.rope_theta)
        self.q_proj = nn.Linear(2 * s.hidden_size, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, s.hidden_size, bias=False)

    def qkv_weights(self) -> QKVWeights:
        w = self.q_proj.weight
        dev = w.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else w.dtype
        fused = torch.cat([p.to(dt) for p in (w, self.k_proj.weight, self.v_proj.weight)])
        H = fused.shape[1] // 2
        return QKVWeights(embed=fused[:, :H], hidden=fused[:, H:])

    def forward(self, qkv, positions, keys=None, extra=None):
        """qkv [B, T, nh*d + 2*nkv*d] (projected, not rotated) -> (out [B, T, H], k, v
        [B, nkv, T, d]: this call's rotated keys and values). keys: (k, v) [B, nkv, P, d] seen
        before this call's rows (a KV cache); extra: TTT step s >= 1: (keys, values) of steps
        1..s-1 of the same rows, `keys` then being their step-0 keys; this call's own keys join
        the extras (see `attend`)."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q = q.view(B, T, self.nh, self.d).transpose(1, 2)
        k = k.view(B, T, self.nkv, self.d).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.d).transpose(1, 2)
        cos, sin = rope_angles(positions, self.d, self.theta, q.dtype)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if extra is not None:
            out = attend(q, keys[0], keys[1], [*extra[0], k], [*extra[1], v])
        elif keys is not None:
            out = attend(q, torch.cat([keys[0], k], dim=2), torch.cat([keys[1], v], dim=2))
        else:
            out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.d)), k, v


class MLP(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        if s.hidden_act != "silu":
            raise ValueError(f"hidden_act {s.hidden_act!r}: SGLang's Llama MLP supports only silu")
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


@fused
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def embed_qkv(self, embeds, w: QKVWeights):
        """[B, T, H] token embeddings -> [B, T, N]: their part of q/k/v. q/k/v read
        cat[input_layernorm(embed), hidden_norm(h)], so W @ a = W_embed @ e + W_hidden @ h; TTT
        step s at row t reads the embedding of row t+s+1, so one projection serves all steps."""
        return F.linear(self.input_layernorm(embeds), w.embed)

    def forward(self, e_qkv, h, positions, w: QKVWeights, keys=None, extra=None):
        qkv = e_qkv + F.linear(self.hidden_norm(h), w.hidden)
        attn, k, v = self.self_attn(qkv, positions, keys, extra)
        h = h + attn                                  # residual is the un-normed input hidden
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k, v


@dataclass
class DraftKVCache:
    """Rotated keys and values of the rows a drafter has seen, [B, nkv, L, d] each.

    Inference keeps one per batch of sequences that share a length (the evaluation drafts one
    sequence at a time). After the target's verify step, `truncate(n)` drops the rows of rejected
    draft tokens; the accepted rows are then re-fed with the target's hidden states."""
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def truncate(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)


class Eagle3Drafter(nn.Module):
    def __init__(self, shape: DrafterShape, embed: Optional[torch.Tensor] = None):
        """embed: the target's embed_tokens [V, H] (frozen); random when not given (tests)."""
        super().__init__()
        self.shape = shape
        s = shape
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)   # the target's, frozen
        if embed is not None:
            self.set_target_embedding(embed)
        self.fc = nn.Linear(s.num_aux * s.target_hidden_size, s.hidden_size, bias=False)
        self.midlayer = DecoderLayer(s)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)

    # -- pieces used by training-time test (eagle3/loss.py) and inference ----------------------
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, k*Ht] (the target's aux states, concatenated; stored in bf16) -> h [B, T, H]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def qkv_weights(self) -> QKVWeights:
        """The q/k/v weights in the compute dtype (autocast's when on), for embed_qkv and layer."""
        return self.midlayer.self_attn.qkv_weights()

    def embed_qkv(self, input_ids: torch.Tensor, w: QKVWeights) -> torch.Tensor:
        """input_ids [B, T] -> [B, T, N]: the tokens' part of q/k/v (see DecoderLayer.embed_qkv)."""
        return self.midlayer.embed_qkv(self.embed_tokens(input_ids), w)

    def layer(self, e_qkv, h, positions, w: QKVWeights, keys=None, extra=None):
        """One drafter step over rows: e_qkv [B, T, N] (embed_qkv of the rows' tokens), h [B, T, H],
        positions [B, T]; keys, extra as Attention.forward. Returns (h_out [B, T, H] pre-norm,
        k, v [B, nkv, T, d] of this call)."""
        return self.midlayer(e_qkv, h, positions, w, keys, extra)

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """[.., H] pre-norm hidden -> [.., Vd] draft-vocab logits."""
        return self.lm_head(self.norm(h_out))

    # -- whole-sequence and cached inference ----------------------------------------------------
    def forward(self, aux, input_ids, attention_mask=None):
        """Step 0 over whole sequences: row t reads (fc(aux_t), input_ids[t]) at position t and
        attends causally. The caller aligns ids (for drafting: input_ids[t] = x_{t+1}).
        attention_mask [B, T] (right padding) needs no use: a causal row never sees later rows,
        so real rows never see padding. Returns (logits [B, T, Vd], h_out [B, T, H])."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        w = self.qkv_weights()
        h_out, _, _ = self.layer(self.embed_qkv(input_ids, w), self.project(aux), positions, w)
        return self.logits(h_out), h_out

    def forward_step(self, input_ids, h, positions, cache: DraftKVCache):
        """Cached inference: new rows input_ids [B, Tq] with hidden h [B, Tq, H] (fc(aux) for
        target rows, a previous h_out for draft rows) at positions [B, Tq]. The new rows see every
        cached row and, causally, each other; their keys/values are appended to `cache`.
        Returns (logits [B, Tq, Vd], h_out [B, Tq, H])."""
        w = self.qkv_weights()
        keys = None if cache.k is None else (cache.k, cache.v)
        h_out, k, v = self.layer(self.embed_qkv(input_ids, w), h, positions, w, keys)
        cache.append(k, v)
        return self.logits(h_out), h_out

    # -- export -----------------------------------------------------------------------------------
    def set_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy in the target's embed_tokens [V, H] (stays frozen)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def exportable_state_dict(self) -> Dict[str, torch.Tensor]:
        """Every trainable weight under its export name (no embed_tokens); d2t/t2d come from
        the DraftVocab."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

