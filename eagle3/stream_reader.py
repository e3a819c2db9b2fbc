"""The trainer's side of a stream (eagle3/stream.py has the order and the protocol): batches in the
schedule's order, read from units as the producer writes them; what every later step no longer
needs is acknowledged in trainer.json and deleted."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from eagle3.batch import collate
from eagle3.features import FeatureDataset, FeatureDatasetError
from eagle3.stream import (HELDOUT, POLL, PRODUCER, TRAINER, Every, Schedule, StreamError, delete_dead,
                           read_json, write_json)


class StreamReader:
    """The trainer's side: batches as the schedule orders them, read from units as they appear.

    Train samples are indexed p*n + i (sample position i in epoch p, so the unit is known), held-out
    ones -1 - h. Only the main process publishes trainer.json and deletes."""

    def __init__(self, root: Path, sched: Schedule, seed: int, sample_ids: Sequence[str], expected: dict,
                 is_main: bool, producer_alive: Callable[[], Optional[str]] = lambda: None):
        self.root, self.sched, self.seed, self.ids = Path(root), sched, seed, list(sample_ids)
        self.expected, self.is_main, self.producer_alive = expected, is_main, producer_alive
        self.units: Dict[str, FeatureDataset] = {}
        self.first, self.step, self.tokens, self.t0 = 0, 0, 0, time.monotonic()
        self.say = Every()

    def start(self, step: int) -> None:
        """Publish where this run starts (a resumed run may start before units already deleted)."""
        self.first, self.step = self.sched.span(step)[0], step
        self.publish(done=False)

    def batch_of(self, step: int) -> List[int]:
        """Step's global batch; everything earlier steps alone read is acknowledged (and deleted)."""
        first, last = self.sched.span(step)
        self.first, self.step = first, step
        # keep only this step's units mapped: a unit the producer evicts (or recaptures) must not
        # stay on disk as a deleted file held open here
        span = {self.sched.name(g) for g in range(first, last + 1)} | {HELDOUT}
        for name in [n for n in self.units if n not in span]:
            del self.units[name]
        if self.is_main:
            self.publish(done=False)
            delete_dead(self.root, self.sched, self.first)
        p = step // self.sched.per_epoch
        return [p * self.sched.n + i for i in self.sched.batch(step, self.seed)]

    def publish(self, done: bool) -> None:
        rate = self.tokens / max(time.monotonic() - self.t0, 1e-9)
        write_json(self.root / TRAINER, {"next": self.sched.end if done else self.first, "done": done,
                                         "step": self.step, "tok_s": rate})

    def make_batch(self, indices: Sequence[int]):
        names = [HELDOUT if i < 0 else self.sched.name((i // self.sched.n) * self.sched.num_shards
                                                        + self.sched.shard_of(i % self.sched.n)) for i in indices]
        for name in dict.fromkeys(names):
            self.unit(name)
        items, ids = [], []
        for i, name in zip(indices, names):
            ds = self.unit(name)
            j = -1 - i if i < 0 else i % self.sched.n - self.sched.starts[self.sched.shard_of(i % self.sched.n)]
            items.append(ds[j])
            ids.append(ds.sample_id(j))
            if i >= 0 and ids[-1] != self.ids[i % self.sched.n]:
                raise StreamError(f"{self.root / name} holds {ids[-1]!r} where the schedule has "
                                  f"{self.ids[i % self.sched.n]!r}: not this run's stream")
        self.tokens += sum(len(it["input_ids"]) for it in items)
        return collate(items, ids)

    def unit(self, name: str) -> FeatureDataset:
        """A unit's dataset, waiting for the producer while it is not there yet."""
        while name not in self.units:
            path = self.root / name
            if (path / "manifest.json").exists():
                try:
                    ds = FeatureDataset(path, expected=self.expected)
                    ds.length(0)                     # maps the shard now: later deletes cannot pull it away
                    self.units[name] = ds
                    break
                except (FileNotFoundError, FeatureDatasetError):
                    if (path / "manifest.json").exists():   # not deleted under us: really broken
                        raise
            dead = self.producer_alive()
            if dead:
                raise StreamError(dead)
            if self.say():
                prod = read_json(self.root / PRODUCER) or {}
                rate = f"{prod['tok_s']:,.0f} tok/s, last wrote {prod.get('last', '-')}" if "tok_s" in prod \
                    else "no unit written yet"
                print(f"[stream] trainer waits for {name} at step {self.step} (producer: {rate})", flush=True)
            time.sleep(POLL)
        return self.units[name]

    def close(self) -> None:
        if self.is_main:
            self.publish(done=True)
            delete_dead(self.root, self.sched, self.sched.end)
