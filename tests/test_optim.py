"""The optimizer step against torch's own: clip_grad_norm (folded into our AdamW's pass, or in
place for another optimizer) then step gives the parameters that clip_grad_norm_ + a plain
(for-loop) torch AdamW step gives; for bf16 parameters, its fp32 masters are torch's fp32
parameters and each bf16 parameter is its master's cast, and a saved state resumes bit-exactly."""
import copy
import io

import pytest
import torch

from eagle3 import fused
from eagle3.optim import AdamW, adamw, clip_grad_norm
from eagle3.reused import linear, reuse


def params_():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(11))]


def set_grads(params, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 3.0).to(dtype)


def run(ours: bool, max_norm: float, steps: int = 3):
    params = params_()
    if ours:
        opt = adamw(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
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


def bf16_run(steps: int, max_norm: float = 0.5):
    """Our AdamW over bf16 params with bf16 gradients, and torch's plain AdamW over fp32 params of
    the same values given the same gradient values (upcast), `steps` clipped steps each."""
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in params_()]
    ref = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = adamw(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    norms, ref_norms = [], []
    for step in range(steps):
        set_grads(params, step, torch.bfloat16)
        for p, r in zip(params, ref):
            r.grad = p.grad.float()
        norms.append(clip_grad_norm(opt, params, max_norm))
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=False))
        opt.step()
        ref_opt.step()
    return params, opt, ref, torch.stack(norms), torch.stack(ref_norms)


@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_params_keep_fp32_masters_that_follow_torch(compiled):
    previous = fused.set_enabled(compiled)
    try:
        params, opt, ref, norms, ref_norms = bf16_run(3)
    finally:
        fused.set_enabled(previous)
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    for p, r in zip(params, ref):
        st = opt.state[p]
        assert p.dtype == p.grad.dtype == torch.bfloat16
        assert {k: st[k].dtype for k in ("master", "exp_avg", "exp_avg_sq")} == dict.fromkeys(
            ("master", "exp_avg", "exp_avg_sq"), torch.float32)
        torch.testing.assert_close(st["master"], r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), st["master"].bfloat16())
        # the masters carry what bf16 drops: updates of 1e-2 and less on weights of about 1
        assert not torch.equal(st["master"], p.detach().float())


def test_bf16_state_resumes_bit_exactly_through_a_file():
    """torch.save / torch.load of params and optimizer state into fresh bf16 params and a fresh
    optimizer: masters and moments come back fp32 and bit-equal (torch's own load_state_dict
    would cast them to bf16), and two more steps equal the uninterrupted optimizer's bit for bit."""
    params, opt, _, _, _ = bf16_run(3)
    f = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, f)
    f.seek(0)
    saved = torch.load(f)
    fresh = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    with torch.no_grad():
        for q, t in zip(fresh, saved["params"]):
            q.copy_(t)
    resumed = adamw(fresh, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    resumed.load_state_dict(saved["opt"])
    for p, q in zip(params, fresh):
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert resumed.state[q][k].dtype == torch.float32, k
            assert torch.equal(resumed.state[q][k], opt.state[p][k]), k
        assert float(resumed.state[q]["step"]) == 3.0
    for step in (3, 4):
        for ps, o in ((params, opt), (fresh, resumed)):
            set_grads(ps, step, torch.bfloat16)
            clip_grad_norm(o, ps, 0.5)
            o.step()
    for p, q in zip(params, fresh):
        assert torch.equal(q, p) and torch.equal(resumed.state[q]["master"], opt.state[p]["master"])


def test_state_without_masters_starts_them_from_the_rounded_weights():
    """A state saved over fp32 params (before masters existed) loaded over their bf16 casts: the
    moments stay fp32 as saved, and the next step starts from the bf16 weight, as the same step
    over fp32 params holding those bf16 values would."""
    params = params_()
    opt = adamw(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    set_grads(params, 0)
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    narrow = [torch.nn.Parameter(p.detach().bfloat16()) for p in params]
    wide = [torch.nn.Parameter(p.detach().float()) for p in narrow]
    ours, ref = adamw(narrow, 1e-2, (0.9, 0.95), 0.1), adamw(wide, 1e-2, (0.9, 0.95), 0.1)
    ours.load_state_dict(copy.deepcopy(state))
    ref.load_state_dict(copy.deepcopy(state))
    for p, q in zip(params, narrow):
        assert "master" not in ours.state[q]
        assert torch.equal(ours.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])   # fp32, not rounded
    set_grads(narrow, 1, torch.bfloat16)
    for p, w in zip(narrow, wide):
        w.grad = p.grad.float()
    ours.step()
    ref.step()
    for p, w in zip(narrow, wide):
        assert torch.equal(ours.state[p]["master"], w.detach()) and torch.equal(p, w.detach().bfloat16())


def test_clip_norm_of_bf16_gradients_is_fp32():
    """The norm over bf16 gradients, taken in fp32: it matches the float64 norm of the upcast
    gradients to fp32 precision, where torch's own (a bf16 number) is off by ~1e-3."""
    params = [torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.zeros(7, 5, dtype=torch.bfloat16))]
    set_grads(params, 0, torch.bfloat16)
    exact = torch.cat([p.grad.double().flatten() for p in params]).norm()
    opt = adamw(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    norm = clip_grad_norm(opt, params, 0.5)
    assert norm.dtype == torch.float32
    assert abs(float(norm) / float(exact) - 1) < 1e-6
    assert abs(float(torch.nn.utils.get_total_norm([p.grad for p in params])) / float(exact) - 1) > 1e-4
    assert float(opt.grad_factor) == pytest.approx(0.5 / (float(exact) + 1e-6), rel=1e-6)


def test_a_bf16_weight_is_used_as_it_is_and_gets_its_gradient_in_bf16():
    """Under autocast a bf16 parameter goes to the GEMMs without a cast (the same storage) and its
    summed gradient arrives in bf16, with no widening."""
    w = torch.nn.Parameter(torch.randn(7, 5).bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = reuse(w, torch.bfloat16)
        x = torch.randn(3, 5)
        linear(x, r).sum().backward()
    assert r.weight.data_ptr() == w.data_ptr()
    assert w.grad.dtype == torch.bfloat16
    expected = x.bfloat16().double().sum(0).expand(7, 5)
    torch.testing.assert_close(w.grad.double(), expected, rtol=1e-2, atol=1e-2)


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
