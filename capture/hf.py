"""In-process capture: forward hooks on a transformers target give `aux` and `final` (DESIGN.md).

    aux, final = capture_hidden(model, input_ids, attention_mask, aux_layers)   # the tensors
    batch = capture_batch(model, input_ids, attention_mask, loss_mask, aux_layers, ids)  # online training
    run_capture(model, samples, out_path, aux_layers=..., meta=...)             # -> feature dataset

`aux` at layer i is the residual stream ENTERING decoder layer i (= output_hidden_states[i]), taken
by a forward pre-hook; `final` is the base model's last_hidden_state (after the final norm), so
target logits = final @ lm_head.weight.T. The base model runs without the LM head: no logits are
computed, which on SmolLM2 (vocab 49152, hidden 576) saves about a fifth of the forward.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from eagle3.features import (MANIFEST, Batch, FeatureDataset, FeatureWriter, check_storage, make_meta,
                             plan_shards, storage_dtype)


def decoder_parts(model: nn.Module) -> Tuple[nn.Module, nn.ModuleList]:
    """(base model, its decoder layer list) of a CausalLM, a base model, or a multimodal wrapper.

    Follows .model / .language_model / .text_model until a module with `layers` and `norm`:
    LlamaForCausalLM.model, DeepseekV3ForCausalLM.model, Kimi-K2.5's language_model.model.
    """
    m = model
    for _ in range(5):
        if isinstance(getattr(m, "layers", None), nn.ModuleList) and isinstance(getattr(m, "norm", None), nn.Module):
            return m, m.layers
        child = next((getattr(m, n) for n in ("model", "language_model", "text_model")
                      if isinstance(getattr(m, n, None), nn.Module)), None)
        if child is None:
            break
        m = child
    raise ValueError(f"{type(model).__name__}: no decoder (a module with .layers and .norm) found "
                     "under .model / .language_model / .text_model")


def capture_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   aux_layers: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """input_ids/attention_mask [B,T] (right padding) -> aux [B,T,k*H], final [B,T,H] in the model dtype.

    Positions past a row's length hold whatever the model computed for padding. No I/O, no
    gradients; hooks are removed even when the forward raises.
    """
    base, layers = decoder_parts(model)
    bad = [i for i in aux_layers if not 0 <= int(i) < len(layers)]
    if bad:
        raise ValueError(f"aux_layers {list(aux_layers)}: {bad} outside 0..{len(layers) - 1} "
                         f"(layer i = the residual stream entering decoder layer i)")
    seen: Dict[int, torch.Tensor] = {}

    def hook_for(i: int):
        def hook(module, args, kwargs):
            # A reference, not a copy: eager llama/deepseek layers never modify their input in
            # place (the tests compare against output_hidden_states to keep that true).
            seen[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [layers[i].register_forward_pre_hook(hook_for(i), with_kwargs=True)
               for i in sorted({int(i) for i in aux_layers})]
    try:
        with torch.no_grad():   # not inference_mode: online training feeds these into autograd
            out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    final = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    aux = torch.cat([seen[int(i)] for i in aux_layers], dim=-1)
    return aux, final


def capture_batch(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  loss_mask: torch.Tensor, aux_layers: Sequence[int], sample_ids: Sequence[str]) -> Batch:
    """Online training's batch: the same Batch a feature dataset gives, computed in-process.

    input_ids/attention_mask/loss_mask [B,T], right padding. Padded positions of aux/final are
    zeroed, as collate() pads them, so the two sources differ only by storage rounding.
    """
    aux, final = capture_hidden(model, input_ids, attention_mask, aux_layers)
    keep = attention_mask.bool()
    return Batch(input_ids.long(), loss_mask.float() * keep, keep, aux * keep[..., None],
                 final * keep[..., None], list(sample_ids))


def hf_meta(*, target_name: str, target_fingerprint: str, arch: str, aux_layers: Sequence[int],
            hidden_size: int, tokenizer_name: str, chat_template: Optional[str],
            data: Dict[str, Any]) -> Dict[str, Any]:
    """make_meta with engine = hf + the installed transformers version."""
    import transformers
    return make_meta(target_name=target_name, target_fingerprint=target_fingerprint, arch=arch,
                     aux_layers=aux_layers, hidden_size=hidden_size, tokenizer_name=tokenizer_name,
                     chat_template=chat_template, engine="hf", engine_version=transformers.__version__,
                     data=data)


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> List[List[int]]:
    """Group positions into batches of at most batch_tokens padded tokens (B * longest).

    Longest first, so neighbours have similar lengths and little padding; ties keep their order,
    so the batches (and hence the exact numerics) are the same on every run.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: List[List[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def pad_right(seqs: Sequence[Sequence[int]], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> input_ids [B,T] int64 (0-padded), attention_mask [B,T] int64."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    att = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        att[b, :len(s)] = 1
    return ids.to(device), att.to(device)


def _without(d: Dict[str, Any], key: str) -> Dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def run_capture(model: nn.Module, samples: Sequence[Any], out_path, *, aux_layers: Sequence[int],
                meta: Dict[str, Any], batch_tokens: int = 8192, shard_tokens: int = 262144,
                dtype: str = "bfloat16", device=None, progress: bool = True, aux_dtype: str = "") -> Path:
    """Capture every sample (objects with .id, .input_ids [T], .loss_mask [T]) into a feature dataset.

    Resumable: shards committed by an earlier run with the same meta/samples/settings are kept and
    their samples skipped; rerunning after Ctrl-C or SIGKILL ends byte-identical to a run that never
    stopped. A finished dataset at out_path is checked against meta (engine version aside) and kept.
    Batches never cross a shard, so a shard's numbers do not depend on where a run stopped.
    """
    out_path = Path(out_path)
    if (out_path / MANIFEST).exists():
        check_storage(FeatureDataset(out_path, expected=_without(meta, "engine")), dtype, aux_dtype)
        print(f"capture: {out_path} is complete; nothing to do")
        return out_path
    ids = [str(s.id) for s in samples]
    lengths = [len(s.input_ids) for s in samples]
    writer = FeatureWriter(out_path, meta, ids, lengths, dtype=dtype, shard_tokens=shard_tokens,
                           aux_dtype=aux_dtype)
    pending = writer.pending_shards()
    if len(pending) < len(writer.plan):
        print(f"capture: resuming {writer.partial}: {len(writer.plan) - len(pending)} of "
              f"{len(writer.plan)} shards already done")
    device = device if device is not None else next(model.parameters()).device
    sdt = storage_dtype(dtype)
    from tqdm import tqdm
    bar = tqdm(total=sum(lengths[i] for shard in pending for i in shard), unit="tok", unit_scale=True,
               desc="capture", disable=not progress, smoothing=0.1)
    # One writer thread: batch k goes to disk while batch k+1 runs (pwrite and the dtype cast
    # release the GIL). At most two batches are on the host; writes stay in plan positions, so the
    # overlap changes no byte.
    pool, writing = ThreadPoolExecutor(max_workers=1), None
    try:
        for shard in pending:
            for local in plan_batches([lengths[i] for i in shard], batch_tokens):
                idx = [shard[j] for j in local]
                input_ids, att = pad_right([samples[i].input_ids for i in idx], device)
                aux, final = capture_hidden(model, input_ids, att, aux_layers)
                host = to_host(aux, final, sdt)
                if writing is not None:
                    writing.result()
                writing = pool.submit(_write_batch, writer, samples, idx, host)
                bar.update(sum(lengths[i] for i in idx))
        if writing is not None:
            writing.result()
    except KeyboardInterrupt:
        bar.close()
        print(f"\ncapture: interrupted; committed shards are kept in {writer.partial}: rerun to resume")
        raise
    finally:
        pool.shutdown(wait=True)
    bar.close()
    return writer.finish()


def to_host(aux: torch.Tensor, final: torch.Tensor, sdt: torch.dtype):
    """Start the device->host copy of a batch: (aux, final, event or None).

    On CUDA: cast on the GPU (half the bytes for bf16), copy into pinned memory without blocking,
    and record an event the writer waits on. On CPU the writer casts, off the main thread.
    """
    if aux.device.type != "cuda":
        return aux, final, None
    out = []
    for t in (aux, final):
        h = torch.empty(t.shape, dtype=sdt, pin_memory=True)
        h.copy_(t.to(sdt), non_blocking=True)
        out.append(h)
    event = torch.cuda.Event()
    event.record()
    return out[0], out[1], event


def _write_batch(writer: FeatureWriter, samples: Sequence[Any], idx: List[int], host) -> None:
    aux, final, event = host
    if event is not None:
        event.synchronize()
    for b, i in enumerate(idx):
        n = len(samples[i].input_ids)
        writer.add(str(samples[i].id), samples[i].input_ids, samples[i].loss_mask, aux[b, :n], final[b, :n])


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Tokens a forward computes over these batches (rows x longest row)."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches) if batches else 0


def shard_batches(lengths: Sequence[int], shard_tokens: int, batch_tokens: int) -> List[List[int]]:
    """The batches run_capture runs, as global positions (for the benchmark and padding stats)."""
    out = []
    for shard in plan_shards(lengths, shard_tokens):
        out += [[shard[j] for j in b] for b in plan_batches([lengths[i] for i in shard], batch_tokens)]
    return out

