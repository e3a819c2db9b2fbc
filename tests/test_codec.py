"""The compact feature format (eagle3/codec.py): 4-bit aux and the stored teacher, written, read back and
trained on.

Run: .venv/bin/python -m pytest tests/test_codec.py -q
Every value is checked against a computation written here: numpy nearest-level quantisation, and the
teacher from torch.softmax of the logits themselves.
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagle3 import codec
from eagle3.codec import Compact, dequantize_aux, encode_teacher, quantize_aux
from eagle3.loss import dense_teacher
from eagle3.batch import collate
from eagle3.features import FeatureDataset, FeatureDatasetError, check_draft_vocab, make_meta
from eagle3.feature_writer import FeatureWriter, open_capture
from eagle3.vocab import build_vocab

ROOT = Path(__file__).resolve().parents[1]
K, H, V, VD, TOPK = 3, 32, 300, 100, 8


# ----------------------------------------------------------------------------- references

def np_round_up_bf16(x: np.ndarray) -> np.ndarray:
    """Smallest bf16 >= x >= 0, as float32: keep the top 16 bits, step up one when that fell below x."""
    bits = x.astype(np.float32).view(np.uint32)
    down = bits & np.uint32(0xFFFF0000)
    up = np.where(down.view(np.float32) < x, down + np.uint32(0x10000), down)
    return up.astype(np.uint32).view(np.float32)


def np_quantize(x: np.ndarray, levels: np.ndarray, group: int):
    """Brute force: each value's nearest level (argmin over all 16) after dividing by its group's scale."""
    g = x.astype(np.float32).reshape(x.shape[0], -1, group)
    scale = np_round_up_bf16(np.abs(g).max(-1))
    y = g / np.maximum(scale, np.finfo(np.float32).tiny)[..., None]
    codes = np.abs(y[..., None] - levels[None, None, None, :]).argmin(-1).reshape(x.shape[0], -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale, (levels[codes].reshape(g.shape) * scale[..., None]).reshape(x.shape)


def reference_teacher(final, lm_head, draft_ids, topk):
    """fp64 logits -> (top-K draft ids and their probabilities of the draft-restricted softmax, c, argmax)."""
    logits = final.double() @ lm_head.double().T
    p_draft = torch.softmax(logits[:, draft_ids], -1)
    pk, ik = p_draft.topk(topk, -1)
    mass = torch.softmax(logits, -1)[:, draft_ids].sum(-1)
    return p_draft, ik, pk, mass, logits.argmax(-1)


# ----------------------------------------------------------------------------- codec

def test_quantize_matches_a_numpy_nearest_level_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, K * H, generator=g) * torch.exp(torch.randn(1, K * H, generator=g))
    x[3, 5] = 300.0                                        # an outlier: only its own group's scale grows
    x[7, :codec.GROUP_SIZE] = 0.0                          # an all-zero group decodes to zeros
    codes, scale = quantize_aux(x)
    ref_codes, ref_scale, ref_y = np_quantize(x.numpy(), codec.LEVELS.numpy(), codec.GROUP_SIZE)
    assert codes.dtype == torch.uint8 and codes.shape == (40, K * H // 2)
    assert scale.dtype == torch.bfloat16 and scale.shape == (40, K * H // codec.GROUP_SIZE)
    assert np.array_equal(scale.float().numpy(), ref_scale)
    assert np.array_equal(codes.numpy(), ref_codes)
    y = dequantize_aux(codes, scale)
    assert y.dtype == torch.bfloat16
    assert np.allclose(y.float().numpy(), ref_y, rtol=2 ** -8, atol=0)          # bf16 read-back only
    assert not y[7, :codec.GROUP_SIZE].any()
    # nothing is further from its value than half the widest gap between levels, times its scale
    half_gap = float((codec.LEVELS[1:] - codec.LEVELS[:-1]).max() / 2)
    err = (y.float() - x).abs().view(40, -1, codec.GROUP_SIZE)
    assert (err <= half_gap * scale.float()[..., None] * (1 + 2 ** -7) + 1e-6).all()
    rel = float((y.float() - x).norm() / x.norm())
    assert 0.01 < rel < 0.12                              # 4 bits: far from exact, far from noise


def test_teacher_is_the_top_k_of_the_draft_softmax_with_mass_and_argmax():
    g = torch.Generator().manual_seed(1)
    final, lm_head = torch.randn(50, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    draft_ids = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    final[0] = lm_head[draft_ids[0]] * 4                 # a row confidently inside the draft vocab
    outside = [i for i in range(V) if i not in set(draft_ids.tolist())][0]
    final[1] = lm_head[outside] * 4                      # and one whose argmax the drafter cannot draft
    enc = encode_teacher(final, lm_head, draft_ids, TOPK, chunk_rows=16)     # chunks: 16, 16, 16, 2 rows
    p_draft, ik, pk, mass, top = reference_teacher(final, lm_head, draft_ids, TOPK)
    assert enc["teacher_ids"].dtype == torch.int16 and enc["teacher_p"].dtype == torch.float16
    assert torch.equal(enc["teacher_ids"].long(), ik)
    assert torch.allclose(enc["teacher_p"].double(), pk, rtol=2 ** -10, atol=1e-7)
    assert torch.allclose(enc["teacher_mass"].double(), mass, rtol=1e-5)
    assert torch.equal(enc["teacher_top"].long(), top) and int(top[1]) == outside
    assert float(mass[1]) < 0.5 < float(mass[0])
    dense = dense_teacher(enc["teacher_ids"][None].long(), enc["teacher_p"][None], VD)[0]
    want = torch.zeros(50, VD, dtype=torch.float64).scatter(-1, ik, pk / pk.sum(-1, keepdim=True))
    assert torch.allclose(dense.double(), want, atol=1e-3) and torch.allclose(dense.sum(-1), torch.ones(50))
    full = encode_teacher(final, lm_head, draft_ids, VD)                    # K = Vd: the whole distribution
    assert torch.allclose(dense_teacher(full["teacher_ids"].long(), full["teacher_p"], VD).double(), p_draft,
                          atol=2e-4)


def test_bytes_per_token_at_kimi_width_fit_in_16_kb():
    kimi = codec.bytes_per_token(7168, 3, 32000, 32)
    assert kimi == 7168 * 3 // 2 + 2 * 7168 * 3 // 16 + 32 * 4 + 13 and kimi <= 16 * 1024
    assert codec.ids_dtype(32000) == "int16" and codec.ids_dtype(40000) == "int32"


# ----------------------------------------------------------------------------- dataset

def meta(name="tiny"):
    return make_meta(target_name=name, target_fingerprint="sha256:abc", arch="llama", aux_layers=[1, 2, 3],
                     hidden_size=H, tokenizer_name="tok", chat_template="{{x}}", engine="hf", engine_version="5",
                     data={"source": "fake", "heldout_ids": ["s6"]})


def fake(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(n):
        T = int(torch.randint(3, 20, (1,), generator=g))
        out.append(SimpleNamespace(id=f"s{s}", input_ids=torch.randint(0, V, (T,), generator=g),
                                   loss_mask=(torch.rand(T, generator=g) > 0.3).to(torch.uint8),
                                   aux=torch.randn(T, K * H, generator=g), final=torch.randn(T, H, generator=g)))
    return out


def compact_fmt(samples, topk=TOPK, vd=VD, seed=2):
    lm_head = torch.randn(V, H, generator=torch.Generator().manual_seed(seed)) * 0.5
    return Compact(codec.capture_vocab(samples, ["s6"], V, vd), topk, lm_head)


def write(path, samples, compact=None, order=None, **kw):
    w = FeatureWriter(path, meta(), [s.id for s in samples], [len(s.input_ids) for s in samples],
                      shard_tokens=30, compact=compact, **kw)
    for i in (order if order is not None else range(len(samples))):
        s = samples[i]
        w.add(s.id, s.input_ids, s.loss_mask, s.aux, s.final)
    return w.finish()


def test_compact_round_trip_holds_the_reference_values(tmp_path):
    samples = fake()
    fmt = compact_fmt(samples)
    ds = FeatureDataset(write(tmp_path / "ds", samples, fmt))
    ds.validate()
    m = ds.manifest
    assert m["format_version"] == 2 and m["feature_format"]["name"] == "compact"
    assert m["feature_format"]["aux"] == {"code": "nf4", "group_size": codec.GROUP_SIZE, "scale": "bfloat16"}
    assert m["feature_format"]["teacher"]["topk"] == TOPK and m["feature_format"]["teacher"]["draft_vocab_size"] == VD
    # the draft vocab: top-VD assistant tokens of the training samples (s6 is held out), stored beside the shards
    counts = torch.zeros(V, dtype=torch.int64)
    for s in samples[:6]:
        counts += torch.bincount(s.input_ids[s.loss_mask.bool()], minlength=V)
    assert torch.equal(ds.draft_vocab().d2t, build_vocab(counts, VD).d2t)
    assert torch.equal(ds.draft_vocab().t2d, fmt.vocab.t2d)
    for i, s in enumerate(samples):
        got = ds[i]
        assert set(got) == {"input_ids", "loss_mask", "aux_codes", "aux_scale", "teacher_ids", "teacher_p",
                            "teacher_mass", "teacher_top"}
        assert torch.equal(got["input_ids"], s.input_ids) and torch.equal(got["loss_mask"], s.loss_mask)
        _, _, ref_y = np_quantize(s.aux.numpy(), codec.LEVELS.numpy(), codec.GROUP_SIZE)
        aux = dequantize_aux(got["aux_codes"], got["aux_scale"])
        assert np.allclose(aux.float().numpy(), ref_y, rtol=2 ** -8, atol=0)
        _, ik, pk, mass, top = reference_teacher(s.final, fmt.lm_head, fmt.vocab.draft_ids, TOPK)
        assert torch.equal(got["teacher_ids"], ik) and torch.equal(got["teacher_top"], top)
        assert torch.allclose(got["teacher_p"].double(), pk, rtol=2 ** -10, atol=1e-7)
        assert torch.allclose(got["teacher_mass"].double(), mass, rtol=1e-5)
    tokens = m["totals"]["num_tokens"]
    per_token = sum(r["num_bytes"] for r in m["shards"]) - sum(header_and_offsets(tmp_path / "ds" / r["file"])
                                                                for r in m["shards"])
    assert per_token == tokens * codec.bytes_per_token(H, K, VD, TOPK)
    batch = collate([ds[0], ds[1]], ["s0", "s1"])
    n0 = len(samples[0].input_ids)
    assert batch.final is None and batch.teacher.p.shape == (2, batch.input_ids.shape[1], TOPK)
    assert torch.equal(batch.teacher.top[0, :n0], ds[0]["teacher_top"]) and not batch.teacher.p[0, n0:].any()
    # aux travels coded and is decoded by Batch.to: each sample's rows as decoded alone, padding zero
    assert batch.aux is None and batch.aux_codes.dtype == torch.uint8
    moved = batch.to("cpu", torch.float32)
    assert torch.equal(moved.aux[0, :n0], dequantize_aux(ds[0]["aux_codes"], ds[0]["aux_scale"]).float())
    assert not moved.aux[0, n0:].any() and moved.aux.shape == (2, batch.input_ids.shape[1], K * H)


def header_and_offsets(path):
    """Bytes of a shard that are not per token: the header and the offsets [S+1] int64."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    a, b = header["offsets"]["data_offsets"]
    return 8 + n + (b - a)


