"""Conversations -> ids + assistant loss mask (eagle3/data.py).

Expectations are built independently: the expected rendering is written out by hand per template,
the ids come from the tokenizer's own apply_chat_template(tokenize=True), and the expected mask
is 1 exactly where the assistant pieces' own token ids are found in them.
"""
import hashlib
import json
import time
from pathlib import Path

import pytest

from eagle3 import data
from eagle3.data import BadRecord, DataReport, build_samples, is_heldout, iter_conversations, render, write_jsonl
from eagle3.loops import mask_loops
from eagle3.targets import load_tokenizer, smollm2_tokenizer

CONV = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome is the capital of Italy."}]
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def smol():
    return smollm2_tokenizer()


def _template_tokenizer(smol, template_file):
    tok = load_tokenizer(smol.name_or_path, template_file)
    assert tok.chat_template == (Path(__file__).parents[1] / template_file).read_text()
    return tok


def _locate(ids, pieces):
    """Mask that is 1 where each piece's own token ids occur in ids, in order (searched by hand)."""
    mask, at = [0] * len(ids), 0
    for piece in pieces:
        while ids[at: at + len(piece)] != piece:
            at += 1
            assert at < len(ids), "assistant piece not found in the rendered ids"
        mask[at: at + len(piece)] = [1] * len(piece)
        at += len(piece)
    return mask


def _check(tok, segments, masked_text):
    """segments: the hand-written rendering as (text, is_assistant) pieces."""
    assert "".join(t for t, _ in segments) == tok.apply_chat_template(CONV, tokenize=False)
    want_ids = list(tok.apply_chat_template(CONV, tokenize=True)["input_ids"])
    want_mask = _locate(want_ids, [tok.encode(t, add_special_tokens=False) for t, on in segments if on])
    ids, mask = render(tok, CONV, 4096)
    assert ids == want_ids
    assert mask == want_mask
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == masked_text


