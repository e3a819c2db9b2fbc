"""Evaluation plumbing: prompt sets, the drafter/target fit check, engine counters -> tau,
report files, and `python evaluate.py` end to end on a tiny random target with the hf backend."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3 import chat, evaluation as ev
from eagle3.export import drafter_config, export_drafter, export_state_dict
from eagle3.model import Eagle3Drafter
from eagle3.shape import DrafterShape

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# prompt sets

def test_mt_bench_first_and_both_turns():
    raw = [json.loads(l) for l in ev.mt_bench_file().read_text().splitlines() if l.strip()]
    one = ev.load_prompts("mt_bench", 5)
    two = ev.load_prompts("mt_bench_2turn", 0)
    assert [p.id for p in one] == [str(r["question_id"]) for r in raw[:5]]
    assert one[0].messages == [{"role": "user", "content": raw[0]["turns"][0]}] and one[0].followups == []
    assert len(two) == 80 and two[3].followups == raw[3]["turns"][1:]
    assert [p.category for p in two] == [r["category"] for r in raw]
    cats = [p.category for p in ev.load_prompts("mt_bench", 0)]
    assert {c: cats.count(c) for c in cats} == {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding",
                                                                "extraction", "stem", "humanities")}


def test_all_prompts_is_the_default():
    from eagle3.config import EvalConfig
    assert EvalConfig().num_prompts == 0 and EvalConfig().chains == []


def test_jsonl_prompt_shapes(tmp_path):
    conv = tmp_path / "c.jsonl"
    conv.write_text(json.dumps({"id": "a", "conversations": [{"from": "system", "value": "S"},
                                                             {"from": "human", "value": "hi"},
                                                             {"from": "gpt", "value": "yo"}]}) + "\n"
                    + json.dumps({"id": "b", "messages": [{"role": "user", "content": "q"}]}) + "\n")
    ps = ev.load_prompts(str(conv), 0)
    assert [p.id for p in ps] == ["a", "b"]
    assert ps[0].messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    mt = tmp_path / "mt.jsonl"
    mt.write_text(json.dumps({"question_id": 7, "turns": ["x", "y"]}) + "\n")
    assert ev.load_prompts(str(mt), 0)[0].followups == ["y"]
    assert ev.prompt_set_name(str(mt)) == "mt"
    with pytest.raises(FileNotFoundError, match="mt_bench"):
        ev.load_prompts(str(tmp_path / "missing.jsonl"), 1)


def test_sharegpt_heldout_takes_only_heldout_ids(tmp_path):
    import hashlib
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"u{i}"}]}) + "\n"
                            for i in range(200)))
    ps = ev._conversations("jsonl", str(path), 0, 0.1)
    held = [f"c{i}" for i in range(200)
            if int.from_bytes(hashlib.blake2b(f"c{i}".encode(), digest_size=8).digest(), "big") / 2 ** 64 < 0.1]
    assert [p.id for p in ps] == held and 5 < len(held) < 40
    # the file named twice in data.mix, greedy and sampled: each held-out conversation once
    from eagle3.config import MixEntry
    twice = ev._conversations("sharegpt", "", 0, 0.1, [MixEntry("jsonl", str(path), 1.0, 0.0),
                                                        MixEntry("jsonl", str(path), 1.0, 0.7)])
    assert [p.id for p in twice] == [f"s:{c}" for c in held]


def test_two_turn_decode_follows_the_models_own_answer(monkeypatch):
    """The answer is cut at the end of turn before it is decoded; the engine's ids are kept whole.
    (tests/test_followup_turns.py renders real templates, thinking ones too.)"""
    from evaluate import decode_prompts
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: f"ans{len(ids)}")
    seen = []
    monkeypatch.setattr(chat, "render_prompt", lambda t, messages: seen.append([dict(m) for m in messages]) or [1, 2, 3])
    monkeypatch.setattr(chat, "assistant_turn", lambda t, answer: {"role": "assistant", "content": answer})
    st = decode_prompts([ev.Prompt("p", [{"role": "user", "content": "q1"}], ["q2"])], tok,
                        lambda ids: ([5] * (4 + len(seen)) + [9], 0.5, {"drafts": 2, "accepted": 1, "per_pos": [1, 0]}),
                        "test", [9])
    assert seen[1] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "ans5"},
                       {"role": "user", "content": "q2"}]
    assert st[0].output_ids == [[5] * 5 + [9], [5] * 6 + [9]] and st[0].num_drafts == 4
    assert st[0].accepted_per_pos == [2, 0]


def test_a_stopped_decode_goes_on_from_its_journal(tmp_path, monkeypatch):
    """decoded.jsonl: a run stopped at the third prompt keeps the first two; the rerun decodes only
    the rest and ends with what one uninterrupted run gives. Another drafter, or a prompt whose
    text changed, is decoded again; a half-written last line is skipped."""
    from eagle3.eval_journal import Journal
    from evaluate import decode_prompts
    monkeypatch.setattr(chat, "render_prompt", lambda t, messages: [len(messages[-1]["content"])])
    prompts = [ev.Prompt(str(i), [{"role": "user", "content": "q" * (i + 1)}], category="math") for i in range(5)]
    calls = []

    def gen(ids, stop_at=None):
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        calls.append(ids[0])
        return [7] * ids[0] + [9], 0.1 * ids[0], {"drafts": ids[0], "accepted": ids[0] - 1, "per_pos": [ids[0] - 1]}

    cfg = {"drafter": ["a", "0" * 64], "chain": 3}
    whole = decode_prompts(prompts, None, gen, "t", [9], Journal(tmp_path / "whole"), cfg)
    assert calls == [1, 2, 3, 4, 5]
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        decode_prompts(prompts, None, lambda ids: gen(ids, stop_at=2), "t", [9], Journal(tmp_path / "cut"), cfg)
    assert len((tmp_path / "cut" / "decoded.jsonl").read_text().splitlines()) == 2
    calls.clear()
    journal = Journal(tmp_path / "cut")
    again = decode_prompts(prompts, None, gen, "t", [9], journal, cfg)
    assert calls == [3, 4, 5] and journal.reused == 2 and again == whole
    calls.clear()
    decode_prompts(prompts, None, gen, "t", [9], Journal(tmp_path / "cut"), dict(cfg, drafter=["a", "1" * 64]))
    assert calls == [1, 2, 3, 4, 5]
    calls.clear()
    with open(tmp_path / "cut" / "decoded.jsonl", "a") as f:
        f.write('{"key": "half a li')
    changed = prompts[:4] + [ev.Prompt("4", [{"role": "user", "content": "q" * 8}], category="math")]
    journal = Journal(tmp_path / "cut")
    decode_prompts(changed, None, gen, "t", [9], journal, cfg)
    assert calls == [8] and journal.reused == 4
    journal = Journal(tmp_path / "cut")
    decode_prompts(changed, None, gen, "t", [9], journal, cfg)
    assert journal.reused == 5


# ---------------------------------------------------------------------------------------------
# check_drafter_fits

V, HT, L = 300, 48, 8
TARGET = SimpleNamespace(name="t", vocab_size=V, hidden_size=HT, num_layers=L, model_type="llama",
                         architectures=["LlamaForCausalLM"])


def _export(vd=100, hidden=HT, target_hidden=HT, k=3, aux=(2, 4, 5), engine="vllm", vocab=V):
    torch.manual_seed(0)
    shape = DrafterShape(hidden_size=hidden, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=12, vocab_size=vocab, draft_vocab_size=vd, target_hidden_size=target_hidden,
                         num_aux=k)
    m = Eagle3Drafter(shape)
    d2t = torch.arange(vd) * 2 - torch.arange(vd)         # draft j -> target 2j
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(vd) * 2] = True
    cfg = drafter_config(shape, list(aux), engine, ["LlamaForCausalLM"])
    return export_state_dict(m.exportable_state_dict(), d2t, t2d), cfg


def test_check_drafter_fits_accepts_a_good_drafter():
    tensors, cfg = _export()
    assert ev.check_drafter_fits(cfg, TARGET, tensors, "vllm") == [2, 4, 5]
    tensors, cfg = _export(engine="sglang")
    assert ev.check_drafter_fits(cfg, TARGET, tensors, "sglang") == [2, 4, 5]


@pytest.mark.parametrize("change,needle", [
    ("vocab", "t2d has 200 entries, target vocab is 300"),
    ("d2t_range", "outside the target vocab"),
    ("d2t_t2d", "d2t and t2d disagree"),
    ("target_hidden", "target_hidden_size 32 != target hidden size 48"),
    ("hidden", "hidden_size 64 != target hidden size 48"),
    ("aux_count", "fc.weight takes 96 inputs but 3 aux layers"),
    ("aux_range", "out of range for a 8-layer target"),
    ("engine", "not the vllm ids"),
])
def test_check_drafter_fits_names_the_mismatch(change, needle):
    tensors, cfg = _export()
    if change == "vocab":
        tensors, cfg = _export(vocab=200)
        cfg["vocab_size"] = V                         # config claims the right vocab; the map does not
    elif change == "d2t_range":
        tensors["d2t"] = tensors["d2t"] + 250
    elif change == "d2t_t2d":
        tensors["t2d"] = torch.roll(tensors["t2d"], 1)
    elif change == "target_hidden":
        tensors, cfg = _export(target_hidden=32)
    elif change == "hidden":
        tensors, cfg = _export(hidden=64)
    elif change == "aux_count":
        tensors, cfg = _export(k=2, aux=(2, 4))
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
        cfg["eagle3"]["aux_layers"] = [2, 4, 5]
    elif change == "aux_range":
        tensors, cfg = _export(aux=(2, 4, 9))
    elif change == "engine":
        tensors, cfg = _export(engine="sglang")       # ids shifted for SGLang, given to vLLM
    with pytest.raises(ev.DrafterMismatch, match="does not fit") as e:
        ev.check_drafter_fits(cfg, TARGET, tensors, "vllm")
    assert needle in str(e.value)


# ---------------------------------------------------------------------------------------------
# engine counters

def test_vllm_counters_from_metric_objects():
    from vllm.v1.metrics.reader import Counter, Gauge, Vector
    def snap(d, t, a, pp):
        return [Gauge(name="vllm:num_requests_running", labels={}, value=0.0),
                Counter(name="vllm:spec_decode_num_drafts", labels={"engine": "0"}, value=d),
                Counter(name="vllm:spec_decode_num_draft_tokens", labels={"engine": "0"}, value=t),
                Counter(name="vllm:spec_decode_num_accepted_tokens", labels={"engine": "0"}, value=a),
                Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={"engine": "0"}, values=pp)]
    before, after = ev.vllm_counters(snap(4, 12, 5, [3, 2, 0])), ev.vllm_counters(snap(10, 30, 14, [7, 5, 2]))
    assert ev.vllm_delta(before, after) == {"drafts": 6, "draft_tokens": 18, "accepted": 9, "per_pos": [4, 3, 2]}
    assert ev.vllm_counters([]) == {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}


def sglang_response(output_ids, hist, num_draft_tokens=4, finish=None):
    """A /generate response exactly as SGLang 0.5.23's TokenizerManager builds it for a finished,
    non-streaming request with speculative decoding (tokenizer_manager.py: meta_info dict at
    `_handle_batch_output`, `_calculate_spec_decoding_metrics`, out_dict {text, output_ids, meta_info})."""
    verify = sum(hist)
    correct = sum(m * n for m, n in enumerate(hist))
    completion = len(output_ids)
    meta = {"id": "9f1c", "finish_reason": finish or {"type": "length", "length": completion},
            "prompt_tokens": 31, "weight_version": "default", "num_retractions": 0,
            "reasoning_tokens": 0, "completion_tokens": completion, "cached_tokens": 0,
            "e2e_latency": 0.41}
    if verify:
        proposed = verify * (num_draft_tokens - 1)
        meta.update({"spec_accept_rate": correct / proposed, "spec_accept_length": completion / verify,
                     "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
                     "spec_verify_ct": verify, "spec_correct_drafts_histogram": list(hist)})
    return {"text": "..." * completion, "output_ids": list(output_ids), "meta_info": meta}


def test_sglang_response_parsing_and_tau():
    # 5 verify steps accepting 3, 0, 2, 1, 3 drafts: 1 (prefill) + 4 + 1 + 3 + 2 + 4 = 15 tokens
    hist = [1, 1, 1, 2]
    r = sglang_response(list(range(100, 115)), hist)
    c = ev.sglang_counters(r, 3)
    assert c["drafts"] == 5 and c["accepted"] == 9 and c["per_pos"] == [4, 3, 2]
    assert c["output_ids"] == list(range(100, 115)) and c["completion_tokens"] == 15
    assert c["completion_tokens"] / c["drafts"] == pytest.approx(r["meta_info"]["spec_accept_length"])
    # a baseline server (no speculative algorithm) has no spec fields
    b = ev.sglang_counters(sglang_response([1, 2, 2], []), 3)
    assert b["drafts"] == 0 and b["per_pos"] == [0, 0, 0]
    st = ev.DecodeStats("p", [c["output_ids"]], 1.0, num_drafts=5, num_accepted=9, accepted_per_pos=[4, 3, 2],
                        engine_tokens=15)
    row = ev.summarize([st], [ev.DecodeStats("p", [c["output_ids"]], 2.0)], "sglang")
    assert row["tau"] == pytest.approx(3.0) and row["accept_per_position"] == pytest.approx([0.8, 0.6, 0.4])
    assert row["speedup"] == pytest.approx(2.0) and row["mismatches"] == []
    with pytest.raises(RuntimeError, match="aborted"):
        ev.sglang_counters(sglang_response([1], [], finish={"type": "abort", "message": "oom"}), 3)


def test_summarize_vllm_rule_and_mismatch_report():
    spec = [ev.DecodeStats("a", [[1, 2, 3]], 1.0, 2, 6, 3, [2, 1, 0]),
            ev.DecodeStats("b", [[4, 5], [6, 7, 8]], 1.0, 4, 12, 1, [1, 0, 0])]
    base = [ev.DecodeStats("a", [[1, 2, 3]], 4.0), ev.DecodeStats("b", [[4, 5], [6, 9, 8]], 4.0)]
    row = ev.summarize(spec, base, "vllm")
    assert row["tau"] == pytest.approx(1 + 4 / 6) and row["accept_per_position"] == pytest.approx([0.5, 1 / 6, 0])
    assert row["tok_s"] == pytest.approx(4.0) and row["baseline_tok_s"] == pytest.approx(1.0)
    assert row["mismatches"] == [{"prompt_id": "b", "turn": 1, "first_diff": 1, "spec_len": 3, "baseline_len": 3}]


def test_draftable_counts_the_output_tokens_inside_the_draft_vocab():
    spec = [ev.DecodeStats("a", [[5, 1, 2, 3], [7, 9]], 1.0), ev.DecodeStats("b", [[4, 6]], 1.0)]
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 2, 9]] = True
    # each turn's first token is the prefill's: 1 2 3 | 9 | 6 are the draftable candidates, 1 2 9 inside
    assert ev.draftable(spec, t2d) == pytest.approx(3 / 5)
    assert ev.draftable(spec, None) == 1.0
    assert ev.draftable([ev.DecodeStats("c", [[8]], 1.0)], t2d) == 0.0


def test_report_files(tmp_path):
    rows = []
    for d, tau in (("trained", 2.1), ("untrained", 1.0)):
        for p in ("mt_bench", "sharegpt_heldout"):
            rows.append({"drafter": d, "drafter_path": "/x", "prompts": p, "tau": tau, "tau_rule": "vllm",
                         "accept_per_position": [0.6, 0.3, 0.2] if tau > 1 else [0.0, 0.0, 0.0],
                         "num_drafts": 10, "num_accepted": 11, "tok_s": 20.0, "baseline_tok_s": 14.0,
                         "speedup": 20 / 14, "mismatches": [], "tau_ci95": [tau - 0.1, tau + 0.05],
                         "per_category": {"writing": {"tau": tau, "tau_ci95": [tau - 0.2, tau + 0.1], "num_prompts": 3}}
                         if p == "mt_bench" else {}})
    settings = {"backend": "vllm", "target": "smollm2", "num_steps": 3, "topk": 1, "num_draft_tokens": 4,
                "max_new_tokens": 64, "num_prompts": 5}
    comparisons = [{"prompts": "mt_bench", "num_steps": 3, "reference": "trained", "drafter": "untrained",
                    "reference_tau": 2.1, "tau": 1.0, "num_prompts": 3, "num_paired": 3, "wins": 0, "losses": 3,
                    "ties": 0, "sign_test_p": 0.25, "mean_diff": -1.1, "mean_diff_ci95": [-1.3, -0.9], "tau_ratio": 1 / 2.1,
                    "tau_ratio_ci95": [0.4, 0.55], "per_prompt_diff": [-1.3, -1.1, -0.9], "prompt_ids": ["1", "2", "3"]}]
    paths = ev.write_report(tmp_path, rows, settings, {"vllm": "0.32.0"}, production_baseline_tok_s=90,
                            comparisons=comparisons)
    rep = json.loads(paths["json"].read_text())
    assert rep["results"][0]["tau"] == 2.1 and rep["production_baseline_tok_s"] == 90
    assert rep["results"][0]["num_steps"] == 3 and rep["comparisons"] == comparisons
    md = paths["md"].read_text()
    assert "| trained | mt_bench | 2.10 [2.00, 2.15] | 0.600 / 0.300 / 0.200 |" in md and "| 90 |" in md
    assert "## Chain of 3 draft tokens" in md and "| trained | mt_bench | 2.10 [1.90, 2.20] (n=3) |" in md
    assert "| untrained | trained | mt_bench | 1.00 vs 2.10 | 0 / 3 / 0 | 0.25 | -1.100 [-1.300, -0.900] |" in md
    for k in ("tau_png", "accept_png", "categories_png", "paired_png"):
        assert paths[k].read_bytes()[:4] == b"\x89PNG" and paths[k].stat().st_size > 10_000
        assert f"({paths[k].name})" in md


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""


def test_host_cpu_names_the_widest_instruction_set():
    assert ev.host_cpu(CPUINFO) == {"model": "Intel(R) Xeon(R) Platinum 8480+", "isa": "AMX"}
    no_amx = CPUINFO.replace(" amx_bf16 amx_tile", "").replace("Platinum 8480+", "Gold 6338")
    assert ev.host_cpu(no_amx) == {"model": "Intel(R) Xeon(R) Gold 6338", "isa": "AVX512-BF16"}
    assert ev.cpu_isa("fpu avx2 avx512f".split()) == "AVX512"
    assert ev.cpu_isa("fpu sse2 avx2".split()) == "AVX2"


def test_host_cpu_agrees_with_torch_on_amx():
    """torch's own probe (cpuid, not /proc/cpuinfo) is the independent check of this host."""
    assert (ev.host_cpu()["isa"] == "AMX") == torch.cpu._is_amx_tile_supported()


