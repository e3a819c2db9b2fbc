"""The drafter against an independent re-implementation of SGLang's LlamaForCausalLMEagle3 math,
and its cached (inference) path against its full causal forward."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from eagle3.config import DrafterConfig
from eagle3.model import DraftKVCache, Eagle3Drafter
from eagle3.shape import DrafterShape, drafter_shape

SHAPE = DrafterShape(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=50, draft_vocab_size=20,
                     target_hidden_size=24, num_aux=3, rms_norm_eps=1e-6, rope_theta=1000.0,
                     max_position_embeddings=64)


def make_drafter(seed=0, shape=SHAPE):
    torch.manual_seed(seed)
    d = Eagle3Drafter(shape).double()
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:                     # norms away from 1 so each one matters
                p.copy_(1 + 0.3 * torch.randn_like(p))
        d.embed_tokens.weight.normal_()
    return d


# ---- SGLang 0.5.23 llama_eagle3.py, re-written with plain ops (fused residual RMSNorm) -------
def sgl_rmsnorm(x, w, eps, residual=None):
    """sglang RMSNorm.forward_native: with a residual it adds first and returns (normed, sum)."""
    if residual is not None:
        x = x + residual
        residual = x
    y = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w
    return y if residual is None else (y, residual)


def neox_rope(x, pos, theta):
    """x [T, n, d]; rotate (x_i, x_{i+d/2}) pairs as complex numbers by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64),
                      pos[:, None].double() * freqs)                  # [T, d/2]
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * rot[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def sglang_eagle3_forward(sd, s: DrafterShape, aux, ids):
    """One sequence: aux [T, k*Ht], ids [T] -> (logits [T, Vd], aux_out [T, H]). Layers j >= 1
    (SGLang's LlamaDecoderLayer with layer_id > 0) pre-norm the residual stream with hidden_norm."""
    eps = s.rms_norm_eps
    hidden = aux @ sd["fc.weight"].T                                   # fc on the aux concat
    embeds = sd["embed_tokens.weight"][ids]
    residual = hidden
    hidden = sgl_rmsnorm(hidden, sd["midlayer.hidden_norm.weight"], eps)
    embeds = sgl_rmsnorm(embeds, sd["midlayer.input_layernorm.weight"], eps)
    hidden, residual = sgl_layer(sd, s, "midlayer.", torch.cat([embeds, hidden], dim=-1), residual)
    for j in range(1, s.num_layers):
        p = f"layers.{j}."
        x, residual = sgl_rmsnorm(hidden, sd[p + "hidden_norm.weight"], eps, residual)
        hidden, residual = sgl_layer(sd, s, p, x, residual)
    to_logits, to_aux = sgl_rmsnorm(hidden, sd["norm.weight"], eps, residual)
    return to_logits @ sd["lm_head.weight"].T, to_aux


def sgl_layer(sd, s: DrafterShape, p, x, residual):
    """A decoder layer from its (normed) attention input x [T, 2H or H] -> (mlp out, residual)."""
    eps, T = s.rms_norm_eps, x.shape[0]
    nh, nkv, d = s.num_attention_heads, s.num_key_value_heads, s.head_dim
    q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(T, nh, d)
    k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(T, nkv, d)
    v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(T, nkv, d)
    pos = torch.arange(T)
    q, k = neox_rope(q, pos, s.rope_theta), neox_rope(k, pos, s.rope_theta)
    out = torch.zeros(T, nh, d, dtype=torch.float64)
    for h in range(nh):
        g = h // (nh // nkv)                                           # GQA: kv head of head h
        for t in range(T):
            scores = torch.stack([q[t, h] @ k[j, g] for j in range(t + 1)]) / math.sqrt(d)
            w = torch.exp(scores - scores.max())
            w = w / w.sum()
            out[t, h] = sum(w[j] * v[j, g] for j in range(t + 1))
    attn = out.reshape(T, nh * d) @ sd[p + "self_attn.o_proj.weight"].T
    hidden, residual = sgl_rmsnorm(attn, sd[p + "post_attention_layernorm.weight"], eps, residual)
    gate = hidden @ sd[p + "mlp.gate_proj.weight"].T
    up = hidden @ sd[p + "mlp.up_proj.weight"].T
    hidden = (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return hidden, residual


EXPORT_NAMES = {
    "fc.weight": (32, 72),
    "midlayer.input_layernorm.weight": (32,), "midlayer.hidden_norm.weight": (32,),
    "midlayer.self_attn.q_proj.weight": (64, 64), "midlayer.self_attn.k_proj.weight": (32, 64),
    "midlayer.self_attn.v_proj.weight": (32, 64), "midlayer.self_attn.o_proj.weight": (32, 64),
    "midlayer.post_attention_layernorm.weight": (32,),
    "midlayer.mlp.gate_proj.weight": (48, 32), "midlayer.mlp.up_proj.weight": (48, 32),
    "midlayer.mlp.down_proj.weight": (32, 48),
    "norm.weight": (32,), "lm_head.weight": (20, 32),
}


# q/k/v are stored as the embedding and hidden halves of their fused weight (eagle3.layers.Attention)
STORED_QKV = {"midlayer.self_attn.qkv_embed": (128, 32), "midlayer.self_attn.qkv_hidden": (128, 32)}


def test_state_dict_names_are_the_export_names():
    d = Eagle3Drafter(SHAPE)
    stored = {n: s for n, s in EXPORT_NAMES.items() if ".self_attn." not in n or "o_proj" in n}
    params = {n: tuple(p.shape) for n, p in d.named_parameters()}
    assert params == {**stored, **STORED_QKV, "embed_tokens.weight": (50, 32)}
    assert not d.embed_tokens.weight.requires_grad
    assert {n for n, p in d.named_parameters() if p.requires_grad} == set(stored) | set(STORED_QKV)
    assert {n: tuple(t.shape) for n, t in d.state_dict().items()} == {**EXPORT_NAMES, "embed_tokens.weight": (50, 32)}
    exported = d.exportable_state_dict()
    assert {n: tuple(t.shape) for n, t in exported.items()} == EXPORT_NAMES
    assert SHAPE.num_trainable() == sum(p.numel() for p in d.parameters() if p.requires_grad)


def test_stored_qkv_halves_map_to_engine_weights_and_back():
    d = make_drafter()
    a = d.midlayer.self_attn
    sd = d.state_dict()
    H, sizes = SHAPE.hidden_size, [64, 32, 32]                  # q, k, v rows
    for name, e, h in zip(("q", "k", "v"), a.qkv_embed.detach().split(sizes), a.qkv_hidden.detach().split(sizes)):
        w = sd[f"midlayer.self_attn.{name}_proj.weight"]
        assert torch.equal(w[:, :H], e) and torch.equal(w[:, H:], h)    # embedding half first
    fresh = Eagle3Drafter(SHAPE)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.midlayer.self_attn.qkv_embed, a.qkv_embed)
    assert torch.equal(fresh.midlayer.self_attn.qkv_hidden, a.qkv_hidden)
    # parameter-named dicts (ZeRO-3's gathered state) convert to the same engine names
    raw = {n: p.detach() for n, p in d.named_parameters()}
    engine = d.to_engine_names(raw)
    assert engine.keys() == sd.keys() and all(torch.equal(engine[k], sd[k]) for k in sd)
    assert d.to_engine_names(sd).keys() == sd.keys()


SHAPE2 = dataclasses.replace(SHAPE, num_layers=2)


@pytest.mark.parametrize("shape", [SHAPE, SHAPE2], ids=["1layer", "2layers"])
def test_forward_matches_sglang_math_with_padding(shape):
    d = make_drafter(shape=shape)
    torch.manual_seed(1)
    B, T, lengths = 2, 7, [7, 4]
    aux = torch.randn(B, T, 72, dtype=torch.float64)
    ids = torch.randint(0, 50, (B, T))
    mask = torch.tensor([[i < n for i in range(T)] for n in lengths])
    logits, h_out = d(aux, ids, mask)
    sd = d.exportable_state_dict() | {"embed_tokens.weight": d.embed_tokens.weight}
    for b, n in enumerate(lengths):
        ref_logits, ref_aux = sglang_eagle3_forward(sd, shape, aux[b, :n], ids[b, :n])
        torch.testing.assert_close(logits[b, :n], ref_logits, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h_out[b, :n], ref_aux, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(logits).all()                               # padded rows stay finite


@pytest.mark.parametrize("shape", [SHAPE, SHAPE2], ids=["1layer", "2layers"])
def test_cached_inference_equals_full_forward(shape):
    d = make_drafter(seed=2, shape=shape)
    torch.manual_seed(3)
    T = 8
    aux = torch.randn(1, T, 72, dtype=torch.float64)
    ids = torch.randint(0, 50, (1, T))
    full_logits, full_h = d(aux, ids)
    h = d.project(aux)
    pos = torch.arange(T)[None]

    cache = DraftKVCache()                                            # token by token
    for t in range(T):
        lg, ho = d.forward_step(ids[:, t:t + 1], h[:, t:t + 1], pos[:, t:t + 1], cache)
        torch.testing.assert_close(lg, full_logits[:, t:t + 1], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ho, full_h[:, t:t + 1], rtol=1e-10, atol=1e-10)
    assert cache.length == T

    cache = DraftKVCache()                                            # prefill 5, draft, roll back
    lg, _ = d.forward_step(ids[:, :5], h[:, :5], pos[:, :5], cache)
    torch.testing.assert_close(lg, full_logits[:, :5], rtol=1e-10, atol=1e-10)
    draft_h = _
    for step in range(2):                                             # two speculative rows
        _, draft_h = d.forward_step(ids[:, :1], draft_h[:, -1:], pos[:, 5 + step:6 + step], cache)
    assert cache.length == 7
    cache.truncate(5)
    lg, _ = d.forward_step(ids[:, 5:], h[:, 5:], pos[:, 5:], cache)
    torch.testing.assert_close(lg, full_logits[:, 5:], rtol=1e-10, atol=1e-10)


# layer 1 of a two-layer drafter: a Llama layer over [H] inputs, its pre-norm under both engines' names
LAYER1_NAMES = {
    "layers.1.input_layernorm.weight": (32,), "layers.1.hidden_norm.weight": (32,),
    "layers.1.self_attn.q_proj.weight": (64, 32), "layers.1.self_attn.k_proj.weight": (32, 32),
    "layers.1.self_attn.v_proj.weight": (32, 32), "layers.1.self_attn.o_proj.weight": (32, 64),
    "layers.1.post_attention_layernorm.weight": (32,),
    "layers.1.mlp.gate_proj.weight": (48, 32), "layers.1.mlp.up_proj.weight": (48, 32),
    "layers.1.mlp.down_proj.weight": (32, 48),
}


def test_two_layers_are_named_counted_and_loaded_as_the_engines_name_them():
    d = make_drafter(seed=4, shape=SHAPE2)
    exported = d.exportable_state_dict()
    assert {n: tuple(t.shape) for n, t in exported.items()} == {**EXPORT_NAMES, **LAYER1_NAMES}
    a, b = exported["layers.1.input_layernorm.weight"], exported["layers.1.hidden_norm.weight"]
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()        # one value, two tensors
    assert not torch.equal(a, torch.ones_like(a))
    # state_dict (checkpoints) holds the one norm; q/k/v in the engines' names
    assert "layers.1.hidden_norm.weight" not in d.state_dict()
    assert set(d.state_dict()) == set(exported) - {"layers.1.hidden_norm.weight"} | {"embed_tokens.weight"}
    stored = d.layers["1"].self_attn.qkv
    qkv = [exported[f"layers.1.self_attn.{n}_proj.weight"] for n in "qkv"]
    assert torch.equal(torch.cat(qkv), stored)
    assert len({t.untyped_storage().data_ptr() for t in [*qkv, stored]}) == 4   # safetensors keeps each
    assert SHAPE2.num_trainable() == sum(p.numel() for p in d.parameters() if p.requires_grad)
    assert SHAPE2.num_trainable() - SHAPE.num_trainable() == 128 * 32 + 32 * 64 + 3 * 32 * 48 + 2 * 32
    # the export's names load back (both norms) and so do the checkpoint's
    for sd in (exported, d.state_dict()):
        fresh = Eagle3Drafter(SHAPE2).double()
        fresh.load_state_dict({**sd, "embed_tokens.weight": d.embed_tokens.weight})
        assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), d.parameters()))
    # norms that differ would be two different drafters in the two engines: refused
    bad = {**exported, "embed_tokens.weight": d.embed_tokens.weight,
           "layers.1.hidden_norm.weight": b + 1}
    with pytest.raises(ValueError, match="hidden_norm"):
        Eagle3Drafter(SHAPE2).double().load_state_dict(bad)
    # parameter-named dicts (ZeRO-3's gathered state) give the same engine names
    raw = d.to_engine_names({n: p.detach() for n, p in d.named_parameters() if n != "embed_tokens.weight"})
    assert raw.keys() == exported.keys() and all(torch.equal(raw[k], exported[k]) for k in raw)