def test_compact_resume_and_arrival_order_change_no_byte(tmp_path):
    samples = fake()
    fmt = compact_fmt(samples)
    write(tmp_path / "a", samples, fmt)
    write(tmp_path / "b", samples, fmt, order=[6, 2, 0, 5, 1, 4, 3])
    ids, lens = [s.id for s in samples], [len(s.input_ids) for s in samples]
    w = FeatureWriter(tmp_path / "c", meta(), ids, lens, shard_tokens=30, compact=fmt)
    for i in w.plan[0]:
        w.add(samples[i].id, samples[i].input_ids, samples[i].loss_mask, samples[i].aux, samples[i].final)
    del w                                                    # "killed" after its first shard
    w = FeatureWriter(tmp_path / "c", meta(), ids, lens, shard_tokens=30, compact=fmt)
    for s in samples:
        if s.id not in w.done_ids():
            w.add(s.id, s.input_ids, s.loss_mask, s.aux, s.final)
    w.finish()
    for f in sorted(os.listdir(tmp_path / "a")):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() == \
            (tmp_path / "c" / f).read_bytes(), f
    FeatureWriter(tmp_path / "d", meta(), ids, lens, compact=fmt)
    with pytest.raises(FeatureDatasetError, match=r"feature_format\.teacher\.topk: earlier run 8, this run 4"):
        FeatureWriter(tmp_path / "d", meta(), ids, lens, compact=compact_fmt(samples, topk=4))


