"""SGLang capture client: prompts -> capture server -> spool -> feature dataset.

    python -m capture +experiment=kimi_k25                                   # launches the server
    python -m capture +experiment=kimi_k25 capture.server_url=http://127.0.0.1:30000   # uses one

capture/run.py calls capture_sglang(). It sends each pre-tokenized sample to /generate
(`input_ids`, `rid`, max_new_tokens 0: prefill only); the server-side plugin
(capture/sglang_plugin.py) writes `req_<rid>/` into the spool; this client packs every finished
request into the feature dataset (FeatureWriter.add writes the sample at its planned place in its
shard file at once, so nothing waits in memory or in the spool for the rest of its shard) and
deletes it. Sending pauses while the spool, plus what the requests in flight will add, would pass
capture.spool_budget_gb (tmpfs is RAM). Requests go out in shard-plan order, so shards complete
one after another; a rerun keeps committed shards, reuses finished spool entries and sends the rest.

A rid is the sample's (spool_rid) plus `+<nonce>`, fresh for every run: the plugin writes a rid once
and skips a second prefill of it (SGLang re-prefills retracted requests under the same rid), so a
rerun against a server that is still up must not reuse the rids it already saw.

The client reads the spool directly: it must run on the node of the server's TP rank 0.
The server's Python is $EAGLE3_SGLANG_PYTHON (SGLang lives in its own environment), else this one.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from capture.sglang_plugin import SGLANG_VERSION, safe_rid
from capture.sglang_server import capture_server_cmd, capture_server_env, free_port, log_tail, running_server
from eagle3 import codec
from eagle3.codec import FeatureFormat
from eagle3.config import CaptureConfig
from eagle3.features import make_meta
from eagle3.feature_writer import FeatureWriter, finished_capture, open_capture
from eagle3.serving import sglang_python

REQUEST_TIMEOUT = 900.0           # one prefill-only request, queued behind `concurrency` others
# A request answered by the server must show up in the spool within this time, or the plugin is
# not capturing (not installed in the server's environment, EAGLE3_SPOOL_DIR not set, ...).
SPOOL_TIMEOUT = 300.0
_FILE_OVERHEAD = 4096             # torch.save's zip framing per file, an upper bound (bytes)
_POLL = 0.02                      # seconds between spool polls when nothing happened
_ATTEMPT_RE = re.compile(r"(.+)\+([0-9a-f]{8})")


# ----------------------------------------------------------------------------------------------
# Small pieces (tests use them directly).

def spool_rid(sample_id: str) -> str:
    """A rid stem the plugin accepts as a directory name; ids that are already safe stay as they are.

    Others (ShareGPT's "<id>#<k>", paths, long ids) become their safe characters plus a hash of
    the whole id: deterministic, so a rerun maps an earlier run's spool entries back to samples.
    """
    sid = str(sample_id)
    if safe_rid(sid) and len(sid) <= 150:
        return sid
    digest = hashlib.blake2b(sid.encode(), digest_size=6).hexdigest()
    stem = re.sub(r"[^A-Za-z0-9_.:=+-]", "_", sid)[:120].lstrip(".")
    return f"{stem}={digest}"


def attempt_rid(stem: str, nonce: str) -> str:
    """The rid one run sends for a sample: its stem plus the run's nonce (8 hex digits)."""
    return f"{stem}+{nonce}"


def rid_stem(rid: str) -> str:
    """attempt_rid's inverse; a rid without a nonce (an older client's) is its own stem."""
    m = _ATTEMPT_RE.fullmatch(rid)
    return m.group(1) if m else rid


def new_nonce() -> str:
    return os.urandom(4).hex()


def rid_map(sample_ids: Sequence[str]) -> Dict[str, str]:
    """rid -> sample id for every sample; two samples may never share a rid."""
    out: Dict[str, str] = {}
    for sid in sample_ids:
        rid = spool_rid(sid)
        if rid in out:
            raise ValueError(f"samples {out[rid]!r} and {sid!r} map to the same spool rid {rid!r}")
        out[rid] = str(sid)
    return out


def request_bytes(num_tokens: int, num_aux: int, hidden: int) -> int:
    """An upper bound on one request's spool size: k aux + final bf16 [T, H] files, plus meta."""
    return (num_aux + 1) * (num_tokens * hidden * 2 + _FILE_OVERHEAD) + _FILE_OVERHEAD


def spool_bytes(spool: Path) -> int:
    """Bytes under the spool's request directories (finished or being written)."""
    total = 0
    try:
        entries = list(os.scandir(spool))
    except FileNotFoundError:
        return 0
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                total += sum(f.stat().st_size for f in os.scandir(e.path) if f.is_file())
    return total


def server_version(url: str) -> Optional[str]:
    """SGLang's version as the server reports it (/server_info; /get_server_info before 0.5.23)."""
    for path in ("/server_info", "/get_server_info"):
        try:
            with urllib.request.urlopen(url.rstrip("/") + path, timeout=30) as r:
                version = json.loads(r.read()).get("version")
            if version:
                return str(version)
        except (urllib.error.URLError, OSError, ValueError):
            continue
    return None


def post_json(url: str, body: Dict[str, Any], timeout: float = REQUEST_TIMEOUT) -> Dict[str, Any]:
    """POST JSON, return the decoded answer; HTTP errors raise RuntimeError with the server's text."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode('utf-8', 'replace')[:2000]}") from None


def needs_remote_code(target_dir: Path) -> bool:
    """Checkpoints that ship their own modelling code (Kimi-K2.5) name it in config.json's auto_map."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return "auto_map" in cfg or "auto_map" in (cfg.get("text_config") or {})


# ----------------------------------------------------------------------------------------------
# Reading one finished spool entry.

def read_entry(d: Path, sample, hidden: int, aux_layers: Sequence[int], rid: str):
    """(aux [T, k*H] bf16, final [T, H] bf16) of req_<rid>/, checked against the sample.

    A mismatch (token count, hidden size, number or ids of aux layers) raises naming the rid:
    it means the server captured something other than what was sent.
    """
    meta = json.loads((d / "meta.json").read_text())
    k, T = len(aux_layers), len(sample.input_ids)
    where = f"request {rid} (sample {sample.id!r}, {d})"
    if int(meta.get("num_tokens", -1)) != T:
        raise RuntimeError(f"{where}: the spool holds {meta.get('num_tokens')} tokens, the sample "
                           f"has {T}. The server did not prefill exactly the ids sent (a chat "
                           "template or BOS added server-side, a truncated prompt?)")
    if int(meta.get("hidden_size", -1)) != hidden:
        raise RuntimeError(f"{where}: hidden size {meta.get('hidden_size')}, the target's is {hidden}: "
                           "is the server serving another model?")
    if meta.get("aux_layers") is not None and list(meta["aux_layers"]) != list(aux_layers):
        raise RuntimeError(f"{where}: captured aux_layers {meta['aux_layers']}, this capture wants "
                           f"{list(aux_layers)}: the server was launched for other layers")
    aux = [torch.load(d / f"aux_{i}.pt", map_location="cpu", weights_only=True) for i in range(k)]
    if (d / f"aux_{k}.pt").exists() or int(meta.get("num_aux", k)) != k:
        raise RuntimeError(f"{where}: {meta.get('num_aux')} aux states in the spool, expected {k}")
    final = torch.load(d / "final.pt", map_location="cpu", weights_only=True)
    for name, t in [*((f"aux_{i}", a) for i, a in enumerate(aux)), ("final", final)]:
        if tuple(t.shape) != (T, hidden):
            raise RuntimeError(f"{where}: {name}.pt has shape {tuple(t.shape)}, expected {(T, hidden)}")
    return torch.cat(aux, dim=-1), final


# ----------------------------------------------------------------------------------------------
# The packer loop.

@dataclass
class _Run:
    """What the loop tracks: requests sent and not yet packed, refusals, counters."""
    spool: Path
    url: str
    rids: Dict[str, str]                        # rid -> sample id
    by_id: Dict[str, Any]                       # sample id -> sample
    in_flight: Dict[str, Future] = field(default_factory=dict)    # HTTP request running
    answered: Dict[str, float] = field(default_factory=dict)      # answered, waiting for `done`
    refused: Dict[str, str] = field(default_factory=dict)         # sample id -> reason
    inflight_bytes: int = 0
    est: Dict[str, int] = field(default_factory=dict)             # rid -> estimated spool bytes


def _send(url: str, rid: str, input_ids: List[int]) -> Dict[str, Any]:
    return post_json(url + "/generate", {"input_ids": [int(t) for t in input_ids], "rid": rid,
                                         "sampling_params": {"max_new_tokens": 0}})


def _check_errors_file(spool: Path) -> None:
    f = spool / "errors.txt"
    if f.exists():
        raise RuntimeError(f"the capture plugin reports a misconfigured server ({f}); fix it, delete "
                           f"the file and rerun:\n{f.read_text()[-4000:]}")


def _sample_of(rid: str, stems: Dict[str, str]) -> Optional[str]:
    """The sample id behind a spool rid of any run, given this capture's {stem: sample id}."""
    return stems[rid] if rid in stems else stems.get(rid_stem(rid))


def _prepare_spool(spool: Path, stems: Dict[str, str], done: set) -> Dict[str, str]:
    """Clean what an earlier run left; return {sample id: rid} of finished entries to pack as they are.

    An old errors.txt belongs to an earlier server: it is kept aside, not acted on. An entry of a
    pending sample (from any earlier run) is reused when finished, else removed (to be sent
    again); entries of committed samples, second entries of one sample and entries of
    regeneration requests are removed; others are left alone.
    """
    spool.mkdir(parents=True, exist_ok=True)
    old = spool / "errors.txt"
    if old.exists():
        aside = spool / f"errors.{time.strftime('%Y%m%d-%H%M%S')}.txt.old"
        os.replace(old, aside)
        print(f"[capture] warning: {old} from an earlier server moved to {aside.name}")
    reuse: Dict[str, str] = {}
    foreign = 0
    for e in sorted(os.scandir(spool), key=lambda e: e.name):
        if not e.name.startswith("req_") or not e.is_dir():
            continue
        rid, d = e.name[4:], Path(e.path)
        sid = _sample_of(rid, stems)
        if sid is not None and sid not in done and sid not in reuse and (d / "done").exists():
            reuse[sid] = rid
        elif sid is not None or rid.startswith("regen."):
            shutil.rmtree(d, ignore_errors=True)
        else:
            foreign += 1
    if foreign:
        print(f"[capture] warning: {foreign} spool entries in {spool} belong to no sample of this "
              "capture; they are left alone but count against the spool budget")
    return reuse


def _sweep_other_attempts(spool: Path, stems: Dict[str, str], ours: Dict[str, str]) -> None:
    """Remove entries of this capture's samples written for another run's rids: requests an
    interrupted run left in flight can land after this run has resent their samples."""
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(spool):
            rid = e.name[4:]
            if e.name.startswith("req_") and rid not in ours and _sample_of(rid, stems) is not None:
                shutil.rmtree(e.path, ignore_errors=True)


def _pack(run: _Run, writer: FeatureWriter, rid: str, hidden: int, aux_layers: Sequence[int]) -> int:
    """Pack req_<rid>/ into the dataset and delete it; returns the sample's token count."""
    d = run.spool / f"req_{rid}"
    sample = run.by_id[run.rids[rid]]
    aux, final = read_entry(d, sample, hidden, aux_layers, rid)
    writer.add(sample.id, sample.input_ids, sample.loss_mask, aux, final)
    shutil.rmtree(d, ignore_errors=True)
    return len(sample.input_ids)


def _poll(run: _Run, writer: FeatureWriter, hidden: int, aux_layers: Sequence[int], bar) -> bool:
    """One pass over requests sent: collect answers, pack finished entries, note refusals."""
    progressed, late = False, []
    for rid, fut in list(run.in_flight.items()):
        if not fut.done():
            continue
        del run.in_flight[rid]
        progressed = True
        exc = fut.exception()
        if exc is not None:
            run.refused[run.rids[rid]] = f"request {rid}: {exc}"
            run.inflight_bytes -= run.est.pop(rid, 0)
            bar.update(len(run.by_id[run.rids[rid]].input_ids))
        else:
            run.answered[rid] = time.monotonic()
    for rid in list(run.in_flight) + list(run.answered):
        d = run.spool / f"req_{rid}"
        if (d / "done").exists():
            bar.update(_pack(run, writer, rid, hidden, aux_layers))
        elif (d / "error.txt").exists():
            run.refused[run.rids[rid]] = f"request {rid}: {(d / 'error.txt').read_text().strip()}"
            shutil.rmtree(d, ignore_errors=True)
            bar.update(len(run.by_id[run.rids[rid]].input_ids))
        else:
            if rid in run.answered and time.monotonic() - run.answered[rid] > SPOOL_TIMEOUT:
                late.append(rid)
            continue
        progressed = True
        run.answered.pop(rid, None)
        fut = run.in_flight.pop(rid, None)
        if fut is not None:   # spooled before its answer arrived: the answer is not needed
            fut.add_done_callback(lambda f: f.exception())
        run.inflight_bytes -= run.est.pop(rid, 0)
    if late:
        more = f" and {len(late) - 5} more" if len(late) > 5 else ""
        raise RuntimeError(
            f"no spool entry arrived for request id(s) {', '.join(late[:5])}{more} within "
            f"{SPOOL_TIMEOUT:g} s of the server answering (expected {run.spool}/req_<rid>/done). "
            "Is the server started with the capture plugin? Its log says 'eagle3 capture plugin: "
            "spooling prefills to <dir>' when the plugin is installed in the server's environment "
            f"and EAGLE3_SPOOL_DIR is set. Is the spool dir the same path on both sides? This client "
            f"reads {run.spool}; the server must write there, on this node (that of its TP rank 0)")
    return progressed


def pack_requests(samples: Sequence[Any], writer: FeatureWriter, url: str, spool: Path,
                  aux_layers: Sequence[int], hidden: int, concurrency: int, budget_bytes: int,
                  proc=None, log_path: Optional[Path] = None, progress: bool = True) -> Dict[str, str]:
    """Send every sample of the writer's pending shards, pack them; returns {sample id: reason} of
    refused requests (the caller fails the run with them)."""
    from tqdm import tqdm

    pending = [samples[i] for shard in writer.pending_shards() for i in shard]
    stems = rid_map([s.id for s in samples])
    reuse = _prepare_spool(spool, stems, writer.done_ids())
    nonce = new_nonce()
    rid_of = {str(s.id): reuse.get(str(s.id)) or attempt_rid(spool_rid(s.id), nonce) for s in pending}
    run = _Run(spool, url.rstrip("/"), {r: sid for sid, r in rid_of.items()}, {str(s.id): s for s in samples})
    (spool / "rids.json").write_text(json.dumps({r: s for r, s in stems.items() if r != s}))
    k = len(aux_layers)
    bar = tqdm(total=sum(len(s.input_ids) for s in pending), unit="tok", unit_scale=True,
               desc="capture", disable=not progress, smoothing=0.05)
    pool = ThreadPoolExecutor(max(1, int(concurrency)), thread_name_prefix="eagle3-capture-http")
    queue = list(reversed(pending))            # pop() from the end = plan order
    last_size = (0.0, 0)
    try:
        while queue or run.in_flight or run.answered:
            _check_errors_file(spool)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the capture server exited with code {proc.returncode}; last lines "
                                   f"of {log_path}:\n{log_tail(str(log_path))}")
            now = time.monotonic()
            if now - last_size[0] > 0.5:       # a directory walk: not every iteration
                last_size = (now, spool_bytes(spool))
            while queue and len(run.in_flight) < concurrency:
                s = queue[-1]
                rid = rid_of[str(s.id)]
                if str(s.id) in reuse:         # finished by an earlier run, never packed
                    queue.pop()
                    run.answered[rid] = now
                    continue
                est = request_bytes(len(s.input_ids), k, hidden)
                # With nothing in flight, send anyway: one request over budget (or entries that
                # are not ours) must not stall the run forever.
                busy = bool(run.in_flight or run.answered)
                if busy and last_size[1] + run.inflight_bytes + est > budget_bytes:
                    break                      # pause: the spool would pass its budget
                queue.pop()
                run.est[rid] = est
                run.inflight_bytes += est
                run.in_flight[rid] = pool.submit(_send, run.url, rid, s.input_ids)
            progressed = _poll(run, writer, hidden, aux_layers, bar)
            if progressed:
                last_size = (time.monotonic(), spool_bytes(spool))
            bar.set_postfix(spool=f"{last_size[1] / 2**30:.2f}GB", flight=len(run.in_flight),
                            refused=len(run.refused), refresh=False)
            if not progressed:
                time.sleep(_POLL)
        _sweep_other_attempts(spool, stems, run.rids)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
    return run.refused


