"""Continuous batching (capture/fastgen.py ContinuousGreedy) on a tiny random Llama, fp32 on CPU.

    .venv/bin/python -m pytest tests/test_fastgen_continuous.py -q

Independent truth: transformers' greedy `generate` on each prompt alone (no batching, no padding).
Fewer rows than prompts, so every row is refilled several times at positions its earlier occupant
had written past; a row that wrote its key/value anywhere but its own position would read the
wrong keys and part from generate within a few tokens. Compaction moves busy rows to new places
mid-answer; a row whose cache or state did not move with it would part from generate the same way.
"""
from __future__ import annotations

import json

import pytest
import torch

from capture import fastgen
from capture import answer_engines as E
from capture import regenerate as R
from eagle3 import chat
from test_regenerate import model, tok  # noqa: F401 - the fixtures: regeneration's tiny Llama target

LENGTHS = (1, 41, 3, 60, 2, 17, 9, 33, 5, 50, 12, 4)


@pytest.fixture(scope="module")
def prompts(tok):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in LENGTHS]


def generate_alone(model, prompt, new, stop_ids=None):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, pad_token_id=0,
                             **({"eos_token_id": stop_ids} if stop_ids else {"min_new_tokens": new}))
    return out[0, len(prompt):].tolist()


def test_refilled_rows_equal_generate_and_static_greedy(model, prompts):
    """12 prompts of 1 to 60 tokens through 3 rows, 30 new tokens each, no stop id: every answer
    equals generate's and StaticGreedy's (one left padded batch) token for token."""
    new = 30
    dec = fastgen.ContinuousGreedy(model, new, max_prompt=max(LENGTHS), rows=3, pad_id=0, check_every=4,
                                   prefill_tokens=64)              # refills of long prompts prefill in groups
    got = dec.generate(prompts)
    assert got == fastgen.StaticGreedy(model, new, pad_id=0).generate(prompts)
    for p, ids in zip(prompts, got):
        assert ids == generate_alone(model, p, new)
    assert dec.busy() == 0 and dec.free() == 3


def test_answers_stop_at_their_own_stop_id_or_the_budget(model, prompts):
    """Stop ids taken from the answers themselves, so some rows stop after 1 or 2 tokens (one at the
    prefill's token), some in the middle and some run to the budget; each row is checked every 5
    steps, so a stopped row runs on past its stop before it is refilled."""
    new = 24
    full = fastgen.StaticGreedy(model, new, pad_id=0).generate(prompts)
    stops = sorted({full[0][0], full[3][1], full[5][12]})
    ended = [E.cut_at_stop(a, stops) for a in full]
    assert {f for _, f in ended} == {True, False}
    assert min(len(a) for a, f in ended if f) == 0 and max(len(a) for a, f in ended if f) >= 5
    dec = fastgen.ContinuousGreedy(model, new, max_prompt=max(LENGTHS), rows=4, pad_id=0, stop_ids=stops,
                                   check_every=5)
    got = dec.generate(prompts)
    for p, ids, (answer, finished) in zip(prompts, got, ended):
        assert E.cut_at_stop(ids, stops) == (answer, finished)
        assert ids == (answer + [ids[-1]] if finished else answer) and (not finished or ids[-1] in stops)
        assert E.cut_at_stop(generate_alone(model, p, new, stops), stops) == (answer, finished)