def test_mask_smollm2_template(smol):
    a1, a2 = CONV[1]["content"], CONV[3]["content"]
    segments = [
        (f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\n{CONV[0]['content']}<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        (f"{a1}<|im_end|>\n", 1),
        (f"<|im_start|>user\n{CONV[2]['content']}<|im_end|>\n<|im_start|>assistant\n", 0),
        (f"{a2}<|im_end|>\n", 1)]
    _check(smol, segments, f"{a1}<|im_end|>\n{a2}<|im_end|>\n")


def test_mask_llama3_template(smol):
    tok = _template_tokenizer(smol, "tests/templates/llama3_style.jinja")
    tok.add_tokens(LLAMA3_SPECIAL, special_tokens=True)   # as in a real Llama-3 tokenizer

    def head(role):
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"
    a1, a2 = CONV[1]["content"], CONV[3]["content"]
    segments = [(f"<|begin_of_text|>{head('user')}{CONV[0]['content']}<|eot_id|>{head('assistant')}", 0),
                (f"{a1}<|eot_id|>", 1),
                (f"{head('user')}{CONV[2]['content']}<|eot_id|>{head('assistant')}", 0),
                (f"{a2}<|eot_id|>", 1)]
    _check(tok, segments, f"{a1}<|eot_id|>{a2}<|eot_id|>")


def test_mask_kimi_template(smol):
    tok = _template_tokenizer(smol, "conf/templates/kimi_style.jinja")
    a1, a2 = CONV[1]["content"], CONV[3]["content"]
    segments = [("<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
                 f"<|im_user|>user<|im_middle|>{CONV[0]['content']}<|im_end|>"
                 "<|im_assistant|>assistant<|im_middle|>", 0),
                (f"{a1}<|im_end|>", 1),
                (f"<|im_user|>user<|im_middle|>{CONV[2]['content']}<|im_end|>"
                 "<|im_assistant|>assistant<|im_middle|>", 0),
                (f"{a2}<|im_end|>", 1)]
    _check(tok, segments, f"{a1}<|im_end|>{a2}<|im_end|>")


KIMI_SPECIAL = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<think>", "</think>"]
KIMI_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
REASONED = CONV[:3] + [{**CONV[3], "reasoning_content": "Italy's capital: Rome, since 1871."}]


def _kimi_tokenizer(smol, thinking):
    from eagle3.chat import use_template_kwargs

    tok = _template_tokenizer(smol, "conf/templates/kimi_k25_style.jinja")
    tok.add_tokens(KIMI_SPECIAL, special_tokens=True)     # as in Kimi's own tokenizer
    return use_template_kwargs(tok, {"thinking": thinking})


@pytest.mark.parametrize("thinking", [True, False])
def test_mask_kimi_thinking_switch(smol, thinking):
    """The assistant's tokens, and only they, are in the loss: with thinking on the generation prompt
    ends in <think> and the reasoning is the model's own output (masked); with thinking off the
    prompt ends in <think></think> and only the answer follows. System and user turns and the role
    markers never are. Expected text by hand, ids from apply_chat_template(thinking=...)."""
    tok = _kimi_tokenizer(smol, thinking)
    conv = REASONED if thinking else CONV
    a1, a2, r2 = CONV[1]["content"], CONV[3]["content"], REASONED[3]["reasoning_content"]
    head = "<|im_assistant|>assistant<|im_middle|>" + ("<think>" if thinking else "<think></think>")
    if thinking:   # the first answer, rendered as history, has an empty think block
        answers = [f"</think>{a1}<|im_end|>", f"{r2}</think>{a2}<|im_end|>"]
    else:
        answers = [f"{a1}<|im_end|>", f"{a2}<|im_end|>"]
    segments = [(f"{KIMI_SYSTEM}<|im_user|>user<|im_middle|>{CONV[0]['content']}<|im_end|>{head}", 0),
                (answers[0], 1),
                (f"<|im_user|>user<|im_middle|>{CONV[2]['content']}<|im_end|>{head}", 0),
                (answers[1], 1)]
    full = "".join(t for t, _ in segments)
    assert full == tok.apply_chat_template(conv, tokenize=False, thinking=thinking)
    want_ids = list(tok.apply_chat_template(conv, tokenize=True, thinking=thinking)["input_ids"])
    want_mask = _locate(want_ids, [tok.encode(t, add_special_tokens=False) for t, on in segments if on])
    ids, mask = render(tok, conv, 4096)
    assert ids == want_ids and mask == want_mask
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "".join(answers)
    markers = set(tok.convert_tokens_to_ids(KIMI_SPECIAL[:4])) | {tok.convert_tokens_to_ids("<think>")}
    assert not markers & {i for i, m in zip(ids, mask) if m}
    assert (r2 in tok.decode(ids)) == thinking


def test_kimi_reasoning_the_template_drops_is_a_bad_record_not_a_wrong_mask(smol):
    """Kimi renders an earlier turn's reasoning as an empty think block once a later answer exists:
    that turn's prefix rendering is not a prefix of the whole, so the record is refused. So is
    reasoning in thinking-off mode, whose prompt already closed the think block."""
    reasoned_first = [CONV[0], {**CONV[1], "reasoning_content": "Easy."}] + CONV[2:]
    with pytest.raises(BadRecord, match="template not incremental"):
        render(_kimi_tokenizer(smol, True), reasoned_first, 4096)
    with pytest.raises(BadRecord, match="template not incremental"):
        render(_kimi_tokenizer(smol, False), REASONED, 4096)


class _NoOffsets:
    """A tokenizer without offsets (like tiktoken-based ones): forces the token-prefix path."""

    def __init__(self, tok):
        self._tok = tok

    def apply_chat_template(self, *a, **k):
        return self._tok.apply_chat_template(*a, **k)

    def encode(self, *a, **k):
        return self._tok.encode(*a, **k)


def test_token_prefix_path_matches_offsets_path(smol):
    assert render(_NoOffsets(smol), CONV, 4096) == render(smol, CONV, 4096)


def test_leading_assistant_is_context(smol):
    conv = [{"role": "assistant", "content": "Welcome back."}] + CONV
    ids, mask = render(smol, conv, 4096)
    masked = smol.decode([i for i, m in zip(ids, mask) if m])
    assert masked == f"{CONV[1]['content']}<|im_end|>\n{CONV[3]['content']}<|im_end|>\n"


def test_truncation_matches_whole_tokenization(smol):
    # Long turns, so the prefix cut in render (5 characters a token) is exercised.
    conv = []
    for i in range(6):
        conv += [{"role": "user", "content": f"Question {i}: " + "tell me more about it " * 60},
                 {"role": "assistant", "content": f"Answer {i}: " + "here is more detail, ok. " * 80}]
    whole = list(smol.apply_chat_template(conv, tokenize=True)["input_ids"])
    long_ids, long_mask = render(smol, conv, 100_000)
    assert long_ids == whole
    for n in (400, 900, 1500):
        ids, mask = render(smol, conv, n)
        assert ids == whole[:n] and mask == long_mask[:n]
    assert sum(render(smol, conv, 1500)[1]) > 500


def _bad_templates(smol):
    raising = smol.chat_template.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if message['content'] == 'boom' %}{{ raise_exception('boom') }}{% endif %}")
    rewriting = smol.chat_template.replace("'<|im_end|>' + '\n'", "'<|im_end|>' + ('' if loop.last else '\n')")
    assert raising != smol.chat_template and rewriting != smol.chat_template
    return raising, rewriting


