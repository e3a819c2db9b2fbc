"""The feature dataset contract (eagle3/features.py): layout, resume, validation, memory mapping.

Run: .venv/bin/python -m pytest tests/test_features.py -q
Features here are random tensors, so every check is against values the test holds itself.
"""
import json
import os
import struct

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from eagle3.batch import Batch, collate
from eagle3.features import FeatureDataset, FeatureDatasetError, check_compatible, make_meta, plan_shards
from eagle3.feature_writer import FeatureWriter, open_capture

K, H = 3, 8


def meta(name="tiny", aux=(1, 2, 3)):
    return make_meta(target_name=name, target_fingerprint="sha256:abc", arch="llama", aux_layers=list(aux),
                     hidden_size=H, tokenizer_name="tok", chat_template="{{x}}", engine="hf",
                     engine_version="5.19.0", data={"source": "fake", "num_samples": 7, "max_length": 64})


def fake_samples(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(n):
        T = int(torch.randint(3, 20, (1,), generator=g))
        out.append({"id": f"s{s}", "input_ids": torch.randint(0, 1000, (T,), generator=g),
                    "loss_mask": (torch.rand(T, generator=g) > 0.5).to(torch.uint8),
                    "aux": torch.randn(T, K * H, generator=g), "final": torch.randn(T, H, generator=g)})
    return out


def write(path, samples, order=None, dtype="bfloat16", shard_tokens=30, m=None, aux_dtype=""):
    w = FeatureWriter(path, m or meta(), [s["id"] for s in samples], [len(s["input_ids"]) for s in samples],
                      dtype=dtype, shard_tokens=shard_tokens, aux_dtype=aux_dtype)
    for i in (order if order is not None else range(len(samples))):
        s = samples[i]
        w.add(s["id"], s["input_ids"], s["loss_mask"], s["aux"], s["final"])
    return w.finish()


def test_plan_shards_against_running_sum():
    lengths = [5, 9, 30, 2, 2, 40, 1, 7, 8, 9]
    plan = plan_shards(lengths, 16)
    assert [i for s in plan for i in s] == list(range(len(lengths)))   # ordered, every sample once
    for s in plan:                                       # a shard is over budget only when it is one sample
        assert sum(lengths[i] for i in s) <= 16 or len(s) == 1
    for a, b in zip(plan, plan[1:]):                     # greedy: the next sample would not have fit
        assert sum(lengths[i] for i in a) + lengths[b[0]] > 16
    assert plan == [[0, 1], [2], [3, 4], [5], [6, 7, 8], [9]]


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                               ("float32", torch.float32)])
def test_roundtrip_values(tmp_path, dtype, torch_dtype):
    samples = fake_samples()
    ds = FeatureDataset(write(tmp_path / "ds", samples, dtype=dtype))
    ds.validate()
    assert len(ds) == len(samples) and ds.manifest["totals"]["num_shards"] > 1
    for i, s in enumerate(samples):
        got = ds[i]
        assert ds.sample_id(i) == s["id"] and ds.length(i) == len(s["input_ids"])
        assert torch.equal(got["input_ids"], s["input_ids"]) and got["input_ids"].dtype == torch.long
        assert torch.equal(got["loss_mask"], s["loss_mask"])
        assert got["aux"].dtype == torch_dtype
        assert torch.equal(got["aux"], s["aux"].to(torch_dtype))      # storage is a plain cast
        assert torch.equal(got["final"], s["final"].to(torch_dtype))
    tot = ds.manifest["totals"]
    assert tot["num_tokens"] == sum(len(s["input_ids"]) for s in samples)
    assert tot["num_loss_tokens"] == sum(int(s["loss_mask"].sum()) for s in samples)
    assert tot["num_bytes"] == sum(os.path.getsize(tmp_path / "ds" / r["file"]) for r in ds.manifest["shards"])


