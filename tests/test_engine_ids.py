"""Aux-layer ids per engine and target architecture (eagle3/engine_ids.py), and what exports write.

    .venv/bin/python -m pytest tests/test_engine_ids.py -q

The rules are read from SGLang 0.5.23's and vLLM 0.32's sources; tests/sglang/test_engine_rules.py
checks the SGLang table against SGLang's own set_eagle3_layers_to_capture for every architecture,
tests/sglang/test_loader.py the whole chain from an export to layers_to_capture.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from eagle3.config import DrafterConfig
from eagle3.engine_ids import capture_layer_ids, engine_aux_ids, known_architectures
from eagle3.evaluation import check_drafter_fits
from eagle3.export import load_export
from eagle3.export import write_export
from eagle3.model import Eagle3Drafter
from eagle3.shape import drafter_shape
from eagle3.targets import prepare_target
from eagle3.vocab import DraftVocab

ROOT = Path(__file__).resolve().parents[1]
LLAMA_RULE = ["LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM",
              "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
DEEPSEEK_RULE = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"]


def test_every_engine_knows_the_same_architectures():
    assert known_architectures("sglang") == known_architectures("vllm") == sorted(LLAMA_RULE + DEEPSEEK_RULE)


@pytest.mark.parametrize("arch", LLAMA_RULE)
def test_llama_rule(arch):
    assert engine_aux_ids([2, 15, 27], "sglang", [arch]) == [1, 14, 26]     # SGLang adds 1 to every id
    assert engine_aux_ids([2, 15, 27], "vllm", [arch]) == [2, 15, 27]
    assert engine_aux_ids([1, 2, 3], "sglang", arch) == [0, 1, 2]            # one name as a string
    assert capture_layer_ids([2, 15, 27], [arch]) == [1, 14, 26]


@pytest.mark.parametrize("arch", DEEPSEEK_RULE)
def test_deepseek_rule(arch):
    assert engine_aux_ids([3, 31, 59], "sglang", [arch]) == [3, 31, 59]     # first id not 1: as given
    assert engine_aux_ids([3, 31, 59], "vllm", [arch]) == [3, 31, 59]
    assert capture_layer_ids([3, 31, 59], [arch]) == [3, 31, 59]
    assert engine_aux_ids([1, 31, 59], "vllm", [arch]) == [1, 31, 59]
    with pytest.raises(ValueError, match="first aux layer of 1 cannot be expressed"):
        engine_aux_ids([1, 31, 59], "sglang", [arch])   # SGLang would add 1 to every id


@pytest.mark.parametrize("archs", [["GPT2LMHeadModel"], ["llama"], ["deepseek_v3"], [],
                                   ["LlamaForCausalLM", "GPT2LMHeadModel"]])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_unknown_architecture_is_refused_listing_the_known(archs, engine):
    with pytest.raises(ValueError) as e:
        engine_aux_ids([2, 3, 4], engine, archs)
    msg = str(e.value)
    assert all(a in msg for a in LLAMA_RULE + DEEPSEEK_RULE) and "eagle3/engine_ids.py" in msg
    assert ("names no `architectures`" in msg) if not archs else (repr(archs[-1]) in msg)


def test_architectures_with_different_rules_are_refused():
    with pytest.raises(ValueError, match="different aux-id rules"):
        engine_aux_ids([2, 3, 4], "sglang", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
    assert engine_aux_ids([2, 3, 4], "sglang", ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"]) == [2, 3, 4]


def test_versions_and_engines_are_checked():
    with pytest.raises(ValueError, match="verified for sglang 0.5.23"):
        engine_aux_ids([2, 3, 4], "sglang", ["LlamaForCausalLM"], engine_version="0.5.99")
    assert engine_aux_ids([2, 3, 4], "vllm", ["LlamaForCausalLM"], engine_version="0.32.0") == [2, 3, 4]
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        engine_aux_ids([2, 3, 4], "tgi", ["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="layer 0"):
        engine_aux_ids([0, 3, 4], "vllm", ["LlamaForCausalLM"])


@pytest.mark.parametrize("name,architectures,sglang_ids", [
    ("tiny_llama", ["LlamaForCausalLM"], [1, 2, 3]),
    ("tiny_deepseek", ["DeepseekV3ForCausalLM"], [2, 3, 4]),
])
def test_tiny_targets_export_their_engines_ids(tmp_path, name, architectures, sglang_ids):
    """The tests' tiny targets, set up as train.py does, exported through the training run's own
    export (write_export): config.json's `architectures` picks each engine's ids."""
    t = OmegaConf.load(ROOT / "conf" / "target" / f"{name}.yaml")
    target = prepare_target(t.source, "", t.name, t.arch, OmegaConf.to_container(t.random_config), 0, [2, 3, 4])
    assert target.info.architectures == architectures
    shape = drafter_shape(target.info, DrafterConfig(), num_aux=3, draft_vocab_size=50)
    d2t = torch.zeros(50, dtype=torch.long)
    t2d = torch.zeros(target.info.vocab_size, dtype=torch.bool)
    t2d[:50] = True
    torch.manual_seed(0)
    state = {"drafter." + k: v for k, v in Eagle3Drafter(shape).state_dict().items()}
    written = write_export(tmp_path, state, shape, DraftVocab(d2t, t2d), target)
    for engine, want in (("sglang", sglang_ids), ("vllm", [2, 3, 4])):
        tensors, cfg = load_export(written[engine])
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == want
        assert cfg["eagle3"]["target_architectures"] == architectures and cfg["eagle3"]["aux_layers"] == [2, 3, 4]
        assert check_drafter_fits(cfg, target.info, tensors, engine=engine) == [2, 3, 4]


def test_check_drafter_fits_refuses_a_target_of_unknown_architecture(tmp_path):
    t = OmegaConf.load(ROOT / "conf" / "target" / "tiny_llama.yaml")
    target = prepare_target(t.source, "", t.name, t.arch, OmegaConf.to_container(t.random_config), 0, [2, 3, 4])
    shape = drafter_shape(target.info, DrafterConfig(), num_aux=3, draft_vocab_size=50)
    t2d = torch.zeros(target.info.vocab_size, dtype=torch.bool)
    t2d[:50] = True
    state = {"drafter." + k: v for k, v in Eagle3Drafter(shape).state_dict().items()}
    _, cfg = load_export(write_export(tmp_path, state, shape, DraftVocab(torch.zeros(50, dtype=torch.long), t2d),
                                      target)["vllm"])
    target.info.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="not checked for architecture"):
        check_drafter_fits(cfg, target.info, engine="vllm")
