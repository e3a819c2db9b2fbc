"""The optimizer step against torch's own: clip_grad_norm (folded into our AdamW's pass, or in
place for another optimizer) then step gives the parameters that clip_grad_norm_ + a plain
(for-loop) torch AdamW step gives; the compute-dtype copies it writes are the weights' casts and
are dropped when a weight changes otherwise."""
import copy

import pytest
import torch

from eagle3 import fused
from eagle3.optim import AdamW, adamw, clip_grad_norm
from eagle3.reused import kept_copy, linear, reuse


def params_():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(11))]


def set_grads(params, step):
    g = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3.0


def run(ours: bool, max_norm: float, steps: int = 3, copy_dtype=None):
    params = params_()
    if ours:
        opt = adamw(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, copy_dtype=copy_dtype)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    norms = []
    for step in range(steps):
        set_grads(params, step)
        if ours:
            norms.append(clip_grad_norm(opt, params, max_norm))
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params, torch.stack(norms)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])          # clipping every step; never clipping
def test_step_with_folded_clip_matches_torch(compiled, max_norm):
    previous = fused.set_enabled(compiled)
    try:
        (ref, ref_norms), (got, norms) = run(False, max_norm), run(True, max_norm)
    finally:
        fused.set_enabled(previous)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    # the clip mattered: without it the parameters end elsewhere, far beyond the tolerance above
    # (little, as Adam's update barely depends on a gradient scale that varies slowly across steps)
    if max_norm < 1:
        unclipped, _ = run(False, 1e6)
        assert max((a - b).abs().max().item() for a, b in zip(unclipped, ref)) > 1e-4


def test_copies_are_the_weights_casts_and_go_stale_when_a_weight_changes():
    params, _ = run(True, 0.5, copy_dtype=torch.bfloat16)
    w = params[0]
    kept = kept_copy(w, torch.bfloat16)
    assert kept is not None and kept_copy(w, torch.float16) is None
    assert torch.equal(kept, w.detach().to(torch.bfloat16))
    # the forward reads the copy itself, not a new cast
    r = reuse(w, torch.bfloat16)
    assert r.weight.data_ptr() == kept.data_ptr()
    # a change outside the optimizer (a loaded checkpoint, an edit) drops it: the forward casts
    with torch.no_grad():
        w.add_(1.0)
    assert kept_copy(w, torch.bfloat16) is None
    r = reuse(w, torch.bfloat16)
    assert r.weight.data_ptr() != kept.data_ptr()
    torch.testing.assert_close(r.weight, w.detach().to(torch.bfloat16), rtol=0, atol=0)
    # and the gradient through a copy reaches the fp32 weight, in fp32 (a bf16 GEMM's rounding)
    x = torch.randn(3, 5)
    linear(x, r).sum().backward()
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, x.to(torch.bfloat16).float().sum(0).expand(7, 5), rtol=1e-2, atol=1e-2)


def test_resumes_torch_fused_adamw_state():
    """A run saved by torch's fused AdamW (its step counts on the device) continues as torch would."""
    ref_params, params = params_(), params_()
    torch_opt = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01, fused=True)
    set_grads(ref_params, 0)
    torch_opt.step()
    with torch.no_grad():
        for p, q in zip(params, ref_params):
            p.copy_(q)
    ours = AdamW(params, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
    ours.load_state_dict(copy.deepcopy(torch_opt.state_dict()))   # as from a file: no shared moments
    for step in (1, 2):
        set_grads(ref_params, step)
        set_grads(params, step)
        torch_opt.step()
        ours.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    assert float(ours.state[params[0]]["step"]) == 3.0