def test_compacted_rows_go_on_as_generate(model, prompts, monkeypatch):
    """12 prompts in 12 rows, stop ids from the answers so rows end at different times; after every
    check the decoder drops its free rows (down to a multiple of 2) and goes on with the busy ones
    in their new places. Capturing the step on CUDA runs one step for real; here it does too, so
    that step must count as one of the answers' own. Every answer still equals generate's."""
    new = 24
    full = fastgen.StaticGreedy(model, new, pad_id=0).generate(prompts)
    stops = sorted({full[0][0], full[3][1], full[5][12]})
    replayable = fastgen.StaticGreedy._replayable

    def warm(self, *args, step=None):
        (step or self._step)(*args)                       # the capture's warm-up step
        return replayable(self, *args, step=step)
    monkeypatch.setattr(fastgen.StaticGreedy, "_replayable", warm)
    dec = fastgen.ContinuousGreedy(model, new, max_prompt=max(LENGTHS), rows=len(prompts), pad_id=0,
                                   stop_ids=stops, check_every=3)
    dec.add(list(enumerate(prompts)))
    got, sizes = {}, []
    while dec.busy():
        got.update(dec.advance())
        if dec.compact(multiple=2):
            sizes.append(dec.rows)
    assert sizes and sizes[-1] < len(prompts) and sizes == sorted(sizes, reverse=True)
    for i, p in enumerate(prompts):
        assert E.cut_at_stop(got[i], stops) == E.cut_at_stop(generate_alone(model, p, new, stops), stops)


def test_a_prompt_longer_than_the_cache_allows_is_refused(model):
    dec = fastgen.ContinuousGreedy(model, 4, max_prompt=8, rows=2, pad_id=0)
    with pytest.raises(ValueError):
        dec.add([("a", list(range(3, 12)))])
    with pytest.raises(ValueError):
        dec.add([(k, [5, 6]) for k in "abc"])


CONVS = [
    ("a", [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
           {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Red."},
           {"role": "user", "content": "And a third, please, with a long explanation of why."}]),
    ("b", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
           {"role": "assistant", "content": "Hi."}]),
    ("c", [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "Why?"},
           {"role": "user", "content": "Really, why?"}, {"role": "assistant", "content": "Because."},
           {"role": "user", "content": "And then?"}]),
    ("d", [{"role": "user", "content": "x " * 120}, {"role": "assistant", "content": "ok"},
           {"role": "user", "content": "Shorter now."}]),
    ("e", [{"role": "user", "content": "One"}, {"role": "assistant", "content": "1"},
           {"role": "user", "content": "Two"}, {"role": "assistant", "content": "2"},
           {"role": "user", "content": "Three"}, {"role": "assistant", "content": "3"},
           {"role": "user", "content": "Four"}]),
]
NEW = 12


def read(path):
    return [json.loads(line) for line in open(path)]


def rounds_and_continuous(tok, model, tmp_path, max_prompt_tokens, chunk, rows, stop_ids):
    rounds, cont = tmp_path / "rounds.jsonl", tmp_path / "continuous.jsonl"
    R.regenerate_conversations(CONVS, tok, E.hf_generate(model, stop_ids, NEW, batch_size=2), rounds,
                               max_prompt_tokens, progress=False, chunk=chunk)
    dec = E.hf_continuous(model, stop_ids, NEW, max_prompt_tokens - 1, rows)
    assert isinstance(dec, fastgen.ContinuousGreedy) and dec.check_every == 16
    dec.check_every = 3
    advance, checks = dec.advance, [0]

    def counted():
        checks[0] += 1
        return advance()
    dec.advance = counted
    R.regenerate_conversations(CONVS, tok, dec, cont, max_prompt_tokens, progress=False, chunk=chunk)
    return read(rounds), read(cont), dec, checks[0]


