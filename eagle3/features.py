"""The feature dataset: the one contract between capture and training (docs/design.md).

A dataset is a directory of safetensors shards plus manifest.json. A shard holds many samples
concatenated along tokens:

    offsets   [S+1] int64   sample s is rows offsets[s]:offsets[s+1]
    input_ids [N]   int32
    aux       [N, k*H]      the k aux states (residual stream entering layer i), in aux_layers order
    final     [N, H]        what the LM head consumes: target logits = final @ lm_head.weight.T
    loss_mask [N]   uint8   1 on assistant tokens

With `capture.format=compact` (eagle3/codec.py) aux is stored in 4-bit codes with a scale per group
and final is replaced by the teacher the loss reads (top-K draft-vocab probabilities, the mass on
the draft vocab, the full-vocab argmax), computed at capture over a draft vocab fixed there and
stored beside the shards (draft_vocab.safetensors); the manifest's `feature_format` names it.
ds[i] then holds teacher_ids/teacher_p/teacher_mass/teacher_top instead of final.

In the full format aux and final are stored in the capture's dtype (bfloat16 by default). With aux_dtype
float8_e4m3fn, aux is stored in fp8 with one fp32 scale per row and aux state, `aux_scale [N, k]`
(the row's largest magnitude / 448, the e4m3 maximum), and read back as bf16: 37.5% fewer bytes at
Kimi-K2.5 dims for +0.01% of TTT loss (docs/perf.md). final stays 16-bit: it is the teacher, and in
fp8 the target's argmax moves on 3% of rows.

Tensors sit in the file in descending element size, so every one starts aligned to its element
size and can be viewed straight out of the memory map. The writer fixes every shard's layout up front from the
ordered sample list (plan_shards), writes each sample at its place, and commits a shard by renaming
it; so shards do not depend on the order samples arrive in, and a killed capture that resumes ends
byte-identical to one that never stopped. Each shard's sha256, taken at commit, is in the manifest;
the reader checks it the first time a process reads a sample of the shard, so a flipped bit is
refused by name.
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
from eagle3.shards import (AUX_DTYPES, FLOAT_DTYPES, FORMAT, FORMAT_VERSION, FP8, FeatureDatasetError,
                           OpenShard, check_sha256, check_shard, dequantize_fp8, file_sha256, np_bytes,
                           quantize_fp8, shard_name, tensor_views)
from eagle3.durable import fsync_dir, write_text
from eagle3.vocab import DraftVocab

AUX_MEANING = ("residual stream entering decoder layer i = transformers output_hidden_states[i] "
               "(hidden_states + residual in engines that keep the residual separate)")
PROGRESS = "progress.json"
MANIFEST = "manifest.json"
VOCAB = "draft_vocab.safetensors"               # a compact dataset's draft vocab, beside its shards
# feature_format name -> the versions this code reads. A manifest without feature_format is full.
# Compact datasets also carry container format_version 2, so readers that predate them refuse them
# by that number instead of failing on a missing tensor.
KNOWN_FORMATS = {"full": (1,), codec.NAME: (codec.VERSION,)}
COMPACT_CONTAINER_VERSION = 2

# ----------------------------------------------------------------------------- planning / meta

def plan_shards(lengths: Sequence[int], shard_tokens: int) -> List[List[int]]:
    """Cut the ordered samples into consecutive shards of at most shard_tokens tokens.

    Greedy in order, so the cut depends only on the lengths: a rerun plans the same shards. A
    sample longer than shard_tokens gets a shard of its own.
    """
    shards: List[List[int]] = []
    cur: List[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and used + n > shard_tokens:
            shards.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += int(n)
    if cur:
        shards.append(cur)
    return shards


def template_sha256(chat_template: Optional[str]) -> str:
    """How a manifest (and the regeneration cache) identifies a chat template."""
    return hashlib.sha256((chat_template or "").encode()).hexdigest()


def make_meta(*, target_name: str, target_fingerprint: str, arch: str, aux_layers: Sequence[int],
              hidden_size: int, tokenizer_name: str, chat_template: Optional[str], engine: str,
              engine_version: str, data: Dict[str, Any]) -> Dict[str, Any]:
    """What a capture records about where its features came from (the writer adds the rest)."""
    return {
        "target": {"name": target_name, "fingerprint": target_fingerprint, "arch": arch},
        "aux_layers": [int(i) for i in aux_layers],
        "aux_meaning": AUX_MEANING,
        "hidden_size": int(hidden_size),
        "num_aux": len(aux_layers),
        "tokenizer": {"name": tokenizer_name, "chat_template_sha256": template_sha256(chat_template)},
        "engine": {"name": engine, "version": engine_version},
        "data": dict(data),
    }


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype features are stored in ("bfloat16" | "float16" | "float32")."""
    if name not in FLOAT_DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[name][0]


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _normal(d: Dict[str, Any]) -> Dict[str, Any]:
    """Tuples -> lists etc., so a value compares equal to itself after a JSON round trip."""
    return json.loads(json.dumps(d))


