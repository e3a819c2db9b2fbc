"""Gradient accumulation over micro-batches under accelerate. accelerate passes each backward's place
to DeepSpeed as sync_gradients, and DeepSpeed steps its optimizer after every backward it is told
ends an accumulation; so train.py must say so at a step's last micro-batch only, or a step of 8
micro-batches becomes 8 optimizer steps on an eighth of the batch each."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


class RecordingEngine:
    """The DeepSpeed engine calls accelerate makes in a backward, recorded."""

    def __init__(self):
        self.calls = []

    def set_gradient_accumulation_boundary(self, is_boundary):
        self.calls.append(("boundary", is_boundary))

    def backward(self, loss, **kwargs):
        self.calls.append(("backward",))

    def step(self):
        self.calls.append(("step",))


def test_accelerate_steps_deepspeed_only_after_a_backward_that_ends_the_accumulation():
    """The contract train.py relies on, in the installed accelerate: a backward with
    sync_gradients=False accumulates, one with True also steps."""
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    engine = RecordingEngine()
    wrapper = DeepSpeedEngineWrapper(engine)
    wrapper.backward(torch.tensor(1.0), sync_gradients=False)
    wrapper.backward(torch.tensor(1.0), sync_gradients=True)
    assert engine.calls == [("boundary", False), ("backward",), ("boundary", True), ("backward",), ("step",)]


RECORD = """
import json, sys
import accelerate
sys.path.insert(0, {root!r})
from hydra import compose, initialize_config_dir
import train

seen = []
backward = accelerate.Accelerator.backward
def recording(self, loss, **kwargs):
    seen.append(self.sync_gradients)
    return backward(self, loss, **kwargs)
accelerate.Accelerator.backward = recording
with initialize_config_dir(config_dir={conf!r}, version_base=None):
    cfg = compose(config_name="train", overrides={overrides!r})
train.main(cfg)
print("SEEN " + json.dumps(seen))
"""


def test_only_each_steps_last_micro_batch_ends_the_accumulation(tmp_path):
    """The real training loop (tiny target, batch 4 in micro-batches of 2, 3 steps), with
    accelerate's backward recorded: per step [False, True]. It fails if every backward syncs."""
    overrides = ["+experiment=tiny", f"run_dir={tmp_path}/run", f"data.features_dir={tmp_path}/features",
                 "train.steps=3", "train.micro_batch_size=2", "train.log_every=1", "train.save_every=100",
                 "train.eval_every=100"]
    script = RECORD.format(root=str(ROOT), conf=str(ROOT / "conf"), overrides=overrides)
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    seen = json.loads(p.stdout.split("SEEN ", 1)[1])
    assert seen == [False, True] * 3
