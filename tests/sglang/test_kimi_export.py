"""The Kimi recipe's RoPE settings reach SGLang 0.5.23: our export's config.json -> SGLang's own
draft ModelConfig (built the way its scheduler builds it, with the target's context length).

    .venv-sglang/bin/python -m pytest tests/sglang/test_kimi_export.py -q

A draft whose max_position_embeddings is below the target's context (262,144 for Kimi-K2.5) is
refused at start-up unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set: the recipe exports
262,144 so the server starts as configured.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.configs.model_config",
                    reason="SGLang is not installed; run with .venv-sglang/bin/python -m pytest tests/sglang")

import torch  # noqa: E402

from eagle3.export import export_drafter  # noqa: E402
from eagle3.model import Eagle3Drafter  # noqa: E402
from eagle3.shape import DrafterShape  # noqa: E402
from eagle3.serving import eval_server_cmd  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf" / "experiment" / "kimi_k25.yaml"


def _recipe_rope():
    import yaml
    d = yaml.safe_load(CONF.read_text())["drafter"]
    return float(d["rope_theta"]), int(d["max_position_embeddings"])


def _target(tmp_path: Path, context: int) -> Path:
    """A config-only DeepSeek-V3 target (MLA, 61 layers) with Kimi-K2.5's context length."""
    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 48,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 61, "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": 300,
        "max_position_embeddings": context, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}))
    return d


def _export(tmp_path: Path, rope_theta: float, max_positions: int) -> Path:
    s = DrafterShape(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                     vocab_size=300, draft_vocab_size=50, target_hidden_size=48, rope_theta=rope_theta,
                     max_position_embeddings=max_positions)
    d2t = torch.zeros(50, dtype=torch.long)
    t2d = torch.zeros(300, dtype=torch.bool)
    t2d[:50] = True
    return export_drafter(tmp_path / f"export_{max_positions}", Eagle3Drafter(s).exportable_state_dict(), s, d2t, t2d,
                          [3, 31, 59], ["DeepseekV3ForCausalLM"], engines=["sglang"])["sglang"]


def _draft_model_config(target: Path, draft: Path):
    """(target ModelConfig, draft ModelConfig) as SGLang builds them for `eval_server_cmd`."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(eval_server_cmd(str(target), str(draft), 1, 3, 1, 4, 30000,
                                             ["--device", "cpu", "--skip-tokenizer-init"])[3:])
    sa.resolve_once()
    reset_context()
    try:
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
        t = ModelConfig.from_server_args(sa)
        return t, ModelConfig.from_server_args(sa, model_path=str(draft), is_draft_model=True,
                                               context_length=t.context_len)
    finally:
        reset_context()


def test_recipe_rope_reaches_sglangs_draft_config(tmp_path):
    theta, positions = _recipe_rope()
    assert (theta, positions) == (1e6, 262144)
    draft = _export(tmp_path, theta, positions)
    cfg = json.loads((draft / "config.json").read_text())
    assert (cfg["rope_theta"], cfg["max_position_embeddings"]) == (theta, positions)
    target, d = _draft_model_config(_target(tmp_path, 262144), draft)
    assert target.context_len == 262144
    assert d.context_len == 262144 and d.hf_config.max_position_embeddings == positions
    # transformers 5 keeps rope_theta under rope_parameters, where SGLang's Llama layer reads it
    assert d.hf_config.rope_parameters["rope_theta"] == theta
    assert d.hf_config.rope_parameters.get("rope_type", "default") == "default"   # plain RoPE, as trained


def test_a_draft_shorter_than_the_target_context_is_refused(tmp_path, monkeypatch):
    for var in ("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "SGLANG_IS_IN_CI"):
        monkeypatch.delenv(var, raising=False)
    draft = _export(tmp_path, 1e6, 4096)
    with pytest.raises(ValueError, match="context_length"):
        _draft_model_config(_target(tmp_path, 262144), draft)


def test_the_eval_servers_kv_flags_resolve_in_sglang(tmp_path):
    """evaluate.py's memory flags for a Kimi-shaped target and our drafter parse and resolve through
    SGLang's own ServerArgs (the pool cap it later applies in kv_cache_configurator)."""
    from sglang.srt.server_args import prepare_server_args

    from eagle3.serving import eval_kv_args

    target = _target(tmp_path, 262144)
    draft = _export(tmp_path, 1e6, 262144)
    kimi = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    ours = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 64,
            "head_dim": 128, "hidden_size": 7168}
    flags = eval_kv_args(kimi, ours, 8)
    sa = prepare_server_args(eval_server_cmd(str(target), str(draft), 1, 3, 1, 4, 30000,
                                             [*flags, "--device", "cpu", "--skip-tokenizer-init"])[3:])
    sa.resolve_once()
    assert sa.max_total_tokens == 65536


_LOAD = """
import json, sys, types
from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.server_args import ServerArgs
ops = types.ModuleType("vllm._custom_ops")          # imported by the rotary module off CUDA, never called here
ops.rotary_embedding = lambda *args, **kwargs: None
sys.modules.setdefault("vllm", types.ModuleType("vllm"))._custom_ops = ops
sys.modules["vllm._custom_ops"] = ops
draft, port = sys.argv[1], sys.argv[2]
publish(ServerArgs(model_path=draft, tp_size=1, device="cpu"), role="scheduler", ranks=SpawnRanks(world_rank=0))
init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                             distributed_init_method=f"tcp://127.0.0.1:{port}")
initialize_model_parallel(backend="gloo")
from transformers import LlamaConfig
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
rope = LlamaForCausalLMEagle3(LlamaConfig(**json.load(open(draft + "/config.json")))).model.layers[0].self_attn.rotary_emb
print(json.dumps({"base": rope.base, "max_position_embeddings": rope.max_position_embeddings,
                  "cache_rows": rope.cos_sin_cache.shape[0]}))
"""


def test_sglangs_draft_layer_rotates_with_the_recipes_rope(tmp_path):
    """SGLang's own LlamaForCausalLMEagle3, built from our export, has the recipe's base and a
    rotary table over every served position. In a process of its own: SGLang's parallel state is
    process-wide and test_loader.py sets up its own."""
    import subprocess
    import sys

    from capture.sglang_server import free_port

    theta, positions = _recipe_rope()
    draft = _export(tmp_path, theta, positions)
    p = subprocess.run([sys.executable, "-c", _LOAD, str(draft), str(free_port())], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"base": theta, "max_position_embeddings": positions, "cache_rows": positions}
