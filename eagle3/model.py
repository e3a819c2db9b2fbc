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

One attention function, `attend`, serves training-time test (a boolean mask over the step-0 keys
plus each row's own later-step keys, see eagle3/loss.py) and inference with a KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn


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
        # Statistics in (at least) fp32 whatever the compute dtype, as SGLang's and HF's RMSNorm.
        xf = x.to(_at_least_fp32(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (NeoX-style, rotate-half) rotary embedding. x [B, n, T, d], positions [B, T] int."""
    d, dt = x.shape[-1], _at_least_fp32(x.dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=dt) / d))
    angles = positions.to(dt)[:, None, :, None] * inv_freq           # [B, 1, T, d/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.to(dt).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """THE attention of this project. q [B, nh, Tq, d]; k, v [B, nkv, Tk, d] (already rotated);
    allowed [B, 1, Tq, Tk] bool, True where query may see key; every row must allow one key.
    Returns [B, nh, Tq, d]. Scale 1/sqrt(d), as SGLang's LlamaAttention."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                          enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.nh, self.nkv, self.d, self.theta = (s.num_attention_heads, s.num_key_value_heads,
                                                 s.head_dim, s.rope_theta)
        self.q_proj = nn.Linear(2 * s.hidden_size, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, s.hidden_size, bias=False)

    def forward(self, a, positions, past_k, past_v, allowed):
        """a [B, T, 2H] -> (out [B, T, H], k, v [B, nkv, T, d]: this call's keys/values)."""
        B, T, _ = a.shape
        q = self.q_proj(a).view(B, T, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(a).view(B, T, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(a).view(B, T, self.nkv, self.d).transpose(1, 2)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        vals = v if past_v is None else torch.cat([past_v, v], dim=2)
        out = attend(q, keys, vals, allowed).transpose(1, 2).reshape(B, T, self.nh * self.d)
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        if s.hidden_act != "silu":
            raise ValueError(f"hidden_act {s.hidden_act!r}: SGLang's Llama MLP supports only silu")
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, embeds, h, positions, past_k, past_v, allowed):
        a = torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)
        attn, k, v = self.self_attn(a, positions, past_k, past_v, allowed)
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

    def layer(self, input_ids, h, positions, past_k=None, past_v=None, allowed=None):
        """One drafter step over rows: input_ids [B, T], h [B, T, H], positions [B, T];
        past_k/past_v [B, nkv, P, d] keys before this call's; allowed [B, 1, T, P+T] bool.
        Returns (h_out [B, T, H] pre-norm, k, v [B, nkv, T, d] of this call)."""
        embeds = self.embed_tokens(input_ids).to(h.dtype)
        return self.midlayer(embeds, h, positions, past_k, past_v, allowed)

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """[.., H] pre-norm hidden -> [.., Vd] draft-vocab logits."""
        return self.lm_head(self.norm(h_out))

    # -- whole-sequence and cached inference ----------------------------------------------------
    def forward(self, aux, input_ids, attention_mask=None):
        """Step 0 over whole sequences: row t reads (fc(aux_t), input_ids[t]) at position t and
        attends causally. The caller aligns ids (for drafting: input_ids[t] = x_{t+1}).
        attention_mask [B, T] bool (right padding). Returns (logits [B, T, Vd], h_out [B, T, H])."""
        B, T = input_ids.shape
        real = (torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
                if attention_mask is None else attention_mask.bool())
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        h_out, _, _ = self.layer(input_ids, self.project(aux), positions,
                                 allowed=causal_mask(real)[:, None])
        return self.logits(h_out), h_out

    def forward_step(self, input_ids, h, positions, cache: DraftKVCache):
        """Cached inference: new rows input_ids [B, Tq] with hidden h [B, Tq, H] (fc(aux) for
        target rows, a previous h_out for draft rows) at positions [B, Tq]. The new rows see every
        cached row and, causally, each other; their keys/values are appended to `cache`.
        Returns (logits [B, Tq, Vd], h_out [B, Tq, H])."""
        B, Tq = input_ids.shape
        L = cache.length
        i = torch.arange(Tq, device=input_ids.device)[:, None]
        j = torch.arange(L + Tq, device=input_ids.device)[None, :]
        allowed = (j < L) | (j - L <= i)                               # [Tq, L+Tq]
        h_out, k, v = self.layer(input_ids, h, positions, cache.k, cache.v,
                                 allowed.expand(B, 1, Tq, L + Tq))
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


def causal_mask(real: torch.Tensor) -> torch.Tensor:
    """[B, T] bool real (right padding) -> [B, T, T] bool: row i sees real keys j <= i, and
    always itself (so padded rows, whose outputs are never used, stay finite)."""
    T = real.shape[1]
    i = torch.arange(T, device=real.device)[:, None]
    j = torch.arange(T, device=real.device)[None, :]
    return (j <= i) & (real[:, None, :] | (j == i))
