"""Evaluation pieces every backend shares: prompt sets, the drafter/target fit check, the
engines' acceptance counters turned into one record, per_prompt.jsonl records, report.json and
report.md (the statistics are eagle3/judging.py's, the figures eagle3/plots.py's).

The decode loops themselves live in eagle3/specdec.py (`hf`) and evaluate.py (`vllm`, `sglang`);
they all hand back `DecodeStats` per prompt, so tau is summed the same way whatever ran it.
"""
from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from eagle3 import judging
from eagle3.judging import mt_bench_file

BUILTIN_PROMPT_SETS = ("mt_bench", "mt_bench_2turn", "sharegpt_heldout")


# ----------------------------------------------------------------------------------------------
# Prompt sets

@dataclass
class Prompt:
    id: str
    messages: List[dict]                                  # the conversation up to its first user turn
    followups: List[str] = field(default_factory=list)    # later user turns, each sent after the model's own answer
    category: str = ""                                    # MT-Bench category (writing, coding, ...); "" when the set has none


def prompt_set_name(spec: str) -> str:
    return spec if spec in BUILTIN_PROMPT_SETS else Path(spec).stem


def load_prompts(spec: str, num_prompts: int, data_source: str = "sharegpt", data_path: str = "",
                 heldout_fraction: float = 0.02, data_mix: Sequence = ()) -> List[Prompt]:
    """The first `num_prompts` prompts (0 = all) of a prompt set, in file order.

    spec: mt_bench (first turns) | mt_bench_2turn (both turns) | sharegpt_heldout (first user turns
    of conversations in the held-out split of the training data: data.mix, or `data_source` when
    the mix is empty, which training never sees, whatever its num_samples; conversation ids as
    eagle3.data gives them) | a .jsonl path: MT-Bench records ({"turns": [...]}) or conversations
    (messages or ShareGPT shape, read by eagle3.data), the latter cut after the first user turn.
    Render them with eagle3.chat.render_prompt, as regeneration and the training data do.
    """
    if spec in ("mt_bench", "mt_bench_2turn"):
        return _mt_bench(mt_bench_file(), num_prompts, two_turns=spec == "mt_bench_2turn")
    if spec == "sharegpt_heldout":
        return _conversations(data_source, data_path, num_prompts, heldout_fraction, data_mix)
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"prompt set {spec!r}: expected one of {', '.join(BUILTIN_PROMPT_SETS)} "
                                "or an existing .jsonl file")
    with path.open() as f:
        first = next((json.loads(line) for line in f if line.strip()), {})
    if "turns" in first:
        return _mt_bench(path, num_prompts, two_turns=True)
    return _conversations("jsonl", str(path), num_prompts, None)


def _mt_bench(path: Path, num_prompts: int, two_turns: bool) -> List[Prompt]:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (MT-Bench questions; set EAGLE3_MT_BENCH to its path)")
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        turns = rec["turns"]
        pid = str(rec.get("question_id", len(prompts)))
        prompts.append(Prompt(pid, [{"role": "user", "content": turns[0]}],
                              list(turns[1:]) if two_turns else [], str(rec.get("category", ""))))
        if num_prompts and len(prompts) == num_prompts:
            break
    return prompts


def _conversations(source: str, path: str, num_prompts: int, heldout_fraction: Optional[float],
                   mix: Sequence = ()) -> List[Prompt]:
    """First user turn (with any system message before it) of each conversation of the mix
    (eagle3.data.mix_sources(mix, source, path); each conversation once, whatever its weight, and
    a file named twice, at two temperatures, read once: its first turns are the same)."""
    from eagle3 import data
    from eagle3.chat import conversation_problem
    sources = []
    for s in data.mix_sources(mix, source, path):
        if all((s.source, s.path) != (o.source, o.path) for o in sources):
            sources.append(s)
    prompts = []
    for src, (cid, messages) in ((s, c) for s in sources for c in data.iter_conversations(s.source, s.path)):
        cid = src.conversation_id(cid)
        if heldout_fraction is not None and not data.is_heldout(cid, heldout_fraction, [src.name]):
            continue
        first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                          None) if isinstance(messages, list) else None
        prompt = messages[:first_user + 1] if first_user is not None else messages
        if conversation_problem(prompt, needs="user") or not prompt[-1]["content"].strip():
            continue                                   # a bad record (eagle3.data counts those)
        prompts.append(Prompt(str(cid), [dict(m) for m in prompt]))
        if num_prompts and len(prompts) == num_prompts:
            break
    if not prompts:
        where = ", ".join(s.label for s in sources)
        raise ValueError(f"no usable prompts in {where} (held-out split: {heldout_fraction})")
    return prompts


