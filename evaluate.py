"""Drafters -> acceptance length, tok/s and speedup, measured by a real decoder.

    python evaluate.py +experiment=NAME eval.drafters=[runs/NAME] [eval.backend=hf|vllm|sglang|replay]
        [eval.prompts=[mt_bench,mt_bench_2turn,sharegpt_heldout,path.jsonl]] [eval.num_steps=3]
        [eval.chains=[3,7]] [eval.reference=NAME] ...

Every backend decodes each prompt set once without a drafter (baseline tok/s) and once per drafter
and chain length, one prompt at a time (batch 1, greedy), and hands back the engine's own
acceptance counters per prompt (eagle3.evaluation.DecodeStats). eagle3.judging turns those into
tau with bootstrap intervals, tau per MT-Bench category and paired comparisons against the
reference drafter. Writes report.json, report.md, per_prompt.jsonl and the figures (tau.png,
acceptance.png, categories.png, paired.png) to eval.out_dir.

`replay` gives the hf backend's counters without running its loop (eagle3/replay.py): one greedy
decode per prompt turn, shared by the baseline, every drafter and every chain length, then one
drafter forward per batch of turns. It times nothing: its tok/s and speedup are absent.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import hydra

from eagle3 import chat, evaluation as ev
from eagle3 import judging
from eagle3.config import Config, register, to_config
from eagle3.eval_journal import Journal

register()

# generate(prompt_ids) -> (new_ids, seconds, counters {drafts, draft_tokens, accepted, per_pos, engine_tokens})
Generate = Callable[[List[int]], Tuple[List[int], float, dict]]
# key(drafter or None, prompt set name or None, chain or None) -> the journal's dict for that configuration
Key = Callable[[dict, str, int], dict]


def decode_prompts(prompts: List[ev.Prompt], tokenizer, generate: Generate, label: str,
                   stop: List[int], journal: Journal = None, config: dict = None) -> List[ev.DecodeStats]:
    """Every turn of every prompt; later turns follow the model's own previous answer, cut at the
    stop ids the decoding used and rendered as regeneration renders it (chat.answer_turn), so a
    follow-up prompt holds the tokens training saw for the same conversation. With a journal,
    prompts it holds for `config` are taken from it and each new one is added as it finishes."""
    from tqdm import tqdm

    from capture.answer_engines import cut_at_stop
    out = []
    for p in tqdm(prompts, desc=f"[eval] {label}", unit="prompt", file=sys.stderr, dynamic_ncols=True):
        if journal is not None and (st := journal.get(config, p)) is not None:
            out.append(st)
            continue
        st = ev.DecodeStats(p.id, [], 0.0, category=p.category)
        messages = list(p.messages)
        for turn, followup in enumerate([None] + list(p.followups)):
            if followup is not None:
                messages += [chat.answer_turn(tokenizer, cut_at_stop(st.output_ids[-1], stop)[0]),
                             {"role": "user", "content": followup}]
            ids, secs, c = generate(chat.render_prompt(tokenizer, messages))
            st.output_ids.append(list(ids))
            st.seconds += secs
            st.num_drafts += c.get("drafts", 0)
            st.num_draft_tokens += c.get("draft_tokens", 0)
            st.num_accepted += c.get("accepted", 0)
            st.engine_tokens += c.get("engine_tokens", 0)
            per_pos = c.get("per_pos") or []
            st.accepted_per_pos = [a + b for a, b in zip(
                st.accepted_per_pos + [0] * (len(per_pos) - len(st.accepted_per_pos)),
                per_pos + [0] * (len(st.accepted_per_pos) - len(per_pos)))]
        if journal is not None:
            journal.add(config, p, st)
        out.append(st)
    return out


# --------------------------------------------------------------------------------------------
# Backends: each returns ({prompt set: baseline stats}, {(drafter, prompt set, chain): stats}, versions).
# The baseline is decoded once; each drafter once per chain length in `chains`.

def at_chain(e, k: int):
    """The eval settings for a chain of k draft tokens. An explicit num_draft_tokens belongs to
    eval.num_steps; any other chain verifies k + 1 tokens."""
    return dataclasses.replace(e, num_steps=k, num_draft_tokens=e.num_draft_tokens if k == e.num_steps else 0)


def run_hf(e, target_dir, dtype_name, drafters, prompt_sets, tokenizer, stop, chains, journal, key) -> tuple:
    import torch
    import transformers
    from eagle3.specdec import greedy_decode, load_hf_drafter, spec_decode
    from eagle3.targets import load_target_model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = _torch_dtype(dtype_name, device)
    model = load_target_model(target_dir, dtype, device)
    base = {name: decode_prompts(ps, tokenizer, lambda ids: (*greedy_decode(model, ids, e.max_new_tokens, stop), {}),
                                 f"baseline / {name}", stop, journal, key(None, name, None))
            for name, ps in prompt_sets.items()} if e.baseline else {}
    spec = {}
    for d in drafters:
        chain = load_hf_drafter(d["export"], model, device, dtype)
        for k in chains:
            def gen(ids, chain=chain, aux=d["aux_layers"], k=k):
                toks, c, secs = spec_decode(model, chain, ids, aux, k, e.max_new_tokens, stop)
                return toks, secs, _counters(c)
            for name, ps in prompt_sets.items():
                spec[(d["name"], name, k)] = decode_prompts(ps, tokenizer, gen, f"{d['name']} / {name} / chain {k}",
                                                            stop, journal, key(d, name, k))
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "device": device, "dtype": str(dtype).replace("torch.", "")}
    if device == "cpu":
        versions["host_cpu"] = ev.host_cpu()
    return base, spec, versions


def _counters(c) -> dict:
    """specdec.SpecCounts -> decode_prompts' counters."""
    return {"drafts": c.num_drafts, "draft_tokens": c.num_draft_tokens, "accepted": c.num_accepted,
            "per_pos": c.accepted_per_pos}


