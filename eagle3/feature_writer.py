"""Writing a feature dataset (the format: eagle3/features.py), resumably and atomically.

The writer fixes every shard's layout up front from the ordered sample list (plan_shards), writes
each sample at its place, and commits a shard by renaming it; so shards do not depend on the order
samples arrive in, and a killed capture that resumes ends byte-identical to one that never stopped.
`open_capture` is a capture's entry: the writer, resuming an earlier run's committed shards, or None
when the finished dataset is already there.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from eagle3 import codec
from eagle3.codec import Compact
from eagle3.durable import fsync_dir, write_text
from eagle3.config import field_diffs, flatten, json_normal
from eagle3.features import COMPACT_CONTAINER_VERSION, MANIFEST, VOCAB, FeatureDataset, plan_shards
from eagle3.shards import (AUX_DTYPES, FLOAT_DTYPES, FORMAT, FORMAT_VERSION, FP8, FeatureDatasetError,
                           OpenShard, file_sha256, np_bytes, quantize_fp8, shard_name)

PROGRESS = "progress.json"


def _atomic_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=1, sort_keys=True))


# ----------------------------------------------------------------------------- writer

class FeatureWriter:
    """Writes a feature dataset at `path`, resumably and atomically.

    Work happens in `<path>.partial/`; a shard is written to a `.tmp` name and renamed when its
    last sample arrives; progress.json lists committed shards. Samples may arrive in any order
    (a batch sorted by length, SGLang requests finishing out of order). finish() writes
    manifest.json and renames the directory to `path`.

    sample_ids/lengths: every sample of the dataset, in dataset order (they fix the shard plan).
    meta: from make_meta (target, aux_layers, hidden_size, num_aux, tokenizer, engine, data).
    dtype: storage of final (and aux); aux_dtype: of aux when different (float8_e4m3fn: see top).
    compact: write the compact format instead (eagle3/codec.py; dtype and aux_dtype do not apply).
    """

    def __init__(self, path, meta: Dict[str, Any], sample_ids: Sequence[str], lengths: Sequence[int],
                 dtype: str = "bfloat16", shard_tokens: int = 262144, aux_dtype: str = "",
                 compact: Optional[Compact] = None):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        if self.path.exists():
            raise FileExistsError(f"{self.path} already exists (a finished feature dataset)")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {sorted(FLOAT_DTYPES)} (fp8 is for aux only: "
                             f"aux_dtype={FP8!r}; final is the teacher and stays 16-bit)")
        if compact is not None and aux_dtype:
            raise ValueError(f"aux_dtype {aux_dtype!r} is for the full format; the compact format stores aux "
                             f"in 4 bits")
        aux_dtype = aux_dtype or dtype
        if aux_dtype not in AUX_DTYPES:
            raise ValueError(f"aux_dtype {aux_dtype!r}: expected one of {sorted(AUX_DTYPES)}")
        if len(set(sample_ids)) != len(sample_ids):
            raise ValueError("sample ids are not unique")
        self.meta = json_normal(meta)
        self.num_aux, self.hidden = int(meta["num_aux"]), int(meta["hidden_size"])
        self.dtype, self.torch_dtype, self.aux_dtype = dtype, FLOAT_DTYPES[dtype][0], aux_dtype
        self.compact = compact
        self.fmt = compact.params() if compact is not None else None
        self.ids, self.lengths = [str(s) for s in sample_ids], [int(n) for n in lengths]
        self.plan = plan_shards(self.lengths, shard_tokens)
        self.where = {self.ids[i]: (s, j) for s, idx in enumerate(self.plan) for j, i in enumerate(idx)}
        plan_hash = hashlib.sha256(json.dumps([self.ids, self.lengths]).encode()).hexdigest()
        self.run = {"meta": self.meta, "dtype": dtype, "shard_tokens": int(shard_tokens),
                    "plan_sha256": plan_hash, "format_version": FORMAT_VERSION,
                    **({"aux_dtype": aux_dtype} if aux_dtype != dtype else {}),
                    **({"feature_format": self.fmt} if self.fmt else {})}
        self.done: Dict[int, Dict[str, int]] = {}
        self.open: Dict[int, OpenShard] = {}
        self._resume()
        if compact is not None:                       # rewritten each run: the same bytes for the same vocab
            compact.vocab.save(self.partial / VOCAB)

    def _resume(self) -> None:
        """Keep the committed shards of an earlier run with the same settings; drop everything else."""
        progress = self.partial / PROGRESS
        if progress.exists():
            old = json.loads(progress.read_text())
            diffs = [f"{k}: earlier run {h!r}, this run {w!r}" for k, h, w in field_diffs(old["run"], self.run)]
            diffs += [f"{k}: earlier run {h!r}, this run <missing>" for k, _, h in field_diffs(self.run, old["run"])
                      if k not in flatten(self.run)]
            if diffs:
                raise FeatureDatasetError(f"cannot resume {self.partial}: " + "; ".join(diffs)
                                          + f". Delete {self.partial} to start over.")
            for s, rec in old["done"].items():
                f = self.partial / shard_name(int(s))
                if f.exists() and f.stat().st_size == rec["num_bytes"] and \
                        rec.get("sha256", "") in ("", file_sha256(f)):
                    self.done[int(s)] = rec
        self.partial.mkdir(parents=True, exist_ok=True)
        keep = {shard_name(s) for s in self.done}
        for f in self.partial.iterdir():              # temp files, uncommitted shards, old manifest
            if f.name not in keep and f.name != PROGRESS:
                f.unlink() if f.is_file() else shutil.rmtree(f)
        self._save_progress()

    def _save_progress(self) -> None:
        _atomic_json(self.partial / PROGRESS,
                     {"run": self.run, "done": {str(s): r for s, r in sorted(self.done.items())}})

    def done_ids(self) -> set:
        return {self.ids[i] for s in self.done for i in self.plan[s]}

    def pending_shards(self) -> List[List[int]]:
        """The plan's shards (lists of sample positions) not yet committed, in order."""
        return [idx for s, idx in enumerate(self.plan) if s not in self.done]

    def add(self, sample_id: str, input_ids, loss_mask, aux: Optional[torch.Tensor], final: Optional[torch.Tensor],
            encoded: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """input_ids [T], loss_mask [T], aux [T, k*H], final [T, H] (any float dtype or device).
        Compact: aux and final are encoded here with the writer's Compact, or `encoded` holds the
        columns codec.encode made of them already (on a GPU, say), and aux and final are None."""
        s, j = self.where[str(sample_id)]
        if s in self.done:
            raise ValueError(f"sample {sample_id!r} is in shard {s}, which is already committed")
        n = self.lengths[self.plan[s][j]]
        if self.compact is not None:
            self._add_compact(s, j, n, sample_id, input_ids, loss_mask,
                              encoded if encoded is not None else codec.encode(self.compact, aux, final))
            return
        want = {"input_ids": (n,), "loss_mask": (n,), "aux": (n, self.num_aux * self.hidden),
                "final": (n, self.hidden)}
        parts = {"input_ids": torch.as_tensor(input_ids), "loss_mask": torch.as_tensor(loss_mask),
                 "aux": aux, "final": final}
        for name, shape in want.items():
            if tuple(parts[name].shape) != shape:
                raise ValueError(f"sample {sample_id!r}: {name} has shape {tuple(parts[name].shape)}, "
                                 f"expected {shape}")
        _check_finite(sample_id, parts, ("aux", "final"))   # a NaN here would surface steps later as a NaN loss
        arrays = {"input_ids": np_bytes(parts["input_ids"], torch.int32),
                  "loss_mask": np_bytes(parts["loss_mask"], torch.uint8),
                  "final": np_bytes(final, self.torch_dtype)}
        if self.aux_dtype == FP8:
            q, scale = quantize_fp8(aux, self.num_aux)
            arrays.update(aux=np_bytes(q, torch.float8_e4m3fn), aux_scale=scale.numpy())
        else:
            arrays["aux"] = np_bytes(aux, FLOAT_DTYPES[self.aux_dtype][0])
        self._write(s, j, arrays)

    def _add_compact(self, s: int, j: int, n: int, sample_id: str, input_ids, loss_mask,
                     enc: Dict[str, torch.Tensor]) -> None:
        specs = codec.column_specs(self.num_aux, self.hidden, self.fmt)
        parts = {"input_ids": torch.as_tensor(input_ids), "loss_mask": torch.as_tensor(loss_mask), **enc}
        for name, shape in [("input_ids", (n,)), ("loss_mask", (n,))] + [(c, (n, *specs[c][1])) for c in specs]:
            if tuple(parts[name].shape) != shape:
                raise ValueError(f"sample {sample_id!r}: {name} has shape {tuple(parts[name].shape)}, "
                                 f"expected {shape}")
        # what a NaN in aux or final turns into
        _check_finite(sample_id, parts, ("aux_scale", "teacher_p", "teacher_mass"))
        arrays = {"input_ids": np_bytes(parts["input_ids"], torch.int32),
                  "loss_mask": np_bytes(parts["loss_mask"], torch.uint8),
                  **{c: np_bytes(parts[c], dt) for c, dt in codec.column_dtypes(self.fmt).items()}}
        self._write(s, j, arrays)

    def _write(self, s: int, j: int, arrays: Dict[str, np.ndarray]) -> None:
        """Write one sample's arrays at its place in shard s; commit the shard when it is complete."""
        if s not in self.open:
            lengths = [self.lengths[i] for i in self.plan[s]]
            self.open[s] = OpenShard(self.partial / shard_name(s), lengths, self.num_aux, self.hidden,
                                     FLOAT_DTYPES[self.dtype][1], AUX_DTYPES[self.aux_dtype][1], self.fmt)
        shard = self.open[s]
        shard.write(j, arrays)
        if not shard.pending:
            nbytes, digest = shard.commit()
            del self.open[s]
            self.done[s] = {"num_bytes": nbytes, "num_loss_tokens": shard.loss_tokens, "sha256": digest}
            self._save_progress()

    def finish(self) -> Path:
        """Write manifest.json and move `<path>.partial` to `path`; every sample must have been added."""
        missing = len(self.plan) - len(self.done)
        if missing:
            raise FeatureDatasetError(f"{self.partial}: {missing} of {len(self.plan)} shards are not complete")
        shards = []
        for s, idx in enumerate(self.plan):
            shards.append({"file": shard_name(s), "num_samples": len(idx),
                           "num_tokens": sum(self.lengths[i] for i in idx),
                           "num_bytes": self.done[s]["num_bytes"],
                           "num_loss_tokens": self.done[s]["num_loss_tokens"],
                           **({"sha256": self.done[s]["sha256"]} if "sha256" in self.done[s] else {}),
                           "sample_ids": [self.ids[i] for i in idx]})
        tokens = sum(sh["num_tokens"] for sh in shards)
        nbytes = sum(sh["num_bytes"] for sh in shards)
        manifest = dict(self.meta)
        if self.fmt is not None:
            dtypes = {c: str(dt).replace("torch.", "") for c, dt in codec.column_dtypes(self.fmt).items()}
            manifest["feature_format"] = dict(self.fmt, draft_vocab_file=VOCAB)
        else:
            dtypes = {"aux": self.aux_dtype, "final": self.dtype,
                      **({"aux_scale": "float32"} if self.aux_dtype == FP8 else {})}
        manifest.update({
            "format": FORMAT, "shard_tokens": self.run["shard_tokens"],
            "format_version": FORMAT_VERSION if self.fmt is None else COMPACT_CONTAINER_VERSION,
            "dtypes": {**dtypes, "input_ids": "int32", "loss_mask": "uint8", "offsets": "int64"},
            "shards": shards,
            "totals": {"num_shards": len(shards), "num_samples": len(self.ids), "num_tokens": tokens,
                       "num_loss_tokens": sum(sh["num_loss_tokens"] for sh in shards),
                       "num_bytes": nbytes, "bytes_per_token": round(nbytes / max(tokens, 1), 3)},
        })
        _atomic_json(self.partial / MANIFEST, manifest)
        (self.partial / PROGRESS).unlink()
        os.rename(self.partial, self.path)
        fsync_dir(self.path.parent)                   # make the rename durable
        return self.path


def _check_finite(sample_id: str, parts: Dict[str, torch.Tensor], names: Sequence[str]) -> None:
    for name in names:
        bad = int((~torch.isfinite(parts[name])).sum())
        if bad:
            raise FeatureDatasetError(f"sample {sample_id!r}: {name} holds {bad} non-finite values (NaN/Inf): "
                                      f"the target overflowed its dtype on this sample")


def check_storage(ds: FeatureDataset, dtype: str, aux_dtype: str = "", compact: Optional[Compact] = None) -> None:
    """A finished dataset kept for a capture must be stored as that capture asks."""
    if ds.compact or compact is not None:
        have = ds.format if ds.compact else {"name": "full"}
        want = compact.params() if compact is not None else {"name": "full"}
        bad = [f"{k} is {h!r}, this capture asks for {w!r}" for k, h, w in field_diffs(have, want)]
        if bad:
            raise FeatureDatasetError(f"{ds.path}: feature format " + "; ".join(bad) + " (capture.format, "
                                      "capture.teacher_topk, drafter.draft_vocab_size): delete it or point "
                                      "data.features_dir elsewhere")
        return
    have = {"final": ds.manifest["dtypes"]["final"], "aux": ds.manifest["dtypes"]["aux"]}
    want = {"final": dtype, "aux": aux_dtype or dtype}
    if have != want:
        raise FeatureDatasetError(
            f"{ds.path} holds aux {have['aux']} / final {have['final']}, this capture asks for aux "
            f"{want['aux']} / final {want['final']} (capture.dtype, capture.aux_dtype): delete it or "
            f"point data.features_dir elsewhere")


def finished_capture(path, meta: Dict[str, Any], dtype: str, aux_dtype: str = "",
                     compact: Optional[Compact] = None) -> bool:
    """True when a finished dataset at `path` is this capture's: its manifest matches meta (engine
    version aside, so a newer engine keeps it) and its storage (dtypes or format); a mismatch raises."""
    path = Path(path)
    if not (path / MANIFEST).exists():
        return False
    check_storage(FeatureDataset(path, expected={k: v for k, v in meta.items() if k != "engine"}),
                  dtype, aux_dtype, compact)
    print(f"capture: {path} is complete; nothing to do")
    return True


def open_capture(path, meta: Dict[str, Any], sample_ids: Sequence[str], lengths: Sequence[int], *,
                 dtype: str, shard_tokens: int, aux_dtype: str = "",
                 compact: Optional[Compact] = None) -> Optional[FeatureWriter]:
    """The writer of a capture into `path`, resuming the committed shards of an earlier run of it;
    None when the finished dataset is already there (see finished_capture)."""
    if finished_capture(path, meta, dtype, aux_dtype, compact):
        return None
    writer = FeatureWriter(path, meta, sample_ids, lengths, dtype=dtype, shard_tokens=shard_tokens,
                           aux_dtype=aux_dtype, compact=compact)
    done = len(writer.plan) - len(writer.pending_shards())
    if done:
        print(f"capture: resuming {writer.partial}: {done} of {len(writer.plan)} shards already done")
    return writer
