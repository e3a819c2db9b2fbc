"""The SGLang capture client against a fake capture server, in the main environment (no SGLang).

    .venv/bin/python -m pytest tests/test_sglang_client.py -q

The fake server is a real HTTP server on 127.0.0.1: for each /generate it computes the tiny
target's hidden states with eagle3.hidden.capture_hidden (one unpadded sample) and hands them to the
plugin's own process_pass (its assembly state lives as long as the server, longer prompts arrive
in two chunks), which writes the spool entry, a little after answering (the plugin writes on a
background thread). Independent truth: the hf backend's dataset of the same samples (padded
batches, its own writer path), compared field by field and within bf16 rounding.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from capture.hf import hf_meta, run_capture
import capture.sglang_client as client
from capture.sglang_assembly import AssemblyState
from capture.sglang_client import (attempt_rid, capture_sglang, request_bytes, rid_map, rid_stem, spool_bytes,
                                   spool_rid)
from capture.sglang_plugin import PassCopy, process_pass, safe_rid, write_error
from eagle3.hidden import capture_hidden
from eagle3.config import CaptureConfig
from eagle3.features import FeatureDataset
from eagle3.targets import target_info

AUX = [1, 3, 4]
BF16_RTOL = 2 ** -7


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("tiny") / "tiny_llama"
    model.save_pretrained(d)
    return model, target_info(d, "tiny_llama")


def make_samples(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = ["c0", "sg#1", "a/b", "c3"] + [f"c{i}" for i in range(4, n)]   # two ids need a mapped rid
    out = []
    for i in range(n):
        T = int(torch.randint(4, 30, (1,), generator=g))
        out.append(SimpleNamespace(id=ids[i], input_ids=torch.randint(3, 512, (T,), generator=g).tolist(),
                                   loss_mask=[int(t >= T // 2) for t in range(T)]))
    return out


class FakeServer:
    """/generate -> spool entry (as the plugin writes it); /server_info -> a version; /health."""

    def __init__(self, model, spool: Path, refuse=(), short=(), misconfigure_after=None, delay=0.01,
                 misconfigure_gate=None):
        self.model, self.spool, self.delay = model, Path(spool), delay
        self.misconfigure_gate = misconfigure_gate   # misconfigure only once this returns True
        self.refuse, self.short, self.misconfigure_after = set(refuse), set(short), misconfigure_after
        self.received, self.max_spool, self.lock = [], 0, threading.Lock()
        self.state = AssemblyState()                     # the plugin's: rids it has captured
        self.outcomes = []
        self.outstanding = self.max_outstanding = 0      # requests received and not yet spooled
        self.model_lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, obj, code=200):
                raw = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._reply({"version": "0.5.23"} if self.path == "/server_info" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert body["sampling_params"] == {"max_new_tokens": 0}
                rid, ids = rid_stem(body["rid"]), body["input_ids"]   # rid: the sample's stem
                with fake.lock:
                    fake.received.append(rid)
                    n = len(fake.received)
                    fake.outstanding += 1
                    fake.max_outstanding = max(fake.max_outstanding, fake.outstanding)
                self._reply({"text": "", "meta_info": {"id": rid, "prompt_tokens": len(ids)}})
                threading.Timer(fake.delay, fake.write, (body["rid"], ids, n)).start()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def write(self, rid, ids, n):
        try:
            self._write(rid, ids, n)
        finally:
            with self.lock:
                self.outstanding -= 1

    def _write(self, rid, ids, n):
        if self.misconfigure_after is not None and n > self.misconfigure_after:
            deadline = time.time() + 60          # under load the client may not have packed a shard yet
            while self.misconfigure_gate is not None and not self.misconfigure_gate() and time.time() < deadline:
                time.sleep(0.05)
            write_error(self.spool, None, "pass not captured: ValueError('rows without rids')")
            return
        if rid_stem(rid) in self.refuse:
            write_error(self.spool, rid, f"request {rid}: prefill starts at position 5 ...")
            return
        # forward hooks on one model, and one assembly state: one request at a time
        with self.model_lock, torch.no_grad():
            aux, final = capture_hidden(self.model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), AUX)
            H = final.shape[-1]
            aux_list, final = [a[0] for a in aux.split(H, dim=-1)], final[0]
            if rid_stem(rid) in self.short:              # the server prefilled one token less
                aux_list, final = [a[:-1] for a in aux_list], final[:-1]
            T = final.shape[0]
            cut = T // 2 if T > 16 else T                # chunked prefill: two passes
            for start, end in ((0, cut), (cut, T))[:1 + (cut < T)]:
                item = PassCopy(rids=[rid], prefix_lens=[start], extend_lens=[end - start],
                                total_lens=torch.tensor([T]), aux=[a[start:end] for a in aux_list],
                                final=final[start:end], event=None)
                self.outcomes += process_pass(self.spool, self.state, item, AUX, [a - 1 for a in AUX])
        with self.lock:
            self.max_spool = max(self.max_spool, spool_bytes(self.spool))

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def run_client(target, samples, out, spool, server, **kw):
    model, info = target
    cfg = CaptureConfig(backend="sglang", server_url=server.url, spool_dir=str(spool),
                        shard_tokens=kw.pop("shard_tokens", 60), concurrency=kw.pop("concurrency", 4),
                        spool_budget_gb=kw.pop("budget", 1.0))
    tok = SimpleNamespace(name_or_path="tiny-tok", chat_template="{{ x }}")
    data_meta = {"source": "fake", "num_samples": len(samples)}
    return capture_sglang(Path(info.path), info, tok, samples, AUX, cfg, data_meta, out, progress=False)


def hf_dataset(target, samples, out):
    model, info = target
    meta = hf_meta(target_name=info.name, target_fingerprint=info.fingerprint, arch=info.model_type,
                   aux_layers=AUX, hidden_size=info.hidden_size, tokenizer_name="tiny-tok",
                   chat_template="{{ x }}", data={"source": "fake", "num_samples": len(samples)})
    return run_capture(model, samples, out, aux_layers=AUX, meta=meta, batch_tokens=64, shard_tokens=60,
                       progress=False)


def spool_entries(spool):
    return sorted(p.name for p in Path(spool).iterdir() if p.name.startswith("req_"))


def test_rids_are_safe_deterministic_and_unique():
    ids = ["plain_id-1", "QWE12#1", "a/b", "../x", "x" * 300, ".hidden", "with space"]
    rids = [spool_rid(i) for i in ids]
    assert rids[0] == "plain_id-1"                             # safe ids are kept
    assert all(safe_rid(r) for r in rids) and rids == [spool_rid(i) for i in ids]
    assert len(set(rids)) == len(ids) and set(rid_map(ids).values()) == set(ids)
    assert spool_rid("a#1") != spool_rid("a_1") and spool_rid("a_1") == "a_1"
    ids.append("x+0123abcd")                                   # a safe id that looks like an attempt's
    attempts = [attempt_rid(spool_rid(i), "89abcdef") for i in ids]
    assert all(safe_rid(r) for r in attempts) and [rid_stem(r) for r in attempts] == [spool_rid(i) for i in ids]


def test_packed_dataset_equals_hf_backend(target, tmp_path):
    samples = make_samples(12)
    server = FakeServer(target[0], tmp_path / "spool")
    try:
        ds = FeatureDataset(run_client(target, samples, tmp_path / "sg", tmp_path / "spool", server))
    finally:
        server.close()
    ref = FeatureDataset(hf_dataset(target, samples, tmp_path / "hf"))
    ds.validate()
    a = {k: v for k, v in ds.manifest.items() if k not in ("engine", "shards")}
    b = {k: v for k, v in ref.manifest.items() if k not in ("engine", "shards")}
    assert a == b and a["totals"]["num_shards"] > 2

    def layout(m):        # the shards' files, samples and sizes; their bytes are compared as tensors below
        return [{k: v for k, v in s.items() if k != "sha256"} for s in m["shards"]]
    assert layout(ds.manifest) == layout(ref.manifest)
    # The server runs each request alone and the hf backend pads batches: a CPU's matmul kernels may
    # round a row differently by batch shape, so hidden states agree to a rounding of the stored dtype
    # (a mis-wired layer would differ everywhere), and ids and masks exactly.
    floats = same = 0
    for i in range(len(ds)):
        x, y = ds[i], ref[i]
        assert ds.sample_id(i) == ref.sample_id(i) and x.keys() == y.keys()
        for k in x:
            if x[k].is_floating_point():
                torch.testing.assert_close(x[k].float(), y[k].float(), rtol=2 ** -7, atol=1e-6, msg=k)
                floats, same = floats + x[k].numel(), same + int((x[k] == y[k]).sum())
            else:
                assert torch.equal(x[k], y[k]), k
    assert same >= 0.99 * floats
    assert ds.manifest["engine"] == {"name": "sglang", "version": "0.5.23"}
    assert sorted(server.received) == sorted(spool_rid(s.id) for s in samples)
    assert [o.kind for o in server.outcomes].count("complete") == len(samples)
    for i, s in enumerate(samples):
        got, want = ds[i], ref[i]
        assert ds.sample_id(i) == s.id and got["input_ids"].tolist() == s.input_ids
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        for name in ("aux", "final"):
            w = want[name].float()
            torch.testing.assert_close(got[name].float(), w, rtol=BF16_RTOL,
                                       atol=1e-4 * w.pow(2).mean().sqrt().item())
    assert spool_entries(tmp_path / "spool") == []             # every entry packed and deleted


def test_budget_pause_is_honoured(target, tmp_path):
    samples = make_samples(16, seed=1)
    biggest = max(request_bytes(len(s.input_ids), 3, 64) for s in samples)
    budget = 2.5 * biggest                                     # two requests at a time, at most
    server = FakeServer(target[0], tmp_path / "spool", delay=0.05)
    try:
        ds = FeatureDataset(run_client(target, samples, tmp_path / "sg", tmp_path / "spool", server,
                                       concurrency=8, budget=budget / 2**30))
    finally:
        server.close()
    assert len(ds) == 16 and spool_entries(tmp_path / "spool") == []
    assert 0 < server.max_spool <= budget
    smallest = min(request_bytes(len(s.input_ids), 3, 64) for s in samples)
    most_in_flight = int(budget // smallest)                  # the budget counts requests in flight too
    assert server.max_outstanding <= most_in_flight < 8
    # Without the budget, all 8 requests are in flight at once (the server holds each 0.5 s before
    # spooling it): the in-flight measurement can see a pause's effect, whatever the timing.
    server = FakeServer(target[0], tmp_path / "spool2", delay=0.5)
    try:
        run_client(target, samples, tmp_path / "sg2", tmp_path / "spool2", server, concurrency=8)
    finally:
        server.close()
    assert server.max_outstanding > most_in_flight


def test_resume_after_a_mid_run_stop(target, tmp_path):
    samples = make_samples(14, seed=2)
    spool = tmp_path / "spool"
    progress_file = tmp_path / "sg.partial" / "progress.json"

    def a_shard_is_committed():
        return progress_file.exists() and bool(json.loads(progress_file.read_text()).get("done"))

    server = FakeServer(target[0], spool, misconfigure_after=7, misconfigure_gate=a_shard_is_committed)
    try:
        with pytest.raises(RuntimeError, match="misconfigured"):
            run_client(target, samples, tmp_path / "sg", spool, server, concurrency=2)
    finally:
        server.close()
    partial = tmp_path / "sg.partial"
    progress = json.loads((partial / "progress.json").read_text())
    committed = {sid for s in progress["done"] for sid in
                 [samples[i].id for i in _plan(samples)[int(s)]]}
    assert committed                                           # something was packed and committed
    server = FakeServer(target[0], spool)
    try:
        ds = FeatureDataset(run_client(target, samples, tmp_path / "sg", spool, server))
    finally:
        server.close()
    assert not {spool_rid(sid) for sid in committed} & set(server.received)   # not sent again
    straight = tmp_path / "straight"
    server = FakeServer(target[0], tmp_path / "spool3")
    try:
        run_client(target, samples, straight, tmp_path / "spool3", server)
    finally:
        server.close()
    for rec in ds.manifest["shards"]:                           # byte-identical to a run without a stop
        assert (tmp_path / "sg" / rec["file"]).read_bytes() == (straight / rec["file"]).read_bytes()
    assert spool_entries(spool) == []


def test_resume_against_the_same_running_server(target, tmp_path, monkeypatch):
    """A client stopped midway (Ctrl-C) and rerun against the server it used, which is still up and
    remembers every rid it captured: the samples of the shard it discarded are captured again, and
    the dataset equals an uninterrupted capture's, tensor for tensor."""
    samples = make_samples(14, seed=6)
    spool, out = tmp_path / "spool", tmp_path / "sg"
    plan = _plan(samples)
    shard_of = {samples[i].id: n for n, shard in enumerate(plan) for i in shard}
    real_pack = client._pack

    def pack_then_stop(run, writer, rid, hidden, aux_layers):
        n = real_pack(run, writer, rid, hidden, aux_layers)
        progress = json.loads((tmp_path / "sg.partial" / "progress.json").read_text())
        if progress.get("done") and str(shard_of[run.rids[rid]]) not in map(str, progress["done"]):
            raise KeyboardInterrupt   # a shard is committed, this sample's is not: it will be resent
        return n

    server = FakeServer(target[0], spool)
    try:
        monkeypatch.setattr(client, "_pack", pack_then_stop)
        with pytest.raises(KeyboardInterrupt):
            run_client(target, samples, out, spool, server, concurrency=2)
        monkeypatch.setattr(client, "_pack", real_pack)
        deadline = time.time() + 60
        while server.outstanding and time.time() < deadline:   # what it had in flight lands in the spool
            time.sleep(0.05)
        first = list(server.received)
        ds = FeatureDataset(run_client(target, samples, out, spool, server))
    finally:
        server.close()
    resent = set(first) & set(server.received[len(first):])
    assert resent                                   # rids the server had captured, sent again...
    kinds = [o.kind for o in server.outcomes]
    assert "duplicate" not in kinds and kinds.count("complete") == len(server.received)   # ...and captured
    assert spool_entries(spool) == []
    straight = FakeServer(target[0], tmp_path / "spool2")
    try:
        ref = FeatureDataset(run_client(target, samples, tmp_path / "straight", tmp_path / "spool2", straight))
    finally:
        straight.close()
    assert ds.manifest == ref.manifest and len(ds) == len(samples)
    for i in range(len(ds)):
        assert ds.sample_id(i) == ref.sample_id(i)
        assert all(torch.equal(ds[i][k], ref[i][k]) for k in ("input_ids", "loss_mask", "aux", "final"))