# ----------------------------------------------------------------------------------------------
# Entry point (capture/run.py).

def capture_sglang(target_dir: Path, info, tok, samples: Sequence[Any], aux_layers: Sequence[int],
                   capture: CaptureConfig, data_meta: Dict[str, Any], out_dir: Path,
                   progress: bool = True, vocab_samples: Optional[Sequence[Any]] = None) -> Path:
    """Capture `samples` (objects with .id, .input_ids, .loss_mask) through an SGLang capture server.
    A compact capture's draft vocab comes from vocab_samples (default: samples).

    info: eagle3.targets.TargetInfo; tok: the tokenizer (its name and chat template go to the
    manifest). Launches the server (TP capture.tp_size, aux ids via eagle3.engine_ids) unless
    capture.server_url is set, and stops it on exit. Resumable like the hf backend.
    """
    out_dir, spool = Path(out_dir), Path(capture.spool_dir)

    def meta_of(version: str) -> Dict[str, Any]:
        return make_meta(target_name=info.name, target_fingerprint=info.fingerprint, arch=info.model_type,
                         aux_layers=aux_layers, hidden_size=info.hidden_size,
                         tokenizer_name=getattr(tok, "name_or_path", ""),
                         chat_template=getattr(tok, "chat_template", None), engine="sglang",
                         engine_version=version, data=data_meta)

    compact = None
    if capture.format != "full":   # the client computes the teacher from the spool's final states, on a GPU if one is free
        from eagle3.targets import load_head
        head = load_head(target_dir)[1].to("cuda" if torch.cuda.is_available() else "cpu")
        compact = codec.compact_for(FeatureFormat(capture.format, capture.teacher_topk, capture.draft_vocab_size),
                                    samples if vocab_samples is None else vocab_samples,
                                    data_meta.get("heldout_ids", []), head)
    if finished_capture(out_dir, meta_of(""), capture.dtype, capture.aux_dtype, compact):
        return out_dir
    with contextlib.ExitStack() as stack:
        proc, log_path, url = None, None, capture.server_url
        if not url:
            port = free_port()
            log_path = out_dir.with_name(out_dir.name + ".capture_server.log")
            cmd = capture_server_cmd(str(target_dir), capture.tp_size, aux_layers, info.architectures, port,
                                     capture.server_args, trust_remote_code=needs_remote_code(target_dir),
                                     python=sglang_python())
            url, proc = stack.enter_context(running_server(
                cmd, capture_server_env(str(spool), aux_layers), log_path, port))
        version = server_version(url) or SGLANG_VERSION
        writer = open_capture(out_dir, meta_of(version), [str(s.id) for s in samples],
                              [len(s.input_ids) for s in samples], dtype=capture.dtype,
                              shard_tokens=capture.shard_tokens, aux_dtype=capture.aux_dtype, compact=compact)
        print(f"[capture] SGLang {version} at {url}: {sum(map(len, writer.pending_shards()))} samples "
              f"to capture, spool {spool} (budget {capture.spool_budget_gb} GB)")
        try:
            refused = pack_requests(samples, writer, url, spool, aux_layers, info.hidden_size,
                                    capture.concurrency, int(capture.spool_budget_gb * 2**30), proc,
                                    log_path, progress)
        except KeyboardInterrupt:
            print(f"\ncapture: interrupted; committed shards are kept in {writer.partial}: rerun to resume")
            raise
    if refused:
        lines = "\n".join(f"  {sid}: {why}" for sid, why in list(refused.items())[:50])
        raise RuntimeError(f"capture: {len(refused)} request(s) refused (shards without them stay "
                           f"uncommitted in {writer.partial}; rerun to retry them):\n{lines}")
    return writer.finish()
