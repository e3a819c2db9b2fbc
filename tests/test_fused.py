"""The fused (torch.compile) elementwise functions against their own eager function, compiled by
inductor on the CPU: forward and backward, fp32 and bf16; and the whole ttt_loss compiled against
eager on a tiny drafter. Eager itself is checked against independent references in
tests/test_loss.py and tests/test_model.py.

Tolerances, per element, as a share of the larger of |eager| and the tensor's largest |eager|:
fp32 1e-5 (the compiled kernel may reorder a reduction); bf16 2**-7, one or two bf16 ulps (compiled
rounds to bf16 once where eager rounds after each op, and a sum of such terms, e.g. RMSNorm's
weight gradient, carries that ulp of its largest term)."""
import pytest
import torch
from torch._dynamo.utils import counters

from eagle3 import fused
from eagle3.loss import _scale_rows, _soft_ce, ttt_loss
from eagle3.attention import _merge, _merge_backward, _merge_grads
from eagle3.layers import rms_norm, rope, rope_angles, silu_mul

TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def compiled():
    """Calls through `fused` functions compile (CPU included) inside the test; asserts they did."""
    torch.manual_seed(0)
    previous = fused.set_enabled(True)
    before = counters["stats"]["calls_captured"]
    yield
    fused.set_enabled(previous)
    assert counters["stats"]["calls_captured"] > before, "nothing was compiled"


def eager_and_compiled(fn, *args):
    """fn's results (and, where they require grad, the inputs' gradients for a random upstream
    gradient) eager, then compiled."""
    results = []
    for enabled in (False, True):
        fused.set_enabled(enabled)
        leaves = [a.detach().clone().requires_grad_(a.requires_grad)
                  if isinstance(a, torch.Tensor) else a for a in args]
        out = fn(*leaves)
        grads = []
        if isinstance(out, torch.Tensor) and out.requires_grad:
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
            grads = torch.autograd.grad(out, [a for a in leaves if isinstance(a, torch.Tensor)
                                               and a.requires_grad], g)
        results.append((out, grads))
    fused.set_enabled(True)
    return results


def close(eager, comp, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(comp, eager, rtol=tol, atol=tol * eager.abs().max().item())


def rand(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_differentiable_functions(compiled, dtype):
    x = rand(2, 5, 32, dtype=dtype, grad=True)
    w = rand(32, grad=True)                      # fp32 master weight, as under autocast
    (ye, ge), (yc, gc) = eager_and_compiled(rms_norm, x, w, 1e-6)
    close(ye, yc, dtype)
    close(ge[0], gc[0], dtype)
    close(ge[1].float(), gc[1].float(), dtype)

    q = rand(2, 5, 3, 16, dtype=dtype, grad=True)                 # [B, T, nh, d]
    k = rand(2, 5, 1, 16, dtype=dtype, grad=True)                 # [B, T, nkv, d]
    positions = torch.arange(5).expand(2, 5) + 3
    both = lambda *a: torch.cat([x.flatten() for x in rope(*a)])  # noqa: E731
    (ye, ge), (yc, gc) = eager_and_compiled(both, q, k, *rope_angles(positions, 16, 1000.0, dtype))
    close(ye, yc, dtype)
    close(ge[0], gc[0], dtype)
    close(ge[1], gc[1], dtype)

    (ye, ge), (yc, gc) = eager_and_compiled(silu_mul, rand(2, 5, 24, dtype=dtype, grad=True),
                                            rand(2, 5, 24, dtype=dtype, grad=True))
    close(ye, yc, dtype)
    for a, b in zip(ge, gc):
        close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_merge(compiled, dtype):
    B, n, T, d, S = 2, 3, 5, 16, 2
    q = rand(B, n, T, d, dtype=dtype)
    lses, outs = [rand(B, n, T)], [rand(B, n, T, d, dtype=dtype)]
    eks = [rand(B, n, T, d, dtype=dtype) for _ in range(S)]
    evs = [rand(B, n, T, d, dtype=dtype) for _ in range(S)]
    (oe, le), _ = eager_and_compiled(_merge, q, lses, outs, eks, evs, d ** -0.5)[0]
    (oc, lc), _ = eager_and_compiled(_merge, q, lses, outs, eks, evs, d ** -0.5)[1]
    close(oe, oc, dtype)
    close(le, lc, torch.float32)                 # lse is fp32 in both

    dout = rand(B, n, T, d, dtype=dtype)
    ge, gc = (r[0] for r in eager_and_compiled(_merge_grads, dout, le, lses))
    close(ge[0], gc[0], dtype)
    dqs = [rand(B, n, T, d, dtype=dtype)]
    (dqe, dke, dve), (dqc, dkc, dvc) = (r[0] for r in eager_and_compiled(
        _merge_backward, dout, oe, q, le, dqs, eks, evs, d ** -0.5))
    close(dqe, dqc, dtype)
    for a, b in zip(dke + dve, dkc + dvc):
        close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_cross_entropy(compiled, dtype):
    z = 3 * rand(6, 40, dtype=dtype)
    p = torch.randn(9, 40).softmax(-1)
    rows = torch.tensor([0, 2, 2, 5, 7, 8])
    (ce_e, top_e, d_e), (ce_c, top_c, d_c) = (r[0] for r in eager_and_compiled(_soft_ce, z, p, rows))
    close(ce_e, ce_c, torch.float32)             # fp32 statistics in both
    assert torch.equal(top_c, top_e) and torch.equal(top_e, z.argmax(-1))
    close(d_e, d_c, dtype)
    g = torch.rand(6)
    ge, gc = (r[0] for r in eager_and_compiled(_scale_rows, d_e, g))
    close(ge, gc, dtype)


def test_ttt_loss_compiled_matches_eager(compiled):
    """The whole unrolled loss and every gradient, fp32, TTT 3 (merges over 0, 1 and 2 own keys)."""
    from tests.test_loss import make_case
    drafter, batch, vocab = make_case()
    drafter.float()
    batch = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
    results = []
    for enabled in (False, True):
        fused.set_enabled(enabled)
        drafter.zero_grad(set_to_none=True)
        out = ttt_loss(drafter, **batch, vocab=vocab, ttt_steps=3)
        out.loss.backward()
        results.append((out.loss.detach(), out.correct,
                        {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}))
    (le, ce, ge), (lc, cc, gc) = results
    assert lc.item() == pytest.approx(le.item(), rel=1e-5)
    assert torch.equal(ce, cc)
    assert ge.keys() == gc.keys() and len(ge) == 12          # q/k/v stored as two fused halves
    for name in ge:
        torch.testing.assert_close(gc[name], ge[name], rtol=1e-4, atol=1e-5, msg=name)


def test_reused_weight_sums_its_uses_gradients_like_autograd():
    """eagle3.reused: a weight used three times (one use's output never reaching the loss, so
    autograd never runs its backward), under a cast to another dtype: values and the gradients of
    the weight and of every input equal plain F.linear's."""
    from eagle3.reused import linear, reuse
    torch.manual_seed(0)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(3, 5, 4, requires_grad=True) for _ in range(3)]
    g = torch.randn(3, 5, 6)

    def run(lin, weight):
        ys = [lin(x, weight) for x in xs]
        loss = (ys[0] * g).sum() + (ys[1].float() ** 2).sum()        # ys[2] is not used
        return ys, torch.autograd.grad(loss, [w, xs[0], xs[1]])

    ys_got, grads_got = run(linear, reuse(w, torch.float32))
    ys_want, grads_want = run(torch.nn.functional.linear, w.float())
    for a, b in zip(ys_got, ys_want):
        torch.testing.assert_close(a, b)
    assert grads_got[0].dtype == torch.float64
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-5)


