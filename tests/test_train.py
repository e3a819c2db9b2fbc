"""train.py end to end on the tiny experiments: capture-first, export, curves, exact resume, progress,
bad input; and `python -m eagle3.export RUN_DIR`, the export of a run cut short."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def run_train(*overrides, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    p = subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py {' '.join(overrides)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    p = run_train("+experiment=tiny", f"run_dir={d}/run", f"data.features_dir={d}/features",
                  "train.steps=8", "train.save_every=4", "train.log_every=1", "train.eval_every=4")
    (d / "stdout.txt").write_text(p.stdout)
    return d


def test_tiny_end_to_end_writes_exports_curves_and_metrics(tiny_run):
    run = tiny_run / "run"
    rows = metrics(run)
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(8))
    assert all(len(r["acc"]) == 3 and r["lr"] > 0 for r in train_rows)
    keys = {"step", "split", "lr", "loss", "acc", "tokens", "accept", "tau3", "tok_s", "eta_s"}
    assert all(set(r) == keys for r in train_rows)
    assert all(r["eta_s"] >= 0 for r in train_rows) and train_rows[-1]["eta_s"] == 0
    lines = [line for line in (tiny_run / "stdout.txt").read_text().splitlines() if line.startswith("[train] step")]
    assert len(lines) == 8 and lines[-1].startswith("[train] step 8/8 ")
    assert all(" tok/s elapsed " in line and " eta " in line for line in lines)
    assert any(r["split"] == "heldout" for r in rows)
    assert (run / "curves.png").stat().st_size > 10_000
    for engine, ids in (("sglang", [1, 2, 3]), ("vllm", [2, 3, 4])):   # tiny: aux_layers [2, 3, 4], Llama
        cfg = json.loads((run / "export" / engine / "config.json").read_text())
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
        t = load_file(str(run / "export" / engine / "model.safetensors"))
        assert "embed_tokens.weight" not in t and t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
        assert t["lm_head.weight"].shape[0] == t["d2t"].shape[0] == cfg["draft_vocab_size"]
        assert int(t["t2d"].sum()) == cfg["draft_vocab_size"]
    # the vocab saved with the run and every checkpoint is the exported one
    vocab = load_file(str(run / "checkpoints" / "step_0000004" / "vocab.safetensors"))
    assert torch.equal(vocab["d2t"], t["d2t"])


def test_head_from_target_starts_the_drafter_in_the_targets_output_space(tiny_run, tmp_path):
    """drafter.head_from_target: with lr 0 the exported lm_head is exactly the target's lm_head rows
    of the draft vocab (d2t: target id - draft id) and norm is the target's final norm."""
    from eagle3.export import load_export
    from eagle3.targets import load_final_norm, load_head, resolve_target

    run_train("+experiment=tiny", f"run_dir={tmp_path}/warm", f"data.features_dir={tiny_run}/features",
              "train.steps=1", "optim.lr=0", "optim.weight_decay=0", "drafter.head_from_target=true")
    t, _ = load_export(tmp_path / "warm" / "export" / "vllm")
    tc = OmegaConf.load(tmp_path / "warm" / "config.yaml").target
    target_dir = resolve_target(tc.source, tc.path, tc.name, tc.arch, dict(tc.random_config), tc.seed)
    _, head = load_head(target_dir)
    target_ids = t["d2t"] + torch.arange(len(t["d2t"]))
    close = dict(rtol=1e-2, atol=1e-6)        # the export is bf16
    torch.testing.assert_close(t["lm_head.weight"].float(), head[target_ids].float(), **close)
    torch.testing.assert_close(t["norm.weight"].float(), load_final_norm(target_dir).float(), **close)
    assert not torch.allclose(t["lm_head.weight"].float(), head[:len(target_ids)].float(), **close)


