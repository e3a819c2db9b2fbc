"""Judging drafters on the same prompts: tau with a bootstrap interval, tau per MT-Bench category,
and a paired per-prompt comparison against a reference drafter.

    python -m eagle3.judging OUT_DIR [OUT_DIR ...] [--reference NAME] [--out DIR]

recomputes all of it from the per_prompt.jsonl files that evaluate.py wrote, without decoding again.

tau is a ratio of sums over prompts, T = sum_i n_i / sum_i d_i: d_i is the number of target
verify steps of prompt i that checked a draft, n_i the tokens they produced (vLLM rule:
n_i = d_i + accepted drafts; SGLang rule: n_i = completion tokens). The steps of one prompt are
not independent draws, the prompts are: intervals resample prompts with replacement and
recompute the ratio (percentile bootstrap, RESAMPLES resamples from SEED). A paired comparison
resamples the same prompts for both drafters, which removes the spread that comes from some
prompts being easier than others for every drafter.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

RESAMPLES, SEED, LEVEL = 10_000, 0, 0.95
_CHUNK = 1000            # resamples drawn at a time: bounds memory on large prompt sets


# ----------------------------------------------------------------------------------------------
# Statistics on per-prompt counts

def counts(records: Sequence[dict], tau_rule: str) -> Tuple[np.ndarray, np.ndarray]:
    """Per-prompt (tokens n_i, verify steps d_i) as float64 arrays, from per_prompt.jsonl records."""
    den = np.array([r["num_drafts"] for r in records], dtype=np.float64)
    if tau_rule == "sglang":
        num = np.array([r["engine_tokens"] for r in records], dtype=np.float64)
    else:
        num = den + np.array([r["num_accepted"] for r in records], dtype=np.float64)
    return num, den


def ratio(num: np.ndarray, den: np.ndarray) -> Optional[float]:
    d = float(np.sum(den))
    return float(np.sum(num)) / d if d else None


def resample_indices(n: int, resamples: int = RESAMPLES, seed: int = SEED) -> Iterable[np.ndarray]:
    """[chunk, n] index blocks; together they are the rows of one rng.integers(0, n, (resamples, n))."""
    rng = np.random.default_rng(seed)
    for start in range(0, resamples, _CHUNK):
        yield rng.integers(0, n, size=(min(_CHUNK, resamples - start), n))


def percentile_interval(values: np.ndarray, level: float = LEVEL) -> Optional[List[float]]:
    v = values[np.isfinite(values)]      # a resample whose prompts had no verify step has no ratio
    if not v.size:
        return None
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(v, [tail, 100 - tail])
    return [float(lo), float(hi)]


def ratio_interval(num: np.ndarray, den: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED,
                   level: float = LEVEL) -> Optional[List[float]]:
    """Bootstrap interval of sum(num) / sum(den), resampling prompts."""
    if not len(num) or not np.sum(den):
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        stats = np.concatenate([num[i].sum(1) / den[i].sum(1) for i in resample_indices(len(num), resamples, seed)])
    return percentile_interval(stats, level)


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the chance of a split at least this uneven if each prompt were a
    coin flip between the two drafters (ties left out)."""
    n, k = wins + losses, min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def paired(ref: Tuple[np.ndarray, np.ndarray], other: Tuple[np.ndarray, np.ndarray], resamples: int = RESAMPLES,
           seed: int = SEED, level: float = LEVEL, tie_tol: float = 1e-12) -> dict:
    """Two drafters on the same prompts (arrays aligned by prompt): other against ref.

    Per-prompt tau is n_i / d_i; a prompt without a verify step under either drafter has none and
    is left out of wins/losses/ties and the mean difference (it adds nothing to either ratio).
    mean_diff: mean over prompts of tau_other - tau_ref; tau_ratio: T_other / T_ref (ratios of sums).
    Both intervals resample the same prompt indices for the two drafters. sign_test_p: sign_test().
    """
    (rn, rd), (on, od) = ref, other
    ok = (rd > 0) & (od > 0)
    diff = on[ok] / od[ok] - rn[ok] / rd[ok]
    wins, losses = int((diff > tie_tol).sum()), int((diff < -tie_tol).sum())
    out = {"num_prompts": int(len(rd)), "num_paired": int(ok.sum()),
           "wins": wins, "losses": losses, "ties": int(diff.size) - wins - losses,
           "sign_test_p": sign_test(wins, losses),
           "mean_diff": float(diff.mean()) if diff.size else None, "mean_diff_ci95": None,
           "tau_ratio": None, "tau_ratio_ci95": None, "per_prompt_diff": [float(x) for x in diff]}
    if diff.size:
        means = np.concatenate([diff[i].mean(1) for i in resample_indices(diff.size, resamples, seed)])
        out["mean_diff_ci95"] = percentile_interval(means, level)
    t_ref, t_other = ratio(rn, rd), ratio(on, od)
    if t_ref and t_other is not None:
        out["tau_ratio"] = t_other / t_ref
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios = np.concatenate([(on[i].sum(1) / od[i].sum(1)) / (rn[i].sum(1) / rd[i].sum(1))
                                     for i in resample_indices(len(rd), resamples, seed)])
        out["tau_ratio_ci95"] = percentile_interval(ratios, level)
    return out