def test_bad_records_counted_by_reason(smol, tmp_path):
    ok = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
    recs = [ok,
            {"messages": []},                                                          # empty
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "bing", "value": "x"}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ["x"]}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}]},
            {"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "Yes"}]},
            {"messages": ["not a turn"]},
            {"id": 7},                                                                  # no messages
            {"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]},
            ok]
    path = tmp_path / "convs.jsonl"
    write_jsonl(path, recs)
    with open(path, "a") as f:
        f.write("{not json\n")
    raising, _ = _bad_templates(smol)
    smol_raising = load_tokenizer(smol.name_or_path)
    smol_raising.chat_template = raising
    train, held, rep = build_samples(smol_raising, "jsonl", str(path), 0, 64, 0.0)
    assert rep.bad == {"empty": 1, "unknown role": 1, "non-string content": 1, "no assistant turn": 1,
                       "nothing to train on": 1, "malformed turn": 1, "malformed record": 1,
                       "template error": 1, "invalid json": 1}
    assert (rep.read, rep.used, len(train), len(held)) == (11, 2, 2, 0)
    assert rep.read == rep.used + sum(rep.bad.values())
    assert "invalid json: 1" in rep.summary()
    # min_loss_tokens: "Hello!<|im_end|>\n" is 4 tokens
    _, _, rep = build_samples(smol, "jsonl", str(path), 0, 64, 0.0, min_loss_tokens=5)
    assert rep.used == 0 and rep.bad["nothing to train on"] == 4   # + "x<|im_end|>\n"


def test_template_not_incremental(smol):
    _, rewriting = _bad_templates(smol)
    tok = load_tokenizer(smol.name_or_path)
    tok.chat_template = rewriting
    with pytest.raises(BadRecord) as e:
        render(tok, CONV, 4096)
    assert e.value.reason == "template not incremental"


def test_sharegpt_and_messages_shapes_agree(smol, tmp_path):
    sg = {"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                       {"from": "chatgpt", "value": "Hello!"}, {"from": "user", "value": "Bye"},
                                       {"from": "assistant", "value": "Bye!"}]}
    msgs = {"id": "a", "messages": [{"role": ("system", "user", "assistant", "user", "assistant")[i],
                                     "content": t["value"]} for i, t in enumerate(sg["conversations"])]}
    write_jsonl(tmp_path / "a.jsonl", [sg])
    write_jsonl(tmp_path / "b.jsonl", [msgs])
    a = list(iter_conversations("jsonl", str(tmp_path / "a.jsonl")))
    b = list(iter_conversations("jsonl", str(tmp_path / "b.jsonl")))
    assert a == b and a[0][1] == msgs["messages"]


def _write_array(path, records, cut_inside=None):
    text = json.dumps(records, indent=2, ensure_ascii=False)
    if cut_inside is not None:   # cut in the middle of record `cut_inside`
        text = text[: text.index(json.dumps(records[cut_inside]["id"])) + 20]
    path.write_text(text, encoding="utf-8")


