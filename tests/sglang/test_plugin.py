"""The capture plugin, driven with SGLang's own ForwardBatch / ForwardMode objects on CPU.

    .venv-sglang/bin/python -m pytest tests/sglang/test_plugin.py -q

Independent truth: every request's whole-prompt rows are drawn first ([T, H] per aux layer and
final); passes are then cut from them the way SGLang lays a batch out (request after request,
chunks at their prefix, decode rows appended as 1-token extends). What lands in the spool must
equal the truth in bf16, request by request.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.model_executor.forward_batch_info",
                    reason="SGLang is not installed; run with .venv-sglang/bin/python -m pytest tests/sglang")

import torch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from capture import sglang_plugin as P  # noqa: E402

H, K = 16, 3
ROOT = Path(__file__).resolve().parents[2]


def truth(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"aux": [torch.randn(T, H, generator=g) for _ in range(K)], "final": torch.randn(T, H, generator=g)}


def make_fb(mode, rids, prefix, extend, totals, spec_info=None, algo=SpeculativeAlgorithm.NONE):
    n = sum(extend)
    return ForwardBatch(forward_mode=mode, batch_size=len(rids), input_ids=torch.zeros(n, dtype=torch.long),
                        req_pool_indices=torch.arange(len(rids)), seq_lens=torch.tensor([p + e for p, e in zip(prefix, extend)]),
                        out_cache_loc=torch.arange(n), seq_lens_sum=sum(p + e for p, e in zip(prefix, extend)),
                        orig_seq_lens=torch.tensor(totals, dtype=torch.int32), rids=list(rids),
                        extend_prefix_lens_cpu=list(prefix), extend_seq_lens_cpu=list(extend),
                        spec_info=spec_info, spec_algorithm=algo)


def cut(parts):
    """parts: (truth, start, n) per request -> aux list k x [N, H], final [N, H] for one pass."""
    aux = [torch.cat([t["aux"][j][s:s + n] for t, s, n in parts]) for j in range(K)]
    return aux, torch.cat([t["final"][s:s + n] for t, s, n in parts])


class Served:
    """Stands in for the original LogitsProcessor.forward: records that it ran, returns a token."""
    def __init__(self):
        self.calls = 0

    def __call__(self, lp_self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                 hidden_states_before_norm=None):
        self.calls += 1
        return ("served", hidden_states.shape[0])


def forward(fb, aux, final, packed=False):
    """Call the hook as SGLang's AROUND wrapper would: hook(original, self, *args)."""
    served = Served()
    a = torch.cat(aux, dim=-1) if packed else list(aux)
    out = P.around_logits_forward(served, object(), fb.input_ids, final, None, fb, a)
    assert out == ("served", final.shape[0]) and served.calls == 1
    return out


@pytest.fixture
def cap(tmp_path, monkeypatch):
    c = P._Capture(tmp_path / "spool", aux_layers=[2, 4, 6])
    monkeypatch.setattr(P, "_ACTIVE", c)
    with get_parallel().override(attn_tp_rank=0, attn_cp_rank=0):
        yield c
    assert c.drain(30)


def spooled(cap):
    cap.drain(30)
    d = cap.spool
    return sorted(p.name for p in d.iterdir() if p.name.startswith("req_")) if d.exists() else []


def assert_written(cap, rid, t, T=None):
    assert cap.drain(30)
    d = cap.spool / f"req_{rid}"
    assert (d / "done").exists() and not (d / "error.txt").exists()
    T = t["final"].shape[0] if T is None else T
    for j in range(K):
        got = torch.load(d / f"aux_{j}.pt")
        assert got.dtype == torch.bfloat16 and got.shape == (T, H)
        assert torch.equal(got, t["aux"][j][:T].to(torch.bfloat16)), f"{rid} aux_{j}"
    assert torch.equal(torch.load(d / "final.pt"), t["final"][:T].to(torch.bfloat16))
    meta = json.loads((d / "meta.json").read_text())
    assert meta["num_tokens"] == T and meta["hidden_size"] == H and meta["aux_layers"] == [2, 4, 6]
    assert meta["rid"] == rid


@pytest.mark.parametrize("packed", [False, True], ids=["list_llama", "packed_deepseek"])
def test_several_requests_in_one_batch(cap, packed):
    ts = {"a": truth(5, 1), "b": truth(1, 2), "c": truth(7, 3)}
    aux, final = cut([(ts[r], 0, ts[r]["final"].shape[0]) for r in "abc"])
    forward(make_fb(ForwardMode.EXTEND, list("abc"), [0, 0, 0], [5, 1, 7], [5, 1, 7]), aux, final, packed)
    assert spooled(cap) == ["req_a", "req_b", "req_c"]
    for r in "abc":
        assert_written(cap, r, ts[r])