# ----------------------------------------------------------------------------------------------
# Per-prompt records -> per drafter x prompt set x chain: tau, interval, categories, comparisons

Key = Tuple[str, str, int]          # (drafter, prompt set, chain length)


def group(records: Iterable[dict]) -> Dict[Key, List[dict]]:
    """Drafted records by (drafter, prompts, num_steps), in the order they first appear."""
    out: Dict[Key, List[dict]] = {}
    for r in records:
        if r.get("drafter") != "baseline":
            out.setdefault((r["drafter"], r["prompts"], int(r["num_steps"])), []).append(r)
    return out


def summary(records: Sequence[dict], resamples: int = RESAMPLES, seed: int = SEED) -> dict:
    """tau, its interval and, when the prompts have categories, the same per category."""
    rule = records[0].get("tau_rule", "vllm") if records else "vllm"
    num, den = counts(records, rule)
    out = {"tau": ratio(num, den), "tau_ci95": ratio_interval(num, den, resamples, seed),
           "num_prompts": len(records), "per_category": {}}
    cats: Dict[str, List[int]] = {}
    for i, r in enumerate(records):
        if r.get("category"):
            cats.setdefault(r["category"], []).append(i)
    for cat, idx in cats.items():
        n, d = num[idx], den[idx]
        out["per_category"][cat] = {"tau": ratio(n, d), "tau_ci95": ratio_interval(n, d, resamples, seed),
                                    "num_prompts": len(idx)}
    return out


def judge(records: Iterable[dict], reference: str = "", resamples: int = RESAMPLES,
          seed: int = SEED) -> Tuple[Dict[Key, dict], List[dict]]:
    """-> ({(drafter, prompts, num_steps): summary}, comparisons).

    Within each prompt set and chain length, every drafter is compared with the reference (the
    drafter named `reference`, else the first one), on the prompt ids both decoded.
    """
    groups = group(records)
    summaries = {k: summary(v, resamples, seed) for k, v in groups.items()}
    comparisons = []
    for prompts, steps in dict.fromkeys((p, s) for _, p, s in groups):
        names = [d for d, p, s in groups if (p, s) == (prompts, steps)]
        ref = reference if reference in names else names[0]
        ref_recs = {r["prompt_id"]: r for r in groups[(ref, prompts, steps)]}
        rule = next(iter(ref_recs.values())).get("tau_rule", "vllm")
        for name in names:
            if name == ref:
                continue
            other = {r["prompt_id"]: r for r in groups[(name, prompts, steps)]}
            ids = [i for i in ref_recs if i in other]
            c = paired(counts([ref_recs[i] for i in ids], rule), counts([other[i] for i in ids], rule),
                       resamples, seed)
            c["prompt_ids"] = [i for i in ids if ref_recs[i]["num_drafts"] and other[i]["num_drafts"]]
            comparisons.append({"prompts": prompts, "num_steps": steps, "reference": ref, "drafter": name,
                                "reference_tau": summaries[(ref, prompts, steps)]["tau"],
                                "tau": summaries[(name, prompts, steps)]["tau"], **c})
    return summaries, comparisons


# ----------------------------------------------------------------------------------------------
# Markdown sections (report.md and this module's own report)

def _ci(x, ci, fmt="{:.2f}") -> str:
    if x is None:
        return "-"
    return fmt.format(x) + (f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else "")


def category_table(summaries: Dict[Key, dict], num_steps: int) -> List[str]:
    keys = [k for k in summaries if k[2] == num_steps and summaries[k]["per_category"]]
    cats = list(dict.fromkeys(c for k in keys for c in summaries[k]["per_category"]))
    if not keys:
        return []
    lines = ["tau per MT-Bench category [95% bootstrap interval over the category's prompts]:", "",
             "| drafter | prompts | " + " | ".join(cats) + " |", "|" + "---|" * (2 + len(cats))]
    for k in keys:
        pc = summaries[k]["per_category"]
        cells = [_ci(pc[c]["tau"], pc[c]["tau_ci95"]) + f" (n={pc[c]['num_prompts']})" if c in pc else "-"
                 for c in cats]
        lines.append(f"| {k[0]} | {k[1]} | " + " | ".join(cells) + " |")
    return lines + [""]


