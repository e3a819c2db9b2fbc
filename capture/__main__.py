"""Capture target hidden states into a feature dataset, or regenerate the conversations first.

    python -m capture                                   # embedded default (SmolLM2, in-process hf backend)
    python -m capture +experiment=tiny
    python -m capture +experiment=kimi_k25 capture.server_url=http://HOST:30000   # SGLang capture server
    python -m capture +experiment=smollm2_peer capture.regenerate_only=true       # the target's answers only
    python -m capture +experiment=NAME train.mode=stream data.disk_budget_gb=500  # producer of a streaming run

Two steps: with capture.regenerate_only the target answers the conversations (JSONL, for capture
and online training to read); otherwise the features are captured. An experiment with
capture.regenerate=true needs the first before the second. Rerunning the same command after an
interruption resumes where it stopped. A run trained in stages (train.stages) gets the data of
every stage, each distinct set once.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra

from eagle3 import config as config_schema
from eagle3 import chat
from eagle3.targets import prepare_target

config_schema.register()


@hydra.main(config_path="../conf", config_name="capture", version_base=None)
def main(cfg) -> None:
    try:
        plan = [s.c for s in config_schema.plan_stages(cfg)]
    except ValueError as e:
        sys.exit(f"error: {e}")
    seen = []
    for c in plan:   # the stages' data, each distinct set once
        key = (c.target, c.aux_layers, c.data, c.capture)
        if key not in seen:
            seen.append(key)
            capture_one(c)


def capture_one(c) -> None:
    t = c.target
    target = prepare_target(t.source, t.path, t.name, t.arch, t.random_config, t.seed, c.aux_layers)
    if c.capture.regenerate_only:
        from capture.regenerate import regenerate

        paths = regenerate(target.dir, t, c.data, c.capture, chat.load_tokenizer(target.dir, t), target.info)
        print("[capture] regenerated conversations: " + "  ".join(str(p) for p in paths))
        return
    if c.train.mode == "stream":   # the producer of a streaming run (docs/streaming.md)
        from capture.run import stream_features

        out = stream_features(target.dir, target.aux_layers, t, c.data, c.capture, c.train)
        print(f"[stream] producer done: {out}")
        return
    from capture.run import capture_features

    out = capture_features(target.dir, target.aux_layers, t, c.data, c.capture, Path(c.data.features_dir))
    print(f"[capture] feature dataset: {out}")


if __name__ == "__main__":
    main()
