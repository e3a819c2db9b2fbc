"""hf reference vs vLLM (CPU build) on the real SmolLM2 target with the same drafter and prompts.

The drafter comes from EAGLE3_TEST_DRAFTER (an export or run dir: e.g. a trained SmolLM2 drafter)
or, by default, from a quick fixture: a drafter fitted for a minute to SmolLM2's own greedy answers
to the very prompts evaluated, so both decoders accept a good share of its drafts (the point is
that the two decoders COUNT the same, not that the drafter generalises).

The comparisons run target and drafter in fp32 in both engines: in bf16 each engine's kernels
round near-ties their own way (and a verify pass differently from a decode step), so the two
greedy texts part, on CPUs with bf16 matrix units and without, and a drafter fitted to one text
is judged on another. Batch size is 1 in both, so batching does not enter.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NUM_PROMPTS, MAX_NEW, K = 3, 32, 3
TAU_TOL = 0.15        # |tau_hf - tau_vllm| allowed between the two decoders in fp32


def _engine_missing():
    try:
        import vllm  # noqa: F401
        return None
    except Exception as e:           # not installed, or installed without a usable torch
        return f"vLLM is not importable here: {e}"


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_engine_missing() is not None,
                                                   reason=str(_engine_missing()))]


def fit_memorizing_drafter(out_root: Path, steps: int = 80, **norms) -> Path:
    """Greedy SmolLM2 answers to the evaluated prompts -> aux/next-token pairs -> a drafter trained
    (step 0 only, hard labels = the target's greedy tokens) until it reproduces them. Exported with
    the real exporter, so the engine reads exactly what training would hand it. norms: EAGLE-3.1's
    fc_norm / norm_output (DrafterShape fields); the drafter is then trained by training-time test
    over K steps (eagle3.loss.ttt_loss), so that the drafts after the first, which norm_output
    changes, are accepted too; no mis-wired copy is written then. Without norms the drafter is
    also taught that the states of the layers one above and one below each aux layer are not its
    input (it must draft anything but the answer's token from them), and a copy is written with
    vLLM's ids shifted by one: acceptance then tells whether the engine hands over exactly the
    layers the ids name, which a drafter trained on real data shows only faintly (adjacent
    residual streams are alike)."""
    from eagle3 import chat, evaluation as ev
    from eagle3.export import export_drafter
    from eagle3.loss import target_teacher, ttt_loss
    from eagle3.model import Eagle3Drafter
    from eagle3.shape import DrafterShape
    from eagle3.specdec import greedy_decode
    from eagle3.targets import default_aux_layers, load_target_model, load_tokenizer, resolve_target, target_info
    from eagle3.vocab import build_vocab, count_tokens

    torch.manual_seed(0)
    tdir = resolve_target("gguf", "", "smollm2")
    info = target_info(tdir)
    tok = load_tokenizer(tdir)
    model = load_target_model(tdir, torch.float32, "cpu")   # fp32: faster than bf16 on this CPU
    stop = chat.stop_ids(tok, tdir)
    aux_layers = default_aux_layers(info.num_layers)
    seqs, masks = [], []
    for p in ev.load_prompts("mt_bench", NUM_PROMPTS):
        ids = chat.render_prompt(tok, p.messages)
        ans, _ = greedy_decode(model, ids, MAX_NEW, stop)
        seqs.append(ids + ans)
        masks.append([0] * len(ids) + [1] * len(ans))
    vocab = build_vocab(count_tokens([torch.tensor(s) for s in seqs], [torch.tensor(m) for m in masks],
                                     info.vocab_size), 512)
    shape = DrafterShape(hidden_size=info.hidden_size, intermediate_size=512, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=info.vocab_size, draft_vocab_size=512,
                         target_hidden_size=info.hidden_size, num_aux=3, rms_norm_eps=info.rms_norm_eps,
                         rope_theta=info.rope_theta, max_position_embeddings=info.max_position_embeddings,
                         **norms)
    drafter = Eagle3Drafter(shape)
    drafter.set_target_embedding(model.get_input_embeddings().weight.float())
    rows, ttt = [], []
    head = model.get_output_embeddings().weight.detach().float()

    def aux_states(hs, shift=0):     # [T, k*H]: the aux layers' states, or those `shift` layers off
        return torch.cat([hs[i + shift][0] for i in aux_layers], -1).float()

    with torch.no_grad():
        for s, m in zip(seqs, masks):
            hs = model(torch.tensor([s]), output_hidden_states=True).hidden_states
            aux = aux_states(hs)
            if norms:
                final = model.model(torch.tensor([s])).last_hidden_state.float()      # after the final norm
                ttt.append(dict(input_ids=torch.tensor([s]), loss_mask=torch.tensor([m]),
                                attention_mask=torch.ones(1, len(s), dtype=torch.long), aux=aux[None], final=final,
                                teacher=target_teacher(final, head, vocab.draft_ids)))
            t2d = vocab.t2d
            # row t: (aux_t, x_{t+1}) -> x_{t+2}; train where x_{t+2} is an answer token
            ids = torch.tensor(s)
            target = ids[2:]
            keep = torch.tensor(m[2:]).bool() & t2d[target]
            # the states of the layers one above and one below: taught to draft anything but the
            # answer's token, so that an engine reading the ids one off in either direction is refused
            wrong = [aux_states(hs, d)[:-1] for d in (-1, 1)]
            rows.append((aux[:-1], ids[1:], target, keep, wrong))
    draft_of = torch.full((info.vocab_size,), -1, dtype=torch.long)
    draft_of[vocab.draft_ids] = torch.arange(vocab.size)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=2e-3)
    for _ in range(steps):
        loss = 0.0
        for batch in ttt:
            loss = loss + ttt_loss(drafter, **batch, target_lm_head=head, vocab=vocab, ttt_steps=K).loss
        for aux, nxt, target, keep, wrong in rows if not norms else []:
            label = draft_of[target][keep]
            logits, _ = drafter(aux[None], nxt[None])
            loss = loss + torch.nn.functional.cross_entropy(logits[0, :-1][keep], label)
            for w in wrong:            # unlikelihood of the answer's token: -log(1 - p)
                logits, _ = drafter(w[None], nxt[None])
                lp = logits[0, :-1][keep].log_softmax(-1).gather(-1, label[:, None])
                loss = loss - torch.log(-torch.expm1(lp.clamp(max=-1e-6))).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if norms.get("fc_norm"):
        # The same function with every fc_norm weight and its fc columns negated: an engine that
        # applied fc (but not fc_norm) would see every aux state's contribution flipped in sign.
        with torch.no_grad():
            for i, n in enumerate(drafter.fc_norm):
                n.weight.neg_()
                drafter.fc.weight[:, i * shape.target_hidden_size:(i + 1) * shape.target_hidden_size].neg_()
    dirs = export_drafter(out_root / "export", drafter.exportable_state_dict(), shape, vocab.d2t, vocab.t2d,
                          aux_layers, info.architectures, "smollm2", info.fingerprint, engines=("vllm",))
    if norms:
        return dirs["vllm"]
    # the same weights with the vLLM ids shifted by one: a wiring error acceptance must expose
    export_drafter(out_root / "shifted" / "export", drafter.exportable_state_dict(), shape, vocab.d2t,
                   vocab.t2d, aux_layers, info.architectures, engines=("vllm",),
                   aux_ids_override={"vllm": [i + 1 for i in aux_layers]})
    # drop our own record of the meaning, or check_drafter_fits (rightly) refuses the mismatch
    cfg_path = out_root / "shifted" / "export" / "vllm" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["eagle3"]["aux_layers"]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dirs["vllm"]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    given = os.environ.get("EAGLE3_TEST_DRAFTER")
    if given:
        return Path(given)
    return fit_memorizing_drafter(tmp_path_factory.mktemp("memorizer"), steps=40)   # its losses settle by step 30


def _evaluate(backend, drafters, out, extra=(), num_prompts=NUM_PROMPTS, max_new=MAX_NEW, log=None):
    cmd = [sys.executable, "evaluate.py", "+experiment=smollm2", f"run_dir={out}/run", f"eval.backend={backend}",
           f"eval.drafters=[{','.join(str(d) for d in drafters)}]", "eval.prompts=[mt_bench]",
           f"eval.num_prompts={num_prompts}", f"eval.max_new_tokens={max_new}", f"eval.num_steps={K}",
           f"eval.out_dir={out}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    if log is not None:
        log.append(r.stdout + r.stderr)
    return json.loads((Path(out) / "report.json").read_text())


def per_prompt_tau(out: Path, drafter: str) -> dict:
    """prompt id -> that prompt's tau (1 + accepted / drafts) for one drafter of an evaluation in `out`."""
    rows = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    return {r["prompt_id"]: 1 + r["num_accepted"] / max(1, r["num_drafts"]) for r in rows if r["drafter"] == drafter}


def test_hf_and_vllm_agree_on_tau_and_on_the_layer_ids(drafter_dir, tmp_path):
    """The fixture drafter in both decoders (fp32): the same tau and acceptance by position, vLLM
    reading the export's ids as the aux layers the drafter was trained on, and the copy with ids
    shifted by one drafting blind there (an engine whose ids meant the layer's output, or the layer
    below, would serve the correct export that way too: docs/engines.md, "Aux layer ids")."""
    shifted = drafter_dir.parent.parent / "shifted" / "export" / "vllm"
    drafters = [drafter_dir] + ([shifted] if shifted.exists() else [])
    hf = _evaluate("hf", [drafter_dir], tmp_path / "hf", ["target.dtype=float32"])["results"][0]
    rep = _evaluate("vllm", drafters, tmp_path / "vllm", ["eval.baseline=false", "target.dtype=float32"])
    vl = rep["results"][0]
    print(f"\nhf  tau {hf['tau']:.3f} acc {hf['accept_per_position']} drafts {hf['num_drafts']}"
          f"\nvllm tau {vl['tau']:.3f} acc {vl['accept_per_position']} drafts {vl['num_drafts']}")
    assert hf["mismatches"] == [], "fp32 speculative decoding must reproduce the plain greedy text"
    assert hf["tau"] > 1.3, "the drafter must be accepted often enough for the comparison to mean something"
    assert abs(hf["tau"] - vl["tau"]) <= TAU_TOL
    for a, b in zip(hf["accept_per_position"], vl["accept_per_position"]):
        assert abs(a - b) <= 0.15
    # the engine itself says which residual streams it hands the drafter: the export's ids as vLLM reads
    # them must be exactly the aux_layers the drafter was trained on
    assert vl["engine_aux_layers"] == vl["aux_layers"] == [2, 15, 27]
    if len(rep["results"]) > 1:
        sh = rep["results"][1]
        print(f"shifted ids: vllm tau {sh['tau']:.3f} acc {sh['accept_per_position']}")
        assert sh["engine_aux_layers"] == [3, 16, 28]      # a mis-wired export is read as written
        assert vl["tau"] - sh["tau"] > 2 * TAU_TOL         # ... and served blind


def misread(export_dir: Path, out: Path, drop: str = "", **config) -> Path:
    """The same weights as a wrong engine would run them: the tensors whose names start with `drop`
    left out and `config` written over config.json (by hand: export_drafter refuses to write such
    a thing, or writes only what the drafter holds)."""
    from safetensors.torch import save_file
    from eagle3.export import load_export

    tensors, cfg = load_export(export_dir)
    out.mkdir(parents=True)
    save_file({k: v for k, v in tensors.items() if not (drop and k.startswith(drop))}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg, **config}, indent=2))
    return out