def comparison_table(comparisons: Sequence[dict], num_steps: int) -> List[str]:
    rows = [c for c in comparisons if c["num_steps"] == num_steps]
    if not rows:
        return []
    lines = ["Paired against the reference drafter on the same prompts (per-prompt tau = tokens / verify "
             "steps of that prompt; 95% paired bootstrap intervals over prompts):", "",
             "| drafter | reference | prompts | tau vs reference | wins / losses / ties | sign test p | "
             "mean per-prompt difference | tau ratio |", "|" + "---|" * 8]
    for c in rows:
        lines.append(f"| {c['drafter']} | {c['reference']} | {c['prompts']} | "
                     f"{_ci(c['tau'], None)} vs {_ci(c['reference_tau'], None)} | "
                     f"{c['wins']} / {c['losses']} / {c['ties']} | {c['sign_test_p']:.2g} | "
                     f"{_ci(c['mean_diff'], c['mean_diff_ci95'], '{:+.3f}')} | "
                     f"{_ci(c['tau_ratio'], c['tau_ratio_ci95'], '{:.3f}')} |")
    return lines + [""]


# ----------------------------------------------------------------------------------------------
# python -m eagle3.judging OUT_DIR...: the same judgement from existing evaluation directories

COMPARABLE = ("backend", "target_fingerprint", "max_new_tokens", "topk", "temperature", "stop_token_ids")


def load_settings(out_dir: Path) -> dict:
    path = Path(out_dir) / "report.json"
    return json.loads(path.read_text()).get("settings", {}) if path.exists() else {}


def load_per_prompt(out_dir: Path) -> List[dict]:
    """per_prompt.jsonl of one evaluate.py run. Records written before they carried num_steps,
    tau_rule and category get them from the run's report.json and the MT-Bench file."""
    out_dir = Path(out_dir)
    path = out_dir / "per_prompt.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {out_dir} an evaluate.py output directory?")
    settings = load_settings(out_dir)
    rule = "sglang" if settings.get("backend") == "sglang" else "vllm"
    cats = None
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        r.pop("output_ids", None)
        r.setdefault("num_steps", 0 if r["drafter"] == "baseline" else settings.get("num_steps", 0))
        r.setdefault("tau_rule", rule)
        if "category" not in r:
            if cats is None:
                cats = _mt_bench_categories()
            r["category"] = cats.get(str(r["prompt_id"]), "") if r["prompts"].startswith("mt_bench") else ""
        records.append(r)
    return records


def mt_bench_file() -> Path:
    """The 80 MT-Bench questions shipped in data/ (Apache-2.0, from FastChat); EAGLE3_MT_BENCH overrides."""
    return Path(os.environ.get("EAGLE3_MT_BENCH", Path(__file__).resolve().parent.parent / "data" / "mt_bench_questions.jsonl"))


def _mt_bench_categories() -> Dict[str, str]:
    path = mt_bench_file()
    if not path.exists():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {str(r["question_id"]): r.get("category", "") for r in recs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Compare drafters from evaluate.py's per_prompt.jsonl files.")
    p.add_argument("out_dirs", nargs="+", type=Path, help="evaluate.py output directories (eval.out_dir)")
    p.add_argument("--reference", default="", help="drafter to compare against (default: the first)")
    p.add_argument("--out", type=Path, default=Path("judging"), help="where judging.json/.md and plots go")
    a = p.parse_args(argv)
    records, notes = [], []
    settings = [load_settings(d) for d in a.out_dirs]
    for key in COMPARABLE:
        if len({json.dumps(s.get(key)) for s in settings}) > 1:
            values = ", ".join(f"{d} {s.get(key)}" for d, s in zip(a.out_dirs, settings))
            notes.append(f"the runs differ in {key}: {values}")
    for n in notes:
        print(f"WARNING: {n}", file=sys.stderr)
    for d in a.out_dirs:
        recs = load_per_prompt(d)
        taken = {r["drafter"] for r in records}
        if taken & {r["drafter"] for r in recs if r["drafter"] != "baseline"}:   # same name in two runs
            for r in recs:
                r["drafter"] = f"{d}/{r['drafter']}"
        records += recs
    summaries, comparisons = judge(records, a.reference)
    a.out.mkdir(parents=True, exist_ok=True)
    results = [{"drafter": k[0], "prompts": k[1], "num_steps": k[2], **v} for k, v in summaries.items()]
    (a.out / "judging.json").write_text(json.dumps({"results": results, "comparisons": comparisons}, indent=2) + "\n")
    from eagle3 import plots
    pngs = [plots.plot_categories(results, a.out / "categories.png"),
            plots.plot_paired(comparisons, a.out / "paired.png")]
    lines = [f"# Drafters compared from {', '.join(str(d) for d in a.out_dirs)}", ""]
    lines += [f"Warning: {n}; their tau are not comparable." for n in notes] + ([""] if notes else [])
    for steps in sorted({k[2] for k in summaries}):
        lines += [f"## Chain of {steps} draft tokens", "", "| drafter | prompts | tau [95% CI] | n prompts |",
                  "|---|---|---|---|"]
        lines += [f"| {k[0]} | {k[1]} | {_ci(v['tau'], v['tau_ci95'])} | {v['num_prompts']} |"
                  for k, v in summaries.items() if k[2] == steps] + [""]
        lines += category_table(summaries, steps) + comparison_table(comparisons, steps)
    lines += ["Figures: " + ", ".join(f"[{p.name}]({p.name})" for p in pngs if p)]
    (a.out / "judging.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
