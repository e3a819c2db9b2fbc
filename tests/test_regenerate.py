"""Response regeneration (capture/regenerate.py) on a tiny random Llama with SmolLM2's tokenizer.

    .venv/bin/python -m pytest tests/test_regenerate.py -q

Independent truth: for every regenerated assistant turn, transformers' own greedy `generate` on
that turn's rendered prompt alone (no batching, no padding), cut at the end-of-turn token.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from capture import answer_cache
from capture import answer_engines as E
from capture import regenerate as R
from eagle3 import data as D
from eagle3 import chat
from eagle3.config import CaptureConfig, DataConfig, TargetConfig
from eagle3.data import build_samples, load_samples
from eagle3.targets import load_tokenizer, resolve_target, smollm2_tokenizer, target_info

NEW = 6
CONVS = [
    ("a", [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
           {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Red."}]),
    ("b", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
           {"role": "assistant", "content": "Hi."}]),
    ("c", [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "Why?"},
           {"role": "user", "content": "Really, why?"}, {"role": "assistant", "content": "Because."},
           {"role": "user", "content": "And then?"}]),
]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval()


def reference_answer(model, tok, messages, stop_ids):
    """transformers' greedy generate on one unpadded prompt, cut at the first end-of-turn token."""
    ids = torch.tensor([chat.render_prompt(tok, messages)])
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=NEW, eos_token_id=stop_ids,
                             pad_token_id=stop_ids[0])
    new, _ = E.cut_at_stop(out[0, ids.shape[1]:].tolist(), stop_ids)
    return tok.decode(new, skip_special_tokens=False)


def read(path):
    return [json.loads(line) for line in open(path)]


def test_answers_are_greedy_generate_and_resume_skips_done_ids(tok, model, tmp_path):
    stop_ids = chat.stop_ids(tok)
    calls = []

    def counting(gen):
        def run(prompts):
            calls.append(len(prompts))
            return gen(prompts)
        return run

    path = tmp_path / "regen.jsonl"
    gen = counting(E.hf_generate(model, stop_ids, NEW, batch_size=2))   # batches of 2, left padding
    R.regenerate_conversations(CONVS, tok, gen, path, max_prompt_tokens=1024, progress=False)
    recs = read(path)
    assert [r["id"] for r in recs] == ["a", "b", "c"]
    # Structure: original assistant turns dropped, one answer after every run of user turns.
    roles = [[m["role"] for m in r["messages"]] for r in recs]
    assert roles == [["user", "assistant", "user", "assistant"], ["system", "user", "assistant"],
                     ["user", "user", "assistant", "user", "assistant"]]
    originals = {cid: [m for m in msgs if m["role"] != "assistant"] for cid, msgs in CONVS}
    n_answers = 0
    for r in recs:
        assert [m for m in r["messages"] if m["role"] != "assistant"] == originals[r["id"]]
        for i, m in enumerate(r["messages"]):
            if m["role"] == "assistant":
                assert m["content"] == reference_answer(model, tok, r["messages"][:i], stop_ids)
                assert m["content"] not in ("Blue.", "Red.", "Hi.", "Because.")
                n_answers += 1
    assert n_answers == 5 and sum(calls) == 5
    assert all(len(r["regen"]["new_tokens"]) == len(r["regen"]["finished"]) for r in recs)

    # Resume: a torn last line is cut off, done ids are skipped, only the new conversation runs.
    first = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"id": "d", "messa')
    calls.clear()
    extra = ("d", [{"role": "user", "content": "One more question."}])
    R.regenerate_conversations(CONVS + [extra], tok, gen, path, max_prompt_tokens=1024, progress=False)
    assert calls == [1] and path.read_bytes().startswith(first)
    assert [r["id"] for r in read(path)] == ["a", "b", "c", "d"]


def test_a_time_limit_keeps_finished_chunks_and_a_rerun_completes_them(tok, model, tmp_path):
    import time

    stop_ids = chat.stop_ids(tok)
    gen = E.hf_generate(model, stop_ids, NEW, batch_size=4)

    def slow(prompts):              # every round takes 0.3 s, so a one-conversation chunk >= 0.3 s
        time.sleep(0.3)
        return gen(prompts)

    whole = tmp_path / "whole.jsonl"
    R.regenerate_conversations(CONVS, tok, gen, whole, max_prompt_tokens=1024, progress=False, chunk=1)
    path = tmp_path / "limited.jsonl"
    # chunk 1 ("a", two rounds) runs ~0.6 s; at that pace chunk 2 would end past 1 s: stop there
    R.regenerate_conversations(CONVS, tok, slow, path, max_prompt_tokens=1024, progress=False, chunk=1,
                               minutes=1.0 / 60)
    assert [r["id"] for r in read(path)] == ["a"]
    R.regenerate_conversations(CONVS, tok, gen, path, max_prompt_tokens=1024, progress=False, chunk=1)
    assert read(path) == read(whole)