def run_replay(e, target_dir, dtype_name, drafters, prompt_sets, tokenizer, stop, chains) -> tuple:
    """The hf backend's counts by replay: every turn decoded greedily once, `max(chains)` tokens past
    its output (later turns follow that output, whatever the drafter), then per drafter one forward of
    its longest chain over all turns. Seconds are 0: nothing is timed, so tok/s and speedup are None."""
    import torch
    import transformers
    from eagle3.replay import greedy_cache, replay_counts
    from eagle3.specdec import load_hf_drafter
    from eagle3.targets import load_target_model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = _torch_dtype(dtype_name, device)
    model = load_target_model(target_dir, dtype, device)
    cache = greedy_cache(Path(target_dir), model)
    runs = {}                                      # prompt ids -> greedy_run

    def greedy(ids):
        key = tuple(ids)
        if key not in runs:
            runs[key] = cache.run(model, ids, e.max_new_tokens, stop, max(chains))
        return runs[key].output, 0.0, {}
    base = {name: decode_prompts(ps, tokenizer, greedy, f"greedy / {name}", stop) for name, ps in prompt_sets.items()}
    if cache.hits:
        print(f"[eval] greedy runs: {cache.hits} from {cache.root}, {cache.misses} decoded")
    spec = {}
    for d in drafters:
        chain = load_hf_drafter(d["export"], model, device, dtype)
        counts = dict(zip(runs, replay_counts(model, chain, d["aux_layers"], list(runs.values()), chains)))
        for k in chains:
            def gen(ids, counts=counts, k=k):
                return runs[tuple(ids)].output, 0.0, _counters(counts[tuple(ids)][k])
            for name, ps in prompt_sets.items():
                spec[(d["name"], name, k)] = decode_prompts(ps, tokenizer, gen, f"{d['name']} / {name} / chain {k}",
                                                            stop)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "device": device, "dtype": str(dtype).replace("torch.", "")}
    if device == "cpu":
        versions["host_cpu"] = ev.host_cpu()
    return base if e.baseline else {}, spec, versions


