"""Kill every long job at a random moment, resume it, and check it ends as if it never stopped.

    python -m eagle3.faults --runs 5 --seed 0                       # 5 kills of each job kind
    python -m eagle3.faults --runs 50 --seed 1 --out table.md       # the docs/reliability.md table
    python -m eagle3.faults --kinds train --runs 1 --delay 9.3      # replay one kill (from the log)
    python -m eagle3.faults --kinds capture --runs 1 --delay 0.4 --from-write

Each kind runs once uninterrupted (the reference), then `runs` times: start the job, SIGKILL its
process group after a delay drawn (seeded) in [0, the reference's wall time] (every other one counted
from the moment the job first writes its output, in [0, the reference's time from there], so it lands
in the work, not the imports), rerun the same command
(train: with resume=true) to completion, and compare with the reference:

    capture     python -m capture +experiment=tiny            every tensor of every shard, and the manifest
    regenerate  capture.regenerate_only=true on the tiny target   the regenerated JSONL, byte for byte
    train       train.py +experiment=tiny, then resume=true       the exported weights, and every metrics
                                                                  row (rate and ETA aside)
    export      python -m eagle3.export RUN_DIR                   the export's tensors and config.json

Everything lives under --work (a fresh temporary directory by default); EAGLE3_CACHE points there, so
the user's caches are not touched. Disk-full and bad-input faults are in-process tests
(tests/faults/), listed with these in docs/reliability.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("capture", "regenerate", "train", "export")
# Sizes that keep one job to seconds on two CPU cores while still crossing several shards,
# regeneration chunks and checkpoints, so a kill can land between any two commits.
CAPTURE = ["+experiment=tiny", "capture.shard_tokens=2048", "capture.batch_tokens=1024"]
REGEN = ["+experiment=tiny", "capture.regenerate_only=true", "capture.regenerate=true", "data.num_samples=8",
         "capture.regen_max_new_tokens=16", "capture.regen_chunk=2", "capture.regen_batch_size=2"]
TRAIN = ["+experiment=tiny", "train.steps=8", "train.save_every=2", "train.log_every=1", "train.eval_every=4"]
VOLATILE = ("tok_s", "eta_s")          # metrics that measure the machine, not the run


@dataclass
class Outcome:
    kind: str
    index: int
    delay: float
    from_write: bool = False           # delay counted from the job's first write, not its start
    landed: bool = False               # the job was still running when it was killed
    after_commit: bool = False         # ... and had committed something (a shard, chunk, checkpoint)
    survived: bool = False
    problems: List[str] = field(default_factory=list)


class Harness:
    def __init__(self, work: Path):
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1",
                        TOKENIZERS_PARALLELISM="false", EAGLE3_CACHE=str(self.work / "cache"))
        self.typical: Dict[str, float] = {}     # kind -> wall seconds of the reference run
        self.writing: Dict[str, float] = {}     # kind -> seconds until it first wrote its output

    # ------------------------------------------------------------------ processes

    def _popen(self, args: List[str], logname: str) -> subprocess.Popen:
        out = open(self.work / logname, "ab")
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=self.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def run(self, args: List[str], logname: str, marker: Optional[Callable[[], bool]] = None) -> tuple:
        """Run to completion: (wall seconds, seconds until marker() first held, or 0)."""
        t0, first = time.time(), 0.0
        p = self._popen(args, logname)
        while marker is not None and not first and p.poll() is None:
            if marker():
                first = time.time() - t0
            time.sleep(0.02)
        if p.wait() != 0:
            tail = (self.work / logname).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}); {self.work / logname}:\n{tail}")
        return time.time() - t0, first

    def kill_after(self, args: List[str], delay: float, logname: str,
                   marker: Optional[Callable[[], bool]] = None) -> bool:
        """Start the job, SIGKILL its whole process group `delay` s after its start (or after marker()
        first holds); True if it was still running."""
        p = self._popen(args, logname)
        while marker is not None and p.poll() is None and not marker():
            time.sleep(0.01)
        try:
            p.wait(timeout=delay)
            return False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return True

    # ------------------------------------------------------------------ jobs

    def capture_args(self, out: Path) -> List[str]:
        return ["-m", "capture", *CAPTURE, f"data.features_dir={out}", f"run_dir={self.work / 'hydra'}"]

    def regen_args(self) -> List[str]:
        return ["-m", "capture", *REGEN, f"run_dir={self.work / 'hydra'}"]

    def train_args(self, run_dir: Path, resume: bool) -> List[str]:
        return ["train.py", *TRAIN, f"run_dir={run_dir}", f"data.features_dir={self.work / 'ref_features'}",
                f"resume={str(resume).lower()}"]

    def regen_file(self) -> Optional[Path]:
        files = sorted((self.work / "cache" / "regen").glob("*.jsonl"))
        done = [f for f in files if not f.name.endswith(".partial.jsonl")]
        return done[0] if done else None

    def reference(self, kind: str) -> None:
        """Run `kind` uninterrupted once (and what it needs), timing it."""
        w = self.work
        if kind in ("capture", "train", "export") and "capture" not in self.typical:
            shutil.rmtree(w / "ref_features", ignore_errors=True)
            self.typical["capture"], self.writing["capture"] = self.run(
                self.capture_args(w / "ref_features"), "ref_capture.log",
                lambda: any((w / "ref_features.partial").glob("shard-*")))
        if kind in ("train", "export") and "train" not in self.typical:
            shutil.rmtree(w / "ref_run", ignore_errors=True)
            self.typical["train"], self.writing["train"] = self.run(
                self.train_args(w / "ref_run", False), "ref_train.log",
                lambda: (w / "ref_run" / "metrics.jsonl").exists())
        if kind == "export" and "export" not in self.typical:
            shutil.rmtree(w / "ref_export_run", ignore_errors=True)
            shutil.copytree(w / "ref_run", w / "ref_export_run")
            shutil.rmtree(w / "ref_export_run" / "export")
            self.typical["export"], self.writing["export"] = self.run(
                ["-m", "eagle3.export", str(w / "ref_export_run")], "ref_export.log",
                lambda: (w / "ref_export_run" / "export").exists())
        if kind == "regenerate" and "regenerate" not in self.typical:
            shutil.rmtree(w / "cache" / "regen", ignore_errors=True)
            self.typical["regenerate"], self.writing["regenerate"] = self.run(
                self.regen_args(), "ref_regen.log", lambda: any((w / "cache" / "regen").glob("*.partial.jsonl")))
            shutil.move(self.regen_file(), w / "ref_regen.jsonl")

    def one(self, kind: str, index: int, delay: float, from_write: bool = False) -> Outcome:
        o = Outcome(kind, index, round(delay, 3), from_write)
        when = (lambda m: m) if from_write else (lambda m: None)
        d = self.work / f"{kind}_{index:04d}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        log = f"{d.name}.log"
        if kind == "capture":
            o.landed = self.kill_after(self.capture_args(d / "features"), delay, log,
                                       when(lambda: any((d / "features.partial").glob("shard-*"))))
            progress = d / "features.partial" / "progress.json"
            o.after_commit = (d / "features" / "manifest.json").exists() or (
                progress.exists() and bool(json.loads(progress.read_text())["done"]))
            self.run(self.capture_args(d / "features"), log)
            o.problems = same_dataset(self.work / "ref_features", d / "features")
        elif kind == "regenerate":
            shutil.rmtree(self.work / "cache" / "regen", ignore_errors=True)
            o.landed = self.kill_after(self.regen_args(), delay, log,
                                       when(lambda: any((self.work / "cache" / "regen").glob("*.partial.jsonl"))))
            partial = list((self.work / "cache" / "regen").glob("*.partial.jsonl"))
            o.after_commit = self.regen_file() is not None or (bool(partial) and partial[0].stat().st_size > 0)
            self.run(self.regen_args(), log)
            got = self.regen_file()
            o.problems = [] if got and got.read_bytes() == (self.work / "ref_regen.jsonl").read_bytes() else \
                [f"regenerated file {got} differs from the uninterrupted run's"]
        elif kind == "train":
            o.landed = self.kill_after(self.train_args(d / "run", False), delay, log,
                                       when(lambda: (d / "run" / "metrics.jsonl").exists()))
            o.after_commit = (d / "run" / "checkpoints" / "latest").exists()
            self.run(self.train_args(d / "run", True), log)
            o.problems = same_training(self.work / "ref_run", d / "run")
        elif kind == "export":
            run = d / "run"
            shutil.copytree(self.work / "ref_run", run, ignore=lambda d, names: ["export"] if d == str(
                self.work / "ref_run") else [])                       # a run cut short: no export yet
            o.landed = self.kill_after(["-m", "eagle3.export", str(run)], delay, log,
                                       when(lambda: (run / "export").exists()))
            o.after_commit = (run / "export" / "sglang" / "config.json").exists()
            self.run(["-m", "eagle3.export", str(run)], log)
            o.problems = same_export(self.work / "ref_export_run" / "export", run / "export")
        else:
            raise ValueError(f"kind {kind!r}: expected one of {KINDS}")
        o.survived = not o.problems
        if o.survived:
            shutil.rmtree(d, ignore_errors=True)     # keep only what failed, for a look
        return o


# ---------------------------------------------------------------------- comparisons

def same_dataset(ref: Path, got: Path) -> List[str]:
    """Every shard tensor for tensor and the manifest key for key; no work directory left behind."""
    if not (got / "manifest.json").exists():
        return [f"{got}: no manifest.json after the rerun"]
    out = []
    if got.with_name(got.name + ".partial").exists():
        out.append(f"{got}.partial is left behind")
    a, b = (json.loads((p / "manifest.json").read_text()) for p in (ref, got))
    out += [f"manifest {k}: {b.get(k)!r} != {a.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    for rec in a.get("shards", []):
        ta, tb = load_file(str(ref / rec["file"])), load_file(str(got / rec["file"]))
        out += [f"{rec['file']}: {n} differs" for n in ta if n not in tb or not torch.equal(ta[n], tb[n])]
    if sorted(p.name for p in ref.iterdir()) != sorted(p.name for p in got.iterdir()):
        out.append(f"{got} holds other files than {ref}")
    return out


def same_export(ref: Path, got: Path) -> List[str]:
    out = []
    for engine in ("sglang", "vllm"):
        a, b = ref / engine, got / engine
        if not (b / "model.safetensors").exists():
            out.append(f"{b}: no model.safetensors")
            continue
        ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
        if set(ta) != set(tb):
            out.append(f"{b}: tensors {sorted(set(ta) ^ set(tb))} differ in name")
        out += [f"{b}: {n} differs" for n in ta if n in tb and not torch.equal(ta[n], tb[n])]
        if (a / "config.json").read_text() != (b / "config.json").read_text():
            out.append(f"{b}/config.json differs")
    stray = sorted(p.name for p in got.iterdir() if p.name not in ("sglang", "vllm"))
    if stray:
        out.append(f"{got}: left behind {stray}")
    return out


def same_training(ref: Path, got: Path) -> List[str]:
    """The exported weights, and every metrics row (step, split) with the machine-dependent keys aside."""
    out = same_export(ref / "export", got / "export")

    def rows(run: Path):
        lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
        return [{k: v for k, v in json.loads(x).items() if k not in VOLATILE} for x in lines if x.strip()]
    a, b = rows(ref), rows(got)
    if a != b:
        keys_a = [(r["step"], r["split"]) for r in a]
        keys_b = [(r["step"], r["split"]) for r in b]
        if keys_a != keys_b:
            out.append(f"metrics rows {keys_b} != {keys_a}")
        else:
            out += [f"metrics step {x['step']} {x['split']}: {y} != {x}" for x, y in zip(a, b) if x != y]
    return out


# ---------------------------------------------------------------------- command

def draw_delays(seed: int, kind: str, runs: int, typical: float, writing: float) -> List[tuple]:
    """(delay, from_write) per run: even runs anywhere in [0, typical] from the start, odd runs in
    [0, typical - writing] from the job's first write: a tiny job spends most of its wall time
    importing and loading, and a kill there tests little. Seeded per kind, so one kind's delays do
    not move when another kind is added."""
    rng = random.Random(f"{seed}:{kind}")
    return [(rng.uniform(0, typical), False) if i % 2 == 0 else (rng.uniform(0, max(typical - writing, 0.1)), True)
            for i in range(runs)]


def table(outcomes: List[Outcome], seed: int, runs: int) -> str:
    lines = ["| job | runs | killed while running | ... after a commit | survived | data lost | reproduce |",
             "|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        mine = [o for o in outcomes if o.kind == kind]
        if not mine:
            continue
        landed = [o for o in mine if o.landed]
        lines.append(f"| {kind} | {len(mine)} | {len(landed)} | {sum(o.after_commit for o in landed)} | "
                     f"{sum(o.survived for o in mine)} | {sum(not o.survived for o in mine)} | "
                     f"`python -m eagle3.faults --kinds {kind} --runs {runs} --seed {seed}` |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="kills per job kind")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill delays, so a failing run replays")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--delay", type=float, default=None, help="kill after this many seconds instead of drawing")
    p.add_argument("--from-write", action="store_true", help="count --delay from the job's first write")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a fresh temporary one)")
    p.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    p.add_argument("--summarize", type=Path, default=None, metavar="RESULTS_JSONL",
                   help="only print the table of an earlier (or still running) harness's results.jsonl")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="eagle3-faults-"))
    results = work / "results.jsonl"
    if args.summarize:
        outcomes = [Outcome(**json.loads(line)) for line in args.summarize.read_text().splitlines() if line.strip()]
    else:
        h = Harness(work)
        delays = {}
        for kind in args.kinds:
            h.reference(kind)
            delays[kind] = [(args.delay, args.from_write)] * args.runs if args.delay is not None else \
                draw_delays(args.seed, kind, args.runs, h.typical[kind], h.writing[kind])
            print(f"[faults] {kind}: reference {h.typical[kind]:.1f}s, writing from {h.writing[kind]:.1f}s",
                  flush=True)
        outcomes = []
        for i in range(args.runs):                  # kinds take turns, so a run cut short covers them all
            for kind in args.kinds:
                o = h.one(kind, i, *delays[kind][i])
                outcomes.append(o)
                with open(results, "a") as f:
                    f.write(json.dumps(o.__dict__) + "\n")
                state = "ok" if o.survived else "FAILED: " + "; ".join(o.problems[:3])
                print(f"[faults] {kind} #{i} kill at {o.delay:.2f}s from_write={o.from_write} landed={o.landed} "
                      f"after_commit={o.after_commit} {state}", flush=True)
    runs = max((o.index for o in outcomes), default=-1) + 1 if args.summarize else args.runs
    text = table(outcomes, args.seed, runs)
    print(text + ("" if args.summarize else f"[faults] per-run results: {results}"))
    if args.out:
        args.out.write_text(text)
    return 0 if all(o.survived for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