def test_a_prompt_at_max_length_ends_the_conversation(tok, model, tmp_path):
    stop_ids = chat.stop_ids(tok)
    first = len(chat.render_prompt(tok, CONVS[0][1][:1]))
    path = tmp_path / "regen.jsonl"
    R.regenerate_conversations(CONVS[:1], tok, E.hf_generate(model, stop_ids, NEW), path,
                               max_prompt_tokens=first + NEW + 2, progress=False)
    (rec,) = read(path)
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]   # turn 2 would be cut away


def tiny_target_and_source(tmp_path):
    """CONVS as a jsonl source, and a tiny random Llama target resolved like any experiment's."""
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps({"id": cid, "messages": m}) + "\n" for cid, m in CONVS))
    rc = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 1024}
    target = TargetConfig(name="tiny_regen", source="random", arch="llama", random_config=rc)
    return src, target, resolve_target(target.source, "", target.name, target.arch, rc, 0)


def test_loading_only_reads_the_regenerated_conversations(tok, tmp_path, monkeypatch):
    """Before regeneration, loading stops naming the file and the command that writes it; after it,
    the samples are the regenerated file's, not the source's."""
    monkeypatch.setattr(D, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(D.sys, "argv", ["train.py", "+experiment=smollm2_peer", "resume=true"])
    src, target, target_dir = tiny_target_and_source(tmp_path)
    data = DataConfig(source="jsonl", path=str(src), num_samples=3, max_length=256, heldout_fraction=0.0)
    cap = CaptureConfig(backend="hf", regenerate=True, regen_max_new_tokens=NEW, device="cpu")
    with pytest.raises(SystemExit) as stop:
        load_samples(target_dir, target, data, cap)
    (src,) = D.mix_sources(data.mix, data.source, data.path)
    path = D.regenerated_path(target_info(target_dir).fingerprint, tok, src, data, NEW)
    assert str(path) in str(stop.value)
    assert "python -m capture +experiment=smollm2_peer capture.regenerate_only=true" in str(stop.value)
    assert not (tmp_path / "cache").exists()                  # nothing was generated

    assert R.regenerate(target_dir, target, data, cap, tok, target_info(target_dir)) == [path]
    tok2, train, _ = load_samples(target_dir, target, data, cap)
    recs = {r["id"]: r for r in read(path)}
    assert [s.id for s in train] == ["a", "b", "c"]
    ref, _, _ = build_samples(tok2, "jsonl", str(path), 0, 256, 0.0)
    assert [(s.id, s.input_ids, s.loss_mask) for s in train] == [(s.id, s.input_ids, s.loss_mask) for s in ref]
    for s in train:
        text = tok2.decode(s.input_ids)
        assert "Blue." not in text and recs[s.id]["messages"][-1]["content"] in text


def test_a_stopped_regeneration_stays_partial_until_a_rerun_completes_it(tok, tmp_path, monkeypatch):
    """Answers go to <key>.partial.jsonl; only a complete set is renamed to the path loading reads."""
    monkeypatch.setattr(D, "cache_root", lambda: tmp_path / "cache")
    src, target, target_dir = tiny_target_and_source(tmp_path)
    data = DataConfig(source="jsonl", path=str(src), max_length=256)
    cap = CaptureConfig(backend="hf", regenerate=True, regen_max_new_tokens=NEW, device="cpu", regen_chunk=1)
    info = target_info(target_dir)
    path = D.regenerated_path(info.fingerprint, tok, D.mix_sources([], data.source, data.path)[0], data, NEW)
    partial = path.with_name(f"{path.stem}.partial.jsonl")
    partial.parent.mkdir(parents=True)
    partial.write_text(json.dumps({"id": "a", "messages": [], "regen": {}}) + "\n")   # as if stopped after "a"
    assert R.regenerate(target_dir, target, data, cap, tok, info) == [path]
    assert [r["id"] for r in read(path)] == ["a", "b", "c"] and not partial.exists()


def test_two_workers_write_the_same_cache_as_one(tok, tmp_path, monkeypatch):
    """regen_workers=2 (two CPU processes here, two GPUs on a GPU machine): parts merged in
    conversation order, equal to the single-process cache, and removed afterwards."""
    src, target, target_dir = tiny_target_and_source(tmp_path)
    data = DataConfig(source="jsonl", path=str(src), max_length=256)
    caches = []
    for workers in (1, 2):
        monkeypatch.setattr(D, "cache_root", lambda w=workers: tmp_path / f"cache{w}")
        cap = CaptureConfig(backend="hf", regenerate=True, regen_max_new_tokens=NEW, device="cpu",
                            regen_workers=workers)
        caches += R.regenerate(target_dir, target, data, cap, tok, target_info(target_dir))
    assert caches[0].read_text() == caches[1].read_text()
    assert [r["id"] for r in read(caches[1])] == ["a", "b", "c"]
    assert sorted(p.name for p in caches[1].parent.iterdir()) == sorted([caches[1].name, f"{caches[1].stem}.key.json"])


def test_a_run_of_another_size_reuses_the_answers_it_shares(tok, tmp_path, monkeypatch):
    """data.num_samples=2, then all: only the third conversation is answered, and the file equals
    the one a fresh run of all writes. All, then 2: nothing is answered. A run that differs in
    anything else (the answer length here) reuses nothing."""
    src, target, target_dir = tiny_target_and_source(tmp_path)
    info = target_info(target_dir)
    answered, original = [], R._answer

    def spy(*args):
        answered.append([cid for cid, _ in args[6]])            # the conversations left to answer
        return original(*args)

    monkeypatch.setattr(R, "_answer", spy)

    def run(cache, n, new=NEW):
        monkeypatch.setattr(D, "cache_root", lambda: tmp_path / cache)
        data = DataConfig(source="jsonl", path=str(src), num_samples=n, max_length=256)
        cap = CaptureConfig(backend="hf", regenerate=True, regen_max_new_tokens=new, device="cpu")
        answered.clear()
        (path,) = R.regenerate(target_dir, target, data, cap, tok, info)
        return path, list(answered)

    fresh, asked = run("fresh", 0)
    assert asked == [["a", "b", "c"]]

    two, asked = run("grow", 2)
    assert asked == [["a", "b"]]
    grown, asked = run("grow", 0)
    assert asked == [["c"]]
    assert grown.read_text() == fresh.read_text() and read(grown)[:2] == read(two)
    assert json.loads(grown.with_name(f"{grown.stem}.key.json").read_text())["num_samples"] == 0

    run("shrink", 0)
    fewer, asked = run("shrink", 2)
    assert asked == [] and read(fewer) == read(fresh)[:2]

    _, asked = run("grow", 2, new=NEW - 1)
    assert asked == [["a", "b"]]


def test_reuse_takes_only_records_that_follow_this_runs_conversations(tmp_path):
    """A file whose records stop matching the conversations' ids (another source order, a torn
    last line) gives only its matching leading records."""
    f = tmp_path / "x.jsonl"
    f.write_text("".join(json.dumps({"id": i}) + "\n" for i in ["a", "b", "z", "c"]) + '{"id": "d"')
    assert [json.loads(x)["id"] for x in answer_cache.leading_records(f, ["a", "b", "c", "d"])] == ["a", "b"]
    assert [json.loads(x)["id"] for x in answer_cache.leading_records(f, ["a", "b", "z", "c", "d"])] == ["a", "b", "z", "c"]
    assert answer_cache.leading_records(f, ["b"]) == [] and answer_cache.leading_records(tmp_path / "none.jsonl", ["a"]) == []


def test_first_turns_under_a_length_select_the_same_conversations_for_regeneration_and_training(
        tok, monkeypatch):
    """data.turns=1, data.max_prompt_chars=50: the regeneration's prompts and build_samples' samples
    are the same conversations, each cut before its second user message."""
    convs = CONVS + [("long", [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "ok"}]),
                     ("e", [{"role": "user", "content": "y" * 49}, {"role": "assistant", "content": "fine"}])]
    monkeypatch.setattr(R, "iter_conversations", lambda source, path: iter(convs))
    data = DataConfig(source="jsonl", turns=1, max_prompt_chars=50)
    src = D.Source("", "jsonl", "")
    picked = R.source_conversations(src, data)
    assert [cid for cid, _ in picked] == ["a", "b", "c", "e"]
    assert [m["content"] for m in dict(picked)["a"]] == ["Name a colour.", "Blue."]
    assert [m["content"] for m in dict(picked)["c"]] == ["I speak first.", "Why?"]
    assert R.source_conversations(src, DataConfig(source="jsonl", turns=1, max_prompt_chars=50, num_samples=2)) \
        == picked[:2]


