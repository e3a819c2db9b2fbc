"""Replay (eagle3/replay.py) against the engine it stands for: spec_decode's own counters and output.

The target is the tiny random Llama (conf/target/tiny_llama.yaml); the drafter is trained a few
steps on the target's greedy answers to the test's prompts, so chains are accepted at every
length, some to their end. Everything in fp32 on the CPU.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from eagle3 import replay as rp
from eagle3.hidden import capture_batch, pad_right
from eagle3.loss import ttt_loss
from eagle3.model import Eagle3Drafter
from eagle3.shape import DrafterShape
from eagle3.specdec import Eagle3ChainDrafter, greedy_decode, spec_decode
from eagle3.targets import load_target_model, resolve_target
from eagle3.vocab import DraftVocab

ROOT = Path(__file__).resolve().parents[1]
AUX, VD, CHAINS, MAX_NEW = [2, 3, 4], 512, [1, 3, 7], 20


def tiny_target():
    tcfg = OmegaConf.load(ROOT / "conf/target/tiny_llama.yaml")
    tdir = resolve_target("random", "", tcfg.name, "llama", OmegaConf.to_container(tcfg.random_config), 0)
    return tdir, load_target_model(tdir, torch.float32, "cpu")


def random_prompts(n, vocab_size, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def trained_drafter(model, prompts, steps=40):
    """A drafter trained `steps` steps of ttt_loss on the target's 40-token greedy answers to the
    prompts, its draft vocab the tokens those sequences hold (then the lowest other ids)."""
    V, H = model.config.vocab_size, model.config.hidden_size
    seqs = [p + greedy_decode(model, p, 40, [])[0] for p in prompts]
    seen = sorted({t for s in seqs for t in s})
    draft_ids = torch.tensor((seen + [i for i in range(V) if i not in set(seen)])[:VD]).sort().values
    d2t = draft_ids - torch.arange(VD)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    torch.manual_seed(0)
    shape = DrafterShape(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, num_aux=3)
    drafter = Eagle3Drafter(shape)
    drafter.set_target_embedding(model.get_input_embeddings().weight)
    ids, att = pad_right(seqs, "cpu")
    answer = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        answer[b, len(p):len(seqs[b])] = 1
    bt = capture_batch(model, ids, att, answer, AUX, [str(i) for i in range(len(prompts))])
    opt = torch.optim.AdamW([p for n, p in drafter.named_parameters() if not n.startswith("embed")], lr=1e-2)
    for _ in range(steps):
        o = ttt_loss(drafter, bt.input_ids, bt.loss_mask, bt.attention_mask, bt.aux, bt.final,
                     model.lm_head.weight.detach(), DraftVocab(d2t, t2d), ttt_steps=max(CHAINS))
        opt.zero_grad()
        o.loss.backward()
        opt.step()
    return drafter.eval(), d2t, t2d


@pytest.fixture(scope="module")
def setup():
    from eagle3 import chat, evaluation as ev
    from eagle3.targets import load_tokenizer
    tdir, model = tiny_target()
    prompts = random_prompts(24, model.config.vocab_size)
    tok = load_tokenizer(tdir)
    mt_bench = [chat.render_prompt(tok, p.messages) for p in ev.load_prompts("mt_bench", 2)]
    drafter, d2t, t2d = trained_drafter(model, prompts + mt_bench)   # the evaluate test's first turns too
    return model, Eagle3ChainDrafter(drafter, d2t), t2d, prompts[:6]


def test_replay_equals_spec_decode_counts_and_output(setup):
    model, chain, _, prompts = setup
    stop = [greedy_decode(model, prompts[0], MAX_NEW, [])[0][8]]      # ends prompt 0's answer early
    got = rp.replay(model, chain, AUX, prompts, CHAINS, MAX_NEW, stop)
    ends, accepted = set(), {k: 0 for k in CHAINS}
    for p, (out, counts) in zip(prompts, got):
        for k in CHAINS:
            want_out, want, _ = spec_decode(model, chain, p, AUX, k, MAX_NEW, stop)
            assert out == want_out
            assert (counts[k].accepted_per_pos, counts[k].num_drafts) == (want.accepted_per_pos, want.num_drafts)
            assert counts[k] == want
            accepted[k] += want.num_accepted
        ends.add("stop" if out[-1] in stop else "budget" if len(out) == MAX_NEW else "?")
    assert ends == {"stop", "budget"}
    # chains are accepted at every length, and the longest some way in
    assert all(accepted.values()) and any(c[7].accepted_per_pos[2] for _, c in got)


def test_an_off_by_one_walk_is_caught(setup, monkeypatch):
    """The equality above fails when the walk reads the chain one row late."""
    model, chain, _, prompts = setup
    right = rp.walk
    monkeypatch.setattr(rp, "walk", lambda accept, L, n, k: right(accept[1:], L, n, k))
    got = rp.replay(model, chain, AUX, prompts, [3], MAX_NEW, [])
    want = [spec_decode(model, chain, p, AUX, 3, MAX_NEW, [])[1] for p in prompts]
    assert [c[3] for _, c in got] != want


def test_walk_counts_the_last_verify_past_the_budget():
    """Hand-made accept lengths: rows 4.. of a 5-token prompt; 1 + (2+1) + (3+1) = 8 >= 7 tokens, the
    last verify's 3 accepted drafts count though the output stops inside them."""
    accept = [0] * 4 + [2, 9, 9, 3, 9, 9, 9, 9, 9]
    c = rp.walk(accept, 5, 7, 3)
    assert (c.num_drafts, c.num_accepted, c.accepted_per_pos) == (2, 5, [2, 2, 1])