def test_shards_are_standard_safetensors(tmp_path):
    """The safetensors library itself reads our hand-written shards and agrees (independent reader)."""
    samples = fake_samples()
    ds = FeatureDataset(write(tmp_path / "ds", samples, dtype="float32"))
    rec = ds.manifest["shards"][0]
    st = load_file(str(tmp_path / "ds" / rec["file"]))
    n = len(rec["sample_ids"])
    lens = [len(s["input_ids"]) for s in samples[:n]]
    assert st["offsets"].tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
    assert np.array_equal(st["aux"], torch.cat([s["aux"] for s in samples[:n]]).numpy())
    assert np.array_equal(st["input_ids"], torch.cat([s["input_ids"] for s in samples[:n]]).numpy())


def test_fp8_aux_is_row_scaled_e4m3_and_final_stays_exact(tmp_path):
    """aux_dtype=float8_e4m3fn: aux within e4m3's rounding of every row of every aux state (3
    mantissa bits: half an ulp is 2**-4 relative; subnormals below 2**-6 of the row's scale),
    each row-state's largest value kept to bf16 rounding, final bit-equal to the bf16 dataset,
    a safetensors reader agreeing on the stored bytes, and the bytes per token as computed."""
    from safetensors.torch import load_file as load_torch
    samples = fake_samples()
    samples[0]["aux"][2, :H] *= 1e4                       # one row of one state far larger than the rest
    ds = FeatureDataset(write(tmp_path / "fp8", samples, aux_dtype="float8_e4m3fn"))
    ref = FeatureDataset(write(tmp_path / "bf16", samples))
    ds.validate()
    assert ds.manifest["dtypes"]["aux"] == "float8_e4m3fn" and ds.manifest["dtypes"]["final"] == "bfloat16"
    for i, s in enumerate(samples):
        got, x = ds[i], s["aux"].view(-1, K, H)
        assert got["aux"].dtype == torch.bfloat16 and got["aux"].shape == s["aux"].shape
        assert torch.equal(got["final"], ref[i]["final"])
        y = got["aux"].float().view(-1, K, H)
        row_max = x.abs().amax(-1, keepdim=True)
        assert ((y - x).abs() <= 2 ** -4 * x.abs() * 1.05 + row_max * 2 ** -15).all()   # + bf16 read-back
        at_max = x.abs() == row_max
        assert torch.allclose(y[at_max], x[at_max], rtol=2 ** -8)
        assert rel_err(y, x) < 0.05
    rec = ds.manifest["shards"][0]
    st = load_torch(str(tmp_path / "fp8" / rec["file"]))
    assert st["aux"].dtype == torch.float8_e4m3fn and st["aux_scale"].shape == (rec["num_tokens"], K)
    n0 = len(samples[0]["input_ids"])
    assert torch.equal((st["aux"][:n0].float().view(n0, K, H) * st["aux_scale"][:n0, :, None])
                       .view(n0, -1).bfloat16(), ds[0]["aux"])
    # per token, aux drops from 2*K*H bytes to K*H (e4m3) + 4*K (the scales)
    tokens = ds.manifest["totals"]["num_tokens"]
    assert data_bytes(tmp_path / "fp8", ds) - data_bytes(tmp_path / "bf16", ref) == tokens * (4 * K - K * H)
    with pytest.raises(ValueError, match="aux only"):
        write(tmp_path / "bad", samples, dtype="float8_e4m3fn")


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def data_bytes(path, ds):
    """Bytes of the shards' tensors (file sizes less their safetensors headers)."""
    total = 0
    for r in ds.manifest["shards"]:
        with open(path / r["file"], "rb") as f:
            total += os.path.getsize(path / r["file"]) - 8 - struct.unpack("<Q", f.read(8))[0]
    return total


