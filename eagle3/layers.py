"""The drafter's layers (eagle3/model.py's module doc gives the math they compute).

Layer 0 (`DecoderLayer`) reads cat[input_layernorm(embed), hidden_norm(h)]; layers j >= 1
(`UpperLayer`) are pre-norm Llama layers over the residual stream. Their q/k/v are stored fused
the way every unroll uses them, while state_dict() and load_state_dict() speak the engines'
q_proj/k_proj/v_proj (`Attention`). The elementwise chains (`rms_norm`, `rope`, `silu_mul`) are
fused kernels on a GPU (eagle3/fused.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.attention import at_least_fp32, attend
from eagle3.fused import fused
from eagle3.reused import Reused, linear, shared, window
from eagle3.shape import DrafterShape


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
    xf = x.to(at_least_fp32(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # the product rounded back to x's dtype: what its consumer (a bf16 matmul) reads anyway
    return (weight * xf.to(x.dtype)).to(x.dtype)


def rope_angles(positions: torch.Tensor, d: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, T, 1, d/2] of Llama's rotary angles (at least fp32), once per call for all heads
    of q and k: per element of q and k, pow, cos and sin cost far more than the rotation."""
    dt = at_least_fp32(dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=positions.device, dtype=dt) / d))
    angles = positions.to(dt)[:, :, None, None] * inv_freq
    return angles.cos(), angles.sin()


