"""train.mode=stream (eagle3/stream.py, docs/streaming.md): the stream directory never holds more than
data.disk_budget_gb, the trainer ends with the weights of an offline run over the same samples in the
same order (train.order=shards), a SIGKILLed trainer or producer resumes to those same weights, and
a budget that cannot work is refused up front."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from eagle3.stream import GB, Schedule, StreamError, check_budget, dir_bytes

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
# 32 conversations -> about 25 train samples, 6 batches an epoch: the run reads a second epoch.
# capture.batch_tokens=1: every sample is captured alone, so its features are bit-identical whether
# the stream or the offline capture (whose last shard mixes in held-out samples) batched it.
COMMON = ["+experiment=tiny", "data.num_samples=32", f"train.steps={STEPS}", "train.save_every=4",
          "train.log_every=1", "train.eval_every=5", "capture.shard_tokens=1024", "capture.batch_tokens=1"]
BUDGET_GB = 0.002       # the held-out features and about two shards of ~0.55 MB


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")


def start(module, *overrides):
    args = [sys.executable, *(["-m", module] if module == "capture" else [module]), *overrides]
    return subprocess.Popen(args, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(p, timeout=600):
    out = p.communicate(timeout=timeout)[0]
    assert p.returncode == 0, out[-6000:]
    return out


def weights(run_dir):
    return load_file(Path(run_dir) / "checkpoints" / f"step_{STEPS:07d}" / "model.safetensors")


def assert_same_weights(run_dir, ref_dir):
    got, want = weights(run_dir), weights(ref_dir)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def train_losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


class DirSampler(threading.Thread):
    """The stream directory's size, sampled as fast as a thread can."""

    def __init__(self, root):
        super().__init__(daemon=True)
        self.root, self.max, self.samples, self.stop = Path(root), 0, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.max = max(self.max, dir_bytes(self.root) if self.root.exists() else 0)
            self.samples += 1


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """The reference: the same samples captured whole, trained offline in shard order."""
    d = tmp_path_factory.mktemp("offline")
    finish(start("train.py", *COMMON, f"run_dir={d}/run", f"data.features_dir={d}/features", "train.order=shards"))
    return d / "run"


def test_schedule_is_each_sample_once_an_epoch_in_shard_order():
    """Epoch p's batches hold every sample of the first per_epoch x B positions once, shard after
    shard; another seed shuffles inside the shards only; spans name the shards a batch reads."""
    lengths = [(7 * i) % 50 + 10 for i in range(45)]
    sched = Schedule(lengths, shard_tokens=200, batch_size=4, total=25)
    assert sched.per_epoch == 11 and sched.num_shards > 4
    for p in range(2):
        seen = [i for k in range(11) for i in sched.batch(p * 11 + k, seed=3)]
        assert len(set(seen)) == 44 and set(seen) <= set(range(45))     # one sample is the remainder
        shards = [sched.shard_of(i) for i in seen]
        assert shards == sorted(shards)                  # shard order, shuffled within a shard
        first, last = sched.span(p * 11 + 5)
        assert {sched.shard_of(i) + p * sched.num_shards for i in sched.batch(p * 11 + 5, 3)} == \
            set(range(first, last + 1))
    assert sched.batch(0, seed=3) != sched.batch(0, seed=4)
    assert sched.batch(0, seed=3) != sched.batch(11, seed=3)                  # each epoch shuffled afresh
    assert sched.end == sched.span(24)[1] + 1
    assert sched.next_use(sched.name(3), first=4) is None and sched.next_use(sched.name(3), first=3) == 3
    # one sample a shard: shards 8 and 9 hold the remainder of 10 samples in batches of 4, never read
    small = Schedule([100] * 10, shard_tokens=100, batch_size=4, total=3)
    assert [small.used(g) for g in range(10)] == [True] * 8 + [False] * 2
    assert small.end == 14 and small.used(13) and not small.used(14)
    reuse = Schedule(lengths, 200, 4, 25, reuse=True)
    assert reuse.next_use(reuse.name(1), first=2) == reuse.num_shards + 1    # the same shard next epoch


