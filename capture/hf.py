"""In-process capture: a transformers target's hidden states (eagle3/hidden.py) -> feature dataset.

    run_capture(model, samples, out_path, aux_layers=..., meta=...)

Batches of similar length, longest first; each batch is written while the next one runs.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from eagle3 import codec
from eagle3.codec import Compact, FeatureFormat
from eagle3.features import make_meta, plan_shards, storage_dtype
from eagle3.feature_writer import FeatureWriter, open_capture
from eagle3.hidden import capture_hidden, pad_right


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


def run_capture(model: nn.Module, samples: Sequence[Any], out_path, *, aux_layers: Sequence[int],
                meta: Dict[str, Any], batch_tokens: int = 8192, shard_tokens: int = 262144,
                dtype: str = "bfloat16", device=None, progress: bool = True, aux_dtype: str = "",
                fmt: Optional[FeatureFormat] = None, vocab_samples: Optional[Sequence[Any]] = None) -> Path:
    """Capture every sample (objects with .id, .input_ids [T], .loss_mask [T]) into a feature dataset.

    Resumable: shards committed by an earlier run with the same meta/samples/settings are kept and
    their samples skipped; rerunning after Ctrl-C or SIGKILL ends byte-identical to a run that never
    stopped. A finished dataset at out_path is checked against meta (engine version aside) and kept.
    Batches never cross a shard, so a shard's numbers do not depend on where a run stopped.
    fmt: the feature format (capture.format); compact encodes each batch on the model's device, its
    draft vocab built from vocab_samples (default: samples; held-out ones in meta left out).
    """
    ids = [str(s.id) for s in samples]
    lengths = [len(s.input_ids) for s in samples]
    compact = compact_of(fmt, model, samples if vocab_samples is None else vocab_samples, meta)
    writer = open_capture(out_path, meta, ids, lengths, dtype=dtype, shard_tokens=shard_tokens,
                          aux_dtype=aux_dtype, compact=compact)
    if writer is None:
        return Path(out_path)
    pending = writer.pending_shards()
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
                host = to_host({"aux": aux, "final": final}, sdt) if compact is None else \
                    to_host(codec.encode(compact, aux, final))
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


def compact_of(fmt: Optional[FeatureFormat], model: nn.Module, samples: Sequence[Any],
               meta: Dict[str, Any]) -> Optional[Compact]:
    """codec.compact_for with the in-process target's own lm_head; the training samples are those
    not in meta's held-out ids (capture/run.py records them)."""
    return codec.compact_for(fmt, samples, meta.get("data", {}).get("heldout_ids", []),
                             model.get_output_embeddings().weight.detach())


def to_host(cols: Dict[str, torch.Tensor], cast: Optional[torch.dtype] = None):
    """Start the device->host copy of a batch's columns: ({name: tensor}, event or None).

    On CUDA: cast on the GPU when `cast` is given (half the bytes for bf16), copy into pinned memory
    without blocking, and record an event the writer waits on. On CPU the columns are returned as
    they are (the writer casts, off the main thread).
    """
    if next(iter(cols.values())).device.type != "cuda":
        return cols, None
    host = {}
    for name, t in cols.items():
        t = t if cast is None else t.to(cast)
        host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host[name].copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _write_batch(writer: FeatureWriter, samples: Sequence[Any], idx: List[int], host) -> None:
    """host: to_host's (columns, event): aux and final, or the compact columns codec.encode made."""
    cols, event = host
    if event is not None:
        event.synchronize()
    for b, i in enumerate(idx):
        s = samples[i]
        n = len(s.input_ids)
        if "final" in cols:
            writer.add(str(s.id), s.input_ids, s.loss_mask, cols["aux"][b, :n], cols["final"][b, :n])
        else:
            writer.add(str(s.id), s.input_ids, s.loss_mask, None, None, {k: v[b, :n] for k, v in cols.items()})


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Tokens a forward computes over these batches (rows x longest row)."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches) if batches else 0


def shard_batches(lengths: Sequence[int], shard_tokens: int, batch_tokens: int) -> List[List[int]]:
    """The batches run_capture runs, as global positions (for the benchmark and padding stats)."""
    out = []
    for shard in plan_shards(lengths, shard_tokens):
        out += [[shard[j] for j in b] for b in plan_batches([lengths[i] for i in shard], batch_tokens)]
    return out