@pytest.fixture(scope="module")
def eagle31(tmp_path_factory):
    """A drafter of two decoder layers with EAGLE-3.1's fc_norm and norm_output (each aux state
    normed before fc; the next draft step reads norm(h_out)), fitted like the fixture above, served
    by vLLM; and the hf reference of it and of the same weights as three wrong engines would run
    them: norms ignored, norm_output ignored, the second layer dropped. One fit and one run of each
    decoder serve the two tests below. Both engines run the target in fp32, so that they verify the
    same greedy text as the one the drafter was fitted to (in bf16 the engines' greedy answers part
    on a CPU with bf16 matrix units)."""
    root = tmp_path_factory.mktemp("memorizer_eagle31")
    drafter = fit_memorizing_drafter(root, num_layers=2, fc_norm=True, norm_output=True)
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["num_hidden_layers"] == 2
    wrong = [misread(drafter, root / "ignored" / "vllm", "fc_norm.", fc_norm=False, norm_output=False),
             misread(drafter, root / "no_norm_output" / "vllm", norm_output=False),
             misread(drafter, root / "one_layer" / "vllm", "layers.", num_hidden_layers=1)]
    hf = _evaluate("hf", [drafter, *wrong], root / "hf", ["target.dtype=float32"])["results"]
    vl = _evaluate("vllm", [drafter], root / "vllm", ["eval.baseline=false", "target.dtype=float32"])["results"][0]
    runs = dict(zip(["hf", "hf_ignored", "hf_no_output", "hf_one"], hf), vllm=vl, root=root)
    for name in ("hf", "vllm", "hf_ignored", "hf_no_output", "hf_one"):
        print(f"\n{name}: tau {runs[name]['tau']:.3f} acc {runs[name]['accept_per_position']}", end="")
    return runs


