"""Drafter training speed on synthetic features: full steps exactly as training runs them
(TTT forward over `--ttt` steps, backward, gradient clipping, AdamW).

    python bench/train_speed.py --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --head-dim 16 \
        --vocab 1000 --draft-vocab 256 --seq 128 --ttt 7 --steps 5 --device cpu --dtype fp32
    python bench/train_speed.py --preset kimi --seq 2048 --steps 20 --device cuda --dtype bf16
    python bench/train_speed.py --preset kimi --seq 2048 --device cuda --dtype bf16 --compile both
    python bench/train_speed.py --preset kimi --seq 2048 --device cuda --dtype bf16 --check-numerics

--compile: whether eagle3/fused.py's elementwise chains run through torch.compile (auto: on a GPU
only, the library's default); `both` measures eager then compiled in one process, same dims, same
seed. The warm-up line gives the warm-up steps' time, which includes compiling.

Precision: fp32 = everything fp32; bf16 = as train.py: bf16 parameters (the frozen embedding too)
with fp32 masters and moments in AdamW's state (eagle3/optim.py), compute under
torch.autocast(bfloat16) (what accelerate's bf16 mixed precision does), features and the target
lm_head stored in bf16.

FLOP count (printed; MFU = FLOPs / step time / peak):
    P_layer = 2H*(nh + 2*nkv)*d + nh*d*H + 3*H*I      (q, k, v over 2H inputs; o; gate, up, down)
    forward = 2*B*T*(k*Ht*H)                           (fc, once)
            + sum_s [ 2*B*T*(P_layer + H*Vd)           (layer + lm_head, every TTT step)
                      + 4*B*nh*d*(T*(T+1)/2 + s*T) ]   (QK and PV: causal step-0 keys + s own keys)
    train   = 3 * forward                              (backward = 2x forward)
This nominal count is the plain algorithm's (and SpecForge's), kept for MFU comparisons. Ours does
less: the token embedding's part of q/k/v (2*B*T*H*(nh+2*nkv)*d per step) runs once for all steps
and fc has no input gradient; "done" FLOPs are printed too. tokens/s is the figure to compare.
The target's teacher logits (2*B*T*Ht*V, no gradient) are timed but not counted. lm_head runs
only on counted rows; the synthetic target is built so nearly all rows count (printed), so the
nominal count above is what is computed. Peak = a measured large matmul in the compute dtype
(pass --peak-tflops to use a datasheet figure instead).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3 import fused  # noqa: E402
from eagle3.loss import ttt_loss  # noqa: E402
from eagle3.model import Eagle3Drafter  # noqa: E402
from eagle3.shape import DrafterShape  # noqa: E402
from eagle3.optim import adamw, clip_grad_norm  # noqa: E402
from eagle3.vocab import DraftVocab  # noqa: E402

# Kimi-K2.5's drafter (the published Kimi-K2 EAGLE-3 drafter's dims): 1.19B trainable parameters.
PRESETS = {"kimi": dict(hidden=7168, intermediate=18432, heads=64, kv_heads=64, head_dim=128,
                        vocab=163840, draft_vocab=32000)}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS))
    for name in ("hidden", "intermediate", "heads", "kv-heads", "head-dim", "vocab", "draft-vocab"):
        ap.add_argument(f"--{name}", type=int)
    ap.add_argument("--target-hidden", type=int, help="Ht (default: --hidden)")
    ap.add_argument("--num-aux", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1, help="drafter.num_layers")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--loss", default="soft_ce", help="train.loss: soft_ce | kl | tv | jsd | lk | lk_alpha")
    ap.add_argument("--clip", type=float, default=0.5)
    ap.add_argument("--counted", type=float, default=1.0,
                    help="share of rows the loss counts (train.py's log: tokens counted over tokens a step)")
    ap.add_argument("--peak-tflops", type=float, help="default: measured matmul throughput")
    ap.add_argument("--profile", action="store_true", help="print where one step's time goes")
    ap.add_argument("--new-lengths", type=int, default=0,
                    help="then time one step at each of this many lengths just below --seq, none seen before")
    ap.add_argument("--shapes", action="store_true", help="with --profile: also by op and input shapes")
    ap.add_argument("--stacks", action="store_true",
                    help="with --profile: also the non-matmul ops by where in this project they are called")
    ap.add_argument("--compile", choices=["auto", "on", "off", "both"], default="auto",
                    help="fused elementwise kernels through torch.compile (see the module doc)")
    ap.add_argument("--check-numerics", action="store_true",
                    help="instead of timing: loss and gradients of eager and compiled (in --dtype) "
                         "against an fp32 eager reference, same weights and batch")
    args = ap.parse_args()
    for key, value in PRESETS.get(args.preset, {}).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    missing = [k for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab",
                           "draft_vocab") if getattr(args, k) is None]
    if missing:
        ap.error(f"give --preset or all of: {', '.join('--' + m.replace('_', '-') for m in missing)}")
    args.target_hidden = args.target_hidden or args.hidden
    return args


def train_flops(s: DrafterShape, B: int, T: int, steps: int) -> float:
    H, d = s.hidden_size, s.head_dim
    nh, nkv = s.num_attention_heads, s.num_key_value_heads
    upper = H * (nh + 2 * nkv) * d + nh * d * H + 3 * H * s.intermediate_size    # a layer j >= 1
    layer = H * (nh + 2 * nkv) * d + s.num_layers * upper           # layer 0 reads 2H: one more q/k/v
    fwd = 2 * B * T * s.num_aux * s.target_hidden_size * H
    for st in range(steps):
        fwd += 2 * B * T * (layer + H * s.draft_vocab_size)
        fwd += 4 * B * nh * d * (T * (T + 1) / 2 + st * T) * s.num_layers
    return 3 * fwd


def done_flops(s: DrafterShape, B: int, T: int, steps: int) -> float:
    """train_flops less what ours skips: the embedding's q/k/v part of steps 1.., fc's input grad."""
    embed_qkv = 2 * B * T * s.hidden_size * (s.num_attention_heads + 2 * s.num_key_value_heads) * s.head_dim
    fc = 2 * B * T * s.num_aux * s.target_hidden_size * s.hidden_size
    return train_flops(s, B, T, steps) - 3 * embed_qkv * (steps - 1) - fc


def profile_step(run_step, device, rows: int = 25, shapes: bool = False, stacks: bool = False):
    """One step under torch.profiler: kernels by total time, and the share of the big groups;
    with `shapes`, also the aten ops by input shapes (which copy, which add)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=shapes, with_stack=stacks) as prof:
        run_step()
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    if device.type == "cuda":
        # the kernels themselves: key_averages() also gives the aten op that launched a kernel
        # the kernel's device time, so summing its rows counts every kernel twice
        from torch.autograd import DeviceType
        events = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [(e.key, getattr(e, key)) for e in prof.key_averages() if getattr(e, key) > 0]
    total = sum(t for _, t in events)
    # GPU idle inside the step: the span from the first kernel's start to the last one's end, less
    # the union of the kernels' intervals (the time no kernel ran: launch gaps, host syncs)
    if device.type == "cuda":
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == DeviceType.CUDA)
        busy, gaps = 0, []                      # gaps: (idle us, the kernel before, the one after)
        end, before = kernels[0][0], kernels[0][2]
        for a, b, name in kernels:
            if a > end:
                gaps.append((a - end, before, name))
            if b >= end:
                busy, end, before = busy + b - max(a, end), b, name
        span = kernels[-1][1] - kernels[0][0]
        print(f"gpu busy      {busy / 1e3:.1f} ms of a {span / 1e3:.1f} ms span "
              f"(idle {(span - busy) / 1e3:.1f} ms: launch gaps and host syncs)")
        if stacks:   # the largest idle gaps, and the kernels around them
            gaps.sort(key=lambda g: -g[0])
            sizes = [g[0] for g in gaps]
            print(f"idle gaps     {len(gaps)}: {sum(x for x in sizes if x >= 100) / 1e3:.1f} ms in "
                  f"{sum(x >= 100 for x in sizes)} gaps of >= 100 us, {sum(x for x in sizes if x < 100) / 1e3:.1f} ms in the rest")
            for us, a, b in gaps[:rows]:
                print(f"  {us:7.0f} us  after {a[:60]}  before {b[:60]}")
    groups = {"matmul": ("gemm", "matmul", "mm", "addmm", "linear", "cutlass", "sm90_xmma", "nvjet"),
              "attention": ("flash", "fmha", "attention"),
              "copy/cast": ("copy", "cast", "to_copy", "cat", "index", "gather", "scatter")}
    share = {g: 0.0 for g in groups}
    for name, t in events:
        for g, words in groups.items():
            if any(w in name.lower() for w in words):
                share[g] += t
                break
    print(f"profile       {total / 1e3:.1f} ms of kernel time in one step; " + ", ".join(
        f"{g} {v / 1e3:.1f} ms ({v / max(total, 1):.0%})" for g, v in share.items())
        + f", rest {(total - sum(share.values())) / 1e3:.1f} ms")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))
    if stacks:   # which line of ours launched the non-matmul work (for backward: which node)
        by_caller = {}
        for e in prof.events():
            if not e.name.startswith("aten::") or any(w in e.name for w in ("mm", "linear", "matmul", "flash", "_fused_adamw")):
                continue
            t = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
            if t <= 0:
                continue
            frames, parent = [], e.cpu_parent
            while parent is not None and len(frames) < 3:
                if "eagle3/" in parent.name or "bench/" in parent.name:
                    frames.append(parent.name.split("/")[-1])
                elif parent.name.startswith("autograd::engine::evaluate_function"):
                    frames.append(parent.name.split(": ")[-1])
                parent = parent.cpu_parent
            k = (e.name, " < ".join(frames))
            tot, n = by_caller.get(k, (0.0, 0))
            by_caller[k] = (tot + t, n + 1)
        print(f"{'op':28s} {'self ms':>8s} {'calls':>5s}  called from (innermost first)")
        for (name, where), (t, n) in sorted(by_caller.items(), key=lambda kv: -kv[1][0])[:2 * rows]:
            print(f"{name:28s} {t / 1e3:8.2f} {n:5d}  {where or '?'}")
    if shapes:   # aten ops only (a kernel row has no shapes), by their own device time
        ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
        print(f"{'op':32s} {'self ms':>8s} {'calls':>5s}  input shapes")
        for e in sorted(ops, key=lambda e: -getattr(e, key))[:3 * rows]:
            print(f"{e.key:32s} {getattr(e, key) / 1e3:8.2f} {e.count:5d}  {str(e.input_shapes)[:110]}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measured_peak_tflops(device, dtype) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    reps = 20 if device.type == "cuda" else 3
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12


def synthetic_batch(s: DrafterShape, B, T, device, dtype, gen, counted: float = 1.0):
    """Random features; the target lm_head's draft rows are scaled up so the target's argmax
    (over the full vocab) nearly always lies in the draft vocab, i.e. nearly every row the loss
    mask holds counts; `counted`: the share of rows it holds (real answers leave prompts out)."""
    V, Vd, Ht = s.vocab_size, s.draft_vocab_size, s.target_hidden_size
    d2t = torch.zeros(Vd, dtype=torch.int64)                 # draft vocab = target ids 0..Vd-1
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:Vd] = True
    head = torch.randn(V, Ht, generator=gen) / Ht ** 0.5
    head[:Vd] *= 3.0
    return (random_features(s, B, T, device, dtype, gen, counted), head.to(device, dtype),
            DraftVocab(d2t, t2d).to(device))