H = 1024     # hidden size of the fake features: a unit of 60 tokens is ~0.5 MB, well above its metadata


def fake_stream(tmp_path, reuse, budget_units):
    """A producer thread over 30 fake samples whose features encode (sample, token); the budget holds
    the held-out unit and `budget_units` of the largest units (0: all of them)."""
    from eagle3.features import make_meta
    from eagle3.feature_writer import FeatureWriter
    from eagle3.stream import Stream, unit_reserve
    from eagle3.stream_producer import produce

    gen = torch.Generator().manual_seed(0)
    samples = [SimpleNamespace(id=f"c{i}", input_ids=torch.randint(0, 100, (int(n),), generator=gen).tolist())
               for i, n in enumerate(torch.randint(5, 30, (34,), generator=gen))]
    train, held = samples[:30], samples[30:]
    meta = make_meta(target_name="fake", target_fingerprint="f", arch="llama", aux_layers=[1], hidden_size=H,
                     tokenizer_name="", chat_template="", engine="fake", engine_version="0", data={})

    def capture(batch, out):
        w = FeatureWriter(out, meta, [x.id for x in batch], [len(x.input_ids) for x in batch],
                          dtype="float32", shard_tokens=10 ** 9)
        for x in batch:
            T, v = len(x.input_ids), float(x.id[1:])
            rows = torch.arange(T, dtype=torch.float32)[:, None] + 1000 * v
            w.add(x.id, x.input_ids, [1] * T, rows.expand(T, H), rows.expand(T, H) + 0.5)
        return w.finish()

    sched = Schedule([len(x.input_ids) for x in train], shard_tokens=60, batch_size=4, total=17, reuse=reuse)
    size = dict(meta_bytes=0, num_aux=1, hidden=H, dtype="float32")
    reserve = [unit_reserve([sched.lengths[i] for i in idx], [train[i].id for i in idx], **size) for idx in sched.plan]
    held_reserve = unit_reserve([len(x.input_ids) for x in held], [x.id for x in held], **size)
    budget = held_reserve + (budget_units * max(reserve) if budget_units else sum(reserve))
    st = Stream(tmp_path / "stream", sched, held, reserve, held_reserve, budget, {})
    st.root.mkdir()

    def start_producer(launched=False):
        thread = threading.Thread(target=produce, args=(st.root, sched, train, held, capture, reserve, held_reserve,
                                                        budget), kwargs={"launched": launched}, daemon=True)
        thread.start()
        return thread
    return st, train, start_producer


def read_steps(st, train, steps, sampler):
    """Train-side reads of `steps`: each batch holds the scheduled samples with their own features."""
    from eagle3.stream_reader import StreamReader

    reader = StreamReader(st.root, st.sched, 7, [x.id for x in train], {}, is_main=True)
    reader.start(steps[0])
    for step in steps:
        idx = reader.batch_of(step)
        bt = reader.make_batch(idx)
        want = [train[i].id for i in st.sched.batch(step, 7)]
        assert bt.sample_ids == want, step
        for b, sid in enumerate(want):
            T = len(train[int(sid[1:])].input_ids)
            assert torch.equal(bt.aux[b, :T, 0], torch.arange(T) + 1000.0 * int(sid[1:])), (step, sid)
        held = reader.make_batch([-1, -2])
        assert held.sample_ids == ["c30", "c31"]
        assert sampler.max <= st.budget, (step, sampler.max, st.budget)
    return reader


