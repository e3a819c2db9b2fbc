"""Training-time test against a naive reference that recomputes every (step, row) of the unrolled
drafter with explicit per-step keys and values, in loops; and that reference against the cached
inference chain (what an engine runs). Each `train.loss` choice against its textbook form over
full-vocabulary distributions (torch.distributions where it has one)."""
import dataclasses
import math

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from eagle3.losses import LOSSES
from eagle3.loss import CountedRows, counted_rows, target_teacher, ttt_loss, ttt_mask
from eagle3.model import DraftKVCache, Eagle3Drafter
from eagle3.shape import DrafterShape
from eagle3.vocab import build_vocab

SHAPE = DrafterShape(hidden_size=16, intermediate_size=24, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, vocab_size=20, draft_vocab_size=12,
                     target_hidden_size=12, num_aux=3, rms_norm_eps=1e-6, rope_theta=100.0)

NORMS = [dict(fc_norm=True), dict(norm_output=True), dict(fc_norm=True, norm_output=True)]


def make_case(seed=0, B=2, T=9, lengths=(9, 6), **norms):
    torch.manual_seed(seed)
    d = Eagle3Drafter(dataclasses.replace(SHAPE, **norms)).double()
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        d.embed_tokens.weight.normal_()
    batch = dict(
        input_ids=torch.randint(0, 20, (B, T)),
        loss_mask=(torch.rand(B, T) < 0.8).to(torch.uint8),
        attention_mask=torch.tensor([[i < n for i in range(T)] for n in lengths]),
        aux=torch.randn(B, T, 36, dtype=torch.float64),
        final=torch.randn(B, T, 12, dtype=torch.float64),
        target_lm_head=torch.randn(20, 12, dtype=torch.float64),
    )
    vocab = build_vocab(torch.randint(0, 100, (20,)), 12)             # 8 target ids not draftable
    return d, batch, vocab


# ---- naive reference: plain ops, one (step, row) at a time -----------------------------------
def rms(x, w, eps=1e-6):
    return x * (x.pow(2).mean() + eps).rsqrt() * w