def test_a_rerun_reuses_finished_entries_and_clears_other_attempts(tmp_path):
    """Entries of an earlier run are mapped back to samples through their rid stem: a finished one is
    packed as it is, an unfinished one or a second one of the same sample is removed, others stay."""
    stems = rid_map(["c0", "sg#1", "c2", "c3"])
    by_stem = {sid: stem for stem, sid in stems.items()}
    spool = tmp_path / "spool"
    for rid, finished in [(attempt_rid(by_stem["sg#1"], "0a0b0c0d"), True), (by_stem["c0"], True),
                          (attempt_rid(by_stem["c2"], "00000001"), False), (attempt_rid(by_stem["c3"], "00000001"), True),
                          (attempt_rid(by_stem["c3"], "00000002"), True), ("other+00000001", True)]:
        (spool / f"req_{rid}").mkdir(parents=True)
        if finished:
            (spool / f"req_{rid}" / "done").touch()
    reuse = client._prepare_spool(spool, stems, done={"c0"})
    assert reuse == {"sg#1": attempt_rid(by_stem["sg#1"], "0a0b0c0d"), "c3": attempt_rid("c3", "00000001")}
    assert spool_entries(spool) == sorted(f"req_{r}" for r in [*reuse.values(), "other+00000001"])
    (spool / f"req_{attempt_rid('c2', '00000003')}").mkdir()           # landed after the rerun resent c2
    client._sweep_other_attempts(spool, stems, {attempt_rid("c2", "00000004"): "c2", reuse["c3"]: "c3"})
    assert spool_entries(spool) == sorted(["req_other+00000001", f"req_{reuse['c3']}"])


