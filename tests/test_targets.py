"""Targets (eagle3/targets.py): GGUF cache, random targets, lazy head loading, config reading."""
import json
import time

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3 import targets
from eagle3.targets import (default_aux_layers, load_head, load_target_model, load_tokenizer,
                            resolve_target, target_info)

CONF = targets.PROJECT_ROOT / "conf" / "target"


def _tiny(name):
    c = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    return c["arch"], c["random_config"]


def _weights(d):
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_deepseek"])
def test_random_target_deterministic_and_runs(name, tmp_path):
    arch, rc = _tiny(name)
    d = resolve_target("random", "", name, arch, rc, seed=0)
    assert resolve_target("random", "", name, arch, rc, seed=0) == d
    # Rebuild from scratch into fresh directories: same seed -> identical weights, new seed -> not.
    targets._build_random(arch, rc, 0, tmp_path / "again")
    targets._build_random(arch, rc, 1, tmp_path / "seed1")
    w, again, other = _weights(d), _weights(tmp_path / "again"), _weights(tmp_path / "seed1")
    assert w.keys() == again.keys() and all(torch.equal(w[k], again[k]) for k in w)
    assert not torch.equal(w["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert targets.fingerprint(d) == targets.fingerprint(tmp_path / "again") != targets.fingerprint(tmp_path / "seed1")

    info = target_info(d)
    assert (info.model_type, info.num_layers, info.hidden_size) == (arch, rc["num_hidden_layers"], rc["hidden_size"])
    assert info.vocab_size == len(load_tokenizer(d)) == 49152
    model = load_target_model(d, torch.float32, "cpu")
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, info.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(ids, output_hidden_states=True)
    hs = out.hidden_states
    assert len(hs) == info.num_layers + 1 and out.logits.shape == (2, 16, info.vocab_size)
    assert torch.isfinite(out.logits).all()
    # Non-degenerate init: every decoder layer changes the residual stream by a clear margin.
    for i in range(info.num_layers - 1):
        assert ((hs[i + 1] - hs[i]).norm() / hs[i].norm()) > 0.2, f"layer {i} barely changes the state"
    embed, lm_head = load_head(d)
    assert torch.equal(embed, model.model.embed_tokens.weight) and torch.equal(lm_head, model.lm_head.weight)


def test_build_once_is_atomic(tmp_path):
    out = tmp_path / "targets" / "x-abc"

    def failing(tmp):
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("killed mid-write")
    with pytest.raises(RuntimeError):
        targets._build_once(out, failing)
    assert not out.exists() and list((tmp_path / "targets").iterdir()) == []
    calls = []

    def good(tmp):
        calls.append(tmp)
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    assert targets._build_once(out, good) == out and targets._build_once(out, good) == out
    assert len(calls) == 1 and sorted(p.name for p in out.parent.iterdir()) == ["x-abc"]


def test_hf_source_checks_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        resolve_target("hf", str(tmp_path / "nope"), "x")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_target("hf", str(tmp_path), "x")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_target("hf", str(tmp_path), "x") == tmp_path


KIMI_TEXT = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
             "vocab_size": 163840, "num_hidden_layers": 61, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
             "max_position_embeddings": 262144, "intermediate_size": 18432, "num_attention_heads": 64,
             "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
             "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False}


def _kimi_dir(d, vocab=40, hidden=8):
    """A Kimi-K2.5-shaped checkpoint: wrapper config, `language_model.` names, two shards + index."""
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": dict(KIMI_TEXT, hidden_size=hidden, vocab_size=vocab),
           "vision_config": {"hidden_size": 1152}, "tie_word_embeddings": False}
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    t = {"language_model.model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16),
         "language_model.lm_head.weight": torch.randn(vocab, hidden, generator=g).to(torch.bfloat16),
         "language_model.model.layers.0.mlp.gate.weight": torch.randn(4, hidden, generator=g),
         "vision_tower.patch_embed.weight": torch.randn(3, 3, generator=g)}
    shards = {"model-00001-of-00002.safetensors": ["language_model.model.embed_tokens.weight",
                                                   "vision_tower.patch_embed.weight"],
              "model-00002-of-00002.safetensors": ["language_model.lm_head.weight",
                                                   "language_model.model.layers.0.mlp.gate.weight"]}
    for f, names in shards.items():
        save_file({n: t[n] for n in names}, str(d / f))
    index = {"metadata": {}, "weight_map": {n: f for f, names in shards.items() for n in names}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return t


def test_load_head_sharded_language_model_prefix(tmp_path):
    t = _kimi_dir(tmp_path / "kimi")
    embed, lm_head = load_head(tmp_path / "kimi")
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, t["language_model.model.embed_tokens.weight"])
    assert torch.equal(lm_head, t["language_model.lm_head.weight"])


def test_load_head_tied_and_missing(tmp_path):
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(30, 6, generator=g)
    for name, tie, extra in (("flag", True, {"lm_head.weight": torch.randn(30, 6, generator=g)}),
                             ("absent", False, {})):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"tie_word_embeddings": tie}))
        save_file({"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(6), **extra},
                  str(d / "model.safetensors"))
        embed, lm_head = load_head(d)
        assert torch.equal(embed, emb) and torch.equal(lm_head, emb)
    d = tmp_path / "untied"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    head = torch.randn(30, 6, generator=g)
    save_file({"model.embed_tokens.weight": emb}, str(d / "a.safetensors"))
    save_file({"lm_head.weight": head}, str(d / "b.safetensors"))
    assert torch.equal(load_head(d)[1], head)
    d = tmp_path / "noembed"
    d.mkdir()
    save_file({"lm_head.weight": head}, str(d / "model.safetensors"))
    with pytest.raises(KeyError, match="noembed.*model.embed_tokens.weight"):
        load_head(d)


def test_target_info_kimi_wrapper(tmp_path):
    _kimi_dir(tmp_path / "kimi")
    info = target_info(tmp_path / "kimi")
    assert info.architectures == ["KimiK25ForConditionalGeneration"]
    assert (info.model_type, info.num_layers, info.num_attention_heads) == ("deepseek_v3", 61, 64)
    assert (info.rope_theta, info.rms_norm_eps, info.max_position_embeddings) == (50000.0, 1e-5, 262144)
    assert (info.intermediate_size, info.num_key_value_heads, info.head_dim) == (18432, 64, 192)
    assert info.tie_word_embeddings is False and info.vocab_size == 40
    assert default_aux_layers(info.num_layers) == [2, 30, 58]
    assert default_aux_layers(30) == [2, 15, 27]
    fp = info.fingerprint
    assert fp == target_info(tmp_path / "kimi").fingerprint
    save_file({"language_model.lm_head.weight": torch.zeros(40, 8)},
              str(tmp_path / "kimi" / "model-00002-of-00002.safetensors"))
    assert target_info(tmp_path / "kimi").fingerprint != fp


@pytest.mark.slow
def test_smollm2_gguf_cached_and_faithful():
    from transformers import AutoModelForCausalLM

    d = resolve_target("gguf", "", "smollm2")
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    t = time.time()
    assert resolve_target("gguf", "", "smollm2") == d
    assert time.time() - t < 3 and (d / "model.safetensors").stat().st_mtime_ns == stamp   # no re-dequantize

    info = target_info(d)
    assert (info.model_type, info.num_layers, info.hidden_size, info.vocab_size) == ("llama", 30, 576, 49152)
    assert info.tie_word_embeddings and info.head_dim == 64 and info.rope_theta == 100000.0
    tok = load_tokenizer(d)
    # Recorded: transformers 5.19 reads eos=<|im_end|> (2), bos=<|im_start|> (1), pad=<|im_end|> (2).
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]

    saved = load_target_model(d, torch.float32, "cpu")
    gguf = targets.smollm2_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    assert saved.lm_head.weight.data_ptr() == saved.model.embed_tokens.weight.data_ptr()   # tied, as the GGUF
    ref_sd, saved_sd = ref.state_dict(), saved.state_dict()
    assert ref_sd.keys() == saved_sd.keys() and all(torch.equal(ref_sd[k], saved_sd[k]) for k in ref_sd)
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, ref(ids).logits)
    embed, lm_head = load_head(d)
    assert torch.equal(embed, ref.model.embed_tokens.weight) and lm_head is embed