def test_prompt_chunked_over_passes(cap):
    a, b, c = truth(10, 4), truth(3, 5), truth(2, 6)
    aux, final = cut([(b, 0, 3), (a, 0, 4)])       # a's first chunk rides behind b
    forward(make_fb(ForwardMode.EXTEND, ["b", "a"], [0, 0], [3, 4], [3, 10]), aux, final)
    assert spooled(cap) == ["req_b"]
    aux, final = cut([(a, 4, 4)])
    forward(make_fb(ForwardMode.EXTEND, ["a"], [4], [4], [10]), aux, final)
    assert spooled(cap) == ["req_b"]                # not until the whole prompt is covered
    aux, final = cut([(a, 8, 2), (c, 0, 2)])
    forward(make_fb(ForwardMode.EXTEND, ["a", "c"], [8, 0], [2, 2], [10, 2]), aux, final)
    assert spooled(cap) == ["req_a", "req_b", "req_c"]
    assert_written(cap, "a", a)
    assert_written(cap, "b", b)
    assert_written(cap, "c", c)


@pytest.mark.parametrize("mode", [ForwardMode.MIXED, ForwardMode.EXTEND], ids=["mixed", "dp_decode_as_extend"])
def test_batch_with_decode_rows(cap, mode):
    a, b, c = truth(6, 7), truth(4, 8), truth(5, 9)
    aux, final = cut([(a, 0, 6), (b, 0, 4)])
    forward(make_fb(ForwardMode.EXTEND, ["a", "b"], [0, 0], [6, 4], [6, 4]), aux, final)
    # New prompt c, then a and b's decode rows as 1-token extends at prefix seq_len - 1 (mix_with_running).
    junk = truth(2, 99)
    aux, final = cut([(c, 0, 5), (junk, 0, 1), (junk, 1, 1)])
    forward(make_fb(mode, ["c", "a", "b"], [0, 6, 4], [5, 1, 1], [5, 7, 5]), aux, final)
    assert spooled(cap) == ["req_a", "req_b", "req_c"]
    assert_written(cap, "a", a)
    assert_written(cap, "b", b)
    assert_written(cap, "c", c)
    assert not (cap.spool / "errors.txt").exists()


def test_retracted_request_prefilled_twice_is_written_once(cap):
    a = truth(6, 10)
    aux, final = cut([(a, 0, 6)])
    forward(make_fb(ForwardMode.EXTEND, ["a"], [0], [6], [6]), aux, final)
    assert_written(cap, "a", a)
    stamp = (cap.spool / "req_a" / "final.pt").stat().st_mtime_ns
    again = truth(8, 11)                             # retracted: prompt + 2 output tokens, prefilled anew
    aux, final = cut([(again, 0, 8)])
    forward(make_fb(ForwardMode.EXTEND, ["a"], [0], [8], [8]), aux, final)
    assert spooled(cap) == ["req_a"]
    assert_written(cap, "a", a)
    assert (cap.spool / "req_a" / "final.pt").stat().st_mtime_ns == stamp


def test_a_resent_prompt_is_captured_under_its_new_rid(cap):
    """A client that resumes sends the prompt again under a fresh rid (capture/sglang_client.py's
    attempt_rid): the long-running server writes it again, its first entry already consumed."""
    from capture.sglang_client import attempt_rid

    a = truth(6, 21)
    first, second = attempt_rid("s1", "0000000a"), attempt_rid("s1", "0000000b")
    for rid in (first, second):
        aux, final = cut([(a, 0, 6)])
        forward(make_fb(ForwardMode.EXTEND, [rid], [0], [6], [6]), aux, final)
        assert_written(cap, rid, a)
        shutil.rmtree(cap.spool / f"req_{rid}")   # the client packs it and deletes it
    aux, final = cut([(a, 0, 6)])
    forward(make_fb(ForwardMode.EXTEND, [second], [0], [6], [6]), aux, final)   # the same rid again
    assert spooled(cap) == []


