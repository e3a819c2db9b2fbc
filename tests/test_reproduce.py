"""scripts/reproduce_smollm2.py on the CPU with tiny sizes (--dry-run): the job graph is whole, the
committed drafter's job runs the recipe docs/results.md states, and a job trains and exports."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from reproduce_smollm2 import build_jobs  # noqa: E402

from eagle3.config import register, to_config  # noqa: E402

register()


def _compose(name, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name=name, overrides=overrides)


def run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    p = subprocess.run([sys.executable, "scripts/reproduce_smollm2.py", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{args} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def answers_file(path: Path) -> Path:
    with open(path, "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"question {i}: " + "tell me about the number %d " % i * 3},
                {"role": "assistant", "content": "the number %d is one more than %d. " % (i, i - 1) * 4}]}) + "\n")
    return path


def test_every_dependency_is_a_job_and_the_committed_recipe_is_the_documented_one(tmp_path):
    answers = answers_file(tmp_path / "answers.jsonl")
    for gpus in (1, 2):
        jobs = {j.name: j for j in build_jobs(tmp_path, False, gpus, answers=answers,
                                              sampled=tmp_path / "sampled.jsonl")}
        assert all(d in jobs for j in jobs.values() for d in j.deps + j.after)
    cmd = jobs["long_norms_ttt4_b32_e12_g32"].cmd()
    for arg in ("+experiment=smollm2_committed", "data.source=jsonl", f"data.path={answers}", "data.num_samples=0",
                "capture.regenerate=false", "train.batch_size=32", "optim.lr=1.5e-3", "train.epochs=12",
                "train.length_groups=32", "train.ttt_steps=4", "drafter.fc_norm=true", "drafter.norm_output=true"):
        assert arg in cmd
    assert {"zero3_2gpu", "kimi_zero3_2gpu"} <= set(jobs)
    # the second stage starts from the committed recipe's run and names it as its dependency
    second = jobs["long_init_v12288_e5"]
    assert second.deps == ["long_norms_ttt4_b32_e12_g32"]
    cmd = second.cmd()
    assert f"drafter.init_from={tmp_path / 'runs' / 'long_norms_ttt4_b32_e12_g32'}" in cmd
    assert {"drafter.draft_vocab_size=12288", "train.epochs=5", "optim.lr=1e-3", f"data.path={answers}",
            "data.num_samples=0"} <= set(cmd)
    third = jobs["long_init_v32768_e3"]
    assert third.deps == ["long_norms_ttt4_b32_e12_g32"]
    cmd = third.cmd()
    assert {f"drafter.init_from={tmp_path / 'runs' / 'long_norms_ttt4_b32_e12_g32'}", "drafter.draft_vocab_size=32768",
            "train.epochs=3", "optim.lr=1e-3", "data.num_samples=12288", "capture.regenerate=false"} <= set(cmd)
    assert sum(a.startswith("data.num_samples=") for a in cmd) == 1
    # the third stage starts from the second and reads every answered conversation
    fourth = jobs["long_init_v32768_e3_all"]
    assert fourth.deps == ["long_init_v32768_e3"]
    cmd = fourth.cmd()
    assert {f"drafter.init_from={tmp_path / 'runs' / 'long_init_v32768_e3'}", "drafter.draft_vocab_size=32768",
            "train.epochs=3", "data.num_samples=0"} <= set(cmd)
    assert sum(a.startswith("data.num_samples=") for a in cmd) == 1
    # the grown stages chain on the third, each from the one before
    grown = jobs["long_init_v32768_l2"]
    assert grown.deps == ["long_init_v32768_e3_all"]
    assert {f"drafter.init_from={tmp_path / 'runs' / 'long_init_v32768_e3_all'}", "drafter.num_layers=2",
            "optim.lr=5e-4"} <= set(grown.cmd())
    last = jobs["long_init_v32768_l2_d06"]
    assert last.deps == ["long_init_v32768_l2"]
    assert {f"drafter.init_from={tmp_path / 'runs' / 'long_init_v32768_l2'}", "drafter.num_layers=2",
            "train.step_decay=0.6"} <= set(last.cmd())
    # the one-stage run: every change at once, straight from the committed recipe's run, by steps
    one = jobs["long_init_v32768_one"]
    assert one.deps == ["long_norms_ttt4_b32_e12_g32"]
    cmd = one.cmd()
    assert {f"drafter.init_from={tmp_path / 'runs' / 'long_norms_ttt4_b32_e12_g32'}", "drafter.draft_vocab_size=32768",
            "drafter.num_layers=2", "train.step_decay=0.6", "train.steps=900", "optim.lr=1e-3",
            "data.num_samples=0"} <= set(cmd)
    loops = jobs["long_init_v32768_one_loops16"].cmd()
    assert [a for a in loops if not a.startswith("run_dir=")] == \
        [a for a in cmd if not a.startswith("run_dir=")] + ["data.loop_tokens=16"]
    again = jobs["long_init_v32768_one_loops16_s2"]
    assert again.deps == ["long_init_v32768_one_loops16"]
    assert [a for a in again.cmd() if not a.startswith(("run_dir=", "drafter.init_from="))] == \
        [a for a in loops if not a.startswith(("run_dir=", "drafter.init_from="))]
    assert f"drafter.init_from={tmp_path / 'runs' / 'long_init_v32768_one_loops16'}" in again.cmd()
    # the tempered teachers and the longer run: the one-stage command with one override each
    for name, extra in [("long_init_v32768_one_t05", ["train.teacher_temperature=0.5"]),
                        ("long_init_v32768_one_t15", ["train.teacher_temperature=1.5"]),
                        ("long_init_v32768_one_t25", ["train.teacher_temperature=2.5"])]:
        assert [a for a in jobs[name].cmd() if not a.startswith("run_dir=")] == \
            [a for a in cmd if not a.startswith("run_dir=")] + extra
    longer = [a for a in jobs["long_init_v32768_one_1500"].cmd() if not a.startswith("run_dir=")]
    assert longer == [a.replace("train.steps=900", "train.steps=1500") for a in cmd if not a.startswith("run_dir=")]
    # the sampled answers: the one stage with data.mix of both answer files in place of data.path
    sampled = jobs["long_init_v32768_one_sampled"]
    mixed = [a for a in sampled.cmd() if not a.startswith("run_dir=")]
    assert sampled.deps == ["long_norms_ttt4_b32_e12_g32", "regen_sampled"]
    assert [a for a in mixed if not a.startswith("data.mix=")] == \
        [a for a in cmd if not a.startswith(("run_dir=", "data.source=", "data.path="))]
    over = next(a for a in mixed if a.startswith("data.mix="))
    c = to_config(_compose("train", ["+experiment=smollm2_committed", over]))
    assert [(e.source, e.path, e.weight) for e in c.data.mix] == \
        [("jsonl", str(answers), 1.0), ("jsonl", str(tmp_path / "sampled.jsonl"), 1.0)]
    regen = jobs["regen_sampled"].cmd
    assert {"capture.regenerate_only=true", "capture.regen_temperature=0.7", "data.num_samples=6144"} <= set(regen)
    # the best drafter: smollm2_scale's own defaults (its mix regenerated by regen_scale, its two
    # stages) from the committed recipe's run, judged against it with its first stage
    best = jobs["scale_best"]
    assert best.deps == ["long_norms_ttt4_b32_e12_g32", "regen_scale"]
    assert [a for a in best.cmd()[2:] if not a.startswith(("run_dir=", "train.wandb="))] == \
        ["+experiment=smollm2_scale", f"drafter.init_from={tmp_path / 'runs' / 'long_norms_ttt4_b32_e12_g32'}"]
    assert "+experiment=smollm2_scale" in jobs["regen_scale"].cmd and "capture.regen_temperature=0.7" not in jobs["regen_scale"].cmd
    judged = next(a for a in jobs["eval_best"].cmd() if a.startswith("eval.drafters="))
    assert judged.endswith("long_norms_ttt4_b32_e12_g32," + ",".join(str(tmp_path / "runs" / n)
                                                                      for n in ("scale_best/stage1", "scale_best")) + "]")
    assert jobs["eval_best"].deps == ["long_norms_ttt4_b32_e12_g32", "scale_best"]
    (tmp_path / "runs" / "scale_best" / "stage1" / "checkpoints" / "latest").parent.mkdir(parents=True)
    (tmp_path / "runs" / "scale_best" / "stage1" / "checkpoints" / "latest").write_text("step_0000100\n")
    assert best.cmd()[-1] == "resume=true"   # stopped in its first stage: the rerun goes on
    # each ablation is abl_base's command plus its own overrides: identical data, batch and steps
    from reproduce_smollm2 import ABLATE
    base = jobs["abl_base"].cmd()
    assert "data.num_samples=4096" in base and "train.epochs=2" in base and "train.batch_size=16" in base
    for name, over in ABLATE.items():
        cmd = jobs[name].cmd()
        assert [a for a in cmd if not a.startswith("run_dir=")] == [a for a in base if not a.startswith("run_dir=")] + over
        ev = jobs[f"eval_{name}"].cmd()
        assert jobs[f"eval_{name}"].deps == [name] and "eval.chains=[3,7]" in ev and "eval.baseline=false" in ev


def test_a_subset_of_ablations_regenerates_only_their_conversations_and_is_judged_alone(tmp_path):
    answers = answers_file(tmp_path / "answers.jsonl")
    jobs = {j.name: j for j in build_jobs(tmp_path, False, 1, answers=answers, regen_conversations=4096,
                                          regen_continuous=True)}
    regen = jobs["regen_all"].cmd
    assert "data.num_samples=4096" in regen and "capture.regen_continuous=true" in regen
    plain = {j.name: j for j in build_jobs(tmp_path, False, 1, answers=answers)}["regen_all"].cmd
    assert not any(a.startswith(("data.num_samples", "capture.regen_continuous")) for a in plain)
    with pytest.raises(RuntimeError, match="has an export"):
        jobs["eval_ablations"].cmd()
    for name in ("abl_base", "abl_mlp4x"):
        (tmp_path / "runs" / name / "export" / "vllm").mkdir(parents=True)
    drafters = [a for a in jobs["eval_ablations"].cmd() if a.startswith("eval.drafters=")]
    assert drafters == [f"eval.drafters=[{tmp_path / 'runs' / 'abl_base'},{tmp_path / 'runs' / 'abl_mlp4x'}]"]


def test_dry_run_trains_and_exports_a_job(tmp_path):
    answers = answers_file(tmp_path / "answers.jsonl")
    work = tmp_path / "work"
    listed = run("--work", str(work), "--dry-run", "--gpus", "0", "--only", "long_b32_e10_g32,eval_long",
                 "--answers", str(answers), "--list")
    assert "long_b32_e10_g32: " in listed and "evaluate.py" in listed
    run("--work", str(work), "--dry-run", "--gpus", "0", "--only", "long_b32_e10_g32", "--answers", str(answers))
    status = json.loads((work / "status.json").read_text())
    assert status["long_b32_e10_g32"]["state"] == "ok"
    assert (work / "runs" / "long_b32_e10_g32" / "export" / "vllm" / "config.json").exists()


def test_dry_run_second_stage_starts_from_the_first_stages_export(tmp_path):
    answers = answers_file(tmp_path / "answers.jsonl")
    work = tmp_path / "work"
    run("--work", str(work), "--dry-run", "--gpus", "0", "--only", "long_norms_ttt4_b32_e12_g32,long_init_v12288_e5",
        "--answers", str(answers))
    status = json.loads((work / "status.json").read_text())
    assert status["long_norms_ttt4_b32_e12_g32"]["state"] == status["long_init_v12288_e5"]["state"] == "ok"
    first, second = work / "runs" / "long_norms_ttt4_b32_e12_g32", work / "runs" / "long_init_v12288_e5"
    assert f"init_from: {first}" in (second / "config.yaml").read_text()
    log = (work / "logs" / "long_init_v12288_e5.log").read_text()
    kept = re.search(rf"drafter from {re.escape(str(first))}\S*: (\d+) lm_head rows kept, (\d+) mapped", log)
    assert kept and int(kept[1]) > 0, log[-2000:]
    assert (second / "export" / "vllm" / "config.json").exists()


def test_dry_run_ablation_trains_and_is_judged_at_both_chains(tmp_path):
    answers = answers_file(tmp_path / "answers.jsonl")
    work = tmp_path / "work"
    run("--work", str(work), "--dry-run", "--gpus", "0", "--only", "abl_lk,eval_abl_lk", "--answers", str(answers),
        "--eval-backend", "hf")
    status = json.loads((work / "status.json").read_text())
    assert status["abl_lk"]["state"] == status["eval_abl_lk"]["state"] == "ok"
    cfg = (work / "runs" / "abl_lk" / "config.yaml").read_text()
    assert "loss: lk" in cfg
    rep = json.loads((work / "runs" / "eval_abl_lk" / "eval" / "report.json").read_text())
    assert sorted(r["num_steps"] for r in rep["results"]) == [3, 7]
    assert all(r["drafter"] == "abl_lk" and r["num_drafts"] > 0 for r in rep["results"])


def test_a_job_out_of_gpu_memory_runs_again_once_with_fewer_beside_it(tmp_path):
    """`oom` fails with torch's message while two others run, is queued again and starts only after
    one of them ended; `hopeless` runs out of memory again on its second start and fails; a job
    that ran out of memory with its GPU to itself is not retried. The neighbours end on events, not
    after fixed sleeps, so a loaded machine cannot reorder them: each waits (at most a minute) until
    status.json shows the failing job queued again, and `long` until `oom` has started again."""
    from reproduce_smollm2 import Job, run as run_jobs

    (tmp_path / "logs").mkdir()
    status = tmp_path / "status.json"
    flag, again = tmp_path / "oom_once", tmp_path / "oom_again"

    def py(code):
        return [sys.executable, "-c", code]

    def until(cond):
        """A job that ends once cond (Python, over `s`: status.json's content, and `pathlib`) holds."""
        return py("import json, pathlib, time\nt = time.time()\n"
                  "def s():\n    try:\n        return json.loads(pathlib.Path(%r).read_text())\n"
                  "    except (OSError, ValueError):\n        return {}\n"
                  "while not (%s) and time.time() - t < 60:\n    time.sleep(0.05)" % (str(status), cond))

    def queued(name):                     # ran once, now waits to run again
        return f"s().get({name!r}, {{}}).get('state') == 'wait' and s()[{name!r}]['start_s'] is not None"

    oom_once = (f"import pathlib, sys; f = pathlib.Path({str(flag)!r})\n"
                "if not f.exists():\n    f.touch(); print('torch.OutOfMemoryError: CUDA out of memory.'); sys.exit(1)\n"
                f"pathlib.Path({str(again)!r}).touch(); print('trained')")
    jobs = [Job("short", until(queued("oom")), gpus=0),
            Job("long", until(f"pathlib.Path({str(again)!r}).exists()"), gpus=0),
            Job("oom", py(oom_once), gpus=0)]
    run_jobs(jobs, tmp_path, gpus=0, per_gpu=4)
    short, long, oom = jobs
    assert short.t1 - short.t0 < 50 and long.t1 - long.t0 < 50  # neither timed out waiting
    assert [j.state for j in jobs] == ["ok", "ok", "ok"] and oom.retried and oom.crowd == 2
    assert short.t1 <= oom.t0 < long.t1                        # restarted once a neighbour had ended
    log = (tmp_path / "logs" / "oom.log").read_text()
    assert "CUDA out of memory" in log and "trained" in log     # both attempts kept in its log

    jobs = [Job("hopeless", py("import sys; print('CUDA out of memory'); sys.exit(1)"), gpus=0),
            Job("beside", until(queued("hopeless")), gpus=0),
            Job("alone", py("import sys; print('CUDA out of memory'); sys.exit(1)"), gpus=0, exclusive=True,
                after=["hopeless", "beside"])]
    run_jobs(jobs, tmp_path, gpus=0, per_gpu=4)
    hopeless, beside, alone = jobs
    assert beside.t1 - beside.t0 < 50                          # it saw `hopeless` queued
    assert hopeless.state == "fail" and hopeless.retried and hopeless.t0 >= beside.t1
    assert alone.state == "fail" and not alone.retried


def test_a_signal_reaches_each_running_job_once_and_a_stopped_training_resumes(tmp_path):
    """SIGTERM to the whole process group of the script (as `timeout` and a terminal's Ctrl-C send
    it): the running job gets exactly one SIGTERM, passed on by the script, exits, and is marked
    `stopped`; the job waiting on it never starts; the script exits 128 + 15. A training job's
    command resumes (resume=true) once its run directory holds a checkpoint."""
    (tmp_path / "logs").mkdir()
    got, ready = tmp_path / "got", tmp_path / "ready"
    trap = (f"import pathlib, signal, sys, time\ngot = pathlib.Path({str(got)!r})\n"
            "def on_term(signum, frame):\n    got.write_text(got.read_text() + 'T' if got.exists() else 'T')\n"
            "signal.signal(signal.SIGTERM, on_term)\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            "while not got.exists():\n    time.sleep(0.05)\ntime.sleep(3)\nsys.exit(128 + 15)")
    driver = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
              "from pathlib import Path\nfrom reproduce_smollm2 import Job, run\n"
              f"jobs = [Job('train', [sys.executable, '-c', {trap!r}], gpus=0),\n"
              "        Job('after', [sys.executable, '-c', 'pass'], deps=['train'], gpus=0)]\n"
              f"sys.exit(run(jobs, Path({str(tmp_path)!r}), gpus=0, per_gpu=2, grace_s=60))")
    p = subprocess.Popen([sys.executable, "-c", driver], start_new_session=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while not ready.exists() and time.time() < deadline and p.poll() is None:
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM, out
    assert got.read_text() == "T", out                     # once: from the script, not from the group signal
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["train"]["state"] == "stopped" and status["after"]["state"] == "wait"
    assert "rerun the same command to go on" in out

    answers = answers_file(tmp_path / "answers.jsonl")
    work = tmp_path / "work"
    cmd = {j.name: j for j in build_jobs(work, False, 1, answers=answers)}["long_b32_e10_g32"].cmd()
    assert "resume=true" not in cmd
    ck = work / "runs" / "long_b32_e10_g32" / "checkpoints"
    ck.mkdir(parents=True)
    (ck / "latest").write_text("step_0000500\n")
    cmd = {j.name: j for j in build_jobs(work, False, 1, answers=answers)}["long_b32_e10_g32"].cmd()
    assert cmd[-1] == "resume=true"


def test_the_committed_experiments_defaults_are_the_committed_recipe_and_earlier_jobs_keep_theirs(tmp_path):
    """`train.py +experiment=smollm2_committed` alone trains the committed drafter's recipe (each
    override of long_norms_ttt4_b32_e12_g32 is already the composed value), while the jobs of the
    documented earlier rows spell out their own recipe (no norms, TTT 7; the scaling curve's one epoch
    of batch 16), so moving the experiment's defaults does not move those rows."""
    import yaml
    from reproduce_smollm2 import LONG

    p = subprocess.run([sys.executable, "train.py", "+experiment=smollm2_committed", "--cfg", "job"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = yaml.safe_load(p.stdout)
    for override in LONG["long_norms_ttt4_b32_e12_g32"]:
        key, value = override.split("=")
        section, name = key.split(".")
        assert cfg[section][name] == yaml.safe_load(value), override
    answers = answers_file(tmp_path / "answers.jsonl")
    jobs = {j.name: j for j in build_jobs(tmp_path, True, 1, answers=answers)}      # dry: 40 answers suffice
    plain = {"drafter.fc_norm=false", "drafter.norm_output=false", "train.ttt_steps=7"}
    for name in ("scale_8k", "scale_20k", "scale_30k"):
        cmd = jobs[name].cmd()
        # docs/results.md's scaling rows: one epoch of batch 16 at lr 1e-3, random batches
        assert plain | {"train.epochs=1", "train.batch_size=16", "optim.lr=1e-3", "train.length_groups=0"} <= set(cmd), name
    for name in ("long_b128", "long_b64", "long_b64_e5", "long_b64_e10_g32", "long_b32_e10_g32", "abl_base"):
        assert plain <= set(jobs[name].cmd()), name
    for name in ("long_norms_b32_e10_g32", "long_norms_b32_e20_g32", "long_norms_mlp4x_b32_e10_g32"):
        assert "train.ttt_steps=7" in jobs[name].cmd(), name
