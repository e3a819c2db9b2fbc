"""Training in stages (train.stages, eagle3/config.py plan_stages): one command is, tensor for tensor, the
separate runs it replaces; resume skips finished stages; every stage is checked before any starts."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eagle3 import config as schema
from eagle3.export import load_export

ROOT = Path(__file__).resolve().parents[1]
schema.register()
SECOND = "{optim: {lr: 5.0e-4}, train: {seed: 1, steps: 12}}"
FAST = ["+experiment=tiny", "train.log_every=4", "train.eval_every=10"]


def run(module_or_script, *overrides, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    cmd = [sys.executable, *(["-m", module_or_script] if module_or_script == "capture" else [module_or_script])]
    p = subprocess.run([*cmd, *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if check and p.returncode != 0:
        raise AssertionError(f"{module_or_script} {' '.join(overrides)} failed ({p.returncode}):\n"
                             f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def tensors(run_dir: Path) -> dict:
    return load_export(run_dir / "export" / "vllm")[0]


def rows(run_dir: Path) -> list:
    """metrics.jsonl without the wall-clock fields."""
    return [{k: v for k, v in json.loads(line).items() if k not in ("tok_s", "eta_s")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_drafter(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta), [k for k in ta if not torch.equal(ta[k], tb[k])]


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    return f"data.features_dir={tmp_path_factory.mktemp('features')}/tiny"


def test_one_command_is_the_two_runs_it_replaces(tmp_path, features):
    """Stage 2 trains from stage 1's export with the fragment's keys changed: the same tensors and
    metrics as a second command with drafter.init_from and those keys, bit for bit (fp32, CPU)."""
    staged = tmp_path / "staged"
    run("train.py", *FAST, features, f"run_dir={staged}", f"train.stages=[{SECOND}]")
    run("train.py", *FAST, features, f"run_dir={tmp_path}/first")
    run("train.py", *FAST, features, f"run_dir={tmp_path}/second", f"drafter.init_from={tmp_path}/first/export/vllm",
        "optim.lr=5e-4", "train.seed=1", "train.steps=12")
    assert_same_drafter(staged / "stage1", tmp_path / "first")
    assert_same_drafter(staged, tmp_path / "second")
    assert rows(staged / "stage1") == rows(tmp_path / "first")
    assert rows(staged) == rows(tmp_path / "second")
    assert not torch.equal(tensors(staged)["fc.weight"], tensors(staged / "stage1")["fc.weight"])   # it trained on
    recorded = OmegaConf.load(staged / "config.yaml")
    assert (recorded.drafter.init_from, recorded.optim.lr, recorded.train.steps, recorded.train.stages) == (
        str(staged / "stage1"), 5e-4, 12, [])
    assert json.loads((staged / "done.json").read_text())["steps"] == 12
    assert json.loads((staged / "stage1" / "done.json").read_text())["steps"] == 20


def test_resume_skips_finished_stages_and_goes_on_from_the_checkpoint(tmp_path, features):
    staged, args = tmp_path / "staged", [*FAST, features, f"train.stages=[{SECOND}]"]
    run("train.py", *args, f"run_dir={staged}")
    whole = tmp_path / "whole"
    shutil.copytree(staged / "export", whole / "export")
    # cut stage 2 short after its step-10 checkpoint, as a kill between checkpoints would
    for gone in ("done.json", "export", "checkpoints/step_0000012"):
        shutil.rmtree(staged / gone) if (staged / gone).is_dir() else (staged / gone).unlink()
    (staged / "checkpoints" / "latest").write_text("step_0000010\n")
    stage1 = (staged / "stage1" / "metrics.jsonl").read_text()
    p = run("train.py", *args, f"run_dir={staged}", "resume=true")
    assert "[train] stage 1 of 2 finished earlier" in p.stdout
    assert f"resumed from {staged}/checkpoints/step_0000010 at step 10" in p.stdout
    assert (staged / "stage1" / "metrics.jsonl").read_text() == stage1   # not run again
    assert_same_drafter(staged, whole)

    # a finished stage recorded with other settings is not skipped silently
    p = run("train.py", *args, f"run_dir={staged}", "resume=true", "train.steps=21", check=False)
    assert p.returncode != 0
    assert "stage 1 of 2 in" in p.stderr and "finished with other settings (train.steps: 20 there, 21 now)" in p.stderr

    # a fresh run moves the whole earlier one aside, its first stage with it
    from train import set_aside_previous_run
    shutil.rmtree(staged / "checkpoints")
    (staged / "metrics.jsonl").unlink()
    set_aside_previous_run(staged)
    assert not staged.exists() and len([d for d in tmp_path.iterdir() if d.name.startswith("staged.")]) == 1


def test_capture_prepares_every_stages_data(tmp_path):
    """A stage that changes the data gets its own feature dataset from the one capture command."""
    run("capture", "+experiment=tiny", "data.num_samples=8", f"data.features_dir={tmp_path}/n8",
        f"train.stages=[{{data: {{num_samples: 12, features_dir: {tmp_path}/n12}}}}, {{train: {{steps: 3}}}}]")
    for n in (8, 12):
        assert json.loads((tmp_path / f"n{n}" / "manifest.json").read_text())["totals"]["num_samples"] == n


def _plan(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return schema.plan_stages(compose(config_name="train", overrides=["+experiment=tiny", "run_dir=runs/x", *overrides]))


def test_plan_applies_each_fragment_on_top_of_the_stage_before():
    plan = _plan("train.stages=[{optim: {lr: 5.0e-4}}, {train: {steps: 7}}, {data: {num_samples: 32}}]")
    assert [(s.index, s.count, str(s.run_dir)) for s in plan] == [
        (1, 4, "runs/x/stage1"), (2, 4, "runs/x/stage2"), (3, 4, "runs/x/stage3"), (4, 4, "runs/x")]
    got = [(s.cfg.optim.lr, s.cfg.train.steps, s.cfg.data.num_samples, s.cfg.drafter.init_from) for s in plan]
    assert got == [(1e-3, 20, 64, ""), (5e-4, 20, 64, "runs/x/stage1"), (5e-4, 7, 64, "runs/x/stage2"),
                   (5e-4, 7, 32, "runs/x/stage3")]
    assert all(s.cfg.train.stages == [] and s.cfg.run_dir == str(s.run_dir) for s in plan)
    assert "-n32-" in plan[3].cfg.data.features_dir and "-n64-" in plan[2].cfg.data.features_dir   # interpolations live
    single = _plan()
    assert len(single) == 1 and str(single[0].run_dir) == "runs/x" and single[0].count == 1


@pytest.mark.parametrize("fragment, message", [
    ("{run_dir: elsewhere}", "train.stages[0] sets run_dir: the stages set these themselves"),
    ("{drafter: {init_from: a}}", "train.stages[0] sets drafter.init_from"),
    ("{dist: {zero_stage: 3}}", "train.stages[0] sets dist.zero_stage"),
    ("{train: {stages: []}}", "train.stages[0] sets train.stages"),
    ("{optim: {lrr: 1}}", "train.stages[0]: Key 'lrr' not in 'OptimConfig'"),
    ("{train: {steps: many}}", "train.stages[0]: Value 'many' of type 'str' could not be converted to Integer"),
    ("{train: {mode: stream}}", "stage 2 of 2 trains with train.mode=stream"),
])
def test_plan_refuses_a_bad_stage_before_any_starts(fragment, message):
    with pytest.raises(ValueError) as e:
        _plan(f"train.stages=[{fragment}]")
    assert message in str(e.value)


def test_train_refuses_a_bad_last_stage_at_start(tmp_path):
    p = run("train.py", "+experiment=tiny", f"run_dir={tmp_path}/r", "train.stages=[{train: {eval_every: 0}}]",
            check=False)
    assert p.returncode != 0 and "stage 2 of 2: train.eval_every=0: a number of steps" in p.stderr
    assert [d.name for d in (tmp_path / "r").iterdir()] == ["hydra"]   # Hydra's log only: nothing trained


def test_an_earlier_stage_is_named_after_its_run_in_evaluations():
    from evaluate import drafter_name
    assert [drafter_name(p) for p in ("runs/best", "runs/best/export/vllm", "runs/best/stage1",
                                      "runs/best/stage1/export/sglang", "keep/best/vllm")] == \
        ["best", "best", "best_stage1", "best_stage1", "best"]