def rope_vec(x, pos, theta):
    """x [d]: rotate the pairs (x_i, x_{i+d/2}) by angle pos * theta^(-2i/d), one at a time."""
    d = x.shape[0]
    out = x.clone()
    for i in range(d // 2):
        a = pos * theta ** (-2 * i / d)
        out[i] = x[i] * math.cos(a) - x[i + d // 2] * math.sin(a)
        out[i + d // 2] = x[i + d // 2] * math.cos(a) + x[i] * math.sin(a)
    return out


def naive_row(loss, p, logits, full, draft_ids):
    """One counted row's terms in float64: p [Vd] the renormalised teacher, logits [Vd] the
    drafter's, full [V] the target's logits. The acceptance-based terms compare the target's FULL
    distribution with the drafter's, which puts zero mass outside the draft vocab."""
    target, draft = Categorical(probs=p), Categorical(logits=logits)
    q_full = torch.zeros_like(full).index_put((draft_ids,), torch.softmax(logits, 0))
    tv = 0.5 * (torch.softmax(full, 0) - q_full).abs().sum()
    kl = kl_divergence(target, draft)
    m = Categorical(probs=0.5 * (p + torch.softmax(logits, 0)))
    return {"soft_ce": -(p * torch.log_softmax(logits, 0)).sum(), "kl": kl, "tv": tv,
            "lk_alpha": -torch.log(1 - tv), "jsd": m.entropy() - 0.5 * (target.entropy() + draft.entropy()),
            "lk": (kl, tv)}[loss]


def naive_step_loss(loss, terms):
    """The mean over one step's rows; LK^lambda's weight from that step's mean acceptance 1 - tv."""
    if loss != "lk":
        return torch.stack(terms).mean()
    lam = torch.exp(-3.0 * torch.stack([1 - tv for _, tv in terms]).mean()).detach()
    return torch.stack([lam * kl + (1 - lam) * tv for kl, tv in terms]).mean()


def naive_ttt(d, input_ids, loss_mask, attention_mask, aux, final, target_lm_head, vocab,
              steps, decay, loss="soft_ce"):
    # q/k/v in the engines' layout, as differentiable functions of the stored fused halves
    P = d.to_engine_names(dict(d.named_parameters()))
    m = "midlayer."
    nh, nkv, hd = SHAPE.num_attention_heads, SHAPE.num_key_value_heads, SHAPE.head_dim
    B, T = input_ids.shape
    draft_ids = vocab.draft_ids
    ce = {s: [] for s in range(steps)}
    hits = [0] * steps
    row_hit = {}                    # (b, s, t) -> bool, for counted (step, row) pairs
    for b in range(B):
        real = attention_mask[b]
        hid = {}                    # (s, t) -> h_out
        K, V = {}, {}               # (layer, s, t) -> [nkv, hd] rotated key, value
        for s in range(steps):
            xs = {}
            for t in range(T):      # this step's inputs, keys and values, row by row
                tok = int(input_ids[b, t + 1 + s]) if t + 1 + s < T else 0
                if s == 0:
                    x = aux[b, t]
                    if d.fc_norm is not None:       # EAGLE-3.1: each aux state normed on its own
                        x = torch.cat([rms(c, P[f"fc_norm.{i}.weight"]) for i, c in enumerate(x.chunk(3))])
                    h_in = x @ P["fc.weight"].T
                elif d.shape.norm_output:           # EAGLE-3.1: the next step reads the normed hidden
                    h_in = rms(hid[(s - 1, t)], P["norm.weight"])
                else:
                    h_in = hid[(s - 1, t)]
                # layer 0 reads the token and the hidden; its residual is the un-normed hidden
                a = torch.cat([rms(P["embed_tokens.weight"][tok], P[m + "input_layernorm.weight"]),
                               rms(h_in, P[m + "hidden_norm.weight"])])
                xs[t] = (h_in, a)
            for layer in range(d.shape.num_layers):
                lp = m if layer == 0 else f"layers.{layer}."
                qs = {}
                for t in range(T):
                    res, a = xs[t]
                    q = (P[lp + "self_attn.q_proj.weight"] @ a).view(nh, hd)
                    k = (P[lp + "self_attn.k_proj.weight"] @ a).view(nkv, hd)
                    v = (P[lp + "self_attn.v_proj.weight"] @ a).view(nkv, hd)
                    qs[t] = torch.stack([rope_vec(q[i], t + s, SHAPE.rope_theta) for i in range(nh)])
                    k = torch.stack([rope_vec(k[i], t + s, SHAPE.rope_theta) for i in range(nkv)])
                    K[(layer, s, t)], V[(layer, s, t)] = k, v
                for t in range(T):
                    res, q = xs[t][0], qs[t]
                    # this layer's keys: step-0 rows j <= t (real, or itself), then this row's steps 1..s
                    seen = [(layer, 0, j) for j in range(t + 1) if real[j] or j == t]
                    seen += [(layer, r, t) for r in range(1, s + 1)]
                    heads = []
                    for i in range(nh):
                        g = i // (nh // nkv)
                        sc = torch.stack([q[i] @ K[key][g] for key in seen]) / math.sqrt(hd)
                        w = torch.softmax(sc, 0)
                        heads.append(sum(w[n] * V[key][g] for n, key in enumerate(seen)))
                    h1 = res + P[lp + "self_attn.o_proj.weight"] @ torch.cat(heads)
                    x = rms(h1, P[lp + "post_attention_layernorm.weight"])
                    gate = P[lp + "mlp.gate_proj.weight"] @ x
                    h2 = h1 + P[lp + "mlp.down_proj.weight"] @ (
                        torch.nn.functional.silu(gate) * (P[lp + "mlp.up_proj.weight"] @ x))
                    # a layer j >= 1 reads the residual stream, pre-normed (no embedding)
                    nxt = f"layers.{layer + 1}.input_layernorm.weight"
                    xs[t] = (h2, rms(h2, P[nxt]) if nxt in P else None)
            for t in range(T):
                h2 = xs[t][0]
                hid[(s, t)] = h2
                # the prediction of x_{t+2+s}, taught by the target at row t+1+s
                if t + 2 + s >= T or not (loss_mask[b, t + 2 + s] and real[t + 2 + s]):
                    continue
                full = target_lm_head @ final[b, t + 1 + s]
                if not vocab.t2d[full.argmax()]:
                    continue
                p = torch.softmax(full[draft_ids], 0)
                logits = P["lm_head.weight"] @ rms(h2, P["norm.weight"])
                ce[s].append(naive_row(loss, p, logits, full, draft_ids))
                hits[s] += int(draft_ids[logits.argmax()] == full.argmax())
                row_hit[(b, s, t)] = bool(draft_ids[logits.argmax()] == full.argmax())
    per_step = [naive_step_loss(loss, ce[s]) if ce[s] else torch.zeros((), dtype=torch.float64)
                for s in range(steps)]
    loss = sum(decay ** s * per_step[s] for s in range(steps))
    naive_ttt.row_hit = row_hit
    return loss, per_step, hits, [len(ce[s]) for s in range(steps)], hid


def naive_chain(loss_mask, attention_mask, row_hit, steps):
    """(accepted [steps], chained): a chain starts at every row t whose x_{t+2} is a real assistant
    token, and is accepted through position s when steps 0..s at row t all hit (missing = a miss)."""
    B, T = loss_mask.shape
    accepted, chained = [0] * steps, 0
    for b in range(B):
        for t in range(T - 2):
            if not (loss_mask[b, t + 2] and attention_mask[b, t + 2]):
                continue
            chained += 1
            for s in range(steps):
                if not row_hit.get((b, s, t), False):
                    break
                accepted[s] += 1
    return accepted, chained


def grads(d, loss):
    d.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("loss", LOSSES)
def test_ttt_loss_and_grads_equal_naive_reference(loss):
    d, batch, vocab = make_case()
    steps, decay = 4, 0.8
    out = ttt_loss(d, **batch, vocab=vocab, ttt_steps=steps, decay=decay, loss=loss)
    got = grads(d, out.loss)
    ref_loss, ref_steps, ref_hits, ref_counts, _ = naive_ttt(d, **batch, vocab=vocab,
                                                             steps=steps, decay=decay, loss=loss)
    want = grads(d, ref_loss)
    # the case exercises every mask: counted rows in every step, rows dropped as off-vocab
    assert all(c > 0 for c in ref_counts)
    wanted_rows = sum(int(batch["loss_mask"][b, 2:].bool()[batch["attention_mask"][b, 2:]].sum())
                      for b in range(2))
    assert ref_counts[0] < wanted_rows
    assert out.count.tolist() == ref_counts and out.correct.tolist() == ref_hits
    ref_accepted, ref_chained = naive_chain(batch["loss_mask"], batch["attention_mask"], naive_ttt.row_hit, steps)
    assert out.accepted.tolist() == ref_accepted and int(out.chained) == ref_chained == wanted_rows
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.per_step_loss.double(), torch.stack(ref_steps),
                               rtol=1e-6, atol=1e-7)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11, msg=name)
        assert got[name].abs().sum() > 0, name                         # every weight is trained


@pytest.mark.parametrize("norms", [dict(num_layers=2), dict(num_layers=3, norm_output=True)])
def test_layers_in_ttt_equal_naive_reference(norms):
    """num_layers > 1: layers j >= 1 (pre-norm Llama layers over the residual stream, each with its
    own keys and values across the TTT steps): loss and the gradient of every weight."""
    d, batch, vocab = make_case(seed=4, **norms)
    out = ttt_loss(d, **batch, vocab=vocab, ttt_steps=3, decay=0.8)
    got = grads(d, out.loss)
    ref_loss, _, ref_hits, ref_counts, _ = naive_ttt(d, **batch, vocab=vocab, steps=3, decay=0.8)
    want = grads(d, ref_loss)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-10, atol=1e-12)
    assert out.count.tolist() == ref_counts and out.correct.tolist() == ref_hits
    assert set(got) == set(want)
    assert {n for n in got if n.startswith("layers.")} == {
        f"layers.{j}.{n}" for j in range(1, norms["num_layers"]) for n in (
            "input_layernorm.weight", "self_attn.qkv", "self_attn.o_proj.weight",
            "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
            "mlp.down_proj.weight")}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11, msg=name)
        assert got[name].abs().sum() > 0, name