def test_build_samples_applies_the_same_selection(tok, tmp_path):
    convs = CONVS + [("long", [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "ok"}])]
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps({"id": cid, "messages": m}) + "\n" for cid, m in convs))
    train, _, report = build_samples(tok, "jsonl", str(src), 0, 256, 0.0, turns=1, max_prompt_chars=50)
    # "c" keeps [assistant, "Why?"]: no answer to its first user message, so nothing to train on
    assert [s.id for s in train] == ["a", "b"]
    assert report.bad == {"first user turn too long": 1, "nothing to train on": 1}
    text = tok.decode(train[0].input_ids)
    assert "Blue." in text and "Another one?" not in text
    full, _, _ = build_samples(tok, "jsonl", str(src), 0, 256, 0.0)
    assert len(train[0].input_ids) < len(full[0].input_ids)


def test_a_two_source_mix_keeps_every_user_prompt_and_its_weights(tok, tmp_path, monkeypatch):
    """data.mix of two files, weights 1 and 2: each source is answered once into its own cache file
    (a weight changes how often an answer is used, not the answer), every user turn of both sources
    is kept word for word, and training reads the answers with the sources' names and weights."""
    from eagle3.config import MixEntry

    monkeypatch.setattr(D, "cache_root", lambda: tmp_path / "cache")
    _, target, target_dir = tiny_target_and_source(tmp_path)
    sources = {"mine": CONVS[:2], "theirs": CONVS[2:] + [("d", [{"role": "user", "content": "One more question."}])]}
    for name, convs in sources.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"id": c, "messages": m}) + "\n" for c, m in convs))
    mix = [MixEntry("jsonl", str(tmp_path / "mine.jsonl"), 1.0), MixEntry("jsonl", str(tmp_path / "theirs.jsonl"), 2.0)]
    data = DataConfig(mix=mix, max_length=256, heldout_fraction=0.0)
    cap = CaptureConfig(backend="hf", regenerate=True, regen_max_new_tokens=NEW, device="cpu")
    info = target_info(target_dir)
    paths = R.regenerate(target_dir, target, data, cap, tok, info)
    assert len(paths) == 2 and all(p.exists() for p in paths)
    for path, (name, convs) in zip(paths, sources.items()):
        recs = read(path)
        assert [r["id"] for r in recs] == [c for c, _ in convs]
        for r, (_, msgs) in zip(recs, convs):
            assert [m for m in r["messages"] if m["role"] != "assistant"] == [m for m in msgs if m["role"] != "assistant"]
    heavier = DataConfig(mix=[mix[0], MixEntry("jsonl", mix[1].path, 3.0)], max_length=256)
    assert R.regenerate(target_dir, target, heavier, cap, tok, info) == paths     # nothing to answer again
    _, train, _ = load_samples(target_dir, target, data, cap)
    assert [s.id for s in train] == ["mine:a", "mine:b", "theirs:c", "theirs:c~copy1", "theirs:d", "theirs:d~copy1"]
    text = "".join(tok.decode(s.input_ids) for s in train)
    for _, convs in sources.items():
        for _, msgs in convs:
            assert all(m["content"] in text for m in msgs if m["role"] == "user")