# q and k in one call (one kernel each way on a GPU): every compiled call costs the host time to
# launch, and the forward waits for the host in places.
@fused
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Llama (NeoX-style, rotate-half) rotary embedding of q [B, T, nh, d] and k [B, T, nkv, d];
    cos, sin from rope_angles."""
    def rotate(x):
        x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return rotate(q), rotate(k)


@dataclass
class UnrollWeights:
    """The drafter's weights in the compute dtype (autocast's when on), cast once per unroll.

    q/k/v are fused ([nh*d + 2*nkv*d] output rows) and split by input columns: `embed` [N, H] reads
    input_layernorm(embed(x)) and is used once for all TTT steps; `hidden` reads hidden_norm(h).
    It and the others serve every TTT step, so their gradients are summed inside the GEMMs
    (eagle3/reused.py); `embed` goes the same way for its one use. These are layer 0's; `upper`
    holds layers 1.. (num_layers > 1)."""
    embed: Reused
    hidden: Reused
    o: Reused
    gate: Reused
    up: Reused
    down: Reused
    lm_head: Reused
    upper: List["LayerWeights"] = field(default_factory=list)


@dataclass
class LayerWeights:
    """A layer j >= 1's weights for one unroll: q/k/v fused [nh*d + 2*nkv*d, H], and the rest as
    in UnrollWeights."""
    qkv: Reused
    o: Reused
    gate: Reused
    up: Reused
    down: Reused


_QKV = ("q_proj", "k_proj", "v_proj")


def _engine_names_hook(module, state_dict, prefix, local_metadata) -> None:
    module.to_engine_names(state_dict, prefix)


def _stored_names_hook(module, state_dict, prefix, *unused) -> None:
    module.from_engine_names(state_dict, prefix)


class Attention(nn.Module):
    """Llama attention over cat[input_layernorm(embed), hidden_norm(h)] ([2H] inputs).

    q/k/v are STORED as the two input halves of their fused weight, `qkv_embed` and `qkv_hidden`
    [nh*d + 2*nkv*d, H] (rows q, k, v), because that is how every unroll uses them: the embedding's
    half once for all TTT steps, the hidden half at every step. Storing q_proj/k_proj/v_proj would
    make each unroll concatenate the three and slice the halves out again, and backward fill and copy
    full-width buffers per half.
    state_dict() and load_state_dict() still speak the engines' q_proj/k_proj/v_proj
    [nh*d or nkv*d, 2H] (`to_engine_names`, `from_engine_names`), so exports, checkpoints and tests
    see the layout SGLang and vLLM load.

    first=False: the attention of a layer j >= 1, over [H] inputs; q/k/v are stored fused as one
    `qkv` [nh*d + 2*nkv*d, H] and exported as q_proj/k_proj/v_proj [.., H]."""

    def __init__(self, s: DrafterShape, first: bool = True):
        super().__init__()
        self.nh, self.nkv, self.d, self.theta = (s.num_attention_heads, s.num_key_value_heads,
                                                 s.head_dim, s.rope_theta)
        self.first = first
        rows, H = (self.nh + 2 * self.nkv) * self.d, s.hidden_size
        if first:
            bound = (2 * H) ** -0.5              # nn.Linear(2H, rows)'s default init, per half
            self.qkv_embed = nn.Parameter(torch.empty(rows, H).uniform_(-bound, bound))
            self.qkv_hidden = nn.Parameter(torch.empty(rows, H).uniform_(-bound, bound))
        else:
            bound = H ** -0.5                    # nn.Linear(H, rows)'s default init
            self.qkv = nn.Parameter(torch.empty(rows, H).uniform_(-bound, bound))
        self.o_proj = nn.Linear(self.nh * self.d, s.hidden_size, bias=False)
        self.register_state_dict_post_hook(_engine_names_hook)
        self.register_load_state_dict_pre_hook(_stored_names_hook)

    def _split_rows(self):
        return [self.nh * self.d, self.nkv * self.d, self.nkv * self.d]

    def to_engine_names(self, sd: Dict[str, torch.Tensor], prefix: str = "") -> Dict[str, torch.Tensor]:
        """In place: prefix+qkv_embed / qkv_hidden -> prefix+q_proj.weight, k_proj.weight, v_proj.weight
        [rows, 2H] (embedding half first); for first=False prefix+qkv -> the three [rows, H], each
        a tensor of its own (checkpoint writers keep one name per storage and drop the others).
        Keys already in engine names are left alone."""
        if not self.first:
            if prefix + "qkv" in sd:
                for name, w in zip(_QKV, sd.pop(prefix + "qkv").split(self._split_rows())):
                    sd[f"{prefix}{name}.weight"] = w.clone()
            return sd
        if prefix + "qkv_embed" not in sd:
            return sd
        e, h = sd.pop(prefix + "qkv_embed"), sd.pop(prefix + "qkv_hidden")
        for name, pe, ph in zip(_QKV, e.split(self._split_rows()), h.split(self._split_rows())):
            sd[f"{prefix}{name}.weight"] = torch.cat([pe, ph], dim=1)
        return sd

    def from_engine_names(self, sd: Dict[str, torch.Tensor], prefix: str = "") -> Dict[str, torch.Tensor]:
        """In place, the inverse of to_engine_names (a load_state_dict pre-hook)."""
        if prefix + "q_proj.weight" not in sd:
            return sd
        ws = [sd.pop(f"{prefix}{name}.weight") for name in _QKV]
        if not self.first:
            sd[prefix + "qkv"] = torch.cat(ws)
            return sd
        H = ws[0].shape[1] // 2
        sd[prefix + "qkv_embed"] = torch.cat([w[:, :H] for w in ws])
        sd[prefix + "qkv_hidden"] = torch.cat([w[:, H:] for w in ws])
        return sd

    def forward(self, qkv, angles, o: Reused, keys=None, extra=None, residual=None):
        """qkv [B, T, nh*d + 2*nkv*d] (projected, not rotated), angles: rope_angles (cos, sin) of
        the rows' positions -> (residual + out [B, T, H] (added in o's GEMM), k, v
        [B, nkv, T, d]: this call's rotated keys and values). keys: (k, v) [B, nkv, P, d] seen
        before this call's rows (a KV cache); extra: TTT step s >= 1: (keys, values) of steps
        1..s-1 of the same rows, `keys` then being their step-0 keys; this call's own keys join
        the extras (see `attend`)."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split(self._split_rows(), dim=-1)
        # rotated in [B, T, n, d] and only then viewed as [B, n, T, d]: rope writes the memory
        # layout the attention kernels read, so no layout copy of q and k precedes it
        q, k = rope(q.view(B, T, self.nh, self.d), k.view(B, T, self.nkv, self.d), *angles)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, T, self.nkv, self.d).transpose(1, 2)
        if extra is not None:
            out = attend(q, keys[0], keys[1], [*extra[0], k], [*extra[1], v])
        elif keys is not None:
            out = attend(q, torch.cat([keys[0], k], dim=2), torch.cat([keys[1], v], dim=2))
        else:
            out = attend(q, k, v)
        return linear(out.transpose(1, 2).reshape(B, T, self.nh * self.d), o, add=residual), k, v


