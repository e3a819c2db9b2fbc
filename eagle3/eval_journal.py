"""What evaluate.py has decoded so far, so a stopped evaluation goes on where it stopped.

`<eval.out_dir>/decoded.jsonl` gets one line per prompt as soon as it is decoded (flushed and
fsynced): {"key": ..., "stats": DecodeStats}. A key names everything the counts depend on: the
backend and its settings, the target's and the drafter export's fingerprints
(eagle3.targets.fingerprint), the chain length, the prompt set and the prompt's own text. A rerun
into the same out_dir reads the lines whose key matches and decodes only the rest; a line of
another drafter, chain or prompt text is never reused, so changing any of them decodes again. A configuration whose prompts are all there starts
no engine. Delete the file (or pick another out_dir) to decode everything anew.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Dict, Optional

from eagle3.evaluation import DecodeStats, Prompt

FILE = "decoded.jsonl"


def prompt_digest(p: Prompt) -> str:
    text = json.dumps({"id": p.id, "messages": p.messages, "followups": list(p.followups)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Journal:
    """decoded.jsonl of one out_dir. `config` is a dict naming one configuration (JSON-able)."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / FILE
        self.done: Dict[str, DecodeStats] = {}
        self.meta: Dict[str, dict] = {}
        self._cut = False                             # the file ends inside a line: start the next on a new one
        if self.path.exists():
            text = self.path.read_text()
            self._cut = bool(text) and not text.endswith("\n")
            for n, line in enumerate(text.splitlines(), 1):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:          # the last line of a killed write
                    print(f"[eval] {self.path}:{n}: unreadable line skipped", file=sys.stderr)
                    continue
                if "stats" in rec:
                    self.done[rec["key"]] = DecodeStats(**rec["stats"])
                else:
                    self.meta[rec["key"]] = rec["meta"]
        self.reused = 0

    @staticmethod
    def key(config: dict, prompt: Optional[Prompt] = None) -> str:
        body = dict(config, prompt=[prompt.id, prompt_digest(prompt)] if prompt is not None else None)
        return json.dumps(body, sort_keys=True)

    def get(self, config: dict, prompt: Prompt) -> Optional[DecodeStats]:
        st = self.done.get(self.key(config, prompt))
        self.reused += st is not None
        return st

    def complete(self, configs: Dict[str, dict], prompt_sets: Dict[str, list]) -> bool:
        """Whether every prompt of every set is held, set name -> its config in `configs`."""
        return all(self.key(configs[name], p) in self.done for name, ps in prompt_sets.items() for p in ps)

    def add(self, config: dict, prompt: Prompt, st: DecodeStats) -> None:
        k = self.key(config, prompt)
        self.done[k] = st
        self._write({"key": k, "stats": dataclasses.asdict(st)})

    def set_meta(self, config: dict, meta: dict) -> None:
        k = self.key(config)
        self.meta[k] = meta
        self._write({"key": k, "meta": meta})

    def get_meta(self, config: dict) -> Optional[dict]:
        return self.meta.get(self.key(config))

    def _write(self, rec: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n" * self._cut + json.dumps(rec) + "\n")
            self._cut = False
            f.flush()
            os.fsync(f.fileno())