@pytest.mark.parametrize("thinking", [True, False])
def test_regeneration_evaluation_and_training_render_the_same_prompt(tmp_path, monkeypatch, thinking):
    """With a Kimi-style template and target.chat_template_kwargs={thinking: ...}: the prompt the
    regeneration sends the engine, evaluation's prompt for the same conversation and the prompt part
    of the training sample are the same tokens; the sample's loss covers exactly what the engine
    returned (reasoning included when thinking is on) and the end-of-turn token."""
    from eagle3 import evaluation as ev

    monkeypatch.setattr(D, "cache_root", lambda: tmp_path / "cache")
    _, target, target_dir = tiny_target_and_source(tmp_path)
    target.chat_template = "conf/templates/kimi_k25_style.jinja"
    target.chat_template_kwargs = {"thinking": thinking}
    tok = chat.load_tokenizer(target_dir, target)
    src = tmp_path / "q.jsonl"
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."}]
    src.write_text(json.dumps({"id": "q", "messages": conv}) + "\n")
    answer = ("Colours: pick one.</think>" if thinking else "") + "Green."
    sent = []

    def engine(model, stop_ids, max_new_tokens, batch_size, temperature=0.0):
        return lambda prompts: sent.extend(prompts) or [(tok.encode(answer, add_special_tokens=False), True)
                                                        for _ in prompts]
    monkeypatch.setattr(R, "load_target_model", lambda *a, **k: None)
    monkeypatch.setattr(R, "hf_generate", engine)
    data = DataConfig(source="jsonl", path=str(src), max_length=256, heldout_fraction=0.0)
    cap = CaptureConfig(backend="hf", regenerate=True, regen_max_new_tokens=NEW, device="cpu")
    unbound = load_tokenizer(target_dir, target.chat_template)    # as python -m capture passes it
    (path,) = R.regenerate(target_dir, target, data, cap, unbound, target_info(target_dir))
    (regen_prompt,) = sent
    prompt_text = tok.decode(regen_prompt)
    assert prompt_text.endswith("<|im_assistant|>assistant<|im_middle|>" + ("<think>" if thinking else "<think></think>"))

    (p,) = ev.load_prompts(str(src), 0)
    assert chat.render_prompt(chat.load_tokenizer(target_dir, target), p.messages) == regen_prompt

    (rec,) = read(path)
    assert rec["messages"][-1] == ({"role": "assistant", "content": "Green.", "reasoning_content": "Colours: pick one."}
                                   if thinking else {"role": "assistant", "content": "Green."})
    _, train, _ = load_samples(target_dir, target, data, cap)
    (s,) = train
    first = s.loss_mask.index(1)
    assert s.input_ids[:first] == regen_prompt and all(s.loss_mask[first:])
    assert tok.decode(s.input_ids[first:]) == answer + "<|im_end|>"


