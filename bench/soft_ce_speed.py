"""The TTT heads' soft cross-entropy on a GPU at the Kimi-size drafter's shapes: forward and
backward of eagle3.loss._SoftCrossEntropy, timed apart, with the bytes each must move and the
bandwidth that makes. Run it against another tree's eagle3 to compare (PYTHONPATH=that/tree).

    python bench/soft_ce_speed.py --rows 28637 --teacher-rows 4096 --vocab 32000

28637 rows are the counted rows of all 7 TTT steps at 4096 tokens (bench/train_speed.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))     # after PYTHONPATH: another tree's eagle3 wins
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_speed import timed  # noqa: E402
from eagle3.loss import _SoftCrossEntropy  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=28637)
    ap.add_argument("--teacher-rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    N, R, V = a.rows, a.teacher_rows, a.vocab
    z = (3 * torch.randn(N, V, device="cuda", generator=gen)).bfloat16().requires_grad_()
    p = torch.randn(R, V, device="cuda", generator=gen).softmax(-1)            # fp32, as the teacher
    rows = torch.randint(0, R, (N,), device="cuda", generator=gen)
    g = torch.rand(N, device="cuda", generator=gen)

    def forward():
        return _SoftCrossEntropy.apply(z, p, rows)

    def both():
        ce, _ = forward()
        return torch.autograd.grad(ce, z, g)[0]

    both(), both()                                          # compile
    t_fwd, t_both = timed(forward), timed(both)
    gz = both()
    want = torch.autograd.grad(-(p[rows] * torch.log_softmax(z.float(), -1)).sum(-1), z, g)[0]
    err = float((gz.float() - want).norm() / want.norm())
    gb = N * V * 2 / 1e9                                     # one [N, V] bf16 pass
    print(f"shape         z [{N}, {V}] bf16, p [{R}, {V}] fp32, torch {torch.__version__}")
    print(f"forward       {t_fwd:.3f} ms  (z {gb:.2f} GB + teacher rows {2 * gb:.2f} GB read at least: "
          f"{3 * gb / t_fwd:.2f} TB/s)")
    print(f"backward      {t_both - t_fwd:.3f} ms  (forward + backward {t_both:.3f} ms)")
    print(f"gradient      relative L2 to fp32 {err:.2e}")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        both()
        torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:8]:
        if e.self_device_time_total > 0:
            print(f"  {e.self_device_time_total / 1e3:7.3f} ms {e.count:3d}x  {e.key[:90]}")


if __name__ == "__main__":
    main()
