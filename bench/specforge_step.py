"""SpecForge 0.2.0's EAGLE-3 training step at the same dimensions as bench/train_speed.py, timed the
same way, so the two can be compared inside one GPU run (docs/perf.md).

    pip install --no-deps --target /tmp/sf specforge==0.2.0   # pure Python; pins torch 2.11
    PYTHONPATH=/tmp/sf python bench/specforge_step.py --preset kimi --seq 2048

What one step is (SpecForge's offline EAGLE-3 path, single GPU, no FSDP wrapper): the target's
full-vocab logits from the stored final hidden states (its TargetHead, no gradient), then
`OnlineEagle3Model` (its LlamaForCausalLMEagle3 drafter, flex attention, TTT 7) over the aux
states, the losses summed with weights 0.8**i, backward, and its `BF16Optimizer` (bf16 weights,
fp32 master copies, AdamW, grad clip 0.5). Random inputs, as ours.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speed import PRESETS  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="kimi")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="flex attention compiles in these")
    ap.add_argument("--device", default="cuda")
    return ap.parse_args()


def build(dims: dict, seq: int, ttt: int, device):
    from transformers import LlamaConfig
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    cfg = LlamaConfig(hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
                      num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
                      head_dim=dims["head_dim"], vocab_size=dims["vocab"], num_hidden_layers=1,
                      max_position_embeddings=max(4096, seq + ttt), rms_norm_eps=1e-6,
                      hidden_act="silu", rope_parameters={"rope_type": "default",
                                                          "rope_theta": 10000.0})
    cfg.draft_vocab_size = dims["draft_vocab"]
    cfg.target_hidden_size = dims["hidden"]
    with torch.device(device):
        draft = LlamaForCausalLMEagle3(cfg, attention_backend="flex_attention")
    draft = draft.to(torch.bfloat16)
    draft.embed_tokens.weight.requires_grad_(False)           # the target's, frozen
    with torch.no_grad():                                      # draft vocab = target ids 0..Vd-1
        draft.t2d.zero_()
        draft.t2d[:dims["draft_vocab"]] = True
        draft.d2t.zero_()
    model = OnlineEagle3Model(draft, length=ttt, attention_backend="flex_attention")
    opt = BF16Optimizer(draft, lr=1e-4, max_grad_norm=0.5, total_steps=1000)
    return model, draft, opt


def main():
    args = parse_args()
    dims = PRESETS[args.preset]
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, draft, opt = build(dims, args.seq, args.ttt, device)
    H, V, T = dims["hidden"], dims["vocab"], args.seq
    head = (torch.randn(V, H, device=device) / H ** 0.5).to(torch.bfloat16)
    head[:dims["draft_vocab"]] *= 3.0                         # as ours: target argmax draftable
    batch = dict(input_ids=torch.randint(0, V, (1, T), device=device),
                 attention_mask=torch.ones(1, T, dtype=torch.long, device=device),
                 loss_mask=torch.ones(1, T, 1, dtype=torch.long, device=device),
                 hidden_states=torch.randn(1, T, 3 * H, device=device, dtype=torch.bfloat16))
    final = torch.randn(1, T, H, device=device, dtype=torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_ms = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            target = F.linear(final, head)                    # TargetHead: [1, T, V] bf16
        plosses, *_ = model(target=target, **batch)
        loss = sum(0.8 ** j * p for j, p in enumerate(plosses))
        loss.backward()
        opt.step()
        torch.cuda.synchronize(device)
        if i >= args.warmup:
            step_ms.append(1e3 * (time.perf_counter() - t0))
        del target, plosses, loss
    ms = statistics.median(step_ms)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    print(f"specforge     {args.preset} seq {T} TTT {args.ttt}, {trainable / 1e6:.1f}M trainable, "
          f"torch {torch.__version__}")
    print(f"ms/step       {ms:.1f} median of {len(step_ms)} (min {min(step_ms):.1f})")
    print(f"tokens/s      {T / ms * 1e3:,.0f}")
    print(f"peak memory   {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB (max allocated)")


if __name__ == "__main__":
    main()