def run_vllm(e, target_dir, dtype_name, max_model_len, drafters, prompt_sets, tokenizer, stop, chains,
             journal, key) -> tuple:
    """vLLM in-process (its CPU build here): one LLM object at a time, freed before the next, and
    none for a configuration the journal already holds. The target and drafter run in bf16 unless
    target.dtype names another dtype."""
    import gc

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    on_gpu = torch.cuda.is_available()
    # LLM.apply_model ships our small inspection function to vLLM's engine process by pickle, which
    # vLLM allows only when asked (both processes are ours, on this machine).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    params = SamplingParams(temperature=0.0, max_tokens=e.max_new_tokens, stop_token_ids=list(stop))
    common = dict(model=str(target_dir), dtype="bfloat16" if dtype_name == "auto" else dtype_name,
                  max_model_len=max_model_len,
                  # on the CPU backend this is the fraction of host memory; the 0.92 default fails at 24 GiB
                  gpu_memory_utilization=0.85 if on_gpu else 0.25,
                  enforce_eager=not on_gpu, disable_log_stats=False, seed=0)

    def decode_all(llm, keys) -> Dict[str, List[ev.DecodeStats]]:
        def gen(ids):
            before = ev.vllm_counters(llm.get_metrics())
            t0 = time.perf_counter()
            res = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            secs = time.perf_counter() - t0
            c = ev.vllm_delta(before, ev.vllm_counters(llm.get_metrics()))
            return list(res[0].outputs[0].token_ids), secs, c
        return {name: decode_prompts(ps, tokenizer, gen, name, stop, journal, keys[name])
                for name, ps in prompt_sets.items()}

    def with_llm(drafter=None, k=None, **kw):
        keys = {name: key(drafter, name, k) for name in prompt_sets}
        seen = journal.get_meta(key(drafter, None, k)) if drafter is not None else {}
        if seen is not None and journal.complete(keys, prompt_sets):
            if drafter is not None:
                drafter["engine_aux_layers"] = seen["engine_aux_layers"]
            return decode_all(None, keys)          # every prompt from the journal: no engine
        llm = LLM(**common, **kw)
        try:
            if drafter is not None:
                # What vLLM really captures, read off its model: a mis-wired id crashes nothing.
                drafter["engine_aux_layers"] = llm.apply_model(ev.engine_aux_layers)[0]
                journal.set_meta(key(drafter, None, k), {"engine_aux_layers": drafter["engine_aux_layers"]})
                if drafter["engine_aux_layers"] != drafter["aux_layers"]:
                    print(f"[eval] WARNING: vLLM captures the residual stream entering layers "
                          f"{drafter['engine_aux_layers']} but drafter {drafter['name']} was trained on "
                          f"{drafter['aux_layers']}: its acceptance will suffer", file=sys.stderr)
            return decode_all(llm, keys)
        finally:
            del llm
            gc.collect()

    base = with_llm() if e.baseline else {}
    spec = {}
    for d in drafters:
        for k in chains:
            out = with_llm(d, k, speculative_config={"method": "eagle3", "model": str(d["export"]),
                                                     "num_speculative_tokens": k})
            spec.update({(d["name"], name, k): st for name, st in out.items()})
    versions = {"vllm": vllm.__version__, "torch": torch.__version__,
                "vllm_settings": {k: v for k, v in common.items() if k != "model"}}
    if not on_gpu:
        versions["host_cpu"] = ev.host_cpu()
    return base, spec, versions