def test_shared_rows_and_adds_inside_the_gemm_match_autograd():
    """eagle3.reused.window and linear's add: windows of one tensor read by several steps
    (overlapping, one window's output unused), each added inside a GEMM, give the values and
    gradients that plain slicing and `+` give. Batch 2, so a window is not one block of memory;
    the last use adds an fp32 tensor to the fp64 GEMM (promoted, as `+`)."""
    from eagle3.reused import linear, reuse, shared, window
    torch.manual_seed(0)
    x = torch.randn(2, 9, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    ys = [torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    r = torch.randn(2, 5, 6, requires_grad=True)
    g = torch.randn(5, 2, 5, 6, dtype=torch.float64)

    def run(lin, win):
        outs = [lin(y, win(s)) for s, y in enumerate(ys)] + [lin(ys[0], r)]
        loss = sum((o * g[s]).sum() for s, o in enumerate(outs) if s != 3)    # outs[3] is not used
        return outs, torch.autograd.grad(loss, [x, w, r, *ys[:3]])

    sx, rw = shared(x), reuse(w, torch.float64)
    got = run(lambda y, a: linear(y, rw, add=a), lambda s: window(sx, s, 5))
    want = run(lambda y, a: torch.nn.functional.linear(y, w) + a, lambda s: x[:, s:s + 5])
    assert got[0][-1].dtype == torch.float64
    for a, b in zip(got[0] + list(got[1]), want[0] + list(want[1])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

    # an add wider than the weight's compute dtype widens the output, as `+` does; the GEMMs'
    # gradients stay in the weight's dtype
    wide = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    w32 = w.detach().float().requires_grad_()
    results = []
    for lin in (lambda: linear(ys[0], reuse(w32, torch.float32), add=wide),
                lambda: torch.nn.functional.linear(ys[0].float(), w32) + wide):
        out = lin()
        results.append((out, *torch.autograd.grad((out * g[0]).sum(), [w32, wide, ys[0]])))
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_widened_gradient_and_teacher_compiled_match_eager(compiled):
    """The cast of a summed bf16 weight gradient to fp32 (exact either way), and the teacher's
    argmax and draft-column softmax from one pass over the logits."""
    from eagle3.loss import _teacher_rows
    from eagle3.reused import _widen
    (e, _), (c, _) = eager_and_compiled(_widen, rand(37, 11, dtype=torch.bfloat16), torch.float32)
    assert c.dtype == torch.float32 and torch.equal(c, e)
    logits, ids = rand(9, 50), torch.tensor([3, 7, 8, 20, 41, 49])
    (e_top, e_p), (c_top, c_p) = [r for r, _ in eager_and_compiled(_teacher_rows, logits, ids, torch.float32)]
    assert torch.equal(c_top, e_top) and torch.equal(e_top, logits.argmax(-1))
    close(e_p, c_p, torch.float32)
    torch.testing.assert_close(e_p, logits[:, ids].softmax(-1))


def test_widths_compile_as_constants_and_row_counts_do_not(compiled):
    """The last dim of a 2+-dim argument is a model width: a new one compiles a new graph; a new
    number of rows (or a 1-dim argument's new length) does not."""
    @fused.fused
    def scale(x, w):
        return x * w

    graphs = lambda: counters["stats"]["unique_graphs"]
    before = graphs()
    for rows in (3, 5, 9):
        torch.testing.assert_close(scale(torch.ones(rows, 8), torch.arange(8.0)), torch.arange(8.0).expand(rows, 8))
    assert graphs() - before == 1
    scale(torch.ones(5, 16), torch.arange(16.0))
    assert graphs() - before == 2