@pytest.mark.parametrize("norms", NORMS)
@pytest.mark.parametrize("loss", ["soft_ce", "lk"])
def test_eagle31_norms_in_ttt_equal_naive_reference(norms, loss):
    """fc_norm (each aux state normed before fc) and norm_output (the next step reads norm(h_out)):
    loss and gradients of every weight, fc_norm's included, against the naive unroll."""
    d, batch, vocab = make_case(seed=6, **norms)
    out = ttt_loss(d, **batch, vocab=vocab, ttt_steps=3, decay=0.7, loss=loss)
    got = grads(d, out.loss)
    ref_loss, *_ = naive_ttt(d, **batch, vocab=vocab, steps=3, decay=0.7, loss=loss)
    want = grads(d, ref_loss)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-10, atol=1e-12)
    assert set(got) == set(want) and any(n.startswith("fc_norm.") for n in got) == bool(norms.get("fc_norm"))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11, msg=name)
        assert got[name].abs().sum() > 0, name


def test_chain_acceptance_counts_a_chain_only_while_every_step_hits():
    """A drafter that always drafts draft_ids[0] (zero lm_head) against a target whose argmax is that
    token on most rows: long chains, broken by the rows where it is not and by off-vocab rows. The
    engine-style acceptance must equal the naive chain count, fall with the position, and stay
    below the per-step accuracy (which neither needs earlier hits nor counts off-vocab rows)."""
    d, batch, vocab = make_case(seed=3, B=2, T=12, lengths=(12, 10))
    steps = 5
    with torch.no_grad():
        d.lm_head.weight.zero_()
        favourite = int(vocab.draft_ids[0])
        batch["target_lm_head"][favourite] = 0.0
        batch["target_lm_head"][:, 0] = 0.0
        batch["final"][..., 0] = torch.where(torch.rand(2, 12) < 0.85, 50.0, -50.0).double()
        batch["target_lm_head"][favourite, 0] = 1.0
        out = ttt_loss(d, **batch, vocab=vocab, ttt_steps=steps, decay=0.8)
    naive_ttt(d, **batch, vocab=vocab, steps=steps, decay=0.8)
    ref_accepted, ref_chained = naive_chain(batch["loss_mask"], batch["attention_mask"], naive_ttt.row_hit, steps)
    assert out.accepted.tolist() == ref_accepted and int(out.chained) == ref_chained
    assert ref_accepted[0] > ref_accepted[1] > ref_accepted[2] > 0          # the case has real chains
    accept = [a / ref_chained for a in ref_accepted]
    acc = [c / n for c, n in zip(out.correct.tolist(), out.count.tolist())]
    assert all(a < b for a, b in zip(accept[1:], acc[1:]))


