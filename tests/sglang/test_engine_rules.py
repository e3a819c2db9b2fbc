"""eagle3/engine_ids.py's SGLang table against SGLang 0.5.23's own code, one architecture at a time.

    .venv-sglang/bin/python -m pytest tests/sglang/test_engine_rules.py -q

For every architecture the table knows: the class SGLang registers under that name (its module's
EntryClass), given our capture ids, must set `layers_to_capture` to aux_layers, the state entering
those layers (docs/design.md, "Aux layer index").
"""
from __future__ import annotations

import importlib

import pytest

from sglang_chain import capturing_model

pytest.importorskip("sglang.srt.models.llama",
                    reason="SGLang is not installed; run with .venv-sglang/bin/python -m pytest tests/sglang")

from eagle3.engine_ids import capture_layer_ids, known_architectures  # noqa: E402

MODULE = {   # architecture -> sglang.srt.models module that registers it
    "LlamaForCausalLM": "llama", "Phi3ForCausalLM": "llama", "InternLM3ForCausalLM": "llama",
    "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v2",
    "KimiK25ForConditionalGeneration": "kimi_k25",
}


def test_every_known_architecture_is_checked_here():
    assert sorted(MODULE) == known_architectures("sglang")


@pytest.mark.parametrize("aux_layers", [[2, 15, 27], [3, 31, 59], [2, 3, 4]])
@pytest.mark.parametrize("arch", sorted(MODULE))
def test_capture_ids_reach_layers_to_capture(arch, aux_layers):
    mod = importlib.import_module(f"sglang.srt.models.{MODULE[arch]}")
    entries = mod.EntryClass if isinstance(mod.EntryClass, list) else [mod.EntryClass]
    cls = next(c for c in entries if c.__name__ == arch)   # what SGLang resolves the name to
    model = capturing_model(cls)
    inner = model
    if arch == "KimiK25ForConditionalGeneration":   # delegates to its DeepSeek-V3 language model
        from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
        model.language_model = inner = capturing_model(DeepseekV3ForCausalLM)
    model.set_eagle3_layers_to_capture(capture_layer_ids(aux_layers, [arch]))
    assert inner.model.layers_to_capture == aux_layers