def test_target_loads_whole_while_a_zero3_run_is_set_up():
    """accelerate registers a ZeRO-3 config with transformers before capture or online training
    loads the target; from_pretrained would then partition it (1-D placeholder weights, which broke
    in-process capture under dist=zero3 on a GPU). The target must load whole and equal to its file."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    arch, rc = _tiny("tiny_llama")
    d = resolve_target("random", "", "tiny_llama", arch, rc, seed=0)
    ds = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    try:
        model = load_target_model(d, torch.float32, "cpu")
        assert is_deepspeed_zero3_enabled()              # the training's own setting is left alone
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
    w = _weights(d)
    params = dict(model.named_parameters())
    assert params["model.embed_tokens.weight"].shape == w["model.embed_tokens.weight"].shape
    assert all(torch.equal(params[k], w[k]) for k in w if k in params)
    del ds


@pytest.mark.parametrize("prefix", ["model.", "language_model.model."])
def test_final_norm_is_read_under_each_checkpoint_naming(tmp_path, prefix):
    """The warm start's norm comes from the target's checkpoint (Llama naming, and Kimi-K2.5's
    language_model wrapper), and a checkpoint without one is an error that names the file."""
    from safetensors.torch import save_file
    from eagle3.targets import load_final_norm

    w = torch.rand(8) + 0.5
    save_file({f"{prefix}norm.weight": w, f"{prefix}embed_tokens.weight": torch.randn(4, 8)},
              str(tmp_path / "model.safetensors"))
    assert torch.equal(load_final_norm(tmp_path), w)
    save_file({"model.embed_tokens.weight": torch.randn(4, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=str(tmp_path)):
        load_final_norm(tmp_path)


def test_pick_device_and_model_dtype():
    assert targets.pick_device("cpu") == "cpu" and targets.pick_device("cuda:1") == "cuda:1"
    assert targets.pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert targets.model_dtype("cuda:0") == torch.bfloat16 and targets.model_dtype("cpu") == torch.float32
