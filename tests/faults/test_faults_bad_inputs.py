"""Bad inputs are refused with an error naming what is wrong, or counted and skipped by reason where
skipping loses nothing. docs/reliability.md lists these with the checks elsewhere in the suite.

Run: .venv/bin/python -m pytest tests/faults/test_faults_bad_inputs.py -q
"""
import dataclasses
import json
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3 import checkpoint, export
from eagle3.evaluation import DrafterMismatch, check_drafter_fits
from eagle3.features import FeatureDataset, FeatureDatasetError, check_compatible, make_meta
from eagle3.feature_writer import FeatureWriter
from eagle3.model import Eagle3Drafter
from eagle3.shape import DrafterShape

K, H = 3, 8
SHAPE = DrafterShape(hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=12, vocab_size=300, draft_vocab_size=100, target_hidden_size=48, num_aux=3)
TARGET = SimpleNamespace(name="t", vocab_size=300, hidden_size=48, num_layers=8, model_type="llama",
                         architectures=["LlamaForCausalLM"])


def tiny_export_args(fc_norm=False):
    """export_drafter's arguments after out_root, for a small random drafter over target TARGET."""
    torch.manual_seed(0)
    m = Eagle3Drafter(dataclasses.replace(SHAPE, fc_norm=fc_norm))
    d2t = torch.arange(100) * 2 - torch.arange(100)            # draft j -> target 2j
    t2d = torch.zeros(300, dtype=torch.bool)
    t2d[torch.arange(100) * 2] = True
    return m.exportable_state_dict(), m.shape, d2t, t2d, [2, 4, 5], ["LlamaForCausalLM"]


def meta(aux=(1, 2, 3), name="tiny"):
    return make_meta(target_name=name, target_fingerprint=f"sha256:{name}", arch="llama", aux_layers=list(aux),
                     hidden_size=H, tokenizer_name="tok", chat_template="", engine="hf", engine_version="0",
                     data={"source": "fake"})


def dataset(path, n=6, nan_at=None):
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(3, 20, (n,), generator=g)]
    w = FeatureWriter(path, meta(), [f"s{i}" for i in range(n)], lengths, shard_tokens=30)
    for i, T in enumerate(lengths):
        aux = torch.randn(T, K * H, generator=g)
        if i == nan_at:
            aux[1, 2] = float("nan")
        w.add(f"s{i}", torch.randint(0, 1000, (T,), generator=g), torch.ones(T, dtype=torch.uint8), aux,
              torch.randn(T, H, generator=g))
    return w.finish()


def flip_bit(f, byte_from_end=5):
    raw = bytearray(f.read_bytes())
    raw[-byte_from_end] ^= 0x10
    f.write_bytes(bytes(raw))


def test_a_bit_flipped_shard_is_refused_by_name_when_first_read(tmp_path):
    path = dataset(tmp_path / "ds")
    ds = FeatureDataset(path)
    for i in range(len(ds)):
        ds[i]
    flip_bit(path / "shard-00001.safetensors")               # same size, same header: only the hash sees it
    ds = FeatureDataset(path)                                # opening stays cheap: a stat per shard
    assert all(ds.length(i) > 0 for i in range(len(ds)))    # lengths read offsets only, nothing is hashed
    ds[0]                                                    # shard 0 is intact
    with pytest.raises(FeatureDatasetError, match=r"shard-00001\.safetensors: its bytes do not match the sha256"):
        for i in range(len(ds)):
            ds[i]
    with pytest.raises(FeatureDatasetError, match=r"shard-00001\.safetensors"):
        FeatureDataset(path).validate()


def test_a_committed_shard_flipped_before_resume_is_written_again(tmp_path):
    g = torch.Generator().manual_seed(1)
    lengths = [10, 10, 10, 10]
    rows = [(torch.randint(0, 9, (10,), generator=g), torch.ones(10, dtype=torch.uint8),
             torch.randn(10, K * H, generator=g), torch.randn(10, H, generator=g)) for _ in lengths]
    ids = ["a", "b", "c", "d"]
    w = FeatureWriter(tmp_path / "ds", meta(), ids, lengths, shard_tokens=20)
    for sid, r in zip(ids[:2], rows[:2]):
        w.add(sid, *r)                                        # shard 0 committed, then the job dies
    flip_bit(tmp_path / "ds.partial" / "shard-00000.safetensors")
    w = FeatureWriter(tmp_path / "ds", meta(), ids, lengths, shard_tokens=20)
    assert len(w.pending_shards()) == 2                      # the flipped shard is not kept
    for sid, r in zip(ids, rows):
        w.add(sid, *r)
    ds = FeatureDataset(w.finish())
    ds.validate()
    assert torch.equal(ds[0]["final"], rows[0][3].bfloat16())