def _diffs(have: Dict[str, Any], want: Dict[str, Any]) -> List[tuple]:
    """(dotted key, have value, want value) for every leaf of `want` that `have` disagrees with."""
    h = _flatten(_normal(have))
    return [(k, h.get(k, "<missing>"), v) for k, v in _flatten(_normal(want)).items()
            if h.get(k, "<missing>") != v]


def check_compatible(manifest: Dict[str, Any], expected: Dict[str, Any], where: str = "") -> None:
    """Raise FeatureDatasetError naming every (nested) key of `expected` the manifest disagrees with.

    expected e.g. {"target": {"name": "smollm2"}, "aux_layers": [2, 15, 27], "hidden_size": 576}.
    """
    bad = [f"{k} is {h!r}, expected {w!r}" for k, h, w in _diffs(manifest, expected)]
    if bad:
        raise FeatureDatasetError(f"feature dataset {where or ''} does not match: " + "; ".join(bad))


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
        self.meta = _normal(meta)
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
            diffs = [f"{k}: earlier run {h!r}, this run {w!r}" for k, h, w in _diffs(old["run"], self.run)]
            diffs += [f"{k}: earlier run {h!r}, this run <missing>" for k, _, h in _diffs(self.run, old["run"])
                      if k not in _flatten(self.run)]
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


# ----------------------------------------------------------------------------- reader

def feature_format(manifest: Dict[str, Any], where: Any) -> Dict[str, Any]:
    """The manifest's feature_format record ({"name": "full", "version": 1} when it has none: every
    dataset written before formats had names); FeatureDatasetError naming `where` and the known
    formats when this code does not read it."""
    fmt = manifest.get("feature_format") or {"name": "full", "version": 1}
    if fmt.get("version") not in KNOWN_FORMATS.get(fmt.get("name"), ()):
        known = ", ".join(f"{n} (version {', '.join(map(str, v))})" for n, v in KNOWN_FORMATS.items())
        raise FeatureDatasetError(f"{where}: feature format {fmt.get('name')!r} version {fmt.get('version')!r} "
                                  f"is not one this code reads; known formats: {known}")
    want = COMPACT_CONTAINER_VERSION if fmt["name"] == codec.NAME else FORMAT_VERSION
    if manifest.get("format_version") != want:
        raise FeatureDatasetError(f"{where}: format_version {manifest.get('format_version')}, this code reads "
                                  f"{want} for the {fmt['name']} format")
    return fmt


