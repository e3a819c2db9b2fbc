"""Our plain, capture and evaluation command lines, parsed and resolved by SGLang 0.5.23's own ServerArgs.

    .venv-sglang/bin/python -m pytest tests/sglang/test_server_args.py -q

The aux-id chain is checked end to end against SGLang's code: our aux_layers -> capture_server_cmd's
--return-aux-hidden-state-layer-ids -> SGLang's resolution and capture config -> the model's
set_eagle3_layers_to_capture -> `layers_to_capture`, which must equal aux_layers (docs/design.md: the
project's index is SGLang's internal layers_to_capture meaning).
"""
from __future__ import annotations

import sys

import pytest

from sglang_chain import capturing_model, layers_sglang_captures

pytest.importorskip("sglang.srt.server_args",
                    reason="SGLang is not installed; run with .venv-sglang/bin/python -m pytest tests/sglang")

from sglang.srt.arg_groups.model_override_base import resolved_view  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from capture.sglang_server import capture_server_cmd  # noqa: E402
from eagle3.serving import eval_server_cmd, server_cmd  # noqa: E402


def resolve(cmd):
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    sa = prepare_server_args(cmd[3:])
    sa.resolve_once()
    return sa, resolved_view(sa)


def test_plain_cmd_resolves(tiny_llama_dir):
    cmd = server_cmd(str(tiny_llama_dir), 1, 31233, ["--device", "cpu", "--skip-tokenizer-init"])
    _, v = resolve(cmd)
    assert v.tp_size == 1 and v.port == 31233 and not v.trust_remote_code
    assert v.speculative_algorithm is None and not v.enable_return_aux_hidden_states
    sa = prepare_server_args(server_cmd("/models/Kimi-K2.5", 8, 30000, trust_remote_code=True)[3:])
    assert (sa.tp_size, sa.port, sa.trust_remote_code) == (8, 30000, True)


def test_capture_cmd_resolves_and_reaches_layers_to_capture(tiny_llama_dir):
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    aux_layers = [2, 4, 5]
    cmd = capture_server_cmd(str(tiny_llama_dir), 1, aux_layers, ["LlamaForCausalLM"], 31234,
                             ["--device", "cpu", "--skip-tokenizer-init"])
    sa, v = resolve(cmd)
    assert v.tp_size == 1 and v.port == 31234
    assert v.enable_return_aux_hidden_states and v.aux_hidden_state_capture == "eagle3"
    assert v.speculative_algorithm is None and v.speculative_draft_model_path is None  # no draft loads
    assert v.return_aux_hidden_state_layer_ids == [1, 3, 4]                           # Llama: i - 1
    assert v.disable_prefill_cuda_graph and v.disable_radix_cache and v.skip_server_warmup
    _, model = layers_sglang_captures(sa, LlamaForCausalLM, SpeculativeAlgorithm.NONE)
    assert model.capture_aux_hidden_states and model.model.layers_to_capture == aux_layers


def test_kimi_capture_cmd_tp8():
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

    cmd = capture_server_cmd("dummy", 8, [3, 31, 59], ["KimiK25ForConditionalGeneration"], 30000, ["--device", "cpu"],
                             trust_remote_code=True)
    _, v = resolve(cmd)   # "dummy" stops resolution after the capture handler: no checkpoint needed
    assert v.tp_size == 8 and v.trust_remote_code
    assert v.return_aux_hidden_state_layer_ids == [3, 31, 59]                         # DeepSeek: as given
    assert v.aux_hidden_state_capture == "eagle3" and v.speculative_algorithm is None
    # Kimi-K2.5 delegates to its DeepSeek-V3 language model, whose rule keeps ids whose first is not 1.
    lm = capturing_model(DeepseekV2ForCausalLM)
    kimi = type("K", (), {"set_eagle3_layers_to_capture": KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture})()
    kimi.language_model = lm
    kimi.set_eagle3_layers_to_capture(v.return_aux_hidden_state_layer_ids)
    assert lm.model.layers_to_capture == [3, 31, 59]


def test_capture_cmd_refuses_flags_that_break_capture():
    with pytest.raises(ValueError, match="two-batch"):
        capture_server_cmd("/m", 8, [3, 31, 59], ["KimiK25ForConditionalGeneration"], 30000, ["--enable-two-batch-overlap"])
    with pytest.raises(ValueError):
        capture_server_cmd("/m", 8, [1, 31, 59], ["KimiK25ForConditionalGeneration"], 30000, [])   # DeepSeek cannot express 1


def test_eval_cmd_resolves(tiny_llama_dir, tmp_path):
    import json

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": 1000, "draft_vocab_size": 100, "target_hidden_size": 64,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}))
    cmd = eval_server_cmd(str(tiny_llama_dir), str(draft), 1, 3, 1, 0, 31235,
                          ["--device", "cpu", "--skip-tokenizer-init"])
    _, v = resolve(cmd)
    assert v.speculative_algorithm == "EAGLE3" and v.speculative_draft_model_path == str(draft)
    assert (v.speculative_num_steps, v.speculative_eagle_topk, v.speculative_num_draft_tokens) == (3, 1, 4)
    assert v.tp_size == 1 and v.port == 31235


def test_eval_cmd_kimi_parses():
    cmd = eval_server_cmd("/models/Kimi-K2.5", "runs/kimi_k25/export/sglang", 8, 3, 1, 4, 30000, [],
                          trust_remote_code=True)
    sa = prepare_server_args(cmd[3:])   # parse only: the checkpoint is not here
    assert (sa.tp_size, sa.speculative_algorithm, sa.speculative_draft_model_path) == (
        8, "EAGLE3", "runs/kimi_k25/export/sglang")
    assert (sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens) == (3, 1, 4)
    assert sa.trust_remote_code