def _records(n):
    return [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"héllo ✓ 日本 {i}"},
                                              {"from": "gpt", "value": "ok " * i}]} for i in range(n)]


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_stream_json_array(tmp_path, chunk):
    recs = _records(5)
    for cut, want, tail in ((None, 5, 0), (3, 3, 1)):
        path = tmp_path / f"a{cut}.json"
        _write_array(path, recs, cut)
        if cut is not None:
            with pytest.raises(json.JSONDecodeError):
                json.loads(path.read_text())
        rep = DataReport(dropped_tail=-1)
        got = list(data._stream_json_array(path, rep, chunk=chunk))
        assert got == recs[:want] and rep.dropped_tail == tail


def test_sharegpt_source_stops_early_and_counts(smol, tmp_path):
    recs = _records(6) + [{"id": "r1", "conversations": [{"from": "human", "value": "dup"},
                                                         {"from": "gpt", "value": "dup id"}]}] + _records(9)[8:]
    path = tmp_path / "sg.json"
    _write_array(path, recs, cut_inside=7)
    ids = [cid for cid, _ in iter_conversations("sharegpt", str(path))]
    assert ids == [f"r{i}" for i in range(6)] + ["r1#1"]
    train, held, rep = build_samples(smol, "sharegpt", str(path), 0, 64, 0.0)
    assert (rep.read, rep.used, rep.dropped_tail, rep.stopped_early) == (7, 7, 1, False)
    assert rep.bad == {}
    assert "1 partial record(s) dropped" in rep.summary()
    train, held, rep = build_samples(smol, "sharegpt", str(path), 3, 64, 0.0)
    assert [s.id for s in train] == ["r0", "r1", "r2"] and rep.read == 3 and rep.stopped_early


def test_split_deterministic_by_id(smol, tmp_path):
    ids = [f"conv-{i}" for i in range(2000)]

    def independent(cid, frac):
        return int(hashlib.blake2b(cid.encode(), digest_size=8).hexdigest(), 16) / 2 ** 64 < frac
    assert [is_heldout(c, 0.1) for c in ids] == [independent(c, 0.1) for c in ids]
    n = sum(is_heldout(c, 0.1) for c in ids)
    assert 140 < n < 260            # binomial(2000, 0.1): mean 200, sd 13
    assert not any(is_heldout(c, 0.0) for c in ids) and all(is_heldout(c, 1.0) for c in ids)
    recs = [{"id": f"conv-{i}", "messages": CONV} for i in range(60)]
    write_jsonl(tmp_path / "c.jsonl", recs)
    runs = [build_samples(smol, "jsonl", str(tmp_path / "c.jsonl"), 0, 256, 0.3) for _ in range(2)]
    assert [s.id for s in runs[0][0]] == [s.id for s in runs[1][0]]
    assert [s.id for s in runs[0][1]] == [c for c in (r["id"] for r in recs) if independent(c, 0.3)]
    assert runs[0][2].heldout == len(runs[0][1]) > 0


@pytest.mark.slow
def test_real_sharegpt_package(smol):
    t = time.time()
    rep = DataReport()
    assert sum(1 for _ in iter_conversations("sharegpt", "", rep)) == 17671
    assert rep.dropped_tail == 1
    stream_s = time.time() - t
    t = time.time()
    train, held, rep = build_samples(smol, "sharegpt", "", 200, 1024, 0.02)
    assert rep.stopped_early and rep.used == 200 and rep.read < 260
    assert all(len(s.input_ids) == len(s.loss_mask) <= 1024 and sum(s.loss_mask) > 0 for s in train + held)
    print(f"stream all: {stream_s:.1f}s; 200 samples: {time.time() - t:.1f}s; {rep.summary()}")


# ---------------------------------------------------------------------------------------------
# data.mix: several sources with weights