class FeatureDataset:
    """Read side: ds[i] -> {input_ids [T] int64, loss_mask [T] uint8, aux [T, k*H], final [T, H]}, or
    for a compact dataset {input_ids, loss_mask, aux [T, k*H] bf16, teacher_ids [T, K] int64,
    teacher_p [T, K] fp16, teacher_mass [T] fp32, teacher_top [T] int64} (eagle3/codec.py).

    Shards are memory-mapped (copy-on-write, so tensors are writable without touching the file)
    when first used; aux/final/loss_mask are views into the mapping, not copies. Only input_ids is
    widened to int64 (a copy of T ints), and fp8 or 4-bit aux is dequantized to bf16 (a copy).
    """

    def __init__(self, path, expected: Optional[Dict[str, Any]] = None):
        self.path = Path(path)
        mf = self.path / MANIFEST
        if not mf.exists():
            hint = " (an unfinished capture: rerun it to resume)" if self.path.with_name(
                self.path.name + ".partial").exists() else ""
            raise FeatureDatasetError(f"{self.path}: no {MANIFEST}{hint}")
        self.manifest = json.loads(mf.read_text())
        self.format = feature_format(self.manifest, mf)
        self.compact = self.format["name"] == codec.NAME
        if expected:
            check_compatible(self.manifest, expected, where=str(self.path))
        shards = self.manifest["shards"]
        for rec in shards:                            # cheap: a stat per shard, so nothing maps past EOF
            f = self.path / rec["file"]
            if not f.exists():
                raise FeatureDatasetError(f"{rec['file']}: missing from {self.path}")
            if f.stat().st_size != rec["num_bytes"]:
                raise FeatureDatasetError(f"{rec['file']}: truncated: {f.stat().st_size} bytes, "
                                          f"manifest says {rec['num_bytes']}")
        self._shard = np.repeat(np.arange(len(shards)), [r["num_samples"] for r in shards])
        self._local = np.concatenate([np.arange(r["num_samples"]) for r in shards]) if shards else \
            np.zeros(0, dtype=np.int64)
        self._ids = [sid for r in shards for sid in r["sample_ids"]]
        self._maps: Dict[int, Dict[str, torch.Tensor]] = {}
        self._unverified: Dict[int, np.memmap] = {}

    def __getstate__(self):                           # DataLoader workers re-map (and re-check) on their own
        state = dict(self.__dict__)
        state["_maps"], state["_unverified"] = {}, {}
        return state

    def __len__(self) -> int:
        return len(self._ids)

    def sample_id(self, i: int) -> str:
        return self._ids[i]

    def length(self, i: int) -> int:
        """Tokens of sample i, from its shard's offsets (nothing else is read)."""
        off = self._tensors(int(self._shard[i]))["offsets"]
        j = int(self._local[i])
        return int(off[j + 1]) - int(off[j])

    def _tensors(self, s: int) -> Dict[str, torch.Tensor]:
        if s not in self._maps:
            rec = self.manifest["shards"][s]
            path = self.path / rec["file"]
            header, start = check_shard(path, rec, self.manifest)
            mm = np.memmap(path, dtype=np.uint8, mode="c")
            self._maps[s] = tensor_views(mm[start:], header)
            self._unverified[s] = mm
        return self._maps[s]

    def _verified(self, s: int) -> Dict[str, torch.Tensor]:
        """The shard's tensors, its sha256 checked on first use in this process (length() reads only
        offsets, so planning batches over a large dataset does not hash it all up front)."""
        t = self._tensors(s)
        if s in self._unverified:
            check_sha256(self.path / self.manifest["shards"][s]["file"], self._unverified[s],
                         self.manifest["shards"][s])
            del self._unverified[s]
        return t

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        t = self._verified(int(self._shard[i]))
        j = int(self._local[i])
        a, b = int(t["offsets"][j]), int(t["offsets"][j + 1])
        if self.compact:
            # aux stays coded: Batch.to decodes it on the training device (a quarter of the bytes to
            # copy, and no host time on a decode the GPU does in microseconds)
            return {"input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b],
                    "aux_codes": t["aux_codes"][a:b], "aux_scale": t["aux_scale"][a:b],
                    "teacher_ids": t["teacher_ids"][a:b].long(), "teacher_p": t["teacher_p"][a:b],
                    "teacher_mass": t["teacher_mass"][a:b], "teacher_top": t["teacher_top"][a:b].long()}
        aux = t["aux"][a:b] if "aux_scale" not in t else dequantize_fp8(t["aux"][a:b], t["aux_scale"][a:b])
        return {"input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b],
                "aux": aux, "final": t["final"][a:b]}

    def draft_vocab(self) -> Optional[DraftVocab]:
        """The draft vocab a compact dataset's teacher is over (checked against the manifest's
        sha256); None for a full dataset, whose teacher training computes from final."""
        if not self.compact:
            return None
        path = self.path / self.format.get("draft_vocab_file", VOCAB)
        if not path.exists():
            raise FeatureDatasetError(f"{path.name}: missing from {self.path} (the draft vocab of its teacher)")
        vocab = DraftVocab.load(path)
        if codec.vocab_sha256(vocab) != self.format["teacher"]["draft_vocab_sha256"]:
            raise FeatureDatasetError(f"{path}: its draft vocab does not match the sha256 the manifest recorded")
        return vocab

    def validate(self) -> None:
        """Check every shard fully against the manifest; FeatureDatasetError names the bad shard."""
        for s, rec in enumerate(self.manifest["shards"]):
            path = self.path / rec["file"]
            if not path.exists():
                raise FeatureDatasetError(f"{rec['file']}: missing from {self.path}")
            check_shard(path, rec, self.manifest)
            t = self._verified(s)
            off = t["offsets"]
            if int(off[0]) != 0 or int(off[-1]) != rec["num_tokens"] or bool((off[1:] < off[:-1]).any()):
                raise FeatureDatasetError(f"{rec['file']}: offsets are not monotone from 0 to "
                                          f"{rec['num_tokens']}")
            if t["loss_mask"].numel() and int(t["loss_mask"].max()) > 1:
                raise FeatureDatasetError(f"{rec['file']}: loss_mask holds values other than 0/1")
            if int(t["loss_mask"].sum()) != rec["num_loss_tokens"]:
                raise FeatureDatasetError(f"{rec['file']}: {int(t['loss_mask'].sum())} loss tokens, "
                                          f"manifest says {rec['num_loss_tokens']}")


def check_draft_vocab(path, vocab: DraftVocab) -> None:
    """A compact dataset's teacher is over the draft vocab it was captured with: a training run with
    another one is refused, naming both. Full datasets take any draft vocab."""
    ds = FeatureDataset(path)
    have = ds.draft_vocab()
    if have is None or torch.equal(have.d2t.cpu(), vocab.d2t.cpu()):
        return
    raise FeatureDatasetError(
        f"this run's draft vocab ({vocab.size} tokens, sha256 {codec.vocab_sha256(vocab)[:12]}) differs from the "
        f"one {ds.path / VOCAB} was captured with ({have.size} tokens, sha256 {codec.vocab_sha256(have)[:12]}): a "
        f"compact dataset's teacher is over its draft vocab. Train with drafter.draft_vocab_size={have.size} and "
        f"the capture's data.heldout_fraction={ds.manifest['data'].get('heldout_fraction')}, or recapture")


def check_storage(ds: FeatureDataset, dtype: str, aux_dtype: str = "", compact: Optional[Compact] = None) -> None:
    """A finished dataset kept for a capture must be stored as that capture asks."""
    if ds.compact or compact is not None:
        have = ds.format if ds.compact else {"name": "full"}
        want = compact.params() if compact is not None else {"name": "full"}
        bad = [f"{k} is {h!r}, this capture asks for {w!r}" for k, h, w in _diffs(have, want)]
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
