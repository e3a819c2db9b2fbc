"""The EAGLE-3 drafter, exactly SGLang 0.5.23's `LlamaForCausalLMEagle3` (models/llama_eagle3.py).

One step of the drafter, for rows of token ids x and hidden states h [.., H]:

    residual = h                                            # the UN-normed hidden
    a   = cat[input_layernorm(embed(x)), hidden_norm(h)]    # [.., 2H]; q/k/v take 2H inputs
    h1  = residual + o_proj(attention(rope(q(a)), rope(k(a)), v(a)))
    h2  = h1 + mlp(post_attention_layernorm(h1))            # h_out: the PRE-norm output
    logits = lm_head(norm(h2))                              # [.., Vd] over the draft vocab
    next h = h2, or norm(h2) with norm_output               # what the next draft step reads

With num_layers = N > 1, layers 1..N-1 follow layer 0 as plain pre-norm Llama layers over the
residual stream (both engines' N-layer LlamaForCausalLMEagle3; the embedding enters layer 0 only):

    a   = prenorm_j(h2)                                     # [.., H]; q/k/v take H inputs
    h1  = h2 + o_proj_j(attention_j(..))                    # each layer its own keys and values
    h2  = h1 + mlp_j(post_attention_layernorm_j(h1))

and logits / next h read the last layer's h2. prenorm_j is `input_layernorm` in vLLM and
`hidden_norm` in SGLang: the export writes both names with one value (`UpperLayer`).

h is fc(aux) [k*Ht -> H] for rows that come from the target (step 0) and the drafter's own output
of the previous step afterwards. With fc_norm, each of the k aux states gets its own RMSNorm [Ht]
before fc: fc(cat[fc_norm_i(aux_i)]). fc_norm and norm_output are EAGLE-3.1's two changes; both
engines read them from config.json (`fc_norm`, `norm_output`, weights `fc_norm.{i}.weight`).
SGLang writes the two residual adds as fused `RMSNorm(x, residual)` calls (add, then norm,
returning both). Its fc is applied when the hidden's width differs from the embedding's, i.e. only
to the k*Ht aux concat: so H must differ from k*Ht (true for every real target).

state_dict() names are the export names (docs/design.md; q/k/v are stored fused, see `Attention`);
`embed_tokens` is the frozen target embedding, shared inside the engines and never exported.

One attention function, `eagle3.attention.attend`, serves training-time test (causal over the
step-0 keys plus each row's own later-step keys, docs/ttt.md) and inference with a KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import nn

from eagle3.layers import (DecoderLayer, LayerWeights, RMSNorm, UnrollWeights, UpperLayer, rope_angles,
                           with_hidden_norm)
from eagle3.reused import Reused, linear, reuse
from eagle3.shape import DrafterShape


@dataclass
class DraftKVCache:
    """Rotated keys and values of the rows a drafter has seen, per layer [B, nkv, L, d] each.

    Inference keeps one per batch of sequences that share a length (the evaluation drafts one
    sequence at a time). After the target's verify step, `truncate(n)` drops the rows of rejected
    draft tokens; the accepted rows are then re-fed with the target's hidden states."""
    k: List[torch.Tensor] = field(default_factory=list)
    v: List[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def keys(self):
        """Eagle3Drafter.layer's `keys`: None when empty, else (k, v) per layer."""
        return list(zip(self.k, self.v)) if self.k else None

    def truncate(self, n: int) -> None:
        self.k = [k[:, :, :n] for k in self.k]
        self.v = [v[:, :, :n] for v in self.v]

    def append(self, ks: List[torch.Tensor], vs: List[torch.Tensor]) -> None:
        """ks, vs: each layer's new rows."""
        if not self.k:
            self.k, self.v = list(ks), list(vs)
        else:
            self.k = [torch.cat([c, k], dim=2) for c, k in zip(self.k, ks)]
            self.v = [torch.cat([c, v], dim=2) for c, v in zip(self.v, vs)]


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
        # EAGLE-3.1's fc_norm: one norm per aux state; the engines' names fc_norm.{i}.weight
        self.fc_norm = (nn.ModuleList(RMSNorm(s.target_hidden_size, s.rms_norm_eps) for _ in range(s.num_aux))
                        if s.fc_norm else None)
        self.fc = nn.Linear(s.num_aux * s.target_hidden_size, s.hidden_size, bias=False)
        self.midlayer = DecoderLayer(s)
        # layers 1..: the engines' names layers.{j}.* (layer 0 keeps EAGLE-3's midlayer.*)
        self.layers = nn.ModuleDict({str(j): UpperLayer(s) for j in range(1, s.num_layers)})
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)

    # -- pieces used by training-time test (eagle3/loss.py) and inference ----------------------
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, k*Ht] (the target's aux states, concatenated; stored in bf16) -> h [B, T, H]:
        fc(aux), or fc(cat[fc_norm_i(aux_i)]) with fc_norm."""
        if self.fc_norm is not None:
            aux = torch.cat([n(a) for n, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return linear(aux, reuse(self.fc.weight, self._compute_dtype()))

    def _compute_dtype(self) -> torch.dtype:
        """autocast's dtype when it is on, else the weights' own."""
        dev = self.fc.weight.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.fc.weight.dtype

    def weights(self) -> UnrollWeights:
        """The weights in the compute dtype (autocast's when on) for one unroll: embed_qkv, layer
        and logits read them (training-time test: S layer steps; inference: one call)."""
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        dt = self._compute_dtype()
        upper = [LayerWeights(qkv=reuse(l.self_attn.qkv, dt), o=reuse(l.self_attn.o_proj.weight, dt),
                              gate=reuse(l.mlp.gate_proj.weight, dt), up=reuse(l.mlp.up_proj.weight, dt),
                              down=reuse(l.mlp.down_proj.weight, dt)) for l in self.layers.values()]
        return UnrollWeights(embed=reuse(attn.qkv_embed, dt), hidden=reuse(attn.qkv_hidden, dt),
                             o=reuse(attn.o_proj.weight, dt), gate=reuse(mlp.gate_proj.weight, dt),
                             up=reuse(mlp.up_proj.weight, dt), down=reuse(mlp.down_proj.weight, dt),
                             lm_head=reuse(self.lm_head.weight, dt), upper=upper)

    def embed_qkv(self, input_ids: torch.Tensor, w: UnrollWeights) -> Reused:
        """input_ids [B, L] -> [B, L, N]: the tokens' part of q/k/v (see DecoderLayer.embed_qkv)."""
        return self.midlayer.embed_qkv(self.embed_tokens(input_ids), w)

    def rope_angles(self, positions: torch.Tensor):
        """positions [B, T] -> rope_angles (cos, sin) [B, T, 1, d/2] in (at least) fp32, for `layer`.
        TTT computes them once for all steps and slices them (step s: positions + s)."""
        a = self.midlayer.self_attn
        return rope_angles(positions, a.d, a.theta, self._compute_dtype())

    def layer(self, e_qkv: Reused, h, angles, w: UnrollWeights, keys=None, extra=None, start: int = 0):
        """One drafter step over rows: e_qkv (embed_qkv of [B, L] tokens; the rows read its rows
        start..start+T-1), h [B, T, H], angles: rope_angles of the rows' positions [B, T]; keys, extra
        as Attention.forward, one entry per layer (keys: None or [(k, v)]; extra: None or
        [(keys, values)]). Returns (h_out [B, T, H] pre-norm, ks, vs: per layer, k, v
        [B, nkv, T, d] of this call)."""
        h, k, v = self.midlayer(e_qkv, h, angles, w, keys and keys[0], extra and extra[0], start)
        ks, vs = [k], [v]
        for j, (layer, lw) in enumerate(zip(self.layers.values(), w.upper), 1):
            h, k, v = layer(h, angles, lw, keys and keys[j], extra and extra[j])
            ks.append(k)
            vs.append(v)
        return h, ks, vs

    def logits(self, h_out: torch.Tensor, w: UnrollWeights) -> torch.Tensor:
        """[.., H] pre-norm hidden -> [.., Vd] draft-vocab logits."""
        return linear(self.norm(h_out), w.lm_head)

    def carry(self, h_out: torch.Tensor) -> torch.Tensor:
        """[.., H] pre-norm hidden -> the hidden the next draft step reads: h_out itself, or
        norm(h_out) (the lm_head's input) with norm_output."""
        return self.norm(h_out) if self.shape.norm_output else h_out

    # -- whole-sequence and cached inference ----------------------------------------------------
    def forward(self, aux, input_ids, attention_mask=None):
        """Step 0 over whole sequences: row t reads (fc(aux_t), input_ids[t]) at position t and
        attends causally. The caller aligns ids (for drafting: input_ids[t] = x_{t+1}).
        attention_mask [B, T] (right padding) needs no use: a causal row never sees later rows,
        so real rows never see padding. Returns (logits [B, T, Vd], the hidden the next step
        reads [B, T, H]: `carry`)."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        w = self.weights()
        h_out, _, _ = self.layer(self.embed_qkv(input_ids, w), self.project(aux),
                                 self.rope_angles(positions), w)
        return self.logits(h_out, w), self.carry(h_out)

    def forward_step(self, input_ids, h, positions, cache: DraftKVCache):
        """Cached inference: new rows input_ids [B, Tq] with hidden h [B, Tq, H] (fc(aux) for
        target rows, a previous h_out for draft rows) at positions [B, Tq]. The new rows see every
        cached row and, causally, each other; their keys/values are appended to `cache`.
        Returns (logits [B, Tq, Vd], the hidden the next step reads [B, Tq, H]: `carry`)."""
        w = self.weights()
        h_out, ks, vs = self.layer(self.embed_qkv(input_ids, w), h, self.rope_angles(positions), w,
                                   cache.keys())
        cache.append(ks, vs)
        return self.logits(h_out, w), self.carry(h_out)

    # -- export -----------------------------------------------------------------------------------
    def set_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy in the target's embed_tokens [V, H] (stays frozen)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def to_engine_names(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """A dict keyed by parameter names (DeepSpeed ZeRO-3 gathers those, skipping state_dict's
        hooks) with the engines' q_proj/k_proj/v_proj instead, and layers j >= 1's hidden_norm
        (`UpperLayer`); engine names pass through."""
        sd = self.midlayer.self_attn.to_engine_names(dict(state), "midlayer.self_attn.")
        for j, layer in self.layers.items():
            layer.self_attn.to_engine_names(sd, f"layers.{j}.self_attn.")
            with_hidden_norm(sd, f"layers.{j}.")
        return sd

    def exportable_state_dict(self) -> Dict[str, torch.Tensor]:
        """Every trainable weight under its export name (no embed_tokens); d2t/t2d come from
        the DraftVocab."""
        return self.to_engine_names({k: v for k, v in self.state_dict().items()
                                     if not k.startswith("embed_tokens.")})