def test_report_names_the_host_cpu(tmp_path):
    row = {"drafter": "d", "drafter_path": "/x", "prompts": "mt_bench", "tau": 2.0, "tau_rule": "vllm",
           "accept_per_position": [0.5, 0.3, 0.2], "num_drafts": 10, "num_accepted": 10, "tok_s": 20.0,
           "baseline_tok_s": 14.0, "speedup": 20 / 14, "mismatches": [], "tau_ci95": [1.9, 2.1], "per_category": {},
           "num_steps": 3, "draftable": 0.875}
    settings = {"backend": "vllm", "target": "smollm2", "num_steps": 3, "topk": 1, "max_new_tokens": 64}
    host = ev.host_cpu(CPUINFO)
    paths = ev.write_report(tmp_path, [row], settings, {"vllm": "0.32.0", "host_cpu": host})
    assert json.loads(paths["json"].read_text())["versions"]["host_cpu"] == host
    assert "Decoded on the host CPU: Intel(R) Xeon(R) Platinum 8480+ (AMX)." in paths["md"].read_text()
    assert "| d | mt_bench | 2.00 [1.90, 2.10] | 0.500 / 0.300 / 0.200 | 87.5% | 10 |" in paths["md"].read_text()
    assert "host CPU" not in ev.markdown_report([row], settings)