# ----------------------------------------------------------------------------------------------
# Does a drafter fit the target? Checked before any engine starts.

class DrafterMismatch(ValueError):
    pass


def check_drafter_fits(export_config: dict, target_info, tensors: Optional[Dict] = None,
                       engine: str = "vllm", where: str = "drafter") -> List[int]:
    """Refuse a drafter that cannot work with the target, naming every mismatch.

    export_config: the export's config.json; target_info: eagle3.targets.TargetInfo (hidden_size,
    vocab_size, num_layers, architectures); tensors: the export's safetensors (shapes of fc, d2t, t2d).
    Returns the aux layers in this project's meaning (entering layer i).
    """
    from eagle3.engine_ids import engine_aux_ids
    errors = []
    V, Ht, L = int(target_info.vocab_size), int(target_info.hidden_size), int(target_info.num_layers)
    if int(export_config.get("vocab_size", V)) != V:
        errors.append(f"vocab_size {export_config.get('vocab_size')} != target vocab {V}")
    if int(export_config.get("target_hidden_size", -1)) != Ht:
        errors.append(f"target_hidden_size {export_config.get('target_hidden_size')} != target hidden size {Ht}")
    # The drafter embeds tokens with the target's own embedding table, so its width must match too.
    if int(export_config.get("hidden_size", -1)) != Ht:
        errors.append(f"hidden_size {export_config.get('hidden_size')} != target hidden size {Ht} "
                      "(the drafter shares the target's embedding)")
    ids = list((export_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
               or export_config.get("eagle_aux_hidden_state_layer_ids") or [])
    record = (export_config.get("eagle3") or {}).get("aux_layers")
    aux = [int(i) for i in (record if record else ids)]
    if not ids:
        errors.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing")
    if aux and not all(1 <= i < L for i in aux):
        errors.append(f"aux layers {aux} out of range for a {L}-layer target (valid: 1..{L - 1})")
    if record and ids:
        try:
            want = engine_aux_ids(record, engine, list(target_info.architectures))
        except ValueError as e:   # an architecture whose ids were never checked: nothing to compare
            errors.append(str(e))
            want = [int(i) for i in ids]
        if want != [int(i) for i in ids]:
            errors.append(f"eagle_aux_hidden_state_layer_ids {ids} are not the {engine} ids of aux layers "
                          f"{list(record)} for a {'/'.join(target_info.architectures)} target (expected {want}): "
                          f"an export for another engine?")
    if tensors is not None:
        errors += _check_tensors(export_config, tensors, V, Ht, len(aux))
    if errors:
        raise DrafterMismatch(f"{where} does not fit target {getattr(target_info, 'name', '')!s}:\n  - "
                              + "\n  - ".join(errors))
    return aux


def expected_tensor_names(cfg: dict) -> set:
    """The tensor names an export with this config.json must hold, no more and no fewer: the
    drafter's parameters under their engine names (fc_norm.{i} only when the config says fc_norm),
    without embed_tokens (the engines use the target's), plus the draft vocab map d2t and t2d."""
    import torch

    from eagle3.model import Eagle3Drafter
    from eagle3.shape import DrafterShape
    with torch.device("meta"):                     # names only: the meta device allocates nothing
        m = Eagle3Drafter(DrafterShape.from_hf_config(cfg))
    names = set(m.to_engine_names(dict(m.named_parameters())))
    return {n for n in names if not n.startswith("embed_tokens.")} | {"d2t", "t2d"}


def _check_tensor_names(cfg: dict, tensors: Dict) -> List[str]:
    """Engines load by name: they skip a tensor they have no module for and leave a module without
    its tensor at its initial values, so a wrong set would serve a different drafter, silently."""
    try:
        want = expected_tensor_names(cfg)
    except (KeyError, ValueError) as e:            # a config the drafter cannot be built from
        return [f"config.json does not describe a drafter this project builds: {e}"]
    missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
    if not missing and not extra:
        return []
    norm = f"fc_norm={bool(cfg.get('fc_norm') or cfg.get('use_aux_norm'))}"
    return [f"tensors do not match the drafter config.json describes ({norm}): missing {missing or 'none'}, "
            f"extra {extra or 'none'}; export the run again (python -m eagle3.export RUN_DIR) rather than "
            "editing the files"]


def _check_tensors(cfg: dict, tensors: Dict, V: int, Ht: int, k: int) -> List[str]:
    errors = _check_tensor_names(cfg, tensors)
    fc = tensors.get("fc.weight")
    if fc is None:
        errors.append("fc.weight is missing")
    elif fc.shape[1] != k * Ht:
        errors.append(f"fc.weight takes {fc.shape[1]} inputs but {k} aux layers x hidden {Ht} = {k * Ht}"
                      + (f" (that is {fc.shape[1] / Ht:g} aux layers)" if fc.shape[1] % Ht == 0 else ""))
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    Vd = int(cfg.get("draft_vocab_size", -1))
    if d2t is None or t2d is None:
        errors.append("d2t / t2d (draft vocab map) missing")
        return errors
    if t2d.numel() != V:
        errors.append(f"t2d has {t2d.numel()} entries, target vocab is {V}")
    if d2t.numel() != Vd:
        errors.append(f"d2t has {d2t.numel()} entries, draft_vocab_size is {Vd}")
    lm = tensors.get("lm_head.weight")
    if lm is not None and lm.shape[0] != d2t.numel():
        errors.append(f"lm_head.weight has {lm.shape[0]} rows, d2t has {d2t.numel()}")
    import torch
    target_ids = d2t.long() + torch.arange(d2t.numel())
    if d2t.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= V):
        errors.append(f"d2t maps draft ids to target ids {int(target_ids.min())}..{int(target_ids.max())}, "
                      f"outside the target vocab 0..{V - 1}")
    elif t2d.numel() == V and not bool(t2d.bool()[target_ids].all()):
        errors.append("d2t and t2d disagree (a draft token's target id is not marked in t2d)")
    return errors


