"""Greedy decoding of Llama-architecture targets with a static KV cache, one step replayed as a CUDA graph.

transformers' `generate` spends each step of a small target in Python, not on the GPU, whatever the
batch size (docs/perf.md compares the two: `bench/regenerate.py`). Here the prompt goes through the model's own forward
(prefill, in row groups that fit in memory) and its keys/values are copied into a static cache of
prompt + max_new_tokens slots; one decode step (embedding, every layer, final norm, lm_head,
argmax) is captured once per batch shape as a CUDA graph and replayed. On CPU the same step runs
eagerly (that is what the tests compare with `generate`).

Rows are left padded, so every row writes the same cache slot each step; a row's mask is its own
prompt span plus the slots written so far, and its positions count from its first real token,
exactly as `generate` does with an attention mask. Only the plain Llama decoder layer is
supported (`supports`); other targets use `generate`.
"""
from __future__ import annotations

from typing import List, Sequence

import torch


def supports(model) -> bool:
    c = model.config
    return (c.model_type == "llama" and not getattr(c, "attention_bias", False)
            and not getattr(c, "mlp_bias", False) and getattr(c, "hidden_act", "silu") == "silu"
            and hasattr(model, "model") and hasattr(model.model, "rotary_emb"))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class StaticGreedy:
    """greedy(prompts) -> generated ids per prompt (max_new_tokens each, stop tokens included)."""

    def __init__(self, model, max_new_tokens: int, pad_id: int):
        if not supports(model):
            raise ValueError(f"StaticGreedy supports plain Llama decoders, not {model.config.model_type!r}")
        c = model.config
        self.model, self.max_new, self.pad_id = model, max_new_tokens, pad_id
        self.nh, self.nkv = c.num_attention_heads, c.num_key_value_heads
        self.hd = getattr(c, "head_dim", None) or c.hidden_size // self.nh
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def cache_bytes_per_token(self) -> int:
        return 2 * len(self.model.model.layers) * self.nkv * self.hd * self.dtype.itemsize

    # ---- one decode step: token ids [B] at positions [B], written to cache slot `slot` [1] ----
    def _step(self, ids, pos, slot, keys, values, valid, arange):
        m = self.model.model
        B, g = ids.shape[0], self.nh // self.nkv
        h = m.embed_tokens(ids)[:, None]                                   # [B, 1, H]
        cos, sin = m.rotary_emb(h, pos[:, None])                           # [B, 1, hd]
        cos, sin = cos[:, None], sin[:, None]                              # [B, 1, 1, hd]
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=ids.device)
        bias = bias.masked_fill(~(valid & (arange <= slot)), float("-inf"))[:, None, None]  # [B,1,1,T]
        for layer, K, V in zip(m.layers, keys, values):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(B, self.nh, 1, self.hd)
            k = a.k_proj(x).view(B, self.nkv, 1, self.hd)
            v = a.v_proj(x).view(B, self.nkv, 1, self.hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            K.index_copy_(2, slot, k)
            V.index_copy_(2, slot, v)
            # query head j*g..j*g+g-1 reads kv head j (transformers' repeat_kv order)
            s = torch.matmul(q.view(B, self.nkv, g, self.hd), K.transpose(-1, -2)).float() * a.scaling
            p = torch.softmax(s + bias, dim=-1).to(V.dtype)
            o = torch.matmul(p, V).reshape(B, 1, self.nh * self.hd)
            h = h + a.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(m.norm(h))[:, 0].argmax(-1)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], prefill_tokens: int = 1 << 18,
                 stop_ids: Sequence[int] = ()) -> List[List[int]]:
        """One batch: left-pad, prefill, decode max_new_tokens greedily (early exit once every row
        has produced a stop id)."""
        dev, B = self.device, len(prompts)
        ids, att = (t.to(dev) for t in left_pad(prompts, self.pad_id))
        T = ids.shape[1]
        S = T + self.max_new
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        layers = self.model.model.layers
        keys = [torch.zeros(B, self.nkv, S, self.hd, dtype=self.dtype, device=dev) for _ in layers]
        values = [torch.zeros_like(k) for k in keys]
        out = torch.empty(B, self.max_new, dtype=torch.long, device=dev)
        rows = max(1, prefill_tokens // T)
        for r0 in range(0, B, rows):                   # prefill in row groups that fit in memory
            sl = slice(r0, r0 + rows)
            res = self.model(input_ids=ids[sl], attention_mask=att[sl], position_ids=pos[sl],
                             use_cache=True, logits_to_keep=1)
            for i, layer_cache in enumerate(res.past_key_values.layers):
                keys[i][sl, :, :T] = layer_cache.keys
                values[i][sl, :, :T] = layer_cache.values
            out[sl, 0] = res.logits[:, -1].argmax(-1)
            del res
        valid = torch.cat([att.bool(), torch.ones(B, self.max_new, dtype=torch.bool, device=dev)], 1)
        arange = torch.arange(S, device=dev)
        cur = out[:, 0].clone()
        cur_pos = pos[:, -1] + 1
        slot = torch.tensor([T], dtype=torch.long, device=dev)
        step = self._replayable(cur, cur_pos, slot, keys, values, valid, arange)
        stops = torch.tensor(list(stop_ids) or [-1], device=dev)
        for j in range(1, self.max_new):
            out[:, j] = step()
            cur.copy_(out[:, j])
            cur_pos.add_(1)
            slot.add_(1)
            if stop_ids and j % 32 == 31 and bool(torch.isin(out[:, :j + 1], stops).any(-1).all()):
                out = out[:, :j + 1]
                break
        return out.tolist()

    def _replayable(self, *args):
        """A no-argument callable running one step on the static buffers `args`."""
        if self.device.type != "cuda":
            return lambda: self._step(*args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                  # warm-up; its cache writes are redone by the replays
            self._step(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                result = self._step(*args)
        except RuntimeError as e:                       # still correct, only slower
            print(f"[fastgen] CUDA graph capture failed ({e}); decoding eagerly", flush=True)
            return lambda: self._step(*args)

        def replay():
            graph.replay()
            return result
        return replay


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int):
    """(ids, attention mask), both [B, longest] int64 on CPU, each prompt right-aligned."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    att = torch.zeros(len(prompts), T, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, T - len(p):] = torch.tensor(p, dtype=torch.long)
        att[r, T - len(p):] = 1
    return ids, att


def batches_by_memory(lengths: Sequence[int], max_new: int, max_batch: int, bytes_per_token: int,
                      budget_bytes: int) -> List[List[int]]:
    """Prompt indices grouped longest first so that each group's static cache fits budget_bytes."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, b = [], 0
    while b < len(order):
        S = lengths[order[b]] + max_new
        n = max(1, min(max_batch, budget_bytes // (S * bytes_per_token)))
        groups.append(order[b:b + n])
        b += n
    return groups