@pytest.mark.parametrize("norms", [{}] + NORMS + [dict(num_layers=2), dict(num_layers=2, norm_output=True)])
def test_naive_reference_is_the_cached_inference_chain(norms):
    """Row t at step s of TTT == drafting s steps from row t with a KV cache (the engine's view:
    step-0 rows 0..t in the cache, then the chain at positions t+1, t+2, ...)."""
    d, batch, vocab = make_case(seed=1, B=1, T=9, lengths=(9,), **norms)
    carry = d.carry if norms.get("norm_output") else (lambda h: h)
    steps = 4
    *_, hid = naive_ttt(d, **batch, vocab=vocab, steps=steps, decay=0.8)
    ids, aux = batch["input_ids"], batch["aux"]
    h0 = d.project(aux)
    with torch.no_grad():
        for t in range(0, 9 - steps):
            cache = DraftKVCache()
            _, h = d.forward_step(ids[:, 1:t + 2], h0[:, :t + 1], torch.arange(t + 1)[None], cache)
            h = h[:, -1:]
            torch.testing.assert_close(h[0, 0], carry(hid[(0, t)]), rtol=1e-10, atol=1e-10)
            for s in range(1, steps):
                _, h = d.forward_step(ids[:, t + 1 + s:t + 2 + s], h,
                                      torch.tensor([[t + s]]), cache)
                torch.testing.assert_close(h[0, 0], carry(hid[(s, t)]), rtol=1e-10, atol=1e-10)


