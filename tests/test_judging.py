"""eagle3.judging: bootstrap intervals of tau (a ratio of sums over prompts), per-category tau and
the paired comparison, checked against hand-computed cases, a naive resampling loop and a
simulation whose true tau is known."""
import json

import numpy as np
import pytest

from eagle3 import judging


def rec(drafter, pid, drafts, accepted, category="", prompts="mt_bench", steps=3, **kw):
    return {"drafter": drafter, "prompts": prompts, "num_steps": steps, "prompt_id": pid, "category": category,
            "tau_rule": "vllm", "num_drafts": drafts, "num_accepted": accepted, "engine_tokens": 0, **kw}


def test_counts_follow_each_engines_rule():
    rs = [rec("a", "1", 4, 6, engine_tokens=11), rec("a", "2", 2, 1, engine_tokens=4)]
    num, den = judging.counts(rs, "vllm")
    assert num.tolist() == [10, 3] and den.tolist() == [4, 2]            # drafts + accepted
    assert judging.ratio(num, den) == pytest.approx(1 + 7 / 6)
    assert judging.counts(rs, "sglang")[0].tolist() == [11, 4]         # completion tokens


def test_paired_comparison_by_hand():
    # per-prompt tau: ref 1.5, 2.0, 1.25, 3.0, (no verify step); other 2.0, 2.0, 1.0, 3.5, 2.0
    ref = [rec("r", "1", 2, 1), rec("r", "2", 4, 4), rec("r", "3", 4, 1), rec("r", "4", 1, 2), rec("r", "5", 0, 0)]
    oth = [rec("o", "1", 2, 2), rec("o", "2", 2, 2), rec("o", "3", 4, 0), rec("o", "4", 2, 5), rec("o", "5", 1, 1)]
    c = judging.paired(judging.counts(ref, "vllm"), judging.counts(oth, "vllm"), resamples=2000)
    assert (c["wins"], c["losses"], c["ties"], c["num_paired"], c["num_prompts"]) == (2, 1, 1, 4, 5)
    assert c["sign_test_p"] == pytest.approx(1.0)                 # 2 of 3: P(X <= 1) x 2 = 2 x 4/8
    assert c["mean_diff"] == pytest.approx((0.5 + 0 - 0.25 + 0.5) / 4)
    assert c["per_prompt_diff"] == pytest.approx([0.5, 0.0, -0.25, 0.5])
    t_ref, t_oth = (11 + 8) / 11, (11 + 10) / 11                 # sum(drafts + accepted) / sum(drafts)
    assert c["tau_ratio"] == pytest.approx(t_oth / t_ref)
    lo, hi = c["mean_diff_ci95"]
    assert -0.25 <= lo <= c["mean_diff"] <= hi <= 0.5


