"""Conversations -> feature dataset, for `python -m capture` and for train.py's capture-first default.

Takes the typed config parts (eagle3.config dataclasses), never the Hydra config. Only reads the
conversations: regenerated ones are written beforehand by capture/regenerate.py.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from eagle3.codec import FeatureFormat
from eagle3.config import CaptureConfig, DataConfig, TargetConfig
from eagle3.data import load_samples
from eagle3.targets import load_target_model, model_dtype, pick_device, target_info


def capture_features(target_dir: Path, aux_layers: Sequence[int], target: TargetConfig, data: DataConfig,
                     capture: CaptureConfig, out_dir: Path) -> Path:
    info = target_info(target_dir, target.name)
    tok, train, held = load_samples(target_dir, target, data, capture)
    data_meta = {"source": data.source, "path": data.path, "num_samples": data.num_samples,
                 "max_length": data.max_length, "heldout_fraction": data.heldout_fraction,
                 "turns": data.turns, "max_prompt_chars": data.max_prompt_chars,
                 "heldout_ids": [s.id for s in held]}
    if data.mix:
        data_meta["mix"] = [asdict(e) for e in data.mix]
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
        print(f"[capture] {info.name} on {device}: {len(train) + len(held)} samples, aux_layers {list(aux_layers)} "
              f"-> {out_dir}")
        return run_capture(model, train + held, out_dir, aux_layers=aux_layers, meta=meta,
                           batch_tokens=capture.batch_tokens, shard_tokens=capture.shard_tokens,
                           dtype=capture.dtype, device=device, aux_dtype=capture.aux_dtype,
                           fmt=FeatureFormat(capture.format, capture.teacher_topk, capture.draft_vocab_size))
    if capture.backend == "sglang":
        from capture.sglang_client import capture_sglang
        return capture_sglang(target_dir, info, tok, train + held, aux_layers, capture, data_meta, out_dir)
    raise SystemExit(f"error: capture.backend={capture.backend!r}: expected 'hf' or 'sglang'")
