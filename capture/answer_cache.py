"""The regenerated-answer files under ~/.cache/eagle3/regen/ (capture/regenerate.py writes them).

`<hash>.jsonl` holds one source's answered conversations, one record a line, in conversation order;
`<hash>.partial.jsonl` while some are not answered yet; `<hash>.key.json` the key the hash is of
(eagle3.data.regeneration_key). This module reads what a file already holds (done_ids), and starts
a new run from the answers of a run that differs only in data.num_samples (reuse_other_sizes).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Sequence, Tuple

from eagle3.durable import write_text


def done_ids(path: Path) -> set:
    """Ids already in the cache file; a torn last line (killed mid-append) is cut off."""
    if not path.exists():
        return set()
    ids, good = set(), 0
    with open(path, "rb") as f:
        for line in f:
            try:
                ids.add(json.loads(line)["id"])
            except (ValueError, KeyError):
                break
            good += len(line)
    if good != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good)
    return ids


def key_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.key.json")


def write_key(path: Path, key: dict) -> None:
    """`<hash>.key.json` beside the answers at `path`: what they were generated with, so that a run
    whose key differs only in data.num_samples can find them (reuse_other_sizes)."""
    kp = key_path(path)
    if not kp.exists():
        kp.parent.mkdir(parents=True, exist_ok=True)
        write_text(kp, json.dumps(key, sort_keys=True, indent=1) + "\n")


def reuse_other_sizes(path: Path, key: dict, convs: Sequence[Tuple[str, list]], partial: Path) -> int:
    """Start `partial` with the answers of an earlier run that differs from this one only in
    data.num_samples (4,096 conversations first, then all of them; or all first, then fewer). Both
    take the first usable conversations of the same source in file order, so the other run's
    records, as far as their ids follow this run's conversations one for one, are this run's
    first conversations answered with the same target, template, lengths and answer budget.
    Returns the number of conversations reused (the most any such file offers)."""
    same = {k: v for k, v in key.items() if k != "num_samples"}
    best: List[str] = []
    best_from = None
    for kp in sorted(path.parent.glob("*.key.json")):
        try:
            other = json.loads(kp.read_text())
        except ValueError:
            continue
        if {k: v for k, v in other.items() if k != "num_samples"} != same or other == key:
            continue
        stem = kp.name[:-len(".key.json")]
        for f in (path.parent / f"{stem}.jsonl", path.parent / f"{stem}.partial.jsonl"):
            lines = leading_records(f, [cid for cid, _ in convs])
            if len(lines) > len(best):
                best, best_from = lines, (f, other["num_samples"])
    if best:
        write_text(partial, "".join(best))
        f, n = best_from
        print(f"[regenerate] {len(best)} conversations reused from {f} (the same settings with "
              f"data.num_samples={n})")
    return len(best)


def leading_records(path: Path, ids: Sequence[str]) -> List[str]:
    """The lines of a cache file, from its start, whose ids are ids[0], ids[1], ... in turn."""
    if not path.exists():
        return []
    lines = []
    with open(path, encoding="utf-8") as f:
        for line, want in zip(f, ids):
            try:
                if json.loads(line)["id"] != want:
                    break
            except (ValueError, KeyError):
                break
            lines.append(line if line.endswith("\n") else line + "\n")
    return lines