@pytest.mark.parametrize("chunk,rows", [(2, 2), (256, 3), (256, 32)])
def test_continuous_regeneration_writes_the_rounds_records(tok, model, tmp_path, monkeypatch, capsys, chunk,
                                                          rows):
    """Every user turn of 5 conversations (1 to 4 answers each; "d" ends at a prompt past the length
    limit, after its first answer), rounds against continuous: the same file, record for record, in
    conversation order though "b" finishes before "a" (records are appended at every check here).
    One stop id is a token the answers write, so answers end early as well as at the budget."""
    monkeypatch.setattr(R, "FLUSH_S", 0.0)
    eot = chat.stop_ids(tok)
    first, _, _, _ = rounds_and_continuous(tok, model, tmp_path / "probe", 1024, chunk, rows, eot)
    common = [t for r in first for m in r["messages"] if m["role"] == "assistant"
              for t in tok.encode(m["content"], add_special_tokens=False)]
    stop_ids = eot + [max(set(common), key=common.count)]
    limit = len(chat.render_prompt(tok, CONVS[3][1][:1])) + 5     # "d"'s second prompt is longer
    rounds, cont, dec, checks = rounds_and_continuous(tok, model, tmp_path, limit, chunk, rows, stop_ids)
    assert cont == rounds
    assert [r["id"] for r in cont] == ["a", "b", "c", "d", "e"]
    assert [len(r["regen"]["new_tokens"]) for r in cont] == [3, 1, 2, 1, 4]
    assert {f for r in cont for f in r["regen"]["finished"]} == {True, False}
    assert dec.busy() == 0
    # its counts: one prefill per answer; check_every steps per check
    assert dec.prefilled == sum(len(r["regen"]["new_tokens"]) for r in cont)
    assert dec.steps == 3 * checks and dec.decode_s > 0 and dec.prefill_s > 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith(f"[regenerate] continuous: {dec.prefilled} answers in ") and f"{dec.steps} steps" in summary
    # 32 rows for 5 conversations: once all have started the free rows go (down to a multiple of 8)
    assert dec.rows == (8 if rows == 32 else rows)


def test_continuous_regeneration_resumes_and_stops_at_the_time_limit(tok, model, tmp_path):
    """A torn last line is cut and done ids are skipped; with a time limit, the conversations started
    are finished and kept, no new one starts past the limit, and a rerun completes the file."""
    import time

    stop_ids = chat.stop_ids(tok)
    whole = tmp_path / "whole.jsonl"
    dec = E.hf_continuous(model, stop_ids, NEW, 1023, 1)             # one conversation in flight
    R.regenerate_conversations(CONVS, tok, dec, whole, 1024, progress=False, chunk=1)

    path = tmp_path / "limited.jsonl"
    advance = dec.advance

    def slow():                     # each check 0.3 s: "a" (3 answers) takes about 1 s
        time.sleep(0.3)
        return advance()
    dec.advance = slow
    R.regenerate_conversations(CONVS, tok, dec, path, 1024, progress=False, chunk=1, minutes=1.5 / 60)
    assert [r["id"] for r in read(path)] == ["a"]
    dec.advance = advance
    with open(path, "ab") as f:
        f.write(b'{"id": "b", "messa')
    R.regenerate_conversations(CONVS, tok, dec, path, 1024, progress=False, chunk=1)
    assert read(path) == read(whole)


def test_capture_regen_continuous_writes_the_same_cache(tok, tmp_path, monkeypatch):
    """capture.regen_continuous=true through regenerate(): the hf backend answers with
    ContinuousGreedy, and the cache file is the rounds' byte for byte."""
    from eagle3 import data as D
    from eagle3.config import CaptureConfig, DataConfig
    from eagle3.targets import target_info
    from tests.test_regenerate import tiny_target_and_source

    src, target, target_dir = tiny_target_and_source(tmp_path)
    data = DataConfig(source="jsonl", path=str(src), max_length=256)
    checks, advance = [], fastgen.ContinuousGreedy.advance
    monkeypatch.setattr(fastgen.ContinuousGreedy, "advance", lambda self: checks.append(1) or advance(self))
    caches = []
    for continuous in (False, True):
        monkeypatch.setattr(D, "cache_root", lambda c=continuous: tmp_path / f"cache{c}")
        cap = CaptureConfig(backend="hf", regenerate=True, regen_max_new_tokens=NEW, device="cpu",
                            regen_continuous=continuous)
        caches += R.regenerate(target_dir, target, data, cap, tok, target_info(target_dir))
        assert bool(checks) == continuous
    assert caches[0].read_text() == caches[1].read_text()
    assert [r["id"] for r in read(caches[1])] == ["a", "b", "c"]
