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
size and can be viewed straight out of the memory map. Shards are laid out up front from the
ordered sample list (plan_shards); eagle3/feature_writer.py writes them. Each shard's sha256, taken
at commit, is in the manifest; the reader checks it the first time a process reads a sample of the
shard, so a flipped bit is refused by name.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from eagle3 import codec
from eagle3.config import field_diffs
from eagle3.shards import (FLOAT_DTYPES, FORMAT_VERSION, FeatureDatasetError, check_sha256, check_shard,
                           dequantize_fp8, tensor_views)
from eagle3.vocab import DraftVocab

AUX_MEANING = ("residual stream entering decoder layer i = transformers output_hidden_states[i] "
               "(hidden_states + residual in engines that keep the residual separate)")
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


def check_compatible(manifest: Dict[str, Any], expected: Dict[str, Any], where: str = "") -> None:
    """Raise FeatureDatasetError naming every (nested) key of `expected` the manifest disagrees with.

    expected e.g. {"target": {"name": "smollm2"}, "aux_layers": [2, 15, 27], "hidden_size": 576}.
    """
    bad = [f"{k} is {h!r}, expected {w!r}" for k, h, w in field_diffs(manifest, expected)]
    if bad:
        raise FeatureDatasetError(f"feature dataset {where or ''} does not match: " + "; ".join(bad))


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