def test_timeout_names_the_request_ids_and_what_to_check(target, tmp_path, monkeypatch):
    """A server that answers but never spools (no plugin, or another spool dir)."""
    class Answers(FakeServer):
        def write(self, rid, ids, n):
            with self.lock:
                self.outstanding -= 1

    monkeypatch.setattr(client, "SPOOL_TIMEOUT", 0.5)
    samples = make_samples(3, seed=7)
    server = Answers(target[0], tmp_path / "spool")
    try:
        with pytest.raises(RuntimeError) as e:
            run_client(target, samples, tmp_path / "sg", tmp_path / "spool", server)
    finally:
        server.close()
    msg = str(e.value)
    assert "no spool entry arrived for request id(s)" in msg and "within 0.5 s" in msg
    assert any(spool_rid(s.id) + "+" in msg for s in samples)
    assert "capture plugin" in msg and "same path on both sides" in msg and str(tmp_path / "spool") in msg


def _plan(samples):
    from eagle3.features import plan_shards
    return plan_shards([len(s.input_ids) for s in samples], 60)


def test_refused_request_is_reported_and_fails_the_run(target, tmp_path):
    samples = make_samples(10, seed=3)
    bad = samples[4].id
    server = FakeServer(target[0], tmp_path / "spool", refuse={spool_rid(bad)})
    try:
        with pytest.raises(RuntimeError, match=r"1 request\(s\) refused") as e:
            run_client(target, samples, tmp_path / "sg", tmp_path / "spool", server)
    finally:
        server.close()
    assert bad in str(e.value) and "prefill starts at position 5" in str(e.value)
    assert not (tmp_path / "sg").exists() and (tmp_path / "sg.partial").exists()
    assert spool_entries(tmp_path / "spool") == []
    # The rerun resends only the refused sample's uncommitted shard and finishes.
    server = FakeServer(target[0], tmp_path / "spool")
    try:
        ds = FeatureDataset(run_client(target, samples, tmp_path / "sg", tmp_path / "spool", server))
    finally:
        server.close()
    assert spool_rid(bad) in server.received and len(server.received) < len(samples) and len(ds) == 10


