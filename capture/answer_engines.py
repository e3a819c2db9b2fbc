"""Engines that answer prompts for regeneration (capture/regenerate.py): each takes prompts as token
ids and returns, per prompt, its answer ids without the stop token and whether a stop token ended it.

    hf_generate      the target in-process, batch by batch (capture/fastgen.py for Llama targets,
                     transformers' generate for others)
    hf_continuous    fastgen.ContinuousGreedy: rows refilled as answers end
    sglang_generate  a running SGLang server's /generate

Each answers greedily, or at temperature > 0 samples from softmax(logits / temperature).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch

Generate = Callable[[List[List[int]]], List[Tuple[List[int], bool]]]


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> Tuple[List[int], bool]:
    for j, t in enumerate(ids):
        if t in stop_ids:
            return list(ids[:j]), True
    return list(ids), False


def hf_generate(model, stop_ids: Sequence[int], max_new_tokens: int, batch_size: int = 16,
                memory_fraction: float = 0.5, temperature: float = 0.0) -> Generate:
    """Greedy answers (sampled at temperature > 0) in batches of similar length (longest first), left padded.

    Llama targets use capture/fastgen.py (static cache, CUDA graph on GPU; on CUDA a batch holds up
    to batch_size prompts, fewer when their cache would exceed memory_fraction of free memory);
    other targets use transformers' generate in batches of batch_size."""
    from capture import fastgen

    device = next(model.parameters()).device
    pad = int(stop_ids[0])
    fast = fastgen.supports(model)
    if fast:
        dec = fastgen.StaticGreedy(model, max_new_tokens, pad_id=pad, temperature=temperature)

        def decode(batch: List[List[int]]) -> List[List[int]]:
            return dec.generate(batch, stop_ids=stop_ids)
    else:
        from transformers import GenerationConfig

        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False)
        gen = GenerationConfig(**sampling, max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids), pad_token_id=pad)

        def decode(batch: List[List[int]]) -> List[List[int]]:
            ids, att = fastgen.left_pad(batch, pad)
            with torch.no_grad():
                seq = model.generate(input_ids=ids.to(device), attention_mask=att.to(device),
                                     generation_config=gen)
            return seq[:, ids.shape[1]:].tolist()

    def run(prompts: List[List[int]]) -> List[Tuple[List[int], bool]]:
        out: List[Optional[Tuple[List[int], bool]]] = [None] * len(prompts)
        on_gpu = fast and device.type == "cuda"
        budget = int(torch.cuda.mem_get_info(device)[0] * memory_fraction) if on_gpu else 1 << 62
        per_token = dec.cache_bytes_per_token() if fast else 1
        for idx in fastgen.batches_by_memory([len(p) for p in prompts], max_new_tokens, batch_size,
                                             per_token, budget):
            for i, ids in zip(idx, decode([prompts[i] for i in idx])):
                out[i] = cut_at_stop(ids, stop_ids)
        return out
    return run


def hf_continuous(model, stop_ids: Sequence[int], max_new_tokens: int, max_prompt_tokens: int,
                  rows: int, memory_fraction: float = 0.5, temperature: float = 0.0):
    """fastgen.ContinuousGreedy for prompts of up to max_prompt_tokens: `rows` rows, fewer on CUDA when
    their static cache (max_prompt_tokens + max_new_tokens slots each) would exceed memory_fraction of
    free memory; None for a target fastgen does not support (it answers in rounds with hf_generate)."""
    from capture import fastgen

    if not fastgen.supports(model):
        return None
    dec = fastgen.StaticGreedy(model, max_new_tokens, pad_id=int(stop_ids[0]))
    device = next(model.parameters()).device
    if device.type == "cuda":
        per_row = (max_prompt_tokens + max_new_tokens) * dec.cache_bytes_per_token()
        rows = max(1, min(rows, int(torch.cuda.mem_get_info(device)[0] * memory_fraction) // per_row))
    return fastgen.ContinuousGreedy(model, max_new_tokens, max_prompt_tokens, rows, int(stop_ids[0]), stop_ids,
                                    temperature=temperature)


def sglang_generate(url: str, stop_ids: Sequence[int], max_new_tokens: int, concurrency: int = 16,
                    spool_dir: Optional[str] = None, temperature: float = 0.0) -> Generate:
    """Greedy (at temperature > 0, sampled) /generate on a running server. On a capture server every
    prompt's prefill also lands in the spool as req_regen.*: those entries are deleted as they appear (and by the capture)."""
    from concurrent.futures import ThreadPoolExecutor

    from capture.sglang_client import post_json

    counter = iter(range(1 << 62))

    def one(prompt: List[int]) -> Tuple[List[int], bool]:
        rid = f"regen.{os.getpid()}.{next(counter)}"
        ans = post_json(url.rstrip("/") + "/generate", {
            "input_ids": prompt, "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature,
                                "stop_token_ids": list(stop_ids), "skip_special_tokens": False}})
        return cut_at_stop(ans.get("output_ids") or [], stop_ids)

    def run(prompts: List[List[int]]) -> List[Tuple[List[int], bool]]:
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            out = list(pool.map(one, prompts))
        if spool_dir:
            _sweep_regen_entries(Path(spool_dir))
        return out
    return run


def _sweep_regen_entries(spool: Path) -> None:
    import shutil

    if spool.is_dir():
        for e in os.scandir(spool):
            if e.name.startswith("req_regen.") and (Path(e.path, "done").exists() or Path(e.path, "error.txt").exists()):
                shutil.rmtree(e.path, ignore_errors=True)