def test_ttt_mask_pattern():
    real = torch.tensor([[True, True, True, False]])
    got = ttt_mask(real, 2)[0, 0].int()
    causal = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]   # padded row 3 sees itself
    eye = torch.eye(4, dtype=torch.int).tolist()
    want = [causal[i] + eye[i] + eye[i] for i in range(4)]
    assert got.tolist() == want


def test_nothing_counted_gives_zero_loss_and_finite_grads():
    d, batch, vocab = make_case(seed=2)
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    out = ttt_loss(d, **batch, vocab=vocab, ttt_steps=3)
    g = grads(d, out.loss)
    assert out.loss.item() == 0.0 and out.count.tolist() == [0, 0, 0] and out.acc == [0.0] * 3
    assert all(torch.isfinite(v).all() and v.abs().sum() == 0 for v in g.values())


@pytest.mark.parametrize("B, T", [(3, 17), (2, 4), (1, 2)])
def test_counted_rows_split_by_step_equal_each_steps_nonzero(B, T):
    """CountedRows finds all steps' rows by one stable sort; step by step, its (b, t) must be
    exactly that step's mask's nonzero(), in order (the heads gather rows and teacher rows by
    them), and `count` its number."""
    g = torch.Generator().manual_seed(B * 100 + T)
    loss_mask = torch.rand(B, T, generator=g) < 0.7
    attention_mask = torch.rand(B, T, generator=g) < 0.9
    top = torch.randint(0, 50, (B, T), generator=g)
    t2d = torch.rand(50, generator=g) < 0.6
    counted = CountedRows(loss_mask, attention_mask, top, t2d, 7)
    step, b, t = counted.rows()
    assert torch.equal(step, step.sort().values)
    for s in range(7):
        want = (counted_rows(loss_mask, attention_mask, top, t2d, s).nonzero(as_tuple=True)
                if T - 2 - s > 0 else (torch.zeros(0, dtype=torch.int64),) * 2)
        assert torch.equal(b[step == s], want[0]) and torch.equal(t[step == s], want[1]), s
        assert counted.count[s] == len(want[0])


@pytest.mark.parametrize("steps", [1, 7])
def test_more_steps_than_rows_is_safe(steps):
    d, batch, vocab = make_case(seed=3, B=2, T=5, lengths=(5, 3))
    out = ttt_loss(d, **batch, vocab=vocab, ttt_steps=steps)
    assert torch.isfinite(out.loss) and out.count[3:].sum() == 0