class MLP(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        if s.hidden_act != "silu":
            raise ValueError(f"hidden_act {s.hidden_act!r}: SGLang's Llama MLP supports only silu")
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x, w: UnrollWeights, residual=None):
        """residual + down(silu(gate(x)) * up(x)), the add inside down's GEMM."""
        return linear(silu_mul(linear(x, w.gate), linear(x, w.up)), w.down, add=residual)


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

    def embed_qkv(self, embeds, w: UnrollWeights) -> Reused:
        """[B, L, H] token embeddings -> [B, L, N]: their part of q/k/v. q/k/v read
        cat[input_layernorm(embed), hidden_norm(h)], so W @ a = W_embed @ e + W_hidden @ h; TTT
        step s at row t reads the embedding of row t+s+1, so one projection serves all steps,
        each reading its window of rows (`window`)."""
        return shared(linear(self.input_layernorm(embeds), w.embed))

    def forward(self, e_qkv: Reused, h, angles, w: UnrollWeights, keys=None, extra=None, start: int = 0):
        # each add (the token part's window, rows start.. of e_qkv, and the residuals: the
        # un-normed input hidden, then h1) runs inside the GEMM before it (`linear`'s add)
        qkv = linear(self.hidden_norm(h), w.hidden, add=window(e_qkv, start, h.shape[1]))
        h, k, v = self.self_attn(qkv, angles, w.o, keys, extra, residual=h)
        h = self.mlp(self.post_attention_layernorm(h), w, residual=h)
        return h, k, v


class UpperLayer(nn.Module):
    """Decoder layer j >= 1: a pre-norm Llama layer over the residual stream (the module doc).

    Its one pre-norm is `input_layernorm` in state_dict(); the export adds `hidden_norm` with the
    same value (`with_hidden_norm`), since vLLM's layer reads the first and SGLang's the second,
    and each engine leaves a weight missing from the checkpoint silently at its initial value.
    Loading checks the two agree and keeps one."""

    def __init__(self, s: DrafterShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s, first=False)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)
        self.register_load_state_dict_pre_hook(_drop_hidden_norm_hook)

    def forward(self, h, angles, w: LayerWeights, keys=None, extra=None):
        qkv = linear(self.input_layernorm(h), w.qkv)
        h, k, v = self.self_attn(qkv, angles, w.o, keys, extra, residual=h)
        h = self.mlp(self.post_attention_layernorm(h), w, residual=h)
        return h, k, v


def with_hidden_norm(sd: Dict[str, torch.Tensor], prefix: str) -> None:
    """In place: prefix+hidden_norm.weight, a copy of prefix+input_layernorm.weight (a tensor of
    its own: safetensors refuses two names for one storage)."""
    if prefix + "input_layernorm.weight" in sd:
        sd[prefix + "hidden_norm.weight"] = sd[prefix + "input_layernorm.weight"].detach().clone()


def _drop_hidden_norm_hook(module, sd, prefix, *unused) -> None:
    norm = sd.pop(prefix + "hidden_norm.weight", None)
    if norm is not None and prefix + "input_layernorm.weight" in sd and not torch.equal(
            norm.to(sd[prefix + "input_layernorm.weight"].dtype), sd[prefix + "input_layernorm.weight"]):
        raise ValueError(f"{prefix}hidden_norm.weight differs from {prefix}input_layernorm.weight: "
                         f"vLLM reads the one and SGLang the other, so this drafter has no one meaning")