def test_arrival_order_does_not_change_bytes(tmp_path):
    samples = fake_samples()
    write(tmp_path / "a", samples)
    write(tmp_path / "b", samples, order=[6, 2, 0, 5, 1, 4, 3])
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(os.listdir(tmp_path / "b"))
    for f in names:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_resume_keeps_done_shards_and_drops_partial_work(tmp_path):
    samples = fake_samples()
    ids, lens = [s["id"] for s in samples], [len(s["input_ids"]) for s in samples]
    w = FeatureWriter(tmp_path / "ds", meta(), ids, lens, shard_tokens=30)
    first = w.plan[0]
    for i in first + [w.plan[1][0]]:                     # shard 0 complete, shard 1 started
        s = samples[i]
        w.add(s["id"], s["input_ids"], s["loss_mask"], s["aux"], s["final"])
    del w                                                # "killed": nothing finalised
    part = tmp_path / "ds.partial"
    assert (part / "shard-00001.safetensors.tmp").exists()
    w2 = FeatureWriter(tmp_path / "ds", meta(), ids, lens, shard_tokens=30)
    assert w2.done_ids() == {ids[i] for i in first}
    assert not (part / "shard-00001.safetensors.tmp").exists()
    for s in samples:
        if s["id"] not in w2.done_ids():
            w2.add(s["id"], s["input_ids"], s["loss_mask"], s["aux"], s["final"])
    w2.finish()
    write(tmp_path / "ref", samples)
    for f in sorted(os.listdir(tmp_path / "ref")):
        assert (tmp_path / "ds" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
    assert not part.exists()


def test_resume_with_other_meta_names_both_values(tmp_path):
    samples = fake_samples()
    ids, lens = [s["id"] for s in samples], [len(s["input_ids"]) for s in samples]
    FeatureWriter(tmp_path / "ds", meta("smollm2"), ids, lens)
    with pytest.raises(FeatureDatasetError, match=r"target\.name: earlier run 'smollm2', this run 'other'"):
        FeatureWriter(tmp_path / "ds", meta("other"), ids, lens)
    with pytest.raises(FeatureDatasetError, match=r"aux_layers: earlier run \[1, 2, 3\], this run \[1, 2, 4\]"):
        FeatureWriter(tmp_path / "ds", meta("smollm2", aux=(1, 2, 4)), ids, lens)
    with pytest.raises(FeatureDatasetError, match="plan_sha256"):           # other samples
        FeatureWriter(tmp_path / "ds", meta("smollm2"), ids, [n + 1 for n in lens])


def test_open_capture_resumes_then_keeps_the_finished_dataset(tmp_path, capsys):
    """open_capture: a writer that resumes committed shards; None once the dataset is finished and
    its manifest matches (another engine version included); a mismatch or other storage raises."""
    samples = fake_samples()
    ids, lens = [s["id"] for s in samples], [len(s["input_ids"]) for s in samples]
    w = open_capture(tmp_path / "ds", meta(), ids, lens, dtype="bfloat16", shard_tokens=30)
    for s in samples[:len(w.plan[0])]:                     # shard 0: the first samples, in order
        w.add(s["id"], s["input_ids"], s["loss_mask"], s["aux"], s["final"])
    w = open_capture(tmp_path / "ds", meta(), ids, lens, dtype="bfloat16", shard_tokens=30)
    assert f"1 of {len(w.plan)} shards already done" in capsys.readouterr().out
    for s in samples[len(w.plan[0]):]:
        w.add(s["id"], s["input_ids"], s["loss_mask"], s["aux"], s["final"])
    w.finish()
    newer = meta()
    newer["engine"]["version"] = "9.9"
    assert open_capture(tmp_path / "ds", newer, ids, lens, dtype="bfloat16", shard_tokens=30) is None
    with pytest.raises(FeatureDatasetError, match=r"target\.name"):
        open_capture(tmp_path / "ds", meta("other"), ids, lens, dtype="bfloat16", shard_tokens=30)
    with pytest.raises(FeatureDatasetError, match="capture.dtype"):
        open_capture(tmp_path / "ds", meta(), ids, lens, dtype="float16", shard_tokens=30)


def test_finish_refuses_missing_samples(tmp_path):
    samples = fake_samples()
    w = FeatureWriter(tmp_path / "ds", meta(), [s["id"] for s in samples], [len(s["input_ids"]) for s in samples])
    with pytest.raises(FeatureDatasetError, match="not complete"):
        w.finish()
    assert not (tmp_path / "ds").exists()


def test_truncated_shard_is_named(tmp_path):
    path = write(tmp_path / "ds", fake_samples())
    f = path / "shard-00001.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 10)
    with pytest.raises(FeatureDatasetError, match=rf"shard-00001\.safetensors: truncated: {size - 10} bytes"):
        FeatureDataset(path)
    # The manifest updated to agree with the short file: the header still gives it away.
    m = json.loads((path / "manifest.json").read_text())
    m["shards"][1]["num_bytes"] = size - 10
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FeatureDatasetError,
                       match=rf"shard-00001\.safetensors: truncated: {size - 10} bytes, header says {size}"):
        FeatureDataset(path).validate()


