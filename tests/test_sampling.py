"""Sampled regeneration: capture/fastgen.py's `pick` and decoders at temperature > 0, and the
answers' own cache file and held-out split.

    .venv/bin/python -m pytest tests/test_sampling.py -q

Independent truth: softmax(logits / T) computed in float64 from the model's own forward (the
prompt alone, unpadded), against the frequencies of thousands of sampled rows; each frequency must
lie within five standard errors of its probability.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from capture import fastgen
from capture import regenerate as R
from eagle3 import data as D
from eagle3.config import CaptureConfig, DataConfig, MixEntry, TargetConfig
from eagle3.data import build_samples
from eagle3.targets import smollm2_tokenizer, target_info
from tests.test_regenerate import tiny_target_and_source

ROWS = 6000
PROMPT = [3, 1, 4, 1, 5]


def within(counts: Counter, probs: torch.Tensor, n: int) -> None:
    for t, p in enumerate(probs.tolist()):
        se = max((p * (1 - p) / n) ** 0.5, 1 / n)
        assert abs(counts.get(t, 0) / n - p) < 5 * se, (t, counts.get(t, 0) / n, p)


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, -1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_pick_draws_from_the_tempered_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    torch.manual_seed(0)
    got = fastgen.pick(logits.expand(200_000, -1), temperature)
    within(Counter(got.tolist()), probs(logits, temperature), 200_000)
    assert fastgen.pick(logits.expand(3, -1), 0.0).tolist() == [0, 0, 0]


@pytest.fixture(scope="module")
def small_vocab_model():
    """Eight tokens and large weights: next-token distributions far from uniform and from one-hot."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.5)
    return LlamaForCausalLM(cfg).eval()


def next_probs(model, ids, temperature):
    with torch.no_grad():
        return probs(model(torch.tensor([ids])).logits[0, -1], temperature)


@pytest.mark.parametrize("decoder", ["static", "continuous"])
def test_sampled_tokens_follow_the_targets_distribution(small_vocab_model, decoder):
    """The first token (prefill) and the second (one decode step, after the commonest first token)."""
    m, T = small_vocab_model, 0.7
    torch.manual_seed(1)
    if decoder == "static":
        out = fastgen.StaticGreedy(m, 2, pad_id=0, temperature=T).generate([PROMPT] * ROWS)
    else:
        out = fastgen.ContinuousGreedy(m, 2, max_prompt=len(PROMPT), rows=ROWS, pad_id=0, check_every=2,
                                       temperature=T).generate([PROMPT] * ROWS)
    first = Counter(o[0] for o in out)
    p1 = next_probs(m, PROMPT, T)
    assert 0.05 < p1.max() < 0.95                  # a real distribution, not an argmax in disguise
    within(first, p1, ROWS)
    top, n = first.most_common(1)[0]
    within(Counter(o[1] for o in out if o[0] == top), next_probs(m, PROMPT + [top], T), n)


def test_temperature_zero_is_greedy_and_a_seed_repeats_its_samples(small_vocab_model):
    m = small_vocab_model
    prompts = [PROMPT, [2, 7], [6, 6, 6, 1]]
    assert fastgen.StaticGreedy(m, 12, pad_id=0, temperature=0.0).generate(prompts) == \
        fastgen.StaticGreedy(m, 12, pad_id=0).generate(prompts)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(fastgen.StaticGreedy(m, 12, pad_id=0, temperature=1.0).generate(prompts))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    with pytest.raises(ValueError, match="temperature"):
        fastgen.StaticGreedy(m, 4, pad_id=0, temperature=-1.0)


CONVS = [(f"c{i}", [{"role": "user", "content": f"Question number {i}?"},
                    {"role": "assistant", "content": "Original."}]) for i in range(40)]