def test_hf_config_roundtrip():
    cfg = SHAPE.to_hf_config()
    assert DrafterShape.from_hf_config(cfg) == SHAPE
    llama = LlamaConfig(**cfg)                     # transformers accepts every field
    assert llama.head_dim == 16 and llama.rope_parameters["rope_theta"] == 1000.0
    back = DrafterShape.from_hf_config(llama.to_dict())
    assert back == SHAPE
    cfg2 = SHAPE2.to_hf_config()
    assert cfg2["num_hidden_layers"] == 2 and cfg["num_hidden_layers"] == 1
    assert DrafterShape.from_hf_config(LlamaConfig(**cfg2).to_dict()) == SHAPE2


def test_rejects_non_silu():
    with pytest.raises(ValueError):
        Eagle3Drafter(DrafterShape(**{**SHAPE.__dict__, "hidden_act": "gelu"}))


def _target(**kw):
    base = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
                rope_theta=100000.0, max_position_embeddings=8192)
    return SimpleNamespace(**{**base, **kw})


def test_drafter_shape_derives_from_the_target():
    s = drafter_shape(_target(), DrafterConfig(draft_vocab_size=99), num_aux=3, draft_vocab_size=16384)
    assert s == DrafterShape(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                             num_key_value_heads=3, head_dim=64, vocab_size=49152,
                             draft_vocab_size=16384, target_hidden_size=576, num_aux=3,
                             rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192)
    # an MLA target (Kimi-K2.5 shape): the config's values win, the rest is derived
    kimi = _target(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
                   num_attention_heads=64, num_key_value_heads=64, head_dim=192, vocab_size=163840)
    s = drafter_shape(kimi, DrafterConfig(num_attention_heads=64, head_dim=128), 3, 32000)
    assert (s.head_dim, s.num_key_value_heads, s.intermediate_size) == (128, 64, 18432)
    assert drafter_shape(kimi, DrafterConfig(), 3, 32000).head_dim == 7168 // 64   # not MLA's 192
    with pytest.raises(ValueError):
        drafter_shape(kimi, DrafterConfig(hidden_size=4096), 3, 32000)
    assert drafter_shape(_target(), DrafterConfig(num_layers=2), 3, 64).num_layers == 2
    with pytest.raises(ValueError, match="num_layers"):
        drafter_shape(_target(), DrafterConfig(num_layers=0), 3, 64)