def test_bad_header_and_offsets_are_named(tmp_path):
    """A dataset written before shards carried a sha256 (none in the manifest) is read, and its
    structural checks still name a bad header or offsets."""
    path = write(tmp_path / "ds", fake_samples())
    m = json.loads((path / "manifest.json").read_text())
    for rec in m["shards"]:
        del rec["sha256"]
    (path / "manifest.json").write_text(json.dumps(m))
    assert len(FeatureDataset(path)) == len(fake_samples())
    f = path / "shard-00000.safetensors"
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    start = 8 + n + header["offsets"]["data_offsets"][0]
    raw[start + 8:start + 16] = struct.pack("<q", 10 ** 6)           # offsets[1] past the end
    f.write_bytes(bytes(raw))
    with pytest.raises(FeatureDatasetError, match=r"shard-00000\.safetensors: offsets are not monotone"):
        FeatureDataset(path).validate()
    raw[9] = ord("!")                                                  # break the JSON
    f.write_bytes(bytes(raw))
    with pytest.raises(FeatureDatasetError, match=r"shard-00000\.safetensors: header does not parse"):
        FeatureDataset(path).validate()


def test_other_target_is_reported_with_both_values(tmp_path):
    path = write(tmp_path / "ds", fake_samples(), m=meta("tiny_llama"))
    with pytest.raises(FeatureDatasetError, match=r"target\.name is 'tiny_llama', expected 'smollm2'"):
        FeatureDataset(path, expected={"target": {"name": "smollm2"}, "aux_layers": [1, 2, 3]})
    with pytest.raises(FeatureDatasetError, match=r"hidden_size is 8, expected 576"):
        check_compatible(FeatureDataset(path).manifest, {"hidden_size": 576})
    FeatureDataset(path, expected={"target": {"name": "tiny_llama"}, "aux_layers": (1, 2, 3), "hidden_size": 8})


def test_samples_are_views_of_the_file_mapping(tmp_path):
    """ds[i] aliases the mapped file: bytes written to the file afterwards show up in the tensor."""
    samples = fake_samples()
    path = write(tmp_path / "ds", samples, dtype="float32")
    ds = FeatureDataset(path)
    a, b = ds[0], ds[1]                                     # samples 0 and 1 share shard 0
    assert a["aux"].untyped_storage().data_ptr() == b["aux"].untyped_storage().data_ptr()
    assert b["aux"].data_ptr() - a["aux"].data_ptr() == a["aux"].numel() * 4   # consecutive rows
    f = path / "shard-00000.safetensors"
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    header = json.loads(f.read_bytes()[8:8 + n])
    pos = 8 + n + header["aux"]["data_offsets"][0] + a["aux"].shape[1] * 4     # aux row 1, col 0
    with open(f, "r+b") as fh:
        fh.seek(pos)
        fh.write(struct.pack("<f", 1234.5))
    assert a["aux"][1, 0].item() == 1234.5 != samples[0]["aux"][1, 0].item()
    a["aux"][0, 0] = -7.0                                   # copy-on-write: the file is untouched
    pos0 = 8 + n + header["aux"]["data_offsets"][0]
    assert struct.unpack("<f", f.read_bytes()[pos0:pos0 + 4])[0] == samples[0]["aux"][0, 0].item()


