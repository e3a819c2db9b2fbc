"""Where a training run's samples come from, as one interface (`Data`): a feature dataset on disk
(offline), the target in this process (online), or shards a producer captures as training goes
(stream, docs/streaming.md); and the order of the global batches over them."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eagle3 import chat, checkpoint
from eagle3.batch import Batch, collate
from eagle3.data import is_heldout, load_samples, mix_sources
from eagle3.features import FeatureDataset, check_compatible, template_sha256
from eagle3.stream import STREAM_PARENT_ENV, Schedule, StreamError, open_stream, plan_stream
from eagle3.stream_reader import StreamReader


def batch_indices(step: int, n: int, batch_size: int, seed: int,
                  lengths: torch.Tensor | None = None, groups: int = 0) -> list[int]:
    """The global batch of `step`: epoch e is a seeded permutation of the n samples, cut into n // B
    batches (the remainder is dropped), so the data position is a function of the step.

    With `lengths` [n] and groups > 1, each run of `groups` batches of the permutation is sorted by
    length before it is cut, and the epoch's batches are then shuffled: every batch holds samples
    of similar length, so far less of it is padding, while each epoch still sees every sample once,
    in an order that is still random from batch to batch."""
    per_epoch = n // batch_size
    epoch, k = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=gen)
    if lengths is not None and groups > 1:
        perm = torch.cat([run[torch.argsort(lengths[run], stable=True)]
                          for run in perm[:per_epoch * batch_size].split(groups * batch_size)])
        perm = perm.view(per_epoch, batch_size)[torch.randperm(per_epoch, generator=gen)].flatten()
    return perm[k * batch_size:(k + 1) * batch_size].tolist()


@dataclass
class Data:
    """The training samples, offline, online or streamed, as indices into one sample space and functions of them."""
    train: list[int]
    held: list[int]
    tokens_of: Callable[[int], tuple]           # i -> (input_ids, loss_mask), for the draft vocabulary
    length_of: Callable[[int], int]             # i -> tokens, for batches of similar length
    make_batch: Callable[[list[int]], Batch]
    desc: str
    batch_of: Callable[[int], list[int]] | None = None   # step -> its global batch, when the source fixes the order
    close: Callable[[], None] = lambda: None
    # make_batch is host work only, safe on another thread: train.py builds the next step's batches
    # while the GPU runs this one (eagle3.batch.Prefetch). Not online (the target runs on the GPU)
    # nor stream (reading a batch is the trainer's acknowledgement to the producer)
    prefetch: bool = False


def batch_order(c, data: Data, total: int) -> Callable[[int], list[int]]:
    """step -> the sample indices of its global batch: the source's own order (stream); with
    train.order=shards the stream's order over the train samples (eagle3/stream.py), so an offline run
    trains on the batches a stream run of the same samples does; else a seeded permutation per epoch."""
    if c.train.order not in ("random", "shards"):
        sys.exit(f"error: train.order={c.train.order!r}: expected random or shards")
    if c.train.length_groups > 1 and (data.batch_of is not None or c.train.order == "shards"):
        sys.exit("error: train.length_groups groups a random order; the shard order (train.order=shards, "
                 "train.mode=stream) keeps each shard's samples together instead: set train.length_groups=0")
    if data.batch_of is not None:
        return data.batch_of
    if c.train.order == "shards":
        sched = Schedule([data.length_of(i) for i in data.train], c.capture.shard_tokens, c.train.batch_size, total)
        return lambda step: [data.train[i] for i in sched.batch(step, c.train.seed)]
    lengths = torch.tensor([data.length_of(i) for i in data.train]) if c.train.length_groups > 1 else None
    return lambda step: [data.train[i] for i in batch_indices(step, len(data.train), c.train.batch_size,
                                                              c.train.seed, lengths, c.train.length_groups)]


def offline_data(c, target, pin: bool = False) -> Data:
    """The feature dataset at data.features_dir, checked against the target, aux layers and chat
    template. pin: batches in pinned host memory (for a GPU)."""
    features_dir = Path(c.data.features_dir)
    ds = FeatureDataset(features_dir)
    check_compatible(ds.manifest, feature_expectations(target, chat.load_tokenizer(target.dir, c.target)),
                     where=str(features_dir))
    # the split is a function of the conversation id (eagle3.data.is_heldout), so it holds for any
    # dataset of the same conversations, whatever fraction the capture was run with
    ids = [ds.sample_id(i) for i in range(len(ds))]
    names = [s.name for s in mix_sources(c.data.mix, c.data.source, c.data.path)]
    held = [is_heldout(sid, c.data.heldout_fraction, names) for sid in ids]
    train_idx = [i for i, h in enumerate(held) if not h]
    held_idx = [i for i, h in enumerate(held) if h]
    return Data(train_idx, held_idx, lambda i: (ds[i]["input_ids"], ds[i]["loss_mask"]), ds.length,
                lambda idx: collate([ds[i] for i in idx], [ids[i] for i in idx], pin=pin),
                f"features {features_dir} ({len(train_idx)} train / {len(held_idx)} held-out samples)", prefetch=True)


def online_data(c, target, device, dtype) -> Data:
    """The target itself, in this process: features are computed per batch and nothing touches disk."""
    from eagle3.online import OnlineSource

    src = OnlineSource(target.dir, c.target, c.data, c.capture, target.aux_layers, device, dtype)
    n_train = len(src.train)
    return Data(list(range(n_train)), list(range(n_train, len(src.samples))), src.tokens,
                lambda i: len(src.samples[i].input_ids), src.batch,
                f"online target {target.dir} ({n_train} train / {len(src.samples) - n_train} held-out)")


def stream_data(c, target, is_main: bool) -> Data:
    """Shards as a producer captures them into data.stream_dir, deleted once used, within
    data.disk_budget_gb (docs/streaming.md). Train samples are indexed by epoch and position (the
    epoch says which shard file holds them), held-out ones are negative."""
    tok, train, held = load_samples(target.dir, c.target, c.data, c.capture)
    try:
        st = plan_stream(train, held, c.data, c.capture, c.train, len(target.aux_layers), target.info.hidden_size,
                         target.info.vocab_size)
        if is_main:
            open_stream(st.root, st.identity)
    except StreamError as e:
        sys.exit(f"error: {e}")
    reader = StreamReader(st.root, st.sched, c.train.seed, [s.id for s in train], feature_expectations(target, tok),
                          is_main)
    producer = None
    if is_main:
        latest = checkpoint.latest(Path(c.run_dir)) if c.resume else None
        reader.start(checkpoint.step_of(latest) if latest else 0)    # before a producer can read a stale `done`
        producer = start_producer(c, st.root)
    if producer is not None:
        reader.producer_alive = lambda: None if producer.poll() is None else \
            f"the stream producer exited with code {producer.returncode} (its output is above)"

    def close():
        reader.close()
        if producer is not None:
            producer.wait()

    n = len(train)
    return Data(list(range(n)), [-1 - h for h in range(len(st.heldout))],
                lambda i: (torch.tensor(train[i].input_ids), torch.tensor(train[i].loss_mask)),
                lambda i: len(train[i].input_ids), reader.make_batch,
                f"stream {st.root} ({n} train / {len(st.heldout)} held-out samples, {st.sched.num_shards} shards "
                f"an epoch, budget {st.budget / 1e9:g} GB{', shards reused' if c.data.stream_reuse else ''})",
                batch_of=reader.batch_of, close=close)


def start_producer(c, root: Path) -> subprocess.Popen | None:
    """The stream's producer, `python -m capture` with this run's overrides, as a subprocess when the
    capture runs in-process (it stops when this process is gone); otherwise None, and the command to
    start it on its own."""
    overrides = [a for a in sys.argv[1:] if not a.startswith("resume")]
    if not captures_in_process(c):
        print(f"[stream] the producer runs on its own; start it where {root} is reachable:\n"
              f"    python -m capture {' '.join(overrides)}", flush=True)
        return None
    return subprocess.Popen([sys.executable, "-m", "capture", *overrides], cwd=Path(__file__).resolve().parents[1],
                            env=dict(os.environ, **{STREAM_PARENT_ENV: str(os.getpid())}))


def feature_expectations(target, tok) -> dict:
    """What a feature dataset's manifest must say to be this target's, for these aux layers and chat template."""
    return {"target": {"fingerprint": target.info.fingerprint}, "aux_layers": target.aux_layers,
            "hidden_size": target.info.hidden_size,
            "tokenizer": {"chat_template_sha256": template_sha256(tok.chat_template)}}


def captures_in_process(c) -> bool:
    """A missing feature dataset is captured first when capture.implicit allows it and the backend runs
    in this process (hf); otherwise the run stops with the capture command."""
    return c.capture.implicit and c.capture.backend == "hf"