def test_non_finite_features_are_refused_naming_the_sample(tmp_path):
    with pytest.raises(FeatureDatasetError, match=r"sample 's2': aux holds 1 non-finite values"):
        dataset(tmp_path / "ds", nan_at=2)


@pytest.mark.parametrize("expected,needle", [
    ({"target": {"fingerprint": "sha256:other"}}, "target.fingerprint is 'sha256:tiny', expected 'sha256:other'"),
    ({"aux_layers": [1, 2, 4]}, "aux_layers is [1, 2, 3], expected [1, 2, 4]"),
    ({"tokenizer": {"chat_template_sha256": "0" * 64}}, "tokenizer.chat_template_sha256 is"),
])
def test_a_manifest_from_another_target_aux_list_or_template_is_refused(tmp_path, expected, needle):
    path = dataset(tmp_path / "ds")
    with pytest.raises(FeatureDatasetError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        FeatureDataset(path, expected=expected)
    with pytest.raises(FeatureDatasetError, match="does not match"):
        check_compatible(FeatureDataset(path).manifest, expected)


def test_a_killed_metrics_write_and_a_killed_checkpoint_rename_resume(tmp_path):
    """A torn last metrics row is dropped at resume (not a crash); a save killed between moving the old
    checkpoint aside and renaming the new one in puts the old one back."""
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 0, "loss": 1}\n{"step": 1, "loss": 2}\n{"step": 2, "lo')
    checkpoint.trim_metrics(m, 2)
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()] == [0, 1]
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / ".old_step_0000004").mkdir(parents=True)
    (ckpts / ".old_step_0000004" / "trainer_state.json").write_text('{"step": 4}\n')
    (ckpts / "latest").write_text("step_0000004\n")
    assert checkpoint.latest(tmp_path / "run") == ckpts / "step_0000004"
    assert checkpoint.step_of(ckpts / "step_0000004") == 4


def test_an_export_killed_mid_write_leaves_nothing_the_next_export_keeps(tmp_path):
    args = tiny_export_args()
    (tmp_path / "export" / ".sglang-killed").mkdir(parents=True)        # a killed export's temp dir
    (tmp_path / "export" / ".sglang-killed" / "model.safetensors").write_bytes(b"half")
    (tmp_path / "export" / ".vllm-old").mkdir()                          # killed between its two renames
    export.export_drafter(tmp_path / "export", *args)
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["sglang", "vllm"]


@pytest.mark.parametrize("change,needle", [
    ("draft_vocab_size", "d2t has 100 entries, draft_vocab_size is 120"),
    ("lm_head", "lm_head.weight has 90 rows, d2t has 100"),
    ("other_engine", "eagle_aux_hidden_state_layer_ids [1, 3, 4] are not the vllm ids of aux layers [2, 4, 5]"),
    ("other_layers", "eagle_aux_hidden_state_layer_ids [1, 2, 3] are not the vllm ids of aux layers [2, 4, 5]"),
    ("out_of_range", "aux layers [2, 4, 8] out of range for a 8-layer target (valid: 1..7)"),
    ("no_ids", "eagle_config.eagle_aux_hidden_state_layer_ids is missing"),
])
def test_export_checks_refuse_a_wrong_draft_vocab_size_and_wrong_engine_ids(tmp_path, change, needle):
    written = export.export_drafter(tmp_path / "export", *tiny_export_args())
    tensors, cfg = export.load_export(written["vllm"])
    assert check_drafter_fits(cfg, TARGET, tensors, "vllm") == [2, 4, 5]
    if change == "draft_vocab_size":
        cfg["draft_vocab_size"] = 120
    elif change == "lm_head":
        tensors["lm_head.weight"] = tensors["lm_head.weight"][:90]
    elif change == "other_engine":                         # SGLang's ids (one lower) handed to vLLM
        cfg = export.load_export(written["sglang"])[1]
    elif change == "other_layers":
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    elif change == "out_of_range":
        cfg["eagle3"]["aux_layers"] = [2, 4, 8]
    elif change == "no_ids":
        del cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    with pytest.raises(DrafterMismatch, match="does not fit") as e:
        check_drafter_fits(cfg, TARGET, tensors, "vllm")
    assert needle in str(e.value)


