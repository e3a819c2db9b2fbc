"""scripts/gpu: the unattended GPU session's runner (proof.py) and collector (collect.py), on the
CPU with tiny sizes (--dry-run): a training the lease cut short still brings its drafter back."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled")
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{args} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def test_collect_snapshot_exports_the_latest_checkpoint_of_an_unfinished_run(tmp_path):
    answers = tmp_path / "answers.jsonl"
    with open(answers, "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"question {i}: " + "tell me about the number %d " % i * 3},
                {"role": "assistant", "content": "the number %d is one more than %d. " % (i, i - 1) * 4}]}) + "\n")
    work, out = tmp_path / "work", tmp_path / "out"
    run("scripts/gpu/proof.py", "--work", str(work), "--dry-run", "--only", "long_b64_e10_g32",
        "--answers", str(answers))
    status = json.loads((work / "status.json").read_text())
    assert status["long_b64_e10_g32"]["state"] == "ok"
    # as if the lease ended mid-run: the job still running, its export not written yet
    status["long_b64_e10_g32"]["state"] = "run"
    (work / "status.json").write_text(json.dumps(status))
    run_dir = work / "runs" / "long_b64_e10_g32"
    final = load_file(run_dir / "export" / "vllm" / "model.safetensors")
    shutil.rmtree(run_dir / "export")
    out.mkdir()
    log = run("scripts/gpu/collect.py", "--work", str(work), "--out", str(out), "--exports", "long_b64_e10_g32",
              "--snapshot", "long_b64_e10_g32")
    assert "exported its checkpoint of step 4" in log
    assert not (out / "exp_long_b64_e10_g32.tar.00").exists()          # not finished: no final export
    with tarfile.open(out / "exp_long_b64_e10_g32_snapshot.tar.00") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    got = load_file(tmp_path / "back" / "long_b64_e10_g32" / "vllm" / "model.safetensors")
    assert got.keys() == final.keys()                                  # the checkpoint is the run's last step here
    assert all(got[k].equal(final[k]) for k in final)