# ----------------------------------------------------------------------------------------------
# Per-prompt counters and their sums

@dataclass
class DecodeStats:
    """One prompt (all its turns) under one configuration. Engines' own counters, not estimates."""
    prompt_id: str
    output_ids: List[List[int]]        # per turn, stop token included when one was produced
    seconds: float                     # wall time of the decode calls
    num_drafts: int = 0                # verify steps that checked a draft chain (vLLM num_drafts, SGLang spec_verify_ct)
    num_draft_tokens: int = 0
    num_accepted: int = 0              # accepted draft tokens, bonus tokens not included
    accepted_per_pos: List[int] = field(default_factory=list)   # [k]: verify steps whose draft j was accepted
    engine_tokens: int = 0             # SGLang: completion_tokens as it counted them (its tau numerator)
    category: str = ""                 # the prompt's category, so comparisons can be regrouped from per_prompt.jsonl

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.output_ids)


def summarize(spec: Sequence[DecodeStats], base: Sequence[DecodeStats], tau_rule: str) -> dict:
    """Sum the counters of one drafter x prompt set.

    tau_rule "vllm": 1 + accepted / drafts (vLLM's metric; the hf backend counts the same way).
    tau_rule "sglang": completion_tokens / spec_verify_ct, which also counts the token the prefill
    produces, so it is a little higher than the vLLM rule on short outputs.
    """
    drafts = sum(s.num_drafts for s in spec)
    accepted = sum(s.num_accepted for s in spec)
    k = max((len(s.accepted_per_pos) for s in spec), default=0)
    per_pos = [sum(s.accepted_per_pos[j] for s in spec if j < len(s.accepted_per_pos)) for j in range(k)]
    tokens, secs = sum(s.new_tokens for s in spec), sum(s.seconds for s in spec)
    btokens, bsecs = sum(s.new_tokens for s in base), sum(s.seconds for s in base)
    if tau_rule == "sglang":
        tau = sum(s.engine_tokens for s in spec) / drafts if drafts else None
    else:
        tau = 1 + accepted / drafts if drafts else None
    tok_s = tokens / secs if secs else None
    base_tok_s = btokens / bsecs if bsecs else None
    return {
        "tau": tau, "tau_rule": tau_rule,
        "accept_per_position": [p / drafts for p in per_pos] if drafts else [0.0] * k,
        "num_drafts": drafts, "num_draft_tokens": sum(s.num_draft_tokens for s in spec),
        "num_accepted": accepted, "new_tokens": tokens, "seconds": secs,
        "tok_s": tok_s, "baseline_tok_s": base_tok_s, "baseline_new_tokens": btokens,
        "speedup": tok_s / base_tok_s if tok_s and base_tok_s else None,
        "num_prompts": len(spec),
        "mismatches": find_mismatches(spec, base),
    }


