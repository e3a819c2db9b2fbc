"""Kill every long job at a random moment, resume it, and check it ends as if it never stopped.

    python -m eagle3.faults --runs 5 --seed 0                       # 5 runs of each job kind, 1 kill each
    python -m eagle3.faults --runs 30 --kills 3 --seed 1 --out table.md   # the docs/reliability.md table
    python -m eagle3.faults --kinds train --runs 1 --delay 9.3      # replay one run (delays from the log)
    python -m eagle3.faults --kinds capture --runs 1 --delay 0.4 1.2 --from-write
    python -m eagle3.faults --kinds train --runs 1 --delay 9.3 0.8 --from-write 0 1   # the first from the start
    python -m eagle3.faults --summarize WORK/results.jsonl          # the table of a run so far

Each kind runs once uninterrupted (the reference), then `runs` times: start the job, SIGKILL its
process group after a delay drawn (seeded) in [0, the job's wall time] (every other run counts its
delays from the moment the attempt first writes, in [0, the job's time from there], so they land in
the work, not the imports), rerun the same command (train: with resume=true) and kill it the same
way, `kills` times in all, then rerun it to completion and compare with the reference. The job's
times are the reference's until a run's first attempt finishes before its kill (the machine got
faster): then that attempt's.

    capture     python -m capture +experiment=tiny            every tensor of every shard, and the manifest
    sglang      the SGLang capture client, its spool packer   as capture
                and the fake server (tests/faults/sglang_job.py)
    regenerate  capture.regenerate_only=true on the tiny target   the regenerated JSONL, byte for byte
    train       train.py +experiment=tiny, then resume=true       the exported weights, and every metrics
                                                                  row (rate and ETA aside)
    stream      the same with train.mode=stream: the kill takes   as train
                the trainer and its producer down together
    export      python -m eagle3.export RUN_DIR                   the export's tensors and config.json

A kill that finds the job already finished ends that run's kills. Data lost counts what differs from
the reference after the rerun: samples (capture, sglang), conversations (regenerate), steps (train),
tensors (export). results.jsonl gets one line per run as it ends, so a run cut short still reports.

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
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("capture", "sglang", "regenerate", "train", "stream", "export", "train_zero2")
UNITS = {"capture": "samples", "sglang": "samples", "regenerate": "conversations", "train": "steps",
         "stream": "steps", "export": "tensors", "train_zero2": "steps"}
GPU_KINDS = ("train_zero2",)           # DeepSpeed runs only under a GPU (accelerate's CPU mode bypasses it)
SGLANG_JOB = ROOT / "tests" / "faults" / "sglang_job.py"   # the fake server lives with the tests
# Sizes that keep one job to seconds on two CPU cores while still crossing several shards,
# regeneration chunks and checkpoints, so a kill can land between any two commits.
CAPTURE = ["+experiment=tiny", "capture.shard_tokens=2048", "capture.batch_tokens=1024"]
REGEN = ["+experiment=tiny", "capture.regenerate_only=true", "capture.regenerate=true", "data.num_samples=8",
         "capture.regen_max_new_tokens=16", "capture.regen_chunk=2", "capture.regen_batch_size=2"]
TRAIN = ["+experiment=tiny", "train.steps=8", "train.save_every=2", "train.log_every=1", "train.eval_every=4"]
# streaming: the same training fed by its in-process producer, 2,048-token shards within 5 MB
STREAM = ["train.mode=stream", "capture.shard_tokens=2048", "data.disk_budget_gb=0.005"]
VOLATILE = ("tok_s", "eta_s", "max_mem_gib")   # metrics that measure the machine or the process, not the run


@dataclass
class Outcome:
    kind: str
    index: int
    delays: List[float]                # one per kill, in seconds
    from_write: Union[bool, List[bool]] = False   # delays counted from each attempt's first write, not its
                                                  # start (a list: per kill)
    kills: int = 0                     # kills that found the job still running
    after_commit: int = 0              # ... of them, kills that found something committed (a shard, chunk, checkpoint)
    survived: bool = False
    lost: int = 0                      # samples / conversations / steps / tensors that differ from the reference
    problems: List[str] = field(default_factory=list)


@dataclass
class Job:
    """One kind of job in one directory: how to start and resume it, when it has written, what it
    has committed, and how its result compares with the reference."""
    first: List[str]                   # the command of the first attempt
    again: List[str]                   # the command of every later one (train: resume=true)
    watch: Path                        # what it writes when the work starts: a change there is its first write
    committed: Callable[[], bool]
    compare: Callable[[], tuple]       # -> (problems, units lost)
    before: Callable[[], None] = lambda: None


def snapshot(root: Path) -> tuple:
    """(path, size, mtime) of root, a file, or of everything under it: a job has written when this changes."""
    if not root.exists():
        return ()
    try:
        if root.is_file():
            return ((str(root), root.stat().st_size, root.stat().st_mtime_ns),)
        return tuple(sorted((str(p), st.st_size, st.st_mtime_ns) for p in root.rglob("*") for st in [p.stat()]))
    except (FileNotFoundError, NotADirectoryError):     # renamed or removed while listed: it is writing
        return ("changing", time.monotonic())


class Harness:
    def __init__(self, work: Path):
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HYDRA_FULL_ERROR="1",
                        TOKENIZERS_PARALLELISM="false", EAGLE3_CACHE=str(self.work / "cache"))
        self.typical: Dict[str, float] = {}     # kind -> wall seconds of the reference run
        self.writing: Dict[str, float] = {}     # kind -> seconds until it first wrote its output
        # (kind, from_write) -> seconds a whole job lasts from its start, or from its first write: the
        # reference's, then those of the last run whose first attempt finished before its kill (the
        # machine's load moves them, and a delay past the job's end kills nothing)
        self.spans: Dict[tuple, float] = {}

    # ------------------------------------------------------------------ processes

    def _popen(self, args: List[str], logname: str) -> subprocess.Popen:
        out = open(self.work / logname, "ab")
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=self.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def run(self, args: List[str], logname: str, watch: Optional[Path] = None) -> tuple:
        """Run to completion: (wall seconds, seconds until something under `watch` first changed, or 0)."""
        t0, first = time.time(), 0.0
        before = snapshot(watch) if watch else None
        p = self._popen(args, logname)
        while watch is not None and not first and p.poll() is None:
            if snapshot(watch) != before:
                first = time.time() - t0
            time.sleep(0.02)
        if p.wait() != 0:
            tail = (self.work / logname).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}); {self.work / logname}:\n{tail}")
        return time.time() - t0, first

    def kill_after(self, args: List[str], delay: float, logname: str, watch: Optional[Path] = None) -> tuple:
        """Start the job, SIGKILL its whole process group `delay` s after its start (or after its
        first write under `watch`): (True if it was still running, else the seconds it lasted from there)."""
        before = snapshot(watch) if watch else None
        p = self._popen(args, logname)
        while watch is not None and p.poll() is None and snapshot(watch) == before:
            time.sleep(0.02)
        t0 = time.time()
        try:
            p.wait(timeout=delay)
            return False, time.time() - t0
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return True, delay

    # ------------------------------------------------------------------ jobs

    def capture_args(self, out: Path) -> List[str]:
        return ["-m", "capture", *CAPTURE, f"data.features_dir={out}", f"run_dir={self.work / 'hydra'}"]

    def sglang_args(self, d: Path) -> List[str]:
        return [str(SGLANG_JOB), str(self.work / "sglang_target"), str(d / "spool"), str(d / "features")]

    def regen_args(self) -> List[str]:
        return ["-m", "capture", *REGEN, f"run_dir={self.work / 'hydra'}"]

    def train_args(self, run_dir: Path, resume: bool, zero2: bool = False) -> List[str]:
        return ["train.py", *TRAIN, f"run_dir={run_dir}", f"data.features_dir={self.work / 'ref_features'}",
                f"resume={str(resume).lower()}", *(["dist=zero2", "train.deterministic=true"] if zero2 else [])]

    def stream_args(self, d: Path, resume: bool) -> List[str]:
        """Training from a stream in d/stream, its producer capturing into it (no feature dataset)."""
        return ["train.py", *TRAIN, *STREAM, f"run_dir={d / 'run'}", f"data.stream_dir={d / 'stream'}",
                f"data.features_dir={d / 'features'}", f"resume={str(resume).lower()}"]

    def regen_dir(self) -> Path:
        return self.work / "cache" / "regen"

    def regen_file(self) -> Optional[Path]:
        files = sorted(self.regen_dir().glob("*.jsonl"))
        done = [f for f in files if not f.name.endswith(".partial.jsonl")]
        return done[0] if done else None

    def reference(self, kind: str) -> None:
        """Run `kind` uninterrupted once (and what it needs), timing it."""
        w = self.work
        if kind in GPU_KINDS and not torch.cuda.is_available():
            raise SystemExit(f"error: --kinds {kind} needs a GPU: {', '.join(GPU_KINDS)} train under DeepSpeed, "
                             f"which runs only with one (docs/reliability.md)")
        if kind in ("capture", "train", "export", "train_zero2") and "capture" not in self.typical:
            shutil.rmtree(w / "ref_features", ignore_errors=True)
            self.typical["capture"], self.writing["capture"] = self.run(
                self.capture_args(w / "ref_features"), "ref_capture.log", w / "ref_features.partial")
        if kind == "sglang" and "sglang" not in self.typical:
            if not SGLANG_JOB.exists():
                raise FileNotFoundError(f"{SGLANG_JOB}: the sglang kind needs the repository's tests")
            shutil.rmtree(w / "ref_sglang", ignore_errors=True)
            self.typical["sglang"], self.writing["sglang"] = self.run(
                self.sglang_args(w / "ref_sglang"), "ref_sglang.log", w / "ref_sglang")
        if kind in ("train", "export") and "train" not in self.typical:
            shutil.rmtree(w / "ref_run", ignore_errors=True)
            self.typical["train"], self.writing["train"] = self.run(
                self.train_args(w / "ref_run", False), "ref_train.log", w / "ref_run" / "metrics.jsonl")
        if kind == "stream" and kind not in self.typical:
            shutil.rmtree(w / "ref_stream", ignore_errors=True)
            self.typical[kind], self.writing[kind] = self.run(
                self.stream_args(w / "ref_stream", False), "ref_stream.log", w / "ref_stream" / "stream")
        if kind == "train_zero2" and kind not in self.typical:
            shutil.rmtree(w / "ref_run_zero2", ignore_errors=True)
            self.typical[kind], self.writing[kind] = self.run(
                self.train_args(w / "ref_run_zero2", False, zero2=True), "ref_train_zero2.log",
                w / "ref_run_zero2" / "metrics.jsonl")
        if kind == "export" and "export" not in self.typical:
            shutil.rmtree(w / "ref_export_run", ignore_errors=True)
            shutil.copytree(w / "ref_run", w / "ref_export_run")
            shutil.rmtree(w / "ref_export_run" / "export")
            self.typical["export"], self.writing["export"] = self.run(
                ["-m", "eagle3.export", str(w / "ref_export_run")], "ref_export.log", w / "ref_export_run" / "export")
        if kind == "regenerate" and "regenerate" not in self.typical:
            shutil.rmtree(self.regen_dir(), ignore_errors=True)
            self.typical["regenerate"], self.writing["regenerate"] = self.run(
                self.regen_args(), "ref_regen.log", self.regen_dir())
            shutil.move(self.regen_file(), w / "ref_regen.jsonl")

    def job(self, kind: str, d: Path) -> Job:
        w = self.work
        if kind in ("capture", "sglang"):
            ref = w / ("ref_features" if kind == "capture" else "ref_sglang/features")
            args = self.capture_args(d / "features") if kind == "capture" else self.sglang_args(d)

            def committed():
                progress = d / "features.partial" / "progress.json"
                return (d / "features" / "manifest.json").exists() or (
                    progress.exists() and bool(json.loads(progress.read_text())["done"]))
            return Job(args, args, d, committed, lambda: same_dataset(ref, d / "features"))
        if kind == "regenerate":
            def committed():
                partial = list(self.regen_dir().glob("*.partial.jsonl"))
                return self.regen_file() is not None or (bool(partial) and partial[0].stat().st_size > 0)
            return Job(self.regen_args(), self.regen_args(), self.regen_dir(), committed,
                       lambda: same_lines(w / "ref_regen.jsonl", self.regen_file()),
                       before=lambda: shutil.rmtree(self.regen_dir(), ignore_errors=True))
        if kind == "train":             # watch metrics.jsonl: its first step (Hydra writes run_dir at start-up)
            return Job(self.train_args(d / "run", False), self.train_args(d / "run", True), d / "run" / "metrics.jsonl",
                       lambda: (d / "run" / "checkpoints" / "latest").exists(),
                       lambda: same_training(w / "ref_run", d / "run"))
        if kind == "stream":            # watch the stream directory: the producer's first unit

            def committed():
                return (d / "run" / "checkpoints" / "latest").exists() or (
                    (d / "stream").exists() and any((u / "manifest.json").exists() for u in (d / "stream").iterdir()))
            return Job(self.stream_args(d, False), self.stream_args(d, True), d / "stream", committed,
                       lambda: same_training(w / "ref_stream" / "run", d / "run"))
        if kind == "train_zero2":       # the same, DeepSpeed ZeRO-2 at world size 1 writing the checkpoints
            return Job(self.train_args(d / "run", False, True), self.train_args(d / "run", True, True),
                       d / "run" / "metrics.jsonl", lambda: (d / "run" / "checkpoints" / "latest").exists(),
                       lambda: same_training(w / "ref_run_zero2", d / "run"))
        if kind == "export":
            run = d / "run"

            def before():                                   # a run cut short: no export yet
                shutil.copytree(w / "ref_run", run, ignore=lambda p, names: ["export"] if p == str(w / "ref_run")
                                else [])
            args = ["-m", "eagle3.export", str(run)]
            return Job(args, args, run / "export", lambda: (run / "export" / "sglang" / "config.json").exists(),
                       lambda: same_export(w / "ref_export_run" / "export", run / "export"), before)
        raise ValueError(f"kind {kind!r}: expected one of {KINDS}")

    def span(self, kind: str, from_write: bool) -> float:
        if (kind, from_write) not in self.spans:
            t, w = self.typical[kind], self.writing[kind]
            self.spans[kind, False], self.spans[kind, True] = t, max(t - w, 0.1)
        return self.spans[kind, from_write]

    def one(self, kind: str, index: int, draws: List[float], from_write: Union[bool, Sequence[bool]] = False,
            seconds: bool = False) -> Outcome:
        """Kill the job after each delay in turn (each attempt resuming the last), then rerun it to
        completion and compare. draws: fractions of the job's span (see `spans`), or seconds;
        from_write: for every kill, or one per kill."""
        modes = [from_write] * len(draws) if isinstance(from_write, bool) else [bool(m) for m in from_write]
        if len(modes) != len(draws):
            raise ValueError(f"{len(draws)} delays but {len(modes)} from-write modes")
        delays = [x if seconds else x * self.span(kind, m) for x, m in zip(draws, modes)]
        o = Outcome(kind, index, [round(x, 3) for x in delays], from_write if isinstance(from_write, bool) else modes)
        d = self.work / f"{kind}_{index:04d}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        log = f"{d.name}.log"
        job = self.job(kind, d)
        job.before()
        for i, delay in enumerate(delays):
            landed, lasted = self.kill_after(job.first if i == 0 else job.again, delay, log,
                                             job.watch if modes[i] else None)
            if not landed:                                  # it finished first: nothing left to kill
                if i == 0:
                    self.spans[kind, modes[0]] = max(lasted, 0.1)
                o.delays = o.delays[:i + 1]
                break
            o.kills += 1
            o.after_commit += job.committed()
        self.run(job.again, log)                            # a finished job's rerun must keep its result
        o.problems, o.lost = job.compare()
        o.survived = not o.problems
        if o.survived:
            shutil.rmtree(d, ignore_errors=True)     # keep only what failed, for a look
        return o


# ---------------------------------------------------------------------- comparisons (-> problems, units lost)

def same_dataset(ref: Path, got: Path) -> tuple:
    """Every shard tensor for tensor and the manifest key for key; no work directory left behind.
    Lost: the samples of the shards that differ or are missing."""
    a = json.loads((ref / "manifest.json").read_text())
    every = sum(rec["num_samples"] for rec in a["shards"])
    if not (got / "manifest.json").exists():
        return [f"{got}: no manifest.json after the rerun"], every
    out, lost = [], 0
    if got.with_name(got.name + ".partial").exists():
        out.append(f"{got}.partial is left behind")
    b = json.loads((got / "manifest.json").read_text())
    out += [f"manifest {k}: {b.get(k)!r} != {a.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    for rec in a["shards"]:
        if not (got / rec["file"]).exists():
            out.append(f"{rec['file']} is missing")
            lost += rec["num_samples"]
            continue
        ta, tb = load_file(str(ref / rec["file"])), load_file(str(got / rec["file"]))
        bad = [f"{rec['file']}: {n} differs" for n in ta if n not in tb or not torch.equal(ta[n], tb[n])]
        out += bad
        lost += rec["num_samples"] if bad else 0
    if sorted(p.name for p in ref.iterdir()) != sorted(p.name for p in got.iterdir()):
        out.append(f"{got} holds other files than {ref}")
    return out, lost


def same_lines(ref: Path, got: Optional[Path]) -> tuple:
    """Byte for byte; lost: the reference's lines (conversations) not found as they are."""
    want = ref.read_bytes()
    have = got.read_bytes() if got else b""
    if have == want:
        return [], 0
    lost = len(set(want.splitlines()) - set(have.splitlines()))
    return [f"regenerated file {got} differs from the uninterrupted run's"], lost


