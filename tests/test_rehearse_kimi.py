"""scripts/rehearse_kimi.py --tiny: the Kimi-K2.5 recipe's own commands (regenerate, capture, train
with dist=zero2, export) on a tiny random DeepseekV3 stand-in, then bench/train_speed.py at the same
shape; every figure of the summary is a number and the export loads with our own loader.

    python -m pytest tests/test_rehearse_kimi.py -q -m slow
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v >= 0


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    work = tmp_path_factory.mktemp("rehearse")
    p = subprocess.run([sys.executable, "scripts/rehearse_kimi.py", "--tiny", "--work", str(work)], cwd=ROOT,
                       capture_output=True, text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return work, json.loads((work / "rehearsal.json").read_text()), p.stdout


@pytest.mark.slow
def test_tiny_rehearsal_reports_every_figure(rehearsal):
    work, s, stdout = rehearsal
    assert s["tiny"] and "+experiment=kimi_k25" in s["overrides"] and "capture.backend=hf" in s["overrides"]
    for k in ("tokens", "loss_tokens", "shard_bytes", "bytes_per_token", "loss_token_fraction"):
        assert number(s["features"][k]) and s["features"][k] > 0, k
    assert s["features"]["format"] == "compact"                   # the recipe's storage
    # bytes per token: the shards on disk over the tokens the manifest counts
    manifest = json.loads((Path(s["features"]["path"]) / "manifest.json").read_text())
    assert s["features"]["bytes_per_token"] == pytest.approx(s["features"]["shard_bytes"] / manifest["totals"]["num_tokens"])
    for k in ("tok_s_reported", "tok_s_steady", "tokens_per_step", "peak_mem_gib", "counted_fraction", "loss_last"):
        assert number(s["train"][k]) and s["train"][k] > 0, k
    assert s["train"]["steps"] == 6 and s["train"]["batch_size"] == 4 and s["train"]["micro_batch_size"] == 2
    for k in ("tok_s", "peak_mem_gib", "ms_per_step"):
        assert number(s["bench"][k]) and s["bench"][k] > 0, k
    # the bench runs one micro-batch of train.py's batches (each GPU's shape), at their mean length
    assert s["bench"]["batch"] == 2
    assert s["bench"]["seq"] * s["train"]["batch_size"] == pytest.approx(s["train"]["tokens_per_step"], rel=0.2)
    assert s["ratio_steady"] == pytest.approx(s["train"]["tok_s_steady"] / s["bench"]["tok_s"])
    assert s["ratio_reported"] == pytest.approx(s["train"]["tok_s_reported"] / s["bench"]["tok_s"])
    assert all(number(v) for v in s["seconds"].values())
    assert s["deepspeed_zero2"] is False and "trains without DeepSpeed" in (work / "logs" / "train.log").read_text()
    assert "ratio steady / bench" in stdout and "--check-sglang" in stdout


@pytest.mark.slow
def test_tiny_rehearsal_export_loads_with_our_loader(rehearsal):
    from eagle3.evaluation import check_drafter_fits
    from eagle3.export import load_export
    from eagle3.targets import target_info

    work, s, _ = rehearsal
    info = target_info(s["stand_in"]["path"])
    for engine in ("sglang", "vllm"):
        tensors, cfg = load_export(Path(s["export"][engine]["path"]))
        assert check_drafter_fits(cfg, info, tensors, engine=engine) == [2, 3, 4]
        assert cfg["eagle3"]["aux_layers"] == [2, 3, 4] and cfg["target_hidden_size"] == 64
        assert len(tensors) == s["export"][engine]["tensors"]


@pytest.mark.slow
@pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"{SGLANG_PYTHON} missing (SGLang 0.5.23's environment)")
def test_tiny_rehearsal_export_loads_with_sglangs_loader(rehearsal):
    _, s, _ = rehearsal
    p = subprocess.run([str(SGLANG_PYTHON), "scripts/rehearse_kimi.py", "--check-sglang", s["export"]["sglang"]["path"]],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "every parameter equals the export's" in p.stdout
