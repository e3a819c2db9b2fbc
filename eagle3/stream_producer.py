"""The producer's side of a stream (eagle3/stream.py has the order and the protocol): one process per
stream directory captures the units the trainer needs next, within the disk budget, evicting the
units needed latest when the budget is full."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from eagle3.stream import (HELDOUT, LOCK, POLL, PRODUCER, TRAINER, Every, Schedule, StreamError, delete_unit,
                           dir_bytes, listing, mb, read_json, write_json)


class ProducerLock:
    """One producer per stream directory: an flock held for the producer's life (the kernel drops it
    when the process dies, SIGKILL included). On NFS it is a POSIX lock; Lustre needs `-o flock`."""

    def __init__(self, root: Path):
        self.fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        say = Every()
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if say():
                print(f"[stream] producer waits: another producer holds {root / LOCK}", flush=True)
            time.sleep(POLL)

    def release(self) -> None:
        os.close(self.fd)


def produce(root: Path, sched: Schedule, train_samples: Sequence[Any], held_samples: Sequence[Any],
            capture: Callable[[Sequence[Any], Path], Path], reserve: Sequence[int], heldout_reserve: int,
            budget: int, orphaned: Callable[[], bool] = lambda: False, launched: bool = False) -> None:
    """Capture units into `root` as the trainer needs them, never holding more than `budget` bytes;
    returns when the trainer says it is done (or `orphaned()`: the launching trainer is gone).
    capture(samples, out_dir) writes a finished one-shard feature dataset.
    launched: started by the trainer it serves, which published `done: false` before starting it, so
    any `done` read here is that trainer's own (one resumed at its last step is done at once)."""
    root = Path(root)
    lock = ProducerLock(root)
    say_full, say_idle, made, t0, tokens = Every(), Every(), 0, time.monotonic(), 0
    # a `done` already there is the previous trainer's: wait for a new one rather than stop
    stale = not launched and (read_json(root / TRAINER) or {}).get("done", False)
    try:
        for name in listing(root)[1]:                 # a killed producer's partial unit and trash
            shutil.rmtree(root / name, ignore_errors=True)
        if held_samples and not (root / HELDOUT / "manifest.json").exists():
            wait_for_room(root, heldout_reserve, budget, HELDOUT, say_full, orphaned)
            capture(held_samples, root / HELDOUT)
        while not orphaned():
            units, leftovers = listing(root)          # list first, then read `next` (see the module doc)
            state = read_json(root / TRAINER) or {"next": 0, "done": False}
            stale = stale and state["done"]
            if state["done"] and not stale:
                break
            if stale:
                if say_idle():
                    print(f"[stream] producer: the trainer of {root} is done; waiting for a new one", flush=True)
                time.sleep(POLL)
                continue
            first = state["next"]
            for name in leftovers:
                shutil.rmtree(root / name, ignore_errors=True)
            present = set(units)
            for name in units:
                if sched.next_use(name, first) is None:
                    delete_unit(root, name)
                    present.discard(name)
            g = next((g for g in range(first, sched.end) if sched.used(g) and sched.name(g) not in present), None)
            if g is None:
                if say_idle():
                    print(f"[stream] producer: every unit up to the run's end is written; waiting for the "
                          f"trainer (step {state.get('step', 0)})", flush=True)
                time.sleep(POLL)
                continue
            s, name = g % sched.num_shards, sched.name(g)
            used = dir_bytes(root)
            if used + reserve[s] > budget:
                later = sorted(((sched.next_use(n, first), n) for n in present), reverse=True)
                for use, victim in later:
                    if use is None or use > g:
                        delete_unit(root, victim)
                        used = dir_bytes(root)
                        if used + reserve[s] <= budget:
                            break
            if used + reserve[s] > budget:
                if say_full():
                    print(f"[stream] producer: {name} ({mb(reserve[s])}) would pass the budget ({mb(used)} of "
                          f"{mb(budget)} used); waiting for the trainer (step {state.get('step', 0)}, "
                          f"{state.get('tok_s', 0):,.0f} tok/s)", flush=True)
                time.sleep(POLL)
                continue
            capture([train_samples[i] for i in sched.plan[s]], root / name)
            got = dir_bytes(root / name)
            if got > reserve[s]:
                raise StreamError(f"{name} takes {got:,} bytes, more than the {reserve[s]:,} reserved for it: "
                                  f"eagle3.stream.unit_reserve no longer matches the feature format")
            made += 1
            tokens += sum(sched.lengths[i] for i in sched.plan[s])
            write_json(root / PRODUCER, {"last": name, "units": made,
                                         "tok_s": tokens / max(time.monotonic() - t0, 1e-9)})
    finally:
        lock.release()


def wait_for_room(root: Path, need: int, budget: int, what: str, say: Every, orphaned) -> None:
    while dir_bytes(root) + need > budget and not orphaned():
        if say():
            print(f"[stream] producer: {what} ({mb(need)}) would pass the budget; waiting", flush=True)
        time.sleep(POLL)
