"""Training curves from metrics.jsonl: one run at the end of training, or several overlaid.

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


def main(argv=None):
    p = argparse.ArgumentParser(description="Overlay the training curves of one or more runs.")
    p.add_argument("runs", nargs="+", type=Path, help="run directories (each has metrics.jsonl)")
    p.add_argument("--out", type=Path, default=Path("compare_curves.png"))
    p.add_argument("--labels", nargs="*", default=None)
    a = p.parse_args(argv)
    print(plot_runs(a.runs, a.out, a.labels))


if __name__ == "__main__":
    main()