def test_unknown_format_is_refused_naming_the_file_and_the_known_formats(tmp_path):
    samples = fake()
    path = write(tmp_path / "ds", samples, compact_fmt(samples))
    mf = path / "manifest.json"
    m = json.loads(mf.read_text())
    for name, version in (("zstd", 1), ("compact", 9)):
        m["feature_format"].update(name=name, version=version)
        mf.write_text(json.dumps(m))
        with pytest.raises(FeatureDatasetError, match=rf"manifest\.json: feature format '{name}' version {version} is "
                                                      r"not one this code reads; known formats: full \(version 1\), "
                                                      r"compact \(version 1\)"):
            FeatureDataset(path)


def test_other_draft_vocab_and_other_storage_are_refused_naming_both(tmp_path):
    samples = fake()
    fmt = compact_fmt(samples)
    path = write(tmp_path / "ds", samples, fmt)
    check_draft_vocab(path, fmt.vocab)                                       # its own: fine
    other = compact_fmt(samples, vd=60).vocab
    with pytest.raises(FeatureDatasetError, match=r"this run's draft vocab \(60 tokens.*captured with \(100 tokens"):
        check_draft_vocab(path, other)
    full = write(tmp_path / "full", samples)
    check_draft_vocab(full, other)                                           # a full dataset takes any vocab
    ids, lens = [s.id for s in samples], [len(s.input_ids) for s in samples]
    with pytest.raises(FeatureDatasetError, match=r"feature format name is 'full', this capture asks for 'compact'"):
        open_capture(full, meta(), ids, lens, dtype="bfloat16", shard_tokens=30, compact=fmt)
    with pytest.raises(FeatureDatasetError, match=r"teacher\.topk is 8, this capture asks for 16"):
        open_capture(path, meta(), ids, lens, dtype="bfloat16", shard_tokens=30, compact=compact_fmt(samples, 16))
    assert open_capture(path, meta(), ids, lens, dtype="bfloat16", shard_tokens=30, compact=fmt) is None
    other.save(path / "draft_vocab.safetensors")                           # swapped after the capture
    with pytest.raises(FeatureDatasetError, match=r"draft_vocab\.safetensors: its draft vocab does not match"):
        FeatureDataset(path).draft_vocab()