def test_prefix_from_radix_cache_is_refused(cap, caplog):
    b = truth(9, 12)
    aux, final = cut([(b, 3, 6)])
    with caplog.at_level("ERROR", logger="eagle3.capture.sglang_plugin"):
        forward(make_fb(ForwardMode.EXTEND, ["b"], [3], [6], [9]), aux, final)
        cap.drain(30)
    d = cap.spool / "req_b"
    assert not (d / "done").exists() and not (d / "final.pt").exists()
    assert "radix" in (d / "error.txt").read_text()
    assert any("radix" in r.getMessage() for r in caplog.records)


def test_padded_rows_and_lists_are_ignored(cap):
    """DP attention pads token rows (and may pad per-request lists) past the real requests."""
    a = truth(4, 13)
    aux, final = cut([(a, 0, 4), (truth(3, 14), 0, 3)])
    fb = make_fb(ForwardMode.EXTEND, ["a"], [0], [4], [4])
    fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = [4, 1, 1], [0, 0, 0]
    forward(fb, aux, final)
    assert spooled(cap) == ["req_a"]
    assert_written(cap, "a", a)


@pytest.mark.parametrize("ranks", [dict(attn_tp_rank=1, attn_cp_rank=0), dict(attn_tp_rank=0, attn_cp_rank=1)],
                         ids=["attn_tp_1", "attn_cp_1"])
def test_other_ranks_write_nothing(cap, ranks):
    a = truth(5, 15)
    aux, final = cut([(a, 0, 5)])
    with get_parallel().override(**ranks):
        forward(make_fb(ForwardMode.EXTEND, ["a"], [0], [5], [5]), aux, final)
    assert spooled(cap) == [] and not (cap.spool / "errors.txt").exists()


@pytest.mark.parametrize("case", ["target_verify", "draft_extend_v2", "draft_extend_spec_info", "eagle3_algo", "decode"])
def test_speculative_and_decode_passes_write_nothing(cap, case):
    a = truth(4, 16)
    aux, final = cut([(a, 0, 4)])
    mode = {"target_verify": ForwardMode.TARGET_VERIFY, "draft_extend_v2": ForwardMode.DRAFT_EXTEND_V2,
            "decode": ForwardMode.DECODE}.get(case, ForwardMode.EXTEND)
    fb = make_fb(mode, ["a"], [0], [4], [4], spec_info=object() if case == "draft_extend_spec_info" else None,
                 algo=SpeculativeAlgorithm.EAGLE3 if case == "eagle3_algo" else SpeculativeAlgorithm.NONE)
    forward(fb, aux, final)
    assert spooled(cap) == []


def test_missing_rids_is_reported_and_serving_continues(cap):
    """A prefill CUDA graph rebuilds the batch without rids: logged, errors.txt, still served."""
    a = truth(4, 17)
    aux, final = cut([(a, 0, 4)])
    fb = make_fb(ForwardMode.EXTEND, ["a"], [0], [4], [4])
    fb.rids = None
    forward(fb, aux, final)
    assert spooled(cap) == []
    assert "--disable-prefill-cuda-graph" in (cap.spool / "errors.txt").read_text()


def test_wrong_aux_count_is_reported_not_raised(cap):
    a = truth(4, 18)
    aux, final = cut([(a, 0, 4)])
    forward(make_fb(ForwardMode.EXTEND, ["a"], [0], [4], [4]), aux[:2], final)
    assert spooled(cap) == [] and "aux states" in (cap.spool / "errors.txt").read_text()


def test_assemble_directly():
    """The plain assembler without SGLang objects: chunk gaps are refused, rows beyond total too."""
    from capture import sglang_assembly as A

    st = A.AssemblyState()
    t = truth(6, 19)

    def piece(rid, s, n, total=6):
        return A.Piece(rid, s, total, [x[s:s + n] for x in t["aux"]], t["final"][s:s + n])

    assert A.assemble(st, piece("x", 0, 2)).kind == "pending"
    assert A.assemble(st, piece("x", 3, 3)).kind == "error"          # gap: rows 2..3 missing
    assert A.assemble(st, piece("x", 4, 2)).kind == "ignored"        # refused rid stays refused
    assert A.assemble(st, piece("y", 0, 2)).kind == "pending"
    done = A.assemble(st, piece("y", 2, 4))
    assert done.kind == "complete" and torch.equal(done.final, t["final"])
    assert A.assemble(st, piece("z", 0, 6, total=5)).kind == "error"