def same_export(ref: Path, got: Path) -> tuple:
    out, lost = [], 0
    for engine in ("sglang", "vllm"):
        a, b = ref / engine, got / engine
        ta = load_file(str(a / "model.safetensors"))
        if not (b / "model.safetensors").exists():
            out.append(f"{b}: no model.safetensors")
            lost += len(ta)
            continue
        tb = load_file(str(b / "model.safetensors"))
        if set(ta) != set(tb):
            out.append(f"{b}: tensors {sorted(set(ta) ^ set(tb))} differ in name")
        bad = [n for n in ta if n not in tb or not torch.equal(ta[n], tb[n])]
        out += [f"{b}: {n} differs" for n in bad if n in tb]
        lost += len(bad)
        if (a / "config.json").read_text() != (b / "config.json").read_text():
            out.append(f"{b}/config.json differs")
    stray = sorted(p.name for p in got.iterdir() if p.name not in ("sglang", "vllm")) if got.exists() else []
    if stray:
        out.append(f"{got}: left behind {stray}")
    return out, lost


def same_training(ref: Path, got: Path) -> tuple:
    """The exported weights, and every metrics row (step, split) with the machine-dependent keys aside.
    Lost: the steps whose rows are missing or differ (every step when the weights differ)."""
    out, bad_tensors = same_export(ref / "export", got / "export")

    def rows(run: Path):
        lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
        return [{k: v for k, v in json.loads(x).items() if k not in VOLATILE} for x in lines if x.strip()]
    a, b = rows(ref), rows(got)
    steps = {r["step"] for r in a}
    if a != b:
        keys_a = [(r["step"], r["split"]) for r in a]
        keys_b = [(r["step"], r["split"]) for r in b]
        if keys_a != keys_b:
            out.append(f"metrics rows {keys_b} != {keys_a}")
        else:
            out += [f"metrics step {x['step']} {x['split']}: {y} != {x}" for x, y in zip(a, b) if x != y]
    lost = {r["step"] for r in a if r not in b}
    return out, len(steps) if bad_tensors else len(lost)


