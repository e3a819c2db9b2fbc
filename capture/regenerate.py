"""Regeneration, a stage of its own: the target answers the conversations' user turns itself.

    python -m capture +experiment=smollm2_peer capture.regenerate_only=true    # hf: in-process generate
    python -m capture +experiment=kimi_k25 capture.regenerate_only=true        # sglang: the server's /generate

Every run of user turns gets one greedy answer (up to capture.regen_max_new_tokens, stopping at
eagle3.chat.stop_ids; with capture.regen_temperature > 0 a sampled one instead, another set of
answers to the same conversations), generated with the earlier answers already replaced; the
original assistant turns are dropped, and so is an assistant turn with no user turn before it. A
conversation stops at the first prompt of data.max_length tokens or more (every token after that is
truncated away by the data loader anyway).

Every source of data.mix is answered into its own eagle3.data.regenerated_path, at the entry's own
temperature where it gives one, so one file named at 0 and at 0.7 gets two answers to each
conversation, in two files. The files are JSONL under ~/.cache/eagle3/regen/, keyed by the
target, its chat template and template variables, the source, the data settings, the answer length
and any sampling temperature; the user turns are kept as they are. An answer is stored as
eagle3.chat.assistant_turn makes it (a thinking model's reasoning in reasoning_content), so the
training data renders the tokens the target wrote. Records are appended
to `<key>.partial.jsonl` as chunks finish, a rerun skips the ids already there, and the file is
renamed to `<key>.jsonl` once every conversation is answered (capture/answer_cache.py: the files,
and `<key>.key.json` beside them). A run that differs from an earlier one only in data.num_samples
starts from that run's answers to the conversations the two share (the first ones of the source):
growing a dataset from 4,096 conversations to all of them answers only the rest. Capture and online
training only read that file (eagle3.data.load_samples); this is the only code that starts a server
or per-GPU workers to generate.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from capture.answer_cache import done_ids, reuse_other_sizes, write_key
from capture.answer_engines import Generate, cut_at_stop, hf_continuous, hf_generate, sglang_generate
from capture.fastgen import ContinuousGreedy
from eagle3 import chat
from eagle3.config import CaptureConfig, DataConfig, TargetConfig
from eagle3.data import (BadRecord, Source, iter_conversations, mix_sources, regeneration_file, regeneration_key,
                         select_turns)
from eagle3.serving import server_cmd, sglang_python
from eagle3.targets import load_target_model, model_dtype, pick_device


# ----------------------------------------------------------------------------------------------
# Conversations being answered.

@dataclass
class _Conv:
    """One conversation being regenerated: `done` messages so far, `todo` still to walk."""
    id: str
    done: List[dict]
    todo: List[dict]
    new_tokens: List[int] = field(default_factory=list)
    finished: List[bool] = field(default_factory=list)

    def next_prompt(self) -> bool:
        """Move turns from todo to done up to the next point that needs an answer; False at the end."""
        while self.todo:
            m = self.todo.pop(0)
            if m["role"] == "assistant":
                continue                         # the original answer is replaced, or has no question
            self.done.append(m)
            if m["role"] == "user" and not (self.todo and self.todo[0]["role"] == "user"):
                return True
        return False

    def prompt(self, tok, max_prompt_tokens: int) -> Optional[List[int]]:
        """The next prompt's token ids; None at the end, or where the prompt is max_prompt_tokens or
        longer (its answer would be truncated away by the data loader: the conversation stops there)."""
        if not self.next_prompt():
            return None
        ids = chat.render_prompt(tok, self.done)
        if len(ids) >= max_prompt_tokens:
            self.done.pop()
            return None
        return ids

    def answered(self, tok, ids: List[int], finished: bool) -> None:
        self.done.append(chat.answer_turn(tok, ids))
        self.new_tokens.append(len(ids))
        self.finished.append(finished)

    def record(self) -> Dict[str, Any]:
        while self.done and self.done[-1]["role"] != "assistant":
            self.done.pop()                      # a trailing question that was not answered
        return {"id": self.id, "messages": self.done,
                "regen": {"new_tokens": self.new_tokens, "finished": self.finished}}


def _append(path: Path, convs: Sequence[_Conv]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for v in convs:
            f.write(json.dumps(v.record(), ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------
# The cached regeneration.

def regenerate_conversations(conversations: Sequence[Tuple[str, list]], tok, generate: Generate | ContinuousGreedy,
                             out_path: Path, max_prompt_tokens: int, progress: bool = True,
                             chunk: int = 256, minutes: float = 0.0, desc: str = "regenerate") -> Path:
    """Answer every conversation's user turns with `generate`; append records to out_path (JSONL).

    conversations: (id, messages) pairs in order; ids already in out_path are skipped, so an
    interrupted run resumes. Records: {"id", "messages", "regen": {"new_tokens", "finished"}}.
    generate is a Generate: `chunk` conversations are answered together, turn by turn (each round of
    user turns is one call of `generate`, so larger chunks make fuller batches), and appended when all
    are done. Or a fastgen.ContinuousGreedy: up to `chunk` conversations (at least its rows) are in
    flight, each turn queued as soon as the answer before it is done (_answer_continuously).
    minutes > 0: no chunk (conversation, when continuous) starts that would, at the pace of the last
    one, end after that many minutes; the finished ones are kept and a rerun goes on from there.
    """
    from tqdm import tqdm

    t0 = time.time()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    have = done_ids(out_path)
    todo = [(cid, msgs) for cid, msgs in conversations if cid not in have]
    bar = tqdm(total=len(todo), unit="conv", desc=desc, disable=not progress)
    if isinstance(generate, ContinuousGreedy):
        started = _answer_continuously(todo, tok, generate, out_path, max_prompt_tokens, bar, chunk, minutes, t0)
    else:
        started = _answer_in_rounds(todo, tok, generate, out_path, max_prompt_tokens, bar, chunk, minutes, t0)
    bar.close()
    if started < len(todo):
        print(f"[regenerate] stopped at the time limit ({minutes:g} min): {started} of {len(todo)} "
              f"conversations answered this run, kept in {out_path}; a rerun goes on from there", flush=True)
    return out_path


def _answer_in_rounds(todo, tok, generate: Generate, out_path: Path, max_prompt_tokens: int, bar,
                      chunk: int, minutes: float, t0: float) -> int:
    """Chunk by chunk, one call of generate per round of user turns; returns the conversations answered."""
    last = 0.0
    for c in range(0, len(todo), chunk):
        if minutes and time.time() - t0 + last > minutes * 60:
            return c
        t_chunk = time.time()
        convs = [_new_conv(cid, msgs) for cid, msgs in todo[c:c + chunk]]
        active = [(v, p) for v in convs for p in [v.prompt(tok, max_prompt_tokens)] if p is not None]
        while active:
            answers = generate([p for _, p in active])
            nxt = []
            for (v, _), (ids, finished) in zip(active, answers):
                v.answered(tok, ids, finished)
                p = v.prompt(tok, max_prompt_tokens)
                if p is not None:
                    nxt.append((v, p))
            active = nxt
        _append(out_path, convs)
        bar.update(len(convs))
        last = time.time() - t_chunk
    return len(todo)


FLUSH_S = 10.0


def _answer_continuously(todo, tok, dec: ContinuousGreedy, out_path: Path, max_prompt_tokens: int, bar,
                         chunk: int, minutes: float, t0: float) -> int:
    """No rounds: dec's rows take waiting prompts as they free up; a conversation's next prompt waits
    as soon as its answer is done, a new conversation starts as soon as fewer than `chunk` are
    unfinished (or fewer than dec has rows: a conversation has one prompt in flight at a time, so
    fewer would leave rows idle). Once no conversation is left to start and three quarters of the
    rows are free, the decoder drops its free rows (ContinuousGreedy.compact): the rows left are
    enough, since each unfinished conversation has one prompt at a time. Records are appended in
    conversation order (a finished conversation waits for the ones before it), at most every FLUSH_S
    seconds: an fsync per conversation would cost more than its decode. Returns the conversations
    started (and answered)."""
    from collections import deque

    started: Dict[int, float] = {}                # id(conversation) -> start time, while unfinished
    unwritten, waiting = deque(), deque()         # conversations in order; (conversation, prompt)
    n, pace, flushed, stop = 0, 0.0, time.time(), False
    in_flight = max(chunk, dec.rows)
    answers, t_start, spent0 = 0, time.time(), dec.decode_s + dec.prefill_s
    while True:
        while len(started) < in_flight and n < len(todo) and not stop:
            stop = bool(minutes) and time.time() - t0 + pace > minutes * 60
            if stop:
                break
            v = _new_conv(*todo[n])
            n += 1
            unwritten.append(v)
            p = v.prompt(tok, max_prompt_tokens)
            if p is not None:
                started[id(v)] = time.time()
                waiting.append((v, p))
        dec.add([waiting.popleft() for _ in range(min(dec.free(), len(waiting)))])
        if not dec.busy():                        # nothing waits and nothing more may start
            break
        if not waiting and (stop or n == len(todo)) and 4 * dec.busy() <= dec.rows:
            dec.compact()                         # the last conversations: the batch shrinks with them
        for v, ids in dec.advance():
            answers += 1
            v.answered(tok, *cut_at_stop(ids, dec.stop_ids))
            p = v.prompt(tok, max_prompt_tokens)
            if p is None:
                pace = time.time() - started.pop(id(v))
            else:
                waiting.append((v, p))
        if time.time() - flushed > FLUSH_S:
            bar.set_postfix_str(f"{answers} answers, {len(started)} conversations in flight", refresh=False)
            bar.update(_append_finished(out_path, unwritten, started))
            flushed = time.time()
    bar.update(_append_finished(out_path, unwritten, started))
    wall = time.time() - t_start
    print(f"[regenerate] continuous: {answers} answers in {wall:.1f} s; {dec.pace()}; "
          f"{wall - (dec.decode_s + dec.prefill_s - spent0):.1f} s elsewhere (prompts rendered, records "
          f"written)", flush=True)
    return n


def _append_finished(path: Path, unwritten, started: Dict[int, float]) -> int:
    """Append the finished conversations at the head of `unwritten` (a deque, in order); their number."""
    ready = []
    while unwritten and id(unwritten[0]) not in started:
        ready.append(unwritten.popleft())
    if ready:
        _append(path, ready)
    return len(ready)


def _new_conv(cid: str, messages: list) -> _Conv:
    return _Conv(cid, [], [dict(role=m["role"], content=m["content"]) for m in messages])


def source_conversations(src: Source, data: DataConfig) -> List[Tuple[str, list]]:
    """The first data.num_samples usable conversations of one source (all when 0), in file order,
    cut to data.turns user turns and skipped when the first is data.max_prompt_chars long."""
    out = []
    for cid, messages in iter_conversations(src.source, src.path):
        try:
            messages = select_turns(messages, data.turns, data.max_prompt_chars)
        except BadRecord:
            continue
        if chat.conversation_problem(messages, needs="user") is None:
            out.append((cid, messages))
            if data.num_samples and len(out) >= data.num_samples:
                break
    return out


def _regenerate_hf(device: str, target_dir: Path, target: TargetConfig, capture: CaptureConfig,
                   convs: Sequence[Tuple[str, list]], path: Path, max_length: int, progress: bool,
                   desc: str = "regenerate", seed_offset: int = 0) -> None:
    tok = chat.load_tokenizer(target_dir, target)
    model = load_target_model(target_dir, model_dtype(device), device, target.trust_remote_code)
    stop, n, t = chat.stop_ids(tok, target_dir), capture.regen_max_new_tokens, capture.regen_temperature
    if t > 0:
        torch.manual_seed(capture.regen_seed + seed_offset)
    gen = hf_continuous(model, stop, n, max_length - 1, capture.regen_batch_size, temperature=t) \
        if capture.regen_continuous else None
    gen = gen or hf_generate(model, stop, n, capture.regen_batch_size, temperature=t)
    regenerate_conversations(convs, tok, gen, path, max_length, progress=progress,
                             chunk=capture.regen_chunk, minutes=capture.regen_minutes, desc=desc)


def _worker(rank: int, workers: int, device: str, target_dir: Path, target: TargetConfig,
            capture: CaptureConfig, convs: Sequence[Tuple[str, list]], part: Path, max_length: int) -> None:
    if device.startswith("cuda"):
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    _regenerate_hf(device, target_dir, target, capture, convs[rank::workers], part, max_length,
                   progress=rank == 0, desc=f"regenerate (worker 0 of {workers})", seed_offset=rank)


def _regenerate_in_workers(workers: int, device: str, target_dir: Path, target: TargetConfig,
                           data: DataConfig, capture: CaptureConfig, missing: Sequence[Tuple[str, list]],
                           path: Path) -> None:
    """Worker r (on GPU r) answers every workers-th missing conversation into its own part file,
    resumable on its own; the parts are then appended to the cache in conversation order and removed."""
    import torch.multiprocessing as mp

    parts = [path.with_name(f"{path.stem}.part{r}of{workers}.jsonl") for r in range(workers)]
    print(f"[regenerate] {len(missing)} conversations in {workers} workers -> {', '.join(p.name for p in parts)}")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, workers, device, target_dir, target, capture, list(missing),
                                               parts[r], data.max_length)) for r in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [str(parts[r]) for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"error: regeneration failed in {len(failed)} worker(s); their finished "
                         f"conversations are kept in {', '.join(failed)} and a rerun resumes them")
    records = {}
    for part in parts:
        done_ids(part)                               # cuts a torn last line
        with open(part, encoding="utf-8") as f:
            for line in f:
                records[json.loads(line)["id"]] = line
    with open(path, "a", encoding="utf-8") as f:
        for cid, _ in missing:
            if cid in records:
                f.write(records[cid])
        f.flush()
        os.fsync(f.fileno())
    for part in parts:
        part.unlink()


def regenerate(target_dir: Path, target: TargetConfig, data: DataConfig, capture: CaptureConfig,
               tok, info) -> List[Path]:
    """Answer the conversations of every source of data's mix with the target, in mix order;
    returns the files holding the answers, one per source: eagle3.data.regenerated_path once all
    of a source's are answered, its .partial.jsonl while some are not (capture.regen_minutes
    stopped it; the later sources are not started, and a rerun goes on).

    tok: the target's tokenizer; target.chat_template_kwargs are bound to it here, so the prompts
    render as the training data and evaluation render them.
    Engine = capture.backend: hf loads the target in-process (one worker per GPU, or
    capture.regen_workers); sglang uses capture.server_url, or launches a plain server (capture
    plugin inert) for the time of the regeneration.
    """
    if capture.regen_temperature < 0:
        raise SystemExit(f"error: capture.regen_temperature={capture.regen_temperature}: expected 0 (greedy "
                         f"answers) or more (sampled ones)")
    tok = chat.use_template_kwargs(tok, target.chat_template_kwargs)
    paths = []
    for src in mix_sources(data.mix, data.source, data.path):
        # each source at its own temperature (data.mix), the engines below read it from capture
        cap = dataclasses.replace(capture, regen_temperature=src.regen_temperature(capture))
        paths.append(_regenerate_source(src, target_dir, target, data, cap, tok, info))
        if paths[-1].name.endswith(".partial.jsonl"):
            break
    return paths


def _regenerate_source(src: Source, target_dir: Path, target: TargetConfig, data: DataConfig,
                       capture: CaptureConfig, tok, info) -> Path:
    key = regeneration_key(info.fingerprint, tok, src, data, capture.regen_max_new_tokens,
                           capture.regen_temperature)
    path = regeneration_file(key)
    write_key(path, key)
    what = src.label + (f" at temperature {capture.regen_temperature:g}" if capture.regen_temperature > 0 else "")
    if path.exists():
        print(f"[regenerate] every conversation of {what} is answered in {path}")
        return path
    partial = path.with_name(f"{path.stem}.partial.jsonl")
    convs = source_conversations(src, data)
    if not convs:
        raise SystemExit(f"error: no conversation with a user turn in {src.label}")
    if not partial.exists():
        reuse_other_sizes(path, key, convs, partial)
    have = done_ids(partial)
    missing = [c for c in convs if c[0] not in have]
    print(f"[regenerate] {what}: {len(convs) - len(missing)} of {len(convs)} conversations answered in {partial}")
    if missing:
        _answer(target_dir, target, data, capture, tok, convs, missing, partial)
    left = len(missing) - len(done_ids(partial) & {cid for cid, _ in missing})
    if left:
        print(f"[regenerate] {left} of {len(convs)} conversations not answered yet; rerun to go on")
        return partial
    os.replace(partial, path)
    return path


def _answer(target_dir: Path, target: TargetConfig, data: DataConfig, capture: CaptureConfig, tok,
            convs: Sequence[Tuple[str, list]], missing: Sequence[Tuple[str, list]], partial: Path) -> None:
    n = capture.regen_max_new_tokens
    if capture.backend == "hf":
        device = pick_device(capture.device)
        workers = capture.regen_workers or (torch.cuda.device_count() if device.startswith("cuda") else 1)
        if workers > 1:
            _regenerate_in_workers(workers, device, target_dir, target, data, capture, missing, partial)
        else:
            _regenerate_hf(device, target_dir, target, capture, convs, partial, data.max_length, progress=True)
        return
    if capture.backend != "sglang":
        raise SystemExit(f"error: capture.backend={capture.backend!r}: expected 'hf' or 'sglang'")
    stop = chat.stop_ids(tok, target_dir)
    if capture.server_url:
        gen = sglang_generate(capture.server_url, stop, n, capture.concurrency, capture.spool_dir,
                              temperature=capture.regen_temperature)
        regenerate_conversations(convs, tok, gen, partial, data.max_length,
                                 chunk=capture.regen_chunk, minutes=capture.regen_minutes)
        return
    from capture.sglang_client import needs_remote_code
    from capture.sglang_server import SPOOL_ENV, free_port, running_server

    port = free_port()
    cmd = server_cmd(str(target_dir), capture.tp_size, port, capture.server_args,
                     trust_remote_code=needs_remote_code(target_dir), python=sglang_python())
    env = {k: v for k, v in os.environ.items() if k != SPOOL_ENV}
    with running_server(cmd, env, partial.with_suffix(".server.log"), port) as (url, _):
        gen = sglang_generate(url, stop, n, capture.concurrency, temperature=capture.regen_temperature)
        regenerate_conversations(convs, tok, gen, partial, data.max_length,
                                 chunk=capture.regen_chunk, minutes=capture.regen_minutes)