def _source_files(tmp_path):
    """Two jsonl sources, "mine" (40 conversations, ids m0..) and "theirs" (30, one without an id)."""
    paths = []
    for name, n in (("mine", 40), ("theirs", 30)):
        recs = [{"id": f"{name[0]}{i}", "messages": CONV[:2]} for i in range(n)]
        if name == "theirs":
            recs[5].pop("id")
        write_jsonl(tmp_path / f"{name}.jsonl", recs)
        paths.append(str(tmp_path / f"{name}.jsonl"))
    return paths


def _expected_copies(cid, weight):
    """Independent: floor(w), plus one when blake2b("mix:" + id) / 2**64 < w - floor(w)."""
    frac = int(hashlib.blake2b(("mix:" + cid).encode(), digest_size=8).hexdigest(), 16) / 2 ** 64
    return int(weight) + (frac < weight - int(weight))


@pytest.mark.parametrize("weights", [(1.0, 1.0), (0.5, 2.0), (1.5, 0.0), (2.0, 0.25), (3.0, 1.7)])
def test_mix_counts_per_source(smol, tmp_path, weights):
    from eagle3.config import MixEntry

    paths = _source_files(tmp_path)
    mix = [MixEntry("jsonl", p, w) for p, w in zip(paths, weights)]
    train, held, rep = build_samples(smol, "sharegpt", "", 0, 64, 0.2, mix=mix)
    ids = [s.id for s in train + held]
    want = {}
    for name, n, w in (("mine", 40, weights[0]), ("theirs", 30, weights[1])):
        convs = [f"{name}:{name[0]}{i}" if i != 5 or name == "mine" else f"{name}:jsonl:5" for i in range(n)]
        want[name] = sum(_expected_copies(c, w) for c in convs)
        for c in convs:
            got = sorted(i for i in ids if i == c or i.startswith(c + "~copy"))
            assert got == sorted([c] + [f"{c}~copy{k}" for k in range(1, _expected_copies(c, w))]
                                 if _expected_copies(c, w) else [])
    assert rep.samples_by_source == want and len(ids) == len(set(ids)) == sum(want.values())
    assert (rep.read, rep.used, rep.samples) == (70, 70, len(ids))
    if weights == (0.5, 2.0):
        assert 10 <= want["mine"] <= 30 and want["theirs"] == 60
    # deterministic: the same samples, in the same order, on a second build
    again = build_samples(smol, "sharegpt", "", 0, 64, 0.2, mix=mix)
    assert [(s.id, s.input_ids) for s in again[0] + again[1]] == [(s.id, s.input_ids) for s in train + held]


def test_mix_copies_of_a_heldout_conversation_stay_held_out(smol, tmp_path):
    from eagle3.config import MixEntry

    paths = _source_files(tmp_path)
    train, held, rep = build_samples(smol, "sharegpt", "", 0, 64, 0.3,
                                     mix=[MixEntry("jsonl", paths[0], 2.5), MixEntry("jsonl", paths[1], 3.0)])

    def conv(sid):                                 # the bare conversation id the split is drawn from
        return sid.split("~copy")[0].split(":", 1)[1]

    def independent(cid):
        return int(hashlib.blake2b(cid.encode(), digest_size=8).hexdigest(), 16) / 2 ** 64 < 0.3
    assert held and train and not {conv(s.id) for s in train} & {conv(s.id) for s in held}
    assert all(independent(conv(s.id)) for s in held) and not any(independent(conv(s.id)) for s in train)
    assert sum(1 for s in held if "~copy" in s.id) >= len({conv(s.id) for s in held})
    # the split train.py applies to a feature dataset's sample ids agrees
    names = ["mine", "theirs"]
    assert all(is_heldout(s.id, 0.3, names) for s in held) and not any(is_heldout(s.id, 0.3, names) for s in train)