def test_target_embedding_is_copied_and_frozen():
    embed = torch.randn(50, 32)
    d = Eagle3Drafter(SHAPE, embed)
    assert torch.equal(d.embed_tokens.weight, embed) and not d.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("backend", ["cpu", "math"])
def test_attend_with_a_cache_equals_masked_attention(monkeypatch, backend):
    """Tq new rows after L cached ones (inference): every cached key plus the new rows causally;
    values and gradients against SDPA with the explicit mask."""
    import eagle3.attention as model
    monkeypatch.setattr(model, "_backend", lambda q: backend)
    torch.manual_seed(6)
    B, nh, nkv, L, Tq, d = 2, 4, 1, 5, 3, 8
    q = torch.randn(B, nh, Tq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, nkv, L + Tq, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, nkv, L + Tq, d, dtype=torch.float64, requires_grad=True)
    i, j = torch.arange(Tq)[:, None], torch.arange(L + Tq)[None, :]
    got = model.attend(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=j <= L + i)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * up).sum(), [q, k, v]),
                    torch.autograd.grad((want * up).sum(), [q, k, v])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_eagle31_norms_are_named_configured_and_counted_as_the_engines_read_them():
    """fc_norm: one RMSNorm [Ht] per aux state, `fc_norm.{i}.weight` (SGLang's and vLLM's names);
    both flags are top-level config.json fields and survive the round trip through transformers."""
    s = DrafterShape(**{**SHAPE.__dict__, "fc_norm": True, "norm_output": True})
    d = Eagle3Drafter(s)
    names = {n: tuple(t.shape) for n, t in d.exportable_state_dict().items()}
    extra = {f"fc_norm.{i}.weight": (s.target_hidden_size,) for i in range(s.num_aux)}
    assert names == {**EXPORT_NAMES, **extra}
    assert s.num_trainable() == sum(p.numel() for p in d.parameters() if p.requires_grad)
    cfg = s.to_hf_config()
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    assert DrafterShape.from_hf_config(LlamaConfig(**cfg).to_dict()) == s
    assert DrafterShape.from_hf_config(SHAPE.to_hf_config()) == SHAPE      # off by default
    s2 = drafter_shape(_target(), DrafterConfig(fc_norm=True, norm_output=True), num_aux=3, draft_vocab_size=64)
    assert (s2.fc_norm, s2.norm_output) == (True, True)