def test_writer_writes_done_last(tmp_path, monkeypatch):
    t = truth(3, 20)
    seen = []
    real = os.replace

    def spy(src, dst):
        dst = Path(dst)
        if dst.name == "done":   # everything else must be in place, complete, before `done` appears
            d = dst.parent
            seen.append(sorted(p.name for p in d.iterdir()))
            assert torch.equal(torch.load(d / "final.pt"), t["final"].to(torch.bfloat16))
        else:
            seen.append(dst.name)
        real(src, dst)

    monkeypatch.setattr(P.os, "replace", spy)
    out = P.write_request(tmp_path, "r1", t["aux"], t["final"], [2, 4, 6], [1, 3, 5])
    assert seen[0] == "req_r1"
    assert seen[1] == [".done.tmp", "aux_0.pt", "aux_1.pt", "aux_2.pt", "final.pt", "meta.json"]
    assert sorted(p.name for p in out.iterdir()) == ["aux_0.pt", "aux_1.pt", "aux_2.pt", "done", "final.pt", "meta.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["req_r1"]       # no temporary left behind


_LOADER = textwrap.dedent("""
    import json, os, sys, torch
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.plugins import load_plugins, load_plugins_by_group
    keep = {"original": LogitsProcessor.forward}   # not a module global: apply_hooks rebinds those
    found = load_plugins_by_group("sglang.srt.plugins")
    load_plugins()
    import capture.sglang_plugin as P
    wrapped = LogitsProcessor.forward
    res = {"found": "eagle3_capture" in found and found["eagle3_capture"][0] is P.register,
           "wrapped": wrapped is not keep["original"],
           "inner": getattr(wrapped, "__wrapped__", None) is keep["original"],
           "hook": any(c.cell_contents is P.around_logits_forward for c in (wrapped.__closure__ or ())),
           "active": P.active() is not None}
    if res["wrapped"]:
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from sglang.srt.runtime_context import get_parallel
        final = torch.randn(3, 8)
        aux = [torch.randn(3, 8) for _ in range(3)]
        fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.zeros(3, dtype=torch.long),
                          req_pool_indices=torch.zeros(1), seq_lens=torch.tensor([3]), out_cache_loc=torch.arange(3),
                          seq_lens_sum=3, orig_seq_lens=torch.tensor([3], dtype=torch.int32), rids=["q1"],
                          extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[3])
        with get_parallel().override(attn_tp_rank=0, attn_cp_rank=0):
            try:   # the real method: our hook runs first, then SGLang's own forward fails on a fake self
                LogitsProcessor.forward(object(), fb.input_ids, final, None, fb, aux)
            except Exception as e:
                res["original_raised"] = type(e).__name__
        P.active().drain(30)
        d = os.path.join(os.environ["EAGLE3_SPOOL_DIR"], "req_q1")
        res["written"] = sorted(os.listdir(d))
        res["equal"] = torch.equal(torch.load(os.path.join(d, "final.pt")), final.to(torch.bfloat16))
    print("RESULT " + json.dumps(res))
""")


def _run_loader(env_extra, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (P.SPOOL_ENV, P.AUX_LAYERS_ENV, "SGLANG_PLUGINS")}
    env.update(env_extra, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _LOADER], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert eps["eagle3_capture"].value == "capture.sglang_plugin:register"
    assert eps["eagle3_capture"].load() is P.register


def test_sglang_loader_wraps_logits_forward_and_hook_writes(tmp_path):
    res = _run_loader({P.SPOOL_ENV: str(tmp_path / "spool"), P.AUX_LAYERS_ENV: "2,4,6"}, tmp_path)
    assert res["found"] and res["wrapped"] and res["inner"] and res["hook"] and res["active"]
    assert res["original_raised"]                     # SGLang's own forward still ran after the hook
    assert res["written"] == ["aux_0.pt", "aux_1.pt", "aux_2.pt", "done", "final.pt", "meta.json"]
    assert res["equal"]


def test_inert_without_spool_env(tmp_path):
    res = _run_loader({}, tmp_path)
    assert res["found"]                               # discovered and executed...
    assert not res["wrapped"] and not res["active"]   # ...but it registered nothing


def test_version_check_warns_only_off_version(monkeypatch, caplog):
    import sglang.version

    with caplog.at_level("WARNING", logger="eagle3.capture.sglang_plugin"):
        assert P.check_sglang_version() == "0.5.23"
        assert not caplog.records
        monkeypatch.setattr(sglang.version, "__version__", "0.5.99")
        assert P.check_sglang_version() == "0.5.99"
    assert any("0.5.99" in r.getMessage() and "0.5.23" in r.getMessage() for r in caplog.records)
