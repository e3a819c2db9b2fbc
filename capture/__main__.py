"""Capture target hidden states into a feature dataset.

    python -m capture                                   # embedded default (SmolLM2, in-process hf backend)
    python -m capture +experiment=tiny
    python -m capture +experiment=kimi_k25 capture.server_url=http://HOST:30000   # SGLang capture server
    python -m capture +experiment=smollm2_peer capture.regenerate_only=true       # the target's answers only

Rerunning the same command after an interruption resumes where it stopped.
"""
from __future__ import annotations

from pathlib import Path

import hydra

from eagle3 import config as config_schema
from eagle3.engine_ids import check_aux_layers
from eagle3.targets import default_aux_layers, resolve_target, target_info

config_schema.register()


@hydra.main(config_path="../conf", config_name="capture", version_base=None)
def main(cfg) -> None:
    from capture.run import capture_features

    c = config_schema.to_config(cfg)
    target_dir = resolve_target(c.target.source, c.target.path, c.target.name, c.target.arch,
                                dict(c.target.random_config), c.target.seed)
    n = target_info(target_dir).num_layers
    aux_layers = check_aux_layers(list(c.aux_layers) or default_aux_layers(n), n)
    if c.capture.regenerate_only:           # for online training, which reads the answers itself
        from capture.regenerate import regenerated_data
        from eagle3.targets import load_tokenizer

        tok = load_tokenizer(target_dir, c.target.chat_template, c.target.trust_remote_code)
        path = regenerated_data(target_dir, c.target, c.data, c.capture, tok, target_info(target_dir, c.target.name))
        print(f"[capture] regenerated conversations: {path}")
        return
    out = capture_features(target_dir, aux_layers, c.target, c.data, c.capture, Path(c.data.features_dir))
    print(f"[capture] feature dataset: {out}")


if __name__ == "__main__":
    main()