@pytest.mark.parametrize("reuse,budget_units", [(False, 2), (True, 2), (True, 0)])
def test_protocol_in_threads_reads_the_schedule_within_the_budget_across_a_resume(tmp_path, reuse, budget_units):
    """Producer thread, trainer reads: every batch is the scheduled samples with their features and
    the directory stays within the budget; a trainer that restarts at an earlier step (a resume)
    gets the units it had deleted captured again. Capturing every epoch, each unit read is written
    once more for the resume; with reuse and room for all, each shard is written once, plus those
    the trainer had already deleted as used for the last time."""
    st, train, start_producer = fake_stream(tmp_path, reuse, budget_units)
    sampler = DirSampler(st.root)
    sampler.start()
    producer = start_producer()
    try:
        read_steps(st, train, range(0, 14), sampler)      # killed after step 13
        reader = read_steps(st, train, range(5, 17), sampler)          # resumed from a step-5 checkpoint
        reader.close()
        producer.join(timeout=60)
        assert not producer.is_alive()
    finally:
        sampler.stop.set()
        sampler.join()
    sched = st.sched
    assert sampler.samples > 50 and sched.num_shards >= 5
    written = read(st.root / "producer.json")["units"]
    at_resume, at_kill = sched.span(5)[0], sched.span(13)[0]
    if not reuse:
        assert sampler.max > st.budget - 2 * max(st.reserve)          # the budget was what held it back
        logical = sum(sched.used(g) for g in range(sched.end))
        assert logical + (at_kill - at_resume) <= written <= logical + sched.span(13)[1] + 3 - at_resume
    elif budget_units == 0:
        names = {sched.name(g) for g in range(sched.end)}
        again = [n for n in names if sched.next_use(n, at_kill) is None and sched.next_use(n, at_resume) is not None]
        read_at_all = [n for n in names if sched.next_use(n, 0) is not None]   # not the remainder's shard
        assert again and written == len(read_at_all) + len(again)
    assert not [p for p in st.root.iterdir() if p.name.startswith(("p0", "s0"))]   # all acknowledged and deleted


def test_a_producer_on_a_finished_stream_waits_for_the_next_trainer(tmp_path, capsys):
    """The `done` of a finished run is not the next run's: a producer started then waits, and serves a
    trainer that starts the same schedule again in the same directory."""
    st, train, start_producer = fake_stream(tmp_path, reuse=False, budget_units=0)
    sampler = DirSampler(st.root)
    sampler.start()
    start_producer()
    read_steps(st, train, range(0, 17), sampler).close()
    again = start_producer()
    time.sleep(1.0)
    assert again.is_alive() and "is done; waiting for a new one" in capsys.readouterr().out
    try:
        read_steps(st, train, range(0, 17), sampler).close()
        again.join(timeout=60)
        assert not again.is_alive()
    finally:
        sampler.stop.set()
        sampler.join()


def test_a_producer_launched_by_a_trainer_already_done_stops(tmp_path):
    """A trainer resumed at its last step is done before the producer it launched reads trainer.json:
    that `done` is its own trainer's, so the producer stops instead of waiting for a new trainer (the
    trainer waits for it to exit: waiting would hang both)."""
    st, train, start_producer = fake_stream(tmp_path, reuse=False, budget_units=0)
    sampler = DirSampler(st.root)
    sampler.start()
    try:
        start_producer()
        read_steps(st, train, range(0, 17), sampler).close()
    finally:
        sampler.stop.set()
        sampler.join()
    launched = start_producer(launched=True)
    launched.join(timeout=30)
    assert not launched.is_alive()


def test_budget_below_one_batchs_shards_is_refused_with_sizes_and_fix():
    sched = Schedule([100] * 12, shard_tokens=300, batch_size=2, total=6)
    reserve = [600_000] * sched.num_shards
    check_budget(sched, reserve, 100_000, 1_300_000)     # a batch spans at most two shards
    with pytest.raises(StreamError) as e:
        check_budget(sched, reserve, 100_000, 1_000_000)
    msg = str(e.value)
    assert "1,000,000 bytes" in msg and "1,200,000" in msg and "600,000" in msg and "100,000" in msg
    assert "data.disk_budget_gb to at least 0.0013" in msg and "capture.shard_tokens" in msg