def draftable(spec: Sequence[DecodeStats], t2d=None) -> float:
    """The share of the output tokens a drafter could have drafted: those inside its draft vocab
    (t2d [V] bool; None: the whole vocab), each turn's first token left out (the prefill makes it).
    Position j of a chain is accepted at most this often; a drafter cut to a vocab fitted on other
    text loses here before it drafts anything."""
    toks = [t for s in spec for turn in s.output_ids for t in turn[1:]]
    if not toks:
        return 0.0
    if t2d is None:
        return 1.0
    inside = [t for t in toks if 0 <= t < len(t2d) and bool(t2d[t])]
    return len(inside) / len(toks)


def find_mismatches(spec: Sequence[DecodeStats], base: Sequence[DecodeStats]) -> List[dict]:
    """Prompts whose speculative output differs from the plain decode (greedy must be identical)."""
    by_id = {b.prompt_id: b for b in base}
    out = []
    for s in spec:
        b = by_id.get(s.prompt_id)
        if b is None:
            continue
        for turn, (x, y) in enumerate(zip(s.output_ids, b.output_ids)):
            if x != y:
                first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                out.append({"prompt_id": s.prompt_id, "turn": turn, "first_diff": first,
                            "spec_len": len(x), "baseline_len": len(y)})
                break
    return out


# ----------------------------------------------------------------------------------------------
# Engine responses -> DecodeStats counters