def test_vllm_applies_the_eagle31_norms(eagle31):
    """vLLM must accept the drafts as the hf reference does, and clearly more often than the hf
    reference accepts the same weights run as an engine that ignored fc_norm (both norms off) or
    norm_output alone would run them."""
    hf, vl = eagle31["hf"], eagle31["vllm"]
    assert hf["tau"] > 1.3
    assert abs(hf["tau"] - vl["tau"]) <= TAU_TOL
    for a, b in zip(hf["accept_per_position"], vl["accept_per_position"]):
        assert abs(a - b) <= 0.15
    assert vl["tau"] - eagle31["hf_ignored"]["tau"] > 2 * TAU_TOL
    assert vl["tau"] - eagle31["hf_no_output"]["tau"] > 2 * TAU_TOL


def test_vllm_runs_every_layer_of_a_two_layer_drafter(eagle31):
    """vLLM's acceptance, prompt by prompt, is closer to the hf reference of the two layers than
    to that of the first layer alone (what an engine that dropped the second would run)."""
    root = eagle31["root"]

    def gap(a, b):
        return sum(abs(a[p] - b[p]) for p in a)
    both = per_prompt_tau(root / "hf", eagle31["hf"]["drafter"])
    first = per_prompt_tau(root / "hf", eagle31["hf_one"]["drafter"])
    served = per_prompt_tau(root / "vllm", eagle31["vllm"]["drafter"])
    print(f"\nper-prompt gap of vllm to both layers {gap(served, both):.3f}, to the first alone {gap(served, first):.3f}")
    assert both != first                       # the second layer changes what is accepted on these prompts
    assert gap(served, both) < gap(served, first)