def test_train_py_refuses_a_budget_smaller_than_a_shard(tmp_path):
    p = subprocess.run([sys.executable, "train.py", *COMMON, f"run_dir={tmp_path}/run", "train.mode=stream",
                        f"data.stream_dir={tmp_path}/stream", "data.disk_budget_gb=0.0003"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "data.disk_budget_gb=0.0003 (300,000 bytes)" in p.stderr and "Raise data.disk_budget_gb to at least" in p.stderr
    assert not any((tmp_path / "stream").glob("p*"))


@pytest.mark.slow
def test_stream_holds_the_budget_and_trains_the_offline_weights(offline, tmp_path):
    """train.py launches the producer itself; the directory is sampled throughout the run."""
    stream = tmp_path / "stream"
    sampler = DirSampler(stream)
    sampler.start()
    try:
        out = finish(start("train.py", *COMMON, f"run_dir={tmp_path}/run", "train.mode=stream",
                           f"data.stream_dir={stream}", f"data.disk_budget_gb={BUDGET_GB}"))
    finally:
        sampler.stop.set()
        sampler.join()
    assert sampler.samples > 100
    assert 0 < sampler.max <= BUDGET_GB * GB, sampler.max
    assert "would pass the budget" in out                # the budget made the producer wait
    assert "[stream] trainer waits for" in out
    produced = json.loads((stream / "producer.json").read_text())
    assert produced["units"] > json.loads((stream / "stream.json").read_text())["num_shards"]   # epoch 2 captured again
    assert sorted(p.name for p in stream.iterdir()) == ["heldout", "producer.json", "producer.lock", "stream.json",
                                                        "trainer.json"]
    assert train_losses(tmp_path / "run") == train_losses(offline)
    assert_same_weights(tmp_path / "run", offline)


def read(path):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def wait_for(cond, procs, timeout=300):
    deadline = time.time() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(p.stdout.read()[-6000:])
        assert time.time() < deadline
        time.sleep(0.02)


@pytest.mark.slow
def test_reuse_keeps_shards_that_fit_and_captures_each_once(offline, tmp_path):
    """data.stream_reuse=true with room for every shard: the second epoch reads the first's shards,
    nothing is captured twice, and the weights are still the offline run's."""
    stream = tmp_path / "stream"
    finish(start("train.py", *COMMON, f"run_dir={tmp_path}/run", "train.mode=stream", f"data.stream_dir={stream}",
                 "data.disk_budget_gb=0.02", "data.stream_reuse=true"))
    assert read(stream / "producer.json")["units"] == read(stream / "stream.json")["num_shards"]
    assert_same_weights(tmp_path / "run", offline)


@pytest.mark.slow
def test_killed_trainer_and_killed_producer_resume_to_the_same_weights(offline, tmp_path):
    """Producer and trainer started on their own (as on two machines): SIGKILL the trainer after its
    step-4 checkpoint, resume it; then SIGKILL the producer mid-run, start it again."""
    stream = tmp_path / "stream"
    args = [*COMMON, "train.mode=stream", f"data.stream_dir={stream}", f"data.disk_budget_gb={BUDGET_GB}"]
    trainer_args = [*args, f"run_dir={tmp_path}/run", "capture.implicit=false"]
    producer = start("capture", *args, f"run_dir={tmp_path}/run")
    trainer = start("train.py", *trainer_args)
    sampler = DirSampler(stream)
    sampler.start()

    def trainer_at(step):
        state = read(stream / "trainer.json") or {}
        return state.get("step", 0) >= step and not state.get("done")
    try:
        wait_for(lambda: (tmp_path / "run" / "checkpoints" / "latest").exists() and trainer_at(6), [producer, trainer])
        trainer.kill()
        trainer.wait()
        trainer = start("train.py", *trainer_args, "resume=true")
        wait_for(lambda: trainer_at(7), [producer, trainer])
        producer.kill()
        producer.wait()
        units_before = read(stream / "producer.json")["units"]
        producer = start("capture", *args, f"run_dir={tmp_path}/run")
        out = finish(trainer)
        finish(producer)
    finally:
        sampler.stop.set()
        sampler.join()
    assert "resumed from" in out and "at step 4" in out
    assert 0 < sampler.max <= BUDGET_GB * GB, sampler.max
    assert read(stream / "producer.json")["units"] < units_before      # the restarted producer wrote units
    assert train_losses(tmp_path / "run") == train_losses(offline)
    assert_same_weights(tmp_path / "run", offline)