def test_collate_pads_right_with_zeros(tmp_path):
    samples = fake_samples()
    ds = FeatureDataset(write(tmp_path / "ds", samples))
    items = [ds[i] for i in (0, 1, 2)]
    batch = collate(items, [ds.sample_id(i) for i in (0, 1, 2)])
    T = max(len(s["input_ids"]) for s in samples[:3])
    assert batch.input_ids.shape == (3, T) and batch.aux.shape == (3, T, K * H) and batch.final.shape == (3, T, H)
    for b, s in enumerate(samples[:3]):
        n = len(s["input_ids"])
        assert batch.attention_mask[b].tolist() == [True] * n + [False] * (T - n)
        assert torch.equal(batch.input_ids[b, :n], s["input_ids"]) and not batch.input_ids[b, n:].any()
        assert torch.equal(batch.loss_mask[b, :n], s["loss_mask"].float()) and not batch.loss_mask[b, n:].any()
        assert torch.equal(batch.aux[b, :n], s["aux"].to(torch.bfloat16)) and not batch.aux[b, n:].any()
    moved = batch.to("cpu", torch.float32)
    assert isinstance(moved, Batch) and moved.aux.dtype == torch.float32 and moved.loss_mask.dtype == torch.float32
    assert moved.sample_ids == ["s0", "s1", "s2"]


def test_full_datasets_carry_no_format_field_and_old_manifests_still_read(tmp_path):
    """A full dataset's manifest is what it was before formats had names (no feature_format,
    format_version 1), so datasets written before read unchanged; one naming the full format
    explicitly reads too, and a format this code does not know is refused naming the file."""
    samples = fake_samples()
    path = write(tmp_path / "ds", samples)
    mf = path / "manifest.json"
    m = json.loads(mf.read_text())
    assert "feature_format" not in m and m["format_version"] == 1
    assert FeatureDataset(path).format == {"name": "full", "version": 1}
    m["feature_format"] = {"name": "full", "version": 1}
    mf.write_text(json.dumps(m))
    ds = FeatureDataset(path)
    assert torch.equal(ds[2]["final"], samples[2]["final"].bfloat16()) and ds.draft_vocab() is None
    for fmt, version, why in (("full", 2, r"feature format 'full' version 2 is not one this code reads"),
                              ("packed", 1, r"feature format 'packed' version 1 is not one this code reads; "
                                            r"known formats: full \(version 1\), compact \(version 1\)")):
        m["feature_format"] = {"name": fmt, "version": version}
        mf.write_text(json.dumps(m))
        with pytest.raises(FeatureDatasetError, match=rf"{tmp_path / 'ds' / 'manifest.json'}: {why}"):
            FeatureDataset(path)
    m["feature_format"] = {"name": "compact", "version": 1}             # compact in a version-1 container
    mf.write_text(json.dumps(m))
    with pytest.raises(FeatureDatasetError, match=r"format_version 1, this code reads 2 for the compact format"):
        FeatureDataset(path)


def test_layout_of_full_shards_is_unchanged(tmp_path):
    """The shard layout every existing full dataset was written with: tensor order and offsets."""
    from eagle3.shards import layout
    header, size = layout(2, 10, K, H, "BF16")
    assert [n for n in header if n != "__metadata__"] == ["offsets", "input_ids", "aux", "final", "loss_mask"]
    assert size == 3 * 8 + 10 * 4 + 10 * K * H * 2 + 10 * H * 2 + 10
    header, _ = layout(2, 10, K, H, "BF16", "F8_E4M3")
    assert [n for n in header if n != "__metadata__"] == ["offsets", "input_ids", "aux_scale", "final", "aux",
                                                         "loss_mask"]
    header, _ = layout(2, 10, K, H, "F32", "F8_E4M3")
    assert [n for n in header if n != "__metadata__"] == ["offsets", "input_ids", "aux_scale", "final", "aux",
                                                         "loss_mask"]
