"""Tests that need SGLang 0.5.23's modules. Run them in their own environment:

    .venv-sglang/bin/python -m pytest tests/sglang -q

From an environment without SGLang (the main .venv) every module that needs it skips with a
reason (each starts with `pytest.importorskip`); test_server_launch.py needs no SGLang and runs
anywhere. Nothing here imports sglang at collection time.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
SKIP_REASON = ("SGLang is not installed in this environment; run these with "
               ".venv-sglang/bin/python -m pytest tests/sglang")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.sglang)


@pytest.fixture
def tiny_llama_dir(tmp_path):
    """A config-only Llama target (8 layers, hidden 64): enough for ServerArgs resolution."""
    import json

    d = tmp_path / "tiny_llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 8, "vocab_size": 1000, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}))
    return d
