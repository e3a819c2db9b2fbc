"""A disk that fills up during a shard write, a checkpoint and an export: the job stops with an error
naming the path and the bytes it needs, the last committed shard / checkpoint / export stays whole,
and the next run resumes from it. The full disk is a low-level write that raises ENOSPC after a
byte budget, so the failure lands mid-file.

Run: .venv/bin/python -m pytest tests/faults/test_faults_disk_full.py -q
"""
import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import checkpoint, export
from eagle3.features import FeatureDataset, make_meta
from eagle3.feature_writer import FeatureWriter

K, H = 3, 8


def samples(n=9):
    g = torch.Generator().manual_seed(0)
    out = []
    for s in range(n):
        T = int(torch.randint(3, 20, (1,), generator=g))
        out.append((f"s{s}", torch.randint(0, 1000, (T,), generator=g), (torch.rand(T, generator=g) > 0.5).byte(),
                    torch.randn(T, K * H, generator=g), torch.randn(T, H, generator=g)))
    return out


def writer(path, ss):
    m = make_meta(target_name="tiny", target_fingerprint="sha256:abc", arch="llama", aux_layers=[1, 2, 3],
                  hidden_size=H, tokenizer_name="tok", chat_template="", engine="hf", engine_version="0",
                  data={"source": "fake"})
    return FeatureWriter(path, m, [s[0] for s in ss], [len(s[1]) for s in ss], shard_tokens=30)


def disk_full_after(monkeypatch, budget: int):
    """os.pwrite writes `budget` more bytes, then raises ENOSPC (a partial write first, as a real disk does)."""
    real, left = os.pwrite, [budget]

    def pwrite(fd, data, offset):
        data = memoryview(data).cast("B")
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, data[:left[0]], offset)
        left[0] -= n
        return n
    monkeypatch.setattr(os, "pwrite", pwrite)


def test_shard_write_on_a_full_disk_names_the_shard_and_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    ss = samples()
    ref = writer(tmp_path / "ref", ss)
    for s in ss:
        ref.add(*s)
    ref.finish()
    w = writer(tmp_path / "ds", ss)
    first_shard = w.plan[0]
    for i in first_shard:                             # shard 0 committed before the disk fills
        w.add(*ss[i])
    disk_full_after(monkeypatch, 300)
    with pytest.raises(OSError, match=r"no space left on device writing .*shard-00001\.safetensors\.tmp: "
                                      r"a feature shard needs [\d,]+ bytes, [\d,]+ bytes free") as e:
        for s in ss[len(first_shard):]:
            w.add(*s)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert not list((tmp_path / "ds.partial").glob("*.tmp"))    # no half-written shard left behind
    w = writer(tmp_path / "ds", ss)                              # the next run keeps shard 0
    assert w.pending_shards() == w.plan[1:]
    for s in ss[len(first_shard):]:
        w.add(*s)
    w.finish()
    for rec in FeatureDataset(tmp_path / "ref").manifest["shards"]:
        assert (tmp_path / "ds" / rec["file"]).read_bytes() == (tmp_path / "ref" / rec["file"]).read_bytes()
    assert (tmp_path / "ds" / "manifest.json").read_text() == (tmp_path / "ref" / "manifest.json").read_text()


class OneProcess:
    """The part of accelerate.Accelerator that checkpoint.save uses, for one process."""
    is_main_process = True

    def __init__(self, fail_after=None):
        self.fail_after = fail_after

    def wait_for_everyone(self):
        pass

    def save_state(self, out):
        data = b"w" * 4096
        with open(Path(out) / "model.safetensors", "wb") as f:
            if self.fail_after is not None:
                f.write(data[:self.fail_after])
                raise OSError(errno.ENOSPC, "No space left on device")
            f.write(data)


def test_checkpoint_on_a_full_disk_keeps_the_previous_one_as_latest(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "vocab.safetensors").write_bytes(b"v" * 100)
    checkpoint.save(OneProcess(), run, 2, run / "vocab.safetensors")
    with pytest.raises(OSError, match=r"writing .*\.tmp_step_0000004: checkpoint of step 4; .*step_0000002 is kept "
                                      r"as the latest: needs [\d,]+ bytes"):
        checkpoint.save(OneProcess(fail_after=1000), run, 4, run / "vocab.safetensors")
    assert checkpoint.latest(run).name == "step_0000002"
    assert not (run / "checkpoints" / ".tmp_step_0000004").exists()
    assert checkpoint.step_of(checkpoint.latest(run)) == 2
    checkpoint.save(OneProcess(), run, 4, run / "vocab.safetensors")     # space again: the next save works
    assert checkpoint.latest(run).name == "step_0000004"


def test_export_on_a_full_disk_keeps_the_previous_export(tmp_path, monkeypatch):
    from test_faults_bad_inputs import tiny_export_args
    args = tiny_export_args()
    export.export_drafter(tmp_path / "export", *args)
    before = load_file(str(tmp_path / "export" / "vllm" / "model.safetensors"))
    real = export.save_file

    def full(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:                 # what was on disk when the space ran out
            f.truncate(100)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(export, "save_file", full)
    with pytest.raises(OSError, match=r"writing .*\.sglang-\w+: the sglang export \(the previous one at .*sglang "
                                      r"is kept\) needs [\d,]+ bytes"):
        export.export_drafter(tmp_path / "export", *args)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["sglang", "vllm"]
    after = load_file(str(tmp_path / "export" / "vllm" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    json.loads((tmp_path / "export" / "sglang" / "config.json").read_text())


def test_a_draft_vocab_write_that_fails_keeps_the_previous_file(tmp_path, monkeypatch):
    """train.py's resume reads run_dir/vocab.safetensors back, so a write cut short must not replace it."""
    import safetensors.torch
    from eagle3.vocab import DraftVocab
    v = DraftVocab(torch.tensor([0, 1]), torch.tensor([True, False, True, False, False]))
    v.save(tmp_path / "vocab.safetensors")
    real = safetensors.torch.save_file

    def full(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(20)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError):
        DraftVocab(torch.tensor([1, 1]), torch.tensor([False, True, False, True, False])).save(
            tmp_path / "vocab.safetensors")
    monkeypatch.undo()
    assert torch.equal(DraftVocab.load(tmp_path / "vocab.safetensors").d2t, v.d2t)