def test_init_from_starts_at_a_trained_drafter_and_maps_a_larger_vocab(tiny_run, tmp_path):
    """drafter.init_from with lr 0: the export is the source drafter's weights; of its lm_head over
    a larger draft vocab the source's tokens keep their rows and the others are the target's head
    rows through the map fitted on those (eagle3.vocab.mapped_rows). Another shape is refused."""
    from eagle3.export import load_export
    from eagle3.targets import load_head, resolve_target
    from eagle3.vocab import mapped_rows

    p = run_train("+experiment=tiny", f"run_dir={tmp_path}/more", f"data.features_dir={tiny_run}/features",
                  "train.steps=1", "optim.lr=0", "optim.weight_decay=0", "drafter.draft_vocab_size=3000",
                  f"drafter.init_from={tiny_run}/run")
    assert "2048 lm_head rows kept, 952 mapped from the target's head" in p.stdout
    src, _ = load_export(tiny_run / "run" / "export" / "vllm")
    got, cfg = load_export(tmp_path / "more" / "export" / "vllm")
    assert cfg["draft_vocab_size"] == 3000
    for k in src:
        if k not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(got[k], src[k]), k
    tc = OmegaConf.load(tmp_path / "more" / "config.yaml").target
    _, head = load_head(resolve_target(tc.source, tc.path, tc.name, tc.arch, dict(tc.random_config), tc.seed))
    src_ids, new_ids = (t["d2t"] + torch.arange(len(t["d2t"])) for t in (src, got))
    assert torch.isin(src_ids, new_ids).all()
    shared = torch.isin(new_ids, src_ids)
    src_row = {int(t): i for i, t in enumerate(src_ids)}
    assert torch.equal(got["lm_head.weight"][shared], src["lm_head.weight"][[src_row[int(t)] for t in new_ids[shared]]])
    want = mapped_rows(src["lm_head.weight"], src_ids, new_ids, head)
    torch.testing.assert_close(got["lm_head.weight"].float(), want, rtol=1e-2, atol=1e-5)   # the export is bf16

    bad = run_train("+experiment=tiny", f"run_dir={tmp_path}/bad", f"data.features_dir={tiny_run}/features",
                    "train.steps=1", "drafter.intermediate_size=96", f"drafter.init_from={tiny_run}/run", check=False)
    assert bad.returncode != 0 and "intermediate_size 128 (this run: 96)" in bad.stderr