def random_features(s: DrafterShape, B, T, device, dtype, gen, counted: float = 1.0):
    V, Ht = s.vocab_size, s.target_hidden_size
    batch = dict(
        input_ids=torch.randint(0, V, (B, T), generator=gen),
        loss_mask=(torch.ones(B, T, dtype=torch.uint8) if counted >= 1 else
                   (torch.rand(B, T, generator=gen) < counted).to(torch.uint8)),
        attention_mask=torch.ones(B, T, dtype=torch.bool),
        aux=torch.randn(B, T, s.num_aux * Ht, generator=gen),
        final=torch.randn(B, T, Ht, generator=gen),
    )
    return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in batch.items()}


def measure(args, shape: DrafterShape, device, cdtype):
    """Build the model and optimizer, run --warmup then --steps full steps, print the results."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Eagle3Drafter(shape)
    model.to(cdtype)            # as train.py: bf16 parameters, their fp32 masters in opt's state
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(trainable, args.lr, (0.9, 0.95), 0.0)
    batch, head, vocab = synthetic_batch(shape, args.batch, args.seq, device, cdtype, gen, args.counted)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                else contextlib.nullcontext())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def forward_backward():
        with autocast:
            out = ttt_loss(model, **batch, target_lm_head=head, vocab=vocab, ttt_steps=args.ttt, loss=args.loss)
        out.loss.backward()
        return out

    def optimizer_step():
        clip_grad_norm(opt, trainable, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_ms, fwd_bwd_ms, host_ms, counted = [], [], [], 0.0
    sync(device)
    t_start = time.perf_counter()
    for i in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        out = forward_backward()
        th = time.perf_counter()              # the host has queued all of it (backward() returned)
        sync(device)
        t1 = time.perf_counter()
        optimizer_step()
        sync(device)
        t2 = time.perf_counter()
        if i == args.warmup - 1:
            warmup_s = t2 - t_start
        if i >= args.warmup:
            step_ms.append(1e3 * (t2 - t0))
            fwd_bwd_ms.append(1e3 * (t1 - t0))
            host_ms.append(1e3 * (th - t0))
        counted = float(out.count[0]) / (args.batch * max(args.seq - 2, 1))
        del out

    ms = statistics.median(step_ms)
    tokens = args.batch * args.seq
    flops = train_flops(shape, args.batch, args.seq, args.ttt)
    peak = args.peak_tflops or measured_peak_tflops(device, cdtype)
    if device.type == "cuda":
        mem = f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB (max allocated)"
    else:
        mem = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (process max RSS)"
    print(f"batch         {args.batch} x {args.seq} tokens, TTT {args.ttt}, loss {args.loss}, "
          f"step-0 counted rows {counted:.1%}")
    print(f"ms/step       {ms:.1f} median of {len(step_ms)} "
          f"(forward+backward {statistics.median(fwd_bwd_ms):.1f}, "
          f"clip+optimizer {ms - statistics.median(fwd_bwd_ms):.1f})")
    host = statistics.median(host_ms)
    print(f"host          {host:.1f} ms to queue forward+backward" + (
        " (near its time: the GPU waits for the host)"
        if device.type == "cuda" and host > 0.8 * statistics.median(fwd_bwd_ms) else ""))
    if args.warmup:
        print(f"warm-up       {warmup_s:.1f} s for {args.warmup} step(s) (compiling included)")
    print(f"tokens/s      {tokens / ms * 1e3:,.0f}")
    print(f"peak memory   {mem}")
    print(f"FLOPs/step    {flops / 1e12:.4g} TFLOP nominal, {done_flops(shape, args.batch, args.seq, args.ttt) / 1e12:.4g} done (train, see module doc); teacher "
          f"{2 * tokens * shape.target_hidden_size * shape.vocab_size / 1e12:.4g} TFLOP not counted")
    print(f"MFU           {flops / (ms / 1e3) / 1e12 / peak:.1%} of {peak:.4g} TFLOP/s "
          f"({'given' if args.peak_tflops else 'measured matmul'})")

    if args.new_lengths:    # real batches have many lengths: what a length not seen before costs
        first = []
        for L in range(args.seq - args.new_lengths, args.seq):
            batch = random_features(shape, args.batch, L, device, cdtype, gen, args.counted)   # forward_backward reads it
            sync(device)
            t0 = time.perf_counter()
            forward_backward()
            optimizer_step()
            sync(device)
            first.append(1e3 * (time.perf_counter() - t0))
        print(f"new lengths   {args.seq - args.new_lengths}..{args.seq - 1}: {statistics.median(first):.1f} ms/step "
              f"median (max {max(first):.1f}) against {ms:.1f} at the one length above")

    if args.profile:
        profile_step(lambda: (forward_backward(), optimizer_step()), device, shapes=args.shapes,
                     stacks=args.stacks)


def check_numerics(args, shape: DrafterShape, device, cdtype):
    """One forward + backward per mode on the same weights and batch: eager and compiled in the
    compute dtype (for bf16 as train.py runs: bf16 parameters under autocast) against eager fp32
    on an fp32 copy of those same (bf16-rounded) weights; relative errors of the loss and
    relative L2 of all trainable gradients together, in fp32 (the tolerance docs/perf.md states:
    loss 1e-5, gradients 2e-2 against fp32)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Eagle3Drafter(shape)
    model.to(cdtype)
    reference = copy.deepcopy(model).float()
    batch, head, vocab = synthetic_batch(shape, args.batch, args.seq, device, torch.float32, gen)

    def run(m, dtype, compiled):
        fused.set_enabled(compiled)
        b = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}
        ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        with ctx:
            out = ttt_loss(m, **b, target_lm_head=head.to(dtype), vocab=vocab, ttt_steps=args.ttt, loss=args.loss)
        out.loss.backward()
        grads = torch.cat([p.grad.flatten().float() for p in m.parameters() if p.requires_grad])
        m.zero_grad(set_to_none=True)
        return float(out.loss.detach()), grads

    ref_loss, ref_grads = run(reference, torch.float32, False)
    results = {"eager": run(model, cdtype, False), "compiled": run(model, cdtype, True)}
    print(f"numerics      fp32 eager reference loss {ref_loss:.6f}, {ref_grads.numel() / 1e6:.1f}M gradients")
    for name, (loss, grads) in results.items():
        print(f"numerics      {args.dtype} {name:8s}: loss rel err {abs(loss - ref_loss) / abs(ref_loss):.2e}, "
              f"gradient rel L2 {float((grads - ref_grads).norm() / ref_grads.norm()):.2e}")
    (le, ge), (lc, gc_) = results["eager"], results["compiled"]
    print(f"numerics      compiled vs eager ({args.dtype}): loss rel {abs(lc - le) / abs(le):.2e}, "
          f"gradient rel L2 {float((gc_ - ge).norm() / ge.norm()):.2e}")
    check_optimizer([p for p in reference.parameters() if p.requires_grad], ref_grads, args.clip, cdtype)