# ---------------------------------------------------------------------------------------------
# end to end: python evaluate.py on a tiny random target, hf backend

def _tiny_export(tmp_path):
    """A random drafter for the tiny target, exported to tmp_path/run_a/export -> its aux ids."""
    from eagle3.targets import resolve_target, target_info
    from omegaconf import OmegaConf
    tcfg = OmegaConf.load(ROOT / "conf/target/tiny_llama.yaml")
    tdir = resolve_target("random", "", tcfg.name, "llama", OmegaConf.to_container(tcfg.random_config), 0)
    info = target_info(tdir)
    torch.manual_seed(0)
    shape = DrafterShape(hidden_size=info.hidden_size, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=info.vocab_size, draft_vocab_size=512,
                         target_hidden_size=info.hidden_size, num_aux=3)
    m = Eagle3Drafter(shape)
    d2t = torch.zeros(512, dtype=torch.long)
    t2d = torch.zeros(info.vocab_size, dtype=torch.bool)
    t2d[:512] = True
    aux = [2, 3, info.num_layers - 3]
    export_drafter(tmp_path / "run_a" / "export", m.exportable_state_dict(), shape, d2t, t2d, aux, ["LlamaForCausalLM"])
    return aux


def test_evaluate_hf_end_to_end(tmp_path):
    import subprocess
    import sys

    aux = _tiny_export(tmp_path)
    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "evaluate.py", "+experiment=tiny", f"run_dir={tmp_path}/r",
                        f"eval.drafters=[{tmp_path}/run_a,{tmp_path}/run_a/export/vllm]",
                        "eval.prompts=[mt_bench,mt_bench_2turn]", "eval.num_prompts=2", "eval.chains=[3,1]",
                        f"eval.reference={tmp_path}/run_a/export/vllm",     # the second drafter, by its path
                        "eval.max_new_tokens=12", f"eval.out_dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert [(x["num_steps"], x["drafter"], x["prompts"]) for x in rep["results"]] == [
        (k, d, p) for k in (3, 1) for d in ("run_a", "run_a'") for p in ("mt_bench", "mt_bench_2turn")]
    for x in rep["results"]:
        assert x["mismatches"] == [] and x["num_drafts"] > 0 and 1.0 <= x["tau"] <= x["num_steps"] + 1
        assert x["aux_layers"] == aux and x["baseline_tok_s"] > 0 and len(x["accept_per_position"]) == x["num_steps"]
        lo, hi = x["tau_ci95"]
        assert lo <= x["tau"] <= hi and x["per_category"]["writing"]["num_prompts"] == 2
    assert rep["settings"]["chains"] == [3, 1] and rep["settings"]["reference"] == "run_a'"
    # the same drafter reached two ways decodes identically: every prompt a tie, a zero difference
    assert rep["results"][0]["num_accepted"] == rep["results"][2]["num_accepted"]
    assert [(c["num_steps"], c["prompts"], c["reference"], c["drafter"]) for c in rep["comparisons"]] == [
        (k, p, "run_a'", "run_a") for k in (3, 1) for p in ("mt_bench", "mt_bench_2turn")]
    for c in rep["comparisons"]:
        assert (c["ties"], c["mean_diff_ci95"], c["tau_ratio"]) == (2, [0.0, 0.0], 1.0)
    lines = [json.loads(l) for l in (out / "per_prompt.jsonl").read_text().splitlines()]
    two = [l for l in lines if l["prompts"] == "mt_bench_2turn"]
    assert two and all(len(l["output_ids"]) == 2 for l in two)
    assert {(l["prompt_id"], l["category"]) for l in lines} == {("81", "writing"), ("82", "writing")}
    assert sorted({(l["drafter"], l["num_steps"]) for l in lines}) == [
        ("baseline", 0), ("run_a", 1), ("run_a", 3), ("run_a'", 1), ("run_a'", 3)]
    md = (out / "report.md").read_text()
    assert md.index("## Chain of 3 draft tokens") < md.index("## Chain of 1 draft tokens")
    assert md.count("tau per MT-Bench category") == 2 and md.count("Paired against the reference") == 2
    for png in ("tau.png", "acceptance.png", "categories.png", "paired.png"):
        assert (out / png).exists() and f"({png})" in md
    # the same command again decodes nothing: every prompt of every configuration is in decoded.jsonl
    r = subprocess.run(r.args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[eval] 20 prompt decodes taken from {out / 'decoded.jsonl'}" in r.stderr
    assert json.loads((out / "report.json").read_text())["results"] == rep["results"]


def test_evaluate_without_baseline_decodes_only_the_drafters(tmp_path):
    """eval.baseline=false: no drafter-less decode (tau needs none); tau and the paired comparison stay."""
    import subprocess
    import sys

    _tiny_export(tmp_path)
    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "evaluate.py", "+experiment=tiny", f"run_dir={tmp_path}/r",
                        f"eval.drafters=[{tmp_path}/run_a,{tmp_path}/run_a/export/vllm]", "eval.baseline=false",
                        "eval.prompts=[mt_bench]", "eval.num_prompts=2", "eval.max_new_tokens=12", f"eval.out_dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(l) for l in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert sorted({l["drafter"] for l in lines}) == ["run_a", "run_a'"] and len(lines) == 4
    rep = json.loads((out / "report.json").read_text())
    assert [x["drafter"] for x in rep["results"]] == ["run_a", "run_a'"]
    assert rep["results"][0]["tau"] == rep["results"][1]["tau"] and 1.0 <= rep["results"][0]["tau"] <= 4.0
    assert [c["ties"] for c in rep["comparisons"]] == [2]


def test_evaluate_refuses_a_misfit_before_starting(tmp_path):
    import subprocess
    import sys
    tensors, cfg = _export()          # vocab 300, hidden 48: not the tiny target
    d = tmp_path / "bad"
    d.mkdir()
    from safetensors.torch import save_file
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "evaluate.py", "+experiment=tiny", f"run_dir={tmp_path}/r",
                        f"eval.drafters=[{d}]", f"eval.out_dir={tmp_path}/e"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "does not fit target" in r.stderr and "target_hidden_size 48" in r.stderr
    assert not (tmp_path / "e" / "report.json").exists()