def run_sglang(e, target_dir, trust_remote_code, drafters, prompt_sets, tokenizer, stop, out_dir, chains,
               journal, key) -> tuple:
    """A fresh `sglang.launch_server` per configuration (its counters are per request, but a fresh
    server keeps caches and warm-up identical), or eval.server_url for one running server; none for
    a configuration the journal already holds."""
    from capture import sglang_server as srv
    from eagle3.serving import SERVER_START_TIMEOUT, eval_server_cmd, server_cmd, sglang_python

    def serve(d, k, tag, e=e) -> Dict[str, List[ev.DecodeStats]]:
        keys = {name: key(d, name, k) for name in prompt_sets}
        if e.server_url or journal.complete(keys, prompt_sets):
            return decode_sglang(e.server_url.rstrip("/"), prompt_sets, tokenizer, stop, e, journal, keys)
        draft = d["export"] if d is not None else None
        port = srv.free_port()
        if draft is None:
            cmd = server_cmd(str(target_dir), e.tp_size, port, e.server_args,
                             trust_remote_code=trust_remote_code, python=sglang_python())
        else:
            cmd = eval_server_cmd(str(target_dir), str(draft), e.tp_size, e.num_steps, e.topk,
                                  e.num_draft_tokens, port, [*draft_memory_args(target_dir, draft, e), *e.server_args],
                                  trust_remote_code=trust_remote_code, python=sglang_python())
        url = f"http://127.0.0.1:{port}"
        proc = srv.launch(cmd, None, str(Path(out_dir) / f"sglang_{tag}.log"), url + "/health",
                          timeout=SERVER_START_TIMEOUT)
        try:
            return decode_sglang(url, prompt_sets, tokenizer, stop, e, journal, keys)
        finally:
            srv.stop(proc)

    base = serve(None, None, "baseline") if e.baseline and not e.server_url else {}
    spec = {}
    for d in drafters:
        for k in chains:
            out = serve(d, k, f"{d['name']}_chain{k}", at_chain(e, k))
            spec.update({(d["name"], name, k): st for name, st in out.items()})
    return base, spec, {"sglang": _pkg_version("sglang")}


def draft_memory_args(target_dir, draft, e) -> List[str]:
    """eagle3.serving.eval_kv_args for this target and drafter, unless eval.server_args already
    sizes SGLang's memory itself."""
    from eagle3.serving import eval_kv_args
    if any(a.split("=")[0] in ("--max-total-tokens", "--mem-fraction-static") for a in e.server_args):
        return []
    target_cfg, draft_cfg = (json.loads((Path(d) / "config.json").read_text()) for d in (target_dir, draft))
    return eval_kv_args(target_cfg, draft_cfg, e.tp_size)


def decode_sglang(url, prompt_sets, tokenizer, stop, e, journal, keys) -> Dict[str, List[ev.DecodeStats]]:
    import urllib.request

    def gen(ids):
        body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": e.max_new_tokens,
                                                      "stop_token_ids": list(stop)}}
        req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            resp = json.loads(r.read())
        secs = time.perf_counter() - t0
        c = ev.sglang_counters(resp, e.num_steps)
        c["engine_tokens"] = c["completion_tokens"]
        return c["output_ids"], secs, c
    return {name: decode_prompts(ps, tokenizer, gen, name, stop, journal, keys[name])
            for name, ps in prompt_sets.items()}


# --------------------------------------------------------------------------------------------

def _torch_dtype(name: str, device: str):
    import torch
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


def _pkg_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed here"


def journal_for(e, dtype_name: str, target_fingerprint: str, stop: List[int], out_dir: Path) -> Tuple[Journal, Key]:
    """The journal of out_dir, and the key of a configuration: everything its counts and timings
    depend on (settings, target, where it runs and with which packages), the drafter's weights, the
    prompt set and the chain length (eagle3/eval_journal.py)."""
    import torch

    from eagle3.targets import fingerprint
    if e.backend == "sglang" and e.server_url:
        host = e.server_url
    else:
        host = torch.cuda.get_device_name() if torch.cuda.is_available() else ev.host_cpu()
    fixed = {"backend": e.backend, "target": target_fingerprint, "dtype": dtype_name,
             "max_new_tokens": e.max_new_tokens, "stop": list(stop), "topk": e.topk, "temperature": e.temperature,
             "tp_size": e.tp_size, "server_args": list(e.server_args), "host": host,
             "packages": {p: _pkg_version(p) for p in ("torch", "transformers", "vllm", "sglang")}}

    def key(d, name, k):
        return dict(fixed, drafter=[d["name"], fingerprint(Path(d["export"]))] if d is not None else None,
                    prompts=name, chain=k,
                    num_draft_tokens=at_chain(e, k).num_draft_tokens if k is not None else None)
    return Journal(out_dir), key


