"""The Kimi-K2.5 recipe as a user meets it: what `--cfg job` shows, the commands train.py prints
without a dataset, and the serving arithmetic its evaluation server depends on (checked against
sizes worked out by hand from the shapes in docs/runbook_kimi.md).

    .venv/bin/python -m pytest tests/test_kimi_recipe.py -q
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir

from eagle3 import config as schema
from eagle3 import serving

ROOT = Path(__file__).resolve().parents[1]
schema.register()

# Kimi-K2.5's text backbone as SGLang reads it (config.json's text_config), and our drafter's export.
KIMI = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512,
                        "qk_rope_head_dim": 64}}
DRAFT = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 7168, "num_attention_heads": 64,
         "num_key_value_heads": 64, "head_dim": 128}


def _config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return schema.to_config(compose(config_name="train", overrides=["+experiment=kimi_k25", *overrides]))


def _train(*args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "train.py", "+experiment=kimi_k25", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, **kw)


def test_cfg_job_shows_all_data_regeneration_thinking_and_the_served_context():
    p = _train("--cfg", "job")
    assert p.returncode == 0, p.stderr[-2000:]
    job = yaml.safe_load(p.stdout)
    assert job["data"]["num_samples"] == 0                                   # all usable data
    assert job["data"]["mix"] == [{"source": "sharegpt", "path": "", "weight": 1.0, "temperature": None}]
    assert job["capture"]["regenerate"] is True and job["capture"]["backend"] == "sglang"
    assert job["capture"]["tp_size"] == 8 and job["capture"]["regen_max_new_tokens"] == 2048
    assert job["target"]["chat_template_kwargs"] == {"thinking": True}
    assert job["data"]["max_length"] == 8192
    assert (job["drafter"]["rope_theta"], job["drafter"]["max_position_embeddings"]) == (1e6, 262144)


def test_recipe_values_and_size():
    c = _config()
    assert (c.optim.lr, c.optim.warmup_fraction, c.train.epochs, c.train.batch_size) == (8e-5, 0.02, 3, 16)
    assert (c.train.ttt_steps, c.train.length_groups, c.drafter.draft_vocab_size) == (4, 32, 32000)
    assert c.capture.format == "compact" and c.capture.draft_vocab_size == 32000 and not c.capture.implicit
    lines = (ROOT / "conf/experiment/kimi_k25.yaml").read_text().splitlines()
    assert len(lines) <= 40                                                  # a small delta


def test_without_a_dataset_train_prints_the_three_stages_and_fails(tmp_path):
    p = _train(f"run_dir={tmp_path}/run", f"data.features_dir={tmp_path}/none")
    assert p.returncode != 0
    out = p.stderr
    over = f"+experiment=kimi_k25 run_dir={tmp_path}/run data.features_dir={tmp_path}/none"
    regen = f"python -m capture {over} capture.regenerate_only=true"
    capture = f"python -m capture {over}\n"
    train = f"accelerate launch --num_processes 8 train.py {over}"
    assert regen in out and capture in out and train in out, out
    assert out.index(regen) < out.index(capture) < out.index(train)
    assert "EAGLE3_SGLANG_PYTHON=" in out


def test_the_message_names_the_capture_server_when_the_target_is_here(tmp_path, monkeypatch):
    import train
    target = tmp_path / "Kimi-K2.5"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(KIMI))
    monkeypatch.setattr(sys, "argv", ["train.py", "+experiment=kimi_k25", f"target.path={target}"])
    msg = train.capture_command_message(_config(f"target.path={target}"))
    server = next(line.strip() for line in msg.splitlines() if "sglang.launch_server" in line)
    assert f"--model-path {target} --tp-size 8 --port 30000" in server
    assert "--return-aux-hidden-state-layer-ids 3 31 59" in server and "--trust-remote-code" in server
    assert f"python -m capture +experiment=kimi_k25 target.path={target} capture.server_url=http://127.0.0.1:30000" in msg


# ---- serving arithmetic ----------------------------------------------------------------------

def test_kv_bytes_by_hand():
    assert serving.kv_bytes_per_token(KIMI, 8) == (512 + 64) * 61 * 2 == 70_272      # MLA latent, every rank
    # SGLang charges the draft one target layer: 576 values; ours stores 64/8 heads x (K + V) x 128
    assert serving.draft_kv_bytes(KIMI, DRAFT, 8) == (576 * 2, 8 * 2 * 128 * 2) == (1152, 4096)
    assert serving.draft_kv_bytes(KIMI, DRAFT, 1) == (1152, 64 * 2 * 128 * 2)


def test_mem_fraction_keeps_sglangs_reserve():
    base = 0.85
    f = serving.draft_mem_fraction(base, KIMI, DRAFT, 8)
    r = (4096 - 1152) / (70_272 + 1152)
    assert f == int(base / (1 + r) * 1000) / 1000 == 0.816
    # SGLang's sizing replayed: tokens = (f M - W) / charged bytes; the pools store N x real bytes.
    M = 139.8 * 2**30
    for W in (0.0, 75e9, 100e9):
        n = (f * M - W) / (70_272 + 1152)
        free = M - W - n * (70_272 + 4096)
        assert free >= (1 - base) * M                     # never less than SGLang meant to keep
    llama = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "hidden_size": 4096}
    small = dict(DRAFT, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    assert serving.draft_mem_fraction(base, llama, small, 8) == base and serving.eval_kv_args(llama, small, 8) == []


def test_eval_server_caps_the_kv_pool(tmp_path):
    from evaluate import draft_memory_args
    from types import SimpleNamespace
    for name, cfg in (("target", KIMI), ("draft", DRAFT)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    e = SimpleNamespace(tp_size=8, server_args=[])
    args = draft_memory_args(tmp_path / "target", tmp_path / "draft", e)
    assert args == ["--max-total-tokens", "65536"]
    assert 65536 * (4096 - 1152) < 0.2e9                  # the uncharged bytes: 193 MB, under SGLang's 10 GiB floor
    e.server_args = ["--mem-fraction-static", "0.8"]
    assert draft_memory_args(tmp_path / "target", tmp_path / "draft", e) == []


def test_one_start_up_timeout_for_every_server():
    from capture import sglang_server
    assert serving.SERVER_START_TIMEOUT == sglang_server.SERVER_START_TIMEOUT == 3600.0
    assert "timeout=SERVER_START_TIMEOUT" in (ROOT / "evaluate.py").read_text()


def test_placeholder_fields_have_the_agreed_defaults():
    assert schema.TargetConfig(name="x").chat_template_kwargs == {}
    assert schema.DataConfig().mix == []
    assert (schema.MixEntry().source, schema.MixEntry().path, schema.MixEntry().weight) == ("sharegpt", "", 1.0)
