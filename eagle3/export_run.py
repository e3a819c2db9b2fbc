"""A run's engine-ready export, RUN_DIR/export/{sglang,vllm}: at the end of training, and from the latest
checkpoint of a run cut short (stopped, killed, or still running):

    python -m eagle3.export RUN_DIR

The entry point reads RUN_DIR/config.yaml (target, drafter shape, aux layers), RUN_DIR/vocab.safetensors
and the weights of the checkpoint `checkpoints/latest` names, and writes what the end of training
would have written at that step. It trains nothing and leaves metrics and checkpoints alone.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict

import torch
from omegaconf import OmegaConf

from eagle3 import checkpoint
from eagle3.config import Config
from eagle3.export import export_drafter
from eagle3.model import Eagle3Drafter, DrafterShape, drafter_shape
from eagle3.targets import Target, prepare_target
from eagle3.vocab import DraftVocab


def write_export(run_dir: Path, model_state: Dict[str, torch.Tensor], shape: DrafterShape, vocab: DraftVocab,
                 target: Target) -> Dict[str, Path]:
    """model_state: the trained module's weights (`drafter.` + parameter name), as training holds them
    and checkpoints store them."""
    with torch.device("meta"):
        names = Eagle3Drafter(shape)   # only for its engine names: the meta device allocates nothing
    state = names.to_engine_names({k.removeprefix("drafter."): v for k, v in model_state.items()})
    return export_drafter(Path(run_dir) / "export", state, shape, vocab.d2t, vocab.t2d, target.aux_layers,
                          target.info.architectures, target.info.name, target.info.fingerprint)


def run_config(run_dir: Path) -> Config:
    """The typed config a run saved. Only the sections the export reads are taken, so a run saved
    before a key elsewhere was added or removed still exports."""
    saved = OmegaConf.load(Path(run_dir) / "config.yaml")
    needed = {k: saved[k] for k in ("target", "drafter", "aux_layers") if k in saved}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), needed))


def export_checkpoint(run_dir: Path) -> tuple[int, Dict[str, Path]]:
    """Export RUN_DIR's latest checkpoint as it is; returns its step and the directories written."""
    run_dir = Path(run_dir)
    ckpt = checkpoint.latest(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir / 'checkpoints'} holds no checkpoint; pass the run_dir of a run "
                                f"that saved one (every train.save_every steps)")
    for need in ("config.yaml", "vocab.safetensors"):
        if not (run_dir / need).exists():
            raise FileNotFoundError(f"{run_dir / need} is missing; {run_dir} is not a training run's directory")
    c = run_config(run_dir)
    target = prepare_target(c.target.source, c.target.path, c.target.name, c.target.arch, c.target.random_config,
                            c.target.seed, c.aux_layers)
    vocab = DraftVocab.load(run_dir / "vocab.safetensors")
    shape = drafter_shape(target.info, c.drafter, num_aux=len(target.aux_layers), draft_vocab_size=len(vocab.d2t))
    return checkpoint.step_of(ckpt), write_export(run_dir, checkpoint.load_model_state(ckpt), shape, vocab, target)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m eagle3.export",
                                description="Export a run's latest checkpoint to RUN_DIR/export/{sglang,vllm}.",
                                epilog="python -m eagle3.export reshard --help: an export as small shards")
    p.add_argument("run_dir", type=Path,
                   help="the run_dir of a training run (config.yaml, vocab.safetensors, checkpoints/)")
    args = p.parse_args(argv)
    try:
        step, written = export_checkpoint(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"[export] {args.run_dir} at step {step}: {written['sglang']}  {written['vllm']}")
