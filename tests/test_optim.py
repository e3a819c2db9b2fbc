"""The optimizer step against torch's own: clip_grad_norm (folded into fused AdamW, or in place)
then step gives the parameters that clip_grad_norm_ + a plain (for-loop) AdamW step gives."""
import pytest
import torch

from eagle3.optim import adamw, clip_grad_norm


def run(fused: bool, ours: bool, max_norm: float, steps: int = 3):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(11))]
    if ours:
        opt = adamw(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    norms = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 3.0
        if ours:
            norms.append(clip_grad_norm(opt, params, max_norm))
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in params], torch.stack(norms)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])          # clipping every step; never clipping
def test_clip_folded_into_step_matches_torch(fused, max_norm):
    (ref, ref_norms), (got, norms) = run(False, False, max_norm), run(fused, True, max_norm)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the clip mattered: without it the parameters end elsewhere, far beyond the tolerance above
    # (little, as Adam's update barely depends on a gradient scale that varies slowly across steps)
    if max_norm < 1:
        unclipped, _ = run(False, False, 1e6)
        assert max((a - b).abs().max().item() for a, b in zip(unclipped, ref)) > 1e-4


def test_resumed_unfused_state_is_clipped_in_place():
    """A fused optimizer that loaded an unfused run's state steps unfused: the clip must not be
    left to a kernel that will not run (torch's unfused AdamW refuses a grad_scale)."""
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    unfused = torch.optim.AdamW(params, lr=1e-2)
    params[0].grad = torch.randn(4, 3)
    unfused.step()
    opt = adamw(params, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01, fused=True)
    opt.load_state_dict(unfused.state_dict())
    params[0].grad = torch.randn(4, 3) * 10
    norm = clip_grad_norm(opt, params, 0.5)
    torch.testing.assert_close(params[0].grad.norm(), torch.tensor(0.5), rtol=1e-5, atol=0)
    assert norm > 0.5
    opt.step()