def test_token_count_mismatch_is_refused_naming_the_rid(target, tmp_path):
    samples = make_samples(6, seed=4)
    bad = samples[1].id                                        # "sg#1": a mapped rid
    server = FakeServer(target[0], tmp_path / "spool", short={spool_rid(bad)})
    try:
        with pytest.raises(RuntimeError, match="tokens, the sample has") as e:
            run_client(target, samples, tmp_path / "sg", tmp_path / "spool", server)
    finally:
        server.close()
    assert spool_rid(bad) in str(e.value) and repr(bad) in str(e.value)


FAKE_LAUNCH_SERVER = r'''
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
import torch
from capture.sglang_plugin import write_request
args = sys.argv[1:]
assert args[:2] == ["-m", "sglang.launch_server"], args
port = int(args[args.index("--port") + 1])
H = json.loads((Path(args[args.index("--model-path") + 1]) / "config.json").read_text())["hidden_size"]
spool, aux = Path(os.environ["EAGLE3_SPOOL_DIR"]), [int(i) for i in os.environ["EAGLE3_AUX_LAYERS"].split(",")]
Path(os.environ["PIDFILE"]).write_text(json.dumps({"pid": os.getpid(), "args": args}))
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _reply(self, obj):
        raw = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(raw))); self.end_headers()
        self.wfile.write(raw)
    def do_GET(self): self._reply({"version": "0.5.23"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        T = len(body["input_ids"])
        write_request(spool, body["rid"], [torch.full((T, H), float(i)) for i in range(len(aux))],
                      torch.full((T, H), -1.0), aux, None)
        self._reply({"text": ""})
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_launches_the_server_and_stops_it(target, tmp_path, monkeypatch):
    """capture.server_url empty: the client starts `<python> -m sglang.launch_server ...` with the
    plugin's environment, captures through it, and stops it on the way out."""
    import os
    import sys

    script = tmp_path / "fake_launch_server.py"
    script.write_text(FAKE_LAUNCH_SERVER)
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    py.chmod(0o755)
    monkeypatch.setenv("EAGLE3_SGLANG_PYTHON", str(py))
    monkeypatch.setenv("PIDFILE", str(tmp_path / "pid"))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    model, info = target
    samples = make_samples(5, seed=5)
    cfg = CaptureConfig(backend="sglang", spool_dir=str(tmp_path / "spool"), shard_tokens=60)
    out = capture_sglang(Path(info.path), info, SimpleNamespace(name_or_path="t", chat_template=""), samples,
                         AUX, cfg, {"source": "fake"}, tmp_path / "sg", progress=False)
    ds = FeatureDataset(out)
    H = info.hidden_size
    assert len(ds) == 5 and torch.equal(ds[2]["aux"][:, H:2 * H].float(), torch.ones(len(samples[2].input_ids), H))
    launched = json.loads((tmp_path / "pid").read_text())
    assert " --return-aux-hidden-state-layer-ids 0 2 3 " in " ".join(launched["args"]) + " "   # Llama: i - 1
    with pytest.raises(ProcessLookupError):
        os.kill(launched["pid"], 0)                            # the server is gone


def test_error_file_appears_whole(tmp_path):
    """The client reads req_<rid>/error.txt as soon as it exists, so write_error replaces it in one
    step (CI once read it empty between an appending open and its write): every message is kept,
    nothing else is left in the request directory."""
    write_error(tmp_path, "c1", "first reason")
    write_error(tmp_path, "c1", "second reason")
    d = tmp_path / "req_c1"
    lines = (d / "error.txt").read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == ["first reason", "second reason"]
    assert [p.name for p in d.iterdir()] == ["error.txt"]