@pytest.mark.parametrize("key", ["norm_before_fc", "norm_before_residual"])
def test_engine_variants_this_drafter_does_not_compute_are_refused(key):
    with pytest.raises(ValueError, match=key):
        DrafterShape.from_hf_config({**SHAPE.to_hf_config(), key: True})
    with pytest.raises(ValueError, match=key):
        DrafterShape.from_hf_config({**SHAPE.to_hf_config(), "eagle_config": {key: True}})


def test_fc_norm_normalises_each_aux_state_on_its_own():
    s = DrafterShape(**{**SHAPE.__dict__, "fc_norm": True})
    d = Eagle3Drafter(s).double()
    torch.manual_seed(0)
    with torch.no_grad():
        for n in d.fc_norm:
            n.weight.normal_()
    aux = torch.randn(2, 5, s.num_aux * s.target_hidden_size, dtype=torch.float64)
    aux[..., :s.target_hidden_size] *= 1000.0                   # one state far louder than the others
    want = torch.cat([sgl_rmsnorm(a, n.weight, s.rms_norm_eps)
                      for a, n in zip(aux.split(s.target_hidden_size, -1), d.fc_norm)], -1) @ d.fc.weight.T
    torch.testing.assert_close(d.project(aux), want, rtol=1e-12, atol=1e-12)


