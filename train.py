"""Train an EAGLE-3 drafter: features -> drafter (training-time test) -> curves -> engine-ready export.

    python train.py                                   # embedded default: SmolLM2 on CPU, captures first
    python train.py +experiment=tiny                  # seconds
    accelerate launch --num_processes 8 train.py +experiment=kimi_k25
    python train.py +experiment=tiny resume=true      # continue exactly from the last checkpoint

Setup, then one plain step loop (logging, held-out evaluation and checkpoints are `if` blocks inside
it), then save + export + curves. Everything the run writes lives in `run_dir`.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import OmegaConf

from eagle3 import checkpoint, config as config_schema, fused
from eagle3.engine_ids import check_aux_layers
from eagle3.export import export_drafter
from eagle3.data import is_heldout
from eagle3.features import FeatureDataset, check_compatible, collate, template_sha256
from eagle3.loss import TTTOutput, step_counts, target_teacher, ttt_loss, unigram_correct
from eagle3.model import Eagle3Drafter, drafter_shape
from eagle3.optim import adamw, clip_grad_norm
from eagle3.plots import plot_runs
from capture.run import capture_features
from capture.sglang_server import free_port
from eagle3.targets import (default_aux_layers, load_final_norm, load_head, load_tokenizer, resolve_target,
                            target_info)
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


def batch_indices(step: int, n: int, batch_size: int, seed: int,
                  lengths: torch.Tensor | None = None, groups: int = 0) -> list[int]:
    """The global batch of `step`: epoch e is a seeded permutation of the n samples, cut into n // B
    batches (the remainder is dropped), so the data position is a function of the step.

    With `lengths` [n] and groups > 1, each run of `groups` batches of the permutation is sorted by
    length before it is cut, and the epoch's batches are then shuffled: every batch holds samples
    of similar length, so far less of it is padding (ShareGPT conversations at batch 64: 47% of
    the padded tokens are real at random, 97% grouped by 32), while each epoch still sees every
    sample once, in an order that is still random from batch to batch."""
    per_epoch = n // batch_size
    epoch, k = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=gen)
    if lengths is not None and groups > 1:
        perm = torch.cat([run[torch.argsort(lengths[run], stable=True)]
                          for run in perm[:per_epoch * batch_size].split(groups * batch_size)])
        perm = perm.view(per_epoch, batch_size)[torch.randperm(per_epoch, generator=gen)].flatten()
    return perm[k * batch_size:(k + 1) * batch_size].tolist()


def wandb_mode() -> str:
    """Online only when the user is logged in; WANDB_MODE wins when set."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    logged_in = bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    return "online" if logged_in else "offline"


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    c = config_schema.to_config(cfg)
    run_dir = Path(c.run_dir)
    use_cuda = c.train.device == "cuda" or (c.train.device == "auto" and torch.cuda.is_available())
    mixed = c.dist.mixed_precision if c.dist.mixed_precision != "auto" else ("bf16" if use_cuda else "no")
    ds_plugin = None
    if c.dist.deepspeed:
        # a plain `python train.py` is a world of one; its rendezvous port is a free one, so two
        # such runs on one machine do not collide (a fixed port did, on 2 H200s)
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, v)
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
        ds_plugin = DeepSpeedPlugin(zero_stage=c.dist.zero_stage, gradient_clipping=c.optim.grad_clip,
                                    offload_optimizer_device="cpu" if c.dist.offload_optimizer else "none",
                                    zero3_save_16bit_model=True)   # ZeRO-3: gather the weights for the export
    acc = Accelerator(cpu=not use_cuda, mixed_precision=mixed, deepspeed_plugin=ds_plugin)
    device, rank, world = acc.device, acc.process_index, acc.num_processes
    is_main = acc.is_main_process
    fused.set_enabled(c.train.compile)
    torch.manual_seed(c.train.seed)

    if c.export_only and checkpoint.latest(run_dir) is None:
        sys.exit(f"error: export_only=true exports the latest checkpoint of run_dir, but {run_dir / 'checkpoints'} "
                 f"holds none; pass the run_dir of the run that wrote them")
    if is_main and not (c.resume or c.export_only):
        set_aside_previous_run(run_dir)
    acc.wait_for_everyone()

    features_missing = c.train.mode == "offline" and not (Path(c.data.features_dir) / "manifest.json").exists()
    if features_missing and not captures_in_process(c):
        sys.exit(capture_command_message(c))

    # ---- target facts (config.json only; the target itself is loaded only for online training) ----
    target_dir = resolve_target(c.target.source, c.target.path, c.target.name, c.target.arch,
                                dict(c.target.random_config), c.target.seed)
    info = target_info(target_dir)
    aux_layers = check_aux_layers(list(c.aux_layers) or default_aux_layers(info.num_layers), info.num_layers)
    compute_dtype = torch.bfloat16 if use_cuda else torch.float32

    # ---- data: a feature dataset (offline) or the target in this process (online) ----
    if c.train.mode == "offline":
        features_dir = Path(c.data.features_dir)
        if features_missing:
            if is_main:
                print(f"[train] feature dataset {features_dir} missing: capturing it in-process first")
                capture_features(target_dir, aux_layers, c.target, c.data, c.capture, features_dir)
            acc.wait_for_everyone()
        ds = FeatureDataset(features_dir)
        tok = load_tokenizer(target_dir, c.target.chat_template, c.target.trust_remote_code)
        check_compatible(ds.manifest, {"target": {"fingerprint": info.fingerprint}, "aux_layers": aux_layers,
                                       "hidden_size": info.hidden_size,
                                       "tokenizer": {"chat_template_sha256": template_sha256(tok.chat_template)}},
                         where=str(features_dir))
        # the split is a function of the conversation id (eagle3.data.is_heldout), so it holds for any
        # dataset of the same conversations, whatever fraction the capture was run with
        ids = [ds.sample_id(i) for i in range(len(ds))]
        held = [is_heldout(sid, c.data.heldout_fraction) for sid in ids]
        train_idx = [i for i, h in enumerate(held) if not h]
        held_idx = [i for i, h in enumerate(held) if h]
        tokens_of = lambda i: (ds[i]["input_ids"], ds[i]["loss_mask"])  # noqa: E731
        length_of = ds.length
        make_batch = lambda idx: collate([ds[i] for i in idx], [ids[i] for i in idx])  # noqa: E731
        data_desc = f"features {features_dir} ({len(train_idx)} train / {len(held_idx)} held-out samples)"
    else:
        from capture.online import OnlineSource   # the target runs here; nothing touches disk
        src = OnlineSource(target_dir, c.target, c.data, c.capture, aux_layers, device, compute_dtype)
        train_idx = list(range(len(src.train)))
        held_idx = list(range(len(src.train), len(src.samples)))
        tokens_of = src.tokens
        length_of = lambda i: len(src.samples[i].input_ids)  # noqa: E731
        make_batch = src.batch
        data_desc = f"online target {target_dir} ({len(train_idx)} train / {len(held_idx)} held-out)"
    if len(train_idx) < c.train.batch_size:
        sys.exit(f"error: {len(train_idx)} training samples is fewer than train.batch_size="
                 f"{c.train.batch_size}; raise data.num_samples or lower the batch size")

    # ---- draft vocabulary: computed once per dataset, saved in run_dir, reused on resume ----
    vocab_path = run_dir / "vocab.safetensors"
    if (c.resume or c.export_only) and vocab_path.exists():
        vocab = DraftVocab.load(vocab_path)
    else:
        pairs = [tokens_of(i) for i in train_idx]
        counts = count_tokens([t for t, _ in pairs], [m for _, m in pairs], info.vocab_size)
        vocab = build_vocab(counts, min(c.drafter.draft_vocab_size, info.vocab_size))
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            vocab.save(vocab_path)

    # ---- drafter, optimizer ----
    embed, lm_head = load_head(target_dir)
    shape = drafter_shape(info, c.drafter, num_aux=len(aux_layers), draft_vocab_size=len(vocab.d2t))
    torch.manual_seed(c.train.seed)   # the same init whether or not this process captured or built a target first
    drafter = Eagle3Drafter(shape)
    drafter.set_target_embedding(embed)
    if c.drafter.head_from_target:   # warm start: the target's own output space (its lm_head rows, final norm)
        with torch.no_grad():
            drafter.lm_head.weight.copy_(lm_head[vocab.draft_ids])
            drafter.norm.weight.copy_(load_final_norm(target_dir))
    if mixed == "bf16" and ds_plugin is None:
        # bf16 parameters, their fp32 masters in the optimizer's state (eagle3/optim.py): the
        # forward reads the weights as they are and the gradients stay bf16 up to the step.
        # DeepSpeed casts the model and keeps fp32 partitions itself; fp16 runs keep fp32
        # parameters, since the loss scaler will not unscale fp16 gradients.
        drafter.to(torch.bfloat16)
    lm_head = lm_head.to(device, compute_dtype)
    vocab = vocab.to(device)
    model = Objective(drafter, vocab, c.train.ttt_steps, c.train.step_decay)
    if ds_plugin is not None and c.dist.zero_stage == 3:
        # The loss casts the weights once per unroll (Eagle3Drafter.weights, .project) and uses
        # them outside their own modules' forward: ZeRO-3 must gather them for the Objective's
        # forward instead (they would be empty). The norms need it not, and it costs them nothing.
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter
        for p in drafter.parameters():
            if p.requires_grad:
                register_external_parameter(model, p)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    # DeepSpeed steps its own flat fp32 partitions with it (and clips by itself)
    optimizer = adamw(trainable, c.optim.lr, c.optim.betas, c.optim.weight_decay)
    per_rank = c.train.batch_size // world
    micro = c.train.micro_batch_size or per_rank
    if per_rank * world != c.train.batch_size or per_rank % micro:
        sys.exit(f"error: train.batch_size={c.train.batch_size} must split evenly over {world} processes "
                 f"and micro batches of {micro}")
    if ds_plugin is not None:
        ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro
        ds_plugin.deepspeed_config["gradient_accumulation_steps"] = per_rank // micro
    model, optimizer = acc.prepare(model, optimizer)
    total = c.train.steps or max(1, int(c.train.epochs * (len(train_idx) // c.train.batch_size)))

    start = 0
    if c.resume or c.export_only:
        start = checkpoint.load_latest(acc, run_dir)
    if c.export_only:           # the checkpoint as it is: no step, and the run's metrics and config stay
        total = start
    elif is_main:
        checkpoint.trim_metrics(run_dir / "metrics.jsonl", start)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    log = Logger(run_dir, is_main, c.train.wandb, cfg)
    n_params = sum(p.numel() for p in trainable)
    if is_main:
        print(f"[train] target {info.name} ({info.model_type}, hidden {info.hidden_size}, {info.num_layers} layers) "
              f"aux_layers {aux_layers}\n[train] {data_desc}\n[train] drafter {n_params / 1e6:.1f}M trainable "
              f"params, draft vocab {len(vocab.d2t)} (covers {vocab.coverage:.2%} of assistant tokens), "
              f"{total} steps x {c.train.batch_size} seqs, ttt {c.train.ttt_steps}, device {device}, world {world}")

    S = c.train.ttt_steps
    lengths = torch.tensor([length_of(i) for i in train_idx]) if c.train.length_groups > 1 else None
    # DDP averages gradients over ranks and DeepSpeed also divides by its accumulation steps; each
    # micro-batch's loss is already its share of the global batch's loss, so undo both.
    grad_scale = world * (per_rank // micro if ds_plugin is not None else 1)

    def prepare(indices):
        """This rank's micro-batches of one global batch with their teachers, and the per-step counts
        of the whole global batch: every micro-batch on every rank divides by the same counts, so the
        shares add up to exactly the loss a single process would compute on the global batch."""
        parts = []
        for m in range(0, len(indices), micro):
            bt = make_batch(indices[m:m + micro]).to(device, compute_dtype)
            parts.append((bt, target_teacher(bt.final, lm_head, vocab.draft_ids)))
        counts = torch.zeros(S, dtype=torch.int64, device=device)
        for bt, (_, top) in parts:
            counts += step_counts(bt.loss_mask, bt.attention_mask, top, vocab.t2d, S)
        return parts, acc.reduce(counts, reduction="sum").clamp(min=1)

    def run_loss(bt, teacher, norm):
        with acc.autocast():
            return TTTOutput(*model(bt.input_ids, bt.loss_mask, bt.attention_mask, bt.aux, bt.final, lm_head,
                                    teacher, norm))

    # ---- the loop ----
    t0, tokens_seen, unigram = time.time(), 0, None
    for step in range(start, total):
        lr = lr_at(step, total, c.optim.lr, c.optim.warmup_fraction, c.optim.min_lr_fraction)
        for g in optimizer.param_groups:
            g["lr"] = lr
        idx = batch_indices(step, len(train_idx), c.train.batch_size, c.train.seed, lengths,
                            c.train.length_groups)[rank * per_rank:(rank + 1) * per_rank]
        model.train()
        stats = StepStats(S)
        parts, norm = prepare([train_idx[i] for i in idx])
        for bt, teacher in parts:
            out = run_loss(bt, teacher, norm)
            if not torch.isfinite(out.loss):
                sys.exit(f"error: non-finite loss {out.loss.item()} at step {step} on samples {bt.sample_ids}; "
                         f"the last good checkpoint in {run_dir / 'checkpoints'} is kept")
            acc.backward(out.loss * grad_scale)
            stats.add(out)
            tokens_seen += int(bt.attention_mask.sum())
        del parts
        if ds_plugin is None and c.optim.grad_clip > 0:
            if acc.scaler is None:
                clip_grad_norm(optimizer, trainable, c.optim.grad_clip)
            else:   # fp16: the loss scaler unscales the gradients itself
                acc.clip_grad_norm_(trainable, c.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % c.train.log_every == 0 or step == total - 1:
            row = stats.reduce(acc, batches=1)
            elapsed = time.time() - t0
            mem = {"max_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30} if use_cuda else {}
            log.write({"step": step, "split": "train", "lr": lr, **row,
                       "tok_s": tokens_seen * world / max(elapsed, 1e-9), **mem})
        if held_idx and (step % c.train.eval_every == 0 or step == total - 1):
            model.eval()
            hs, uni = StepStats(S), torch.zeros(2, device=device)
            # Full global batches only (the last wraps around to the start): every rank must run the
            # same number of forwards, since ZeRO-3 gathers the parameters collectively in each one
            # and a rank left without samples would hang the others (seen on 2 H200s).
            n, bs = len(held_idx), c.train.batch_size
            batches = [[held_idx[(k + j) % n] for j in range(bs)] for k in range(0, n, bs)][:c.train.eval_batches]
            with torch.no_grad():
                for gb in batches:
                    parts, norm = prepare(gb[rank * per_rank:(rank + 1) * per_rank])
                    for bt, teacher in parts:
                        hs.add(run_loss(bt, teacher, norm))
                        if unigram is None:      # the always-draft-the-most-frequent-token baseline
                            uni += torch.tensor(unigram_correct(bt.loss_mask, bt.attention_mask, teacher[1], vocab,
                                                                int(vocab.counts.argmax())), device=device)
            if unigram is None:
                uni = acc.reduce(uni, reduction="sum")
                unigram = float(uni[0] / uni[1].clamp(min=1))
            log.write({"step": step, "split": "heldout", **hs.reduce(acc, batches=len(batches)),
                       "unigram_acc": unigram})
        if (step + 1) % c.train.save_every == 0 and step + 1 < total:
            checkpoint.save(acc, run_dir, step + 1, vocab_path)

    # ---- save, export, curves ----
    if not c.export_only:
        checkpoint.save(acc, run_dir, total, vocab_path)
    full = acc.get_state_dict(model)   # ZeRO-3: gathered by every rank, returned on the main one only
    if is_main:
        state = drafter.to_engine_names({k.removeprefix("drafter."): v for k, v in full.items()})
        exports = export_drafter(run_dir / "export", state, shape, vocab.d2t, vocab.t2d, aux_layers,
                                 info.model_type, info.name, info.fingerprint)
        curves = plot_runs([run_dir], run_dir / "curves.png")
        log.close()
        print(f"[train] done in {time.time() - t0:.0f}s\n[train] export: {exports['sglang']}  {exports['vllm']}\n"
              f"[train] curves: {curves}\n[train] metrics: {run_dir / 'metrics.jsonl'}")
    acc.wait_for_everyone()
    acc.end_training()


class Objective(torch.nn.Module):
    """The drafter and its TTT loss as one forward, so DDP and DeepSpeed wrappers see a forward call.
    The target's lm_head [V, Ht] is an argument, not a parameter: frozen, never saved."""

    def __init__(self, drafter: Eagle3Drafter, vocab: DraftVocab, ttt_steps: int, decay: float):
        super().__init__()
        self.drafter, self.vocab, self.ttt_steps, self.decay = drafter, vocab, ttt_steps, decay

    def forward(self, input_ids, loss_mask, attention_mask, aux, final, lm_head, teacher=None, norm=None):
        out = ttt_loss(self.drafter, input_ids, loss_mask, attention_mask, aux, final, lm_head, self.vocab,
                       ttt_steps=self.ttt_steps, decay=self.decay, teacher=teacher, norm=norm)
        # a plain tuple: ZeRO-3's backward hooks find tensors only in tuples, lists and dicts
        return out.loss, out.per_step_loss, out.correct, out.count, out.accepted, out.chained


class StepStats:
    """Sums of loss shares, per-TTT-step correct/count and chain acceptance (eagle3.loss: what an
    engine would accept) over micro batches, reduced over processes."""

    def __init__(self, ttt_steps: int):
        self.loss = 0.0
        self.correct = torch.zeros(ttt_steps, dtype=torch.float64)
        self.count = torch.zeros(ttt_steps, dtype=torch.float64)
        self.accepted = torch.zeros(ttt_steps, dtype=torch.float64)
        self.chained = torch.zeros(1, dtype=torch.float64)

    def add(self, out) -> None:
        self.loss += float(out.loss.detach())
        self.correct += out.correct.detach().to("cpu", torch.float64)
        self.count += out.count.detach().to("cpu", torch.float64)
        self.accepted += out.accepted.detach().to("cpu", torch.float64)
        self.chained += float(out.chained)

    def reduce(self, acc, batches: int) -> dict:
        """batches: how many global batches the shares cover (their losses are averaged).
        accept[s]: the share of chains accepted through draft position s; tau3 = 1 + accept[0..2]
        estimates tau at a chain of 3 (eagle3.loss's module doc says when it holds)."""
        t = torch.cat([torch.tensor([self.loss], dtype=torch.float64), self.correct, self.count, self.accepted,
                       self.chained])
        t = acc.reduce(t.to(acc.device), reduction="sum").cpu()
        k = len(self.correct)
        correct, count, accepted, chained = t[1:1 + k], t[1 + k:1 + 2 * k], t[1 + 2 * k:1 + 3 * k], t[-1]
        accept = [float(a) for a in accepted / chained.clamp(min=1)]
        return {"loss": float(t[0]) / max(batches, 1),
                "acc": [float(a) for a in (correct / count.clamp(min=1))],
                "tokens": int(count[0]), "accept": accept, "tau3": 1 + sum(accept[:3])}


class Logger:
    """metrics.jsonl (what the plots read) and wandb, on the main process only."""

    def __init__(self, run_dir: Path, enabled: bool, use_wandb: bool, cfg):
        self.enabled, self.wandb = enabled, None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a")
        if use_wandb:
            import wandb
            self.wandb = wandb.init(project="eagle3", dir=str(run_dir), mode=wandb_mode(),
                                    name=run_dir.name, config=OmegaConf.to_container(cfg, resolve=True))

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        lists = ("acc", "accept")
        msg = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k not in lists)
        print(f"[{row['split']}] {msg} " + " ".join(f"{k}=[{', '.join(f'{a:.3f}' for a in row[k])}]"
                                                   for k in lists if k in row), flush=True)
        if self.wandb is not None:
            flat = {f"{row['split']}/{k}": v for k, v in row.items() if k not in ("split", "step", *lists)}
            flat.update({f"{row['split']}/{k}_{s}": a for k in lists for s, a in enumerate(row.get(k, []))})
            self.wandb.log(flat, step=row["step"])

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


def set_aside_previous_run(run_dir: Path) -> None:
    """A fresh run (resume=false) in a run_dir that already holds a run moves the old one aside
    instead of mixing with or deleting it."""
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        old = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S', time.localtime(run_dir.stat().st_mtime))}")
        run_dir.rename(old)
        print(f"[train] {run_dir} held an earlier run: moved it to {old} (pass resume=true to continue a run)")


def captures_in_process(c) -> bool:
    """Only the in-process (hf) backend captures implicitly; Kimi-K2.5 never does (DESIGN.md)."""
    return c.capture.backend == "hf" and not c.target.name.startswith("kimi")


def capture_command_message(c) -> str:
    overrides = " ".join(a for a in sys.argv[1:] if not a.startswith("resume"))
    return (f"error: feature dataset {c.data.features_dir} not found (no manifest.json).\n"
            f"Capture it first (see docs/runbook_kimi.md for the SGLang capture server):\n"
            f"    python -m capture {overrides}\n"
            f"then rerun:\n    python train.py {overrides}")


if __name__ == "__main__":
    main()
