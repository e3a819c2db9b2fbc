"""Every plot the project draws: training curves from metrics.jsonl (one run at the end of
training, or several overlaid) and the evaluation figures of report.md (tau, acceptance per
position, tau per MT-Bench category, paired per-prompt differences).

    python -m eagle3.plots runs/a runs/b [--out compare.png]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def read_metrics(run_dir: Path) -> List[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a training run directory?")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    return rows


def _series(rows: Sequence[dict], split: str, key: str, index: int | None = None):
    xs, ys = [], []
    for r in rows:
        if r.get("split") != split or key not in r:
            continue
        v = r[key]
        if index is not None:
            if index >= len(v):
                continue
            v = v[index]
        xs.append(r["step"])
        ys.append(v)
    return xs, ys


def plot_runs(run_dirs: Sequence[Path], out: Path, labels: Sequence[str] | None = None) -> Path:
    """Loss (train, held-out), per-TTT-step accuracy (train dashed, held-out solid) and, for runs
    that log it, tau3: 1 + the engine-style chain acceptance of the first 3 draft positions, the
    training-side estimate of tau at a chain of 3 (eagle3.loss)."""
    runs: Dict[str, List[dict]] = {}
    for i, d in enumerate(run_dirs):
        runs[labels[i] if labels else Path(d).name or str(d)] = read_metrics(Path(d))
    n_steps = max((len(r["acc"]) for rows in runs.values() for r in rows if "acc" in r), default=1)
    with_tau = any("tau3" in r for rows in runs.values() for r in rows)
    fig, axes = plt.subplots(1, 3 if with_tau else 2, figsize=(19 if with_tau else 13, 4.8))
    ax_loss, ax_acc = axes[0], axes[1]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    many = len(runs) > 1
    for ri, (name, rows) in enumerate(runs.items()):
        c = colors[ri % len(colors)]
        for split, style in (("train", "-"), ("heldout", "--")):
            xs, ys = _series(rows, split, "loss")
            if xs:
                ax_loss.plot(xs, ys, style, color=c, label=f"{name} {split}", alpha=0.6 if split == "train" else 1)
        for s in range(n_steps):
            # several runs: one color per run, only steps 0 and last; one run: one color per step
            if many and s not in (0, n_steps - 1):
                continue
            cs = c if many else colors[s % len(colors)]
            for split, style in (("heldout", "-"), ("train", ":")):
                xs, ys = _series(rows, split, "acc", s)
                if xs:
                    ax_acc.plot(xs, ys, style, color=cs, alpha=0.5 if split == "train" else 1,
                                label=f"{name + ' ' if many else ''}step {s} {split}")
        if with_tau:
            for split, style in (("heldout", "-"), ("train", ":")):
                xs, ys = _series(rows, split, "tau3")
                if xs:
                    axes[2].plot(xs, ys, style, color=c, alpha=0.5 if split == "train" else 1,
                                 label=f"{name + ' ' if many else ''}{split} (last {ys[-1]:.2f})")
        uni = [r["unigram_acc"] for r in rows if r.get("split") == "heldout" and r.get("unigram_acc") is not None]
        if uni:   # what drafting the most frequent token always would score
            ax_acc.axhline(uni[-1], color=c if many else "gray", ls="-.", lw=1,
                           label=f"{name + ' ' if many else ''}unigram baseline {uni[-1]:.3f}")
    ax_loss.set(title="TTT loss", xlabel="optimizer step", ylabel="loss (weighted soft CE)")
    ax_acc.set(title="draft accuracy per TTT step (argmax == target argmax)", xlabel="optimizer step",
               ylabel="accuracy", ylim=(0, 1))
    if with_tau:
        axes[2].set(title="expected tau, chain of 3 (1 + chain acceptance)",
                    xlabel="optimizer step", ylabel="tau3", ylim=(1, 4))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ----------------------------------------------------------------------------------------------
# Evaluation figures. rows: report.json's results (drafter, prompts, num_steps, tau, tau_ci95,
# accept_per_position, per_category); comparisons: report.json's comparisons.

def _chains(rows: Sequence[dict]) -> List[int]:
    return list(dict.fromkeys(r.get("num_steps") for r in rows))


def _panels(items: Sequence[dict]) -> List[tuple]:
    """(prompt set, chain) pairs in order of appearance: one panel each."""
    return list(dict.fromkeys((r["prompts"], r.get("num_steps")) for r in items))


def _yerr(values: Sequence[float], cis: Sequence) -> List[List[float]]:
    return [[v - c[0] if c else 0 for v, c in zip(values, cis)], [c[1] - v if c else 0 for v, c in zip(values, cis)]]


def _finish(fig, axes, out: Path, legend: bool = True) -> Path:
    for ax in axes:
        if legend:
            ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def plot_tau(rows: Sequence[dict], out: Path, settings: dict) -> Path:
    """Grouped bars: tau per prompt set and chain length (groups) and drafter (bars), with the 95%
    bootstrap interval over prompts as error bars and the value written on each bar."""
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    groups = _panels(rows)
    several = len(_chains(rows)) > 1
    width = 0.8 / max(len(drafters), 1)
    fig, ax = plt.subplots(figsize=(min(16, max(6, 0.9 * len(groups) * max(len(drafters), 1) + 2)), 4.5))
    for di, d in enumerate(drafters):
        xs, ys, cis = [], [], []
        for gi, g in enumerate(groups):
            r = next((r for r in rows if r["drafter"] == d and (r["prompts"], r.get("num_steps")) == g), None)
            if r is not None and r["tau"] is not None:
                xs.append(gi + (di - (len(drafters) - 1) / 2) * width)
                ys.append(r["tau"])
                cis.append(r.get("tau_ci95"))
        bars = ax.bar(xs, ys, width * 0.95, yerr=_yerr(ys, cis), capsize=3, label=d)
        ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
    k = max([g[1] or 0 for g in groups], default=0)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(groups)), [f"{p}\nchain {s}" if several else p for p, s in groups])
    ax.set_ylim(0, max(k + 1, max([r["tau"] or 0 for r in rows], default=1)) * 1.1)
    chain = "chains " + ", ".join(str(c) for c in _chains(rows)) if several else f"{k} draft tokens, max {k + 1}"
    ax.set(title=f"Acceptance length tau ({settings.get('backend')}, {chain}); bars: 95% bootstrap interval",
           xlabel="prompt set", ylabel="tau (tokens per target verify step)")
    return _finish(fig, [ax], out)


def plot_acceptance(rows: Sequence[dict], out: Path, settings: dict) -> Path:
    """Acceptance rate at each draft position: one panel per chain length, one line per drafter
    (color) and prompt set (line style), the rate written at each point when few lines share a panel."""
    chains = _chains(rows)
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    sets = list(dict.fromkeys(r["prompts"] for r in rows))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-o", "--s", ":^", "-.D"]
    fig, axes = plt.subplots(1, len(chains), figsize=(min(16, 2 + 5.5 * len(chains)), 4.5), squeeze=False)
    for ax, steps in zip(axes[0], chains):
        mine = [r for r in rows if r.get("num_steps") == steps]
        for r in mine:
            acc = r["accept_per_position"]
            xs = range(1, len(acc) + 1)
            ax.plot(xs, acc, styles[sets.index(r["prompts"]) % len(styles)], ms=5,
                    color=colors[drafters.index(r["drafter"]) % len(colors)],
                    label=f"{r['drafter']} / {r['prompts']}")
            if len(mine) <= 3:
                for x, a in zip(xs, acc):
                    ax.annotate(f"{a:.2f}", (x, a), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
        k = max((len(r["accept_per_position"]) for r in mine), default=1)
        ax.set_xticks(range(1, k + 1))
        ax.set_ylim(0, 1.05)
        ax.set(title=f"Acceptance per draft position, chain of {steps} ({settings.get('backend')})",
               xlabel="draft position in the chain",
               ylabel="acceptance rate (accepted / verify steps)")
    return _finish(fig, axes[0], out)


def plot_categories(rows: Sequence[dict], out: Path) -> Path | None:
    """One panel per prompt set and chain that has categories: grouped bars of tau per category
    (groups) and drafter (bars), 95% bootstrap intervals over the category's prompts as error bars."""
    rows = [r for r in rows if r.get("per_category")]
    panels = _panels(rows)
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 4.2 * len(panels)), squeeze=False)
    for ax, (prompts, steps) in zip(axes[:, 0], panels):
        mine = [r for r in rows if (r["prompts"], r.get("num_steps")) == (prompts, steps)]
        cats = list(dict.fromkeys(c for r in mine for c in r["per_category"]))
        width = 0.8 / len(mine)
        for ri, r in enumerate(mine):
            pc = [r["per_category"].get(c) for c in cats]
            xs = [ci + (ri - (len(mine) - 1) / 2) * width for ci, p in enumerate(pc) if p and p["tau"] is not None]
            got = [p for p in pc if p and p["tau"] is not None]
            ys = [p["tau"] for p in got]
            bars = ax.bar(xs, ys, width * 0.95, yerr=_yerr(ys, [p["tau_ci95"] for p in got]), capsize=3,
                          label=f"{r['drafter']} (all: {r['tau']:.2f})" if r["tau"] is not None else r["drafter"])
            if len(mine) * len(cats) <= 40:
                ax.bar_label(bars, fmt="%.2f", fontsize=7, label_type="center")
        n = {c: max(r["per_category"][c]["num_prompts"] for r in mine if c in r["per_category"]) for c in cats}
        ax.set_xticks(range(len(cats)), [f"{c}\n(n={n[c]})" for c in cats])
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        if steps:
            ax.set_ylim(0, steps + 1.3)            # tau is at most steps + 1
        ax.set(title=f"tau per MT-Bench category: {prompts}, chain of {steps}; bars: 95% bootstrap interval",
               xlabel="MT-Bench category (n = prompts)", ylabel="tau (tokens per target verify step)")
    return _finish(fig, axes[:, 0], out)