VLLM_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def vllm_counters(metrics) -> dict:
    """llm.get_metrics() -> {drafts, draft_tokens, accepted, per_pos: [k]} (cumulative per LLM)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    keys = dict(zip(VLLM_METRICS, ("drafts", "draft_tokens", "accepted", "per_pos")))
    for m in metrics:   # one entry per label set (engine index): sum them
        key = keys.get(getattr(m, "name", None))
        if key == "per_pos":
            vals = [int(v) for v in m.values]
            pad = out["per_pos"] + [0] * (len(vals) - len(out["per_pos"]))
            out["per_pos"] = [a + (vals[j] if j < len(vals) else 0) for j, a in enumerate(pad)]
        elif key is not None:
            out[key] += int(m.value)
    return out


def vllm_delta(before: dict, after: dict) -> dict:
    per_pos = [a - (before["per_pos"][j] if j < len(before["per_pos"]) else 0)
               for j, a in enumerate(after["per_pos"])]
    return {"drafts": after["drafts"] - before["drafts"],
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"], "per_pos": per_pos}


def sglang_counters(response: dict, num_steps: int) -> dict:
    """One /generate response (SGLang 0.5.23, non-streaming) -> counters of that request.

    meta_info carries completion_tokens always and, when speculative decoding ran and verified at
    least once, spec_verify_ct, spec_num_correct_drafts and spec_correct_drafts_histogram
    (histogram[m] = verify steps that accepted m drafts). Draft position j (1-based) was accepted
    in every step that accepted >= j drafts.
    """
    meta = response["meta_info"]
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise RuntimeError(f"SGLang aborted request {meta.get('id')}: {finish.get('message')}")
    verify = int(meta.get("spec_verify_ct", 0))
    hist = list(meta.get("spec_correct_drafts_histogram") or [])
    per_pos = [sum(hist[m] for m in range(j, len(hist))) for j in range(1, num_steps + 1)]
    return {"output_ids": list(response.get("output_ids", [])),
            "completion_tokens": int(meta["completion_tokens"]),
            "drafts": verify, "accepted": int(meta.get("spec_num_correct_drafts", 0)),
            "draft_tokens": int(meta.get("spec_num_proposed_drafts", 0)), "per_pos": per_pos,
            "finish_reason": finish}


# ----------------------------------------------------------------------------------------------
# The host CPU: vLLM's CPU kernels (attention and oneDNN's GEMMs) take a different path on AMX,
# AVX-512 and AVX2, so bf16 rounding, greedy text and tau differ between hosts with different
# instruction sets, while repeated runs on one host agree token for token.

CPU_ISAS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"), ("avx2", "AVX2"))


def cpu_isa(flags) -> str:
    """The widest matrix instruction set in /proc/cpuinfo's flags, as vLLM's CPU kernels choose."""
    flags = set(flags)
    return next((name for flag, name in CPU_ISAS if flag in flags), platform.machine() or "unknown")


def host_cpu(cpuinfo: Optional[str] = None) -> dict:
    """{"model": CPU model name, "isa": cpu_isa(flags)} of this host (Linux's /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return {"model": fields.get("model name") or platform.processor() or "unknown",
            "isa": cpu_isa(fields.get("flags", "").split())}


# ----------------------------------------------------------------------------------------------
# report.json and report.md (the figures are eagle3/plots.py's)