def test_sign_test_by_hand():
    assert judging.sign_test(19, 0) == pytest.approx(2 / 2 ** 19)
    assert judging.sign_test(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert judging.sign_test(0, 0) == 1.0


def test_ratio_interval_matches_a_naive_loop():
    rng = np.random.default_rng(7)
    den = rng.integers(1, 60, 37).astype(float)
    num = den + rng.binomial(den.astype(int) * 3, 0.3)
    got = judging.ratio_interval(num, den, resamples=2500, seed=11)
    loop = np.random.default_rng(11)
    stats = []
    for _ in range(2500):
        idx = loop.integers(0, len(num), len(num))
        stats.append(sum(num[i] for i in idx) / sum(den[i] for i in idx))
    assert got == pytest.approx(list(np.percentile(stats, [2.5, 97.5])), rel=1e-12)


def test_interval_covers_the_true_tau_in_a_simulation():
    """Prompts with a random number of verify steps, each accepting Binomial(3, p_i) drafts, p_i
    varying by prompt: the true tau is E[n] / E[d]. A 95% interval should hold it about 95% of the time."""
    rng = np.random.default_rng(0)
    true_tau = 1 + 3 * 0.5            # p ~ Beta(2, 2) has mean 0.5, independent of the number of steps
    hits, trials = 0, 300
    for t in range(trials):
        den = rng.integers(10, 80, 80).astype(float)
        p = rng.beta(2, 2, 80)
        num = den + rng.binomial((den * 3).astype(int), p)
        lo, hi = judging.ratio_interval(num, den, resamples=1000, seed=t)
        hits += lo <= true_tau <= hi
    assert 0.88 <= hits / trials <= 0.99


def test_constant_difference_gives_a_zero_width_interval():
    ref = [rec("r", str(i), 2, a) for i, a in enumerate([0, 1, 2, 1, 0, 2])]
    oth = [rec("o", str(i), 2, a + 1) for i, a in enumerate([0, 1, 2, 1, 0, 2])]
    c = judging.paired(judging.counts(ref, "vllm"), judging.counts(oth, "vllm"))
    assert c["mean_diff"] == pytest.approx(0.5) and c["mean_diff_ci95"] == pytest.approx([0.5, 0.5])
    assert (c["wins"], c["losses"], c["ties"]) == (6, 0, 0)
    same = judging.paired(judging.counts(ref, "vllm"), judging.counts(ref, "vllm"))
    assert (same["ties"], same["mean_diff_ci95"], same["tau_ratio_ci95"]) == (6, [0.0, 0.0], [1.0, 1.0])


def test_judge_groups_by_category_chain_and_pairs_common_prompts():
    records = [rec("baseline", "1", 0, 0, "writing", steps=0)]
    for steps in (3, 7):
        records += [rec("a", "1", 4, 4, "writing", steps=steps), rec("a", "2", 2, 1, "writing", steps=steps),
                    rec("a", "3", 5, 0, "math", steps=steps),
                    rec("b", "1", 4, 8, "writing", steps=steps), rec("b", "3", 5, 5, "math", steps=steps)]
    summaries, comps = judging.judge(records, reference="b")
    assert list(summaries) == [("a", "mt_bench", 3), ("b", "mt_bench", 3), ("a", "mt_bench", 7), ("b", "mt_bench", 7)]
    a = summaries[("a", "mt_bench", 3)]
    assert a["tau"] == pytest.approx(1 + 5 / 11) and a["num_prompts"] == 3
    assert a["per_category"]["writing"]["tau"] == pytest.approx(1 + 5 / 6)
    assert a["per_category"]["math"] == {"tau": 1.0, "tau_ci95": [1.0, 1.0], "num_prompts": 1}
    assert [(c["num_steps"], c["reference"], c["drafter"]) for c in comps] == [(3, "b", "a"), (7, "b", "a")]
    c = comps[0]
    assert c["prompt_ids"] == ["1", "3"] and (c["wins"], c["losses"]) == (0, 2)      # prompt 2: b never ran it
    assert c["mean_diff"] == pytest.approx(((2 - 3) + (1 - 2)) / 2)
    assert c["tau_ratio"] == pytest.approx((1 + 4 / 9) / (1 + 13 / 9))


def test_cli_rejudges_old_per_prompt_files(tmp_path):
    """Records from before they carried num_steps, tau_rule and category: those come from the run's
    report.json and the MT-Bench file."""
    out = tmp_path / "ev"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"settings": {"backend": "vllm", "num_steps": 3}}))
    rows = [{"drafter": "baseline", "prompts": "mt_bench", "prompt_id": "81", "output_ids": [[1]],
             "num_drafts": 0, "num_accepted": 0, "engine_tokens": 0}]
    for d, acc in (("x", [3, 5, 1]), ("y", [4, 6, 2])):
        rows += [{"drafter": d, "prompts": "mt_bench", "prompt_id": pid, "output_ids": [[1]], "num_drafts": 4,
                  "num_accepted": a, "engine_tokens": 0} for pid, a in zip(("81", "91", "101"), acc)]
    (out / "per_prompt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    judging.main([str(out), "--out", str(tmp_path / "j")])
    rep = json.loads((tmp_path / "j" / "judging.json").read_text())
    assert [(r["drafter"], r["num_steps"]) for r in rep["results"]] == [("x", 3), ("y", 3)]
    assert list(rep["results"][0]["per_category"]) == ["writing", "roleplay", "reasoning"]
    c = rep["comparisons"][0]
    assert (c["reference"], c["drafter"], c["wins"], c["mean_diff"]) == ("x", "y", 3, pytest.approx(0.25))
    assert c["mean_diff_ci95"] == pytest.approx([0.25, 0.25])
    md = (tmp_path / "j" / "judging.md").read_text()
    assert "## Chain of 3 draft tokens" in md and "| y | x | mt_bench |" in md and "Warning" not in md
    for png in ("categories.png", "paired.png"):
        assert (tmp_path / "j" / png).read_bytes()[:4] == b"\x89PNG"


def test_cli_across_runs_renames_clashes_and_warns_on_different_settings(tmp_path):
    for name, max_new in (("a", 128), ("b", 256)):
        out = tmp_path / name
        out.mkdir()
        (out / "report.json").write_text(json.dumps({"settings": {"backend": "vllm", "max_new_tokens": max_new}}))
        (out / "per_prompt.jsonl").write_text("".join(json.dumps(rec("x", pid, 4, acc)) + "\n"
                                                      for pid, acc in (("81", 2), ("82", 3 if name == "a" else 4))))
    judging.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "j")])
    rep = json.loads((tmp_path / "j" / "judging.json").read_text())
    c = rep["comparisons"][0]
    assert (c["reference"], c["drafter"], c["wins"], c["ties"]) == ("x", f"{tmp_path}/b/x", 1, 1)
    md = (tmp_path / "j" / "judging.md").read_text()
    assert f"Warning: the runs differ in max_new_tokens: {tmp_path}/a 128, {tmp_path}/b 256" in md
