"""Reproduce the SmolLM2 figures of docs/results.md and the scale-out rows of docs/perf.md on your GPUs.

    python scripts/reproduce_smollm2.py --work /data/repro                        # every visible GPU
    python scripts/reproduce_smollm2.py --work /data/repro --gpus 2 --only regen_all,long_b32_e10_g32
    python scripts/reproduce_smollm2.py --work /data/repro --answers answers.jsonl --only long_b32_e10_g32
    python scripts/reproduce_smollm2.py --work /data/repro --regen-conversations 4096 --eval-backend replay \
        --only regen_all,abl_base,abl_norms,abl_mlp4x,eval_ablations       # a few ablations, judged together
    python scripts/reproduce_smollm2.py --work /data/repro --list                 # the commands, nothing run
    python scripts/reproduce_smollm2.py --work /tmp/dry --dry-run                 # the same graph on CPU, tiny sizes

Each job is a plain command of this repository (print them with --list), logged to WORK/logs/NAME.log,
its run directory WORK/runs/NAME:
    regen_peer     SmolLM2's own answers to the first 8,000 short ShareGPT first turns
    regen_all      SmolLM2's own answers to every ShareGPT user turn (--regen-minutes: stop in time;
                   rerun to go on)
    regen_sampled  a second answer to every user turn of the first 6,144 conversations, sampled at
                   temperature 0.7 (capture.regen_temperature), cached apart from regen_all's
    regen_scale    the answers conf/experiment/smollm2_scale.yaml trains on: regen_all's, and a
                   second one to every user turn sampled at 0.7
    scale_best     smollm2_scale's defaults from the committed recipe's export, in its two stages (the
                   best drafter; the first stage's in scale_best/stage1); eval_best pairs both against
                   the committed recipe's drafter on all 80 MT-Bench first turns, chains 3 and 7
    peer_*         the same work as SpecForge's run (conf/experiment/smollm2_peer.yaml), its recipe
                   and our changes to it (lr, TTT 1, the original ShareGPT answers)
    scale_*        one epoch over the first conversations holding 8k / 20k / 30k / 55k prompts;
                   scale_55k_warm: lm_head and norm started from the target's
    long_*         several epochs over all answers; long_norms_ttt4_b32_e12_g32 is the committed drafter's
                   recipe; long_init_v12288_e5 goes on from its export with a 12,288-token draft vocab
                   (five epochs), long_init_v32768_e3 with 32,768 tokens (three epochs over the first
                   12,288 conversations), long_init_v32768_e3_all from that one (three epochs over
                   every answered conversation), long_init_v32768_l2 from that one grown to two
                   layers, long_init_v32768_l2_d06 from that one with TTT step weights 0.6^s;
                   long_init_v32768_one all of those changes at once, in one stage of 900 steps
                   from the committed drafter's export, long_init_v32768_one_loops16 the same with
                   each repetition loop's tail out of the loss (data.loop_tokens=16),
                   long_init_v32768_one_loops16_s2 a second such stage from that one,
                   long_init_v32768_one_t05 / _t15 / _t25 the one stage with the teacher tempered
                   (train.teacher_temperature 0.5, 1.5, 2.5), long_init_v32768_one_1500 with 1,500 steps,
                   long_init_v32768_one_sampled on regen_all's answers and regen_sampled's together
                   (data.mix)
    abl_*          ablations: one technique each against abl_base, on identical data and steps (the
                   first 4,096 conversations, two epochs of batch 16): the loss (lk, lk_alpha, tv,
                   jsd; kl has soft_ce's gradient), EAGLE-3.1's norms, TTT step weights (uniform,
                   0.6^s) and length, draft vocab 8,192, the head warm-started from the target's,
                   four epochs, a 2x and a 4x wider MLP, a second decoder layer (each also with
                   the norms), only each conversation's first turn, the top aux layer moved
                   from 27 to 29 (with the norms), repetition-loop tails out of the loss
    fmt_*          the ablation recipe trained offline from full and from compact features (capture.format);
                   the pair, from eval_ablations' output: python -m eagle3.judging
                   WORK/runs/eval_ablations/eval --reference fmt_full
    eval_*         evaluate.py per group (--eval-backend, default vllm; the docs' tau are vLLM's);
                   eval_abl_* judge one ablation each on all 80 MT-Bench first turns at chains 3
                   and 7 without a baseline decode (tau only), so they run side by side;
                   eval_ablations judges every ablation trained so far in one run, each paired
                   against abl_base (with --eval-backend replay, one greedy decode per prompt
                   serves every drafter)
    zero3_*        (2+ GPUs) ZeRO-3 on 2 GPUs against 1, same global batch, tiny target
    kimi_zero3_*   (2+ GPUs) the Kimi-size drafter (conf/experiment/kimi_dims.yaml) under ZeRO-3,
                   1 GPU against 2: losses, tokens/s and memory per GPU
A job starts once its dependencies have finished; at most --per-gpu jobs share a GPU, and timed jobs
run alone on theirs. A job that runs out of GPU memory runs again, once, when fewer jobs share its
GPU. WORK/status.json says what ran, for how long, and how it ended. Rerunning skips jobs already
done; --only runs a subset (a dependency left out counts as done; the scale and long runs then need
--answers, a regenerated-answers file from regen_all).

SIGTERM or Ctrl-C (a scheduler's time limit, `timeout`) is passed on once to every running job: a
training saves a checkpoint of the step it is in and exits, and the run ends with those jobs marked
`stopped`. Rerunning goes on from there: a training whose run directory holds a checkpoint resumes
from it (resume=true), to the same weights as if it had never stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclass
class Job:
    name: str
    cmd: Callable[[], List[str]] | List[str]    # a callable is built when the job starts
    deps: List[str] = field(default_factory=list)
    gpus: int = 1                                 # 1: the freest GPU; 0: every GPU; 2: two GPUs
    exclusive: bool = False                       # alone on its GPUs (its timings are reported)
    after: List[str] = field(default_factory=list)  # jobs that must have ended, well or not
    state: str = "wait"                           # wait | run | ok | fail | stopped (by a signal)
    proc: Optional[subprocess.Popen] = None
    gpu_ids: List[int] = field(default_factory=list)
    t0: float = 0.0
    t1: float = 0.0
    retried: bool = False                         # ran out of GPU memory once and was queued again
    crowd: int = 0                                # the jobs beside it then; it starts again beside fewer


def prompts_prefix(answers: Path, n_prompts: int) -> int:
    """How many conversations, from the start of the file, hold n_prompts answered user turns."""
    total = 0
    with open(answers) as f:
        for i, line in enumerate(f, 1):
            total += sum(m["role"] == "assistant" for m in json.loads(line)["messages"])
            if total >= n_prompts:
                return i
    return 0


PEER = {"peer_specforge_recipe": [],                        # lr 1e-4: exactly SpecForge's settings
        "peer_lr3e-4": ["optim.lr=3e-4"],
        "peer_lr1e-3": ["optim.lr=1e-3"],
        "peer_lr1e-3_ttt1": ["optim.lr=1e-3", "train.ttt_steps=1"],
        "peer_lr1e-3_original": ["optim.lr=1e-3", "capture.regenerate=false"]}
# one epoch of batch 16 over the first conversations that hold this many answered prompts (55,085:
# the first 16,384 conversations of the greedy answer file)
# the drafter before EAGLE-3.1's norms and TTT 4 became the defaults: the scaling curve, the early
# long runs and the ablations keep it, so that their documented rows do not move
PLAIN = ["drafter.fc_norm=false", "drafter.norm_output=false", "train.ttt_steps=7"]
SCALE_COMMON = [*PLAIN, "train.epochs=1", "train.batch_size=16", "optim.lr=1e-3", "train.length_groups=0"]
SCALE = {"scale_8k": (8000, []), "scale_20k": (20000, []), "scale_30k": (29600, []), "scale_55k": (55085, []),
         "scale_55k_warm": (55085, ["drafter.head_from_target=true"])}
# several epochs over all answers
LONG = {
        "long_b128": [*PLAIN, "train.batch_size=128", "optim.lr=3e-3", "train.epochs=3", "train.length_groups=0"],
        "long_b64": [*PLAIN, "train.batch_size=64", "optim.lr=2e-3", "train.epochs=3", "train.length_groups=0"],
        "long_b64_e5": [*PLAIN, "train.batch_size=64", "optim.lr=2e-3", "train.epochs=5", "train.length_groups=0"],
        "long_b64_e10_g32": [*PLAIN, "train.batch_size=64", "optim.lr=2e-3", "train.epochs=10",
                             "train.length_groups=32"],
        "long_b32_e10_g32": [*PLAIN, "train.batch_size=32", "optim.lr=1.5e-3", "train.epochs=10",
                             "train.length_groups=32"]}
# long_b32_e10_g32 with EAGLE-3.1's norms, for ten and for twenty epochs, and with a 4x wider MLP
_NORMS = ["train.batch_size=32", "optim.lr=1.5e-3", "train.length_groups=32", "drafter.fc_norm=true",
          "drafter.norm_output=true"]
for _epochs in (10, 20):
    LONG[f"long_norms_b32_e{_epochs}_g32"] = [*_NORMS, f"train.epochs={_epochs}", "train.ttt_steps=7"]
LONG["long_norms_mlp4x_b32_e10_g32"] = [*_NORMS, "train.epochs=10", "train.ttt_steps=7", "drafter.intermediate_size=6144"]
# the committed drafter: the norms and TTT 4 (both ahead in the ablations); TTT 4's cheaper steps pay
# for two more epochs in about the earlier recipe's GPU time
LONG["long_norms_ttt4_b32_e12_g32"] = [*_NORMS, "train.epochs=12", "train.ttt_steps=4"]
# every change of the staged runs at once: 32,768 tokens, a second layer grown on top, step weights
# 0.6^s, 900 steps (under two epochs) over every answered conversation
def one_stage(steps: int = 900) -> List[str]:
    return ["drafter.draft_vocab_size=32768", "drafter.num_layers=2", "train.step_decay=0.6", f"train.steps={steps}",
            "optim.lr=1e-3"]


ONE_STAGE = one_stage()
# a second stage from a finished long run's export (drafter.init_from): its rows kept, the draft vocab
# grown to 12,288 (new rows mapped from the target's head), five more epochs at a lower peak lr
# second stages, each from a first stage's export (drafter.init_from) with a larger draft vocab:
# name: (first stage, conversations from the start of the answer file (0: all), overrides)
INIT = {"long_init_v12288_e5": ("long_norms_ttt4_b32_e12_g32", 0,
                                ["drafter.draft_vocab_size=12288", "train.epochs=5", "optim.lr=1e-3"]),
        "long_init_v32768_e3": ("long_norms_ttt4_b32_e12_g32", 12288,
                                ["drafter.draft_vocab_size=32768", "train.epochs=3", "optim.lr=1e-3"]),
        # a third stage: the 32,768-token drafter, three more epochs over every answered conversation
        "long_init_v32768_e3_all": ("long_init_v32768_e3", 0,
                                    ["drafter.draft_vocab_size=32768", "train.epochs=3", "optim.lr=1e-3"]),
        # the third stage grown by a second layer that starts as the identity, three more epochs
        "long_init_v32768_l2": ("long_init_v32768_e3_all", 0,
                                ["drafter.draft_vocab_size=32768", "drafter.num_layers=2", "train.epochs=3",
                                 "optim.lr=5e-4"]),
        # and three more with the later TTT steps weighted 0.6^s
        "long_init_v32768_l2_d06": ("long_init_v32768_l2", 0,
                                    ["drafter.draft_vocab_size=32768", "drafter.num_layers=2", "train.epochs=3",
                                     "optim.lr=5e-4", "train.step_decay=0.6"]),
        # the same changes in one stage from the committed drafter (ONE_STAGE)
        "long_init_v32768_one": ("long_norms_ttt4_b32_e12_g32", 0, ONE_STAGE),
        # the same with each repetition loop's tail out of the loss
        "long_init_v32768_one_loops16": ("long_norms_ttt4_b32_e12_g32", 0, [*ONE_STAGE, "data.loop_tokens=16"]),
        # and a second stage of the same 900 steps from that one
        "long_init_v32768_one_loops16_s2": ("long_init_v32768_one_loops16", 0, [*ONE_STAGE, "data.loop_tokens=16"]),
        # the one-stage run with a tempered teacher (softmax(logits / T)), and with 1,500 steps
        "long_init_v32768_one_t05": ("long_norms_ttt4_b32_e12_g32", 0, [*ONE_STAGE, "train.teacher_temperature=0.5"]),
        "long_init_v32768_one_t15": ("long_norms_ttt4_b32_e12_g32", 0, [*ONE_STAGE, "train.teacher_temperature=1.5"]),
        "long_init_v32768_one_t25": ("long_norms_ttt4_b32_e12_g32", 0, [*ONE_STAGE, "train.teacher_temperature=2.5"]),
        "long_init_v32768_one_1500": ("long_norms_ttt4_b32_e12_g32", 0, one_stage(steps=1500))}
# the one stage on the greedy answers and a sampled second answer to the first SAMPLED_CONVERSATIONS
# conversations' turns (regen_sampled), each file one entry of data.mix: name: steps
SAMPLED_CONVERSATIONS = 6144
SAMPLED_TEMPERATURE = 0.7
SAMPLED = {"long_init_v32768_one_sampled": 900}

# ablations: the first ABL_CONVERSATIONS conversations of the answer file, two epochs of batch 16
ABL_CONVERSATIONS = 4096
ABL_COMMON = [*PLAIN, "train.batch_size=16", "optim.lr=1e-3", "train.epochs=2", "train.length_groups=32"]
ABLATE = {"abl_base": [],
          "abl_lk": ["train.loss=lk"],
          "abl_lk_alpha": ["train.loss=lk_alpha"],
          "abl_tv": ["train.loss=tv"],
          "abl_jsd": ["train.loss=jsd"],
          "abl_norms": ["drafter.fc_norm=true", "drafter.norm_output=true"],
          "abl_decay1": ["train.step_decay=1.0"],
          "abl_decay06": ["train.step_decay=0.6"],
          "abl_ttt4": ["train.ttt_steps=4"],
          "abl_v8192": ["drafter.draft_vocab_size=8192"],
          "abl_warm": ["drafter.head_from_target=true"],
          "abl_e4": ["train.epochs=4"],
          "abl_mlp2x": ["drafter.intermediate_size=3072"],      # the target's MLP width is 1,536
          "abl_mlp4x": ["drafter.intermediate_size=6144"],
          "abl_layers2": ["drafter.num_layers=2"],
          "abl_norms_mlp4x": ["drafter.fc_norm=true", "drafter.norm_output=true", "drafter.intermediate_size=6144"],
          "abl_norms_layers2": ["drafter.fc_norm=true", "drafter.norm_output=true", "drafter.num_layers=2"],
          "abl_turn1": ["data.turns=1"],
          # the norms with the top aux layer at the last decoder layer's input instead of n-3 = 27
          "abl_norms_top29": ["drafter.fc_norm=true", "drafter.norm_output=true", "aux_layers=[2,15,29]"],
          # each repetition loop's tail out of the loss (its first 16 repeating tokens stay); the
          # held-out figures then count the same mask, so compare this one with the others in an engine
          "abl_loops16": ["data.loop_tokens=16"]}
# the feature format: the ablation recipe trained offline from a full and from a compact feature
# dataset of the same samples (same seed and steps)
FORMATS = {"fmt_full": "full", "fmt_compact": "compact"}


def build_jobs(work: Path, dry: bool, gpus: int, regen_minutes: float = 0.0, regen_chunk: int = 4096,
               answers: Optional[Path] = None, eval_backend: str = "vllm", regen_conversations: int = 0,
               regen_continuous: bool = False, sampled: Optional[Path] = None) -> List[Job]:
    tiny = (["target=tiny_llama", "aux_layers=[2,3,4]", "data.num_samples=24", "train.steps=4",
             "train.batch_size=4", "drafter.draft_vocab_size=512", "capture.regen_max_new_tokens=8",
             "capture.regen_batch_size=8", "data.max_length=256"] if dry else [])
    ev_tiny = ["eval.num_prompts=2", "eval.max_new_tokens=8"] if dry else []
    runs = work / "runs"

    def regen(exp, *over):
        return [PY, "-m", "capture", f"+experiment={exp}", "capture.regenerate_only=true", *over, *tiny]

    def train(exp, name, *over):
        stopped = (runs / name / "checkpoints" / "latest").exists() or any((runs / name).glob("stage*/checkpoints/latest"))
        resume = ["resume=true"] if stopped else []
        return [PY, "train.py", f"+experiment={exp}", f"run_dir={runs / name}", "train.wandb=false", *over, *tiny,
                *resume]

    def answers_path() -> Path:
        return answers or _answers_from_log(work / "logs" / "regen_all.log")

    def on_answers(n_prompts: int) -> List[str]:
        path = answers_path()
        n = prompts_prefix(path, n_prompts) if n_prompts else 0
        if n_prompts and not n:
            raise RuntimeError(f"{path} holds fewer than {n_prompts} answered prompts")
        return ["data.source=jsonl", f"data.path={path}", f"data.num_samples={n}", "capture.regenerate=false"]

    def scale_train(name, n_prompts, *over):
        return lambda: train("smollm2_committed", name, *on_answers(n_prompts // 1000 if dry else n_prompts), *over)

    def evaluate(exp, group, names, prompts, data=lambda: [], *over, trained_only=False):
        """trained_only: judge those of `names` whose run has an export (a subset run with --only)."""
        def cmd():
            judged = [n for n in names if not trained_only or (runs / n / "export" / "vllm").is_dir()]
            if not judged:
                raise RuntimeError(f"none of {', '.join(names)} has an export under {runs}")
            return [PY, "evaluate.py", f"+experiment={exp}", f"eval.backend={eval_backend}", f"run_dir={runs / group}",
                    "eval.drafters=[" + ",".join(str(runs / n) for n in judged) + "]", f"eval.prompts=[{prompts}]",
                    *data(), *over, *tiny, *ev_tiny]
        return cmd

    def second_stage(name, start: Path, conversations: int, *over):
        n = conversations // 100 if dry else conversations
        return lambda: train("smollm2_committed", name, *on_answers(0)[:2], f"data.num_samples={n}",
                             "capture.regenerate=false", f"drafter.init_from={start}", *over)

    def with_sampled(name, start: Path, steps: int):
        def cmd():
            paths = [answers_path(), sampled or _answers_from_log(work / "logs" / "regen_sampled.log")]
            mix = ",".join(f"{{source:jsonl,path:'{p}'}}" for p in paths)
            return train("smollm2_committed", name, f"data.mix=[{mix}]", "data.num_samples=0", "capture.regenerate=false",
                         f"drafter.init_from={start}", *one_stage(4 if dry else steps))
        return cmd

    def ablation(name, *over):
        n = ABL_CONVERSATIONS // 100 if dry else ABL_CONVERSATIONS
        return lambda: train("smollm2_committed", name, *on_answers(0)[:2], f"data.num_samples={n}",
                             "capture.regenerate=false", *ABL_COMMON, *over)

    # regen_all shares its GPUs with trainings; the 2-GPU checks go first (they are short)
    jobs = [Job("regen_peer", regen("smollm2_peer"), gpus=0, exclusive=True),
            Job("regen_all", regen("smollm2_committed", f"capture.regen_minutes={regen_minutes}",
                                   f"capture.regen_chunk={regen_chunk}",
                                   *([f"data.num_samples={regen_conversations}"] if regen_conversations else []),
                                   *(["capture.regen_continuous=true"] if regen_continuous else [])),
                deps=["regen_peer"], gpus=0,
                after=["zero3_2gpu", "kimi_zero3_2gpu"] if gpus >= 2 else []),
            Job("regen_sampled", regen("smollm2_committed", f"capture.regen_temperature={SAMPLED_TEMPERATURE}",
                                       f"data.num_samples={SAMPLED_CONVERSATIONS // 1024 if dry else SAMPLED_CONVERSATIONS}",
                                       f"capture.regen_chunk={regen_chunk}"), deps=["regen_all"], gpus=0),
            # after regen_sampled: its sampled answers differ from these only in data.num_samples, so
            # this regeneration starts from them (capture/regenerate.py) and answers only the rest
            Job("regen_scale", regen("smollm2_scale", f"capture.regen_chunk={regen_chunk}"), deps=["regen_all"],
                gpus=0, after=["regen_sampled"])]
    jobs += [Job(n, train("smollm2_peer", n, *o), deps=["regen_peer"]) for n, o in PEER.items()]
    jobs += [Job(n, scale_train(n, k, *SCALE_COMMON, *o), deps=["regen_all"]) for n, (k, o) in SCALE.items()]
    jobs += [Job(n, scale_train(n, 0, *o), deps=["regen_all"]) for n, o in LONG.items()]
    jobs += [Job(n, second_stage(n, runs / start, k, *o), deps=[start]) for n, (start, k, o) in INIT.items()]
    committed = "long_norms_ttt4_b32_e12_g32"
    jobs += [Job(n, with_sampled(n, runs / committed, steps), deps=[committed, "regen_sampled"])
             for n, steps in SAMPLED.items()]
    jobs += [Job("scale_best", lambda: train("smollm2_scale", "scale_best", f"drafter.init_from={runs / committed}",
                                             *(["train.stages.0.train.steps=4"] if dry else [])),
                 deps=[committed, "regen_scale"]),
             Job("eval_best", evaluate("smollm2_scale", "eval_best", [committed, "scale_best/stage1", "scale_best"],
                                       "mt_bench", lambda: [], "eval.num_prompts=0", "eval.chains=[3,7]",
                                       "eval.baseline=false"),
                 deps=[committed, "scale_best"])]
    # the format pair first: each captures its features before it trains
    jobs += [Job(n, ablation(n, "train.mode=offline", f"capture.format={f}",
                             f"data.features_dir={work / 'features' / n}"), deps=["regen_all"]) for n, f in FORMATS.items()]
    jobs += [Job(n, ablation(n, *o), deps=["regen_all"]) for n, o in ABLATE.items()]
    jobs += [Job(f"eval_{n}", evaluate("smollm2_committed", f"eval_{n}", [n], "mt_bench", lambda: [],
                                       "eval.num_prompts=0", "eval.chains=[3,7]", "eval.baseline=false"),
                 deps=[n]) for n in [*ABLATE, *FORMATS]]
    jobs += [Job("eval_ablations", evaluate("smollm2_committed", "eval_ablations", [*ABLATE, *FORMATS], "mt_bench",
                                            lambda: [], "eval.num_prompts=0", "eval.chains=[3,7]",
                                            "eval.baseline=false", "eval.reference=abl_base", trained_only=True),
                 deps=[*ABLATE, *FORMATS])]
    jobs += [Job("eval_peer", evaluate("smollm2_peer", "eval_peer", list(PEER), "mt_bench"), deps=list(PEER)),
             Job("eval_scale", evaluate("smollm2_committed", "eval_scale", list(SCALE), "mt_bench"), deps=list(SCALE)),
             Job("eval_long", evaluate("smollm2_committed", "eval_long", list(LONG), "mt_bench,mt_bench_2turn,sharegpt_heldout",
                                       lambda: on_answers(0)[:2]), deps=list(LONG))]
    if gpus >= 2:
        base = ["+experiment=tiny", f"data.features_dir={work / 'features_tiny'}", "train.steps=20",
                "train.batch_size=8", "train.wandb=false", "dist=zero3"]
        launch = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
        jobs.append(Job("zero3_1gpu", [PY, "train.py", *base, f"run_dir={runs / 'zero3_1gpu'}"]))
        jobs.append(Job("zero3_2gpu", [*launch, "29611", "train.py", *base, f"run_dir={runs / 'zero3_2gpu'}"],
                        deps=["zero3_1gpu"], gpus=2))
        # eager, so that no compiling falls inside the timed steps
        kimi = ["+experiment=kimi_dims", "train.compile=false"]
        jobs.append(Job("kimi_zero3_1gpu", [PY, "train.py", *kimi, f"run_dir={runs / 'kimi_zero3_1gpu'}"],
                        exclusive=True))
        jobs.append(Job("kimi_zero3_2gpu", [*launch, "29612", "train.py", *kimi, f"run_dir={runs / 'kimi_zero3_2gpu'}"],
                        deps=["kimi_zero3_1gpu"], gpus=2, exclusive=True))
    return jobs


def _answers_from_log(log: Path) -> Path:
    if log.exists():
        for line in log.read_text().splitlines()[::-1]:
            if line.startswith("[capture] regenerated conversations: "):
                return Path(line.split(": ", 1)[1].strip())
    raise RuntimeError(f"no answer file: regen_all has not run ({log}); give one with --answers")


def out_of_memory(log: Path) -> bool:
    """Did the job's process stop because a GPU allocation failed (torch's message in its log)?"""
    try:
        return "CUDA out of memory" in log.read_text(errors="replace")[-20000:]
    except OSError:
        return False


def run(jobs: List[Job], work: Path, gpus: int, per_gpu: int, grace_s: float = 300.0) -> int:
    """Run the jobs to the end; returns 0, or 128 + the signal that stopped the run (see the module's
    docstring): each running job got SIGTERM once and grace_s to exit before it is killed."""
    status_path = work / "status.json"
    slots = [per_gpu] * max(gpus, 1)             # free job slots per GPU
    start = time.time()
    signals = []
    previous = {s: signal.signal(s, lambda signum, frame: signals.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}

    def save():
        status_path.write_text(json.dumps({j.name: {"state": j.state, "gpus": j.gpu_ids,
                                                    "start_s": round(j.t0 - start, 1) if j.t0 else None,
                                                    "secs": round((j.t1 or time.time()) - j.t0, 1) if j.t0 else None}
                                           for j in jobs}, indent=1))

    def cost(j):
        return per_gpu if j.exclusive else 1

    def sharing(g):
        return sum(k.state == "run" and g in k.gpu_ids for k in jobs)

    while any(j.state in ("wait", "run") for j in jobs) and not signals:
        for j in jobs:
            if j.state == "run" and j.proc.poll() is not None:
                j.state, j.t1 = ("ok" if j.proc.returncode == 0 else "fail"), time.time()
                for g in j.gpu_ids:
                    slots[g] += cost(j)
                print(f"[reproduce] {j.name} {j.state} after {j.t1 - j.t0:.0f}s", flush=True)
                others = min((sharing(g) for g in j.gpu_ids), default=0)
                if j.state == "fail" and not j.retried and others and \
                        out_of_memory(work / "logs" / f"{j.name}.log"):
                    # the jobs beside it took the memory: once, it runs again with fewer of them
                    j.retried, j.state, j.crowd = True, "wait", others
                    print(f"[reproduce] {j.name} ran out of GPU memory beside {others} other job(s): "
                          f"it runs again once fewer share its GPU", flush=True)
        states = {j.name: j.state for j in jobs}
        for j in jobs:
            if j.state != "wait":
                continue
            if any(states.get(d) == "fail" for d in j.deps):
                j.state = "fail"
                print(f"[reproduce] {j.name} skipped: a dependency failed", flush=True)
                continue
            if not all(states.get(d, "ok") == "ok" for d in j.deps) or \
                    any(states.get(d) in ("wait", "run") for d in j.after):
                continue
            n = len(slots)
            want = n if j.gpus == 0 else min(j.gpus, n)
            order = sorted(range(n), key=lambda k: -slots[k])[:want]
            if len(order) < want or any(slots[g] < cost(j) for g in order):
                continue
            if j.retried and any(sharing(g) >= j.crowd for g in order):
                continue
            ids = sorted(order)
            try:
                cmd = j.cmd() if callable(j.cmd) else j.cmd
            except Exception as e:                # noqa: BLE001 - a job that cannot even be built fails alone
                j.state = "fail"
                print(f"[reproduce] {j.name} failed to start: {e}", flush=True)
                continue
            for g in ids:
                slots[g] -= cost(j)
            # CPU threads shared out: every process defaults to all cores, and a dozen of them on one
            # host spend their start-up fighting over the CPUs
            threads = max(1, (os.cpu_count() or 2) // (per_gpu * max(gpus, 1)))
            env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled",
                       OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
            log = open(work / "logs" / f"{j.name}.log", "a" if j.retried else "w")
            log.write(shlex.join(cmd) + "\n")
            log.flush()
            # its own session: a signal to this script's group (a terminal's Ctrl-C, `timeout`) reaches
            # the job only through the one SIGTERM passed on below, never twice
            j.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
            j.state, j.gpu_ids, j.t0 = "run", ids, time.time()
            print(f"[reproduce] {j.name} started on {ids}", flush=True)
            states[j.name] = "run"
        save()
        time.sleep(2)
    if signals:
        running = [j for j in jobs if j.state == "run"]
        print(f"[reproduce] {signal.Signals(signals[0]).name}: stopping {[j.name for j in running]} "
              f"(a training saves a checkpoint of its step first)", flush=True)
        for j in running:
            j.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + grace_s
        for j in running:
            try:
                j.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                j.proc.kill()
                j.proc.wait()
            j.state, j.t1 = "stopped", time.time()
    for s, h in previous.items():
        signal.signal(s, h)
    save()
    print("[reproduce] finished:" if not signals else "[reproduce] stopped; rerun the same command to go on:",
          {j.name: j.state for j in jobs}, flush=True)
    return 128 + signals[0] if signals else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="logs, status.json and runs/ go here")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every visible one)")
    ap.add_argument("--per-gpu", type=int, default=4, help="jobs sharing one GPU at most")
    ap.add_argument("--only", default="", help="comma-separated job names (and nothing else)")
    ap.add_argument("--answers", type=Path, help="scale_* and long_* train on this answer file instead of regen_all's")
    ap.add_argument("--sampled-answers", type=Path,
                    help="the *_sampled jobs train on this sampled-answer file instead of regen_sampled's")
    ap.add_argument("--regen-minutes", type=float, default=0.0, help="regen_all: time limit (0 = none)")
    ap.add_argument("--regen-chunk", type=int, default=4096, help="regen_all: conversations answered together")
    ap.add_argument("--regen-conversations", type=int, default=0,
                    help="regen_all: only the first N conversations (the ablations need the first 4,096; 0 = all; a later "
                         "run of all reuses them)")
    ap.add_argument("--regen-continuous", action="store_true",
                    help="regen_all: capture.regen_continuous (rows refilled as answers end, no rounds)")
    ap.add_argument("--eval-backend", default="vllm", choices=["vllm", "hf", "sglang", "replay"],
                    help="replay: the hf backend's counts from one greedy decode per prompt and one forward per "
                         "drafter (no timings)")
    ap.add_argument("--list", action="store_true", help="print each job's command and exit")
    ap.add_argument("--dry-run", action="store_true", help="tiny target and sizes: the whole graph on a CPU")
    args = ap.parse_args()
    if args.gpus is None:
        import torch
        args.gpus = torch.cuda.device_count()
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    jobs = build_jobs(work, args.dry_run, args.gpus, args.regen_minutes, args.regen_chunk, args.answers,
                      args.eval_backend, args.regen_conversations, args.regen_continuous, args.sampled_answers)
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - {j.name for j in jobs}
        if unknown:
            ap.error(f"unknown jobs {sorted(unknown)}; jobs: {', '.join(j.name for j in jobs)}")
        jobs = [j for j in jobs if j.name in keep]
    if args.list:
        for j in jobs:
            try:
                cmd = shlex.join(j.cmd() if callable(j.cmd) else j.cmd)
            except (RuntimeError, OSError) as e:
                cmd = f"(not yet: {e})"
            print(f"{j.name}: {cmd}")
        return
    status_path = work / "status.json"
    done = {k for k, v in json.loads(status_path.read_text()).items() if v["state"] == "ok"} \
        if status_path.exists() else set()
    for j in jobs:
        if j.name in done:
            j.state = "ok"
    sys.exit(run(jobs, work, args.gpus, args.per_gpu))


if __name__ == "__main__":
    main()