def test_greedy_cache_returns_the_decoded_run_and_decodes_again_only_for_more(setup, tmp_path, monkeypatch):
    """A cached run equals greedy_run's, is read back without decoding, serves a shorter `past` as
    its prefix; a longer `past`, other stop ids or another model key decode again."""
    model, _, _, prompts = setup
    p = prompts[0]
    cache = rp.GreedyCache(tmp_path, "tiny fp32 cpu")
    first = cache.run(model, p, MAX_NEW, [], 7)
    want = rp.greedy_run(model, p, MAX_NEW, [], 7)
    assert (first.tokens, first.num_out) == (want.tokens, want.num_out) and len(want.tokens) == want.num_out + 7
    decoded = []
    real = rp.greedy_run
    monkeypatch.setattr(rp, "greedy_run", lambda *a: decoded.append(a[-1]) or real(*a))
    again = cache.run(model, p, MAX_NEW, [], 7)
    short = cache.run(model, p, MAX_NEW, [], 3)
    assert decoded == [] and (again.tokens, again.num_out) == (want.tokens, want.num_out)
    assert short.tokens == want.tokens[:want.num_out + 3] and short.output == want.output
    assert (cache.hits, cache.misses) == (2, 1)
    cache.run(model, p, MAX_NEW, [], 9)                        # more than kept: decoded, then kept
    stop = [want.output[2]]
    stopped = cache.run(model, p, MAX_NEW, stop, 3)            # other stop ids: their own entry
    rp.GreedyCache(tmp_path, "another target").run(model, p, MAX_NEW, [], 3)
    assert decoded == [9, 3, 3] and stopped.output == want.output[:3]
    assert len(list(tmp_path.glob("*.json"))) == 3


# ---------------------------------------------------------------------------------------------
# end to end: python evaluate.py eval.backend=replay gives the hf backend's tau

def test_evaluate_replay_equals_hf_backend(setup, tmp_path):
    from eagle3.export import export_drafter
    model, chain, t2d, _ = setup
    run = tmp_path / "run_a"
    export_drafter(run / "export", chain.model.exportable_state_dict(), chain.model.shape, chain.d2t, t2d, AUX,
                   ["LlamaForCausalLM"], engines=("vllm",))
    reports = {}
    env = dict(os.environ, EAGLE3_CACHE=str(tmp_path / "cache"))
    for backend, out in (("hf", "hf"), ("replay", "replay"), ("replay", "replay_cached")):
        r = subprocess.run([sys.executable, "evaluate.py", "+experiment=tiny", f"run_dir={tmp_path}/r",
                            f"eval.drafters=[{run}]", f"eval.backend={backend}", "eval.prompts=[mt_bench_2turn]",
                            "eval.num_prompts=2", "eval.chains=[3,1]", "eval.max_new_tokens=12",
                            f"eval.out_dir={tmp_path / out}"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        reports[out] = json.loads((tmp_path / out / "report.json").read_text())
        reports[out]["lines"] = [json.loads(line) for line in (tmp_path / out / "per_prompt.jsonl").read_text().splitlines()]
        reports[out]["stdout"] = r.stdout
    # the second replay reads all 4 turns' greedy runs from the cache and reports the same
    assert "[eval] greedy runs: 4 from" in reports["replay_cached"]["stdout"]
    assert "greedy runs" not in reports["replay"]["stdout"]
    assert reports["replay_cached"]["results"] == reports["replay"]["results"]
    hf, replay = reports["hf"], reports["replay"]
    assert replay["settings"]["backend"] == "replay" and len(replay["results"]) == 2
    assert all(x["num_accepted"] > 0 for x in replay["results"])
    for a, b in zip(hf["results"], replay["results"]):
        for key in ("tau", "accept_per_position", "num_drafts", "num_accepted", "new_tokens", "tau_ci95",
                    "per_category", "mismatches"):
            assert a[key] == b[key], key
        assert (b["tok_s"], b["baseline_tok_s"], b["speedup"]) == (None, None, None)   # not measured
    strip = [{k: v for k, v in line.items() if k != "seconds"} for line in hf["lines"]]
    assert strip == [{k: v for k, v in line.items() if k != "seconds"} for line in replay["lines"]]
    assert {line["drafter"] for line in replay["lines"]} == {"baseline", "run_a"}