def test_static_greedy_equals_generate_on_a_padded_batch(tok, model):
    """capture/fastgen.py against transformers' generate: prompts of different lengths in one left
    padded batch, 40 new tokens each (long enough for the cache slots and positions to matter)."""
    from capture import fastgen

    torch.manual_seed(1)
    prompts = [torch.randint(3, len(tok), (n,)).tolist() for n in (3, 17, 9, 30)]
    dec = fastgen.StaticGreedy(model, 40, pad_id=0)
    got = dec.generate(prompts, prefill_tokens=40)            # two prefill row groups
    for p, ids in zip(prompts, got):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=40, min_new_tokens=40,
                                 pad_token_id=0)
        assert ids == ref[0, len(p):].tolist()


def test_static_greedy_stops_early_only_when_every_row_has_stopped(tok, model):
    from capture import fastgen

    prompts = [[5, 6, 7], [8, 9]]
    full = fastgen.StaticGreedy(model, 64, pad_id=0).generate(prompts)
    only_first = fastgen.StaticGreedy(model, 64, pad_id=0).generate(prompts, stop_ids=[full[0][2]])
    assert full[0][2] in full[1] or len(only_first[0]) == 64      # row 1 never stops: no early exit
    stops = [full[0][2], full[1][2]]                               # each row stops at its third token
    got = fastgen.StaticGreedy(model, 64, pad_id=0).generate(prompts, stop_ids=stops)
    n = len(got[0])
    assert n == 32
    assert got == [row[:n] for row in full]


def test_batches_fit_the_memory_budget():
    from capture.fastgen import batches_by_memory

    lengths = [10, 200, 50, 90, 90, 5]
    groups = batches_by_memory(lengths, max_new=10, max_batch=4, bytes_per_token=1, budget_bytes=300)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert len(g) <= 4 and (len(g) == 1 or len(g) * (max(lengths[i] for i in g) + 10) <= 300)
    assert groups[0] == [1]                                   # longest first


def test_non_llama_targets_use_generate_in_padded_batches():
    """A Mistral target takes hf_generate's transformers path: batched and left padded, the answers
    equal generate's on each prompt alone."""
    from transformers import MistralConfig, MistralForCausalLM

    from capture import fastgen

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2)
    model = MistralForCausalLM(cfg).eval()
    assert not fastgen.supports(model)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]
    stop = [3]
    got = E.hf_generate(model, stop, NEW, batch_size=2)(prompts)
    for p, answer in zip(prompts, got):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, eos_token_id=stop,
                                 pad_token_id=stop[0])
        assert answer == E.cut_at_stop(ref[0, len(p):].tolist(), stop)