# ----------------------------------------------------------------------------- training

def run(module, *overrides, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    p = subprocess.run([sys.executable, *module, *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    if check and p.returncode != 0:
        raise AssertionError(f"{module} {' '.join(overrides)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny experiment captured twice, full and compact with K = the whole draft vocab (2048)."""
    d = tmp_path_factory.mktemp("codec_tiny")
    common = ["+experiment=tiny", "train.steps=4", "train.log_every=1", "train.save_every=100"]
    run(["train.py"], *common, f"run_dir={d}/full", f"data.features_dir={d}/full_features")
    run(["-m", "capture"], "+experiment=tiny", f"data.features_dir={d}/compact_features", "capture.format=compact",
        "capture.teacher_topk=2048", f"run_dir={d}/capture")
    return d, common


def test_offline_training_from_compact_features_matches_full(tiny, tmp_path):
    """The same tiny capture stored compact with K = Vd: the stored teacher is the full one up to fp16,
    so the losses differ by what 4-bit aux does; the losses that need c (tv) train too."""
    d, common = tiny
    m = json.loads((d / "compact_features" / "manifest.json").read_text())
    full_m = json.loads((d / "full_features" / "manifest.json").read_text())
    assert m["feature_format"]["name"] == "compact" and "feature_format" not in full_m
    assert m["feature_format"]["teacher"]["topk"] == m["feature_format"]["teacher"]["draft_vocab_size"] == 2048
    run(["train.py"], *common, f"run_dir={tmp_path}/compact", f"data.features_dir={d}/compact_features")
    full, compact = losses(d / "full"), losses(tmp_path / "compact")
    assert len(full) == len(compact) == 4
    assert compact == pytest.approx(full, rel=2e-2) and compact != full
    run(["train.py"], *common, "train.steps=2", "train.loss=tv", f"run_dir={tmp_path}/tv_full",
        f"data.features_dir={d}/full_features")
    run(["train.py"], *common, "train.steps=2", "train.loss=tv", f"run_dir={tmp_path}/tv_compact",
        f"data.features_dir={d}/compact_features")
    assert losses(tmp_path / "tv_compact") == pytest.approx(losses(tmp_path / "tv_full"), rel=2e-2)


def test_training_with_another_draft_vocab_is_refused(tiny, tmp_path):
    d, common = tiny
    p = run(["train.py"], *common, "drafter.draft_vocab_size=1024", f"run_dir={tmp_path}/other",
            f"data.features_dir={d}/compact_features", check=False)
    err = p.stdout + p.stderr
    assert p.returncode != 0 and "this run's draft vocab (1024 tokens" in err and "(2048 tokens" in err


def test_parts_captured_apart_share_the_draft_vocab_of_all_training_samples(tmp_path):
    """The stream captures a shard's samples at a time: with vocab_samples, every part's teacher is over
    the draft vocab of all training samples; each part's own samples would give another vocab."""
    from omegaconf import OmegaConf

    from capture.hf import hf_meta, run_capture
    from eagle3.codec import FeatureFormat
    from eagle3.targets import load_target_model, resolve_target, target_info
    tcfg = OmegaConf.load(ROOT / "conf/target/tiny_llama.yaml")
    tdir = resolve_target("random", "", tcfg.name, "llama", OmegaConf.to_container(tcfg.random_config), 0)
    info = target_info(tdir)
    model = load_target_model(tdir, torch.float32, "cpu")
    g = torch.Generator().manual_seed(5)
    samples = [SimpleNamespace(id=f"s{i}", input_ids=torch.randint(0, info.vocab_size, (int(n),), generator=g),
                               loss_mask=(torch.rand(int(n), generator=g) > 0.2).to(torch.uint8))
               for i, n in enumerate(torch.randint(8, 40, (8,), generator=g))]
    m = hf_meta(target_name=info.name, target_fingerprint=info.fingerprint, arch=info.model_type,
                aux_layers=[1, 2, 3], hidden_size=info.hidden_size, tokenizer_name="tok", chat_template=None,
                data={"source": "fake", "heldout_ids": ["s7"]})
    fmt = FeatureFormat("compact", 4, 24)
    want = codec.vocab_sha256(codec.capture_vocab(samples, ["s7"], info.vocab_size, 24))
    shas = []
    for k, part in enumerate((samples[:4], samples[4:])):
        for vocab_samples, tag in ((samples, "all"), (None, "own")):
            out = run_capture(model, part, tmp_path / f"{tag}{k}", aux_layers=[1, 2, 3], meta=m, batch_tokens=64,
                              shard_tokens=64, dtype="float32", device="cpu", progress=False, fmt=fmt,
                              vocab_samples=vocab_samples)
            shas.append((tag, FeatureDataset(out).manifest["feature_format"]["teacher"]["draft_vocab_sha256"]))
    assert [s for t, s in shas if t == "all"] == [want, want]
    assert len({s for t, s in shas if t == "own"} | {want}) == 3      # each part alone: a vocab of its own



def test_a_compact_stream_reserves_what_a_compact_shard_takes(tmp_path):
    """train.mode=stream sizes each shard before its draft vocab is counted (codec.size_params): the
    reserve of a compact stream is the written shard's size, far below the full format's."""
    from eagle3.stream import shard_bytes
    samples = fake(6)
    ds = FeatureDataset(write(tmp_path / "ds", samples, compact_fmt(samples)))
    lengths = {s.id: len(s.input_ids) for s in samples}
    params = codec.size_params(V, VD, TOPK)
    compact = full = 0
    for rec in ds.manifest["shards"]:
        path = tmp_path / "ds" / rec["file"]
        lens = [lengths[i] for i in rec["sample_ids"]]
        size = path.stat().st_size
        assert shard_bytes(lens, K, H, "bfloat16", compact=params) == size, path.name
        # the data by its own formula: bytes_per_token a token, an int64 offset a sample and one more
        header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
        assert size - header == sum(lens) * codec.bytes_per_token(H, K, VD, TOPK) + 8 * (len(lens) + 1)
        compact += size
        full += shard_bytes(lens, K, H, "bfloat16")
    assert compact < full / 2