# ---------------------------------------------------------------------- command

def draw_delays(seed: int, kind: str, runs: int, kills: int = 1) -> List[tuple]:
    """(delays as fractions of the job's span, from_write) per run, `kills` each: even runs anywhere
    in a whole job from the start, odd runs from the attempt's first write to the job's end: a tiny
    job spends most of its wall time importing and loading, and a kill there tests little. Seeded per
    kind, so one kind's delays do not move when another kind is added."""
    rng = random.Random(f"{seed}:{kind}")
    return [([rng.random() for _ in range(kills)], i % 2 == 1) for i in range(runs)]


def replay_command(o: Outcome) -> str:
    """The command that replays one run's kills at the same delays."""
    modes = o.from_write
    flag = (" --from-write" if modes else "") if isinstance(modes, bool) else \
        " --from-write " + " ".join(str(int(m)) for m in modes[:len(o.delays)])   # the kills that ran
    return f"python -m eagle3.faults --kinds {o.kind} --runs 1 --delay {' '.join(map(str, o.delays))}{flag}"


def table(outcomes: List[Outcome], seed: int, kills: int = 1) -> str:
    """The markdown table; each row's command repeats the seeds of the runs it counts."""
    lines = ["| job | runs | kills (job running) | ... after a commit | survived | data lost | reproduce |",
             "|---|---|---|---|---|---|---|"]
    flag = f" --kills {kills}" if kills != 1 else ""
    for kind in KINDS:
        mine = [o for o in outcomes if o.kind == kind]
        if not mine:
            continue
        lines.append(f"| {kind} | {len(mine)} | {sum(o.kills for o in mine)} | {sum(o.after_commit for o in mine)} | "
                     f"{sum(o.survived for o in mine)} | {sum(o.lost for o in mine)} {UNITS[kind]} | "
                     f"`python -m eagle3.faults --kinds {kind} --runs {len(mine)}{flag} --seed {seed}` |")
    total = sum(o.kills for o in outcomes)
    lines.append(f"| all | {len(outcomes)} | {total} | {sum(o.after_commit for o in outcomes)} | "
                 f"{sum(o.survived for o in outcomes)} | {sum(not o.survived for o in outcomes)} runs | |")
    return "\n".join(lines) + "\n"