def drafter_name(path: str) -> str:
    p = Path(path).resolve()
    if p.parent.name == "export":          # <run_dir>/export/<engine>
        p = p.parent.parent
    elif p.name in ("sglang", "vllm"):     # <name>/<engine>: an export kept outside a run dir
        p = p.parent
    if re.fullmatch(r"stage\d+", p.name):   # an earlier stage of a run trained in stages (train.stages)
        return f"{p.parent.name}_{p.name}"
    return p.name


def prepare_drafters(paths: List[str], backend: str, info) -> List[dict]:
    """Find each drafter's export dir for the backend and refuse misfits before anything starts."""
    from eagle3.export import find_export, load_export
    engine = "sglang" if backend == "sglang" else "vllm"     # hf and replay read vLLM's ids: as given
    out, names = [], set()
    for path in paths:
        export = find_export(Path(path), engine)
        tensors, cfg = load_export(export)
        aux = ev.check_drafter_fits(cfg, info, tensors, engine=engine, where=f"drafter {export}")
        name = drafter_name(path)
        while name in names:
            name += "'"
        names.add(name)
        out.append({"name": name, "path": str(path), "export": export, "aux_layers": aux, "t2d": tensors.get("t2d")})
    return out


def evaluate(c: Config) -> Dict[str, Path]:
    from eagle3.targets import prepare_target
    e = c.eval
    if not e.drafters:
        raise ValueError("eval.drafters is empty: pass export dirs or run dirs, e.g. eval.drafters=[runs/smollm2]")
    if e.backend not in ("hf", "vllm", "sglang", "replay"):
        raise ValueError(f"eval.backend {e.backend!r}: expected hf | vllm | sglang | replay")
    if e.temperature != 0.0 or (e.backend != "sglang" and e.topk != 1):
        raise ValueError("only greedy chain drafting is evaluated (temperature 0; topk 1 for hf and vllm): "
                         f"got temperature {e.temperature}, topk {e.topk}")
    chains = list(dict.fromkeys(e.chains)) or [e.num_steps]
    if min(chains) < 1:
        raise ValueError(f"eval.chains {list(e.chains)}: chain lengths are at least 1")
    if e.server_url and chains != [e.num_steps]:
        raise ValueError("eval.server_url: a running server has one chain length; leave eval.chains empty")
    t = c.target
    target = prepare_target(t.source, t.path, t.name, t.arch, t.random_config, t.seed, c.aux_layers)
    target_dir, info = target.dir, target.info
    drafters = prepare_drafters(list(e.drafters), e.backend, info)
    tokenizer = chat.load_tokenizer(target_dir, t)
    stop = chat.stop_ids(tokenizer, target_dir)
    prompt_sets = {ev.prompt_set_name(s): ev.load_prompts(s, e.num_prompts, c.data.source, c.data.path,
                                                          c.data.heldout_fraction, c.data.mix) for s in e.prompts}
    print(f"[eval] {len(drafters)} drafter(s) x chains {chains} on " + ", ".join(
        f"{name} ({len(ps)} prompts)" for name, ps in prompt_sets.items()), file=sys.stderr)
    reference = next((d["name"] for d in drafters if e.reference in (d["name"], d["path"])), None)
    if e.reference and reference is None:
        raise ValueError(f"eval.reference {e.reference!r} is none of the drafters {[d['name'] for d in drafters]}")
    out_dir = Path(e.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    journal, key = journal_for(e, t.dtype, info.fingerprint, stop, out_dir)
    if e.backend == "hf":
        base, spec, versions = run_hf(e, target_dir, t.dtype, drafters, prompt_sets, tokenizer, stop, chains,
                                      journal, key)
    elif e.backend == "replay":
        base, spec, versions = run_replay(e, target_dir, t.dtype, drafters, prompt_sets, tokenizer, stop, chains)
    elif e.backend == "vllm":
        longest = max(len(chat.render_prompt(tokenizer, p.messages)) + sum(len(tokenizer(f)["input_ids"]) + 32
                      for f in p.followups) for ps in prompt_sets.values() for p in ps)
        turns = 1 + max(len(p.followups) for ps in prompt_sets.values() for p in ps)
        max_len = min(info.max_position_embeddings or 1 << 30, longest + turns * e.max_new_tokens + max(chains) + 64)
        base, spec, versions = run_vllm(e, target_dir, t.dtype, max_len, drafters, prompt_sets, tokenizer, stop,
                                        chains, journal, key)
    else:
        base, spec, versions = run_sglang(e, target_dir, t.trust_remote_code, drafters, prompt_sets,
                                          tokenizer, stop, out_dir, chains, journal, key)
    if journal.reused:
        print(f"[eval] {journal.reused} prompt decodes taken from {journal.path} (delete it to decode anew)",
              file=sys.stderr)
    rule = "sglang" if e.backend == "sglang" else "vllm"
    records = ev.per_prompt_records(base, spec, rule)
    with open(out_dir / "per_prompt.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    judged, comparisons = judging.judge(records, reference or "")
    rows = []
    for k in chains:
        for d in drafters:
            for name in prompt_sets:
                row = ev.summarize(spec[(d["name"], name, k)], base.get(name, []), rule)
                j = judged[(d["name"], name, k)]
                rows.append({"drafter": d["name"], "drafter_path": str(d["export"]), "prompts": name, "num_steps": k,
                             "aux_layers": d["aux_layers"], "engine_aux_layers": d.get("engine_aux_layers"), **row,
                             "draftable": ev.draftable(spec[(d["name"], name, k)], d["t2d"]),
                             "tau_ci95": j["tau_ci95"], "per_category": j["per_category"]})
                for m in row["mismatches"]:
                    print(f"MISMATCH {d['name']} / {name} / chain {k}: prompt {m['prompt_id']} turn {m['turn']} "
                          f"differs from the plain decode at token {m['first_diff']}", file=sys.stderr)
    settings = {"backend": e.backend, "target": t.name, "target_path": str(target_dir),
                "target_fingerprint": info.fingerprint, "prompts": list(e.prompts),
                "num_prompts": e.num_prompts, "max_new_tokens": e.max_new_tokens, "num_steps": e.num_steps,
                "chains": chains, "topk": e.topk, "num_draft_tokens": e.num_draft_tokens or e.num_steps + 1,
                "temperature": e.temperature, "batch_size": 1, "stop_token_ids": stop,
                "reference": reference or drafters[0]["name"],
                "timed": e.backend != "replay",
                "bootstrap": {"resamples": judging.RESAMPLES, "seed": judging.SEED, "level": judging.LEVEL,
                              "unit": "prompt"}}
    if e.draft_step_ms > 0 and e.baseline_tok_s:
        from eagle3.projection import markdown_section, project
        for r in rows:
            r["projected"] = project(r["accept_per_position"], e.draft_step_ms, e.baseline_tok_s, e.verify_factor)
        settings["projection"] = {"draft_step_ms": e.draft_step_ms, "verify_factor": e.verify_factor}
    paths = ev.write_report(out_dir, rows, settings, versions, e.baseline_tok_s, comparisons)
    if e.draft_step_ms > 0 and e.baseline_tok_s:
        with open(paths["md"], "a") as f:
            f.write(markdown_section(rows, e.draft_step_ms, e.baseline_tok_s, e.verify_factor))
    print(paths["md"].read_text())
    return paths


@hydra.main(version_base=None, config_path="conf", config_name="evaluate")
def main(cfg) -> None:
    evaluate(to_config(cfg))


if __name__ == "__main__":   # vLLM spawns worker processes: nothing may run on import
    main()