def test_the_committed_drafter_is_accepted_in_vllm_in_bf16(tmp_path):
    """The committed GPU-trained drafter (results/smollm2-drafter) served by vLLM as evaluation
    serves it by default (bf16): read with its trained aux layers and accepted well above chance
    (a drafter whose drafts were all refused scores tau 1)."""
    src = ROOT / "results" / "smollm2-drafter" / "export" / "vllm"
    logs = []
    good = _evaluate("vllm", [src], tmp_path / "out", ["eval.baseline=false"], log=logs)["results"][0]
    print(f"\ncommitted tau {good['tau']:.3f} acc {good['accept_per_position']} drafts {good['num_drafts']}")
    assert good["engine_aux_layers"] == good["aux_layers"] == [2, 15, 27]
    assert good["tau"] > 1.3
    assert good["accept_per_position"][0] > 0.3
    # Rerun into the same out_dir: every decode and the layers vLLM captured come from decoded.jsonl,
    # so no engine starts and the report is the same.
    (tmp_path / "out" / "report.json").unlink()
    again = _evaluate("vllm", [src], tmp_path / "out", ["eval.baseline=false"], log=logs)["results"][0]
    assert again == good and f"[eval] {NUM_PROMPTS} prompt decodes taken from" in logs[1]
    engine_start = "Initializing a V1 LLM engine"
    assert engine_start in logs[0] and engine_start not in logs[1]