def check_optimizer(params, grads: torch.Tensor, clip: float, cdtype, steps: int = 3):
    """Our clipped AdamW step (compiled where eagle3/fused.py compiles) on the weights in `cdtype`
    (bf16: masters from their bf16 values) and the gradients given (flat) in `cdtype`, their
    halves on alternate steps; against clip_grad_norm_ + torch's plain AdamW on fp32 weights of
    the same values with the same gradient values in fp32. Prints the masters' (fp32: the
    weights') max relative difference and how many weights differ from their master's cast."""
    fused.set_enabled(None)
    ours = [torch.nn.Parameter(p.detach().to(cdtype)) for p in params]
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = adamw(ours, 1e-3, (0.9, 0.95), 0.01)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, foreach=False)
    for step in range(steps):
        g = grads * (1.0 if step % 2 == 0 else 0.5)
        for a, b in zip(ours, ref):
            n = a.numel()
            a.grad = g[:n].view_as(a).to(cdtype)
            b.grad = a.grad.float()
            g = g[n:]
        clip_grad_norm(opt, ours, clip)
        torch.nn.utils.clip_grad_norm_(ref, clip, foreach=False)
        opt.step()
        ref_opt.step()
    masters = [opt.state[a].get("master", a).detach() for a in ours]    # fp32 weights: their own
    diff = max(float((m - b).detach().abs().max() / b.detach().abs().max()) for m, b in zip(masters, ref))
    unequal = sum(not torch.equal(a.detach(), m.to(a.dtype)) for a, m in zip(ours, masters))
    print(f"numerics      optimizer: {steps} clipped AdamW steps against torch's plain AdamW, "
          f"max rel difference {diff:.2e} ({'masters' if cdtype != torch.float32 else 'weights'}); "
          f"weights not equal to their master's cast: {unequal} of {len(ours)}")


def main():
    args = parse_args()
    device = torch.device(args.device)
    cdtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shape = DrafterShape(hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.head_dim, vocab_size=args.vocab,
                         draft_vocab_size=args.draft_vocab, target_hidden_size=args.target_hidden,
                         num_aux=args.num_aux, max_position_embeddings=max(4096, args.seq + args.ttt),
                         num_layers=args.layers)
    print(f"device        {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
          f"  torch {torch.__version__}  dtype {args.dtype}")
    print(f"shape         {shape}")
    print(f"params        {shape.num_trainable() / 1e6:.1f}M trainable "
          f"(+{shape.vocab_size * shape.hidden_size / 1e6:.1f}M frozen embedding)")
    if args.check_numerics:
        check_numerics(args, shape, device, cdtype)
        return
    modes = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}[args.compile]
    for flag in modes:
        fused.set_enabled(flag)
        print(f"compile       {args.compile if flag is None else ('on' if flag else 'off')}"
              " (eagle3/fused.py's elementwise functions through torch.compile)")
        measure(args, shape, device, cdtype)
        gc.collect()                            # the model and optimizer go before the next mode
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