def test_init_from_grows_a_drafter_by_layers_that_start_as_the_identity(tiny_run, tmp_path):
    """drafter.num_layers=2 from a one-layer export: the added layer starts with o_proj and down_proj
    at zero, so the first step's loss and accuracies are those of the same export loaded as one
    layer; training then moves both (their gradients are not zero), layer 0 starts from the export,
    and a drafter with fewer layers than the export is refused."""
    from eagle3.export import load_export

    common = ("+experiment=tiny", f"data.features_dir={tiny_run}/features", f"drafter.init_from={tiny_run}/run")
    one = run_train(*common, f"run_dir={tmp_path}/one", "train.steps=1")
    two = run_train(*common, f"run_dir={tmp_path}/two", "train.steps=2", "drafter.num_layers=2")
    assert "1 layer(s) added on top" in two.stdout and "added on top" not in one.stdout
    first = [next(r for r in metrics(tmp_path / run) if r["split"] == "train") for run in ("one", "two")]
    for key in ("loss", "acc", "accept", "tau3"):
        assert first[0][key] == pytest.approx(first[1][key], rel=1e-5, abs=1e-7), key
    later = next(r for r in metrics(tmp_path / "two") if r["split"] == "train" and r["step"] == 1)
    assert later["loss"] != pytest.approx(first[1]["loss"], rel=1e-5)
    src, _ = load_export(tiny_run / "run" / "export" / "vllm")
    grown, cfg = load_export(tmp_path / "two" / "export" / "vllm")
    assert cfg["num_hidden_layers"] == 2
    for name in ("layers.1.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert grown[name].abs().max() > 0, name   # trained away from the zero it started at
    moved = [k for k in src if k not in ("d2t", "t2d") and not torch.equal(grown[k], src[k])]
    assert any(k.startswith("midlayer.") for k in moved)   # layer 0 trained on from the export's values

    bad = run_train("+experiment=tiny", f"run_dir={tmp_path}/bad", f"data.features_dir={tiny_run}/features",
                    "train.steps=1", f"drafter.init_from={tmp_path}/two", check=False)
    assert bad.returncode != 0 and "num_layers 2 (this run: 1)" in bad.stderr


def test_prefetching_the_next_steps_batches_trains_exactly_as_building_them_in_line(tiny_run, tmp_path):
    """The tiny run built each step's batches on the prefetch worker (train.prefetch, on by default);
    built in line, every step's loss, accuracy and the held-out rows (which wait for the worker) are
    the same numbers, and so are the exported weights."""
    run_train("+experiment=tiny", f"run_dir={tmp_path}/inline", f"data.features_dir={tiny_run}/features",
              "train.steps=8", "train.save_every=4", "train.log_every=1", "train.eval_every=4", "train.prefetch=false")
    drop = ("tok_s", "eta_s")
    ahead = [{k: v for k, v in r.items() if k not in drop} for r in metrics(tiny_run / "run")]
    inline = [{k: v for k, v in r.items() if k not in drop} for r in metrics(tmp_path / "inline")]
    assert ahead == inline and sum(r["split"] == "heldout" for r in inline) == 3
    a = load_file(str(tiny_run / "run" / "export" / "vllm" / "model.safetensors"))
    b = load_file(str(tmp_path / "inline" / "export" / "vllm" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_continues_exactly(tiny_run):
    """Stop at step 4 (the checkpoint), resume, and every later step's loss equals the uninterrupted run's."""
    run = tiny_run / "run"
    full = {(r["step"], r["split"]): r for r in metrics(run)}
    ck = run / "checkpoints"
    (ck / "latest").write_text("step_0000004\n")
    run_train("+experiment=tiny", f"run_dir={run}", f"data.features_dir={tiny_run}/features", "resume=true",
              "train.steps=8", "train.save_every=4", "train.log_every=1", "train.eval_every=4")
    resumed = {(r["step"], r["split"]): r for r in metrics(run)}
    assert sorted(resumed) == sorted(full)
    for step in range(4, 8):
        a, b = full[(step, "train")], resumed[(step, "train")]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7), step
        assert b["acc"] == pytest.approx(a["acc"], abs=1e-9)


def test_bf16_autocast_resume_continues_exactly(tiny_run, tmp_path):
    """Under bf16 mixed precision the drafter's parameters are bf16 and the optimizer's state holds
    their fp32 masters and moments (eagle3/optim.py); a checkpoint keeps both, so every loss after
    it equals the uninterrupted run's exactly. Masters or moments rounded to bf16 on the way (as
    torch's Optimizer.load_state_dict would) change the losses after the first resumed step."""
    args = ("+experiment=tiny", f"run_dir={tmp_path}/run", f"data.features_dir={tiny_run}/features",
            "dist.mixed_precision=bf16", "train.steps=6", "train.save_every=3", "train.log_every=1",
            "train.eval_every=100")
    run_train(*args)
    full = {(r["step"], r["split"]): r for r in metrics(tmp_path / "run")}
    ck = tmp_path / "run" / "checkpoints" / "step_0000003"
    assert {t.dtype for t in load_file(ck / "model.safetensors").values()} == {torch.bfloat16}
    states = list(torch.load(ck / "optimizer.bin", weights_only=True)["state"].values())
    assert states and all(st[k].dtype == torch.float32 for st in states for k in ("master", "exp_avg", "exp_avg_sq"))
    # real fp32 masters: they hold what the bf16 weights round away
    assert any(not torch.equal(st["master"], st["master"].bfloat16().float()) for st in states)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_0000003\n")
    run_train(*args, "resume=true")
    resumed = {(r["step"], r["split"]): r for r in metrics(tmp_path / "run")}
    losses = [full[(step, "train")]["loss"] for step in range(6)]
    assert len(set(losses)) == 6                      # it trains: bf16 steps, not one loss repeated
    for step in range(3, 6):
        assert resumed[(step, "train")]["loss"] == full[(step, "train")]["loss"], step


def test_sigterm_stops_at_a_step_with_a_checkpoint_and_the_resumed_run_ends_as_one_uninterrupted(tiny_run, tmp_path):
    """SIGTERM mid-run: the process exits with 128 + 15 after saving the step it was in (no periodic
    checkpoint is due: save_every is past the end), and resume=true ends with the same metrics and
    exported weights as a run that was never stopped."""
    args = ["+experiment=tiny", f"data.features_dir={tiny_run}/features", "train.steps=40", "train.save_every=1000",
            "train.log_every=1", "train.eval_every=1000"]
    run_train(*args, f"run_dir={tmp_path}/full")
    cut = tmp_path / "cut"
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    p = subprocess.Popen([sys.executable, "train.py", *args, f"run_dir={cut}"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while p.poll() is None and not any(r["split"] == "train" and r["step"] >= 2
                                           for r in (metrics(cut) if (cut / "metrics.jsonl").exists() else [])):
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    saved = [d.name for d in (cut / "checkpoints").glob("step_*")]
    assert len(saved) == 1 and (cut / "checkpoints" / "latest").read_text().strip() == saved[0]
    stopped = int(saved[0].split("_")[1])
    assert 3 <= stopped < 40 and f"stopped after step {stopped}/40" in out
    assert max(r["step"] for r in metrics(cut)) == stopped - 1
    assert not (cut / "export").exists()
    run_train(*args, f"run_dir={cut}", "resume=true")
    full, resumed = metrics(tmp_path / "full"), metrics(cut)
    assert [(r["step"], r["split"]) for r in resumed] == [(r["step"], r["split"]) for r in full]
    for a, b in zip(full, resumed):
        assert b.get("loss") == pytest.approx(a.get("loss"), rel=1e-6, abs=1e-7), a["step"]
    for engine in ("vllm", "sglang"):
        a = load_file(str(tmp_path / "full" / "export" / engine / "model.safetensors"))
        b = load_file(str(cut / "export" / engine / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), engine


def test_manifest_mismatch_stops_and_names_both_values(tiny_run, tmp_path):
    p = run_train("+experiment=tiny", f"run_dir={tmp_path}/r", f"data.features_dir={tiny_run}/features",
                  "aux_layers=[1,3,4]", "train.steps=2", check=False)
    assert p.returncode != 0
    err = p.stderr + p.stdout
    assert "aux_layers" in err and "[2, 3, 4]" in err and "[1, 3, 4]" in err


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tiny_run, tmp_path):
    p = run_train("+experiment=tiny", f"run_dir={tmp_path}/r", f"data.features_dir={tiny_run}/features",
                  "train.steps=40", "train.save_every=1", "optim.lr=1e30", "optim.grad_clip=0", check=False)
    assert p.returncode != 0
    err = p.stderr + p.stdout
    assert "non-finite loss" in err and "at step" in err
    latest = (tmp_path / "r" / "checkpoints" / "latest").read_text().strip()
    assert (tmp_path / "r" / "checkpoints" / latest / "trainer_state.json").exists()


def test_missing_dataset_without_in_process_capture_prints_command(tmp_path):
    p = run_train("+experiment=kimi_k25", f"run_dir={tmp_path}/run", f"data.features_dir={tmp_path}/none", check=False)
    assert p.returncode != 0
    assert "python -m capture +experiment=kimi_k25" in p.stderr


def test_typo_fails_at_startup():
    p = run_train("+experiment=tiny", "train.stpes=3", check=False)
    assert p.returncode != 0 and "stpes" in p.stderr


@pytest.mark.parametrize("over, said", [
    (["train.teacher_temperature=0"], "train.teacher_temperature=0.0: must be above 0"),
    (["train.teacher_temperature=0.5", "train.loss=lk"], "train.teacher_temperature=0.5 with train.loss=lk")])
def test_a_teacher_temperature_that_cannot_work_fails_at_startup(tmp_path, over, said):
    p = run_train("+experiment=tiny", f"run_dir={tmp_path}/r", *over, check=False)
    assert p.returncode != 0 and said in p.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_step_interval_below_one_fails_at_startup(tmp_path):
    p = run_train("+experiment=tiny", f"run_dir={tmp_path}/r", "train.eval_every=0", check=False)
    assert p.returncode != 0 and "train.eval_every=0: a number of steps, at least 1" in p.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_train_loss_reaches_the_objective(tiny_run, tmp_path):
    """train.loss=kl differs from soft_ce only by the teacher's entropy, a constant: the same
    accuracies step for step, a lower loss; tv is 1 - acceptance per step, so within [0, sum of step
    weights]; an unknown name stops at start-up and lists the choices."""
    runs = {}
    for name in ("soft_ce", "kl", "tv"):
        run_train("+experiment=tiny", f"run_dir={tmp_path}/{name}", f"data.features_dir={tiny_run}/features",
                  "train.steps=3", "train.log_every=1", "train.eval_every=100", f"train.loss={name}")
        runs[name] = [r for r in metrics(tmp_path / name) if r["split"] == "train"]
    for ce, kl in zip(runs["soft_ce"], runs["kl"]):
        assert kl["acc"] == pytest.approx(ce["acc"], abs=1e-6)
        assert 0 <= kl["loss"] < ce["loss"]
    assert [r["loss"] for r in runs["tv"]] != pytest.approx([r["loss"] for r in runs["soft_ce"]])
    assert all(0 <= r["loss"] <= sum(0.8 ** s for s in range(len(r["acc"]))) for r in runs["tv"])
    p = run_train("+experiment=tiny", f"run_dir={tmp_path}/bad", f"data.features_dir={tiny_run}/features",
                  "train.loss=lkk", check=False)
    assert p.returncode != 0 and "lkk" in p.stderr and "soft_ce" in p.stderr


@pytest.mark.parametrize("dist", ["zero2", "zero3"])
def test_deepspeed_world_of_one_matches_the_plain_loop(tiny_run, tmp_path, dist):
    """dist=zero2/zero3 at world size 1 on the CPU composes, starts and trains to the plain process's
    losses. accelerate runs DeepSpeed on GPUs only, so the run says it trains without it (with the
    plain loop's clipping, which DeepSpeed would otherwise do)."""
    common = ["+experiment=tiny", f"data.features_dir={tiny_run}/features", "train.steps=4", "train.log_every=1",
              "train.save_every=100"]
    run_train(*common, f"run_dir={tmp_path}/plain")
    p = run_train(*common, f"run_dir={tmp_path}/ds", f"dist={dist}")
    assert "trains without DeepSpeed" in p.stdout
    plain = [r["loss"] for r in metrics(tmp_path / "plain") if r["split"] == "train"]
    ds = [r["loss"] for r in metrics(tmp_path / "ds") if r["split"] == "train"]
    assert len(plain) == len(ds) == 4
    assert ds == pytest.approx(plain, rel=1e-5)
    assert plain[-1] < plain[0]          # it trained


def test_online_training_sees_the_same_batches_as_offline(tiny_run, tmp_path):
    """train.mode=online runs the target in-process (nothing on disk); its losses equal the offline run's
    up to the bf16 rounding of stored features. Batches grouped by length: both read the same lengths."""
    common = ["+experiment=tiny", "train.steps=3", "train.log_every=1", "train.save_every=100",
              "train.length_groups=2"]
    run_train(*common, f"run_dir={tmp_path}/online", "train.mode=online", f"data.features_dir={tmp_path}/none")
    run_train(*common, f"run_dir={tmp_path}/offline", f"data.features_dir={tiny_run}/features")
    assert not (tmp_path / "none").exists()
    on = [r for r in metrics(tmp_path / "online") if r["split"] == "train"]
    off = [r for r in metrics(tmp_path / "offline") if r["split"] == "train"]
    # counted rows depend on the teacher's argmax, which bf16 storage may flip at a near-tie
    assert [r["tokens"] for r in on] == pytest.approx([r["tokens"] for r in off], rel=0.05)
    assert [r["loss"] for r in on] == pytest.approx([r["loss"] for r in off], rel=2e-3)


@pytest.mark.slow
def test_train_compile_true_matches_eager(tiny_run, tmp_path):
    """train.compile=true (the GPU default) runs the fused elementwise kernels through inductor, here
    on the CPU: the same losses as the eager loop within float reordering."""
    common = ["+experiment=tiny", f"data.features_dir={tiny_run}/features", "train.steps=3", "train.log_every=1",
              "train.save_every=100", "train.eval_every=100"]
    run_train(*common, f"run_dir={tmp_path}/eager", "train.compile=false")
    run_train(*common, f"run_dir={tmp_path}/compiled", "train.compile=true")
    eager = [r["loss"] for r in metrics(tmp_path / "eager") if r["split"] == "train"]
    compiled = [r["loss"] for r in metrics(tmp_path / "compiled") if r["split"] == "train"]
    assert len(eager) == len(compiled) == 3
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_fp8_aux_features_train_like_bf16_and_are_not_mistaken_for_them(tiny_run, tmp_path):
    """capture.aux_dtype=float8_e4m3fn: the same tiny capture stored with fp8 aux trains to the
    losses of the bf16 features within fp8's rounding; a capture asking for bf16 into that
    directory later stops with both storages named instead of silently keeping it. (Training reads
    either: a dataset says how it is stored.)"""
    common = ["+experiment=tiny", "train.steps=4", "train.log_every=1", "train.save_every=100"]
    run_train(*common, f"run_dir={tmp_path}/bf16", f"data.features_dir={tiny_run}/features")
    run_train(*common, f"run_dir={tmp_path}/fp8", f"data.features_dir={tmp_path}/features8",
              "capture.aux_dtype=float8_e4m3fn")
    manifest = json.loads((tmp_path / "features8" / "manifest.json").read_text())
    assert manifest["dtypes"]["aux"] == "float8_e4m3fn" and manifest["dtypes"]["final"] == "bfloat16"
    bf16 = [r["loss"] for r in metrics(tmp_path / "bf16") if r["split"] == "train"]
    fp8 = [r["loss"] for r in metrics(tmp_path / "fp8") if r["split"] == "train"]
    assert len(bf16) == len(fp8) == 4
    assert fp8 == pytest.approx(bf16, rel=1e-2) and fp8 != bf16
    env = dict(os.environ, OMP_NUM_THREADS="2", HYDRA_FULL_ERROR="1")
    p = subprocess.run([sys.executable, "-m", "capture", "+experiment=tiny", f"data.features_dir={tmp_path}/features8"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode != 0
    err = p.stderr + p.stdout
    assert "float8_e4m3fn" in err and "bfloat16" in err and "capture.aux_dtype" in err


def export_run(run_dir, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    p = subprocess.run([sys.executable, "-m", "eagle3.export", str(run_dir)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"python -m eagle3.export {run_dir} failed ({p.returncode}):\n{p.stderr[-5000:]}")
    return p


def test_export_entry_point_writes_what_training_exported(tiny_run, tmp_path):
    """python -m eagle3.export RUN_DIR on the last checkpoint (step 8) writes, tensor for tensor and
    config for config, the export training wrote at step 8; on an earlier one (step 4, a run cut
    short) it exports those weights as they are, trains nothing and leaves metrics and checkpoints
    alone; without a checkpoint it stops with an error that names the directory."""
    from eagle3.export import load_export
    import shutil
    run = tmp_path / "run"
    shutil.copytree(tiny_run / "run", run)
    shutil.rmtree(run / "export")
    before = (run / "metrics.jsonl").read_text()
    export_run(run)
    for engine in ("sglang", "vllm"):
        ours, ours_cfg = load_export(run / "export" / engine)
        trained, trained_cfg = load_export(tiny_run / "run" / "export" / engine)
        assert ours_cfg == trained_cfg
        assert sorted(ours) == sorted(trained)
        for name, t in trained.items():
            assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name

    (run / "checkpoints" / "latest").write_text("step_0000004\n")
    p = export_run(run)
    assert "at step 4" in p.stdout
    assert (run / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_0000004", "step_0000008"]
    exported = load_file(run / "export" / "vllm" / "model.safetensors")
    saved = {k.removeprefix("drafter."): v for k, v in
             load_file(run / "checkpoints" / "step_0000004" / "model.safetensors").items()}
    final = load_file(run / "checkpoints" / "step_0000008" / "model.safetensors")
    assert "midlayer.self_attn.q_proj.weight" in exported
    for name, t in exported.items():
        if name in ("d2t", "t2d"):
            continue
        torch.testing.assert_close(t, saved[name].to(t.dtype), rtol=0, atol=0, msg=name)
    assert not torch.equal(exported["lm_head.weight"], final["drafter.lm_head.weight"].to(torch.bfloat16))

    (tmp_path / "empty").mkdir()
    p = export_run(tmp_path / "empty", check=False)
    assert p.returncode != 0 and str(tmp_path / "empty" / "checkpoints") in p.stderr


def test_a_two_layer_drafter_trains_and_exports_its_layers_for_both_engines(tiny_run, tmp_path):
    """drafter.num_layers=2: config.json's num_hidden_layers is 2, layer 1 is exported as layers.1.*
    with its pre-norm under both engines' names (one value), checkpoints keep the one norm, and
    `python -m eagle3.export` writes what training exported."""
    from eagle3.export import load_export
    run = tmp_path / "run"
    run_train("+experiment=tiny", f"run_dir={run}", f"data.features_dir={tiny_run}/features",
              "drafter.num_layers=2", "train.steps=2", "train.save_every=2")
    layer1 = {f"layers.1.{n}.weight" for n in (
        "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    trained = {}
    for engine in ("sglang", "vllm"):
        trained[engine], cfg = load_export(run / "export" / engine)
        t = trained[engine]
        assert cfg["num_hidden_layers"] == 2
        assert {k for k in t if k.startswith("layers.")} == layer1
        assert torch.equal(t["layers.1.hidden_norm.weight"], t["layers.1.input_layernorm.weight"])
    ck = load_file(str(run / "checkpoints" / "step_0000002" / "model.safetensors"))
    assert "drafter.layers.1.input_layernorm.weight" in ck and "drafter.layers.1.hidden_norm.weight" not in ck
    export_run(run)
    for engine in ("sglang", "vllm"):
        again, _ = load_export(run / "export" / engine)
        assert again.keys() == trained[engine].keys()
        assert all(torch.equal(again[k], trained[engine][k]) for k in again)


def test_profile_steps_write_a_trace_an_op_table_and_the_steps_wall_time(tiny_run, tmp_path):
    """train.profile_steps=[3,4]: the profiler sees exactly those two steps (each runs the drafter's
    forward as many times as it has micro-batches), and the run's metrics are the unprofiled run's."""
    run = tmp_path / "run"
    run_train("+experiment=tiny", f"run_dir={run}", f"data.features_dir={tiny_run}/features", "train.steps=6",
              "train.save_every=100", "train.log_every=1", "train.eval_every=100", "train.profile_steps=[3,4]",
              "train.micro_batch_size=2")
    prof = run / "profile"
    summary = json.loads((prof / "summary.json").read_text())
    assert summary["steps"] == [3, 4] and 0 < summary["wall_s"] < 120
    assert summary["ms_per_step"] == pytest.approx(1000 * summary["wall_s"] / 2)
    names = [e.get("name", "") for e in json.loads((prof / "trace.json").read_text())["traceEvents"]
             if e.get("ph") == "X"]
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#3", "ProfilerStep#4"]
    assert sum(n.startswith("Optimizer.step#") for n in names) == 2
    # tiny: batch 4 in micro-batches of 2, so 2 steps x 2 micro-batches = 4 backward passes of the loss
    assert names.count("_SoftCrossEntropyBackward") == 4
    assert "Self CPU" in (prof / "ops.txt").read_text()
    # every phase ran on the host, inside the steps' wall time; a CPU run launches no kernels
    host = summary["host_ms_per_step"]
    assert set(host) == {"data", "forward", "backward", "optimizer"} and all(v > 0 for v in host.values())
    assert sum(host.values()) <= summary["ms_per_step"] and summary["launches_per_step"] == 0
    rows = {r["step"]: r["loss"] for r in metrics(run) if r["split"] == "train"}
    plain = tmp_path / "plain"
    run_train("+experiment=tiny", f"run_dir={plain}", f"data.features_dir={tiny_run}/features", "train.steps=6",
              "train.save_every=100", "train.log_every=1", "train.eval_every=100", "train.micro_batch_size=2")
    assert rows == {r["step"]: r["loss"] for r in metrics(plain) if r["split"] == "train"}


def test_capture_implicit_false_stops_with_the_capture_command(tmp_path):
    """capture.implicit=false: a missing feature dataset is never captured by train.py, whatever the target."""
    p = run_train("+experiment=tiny", "capture.implicit=false", f"run_dir={tmp_path}/run",
                  f"data.features_dir={tmp_path}/none", check=False)
    assert p.returncode != 0
    assert "python -m capture +experiment=tiny" in p.stderr and not (tmp_path / "none").exists()
