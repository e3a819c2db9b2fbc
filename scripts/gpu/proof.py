"""Issue 9's GPU session in one unattended run: regenerate, train every drafter, evaluate them.

    python scripts/gpu/proof.py --work /tmp/proof            # on a GPU machine, every visible GPU
    python scripts/gpu/proof.py --work /tmp/dry --dry-run    # the same graph on CPU, tiny sizes

Jobs (each a plain command of this repository, logged to WORK/logs/NAME.log):
    regen_peer   python -m capture +experiment=smollm2_peer capture.regenerate_only=true
    regen_all    python -m capture +experiment=smollm2_scale capture.regenerate_only=true
    peer_*       train.py +experiment=smollm2_peer with the peer's recipe and our changes to it
    scale_*      train.py on the regenerated answers of the first conversations holding 8k / 20k
                 prompts, and of all of them
    long_*       several epochs over all of them at batch 32 / 64 / 128 (--answers: an earlier answer file)
    eval_*       evaluate.py (hf backend: our reference, counting tau as the engines do) per group
    zero_*       issue 8: ZeRO-2 / ZeRO-3 on 2 GPUs against 1 GPU, same global batch (tiny target)
    kimi_zero3_* issue 8: the Kimi-size drafter under ZeRO-3, 1 GPU against 2 (conf/experiment/kimi_dims)
A job starts once its dependencies have finished; at most --per-gpu jobs share a GPU. WORK/status.json
says what ran, how long, and the exit codes. Rerunning skips jobs already done; --only runs a subset
(a dependency outside it counts as done), e.g. what the first session left unrun:
    --only regen_all,scale_8k,scale_20k,scale_all,scale_all_lr3e-4,eval_scale,eval_scale_more,\
           peer_lr1e-3_original,zero3_1gpu,zero3_2gpu,kimi_zero3_1gpu,kimi_zero3_2gpu
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


@dataclass
class Job:
    name: str
    cmd: Callable[[], List[str]] | List[str]    # a callable is built when the job starts
    deps: List[str] = field(default_factory=list)
    gpus: int = 1                                 # 1: the freest GPU; 0: every GPU; 2: two GPUs
    exclusive: bool = False                       # alone on its GPUs (timings)
    after: List[str] = field(default_factory=list)  # jobs that must have ended, well or not
    state: str = "wait"                           # wait | run | ok | fail
    proc: Optional[subprocess.Popen] = None
    gpu_ids: List[int] = field(default_factory=list)
    t0: float = 0.0
    t1: float = 0.0


def prompts_prefix(regen_jsonl: Path, n_prompts: int) -> int:
    """How many conversations, from the start of the file, hold n_prompts answered user turns."""
    total = 0
    with open(regen_jsonl) as f:
        for i, line in enumerate(f, 1):
            total += sum(m["role"] == "assistant" for m in json.loads(line)["messages"])
            if total >= n_prompts:
                return i
    return 0


def build_jobs(work: Path, dry: bool, gpus: int, regen_minutes: float = 0.0, regen_chunk: int = 4096,
               answers: Optional[Path] = None) -> List[Job]:
    tiny = (["target=tiny_llama", "aux_layers=[2,3,4]", "data.num_samples=24", "train.steps=4",
             "train.batch_size=4", "drafter.draft_vocab_size=512", "capture.regen_max_new_tokens=8",
             "capture.regen_batch_size=8", "data.max_length=256"] if dry else [])
    ev_tiny = ["eval.num_prompts=2", "eval.max_new_tokens=8"] if dry else []
    runs = work / "runs"

    def regen(exp, *over):
        return lambda: [PY, "-m", "capture", f"+experiment={exp}", "capture.regenerate_only=true", *over, *tiny]

    def train(exp, name, *over):
        return [PY, "train.py", f"+experiment={exp}", f"run_dir={runs / name}", "train.wandb=false", *over, *tiny]

    def scale_train(name, n_prompts, *over):
        def cmd():
            path = answers or _regen_path_from_log(work / "logs" / "regen_all.log")
            n = prompts_prefix(path, n_prompts) if n_prompts else 0
            if n_prompts and not n:
                raise RuntimeError(f"{path} holds fewer than {n_prompts} answered prompts")
            print(f"[proof] {name}: {n or 'all'} conversations for {n_prompts or 'all'} prompts", flush=True)
            return train("smollm2_scale", name, "data.source=jsonl", f"data.path={path}", f"data.num_samples={n}",
                         "capture.regenerate=false", *over)
        return cmd

    peer = {"peer_specforge_recipe": [],                        # lr 1e-4, exactly the peer's settings
            "peer_lr3e-4": ["optim.lr=3e-4"],
            "peer_lr1e-3": ["optim.lr=1e-3"],
            "peer_lr1e-3_ttt1": ["optim.lr=1e-3", "train.ttt_steps=1"],
            "peer_lr1e-3_original": ["optim.lr=1e-3", "capture.regenerate=false"],
            "peer_lr1e-3_vd4096": ["optim.lr=1e-3", "drafter.draft_vocab_size=4096"]}
    scale = {"scale_8k": 8000, "scale_20k": 20000, "scale_all": 0}
    if dry:                                                     # tiny: 8 and 20 prompts
        scale = {k: v // 1000 for k, v in scale.items()}
    scale_lr = {"scale_all_lr3e-4": ["optim.lr=3e-4"],
                "scale_all_warm": ["drafter.head_from_target=true"],     # lm_head and norm from the target
                # several epochs over all 58k answers (carry them: --answers), larger batches to buy
                # epochs (they cost about as much per token as batch 16: docs/results.md)
                "long_b64": ["train.batch_size=64", "optim.lr=2e-3", "train.epochs=3"],
                "long_b128": ["train.batch_size=128", "optim.lr=3e-3", "train.epochs=3"],
                "long_b64_e5": ["train.batch_size=64", "optim.lr=2e-3", "train.epochs=5"],
                # ten epochs with length-grouped batches (random batches of 64 are 53% padding)
                "long_b32_e10_g32": ["train.batch_size=32", "optim.lr=1.5e-3", "train.epochs=10",
                                     "train.length_groups=32"],
                "long_b64_e10_g32": ["train.batch_size=64", "optim.lr=2e-3", "train.epochs=10",
                                     "train.length_groups=32"]}   # the committed drafter
    # Regeneration beside six trainings managed only 4,096 conversations per GPU in 447 s: regen_peer
    # runs alone; regen_all shares its GPUs with at most per_gpu - 1 other jobs, and with
    # --regen-minutes it stops starting chunks in time (the scale runs then train on what it answered)
    # with 2 GPUs the at-scale regeneration waits for the scale-out checks below (they are short)
    jobs = [Job("regen_peer", regen("smollm2_peer"), gpus=0, exclusive=True),
            Job("regen_all", regen("smollm2_scale", f"capture.regen_minutes={regen_minutes}",
                                   f"capture.regen_chunk={regen_chunk}"), deps=["regen_peer"], gpus=0,
                after=["zero3_2gpu", "kimi_zero3_2gpu"] if gpus >= 2 else [])]
    jobs += [Job(n, train("smollm2_peer", n, *o), deps=["regen_peer"]) for n, o in peer.items()]
    jobs += [Job(n, scale_train(n, k), deps=["regen_all"]) for n, k in scale.items()]
    jobs += [Job(n, scale_train(n, 0, *o), deps=["regen_all"]) for n, o in scale_lr.items()]

    def evaluate(exp, names, prompts):
        return [PY, "evaluate.py", f"+experiment={exp}", "eval.backend=hf", f"run_dir={runs / ('eval_' + names[0])}",
                "eval.drafters=[" + ",".join(str(runs / n) for n in names) + "]",
                f"eval.prompts=[{prompts}]", *tiny, *ev_tiny]
    half = len(peer) // 2
    jobs += [Job("eval_peer_a", evaluate("smollm2_peer", list(peer)[:half], "mt_bench"), deps=list(peer)[:half]),
             Job("eval_peer_b", evaluate("smollm2_peer", list(peer)[half:], "mt_bench"), deps=list(peer)[half:]),
             Job("eval_scale", evaluate("smollm2_scale", list(scale), "mt_bench"), deps=list(scale)),
             Job("eval_scale_more", evaluate("smollm2_scale", ["scale_all", *scale_lr],
                                             "mt_bench,mt_bench_2turn,sharegpt_heldout"), deps=["scale_all", *scale_lr])]
    if gpus >= 2:   # issue 8
        base = ["+experiment=tiny", f"data.features_dir={work / 'features_tiny'}", "train.steps=20",
                "train.batch_size=8", "train.wandb=false"]
        launch = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29611"]
        for z in (2, 3):                     # zero2_1gpu captures the tiny features the others reuse
            jobs.append(Job(f"zero{z}_1gpu", [PY, "train.py", *base, f"dist=zero{z}", f"run_dir={runs / f'zero{z}_1gpu'}"],
                            deps=["regen_peer"] if z == 2 else ["zero2_1gpu"]))
            jobs.append(Job(f"zero{z}_2gpu", [*launch, "train.py", *base, f"dist=zero{z}",
                                              f"run_dir={runs / f'zero{z}_2gpu'}"], deps=[f"zero{z}_1gpu"], gpus=2))
        # Kimi-size drafter (1.19B trainable) under ZeRO-3, 1 GPU against 2 with the same global batch:
        # the losses must agree, and the pair gives tokens/s scaling and memory per GPU; alone on
        # their GPUs, eager (no compile time inside the timing)
        kimi = ["+experiment=kimi_dims", "train.compile=false"]
        kimi_launch = [*launch[:-1], "29612"]
        jobs.append(Job("kimi_zero3_1gpu", [PY, "train.py", *kimi, f"run_dir={runs / 'kimi_zero3_1gpu'}"],
                        exclusive=True))
        jobs.append(Job("kimi_zero3_2gpu", [*kimi_launch, "train.py", *kimi, f"run_dir={runs / 'kimi_zero3_2gpu'}"],
                        deps=["kimi_zero3_1gpu"], gpus=2, exclusive=True))
    return jobs


def _regen_path_from_log(log: Path) -> Path:
    for line in log.read_text().splitlines()[::-1]:
        if line.startswith("[capture] regenerated conversations: "):
            return Path(line.split(": ", 1)[1].strip())
    raise RuntimeError(f"{log}: no regenerated-conversations line")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--per-gpu", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated job names (and nothing else)")
    ap.add_argument("--regen-minutes", type=float, default=0.0, help="regen_all: time limit (0 = none)")
    ap.add_argument("--regen-chunk", type=int, default=4096, help="regen_all: conversations answered together")
    ap.add_argument("--answers", type=Path, help="scale_* and long_* train on this answer file instead of regen_all's")
    args = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    status_path = work / "status.json"
    done = {k for k, v in json.loads(status_path.read_text()).items() if v["state"] == "ok"} \
        if status_path.exists() else set()
    jobs = build_jobs(work, args.dry_run, gpus, args.regen_minutes, args.regen_chunk, args.answers)
    if args.only:
        keep = set(args.only.split(","))
        jobs = [j for j in jobs if j.name in keep]
    for j in jobs:
        if j.name in done:
            j.state = "ok"
    slots = [args.per_gpu] * max(gpus, 1)        # free job slots per GPU
    start = time.time()

    def save():
        status_path.write_text(json.dumps({j.name: {"state": j.state, "gpus": j.gpu_ids,
                                                    "start_s": round(j.t0 - start, 1) if j.t0 else None,
                                                    "secs": round((j.t1 or time.time()) - j.t0, 1) if j.t0 else None}
                                           for j in jobs}, indent=1))

    def cost(j):
        return args.per_gpu if j.exclusive else 1

    while any(j.state in ("wait", "run") for j in jobs):
        for j in jobs:
            if j.state == "run" and j.proc.poll() is not None:
                j.state, j.t1 = ("ok" if j.proc.returncode == 0 else "fail"), time.time()
                for g in j.gpu_ids:
                    slots[g] += cost(j)
                print(f"[proof] {j.name} {j.state} after {j.t1 - j.t0:.0f}s", flush=True)
        states = {j.name: j.state for j in jobs}
        for j in jobs:
            if j.state != "wait":
                continue
            if any(states.get(d) == "fail" for d in j.deps):
                j.state = "fail"
                print(f"[proof] {j.name} skipped: a dependency failed", flush=True)
                continue
            if not all(states.get(d, "ok") == "ok" for d in j.deps) or \
                    any(states.get(d) in ("wait", "run") for d in j.after):
                continue
            n = len(slots)
            want = n if j.gpus == 0 else min(j.gpus, n)
            order = sorted(range(n), key=lambda k: -slots[k])[:want]
            if len(order) < want or any(slots[g] < cost(j) for g in order):
                continue
            ids = sorted(order)
            for g in ids:
                slots[g] -= cost(j)
            # CPU threads shared out: 6 trainings x 32 default threads spent ~11 min before their first
            # step on the 32-core 2-GPU machine (the same start takes 30 s alone on 2 cores)
            threads = max(1, (os.cpu_count() or 2) // (args.per_gpu * max(gpus, 1)))
            env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled", NCCL_NVLS_ENABLE="0",
                       OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
            try:
                cmd = j.cmd() if callable(j.cmd) else j.cmd
            except Exception as e:                # noqa: BLE001 - a job that cannot even be built fails alone
                j.state = "fail"
                print(f"[proof] {j.name} failed to start: {e}", flush=True)
                continue
            log = open(work / "logs" / f"{j.name}.log", "w")
            log.write(" ".join(cmd) + "\n")
            log.flush()
            j.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            j.state, j.gpu_ids, j.t0 = "run", ids, time.time()
            print(f"[proof] {j.name} started on {ids}", flush=True)
            states[j.name] = "run"
        save()
        time.sleep(2)
    save()
    print("[proof] finished:", {j.name: j.state for j in jobs}, flush=True)


if __name__ == "__main__":
    main()