def write_report(out_dir: Path, rows: List[dict], settings: dict, versions: dict,
                 production_baseline_tok_s: Optional[float] = None,
                 comparisons: Sequence[dict] = ()) -> Dict[str, Path]:
    """rows: one dict per drafter x prompt set x chain (summarize() plus "drafter", "drafter_path",
    "prompts", "num_steps", and judging's "tau_ci95" and "per_category"); comparisons: judging's."""
    from eagle3 import plots
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"num_steps": settings.get("num_steps"), **r} for r in rows]
    report = {"settings": settings, "versions": versions,
              "production_baseline_tok_s": production_baseline_tok_s, "results": rows,
              "comparisons": list(comparisons)}
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["tau_png"] = plots.plot_tau(rows, out_dir / "tau.png", settings)
    paths["accept_png"] = plots.plot_acceptance(rows, out_dir / "acceptance.png", settings)
    for key, png in (("categories_png", plots.plot_categories(rows, out_dir / "categories.png")),
                     ("paired_png", plots.plot_paired(comparisons, out_dir / "paired.png"))):
        if png is not None:
            paths[key] = png
    figures = [p for k, p in paths.items() if k.endswith("_png")]
    paths["md"].write_text(markdown_report(rows, settings, production_baseline_tok_s, comparisons, figures,
                                           versions.get("host_cpu")))
    return paths


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown_report(rows: Sequence[dict], settings: dict, production_baseline_tok_s=None,
                    comparisons: Sequence[dict] = (), figures: Sequence[Path] = (),
                    host_cpu: Optional[dict] = None) -> str:
    """The settings (and the host CPU where the decoding ran on it), then one section per chain
    length: the table, tau per category, the paired comparison; then the figures."""
    s = settings
    lines = [f"# Drafter evaluation ({s.get('backend')}, target {s.get('target')})", "",
             f"greedy, topk {s.get('topk')}, max {s.get('max_new_tokens')} new tokens, batch 1, prompts: "
             + ", ".join(f"{p} {n}" for p, n in dict.fromkeys((r["prompts"], r.get("num_prompts")) for r in rows))
             + ". tau = tokens per target verify step "
             f"incl. the bonus token ({rows[0]['tau_rule'] if rows else ''} rule); [a, b] = 95% bootstrap "
             f"interval over prompts. draftable = share of the output tokens inside the drafter's draft vocab "
             f"(no chain position is accepted more often).", ""]
    if host_cpu:
        lines += [f"Decoded on the host CPU: {host_cpu['model']} ({host_cpu['isa']}). Greedy text, and so tau, "
                  f"repeats exactly on hosts with the same instruction set; compare drafters inside one run.", ""]
    prod = " | production baseline tok/s" if production_baseline_tok_s else ""
    by_key = {(r["drafter"], r["prompts"], r["num_steps"]): r for r in rows}
    for steps in dict.fromkeys(r["num_steps"] for r in rows):
        lines += [f"## Chain of {steps} draft tokens (tau at most {steps + 1})", "",
                  "| drafter | prompts | tau | accept per position | draftable | drafts | accepted | tok/s | "
                  f"baseline tok/s{prod} | speedup | mismatches |",
                  "|" + "---|" * (11 + bool(production_baseline_tok_s))]
        for r in rows:
            if r["num_steps"] != steps:
                continue
            acc = " / ".join(f"{a:.3f}" for a in r["accept_per_position"])
            prod = f" | {production_baseline_tok_s:g}" if production_baseline_tok_s else ""
            mism = ", ".join(f"{m['prompt_id']}@{m['first_diff']}" for m in r["mismatches"]) or "0"
            tau = _f(r["tau"]) + (f" [{r['tau_ci95'][0]:.2f}, {r['tau_ci95'][1]:.2f}]" if r.get("tau_ci95") else "")
            lines.append(f"| {r['drafter']} | {r['prompts']} | {tau} | {acc} | {_f(r.get('draftable'), '{:.1%}')} | "
                         f"{r['num_drafts']} | "
                         f"{r['num_accepted']} | {_f(r['tok_s'], '{:.1f}')} | {_f(r['baseline_tok_s'], '{:.1f}')}"
                         f"{prod} | {_f(r['speedup'], '{:.2f}x')} | {mism} |")
        lines.append("")
        lines += judging.category_table(by_key, steps) + judging.comparison_table(comparisons, steps)
    if figures:
        lines += ["Figures: " + ", ".join(f"[{Path(p).name}]({Path(p).name})" for p in figures), ""]
    return "\n".join(lines)


def per_prompt_records(base: Dict[str, List[DecodeStats]], spec: Dict[tuple, List[DecodeStats]],
                       tau_rule: str) -> List[dict]:
    """per_prompt.jsonl: one record per prompt of the baseline (num_steps 0) and of every drafter x
    prompt set x chain (spec keys), with the prompt's id and category and the engine's counters."""
    items = [(("baseline", p, 0), st) for p, st in base.items()] + list(spec.items())
    return [{"drafter": d, "prompts": p, "num_steps": k, "tau_rule": tau_rule, **r}
            for (d, p, k), st in items for r in stats_to_json(st)]


def stats_to_json(stats: Sequence[DecodeStats]) -> List[dict]:
    return [asdict(s) for s in stats]


def engine_aux_layers(model) -> list | None:
    """Runs inside vLLM's worker (LLM.apply_model; importable there by reference): the layer ids whose entering residual stream the
    target hands the drafter (vLLM's `aux_hidden_state_layers`, this project's aux_layers meaning)."""
    for m in model.modules():
        layers = getattr(m, "aux_hidden_state_layers", None)
        if layers:
            return [int(i) for i in layers]
    return None