def test_empty_mix_is_the_one_entry_form(smol, tmp_path):
    from eagle3.config import MixEntry

    path = _source_files(tmp_path)[1]
    old = build_samples(smol, "jsonl", path, 7, 64, 0.2)
    new = build_samples(smol, "sharegpt", "", 7, 64, 0.2, mix=[MixEntry("jsonl", path, 1.0)])
    assert [(s.id, s.input_ids, s.loss_mask) for s in old[0] + old[1]] == \
        [(s.id, s.input_ids, s.loss_mask) for s in new[0] + new[1]]
    assert old[2].summary() == new[2].summary() and "theirs" not in old[0][0].id
    assert data.mix_sources([], "jsonl", path) == [data.Source("", "jsonl", path, 1.0)]
    with pytest.raises(ValueError, match="distinct names"):
        data.mix_sources([MixEntry("jsonl", path), MixEntry("jsonl", path, 2.0)])
    with pytest.raises(ValueError, match="unknown source"):
        data.mix_sources([MixEntry("hf", path)])
    # a mix leaves data.source / data.path unread, so setting both is refused, not half obeyed
    with pytest.raises(ValueError, match="data.mix is set, so data.source=jsonl"):
        data.mix_sources([MixEntry("jsonl", path)], "jsonl", path)
    # one file at two temperatures: two sources, named apart; at one temperature twice: refused
    two = data.mix_sources([MixEntry("jsonl", path, 1.0, 0.0), MixEntry("jsonl", path, 1.0, 0.7)])
    assert [(s.name, s.temperature) for s in two] == [(Path(path).stem, 0.0), (Path(path).stem + "_t0.7", 0.7)]
    with pytest.raises(ValueError, match="distinct names"):
        data.mix_sources([MixEntry("jsonl", path, 1.0, 0.7), MixEntry("jsonl", path, 2.0, 0.7)])
    with pytest.raises(ValueError, match="temperature -1"):
        data.mix_sources([MixEntry("jsonl", path, 1.0, -1.0), MixEntry("jsonl", path, 1.0, 0.7)])


def test_mix_and_template_kwargs_compose_from_yaml_and_the_command_line():
    from hydra import compose, initialize_config_dir

    from eagle3 import config as schema
    schema.register()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="train", overrides=[
            "data.mix=[{source: sharegpt, weight: 0.5}, {source: jsonl, path: mine.jsonl, weight: 2}]",
            "+target.chat_template_kwargs.thinking=false"])
    c = schema.to_config(cfg)
    assert [(e.source, e.path, e.weight) for e in c.data.mix] == [("sharegpt", "", 0.5), ("jsonl", "mine.jsonl", 2.0)]
    assert isinstance(c.data.mix[0], schema.MixEntry) and c.target.chat_template_kwargs == {"thinking": False}
    assert schema.to_config(_compose_default()).data.mix == []


def _compose_default():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
        return compose(config_name="train", overrides=[])


def test_loop_tokens_leaves_loop_tails_out_of_the_loss_and_says_how_much(smol, tmp_path):
    line = "The answer is in the next line, and so is the line after it."
    recs = [{"id": "a", "messages": [{"role": "user", "content": "Say it."},
                                     {"role": "assistant", "content": "\n".join([line] * 12)}]},
            {"id": "b", "messages": [{"role": "user", "content": "Capital of France?"},
                                     {"role": "assistant", "content": "Paris is the capital of France."}]}]
    path = tmp_path / "loops.jsonl"
    write_jsonl(path, recs)
    plain, _, rep0 = build_samples(smol, "jsonl", str(path), 0, 512, 0.0)
    cut, _, rep = build_samples(smol, "jsonl", str(path), 0, 512, 0.0, loop_tokens=16)
    assert [s.input_ids for s in cut] == [s.input_ids for s in plain]        # the context is unchanged
    want = [mask_loops(s.input_ids, s.loss_mask, 16) for s in plain]
    assert [s.loss_mask for s in cut] == want
    dropped = sum(map(sum, (s.loss_mask for s in plain))) - sum(map(sum, want))
    line_tokens = len(smol(line + "\n")["input_ids"])
    assert dropped > 8 * line_tokens                             # most of the eleven repeats
    assert cut[1].loss_mask == plain[1].loss_mask                          # no loop, nothing out
    assert (rep.loss_tokens, rep.loop_masked) == (sum(map(sum, (s.loss_mask for s in plain))), dropped)
    assert f"{dropped} of {rep.loss_tokens} answer tokens" in rep.summary()
    assert rep0.loop_masked == 0 and "repetition-loop" not in rep0.summary()