def default_kinds() -> List[str]:
    """Every kind this machine runs: the GPU kinds only where there is a GPU."""
    return [k for k in KINDS if k not in GPU_KINDS or torch.cuda.is_available()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per job kind")
    p.add_argument("--kills", type=int, default=1, help="kills per run, each attempt resuming the last")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill delays, so a failing run replays")
    p.add_argument("--kinds", nargs="+", default=None, choices=KINDS,
                   help="default: every kind this machine runs (train_zero2 only with a GPU)")
    p.add_argument("--delay", type=float, nargs="+", default=None,
                   help="kill after these many seconds (one per kill) instead of drawing")
    p.add_argument("--from-write", type=int, nargs="*", choices=(0, 1), default=None, metavar="0|1",
                   help="count --delay from each attempt's first write; with values, one per kill "
                        "(0: from the attempt's start)")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a fresh temporary one)")
    p.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    p.add_argument("--summarize", type=Path, default=None, metavar="RESULTS_JSONL",
                   help="only print the table of an earlier (or still running) harness's results.jsonl")
    args = p.parse_args(argv)
    if args.kinds is None:
        args.kinds = default_kinds()
    if args.from_write and (args.delay is None or len(args.from_write) != len(args.delay)):
        p.error(f"--from-write with values takes one per --delay ({len(args.delay or [])}), "
                f"got {len(args.from_write)}")
    # absent: from each attempt's start; bare: from each attempt's first write; with values: per kill
    from_write = False if args.from_write is None else [bool(m) for m in args.from_write] or True
    if args.summarize:
        outcomes = [Outcome(**json.loads(line)) for line in args.summarize.read_text().splitlines() if line.strip()]
        kills = max((len(o.delays) for o in outcomes), default=1)
        text = table(outcomes, args.seed, kills)
    else:
        work = args.work or Path(tempfile.mkdtemp(prefix="eagle3-faults-"))
        results = work / "results.jsonl"
        h = Harness(work)
        delays = {}
        for kind in args.kinds:
            h.reference(kind)
            delays[kind] = [(args.delay, from_write)] * args.runs if args.delay is not None else \
                draw_delays(args.seed, kind, args.runs, args.kills)
            print(f"[faults] {kind}: reference {h.typical[kind]:.1f}s, writing from {h.writing[kind]:.1f}s",
                  flush=True)
        outcomes = []
        for i in range(args.runs):                  # kinds take turns, so a run cut short covers them all
            for kind in args.kinds:
                o = h.one(kind, i, *delays[kind][i], seconds=args.delay is not None)
                outcomes.append(o)
                with open(results, "a") as f:
                    f.write(json.dumps(o.__dict__) + "\n")
                state = "ok" if o.survived else "FAILED: " + "; ".join(o.problems[:3])
                print(f"[faults] {kind} #{i} kills at {o.delays}s from_write={o.from_write} landed={o.kills} "
                      f"after_commit={o.after_commit} {state}", flush=True)
        text = table(outcomes, args.seed, args.kills)
        print(f"[faults] per-run results: {results}")
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(o.survived for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