def plot_paired(comparisons: Sequence[dict], out: Path) -> Path | None:
    """One panel per prompt set and chain: each drafter's per-prompt tau minus the reference's on
    the same prompt, sorted (dots), with the mean (line) and its 95% paired bootstrap interval (band)."""
    panels = _panels(comparisons)
    if not panels:
        return None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    most = max(sum((c["prompts"], c["num_steps"]) == p for c in comparisons) for p in panels)
    # one legend line per drafter, below its panel, so that many drafters never cover the dots
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, (4.2 + 0.22 * most) * len(panels)), squeeze=False)
    for ax, (prompts, steps) in zip(axes[:, 0], panels):
        mine = [c for c in comparisons if (c["prompts"], c["num_steps"]) == (prompts, steps)]
        for ci, c in enumerate(mine):
            col = colors[ci % len(colors)]
            d = sorted(c["per_prompt_diff"])
            label = f"{c['drafter']}: {c['wins']} wins / {c['losses']} losses / {c['ties']} ties"
            if c["mean_diff"] is not None:
                ax.axhline(c["mean_diff"], color=col, lw=1.2)
                label += f"; mean {c['mean_diff']:+.3f}"
            if c["mean_diff_ci95"]:
                lo, hi = c["mean_diff_ci95"]
                ax.axhspan(lo, hi, color=col, alpha=0.15)
                label += f" [{lo:+.3f}, {hi:+.3f}]"
            ax.plot(range(1, len(d) + 1), d, "o", ms=4, color=col, label=label)
        ax.axhline(0.0, color="black", lw=0.8, ls="--")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=f"Per-prompt tau minus {mine[0]['reference']}'s on the same prompt: {prompts}, chain of {steps}",
               xlabel="prompt, sorted by difference (line: mean difference; band: its 95% paired interval)",
               ylabel="tau difference (tokens per verify step)")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    return _finish(fig, axes[:, 0], out, legend=False)


def main(argv=None):
    p = argparse.ArgumentParser(description="Overlay the training curves of one or more runs.")
    p.add_argument("runs", nargs="+", type=Path, help="run directories (each has metrics.jsonl)")
    p.add_argument("--out", type=Path, default=Path("compare_curves.png"))
    p.add_argument("--labels", nargs="*", default=None)
    a = p.parse_args(argv)
    print(plot_runs(a.runs, a.out, a.labels))


if __name__ == "__main__":
    main()
