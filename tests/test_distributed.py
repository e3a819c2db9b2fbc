"""Data-parallel training on CPU (gloo): sharding, rank-0-only outputs, multi-process resume."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from eagle3.sources import batch_indices  # noqa: E402


@pytest.mark.parametrize("groups", [0, 3])
@pytest.mark.parametrize("n,batch,world", [(55, 4, 2), (64, 8, 4), (10, 5, 1)])
def test_an_epoch_shards_every_sample_at_most_once(n, batch, world, groups):
    per_epoch = n // batch
    lengths = torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(1))
    for epoch in range(2):
        seen = []
        for step in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            idx = batch_indices(step, n, batch, 3, lengths, groups)
            per_rank = batch // world
            shards = [idx[r * per_rank:(r + 1) * per_rank] for r in range(world)]
            assert sum(map(len, shards)) == batch
            seen += [i for s in shards for i in s]
        assert len(seen) == len(set(seen)) == per_epoch * batch     # nothing twice in an epoch
        assert set(seen) <= set(range(n))
    # a different epoch is a different order
    assert batch_indices(0, n, batch, 3) != batch_indices(per_epoch, n, batch, 3) or n == batch


def test_length_groups_cut_padding_and_keep_the_epoch_random():
    """Grouped batches: each is a run of similar lengths (padding measured against random
    batches of the same epoch), the batch order differs between epochs, and the samples of one
    batch are those of the random permutation's run it came from."""
    n, batch, groups = 4096, 16, 32
    torch.manual_seed(0)
    lengths = (torch.distributions.LogNormal(6.5, 0.8).sample((n,)).clamp(8, 2048)).long()
    per_epoch = n // batch

    def real_share(gr):
        real = padded = 0
        for step in range(per_epoch):
            b = lengths[batch_indices(step, n, batch, 5, lengths, gr)]
            real, padded = real + int(b.sum()), padded + int(b.max()) * batch
        return real / padded
    random_share, grouped_share = real_share(0), real_share(groups)
    assert random_share < 0.6 and grouped_share > 0.9, (random_share, grouped_share)
    # default (no groups) is exactly the plain permutation, so older runs resume unchanged
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5 * 1_000_003))
    assert batch_indices(1, n, batch, 5) == perm[batch:2 * batch].tolist()
    # a grouped batch comes from one run of `groups` batches of that same permutation
    runs = perm[:per_epoch * batch].split(groups * batch)
    first = set(batch_indices(0, n, batch, 5, lengths, groups))
    assert any(first <= set(r.tolist()) for r in runs)
    # the grouped batches are shuffled: sorted runs left in order would make almost every batch
    # longer than the one before (all but one per run); shuffled, about half are
    longest = [int(lengths[batch_indices(k, n, batch, 5, lengths, groups)].max()) for k in range(per_epoch)]
    rising = sum(b > a for a, b in zip(longest, longest[1:])) / (per_epoch - 1)
    assert 0.3 < rising < 0.7, rising
    assert batch_indices(0, n, batch, 5, lengths, groups) != batch_indices(per_epoch, n, batch, 5, lengths, groups)


def torchrun(*overrides, nproc=2):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                        "--master_port", "29541", "train.py", *overrides],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def test_two_processes_log_once_checkpoint_and_resume(tmp_path):
    common = ["+experiment=tiny", f"data.features_dir={tmp_path}/features", "train.steps=6",
              "train.log_every=1", "train.save_every=3", "train.eval_every=3"]
    subprocess.run([sys.executable, "-m", "capture", "+experiment=tiny", f"data.features_dir={tmp_path}/features"],
                   cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    p = torchrun(*common, f"run_dir={tmp_path}/run")
    assert "world 2" in p.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if r["split"] == "train"]
    assert train_steps == list(range(6))                          # one row per step: rank 0 only
    assert (tmp_path / "run" / "checkpoints" / "step_0000003").is_dir()
    assert not list((tmp_path / "run").glob("checkpoints/.tmp*"))
    full = {r["step"]: r["loss"] for r in rows if r["split"] == "train"}

    # the same global batch in one process gives the same losses (each rank divides by the global counts)
    one = subprocess.run([sys.executable, "train.py", *common, f"run_dir={tmp_path}/one"], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled"))
    assert one.returncode == 0, one.stderr[-3000:]
    single = {json.loads(l)["step"]: json.loads(l)["loss"]
              for l in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines() if '"train"' in l}
    assert [single[k] for k in range(6)] == pytest.approx([full[k] for k in range(6)], rel=1e-5)

    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_0000003\n")
    torchrun(*common, f"run_dir={tmp_path}/run", "resume=true")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in rows if r["split"] == "train"}
    assert sorted(resumed) == list(range(6))
    for step in range(3, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6)


def test_two_processes_train_in_stages_as_one_process_does(tmp_path):
    """The stages share one accelerator: the second prepares its model after the first's is freed,
    and its losses on two processes are those of one process."""
    common = ["+experiment=tiny", f"data.features_dir={tmp_path}/features", "train.steps=3", "train.log_every=1",
              "train.save_every=100", "train.eval_every=100", "train.stages=[{optim: {lr: 5.0e-4}, train: {seed: 1}}]"]
    torchrun(*common, f"run_dir={tmp_path}/two")
    one = subprocess.run([sys.executable, "train.py", *common, f"run_dir={tmp_path}/one"], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled"))
    assert one.returncode == 0, one.stderr[-3000:]

    def losses(run):
        return [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
                if '"train"' in line]
    for stage in ("stage1", "."):
        two, single = losses(f"two/{stage}"), losses(f"one/{stage}")
        assert len(two) == 3 and two == pytest.approx(single, rel=1e-5)
    assert losses("two/stage1") != pytest.approx(losses("two"), rel=1e-3)   # the second stage trained on from the first
    assert (tmp_path / "two" / "done.json").exists() and (tmp_path / "two" / "stage1" / "done.json").exists()


@pytest.mark.slow
def test_zero3_on_two_processes_evaluates_a_partial_last_batch_and_matches_one_process(tmp_path):
    """ZeRO-3 gathers parameters collectively in every forward, so a rank with no held-out samples
    left would hang the other under NCCL (9 held-out samples, batches of 8). Held-out batches are
    full global batches, the last one wrapping around: the same rows and losses as one process."""
    common = ["+experiment=tiny", f"data.features_dir={tmp_path}/features", "train.steps=3",
              "train.log_every=1", "train.eval_every=2", "train.eval_batches=3", "dist=zero3",
              "train.save_every=100"]
    subprocess.run([sys.executable, "-m", "capture", "+experiment=tiny", f"data.features_dir={tmp_path}/features"],
                   cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    torchrun(*common, f"run_dir={tmp_path}/two")
    one = subprocess.run([sys.executable, "train.py", *common, f"run_dir={tmp_path}/one"], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled"))
    assert one.returncode == 0, one.stderr[-3000:]

    def rows(run):
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    two, single = rows("two"), rows("one")
    assert [(r["step"], r["split"]) for r in two] == [(r["step"], r["split"]) for r in single]
    assert sum(r["split"] == "heldout" for r in two) == 2
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in single], rel=1e-5)