def test_sampled_answers_are_cached_apart_and_split_with_their_conversations(tmp_path, monkeypatch):
    """capture.regen_temperature > 0: other answers, in another file than the greedy ones; a mix of
    the two files puts both answers to a conversation on the same side of the held-out split."""
    monkeypatch.setattr(D, "cache_root", lambda: tmp_path / "cache")
    tok = smollm2_tokenizer()
    _, target, target_dir = tiny_target_and_source(tmp_path)
    src = tmp_path / "forty.jsonl"
    src.write_text("".join(json.dumps({"id": cid, "messages": m}) + "\n" for cid, m in CONVS))
    info = target_info(target_dir)
    data = DataConfig(source="jsonl", path=str(src), max_length=256)
    files = {}
    for t in (0.0, 1.0):
        cap = CaptureConfig(backend="hf", regenerate=True, regen_max_new_tokens=8, device="cpu",
                            regen_batch_size=64, regen_chunk=64, regen_temperature=t)
        (files[t],) = R.regenerate(target_dir, target, data, cap, tok, info)
    assert files[0.0] != files[1.0]
    assert "temperature" not in json.loads(files[0.0].with_suffix(".key.json").read_text())
    answers = {t: {r["id"]: r["messages"][-1]["content"] for r in map(json.loads, open(f))}
               for t, f in files.items()}
    assert answers[0.0].keys() == answers[1.0].keys() == {cid for cid, _ in CONVS}
    assert sum(answers[0.0][c] != answers[1.0][c] for c in answers[0.0]) >= 30

    greedy, sampled = tmp_path / "greedy.jsonl", tmp_path / "sampled.jsonl"
    greedy.write_bytes(files[0.0].read_bytes())
    sampled.write_bytes(files[1.0].read_bytes())
    mix = [MixEntry("jsonl", str(greedy)), MixEntry("jsonl", str(sampled))]
    train, held, _ = build_samples(tok, "sharegpt", "", 0, 256, 0.3, mix=mix)
    side = {}
    for name, samples in (("train", train), ("held", held)):
        for s in samples:
            side.setdefault(s.id.split(":", 1)[1], set()).add(name)
    assert len(side) == 40 and all(len(v) == 1 for v in side.values())
    assert 2 * len([c for c, v in side.items() if v == {"held"}]) == len(held) > 0
    # the split is drawn from the bare conversation id, as in a single-source run
    single, single_held, _ = build_samples(tok, "jsonl", str(greedy), 0, 256, 0.3)
    assert {s.id for s in single_held} == {c for c, v in side.items() if v == {"held"}}
    assert all(D.is_heldout(s.id, 0.3, ["greedy", "sampled"]) for s in held)
    assert not any(D.is_heldout(s.id, 0.3, ["greedy", "sampled"]) for s in train)


def test_a_mix_entry_at_its_own_temperature_writes_what_capture_regen_temperature_would(tmp_path, monkeypatch):
    """One file named twice in data.mix, at temperatures 0 and 1: one regeneration writes both
    answer files, byte for byte those of two runs at capture.regen_temperature 0 and 1 (an entry's
    temperature wins over capture's), and training reads both answers to each conversation."""
    from eagle3.data import load_samples

    tok = smollm2_tokenizer()
    _, target, target_dir = tiny_target_and_source(tmp_path)
    src = tmp_path / "forty.jsonl"
    src.write_text("".join(json.dumps({"id": cid, "messages": m}) + "\n" for cid, m in CONVS))
    info = target_info(target_dir)
    kw = dict(backend="hf", regenerate=True, regen_max_new_tokens=8, device="cpu", regen_batch_size=64,
              regen_chunk=64)
    monkeypatch.setattr(D, "cache_root", lambda: tmp_path / "apart")
    data = DataConfig(source="jsonl", path=str(src), max_length=256, heldout_fraction=0.3)
    apart = [R.regenerate(target_dir, target, data, CaptureConfig(**kw, regen_temperature=t), tok, info)[0]
             for t in (0.0, 1.0)]

    monkeypatch.setattr(D, "cache_root", lambda: tmp_path / "mixed")
    mixed = DataConfig(mix=[MixEntry("jsonl", str(src), temperature=0.0), MixEntry("jsonl", str(src), temperature=1.0)],
                       max_length=256, heldout_fraction=0.3)
    cap = CaptureConfig(**kw, regen_temperature=0.5)
    paths = R.regenerate(target_dir, target, mixed, cap, tok, info)
    assert [p.name for p in paths] == [p.name for p in apart]
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in apart]

    _, train, held = load_samples(target_dir, target, mixed, cap)
    ids = [s.id for s in train + held]
    assert sorted(ids) == sorted(f"{name}:{cid}" for name in ("forty", "forty_t1") for cid, _ in CONVS)
    by_name = {n: {s.id.split(":", 1)[1] for s in held if s.id.split(":", 1)[0] == n} for n in ("forty", "forty_t1")}
    assert by_name["forty"] == by_name["forty_t1"] and 2 * len(by_name["forty"]) == len(held) > 0
    with pytest.raises(SystemExit, match="capture.regenerate=false reads the files' own answers"):
        load_samples(target_dir, target, mixed, CaptureConfig(regenerate=False))


def test_a_negative_temperature_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "cache_root", lambda: tmp_path / "cache")
    data = DataConfig(source="jsonl", path=str(tmp_path / "none.jsonl"))
    cap = CaptureConfig(backend="hf", regenerate=True, device="cpu", regen_temperature=-0.5)
    with pytest.raises(SystemExit, match="capture.regen_temperature=-0.5"):
        R.regenerate(tmp_path, TargetConfig(name="x"), data, cap, smollm2_tokenizer(), None)
    assert not (tmp_path / "cache").exists()
