"""Train an EAGLE-3 drafter: features -> drafter (training-time test) -> curves -> engine-ready export.

    python train.py                                   # embedded default: SmolLM2 on CPU, captures first
    python train.py +experiment=tiny                  # seconds
    accelerate launch --num_processes 8 train.py +experiment=kimi_k25
    python train.py +experiment=tiny resume=true      # continue exactly from the last checkpoint
    python train.py +experiment=tiny train.mode=stream data.disk_budget_gb=0.01   # capture while training
    python -m eagle3.export runs/tiny                 # export the latest checkpoint of a run cut short

Setup, then one plain step loop (logging, held-out evaluation and checkpoints are `if` blocks inside
it), then save + export + curves. Everything the run writes lives in `run_dir`.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from accelerate.utils import DistributedType
from omegaconf import OmegaConf

from capture.run import capture_features
from capture.sglang_server import free_port
from eagle3 import checkpoint, config as config_schema, fused
from eagle3.batch import Prefetch
from eagle3.durable import write_text
from eagle3.export import warm_start, write_export
from eagle3.features import check_draft_vocab
from eagle3.loss import CountedRows, TTTOutput, batch_teacher, unigram_correct
from eagle3.losses import check_loss
from eagle3.model import Eagle3Drafter
from eagle3.optim import adamw, clip_grad_norm
from eagle3.plots import plot_runs
from eagle3.profiling import StepProfiler, phase
from eagle3.shape import drafter_shape
from eagle3.sources import (Data, batch_order, captures_in_process, offline_data, online_data,
                            stream_data)
from eagle3.stream import total_steps
from eagle3.targets import load_final_norm, load_head, prepare_target
from eagle3.training import RATE_WINDOW, Logger, Objective, StepStats, eta_seconds, stop_if_not_finite
from eagle3.vocab import DraftVocab, build_vocab, count_tokens

config_schema.register()

def lr_at(step: int, total: int, peak: float, warmup_fraction: float, min_fraction: float) -> float:
    """Linear warmup, then cosine to min_fraction * peak at the last step (derived from the step alone,
    so resuming needs no scheduler state)."""
    warmup = max(1, int(round(warmup_fraction * total)))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_fraction + (1 - min_fraction) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg) -> None:
    """The run, or its stages one after another (train.stages) on one accelerator."""
    try:
        plan = config_schema.plan_stages(cfg)   # every stage's config, checked before the first one starts
        for stage in plan:
            check_settings(stage.c, f"{stage.name}: " if stage.count > 1 else "")
    except ValueError as e:
        sys.exit(f"error: {e}")
    acc = make_accelerator(plan[0].c)   # train.device and dist.* are the same for every stage
    if acc.is_main_process and not cfg.resume:
        set_aside_previous_run(Path(cfg.run_dir))
    acc.wait_for_everyone()
    for stage in plan:
        if stage.count > 1:
            if cfg.resume and stage.done and stage.index < stage.count:
                try:
                    config_schema.check_finished_stage(stage)
                except ValueError as e:
                    sys.exit(f"error: {e}")
                if acc.is_main_process:
                    print(f"[train] {stage.name} finished earlier: {stage.run_dir} (skipped)")
                continue
            if acc.is_main_process:
                print(f"[train] {stage.name}: {stage.run_dir}, from {stage.cfg.drafter.init_from or 'scratch'}")
        train_run(stage.cfg, stage.c, acc)
        acc.free_memory()
    acc.end_training()


def train_run(cfg, c, acc) -> None:
    """One run: set-up, the step loop, save + export + curves, all in c.run_dir (cfg: the same config
    untyped, as config.yaml and wandb record it)."""
    if c.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before cuBLAS starts: its deterministic mode
        torch.use_deterministic_algorithms(True)
    run_dir = Path(c.run_dir)
    device, rank, world, is_main = acc.device, acc.process_index, acc.num_processes, acc.is_main_process
    use_ds = acc.distributed_type == DistributedType.DEEPSPEED
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fused.set_enabled(False if c.train.deterministic else c.train.compile)
    torch.manual_seed(c.train.seed)

    # ---- target (config.json only; loaded whole only to capture or for online training) and data ----
    features_dir = Path(c.data.features_dir)
    features_missing = c.train.mode == "offline" and not (features_dir / "manifest.json").exists()
    if features_missing and not captures_in_process(c):
        sys.exit(capture_command_message(c))
    target = prepare_target(c.target.source, c.target.path, c.target.name, c.target.arch, c.target.random_config,
                            c.target.seed, c.aux_layers)
    info, aux_layers = target.info, target.aux_layers
    if features_missing:
        if is_main:
            print(f"[train] feature dataset {features_dir} missing: capturing it in-process first")
            capture_features(target.dir, aux_layers, c.target, c.data, c.capture, features_dir)
        acc.wait_for_everyone()
    if c.train.mode == "stream":
        data = stream_data(c, target, is_main)
    elif c.train.mode == "offline":
        data = offline_data(c, target, pin=device.type == "cuda")
    else:
        data = online_data(c, target, device, compute_dtype)
    if len(data.train) < c.train.batch_size:
        sys.exit(f"error: {len(data.train)} training samples is fewer than train.batch_size="
                 f"{c.train.batch_size}; raise data.num_samples or lower the batch size")

    vocab_path = run_dir / "vocab.safetensors"
    vocab = draft_vocab(data, info.vocab_size, c.drafter.draft_vocab_size, vocab_path, c.resume, is_main)
    if c.train.mode == "offline":
        check_draft_vocab(features_dir, vocab)   # a compact dataset's stored teacher is over its own

    # ---- drafter, optimizer ----
    # DeepSpeed casts the model and keeps fp32 partitions itself (bf16_params: see build_drafter)
    drafter, shape, lm_head = build_drafter(c, target, vocab, bf16_params=acc.mixed_precision == "bf16" and not use_ds)
    lm_head, vocab = lm_head.to(device, compute_dtype), vocab.to(device)
    model = Objective(drafter, vocab, c.train.ttt_steps, c.train.step_decay, c.train.loss)
    if use_ds and c.dist.zero_stage == 3:
        gather_outside_forward(model, drafter)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    # DeepSpeed steps its own flat fp32 partitions with it (and clips by itself)
    optimizer = adamw(trainable, c.optim.lr, c.optim.betas, c.optim.weight_decay)
    per_rank, micro = split_batch(c.train.batch_size, c.train.micro_batch_size, world)
    if use_ds:
        acc.state.deepspeed_plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=micro,
                                                           gradient_accumulation_steps=per_rank // micro)
    model, optimizer = acc.prepare(model, optimizer)
    total = total_steps(c.train.steps, c.train.epochs, len(data.train), c.train.batch_size)
    start = checkpoint.load_latest(acc, run_dir) if c.resume else 0
    if is_main:
        checkpoint.trim_metrics(run_dir / "metrics.jsonl", start)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    log = Logger(run_dir, is_main, c.train.wandb, cfg)
    if is_main:
        print(f"[train] target {info.name} ({info.model_type}, hidden {info.hidden_size}, {info.num_layers} layers) "
              f"aux_layers {aux_layers}\n[train] {data.desc}\n[train] drafter "
              f"{sum(p.numel() for p in trainable) / 1e6:.1f}M trainable params, draft vocab {len(vocab.d2t)} "
              f"(covers {vocab.coverage:.2%} of assistant tokens), {total} steps x {c.train.batch_size} seqs, "
              f"ttt {c.train.ttt_steps}, device {device}, world {world}")

    S, shard = c.train.ttt_steps, slice(rank * per_rank, (rank + 1) * per_rank)
    batch_of = batch_order(c, data, total)
    # DDP averages gradients over ranks and DeepSpeed also divides by its accumulation steps; each
    # micro-batch's loss is already its share of the global batch's loss, so undo both.
    grad_scale = world * (per_rank // micro if use_ds else 1)

    t2d = vocab.t2d.to(device)

    def host_batches(indices):
        """This rank's micro-batches of one global batch, as the source gives them (host memory)."""
        return [data.make_batch(indices[m:m + micro]) for m in range(0, len(indices), micro)]

    def place(batches):
        """The micro-batches on the device as (batch, teacher, counted rows), and the per-step counts
        of the whole global batch: every micro-batch on every rank divides by the same counts, so the
        shares add up to exactly the loss a single process would compute on the global batch. All the
        micro-batches' counted rows are found here, before any forward is queued: a micro-batch's loss
        needs their number on the host, and it is there long before its turn."""
        parts = []
        for b in batches:
            bt = b.to(device, compute_dtype)
            teacher = batch_teacher(bt, lm_head, vocab.draft_ids, c.train.teacher_temperature)
            parts.append((bt, teacher, CountedRows(bt.loss_mask, bt.attention_mask.bool(), teacher[1], t2d, S)))
        counts = sum(counted.count for _, _, counted in parts)
        return parts, acc.reduce(counts, reduction="sum").clamp(min=1)

    def prepare(indices):
        return place(host_batches(indices))

    def run_loss(bt, teacher, counted, norm):
        with acc.autocast():
            return TTTOutput(*model(bt.input_ids, bt.loss_mask, bt.attention_mask, bt.aux, bt.final, lm_head,
                                    teacher, norm, counted))

    # ---- the loop ----
    # the tokens trained on stay a device count, read at log time (see StepStats)
    t0, unigram = time.time(), None
    tokens_seen = torch.zeros((), dtype=torch.int64, device=device)
    recent = deque([(start - 1, t0)], maxlen=RATE_WINDOW + 1)    # (step, when it ended): the ETA's rate
    prof = StepProfiler(c.train.profile_steps, start, run_dir / "profile", device, enabled=is_main)
    prof.start()
    stop = checkpoint.StopRequest(acc, c.train.log_every)
    ahead = Prefetch(lambda k: host_batches(batch_of(k)[shard]), enabled=c.train.prefetch and data.prefetch)
    for step in range(start, total):
        lr = lr_at(step, total, c.optim.lr, c.optim.warmup_fraction, c.optim.min_lr_fraction)
        for g in optimizer.param_groups:
            g["lr"] = lr
        model.train()
        stats = StepStats(S, device)
        with phase("data"):
            parts, norm = place(ahead.get(step, then=step + 1 if step + 1 < total else None))
        losses = []
        for j, (bt, teacher, counted) in enumerate(parts):
            last = j == len(parts) - 1
            with phase("forward"):
                out = run_loss(bt, teacher, counted, norm)
                losses.append(out.loss.detach())
            if last:   # the step's one wait for the GPU, before the last backward can step
                stop_if_not_finite(losses, [b.sample_ids for b, _, _ in parts], step, run_dir)
            # accelerate tells DeepSpeed each backward's place by sync_gradients: the step's last
            # micro-batch ends the accumulation (DeepSpeed steps the optimizer inside that backward),
            # the others only add gradients (and skip DDP's all-reduce)
            acc.sync_gradients = last
            with phase("backward"), (nullcontext() if last else acc.no_sync(model)):
                acc.backward(out.loss * grad_scale)
            stats.add(out)
            tokens_seen += bt.attention_mask.sum()
        del parts
        with phase("optimizer"):
            if not use_ds and c.optim.grad_clip > 0:
                if acc.scaler is None:
                    clip_grad_norm(optimizer, trainable, c.optim.grad_clip)
                else:   # fp16: the loss scaler unscales the gradients itself
                    acc.clip_grad_norm_(trainable, c.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        recent.append((step, time.time()))

        if step % c.train.log_every == 0 or step == total - 1:
            row = stats.reduce(acc, batches=1)
            elapsed = recent[-1][1] - t0
            mem = {"max_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30} if device.type == "cuda" else {}
            log.write({"step": step, "split": "train", "lr": lr, **row,
                       "tok_s": int(tokens_seen) * world / max(elapsed, 1e-9), "eta_s": eta_seconds(recent, step, total),
                       **mem}, total, elapsed)
        if data.held and (step % c.train.eval_every == 0 or step == total - 1):
            ahead.settle()
            model.eval()
            row = heldout_eval(acc, prepare, run_loss, data.held, c.train, shard, vocab, unigram)
            unigram = row["unigram_acc"]
            log.write({"step": step, "split": "heldout", **row}, total)
        saved = None
        if (step + 1) % c.train.save_every == 0 and step + 1 < total:
            saved = checkpoint.save(acc, run_dir, step + 1, vocab_path)
        prof.step()
        if step + 1 < total and stop.due(step):
            ahead.close()
            prof.stop()   # data stays open: a stream's producer sees this process end and stops itself
            saved = saved or checkpoint.save(acc, run_dir, step + 1, vocab_path)
            if is_main:
                log.close()
                print(f"[train] stopped after step {step + 1}/{total}: {saved}\n[train] to go on, run the same "
                      f"command with resume=true", flush=True)
            acc.end_training()
            sys.exit(stop.exit_code)
    stop.close()
    ahead.close()
    prof.stop()

    # ---- save, export, curves ----
    data.close()
    checkpoint.save(acc, run_dir, total, vocab_path)
    full = acc.get_state_dict(model)   # ZeRO-3: gathered by every rank, returned on the main one only
    if is_main:
        exports = write_export(run_dir, full, shape, vocab, target)
        curves = plot_runs([run_dir], run_dir / "curves.png")
        log.close()
        done = {"steps": total, "export": {k: str(v) for k, v in exports.items()}}
        write_text(run_dir / config_schema.DONE, json.dumps(done) + "\n")   # last: every step trained and exported
        print(f"[train] done in {time.time() - t0:.0f}s\n[train] export: {exports['sglang']}  {exports['vllm']}\n"
              f"[train] curves: {curves}\n[train] metrics: {run_dir / 'metrics.jsonl'}")
    acc.wait_for_everyone()


def check_settings(c, where: str = "") -> None:
    """Settings the schema's types cannot check, refused before anything starts."""
    try:
        check_loss(c.train.loss, c.train.teacher_temperature)
    except ValueError as e:
        raise ValueError(f"{where}{e}") from None
    for key in ("log_every", "eval_every", "save_every"):
        if getattr(c.train, key) < 1:
            raise ValueError(f"{where}train.{key}={getattr(c.train, key)}: a number of steps, at least 1 "
                             f"(a value past train.steps acts only at the last step)")


def make_accelerator(c):
    """accelerate's Accelerator for train.device and dist.*: DeepSpeed ZeRO when dist.deepspeed (accelerate
    runs DeepSpeed on GPUs only; a CPU run is a plain one)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    use_cuda = c.train.device == "cuda" or (c.train.device == "auto" and torch.cuda.is_available())
    mixed = c.dist.mixed_precision if c.dist.mixed_precision != "auto" else ("bf16" if use_cuda else "no")
    plugin = None
    if c.dist.deepspeed:
        # a plain `python train.py` is a world of one; its rendezvous port is a free one, so two
        # such runs on one machine do not collide
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, v)
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
        plugin = DeepSpeedPlugin(zero_stage=c.dist.zero_stage, gradient_clipping=c.optim.grad_clip,
                                 offload_optimizer_device="cpu" if c.dist.offload_optimizer else "none",
                                 zero3_save_16bit_model=True)   # ZeRO-3: gather the weights for the export
    acc = Accelerator(cpu=not use_cuda, mixed_precision=mixed, deepspeed_plugin=plugin)
    if plugin is not None and acc.distributed_type != DistributedType.DEEPSPEED and acc.is_main_process:
        print("[train] dist.deepspeed=true needs GPUs: this CPU run trains without DeepSpeed")
    return acc


def draft_vocab(data: Data, vocab_size: int, draft_size: int, path: Path, resume: bool,
                is_main: bool) -> DraftVocab:
    """The draft vocabulary: the most frequent assistant tokens of the training samples, computed once
    per dataset and saved in run_dir (the main process writes it), reused on resume."""
    if resume and path.exists():
        return DraftVocab.load(path)
    pairs = [data.tokens_of(i) for i in data.train]
    counts = count_tokens([t for t, _ in pairs], [m for _, m in pairs], vocab_size)
    vocab = build_vocab(counts, min(draft_size, vocab_size))
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        vocab.save(path)
    return vocab


def build_drafter(c, target, vocab: DraftVocab, bf16_params: bool):
    """The drafter on the target's frozen embedding, its shape, and the target's lm_head [V, Ht] (the teacher)."""
    embed, lm_head = load_head(target.dir)
    shape = drafter_shape(target.info, c.drafter, num_aux=len(target.aux_layers), draft_vocab_size=len(vocab.d2t))
    torch.manual_seed(c.train.seed)   # the same init whether or not this process captured or built a target first
    drafter = Eagle3Drafter(shape)
    drafter.set_target_embedding(embed)
    if c.drafter.head_from_target:   # warm start: the target's own output space (its lm_head rows, final norm)
        with torch.no_grad():
            drafter.lm_head.weight.copy_(lm_head[vocab.draft_ids])
            drafter.norm.weight.copy_(load_final_norm(target.dir))
    if c.drafter.init_from:
        if c.drafter.head_from_target:
            raise ValueError("drafter.init_from and drafter.head_from_target both set the head: choose one")
        got = warm_start(drafter, Path(c.drafter.init_from), vocab, lm_head, target)
        print(f"[train] drafter from {got['from']}: {got['kept_rows']} lm_head rows kept, "
              f"{got['mapped_rows']} mapped from the target's head"
              + (f"; {got['new_layers']} layer(s) added on top, each starting as the identity"
                 if got["new_layers"] else ""))
    if bf16_params:
        # bf16 parameters, their fp32 masters in the optimizer's state (eagle3/optim.py): the
        # forward reads the weights as they are and the gradients stay bf16 up to the step.
        # fp16 runs keep fp32 parameters, since the loss scaler will not unscale fp16 gradients.
        drafter.to(torch.bfloat16)
    return drafter, shape, lm_head


def gather_outside_forward(model: torch.nn.Module, drafter: Eagle3Drafter) -> None:
    """ZeRO-3: the loss casts the weights once per unroll (Eagle3Drafter.weights, .project) and uses
    them outside their own modules' forward, so ZeRO-3 must gather them for the Objective's forward
    instead (they would be empty). The norms need it not, and it costs them nothing."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    for p in drafter.parameters():
        if p.requires_grad:
            register_external_parameter(model, p)


def split_batch(batch_size: int, micro_batch_size: int, world: int) -> tuple[int, int]:
    """(sequences per rank, sequences per micro batch) of one global batch."""
    per_rank = batch_size // world
    micro = micro_batch_size or per_rank
    if per_rank * world != batch_size or per_rank % micro:
        sys.exit(f"error: train.batch_size={batch_size} must split evenly over {world} processes "
                 f"and micro batches of {micro}")
    return per_rank, micro


def heldout_eval(acc, prepare, run_loss, held: list[int], t, shard: slice, vocab: DraftVocab,
                 unigram: float | None) -> dict:
    """Loss, accuracy and acceptance on the first t.eval_batches global batches of the held-out
    samples, and the always-draft-the-most-frequent-token baseline (computed once: pass it back)."""
    # Full global batches only (the last wraps around to the start): every rank must run the same
    # number of forwards, since ZeRO-3 gathers the parameters collectively in each one and a rank
    # left without samples would hang the others.
    n, bs = len(held), t.batch_size
    batches = [[held[(k + j) % n] for j in range(bs)] for k in range(0, n, bs)][:t.eval_batches]
    stats, uni = StepStats(t.ttt_steps), torch.zeros(2, device=acc.device)
    with torch.no_grad():
        for gb in batches:
            parts, norm = prepare(gb[shard])
            for bt, teacher, counted in parts:
                stats.add(run_loss(bt, teacher, counted, norm))
                if unigram is None:
                    uni += torch.tensor(unigram_correct(bt.loss_mask, bt.attention_mask, teacher[1], vocab,
                                                        int(vocab.counts.argmax())), device=acc.device)
    if unigram is None:
        uni = acc.reduce(uni, reduction="sum")
        unigram = float(uni[0] / uni[1].clamp(min=1))
    return {**stats.reduce(acc, batches=len(batches)), "unigram_acc": unigram}


def set_aside_previous_run(run_dir: Path) -> None:
    """A fresh run (resume=false) in a run_dir that already holds a run (or a run's first stage) moves
    the old one aside instead of mixing with or deleting it."""
    held = (run_dir / "metrics.jsonl", run_dir / "checkpoints", config_schema.stage_dir(run_dir, 1))
    if any(p.exists() for p in held):
        old = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S', time.localtime(run_dir.stat().st_mtime))}")
        run_dir.rename(old)
        print(f"[train] {run_dir} held an earlier run: moved it to {old} (pass resume=true to continue a run)")


def capture_command_message(c) -> str:
    """The commands that make the missing feature dataset, then train: regeneration (when
    capture.regenerate), capture, training. SGLang servers run in $EAGLE3_SGLANG_PYTHON's environment."""
    from capture.sglang_server import capture_server_cmd
    from eagle3.serving import SGLANG_PYTHON_ENV, sglang_python

    overrides = " ".join(a for a in sys.argv[1:] if not a.startswith("resume"))
    sglang = c.capture.backend == "sglang"
    env = f"{SGLANG_PYTHON_ENV}={os.environ.get(SGLANG_PYTHON_ENV) or '$PWD/.venv-sglang-gpu/bin/python'} " if sglang else ""
    where = f"SGLang at TP {c.capture.tp_size}" if sglang else "in-process"
    lines = [f"error: feature dataset {c.data.features_dir} not found (no manifest.json). Make it, then train "
             f"(docs/runbook_kimi.md):"]
    n = 1
    if c.capture.regenerate:
        lines += [f"  {n}. the target answers every user turn itself ({where}; cached, a rerun resumes):",
                  f"     {env}python -m capture {overrides} capture.regenerate_only=true"]
        n += 1
    lines += [f"  {n}. capture the features ({where}" + ("; the client starts and stops the capture server):"
                                                        if sglang else "):"),
              f"     {env}python -m capture {overrides}"]
    config = Path(c.target.path) / "config.json"
    if sglang and c.aux_layers and config.is_file():
        cfg = json.loads(config.read_text())
        archs = cfg.get("architectures") or []
        server = capture_server_cmd(c.target.path, c.capture.tp_size, c.aux_layers, archs, 30000, c.capture.server_args,
                                    trust_remote_code=c.target.trust_remote_code, python=sglang_python())
        lines += ["     or with a capture server of your own (its environment: EAGLE3_SPOOL_DIR="
                  f"{c.capture.spool_dir} EAGLE3_AUX_LAYERS={','.join(map(str, c.aux_layers))}):",
                  f"     {' '.join(server)}",
                  f"     python -m capture {overrides} capture.server_url=http://127.0.0.1:30000"]
    launcher = "accelerate launch --num_processes 8 " if c.dist.deepspeed else "python "
    lines += [f"  {n + 1}. train:", f"     {launcher}train.py {overrides}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
