"""Conversations -> feature dataset, for `python -m capture` and for train.py's capture-first default;
and the producer of train.mode=stream (eagle3/stream_producer.py), which captures the same samples shard by
shard into the stream directory as training needs them.

Takes the typed config parts (eagle3.config dataclasses), never the Hydra config. Only reads the
conversations: regenerated ones are written beforehand by capture/regenerate.py.
"""
from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from eagle3.codec import FeatureFormat
from eagle3.config import CaptureConfig, DataConfig, TargetConfig, TrainConfig
from eagle3.data import load_samples
from eagle3.stream import STREAM_PARENT_ENV
from eagle3.targets import load_target_model, model_dtype, pick_device, target_info


def capture_features(target_dir: Path, aux_layers: Sequence[int], target: TargetConfig, data: DataConfig,
                     capture: CaptureConfig, out_dir: Path) -> Path:
    info = target_info(target_dir, target.name)
    tok, train, held = load_samples(target_dir, target, data, capture)
    run = capturer(target_dir, info, tok, aux_layers, target, data, capture, train, held, progress=True)
    print(f"[capture] {info.name} ({capture.backend}): {len(train) + len(held)} samples, aux_layers "
          f"{list(aux_layers)} -> {out_dir}")
    return run(train + held, out_dir, capture.shard_tokens)


def stream_features(target_dir: Path, aux_layers: Sequence[int], target: TargetConfig, data: DataConfig,
                    capture: CaptureConfig, train_cfg: TrainConfig) -> Path:
    """The stream producer: returns when the trainer is done (or the trainer that launched it is gone)."""
    from eagle3.stream import StreamError, open_stream, plan_stream
    from eagle3.stream_producer import produce

    info = target_info(target_dir, target.name)
    tok, train, held = load_samples(target_dir, target, data, capture)
    if capture.backend == "sglang" and not capture.server_url:
        raise SystemExit("error: train.mode=stream with capture.backend=sglang captures through a running capture "
                         "server: start one and pass capture.server_url (docs/streaming.md)")
    try:
        st = plan_stream(train, held, data, capture, train_cfg, len(aux_layers), info.hidden_size, info.vocab_size)
        open_stream(st.root, st.identity)
    except StreamError as e:
        raise SystemExit(f"error: {e}") from None
    run = capturer(target_dir, info, tok, aux_layers, target, data, capture, train, held, progress=False)
    parent = int(os.environ.get(STREAM_PARENT_ENV, "0"))
    print(f"[stream] producer: {st.sched.num_shards} shards an epoch, logical units up to {st.sched.end}, "
          f"budget {st.budget:,} bytes -> {st.root}", flush=True)
    produce(st.root, st.sched, train, st.heldout,
            lambda samples, out: run(samples, out, sum(len(x.input_ids) for x in samples)),
            st.reserve, st.heldout_reserve, st.budget, orphaned=lambda: bool(parent) and os.getppid() != parent,
            launched=bool(parent))
    return st.root


def capturer(target_dir: Path, info, tok, aux_layers: Sequence[int], target: TargetConfig, data: DataConfig,
             capture: CaptureConfig, train: Sequence[Any], held: Sequence[Any],
             progress: bool) -> Callable[[Sequence[Any], Path, int], Path]:
    """(samples, out_dir, shard_tokens) -> a finished feature dataset at out_dir, the model loaded once.
    A compact capture's draft vocab comes from all of `train`, whichever part a call captures (the
    stream captures a shard at a time), so every part stores its teacher over the same vocab."""
    every = [*train, *held]
    data_meta = {"source": data.source, "path": data.path, "num_samples": data.num_samples,
                 "max_length": data.max_length, "heldout_fraction": data.heldout_fraction,
                 "turns": data.turns, "max_prompt_chars": data.max_prompt_chars,
                 "heldout_ids": [s.id for s in held]}
    if data.mix:
        data_meta["mix"] = [asdict(e) for e in data.mix]
    if data.loop_tokens:   # other loss masks: a capture made without it must not be reused
        data_meta["loop_tokens"] = data.loop_tokens
    if target.chat_template_kwargs:   # the same template renders other text with other variables
        data_meta["chat_template_kwargs"] = dict(target.chat_template_kwargs)
    if capture.regenerate:   # a different dataset: a finished capture without it must not be reused
        data_meta["regenerated"] = {"engine": capture.backend, "max_new_tokens": capture.regen_max_new_tokens}
    if capture.backend == "hf":
        from capture.hf import hf_meta, run_capture
        device = pick_device(capture.device)
        model = load_target_model(target_dir, model_dtype(device), device, target.trust_remote_code)
        meta = hf_meta(target_name=info.name, target_fingerprint=info.fingerprint, arch=info.model_type,
                       aux_layers=aux_layers, hidden_size=info.hidden_size,
                       tokenizer_name=getattr(tok, "name_or_path", ""), chat_template=tok.chat_template,
                       data=data_meta)
        fmt = FeatureFormat(capture.format, capture.teacher_topk, capture.draft_vocab_size)

        def run_hf(samples, out_dir, shard_tokens):
            return run_capture(model, samples, out_dir, aux_layers=aux_layers, meta=meta,
                               batch_tokens=capture.batch_tokens, shard_tokens=shard_tokens, dtype=capture.dtype,
                               device=device, aux_dtype=capture.aux_dtype, progress=progress, fmt=fmt,
                               vocab_samples=every)
        return run_hf
    if capture.backend == "sglang":
        from capture.sglang_client import capture_sglang

        def run_sglang(samples, out_dir, shard_tokens):
            return capture_sglang(target_dir, info, tok, samples, aux_layers, replace(capture, shard_tokens=shard_tokens),
                                  data_meta, out_dir, progress=progress, vocab_samples=every)
        return run_sglang
    raise SystemExit(f"error: capture.backend={capture.backend!r}: expected 'hf' or 'sglang'")
