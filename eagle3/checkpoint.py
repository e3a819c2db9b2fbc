"""Training checkpoints: <run_dir>/checkpoints/step_NNNNNNN/ and a `latest` pointer.

A checkpoint holds what exact resumption needs: model, optimizer and RNG states (accelerate's
save_state, which also handles DeepSpeed's sharded states), the draft vocabulary, and the step. The
data position and the learning rate are functions of the step (train.py), so the step is all the
loop state there is. Written under a temporary name, fsynced and renamed (eagle3/durable.py), so a
killed save or a full disk leaves the previous checkpoint as `latest`.

SIGTERM (what schedulers and `timeout` send before they kill) or Ctrl-C stops training at the end of
the step it is in, with a checkpoint of that step (`StopRequest`): a preempted run loses nothing and
goes on with the same command plus resume=true. A second signal stops at once.
"""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.durable import disk_full, fsync_tree, is_disk_full, tree_bytes, write_text


def save(acc, run_dir: Path, step: int, vocab_path: Path) -> Path:
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step_{step:07d}"
    tmp = ckpt_root / f".tmp_step_{step:07d}"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    try:
        acc.save_state(str(tmp))                 # every rank: DeepSpeed writes its own shards
        acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.copy2(vocab_path, tmp / "vocab.safetensors")
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step}) + "\n")
            if (Path(run_dir) / "config.yaml").exists():
                shutil.copy2(Path(run_dir) / "config.yaml", tmp / "config.yaml")
            fsync_tree(tmp)
    except OSError as e:
        if not is_disk_full(e):
            raise
        prev = latest(run_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"; {prev} is kept as the latest" if prev else ""
        raise disk_full(tmp, tree_bytes(prev) if prev else None, f"checkpoint of step {step}{kept}:") from e
    if acc.is_main_process:
        if final.exists():                       # the same step saved by a run cut short: never leave none
            old = ckpt_root / f".old_{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        write_text(ckpt_root / "latest", final.name + "\n")
    acc.wait_for_everyone()
    return final


class StopRequest:
    """Notes SIGTERM and SIGINT instead of dying of them, so the loop can stop at a step boundary.

    `due(step)` says whether to save and stop after `step`. With several processes every rank must
    stop after the same step, so the ranks agree by a max-reduction of their flags; that costs a wait
    for the GPU, so they compare only every `every` steps (and at once on one process)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, acc, every: int):
        self.acc, self.every, self.signum = acc, max(1, every), 0
        self.previous = {s: signal.signal(s, self._note) for s in self.SIGNALS}

    def _note(self, signum, frame):
        self.signum = signum
        for s, h in self.previous.items():      # a second signal takes its usual course
            signal.signal(s, h)
        if self.acc.is_main_process:
            print(f"[train] {signal.Signals(signum).name}: stopping at the end of this step with a checkpoint "
                  f"(signal again to stop now)", flush=True)

    def due(self, step: int) -> bool:
        if self.acc.num_processes == 1:
            return self.signum != 0
        if step % self.every:
            return False
        flag = torch.tensor([self.signum], device=self.acc.device)
        self.signum = int(self.acc.reduce(flag, reduction="max").item())
        return self.signum != 0

    def close(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum              # the shell's code for a process ended by that signal


def latest(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    old = pointer.parent / f".old_{path.name}"       # save() was killed between its two renames
    if not path.exists() and (old / "trainer_state.json").exists():
        old.rename(path)
    if not (path / "trainer_state.json").exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is incomplete or missing; "
                                f"point it at an earlier checkpoint directory in {pointer.parent}")
    return path


def load_latest(acc, run_dir: Path) -> int:
    """Restore the newest checkpoint into the prepared model/optimizer; returns the step to run next."""
    path = latest(run_dir)
    if path is None:
        if acc.is_main_process:
            print(f"[train] resume=true but {Path(run_dir) / 'checkpoints'} has no checkpoint: starting at step 0")
        return 0
    acc.load_state(str(path))
    step = step_of(path)
    if acc.is_main_process:
        print(f"[train] resumed from {path} at step {step}")
    return step


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model's weights in a checkpoint, read without the training set-up: accelerate's
    model.safetensors (one process or DDP), or DeepSpeed's module states under ZeRO-1/2, where every
    rank holds the whole model. Keys are the trained module's (`drafter.` + parameter name)."""
    path = Path(path)
    if (path / "model.safetensors").exists():
        return load_file(str(path / "model.safetensors"))
    ds = path / "pytorch_model"
    if (ds / "mp_rank_00_model_states.pt").exists():
        # DeepSpeed's file also holds its config and version, which weights_only refuses
        return torch.load(ds / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    if list(ds.glob("zero_pp_rank_*_model_states.pt")):
        raise ValueError(f"{path} is a DeepSpeed ZeRO-3 checkpoint, its weights partitioned over the ranks' "
                         f"files; export it by resuming the run with no step left, under the launcher it trained "
                         f"with: train.py <the run's overrides> resume=true train.steps={step_of(path)}")
    raise FileNotFoundError(f"{path} holds no model weights (model.safetensors or pytorch_model/)")


def step_of(path: Path) -> int:
    return json.loads((Path(path) / "trainer_state.json").read_text())["step"]


def trim_metrics(path: Path, step: int) -> None:
    """Drop metric rows at or after `step` (written by a run that went past its last checkpoint), so a
    resumed run's metrics.jsonl has one row per step and split."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and _step(line) < step]
    write_text(path, "".join(line + "\n" for line in keep))   # a kill here must not lose the rows


def _step(line: str) -> float:
    """A row's step; a line cut short by a kill mid-write counts as past every step (dropped)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError):
        return float("inf")
