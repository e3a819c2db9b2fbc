"""Streaming training on a fixed disk budget: the capture writes feature shards into a directory while
training reads them, and what training has used is deleted (docs/streaming.md has the layout).

Order: epoch p is the train samples' shard plan (plan_shards at capture.shard_tokens) in plan order,
each shard shuffled by a generator seeded from (seed, p, shard); batch k is epoch positions
[kB, (k+1)B). A function of the samples and settings only, so producer and trainer agree on it on
any machine, and train.order=shards gives an offline run the same batches.

Shard s of epoch p is the logical unit g = p*S + s, on disk a finished one-shard feature dataset
renamed into place. The trainer's acknowledgement is trainer.json's `next`, the first unit it still
needs: units with no use at or after it are dead and deleted, by either side. The producer captures
the first missing unit at or after `next` when it fits the budget, evicting units needed later
than it if need be. A resumed trainer publishes its checkpoint step's `next`, possibly earlier, and
the producer captures again what was deleted: no side keeps a position beyond that checkpoint.

This module holds what both sides share: the order, the budget's arithmetic and the directory's
files. The trainer's side is eagle3/stream_reader.py, the producer's eagle3/stream_producer.py.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from eagle3 import codec
from eagle3.config import CaptureConfig, DataConfig, TrainConfig
from eagle3.durable import write_text
from eagle3.features import plan_shards
from eagle3.shards import AUX_DTYPES, FLOAT_DTYPES, header_bytes, layout

GB = 10 ** 9                       # data.disk_budget_gb counts decimal gigabytes
POLL = 0.05                        # seconds between looks at the directory while waiting
SAY_EVERY = 30.0                   # seconds between two "waiting" messages of one kind
HELDOUT = "heldout"
# set by a trainer on the producer it launches: the producer stops when that trainer is gone
STREAM_PARENT_ENV = "EAGLE3_STREAM_PARENT"
STREAM, TRAINER, PRODUCER, LOCK = "stream.json", "trainer.json", "producer.json", "producer.lock"


class StreamError(Exception):
    """A stream directory or budget that cannot work, with what to change."""


def total_steps(steps: int, epochs: float, num_train: int, batch_size: int) -> int:
    """train.steps, or epochs x full batches per epoch."""
    return steps or max(1, int(epochs * (num_train // batch_size)))


class Schedule:
    """Which samples every step trains on and which units hold them; a function of the ordered train
    samples' lengths and the settings only (see the module doc)."""

    def __init__(self, lengths: Sequence[int], shard_tokens: int, batch_size: int, total: int,
                 reuse: bool = False):
        self.lengths, self.batch_size, self.total, self.reuse = [int(n) for n in lengths], batch_size, total, reuse
        self.plan = plan_shards(self.lengths, shard_tokens)
        self.starts = [idx[0] for idx in self.plan]            # epoch position of each shard's first sample
        self.n, self.num_shards = len(self.lengths), len(self.plan)
        self.per_epoch = self.n // batch_size
        if self.per_epoch == 0:
            raise StreamError(f"{self.n} training samples is fewer than train.batch_size={batch_size}")
        self.end = self.span(total - 1)[1] + 1                  # logical units [0, end) hold every step
        self._orders: Dict[tuple, List[int]] = {}

    def shard_of(self, position: int) -> int:
        return bisect.bisect_right(self.starts, position) - 1

    def order(self, seed: int, p: int, s: int) -> List[int]:
        """Shard s's sample positions in epoch p's order."""
        key = (seed, p, s)
        if key not in self._orders:
            if len(self._orders) > 4096:
                self._orders.clear()
            gen = torch.Generator().manual_seed((seed * 1_000_003 + p) * 1_000_003 + s)
            self._orders[key] = [self.plan[s][j] for j in torch.randperm(len(self.plan[s]), generator=gen).tolist()]
        return self._orders[key]

    def batch(self, step: int, seed: int) -> List[int]:
        """The sample positions (into the train samples) of `step`'s global batch."""
        p, k = divmod(step, self.per_epoch)
        out = []
        for q in range(k * self.batch_size, (k + 1) * self.batch_size):
            s = self.shard_of(q)
            out.append(self.order(seed, p, s)[q - self.starts[s]])
        return out

    def span(self, step: int) -> tuple:
        """(first, last) logical unit of `step`'s batch."""
        p, k = divmod(step, self.per_epoch)
        first, last = self.shard_of(k * self.batch_size), self.shard_of((k + 1) * self.batch_size - 1)
        return p * self.num_shards + first, p * self.num_shards + last

    def used(self, g: int) -> bool:
        """Whether a step of the run reads logical unit g (a shard wholly in an epoch's dropped
        remainder, or past the last step, is never read)."""
        p, s = divmod(g, self.num_shards)
        return self.starts[s] < self.per_epoch * self.batch_size and \
            p * self.per_epoch + self.starts[s] // self.batch_size < self.total

    def name(self, g: int) -> str:
        p, s = divmod(g, self.num_shards)
        return f"s{s:06d}" if self.reuse else f"p{p:04d}-s{s:06d}"

    def next_use(self, name: str, first: int) -> Optional[int]:
        """The first logical unit at or after `first` that reads the unit called `name`; None: dead."""
        try:
            if self.reuse:
                s = int(name[1:])
                p = max(0, -(-(first - s) // self.num_shards))
            else:
                p, s = (int(part[1:]) for part in name.split("-"))
        except ValueError:
            return None
        g = p * self.num_shards + s
        if s >= self.num_shards or g < first or g >= self.end or not self.used(g):
            return None
        return g

    def identity(self, sample_ids: Sequence[str], heldout_ids: Sequence[str], storage: Dict[str, Any]) -> dict:
        """What stream.json records: both sides must agree on all of it."""
        digest = hashlib.sha256(json.dumps([list(map(str, sample_ids)), self.lengths]).encode()).hexdigest()
        return {"samples_sha256": digest, "num_samples": self.n, "num_shards": self.num_shards,
                "batch_size": self.batch_size, "total_steps": self.total, "reuse": self.reuse,
                "heldout_sha256": hashlib.sha256(json.dumps(list(map(str, heldout_ids))).encode()).hexdigest(),
                **storage}


# ----------------------------------------------------------------------------- sizes and budget

def shard_bytes(lengths: Sequence[int], num_aux: int, hidden: int, dtype: str, aux_dtype: str = "",
                compact: Optional[Dict[str, Any]] = None) -> int:
    """Bytes of the shard file that holds these samples (eagle3/shards.py's layout); compact: the
    compact format's size_params (eagle3/codec.py), None for the full format."""
    header, body = layout(len(lengths), int(sum(lengths)), num_aux, hidden, FLOAT_DTYPES[dtype][1],
                          AUX_DTYPES[aux_dtype or dtype][1], compact)
    return len(header_bytes(header)) + body


def unit_reserve(lengths: Sequence[int], ids: Sequence[str], meta_bytes: int, num_aux: int, hidden: int,
                 dtype: str, aux_dtype: str = "", compact: Optional[Dict[str, Any]] = None) -> int:
    """The most a unit (or heldout/) holds on disk while it is written: the shard, and progress.json
    and manifest.json side by side at the commit, each with the sample ids and the capture's
    settings; meta_bytes: the JSON of those settings' variable part (they list the held-out ids)."""
    names = len(json.dumps(list(map(str, ids)), indent=1)) + meta_bytes
    return shard_bytes(lengths, num_aux, hidden, dtype, aux_dtype, compact) + 3 * names + 64 * 1024


def check_budget(sched: Schedule, reserve: Sequence[int], heldout_reserve: int, budget: int) -> None:
    """Refuse, with the sizes and the fix, a budget that cannot hold the held-out features and the
    units of the step that spans the most bytes at once (the trainer holds them together)."""
    prefix = [0]
    for r in reserve:
        prefix.append(prefix[-1] + r)
    widest = 0
    for k in range(min(sched.per_epoch, sched.total)):
        a, b = sched.span(k)                          # units of epoch 0: shards a..b
        widest = max(widest, prefix[b + 1] - prefix[a])
    need = heldout_reserve + widest
    if need > budget:
        raise StreamError(
            f"data.disk_budget_gb={budget / GB:g} ({budget:,} bytes) cannot hold what streaming needs at once: "
            f"the held-out features ({heldout_reserve:,} bytes) and the shards one batch spans (up to "
            f"{widest:,} bytes; the largest shard of capture.shard_tokens tokens takes {max(reserve):,}). "
            f"Raise data.disk_budget_gb to at least {need / GB:.4g}, or lower capture.shard_tokens "
            f"(held-out features: train.eval_batches x train.batch_size samples).")


def dir_bytes(root: Path) -> int:
    """Bytes of every file under root (st_size: a shard being written counts whole, it is preallocated)."""
    total = 0
    stack = [str(root)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except FileNotFoundError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    total += e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    return total


@dataclass
class Stream:
    """What both sides derive from the same config: the directory, the schedule, the held-out samples
    evaluation reads, the bytes each unit may take and the budget."""
    root: Path
    sched: Schedule
    heldout: List[Any]
    reserve: List[int]
    heldout_reserve: int
    budget: int
    identity: dict


def plan_stream(train: Sequence[Any], held: Sequence[Any], data: DataConfig, capture: CaptureConfig,
                t: TrainConfig, num_aux: int, hidden: int, vocab_size: int) -> Stream:
    """The stream of a run over `train`/`held` samples (objects with .id, .input_ids), its budget
    checked (StreamError says what to change)."""
    if data.disk_budget_gb <= 0:
        raise StreamError("train.mode=stream needs data.disk_budget_gb: the most the stream directory may hold")
    root = Path(data.stream_dir or f"{data.features_dir}.stream")
    lengths = [len(x.input_ids) for x in train]
    sched = Schedule(lengths, capture.shard_tokens, t.batch_size,
                     total_steps(t.steps, t.epochs, len(train), t.batch_size), data.stream_reuse)
    # evaluation reads the first eval_batches global batches of the held-out samples (train.heldout_eval)
    heldout = list(held[:t.eval_batches * t.batch_size])
    meta_bytes = len(json.dumps([str(x.id) for x in held], indent=1))
    compact = (codec.size_params(vocab_size, capture.draft_vocab_size, capture.teacher_topk)
               if capture.format == codec.NAME else None)
    size = dict(num_aux=num_aux, hidden=hidden, dtype=capture.dtype, aux_dtype=capture.aux_dtype, compact=compact)
    reserve = [unit_reserve([lengths[i] for i in idx], [str(train[i].id) for i in idx], meta_bytes, **size)
               for idx in sched.plan]
    heldout_reserve = unit_reserve([len(x.input_ids) for x in heldout], [str(x.id) for x in heldout], meta_bytes,
                                   **size) if heldout else 0
    budget = int(data.disk_budget_gb * GB)
    check_budget(sched, reserve, heldout_reserve, budget)
    identity = sched.identity([x.id for x in train], [x.id for x in heldout],
                              {"format": capture.format, "dtype": capture.dtype, "aux_dtype": capture.aux_dtype,
                               "num_aux": num_aux, "hidden_size": hidden,
                               **({"teacher": compact["teacher"]} if compact else {})})
    return Stream(root, sched, heldout, reserve, heldout_reserve, budget, identity)


# ----------------------------------------------------------------------------- small files

def write_json(path: Path, obj: Any) -> None:
    """Atomically: a reader on any machine sees the old content or the new."""
    write_text(path, json.dumps(obj, sort_keys=True))


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def open_stream(root: Path, identity: dict) -> None:
    """Create the stream directory, or check that it holds this schedule's stream."""
    root.mkdir(parents=True, exist_ok=True)
    have = read_json(root / STREAM)
    if have is None:
        write_json(root / STREAM, identity)
        return
    diffs = [f"{k}: {have.get(k)!r} there, {v!r} here" for k, v in identity.items() if have.get(k) != v]
    if diffs:
        raise StreamError(f"{root} holds the stream of other settings ({'; '.join(diffs)}). Delete {root} "
                          f"(it holds only features that are captured again) or point data.stream_dir elsewhere.")


def delete_unit(root: Path, name: str) -> None:
    """Rename away, then remove: readers never see half a unit, and two deleters do not collide."""
    trash = root / f".trash-{name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(root / name, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def listing(root: Path) -> tuple:
    """(finished unit names, partial and trash entries) in the stream directory."""
    units, leftovers = [], []
    for e in os.scandir(root):
        if e.name.startswith(".trash-") or e.name.endswith(".partial"):
            leftovers.append(e.name)
        elif e.is_dir() and e.name != HELDOUT and (Path(e.path) / "manifest.json").exists():
            units.append(e.name)
    return units, leftovers


def delete_dead(root: Path, sched: Schedule, first: int) -> None:
    for name in listing(root)[0]:
        if sched.next_use(name, first) is None:
            delete_unit(root, name)


class Every:
    """True at most once every `seconds` (rate-limited messages)."""

    def __init__(self, seconds: float = SAY_EVERY):
        self.seconds, self.last = seconds, -float("inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.last >= self.seconds:
            self.last = now
            return True
        return False


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"