def test_bench_runs_full_steps_on_cpu(monkeypatch, capsys):
    """bench/train_speed.py at tiny dims: full training steps, and the numbers it must print."""
    import importlib.util
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "train_speed.py"
    spec = importlib.util.spec_from_file_location("train_speed", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", [str(path), "--hidden", "32", "--intermediate", "48",
                                      "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                                      "--vocab", "300", "--draft-vocab", "64", "--seq", "32",
                                      "--ttt", "3", "--steps", "2", "--warmup", "1",
                                      "--device", "cpu", "--dtype", "fp32", "--layers", "2"])
    bench.main()
    lines = capsys.readouterr().out.splitlines()
    for key in ("params", "ms/step", "tokens/s", "peak memory", "FLOPs/step", "MFU"):
        assert any(line.startswith(key) for line in lines), (key, lines)
    # a second layer adds, per TTT step, its GEMMs (q/k/v over H inputs, o, the MLP) and its attention
    B, T, S = 2, 9, 3
    s2 = dataclasses.replace(SHAPE, num_layers=2)
    gemms = 2 * B * T * (16 * (4 + 2 * 2) * 8 + 4 * 8 * 16 + 3 * 16 * 24)
    attention = sum(4 * B * 4 * 8 * (T * (T + 1) / 2 + st * T) for st in range(S))
    assert bench.train_flops(s2, B, T, S) - bench.train_flops(SHAPE, B, T, S) == 3 * (S * gemms + attention)


def test_micro_batches_with_global_norm_add_up_to_the_whole_batch():
    """What data parallelism and gradient accumulation rely on (train.py): each part divides by the
    global batch's per-step counts, so the parts' losses and gradients sum to the whole batch's; the
    parts' counted rows found before any forward (as train.py finds them) change nothing."""
    from eagle3.loss import CountedRows
    d, batch, vocab = make_case(seed=3, B=4, lengths=(9, 6, 8, 4))
    steps = 4
    whole = ttt_loss(d, **batch, vocab=vocab, ttt_steps=steps)
    want = grads(d, whole.loss)
    parts = [{k: v[i:i + 2] if k != "target_lm_head" else v for k, v in batch.items()} for i in (0, 2)]
    teachers = [target_teacher(p["final"], p["target_lm_head"], vocab.draft_ids) for p in parts]
    counted = [CountedRows(p["loss_mask"], p["attention_mask"].bool(), t[1], vocab.t2d, steps)
               for p, t in zip(parts, teachers)]
    norm = sum(c.count for c in counted)
    assert norm.tolist() == whole.count.tolist()
    total, got = 0.0, None
    for p, t, c in zip(parts, teachers, counted):
        out = ttt_loss(d, **p, vocab=vocab, ttt_steps=steps, teacher=t, norm=norm, counted=c)
        g = grads(d, out.loss)
        got = g if got is None else {n: got[n] + g[n] for n in g}
        total += out.loss.item()
    assert total == pytest.approx(whole.loss.item(), rel=1e-10)
    # a part's own mean differs from its share: the test would catch the old per-part normalisation
    assert ttt_loss(d, **parts[1], vocab=vocab, ttt_steps=steps).loss.item() != pytest.approx(
        whole.loss.item() - (total - out.loss.item()), rel=1e-3)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-11, msg=n)