def test_two_layer_export_loads_back_as_the_same_drafter(tmp_path):
    """export_drafter -> config.json (num_hidden_layers 2) + both pre-norm names for layer 1 ->
    load_hf_drafter: the same logits and next hidden, cached step by step."""
    from eagle3.export import export_drafter, load_export
    from eagle3.specdec import load_hf_drafter
    d = make_drafter(seed=5, shape=SHAPE2)
    with torch.no_grad():                                   # weights bf16 can hold: the export is exact
        for p in d.parameters():
            p.copy_(p.to(torch.bfloat16))
    d2t = torch.arange(20)                                  # draft id i is target id 2i
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[d2t + torch.arange(20)] = True
    # a checkpoint's state (one norm) turned into engine names as write_export does, on the meta device
    with torch.device("meta"):
        names = Eagle3Drafter(SHAPE2)
    state = names.to_engine_names(d.state_dict())
    out = export_drafter(tmp_path, state, SHAPE2, d2t, t2d, [1, 2, 3], ["LlamaForCausalLM"])
    for engine in ("sglang", "vllm"):
        tensors, cfg = load_export(out[engine])
        assert cfg["num_hidden_layers"] == 2
        assert set(tensors) == set(EXPORT_NAMES) | set(LAYER1_NAMES) | {"d2t", "t2d"}
        assert torch.equal(tensors["layers.1.hidden_norm.weight"], tensors["layers.1.input_layernorm.weight"])
    target = SimpleNamespace(get_input_embeddings=lambda: d.embed_tokens)
    back = load_hf_drafter(out["vllm"], target, dtype=torch.float64).model
    assert back.shape == SHAPE2
    torch.manual_seed(6)
    aux, ids = torch.randn(1, 6, 72, dtype=torch.float64), torch.randint(0, 50, (1, 6))
    for a, b in zip(d(aux, ids), back(aux, ids)):
        assert torch.equal(a, b)
    # a shape that does not count the weights' layers, or a layer 1 short of a tensor, is refused
    with pytest.raises(ValueError, match="num_layers"):
        export_drafter(tmp_path / "bad", d.exportable_state_dict(), SHAPE, d2t, t2d, [1, 2, 3], ["LlamaForCausalLM"])
    for name in ("hidden_norm", "self_attn.v_proj"):
        short = {k: v for k, v in state.items() if k != f"layers.1.{name}.weight"}
        with pytest.raises(ValueError, match=name):
            export_drafter(tmp_path / "bad", short, SHAPE2, d2t, t2d, [1, 2, 3], ["LlamaForCausalLM"])