def rewrite(export_dir, drop=(), add=()):
    """Edit an export's tensors on disk: the file an engine would be handed."""
    tensors = load_file(str(export_dir / "model.safetensors"))
    for name in drop:
        del tensors[name]
    for name in add:
        tensors[name] = torch.zeros(4)
    save_file(tensors, str(export_dir / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("fc_norm", [False, True])
def test_an_export_with_a_missing_or_an_extra_tensor_is_refused_naming_both(tmp_path, fc_norm):
    """Engines load by name: they skip a tensor they have no module for and keep a module whose tensor
    is absent at its initial values, so either would serve another drafter than the one trained."""
    state, shape, *rest = tiny_export_args(fc_norm)
    written = export.export_drafter(tmp_path / "export", state, shape, *rest)
    for engine, where in written.items():                  # intact exports of both layouts pass
        assert check_drafter_fits(*_fits_args(where), engine=engine) == [2, 4, 5]
    sharded = tmp_path / "sharded"
    export.reshard_export(written["sglang"], sharded, max_shard_bytes=40_000)
    assert check_drafter_fits(*_fits_args(sharded), engine="sglang") == [2, 4, 5]
    gone = "fc_norm.1.weight" if fc_norm else "midlayer.mlp.up_proj.weight"
    for engine, where in written.items():
        rewrite(where, drop=[gone], add=["midlayer.self_attn.qkv_proj.weight"])
        with pytest.raises(DrafterMismatch) as e:
            check_drafter_fits(*_fits_args(where), engine=engine, where=f"drafter {where}")
        msg = str(e.value)
        assert f"drafter {where} does not fit" in msg
        assert f"missing ['{gone}'], extra ['midlayer.self_attn.qkv_proj.weight']" in msg
        assert "python -m eagle3.export RUN_DIR" in msg


def test_fc_norm_weights_must_match_what_the_config_says(tmp_path):
    """fc_norm weights under a config without fc_norm are extra (an engine would drop them), and a
    config with fc_norm but no weights is missing them (an engine would keep its norms at ones)."""
    written = export.export_drafter(tmp_path / "export", *tiny_export_args(fc_norm=True))
    tensors, cfg = export.load_export(written["vllm"])
    norms = [f"fc_norm.{i}.weight" for i in range(3)]
    with pytest.raises(DrafterMismatch, match=r"\(fc_norm=False\): missing none, extra " + re.escape(str(norms))):
        check_drafter_fits(dict(cfg, fc_norm=False), TARGET, tensors, "vllm")
    with pytest.raises(DrafterMismatch, match=r"\(fc_norm=True\): missing " + re.escape(str(norms)) + ", extra none"):
        check_drafter_fits(cfg, TARGET, {k: v for k, v in tensors.items() if k not in norms}, "vllm")


def _fits_args(export_dir):
    tensors, cfg = export.load_export(export_dir)
    return cfg, TARGET, tensors


@pytest.fixture(scope="module")
def smol():
    from eagle3.targets import smollm2_tokenizer
    return smollm2_tokenizer()


def test_bad_conversation_lines_are_counted_by_reason(smol, tmp_path):
    """Empty, over-long, non-JSON and non-UTF-8 lines of a conversations file: the good records are
    used, every other line is counted under its reason, and an over-long one is truncated to max_length."""
    from eagle3.data import build_samples, write_jsonl
    ok = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
    long = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "word " * 400}]}
    path = tmp_path / "convs.jsonl"
    write_jsonl(path, [ok, {"messages": []}, long])
    with open(path, "ab") as f:
        f.write(b"{not json\n")
        f.write(b'{"conversations": [{"from": "human", "value": "\xff\xfe"}]}\n')
        f.write(json.dumps(ok).encode() + b"\n")
    train, held, rep = build_samples(smol, "jsonl", str(path), 0, 64, 0.0)
    assert rep.bad.get("empty") == 1 and rep.bad.get("invalid json") == 1
    assert sum(rep.bad.values()) == 3                        # the non-UTF-8 line is counted, not a crash
    assert len(train) == 3 and max(len(s.input_ids) for s in train) == 64


def test_zero2_kills_need_a_gpu_and_say_so(tmp_path, monkeypatch):
    """train_zero2 kills DeepSpeed runs, which train only under a GPU: without one the harness refuses
    that kind by name before running anything, and leaves it out of its default kinds."""
    from eagle3 import faults
    monkeypatch.setattr(faults.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--kinds train_zero2 needs a GPU"):
        faults.main(["--kinds", "train_zero2", "--runs", "1", "--work", str(tmp_path)])
    assert not (tmp_path / "ref_features").exists()                 # refused before any reference ran
    assert faults.default_kinds() == ["capture", "sglang", "regenerate", "train", "stream", "export"]
    monkeypatch.setattr(faults.torch.cuda, "is_available", lambda: True)
    assert faults.default_kinds()[-1] == "train_zero2"