@pytest.mark.parametrize("backend", ["cpu", "math"])
def test_attend_equals_dense_ttt_mask_attention(monkeypatch, backend):
    """attend (flash causal over K_0 + each row's own keys, merged by log-sum-exp; its own backward)
    == softmax attention over [K_0 | K_1 .. K_s] with the dense ttt_mask, values and gradients,
    for the real rows of right-padded sequences; both the CPU flash kernel and the math backend."""
    import eagle3.attention as model
    monkeypatch.setattr(model, "_backend", lambda q: backend)
    torch.manual_seed(4)
    B, nh, nkv, T, d, s = 2, 4, 2, 7, 8, 3
    real = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    q = torch.randn(B, nh, T, d, dtype=torch.float64, requires_grad=True)
    ks = [torch.randn(B, nkv, T, d, dtype=torch.float64, requires_grad=True) for _ in range(s + 1)]
    vs = [torch.randn(B, nkv, T, d, dtype=torch.float64, requires_grad=True) for _ in range(s + 1)]
    got = model.attend(q, ks[0], vs[0], ks[1:], vs[1:])
    want = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat(ks, 2).repeat_interleave(2, 1), torch.cat(vs, 2).repeat_interleave(2, 1),
        attn_mask=ttt_mask(real, s))
    keep = real[:, None, :, None].double()                  # padded rows differ and are unused
    up = torch.randn_like(got)
    g_got = torch.autograd.grad((got * keep * up).sum(), [q, *ks, *vs])
    g_want = torch.autograd.grad((want * keep * up).sum(), [q, *ks, *vs])
    torch.testing.assert_close(got * keep, want * keep, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert a.abs().sum() > 0


def test_soft_cross_entropy_equals_log_softmax_form():
    from eagle3.loss import _SoftCrossEntropy
    torch.manual_seed(5)
    z = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    p = torch.randn(9, 11, dtype=torch.float64).softmax(-1)
    rows = torch.tensor([0, 3, 3, 8, 1, 5])
    g = torch.randn(6, dtype=torch.float64)
    got, top = _SoftCrossEntropy.apply(z, p, rows)
    assert torch.equal(top, z.argmax(-1))
    want = -(p[rows] * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad((got * g).sum(), z)[0],
                               torch.autograd.grad((want * g).sum(), z)[0], rtol=1e-12, atol=1e-12)


def test_kl_differs_from_soft_ce_by_the_teachers_entropy_only():
    """Forward KL = soft CE - H(p): the same gradient, so `kl` and `soft_ce` train the same drafter."""
    d, batch, vocab = make_case(seed=7)
    ce, kl = (ttt_loss(d, **batch, vocab=vocab, ttt_steps=3, loss=name) for name in ("soft_ce", "kl"))
    assert (ce.per_step_loss > kl.per_step_loss).all()
    g_ce, g_kl = grads(d, ce.loss), grads(d, kl.loss)
    for name in g_ce:
        torch.testing.assert_close(g_kl[name], g_ce[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("loss", [n for n in LOSSES if n != "soft_ce"])
def test_lean_row_losses_equal_autograd_in_chunks(loss):
    """The chunked loss that keeps only dloss/dz gives the values and gradients of plain autograd
    over the whole batch (lk's weight too, though it depends on every row of a step), for chunks of
    1, 3 and all rows; teacher rows are gathered with repeats, as TTT steps share them."""
    from eagle3.losses import lean_row_losses, row_losses
    g = torch.Generator().manual_seed(3)
    n, r, vd, steps = 11, 6, 7, 3
    z0 = torch.randn(n, vd, generator=g, dtype=torch.float64) * 2
    p = torch.randn(r, vd, generator=g, dtype=torch.float64).softmax(-1)
    rows = torch.randint(0, r, (n,), generator=g)
    mass = torch.rand(r, generator=g, dtype=torch.float64) * 0.5 + 0.5
    step = torch.randint(0, steps, (n,), generator=g)
    up = torch.randn(n, generator=g, dtype=torch.float64)
    z = z0.clone().requires_grad_(True)
    want = row_losses(loss, z, p[rows], mass[rows], step, steps)
    want_grad, = torch.autograd.grad((want * up).sum(), z)
    for chunk_rows in (1, 3, n):
        z = z0.clone().requires_grad_(True)
        got = lean_row_losses(loss, z, p, rows, mass, step, steps, chunk_elems=chunk_rows * vd)
        got_grad, = torch.autograd.grad((got * up).sum(), z)
        torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    assert want_grad.abs().sum() > 0


def test_unknown_loss_is_refused():
    d, batch, vocab = make_case()
    with pytest.raises(ValueError, match="train.loss='ce'"):
        ttt_loss(d, **batch, vocab=vocab, ttt_steps=2, loss="ce")
