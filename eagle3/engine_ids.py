"""Aux layer ids as each serving engine wants them in the drafter's config.json.

This project's `aux_layers: [i, j, k]` always means the residual stream *entering* decoder layer i
(= transformers' `output_hidden_states[i]`). Engines read
`eagle_config.eagle_aux_hidden_state_layer_ids` with their own offsets, per target model class, and
a wrong one crashes nothing: it silently ruins acceptance. This is the one place that knows the
offsets. It keys on the target's config.json `architectures` (the name each engine resolves to a
model class) and refuses one it was not checked for: a guess would be a silent wrong shift.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

# SGLang 0.5.23, set_eagle3_layers_to_capture of the class each architecture resolves to:
# "plus_one" adds 1 to every id (models/llama.py; qwen2.py and qwen3.py have the same rule);
# "deepseek" adds 1 only when the first id is 1 (models/deepseek_v2.py). Each captures the state
# entering layer layers_to_capture[n], this project's meaning.
_SGLANG_RULES: Dict[str, str] = {
    "LlamaForCausalLM": "plus_one",
    "MistralForCausalLM": "plus_one",                 # mistral.py: a LlamaForCausalLM subclass
    "Phi3ForCausalLM": "plus_one",                    # llama.py subclasses
    "InternLM3ForCausalLM": "plus_one",
    "Qwen2ForCausalLM": "plus_one",
    "Qwen3ForCausalLM": "plus_one",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",              # a DeepseekV2ForCausalLM subclass
    "KimiK25ForConditionalGeneration": "deepseek",    # delegates to its DeepseekV3ForCausalLM
}
# vLLM 0.32: each of these classes (Kimi-K2.5 through its DeepseekV2ForCausalLM language model)
# records `hidden_states + residual` entering layer id: ids as given.
_VLLM_RULES: Dict[str, str] = {arch: "as_given" for arch in _SGLANG_RULES}
_RULES = {"sglang": _SGLANG_RULES, "vllm": _VLLM_RULES}
_VERSIONS = {"sglang": ("0.5.23",), "vllm": ("0.32.0",)}


def known_architectures(engine: str) -> List[str]:
    return sorted(_rules(engine))


def engine_aux_ids(aux_layers: Sequence[int], engine: str, architectures: Sequence[str] | str,
                   engine_version: str | None = None) -> List[int]:
    """Map aux_layers (entering-layer meaning) to the ids `engine` expects in config.json.

    architectures: the target's config.json `architectures` (eagle3.targets.TargetInfo), or one
    name. Every name must be known for `engine` and share one rule; anything else is refused.
    SGLang 0.5.23: the Llama rule adds 1 to every id, so write i-1; the DeepSeek rule (DeepSeek-V2/V3,
    Kimi-K2.5) adds 1 only when the first id is 1, so write i as given, and a first aux layer of 1
    cannot be expressed. vLLM 0.32: ids as given.
    """
    ids = [int(i) for i in aux_layers]
    if any(i < 1 for i in ids):
        raise ValueError(f"aux_layers {ids}: layer 0 is the embedding output; engines cannot capture it")
    rules = _rules(engine)
    _check_version(engine, engine_version)
    rule = _rule(rules, engine, [architectures] if isinstance(architectures, str) else list(architectures))
    if rule == "as_given":
        return ids
    if rule == "plus_one":
        return [i - 1 for i in ids]
    if ids[0] == 1:
        raise ValueError(
            f"aux_layers {ids}: SGLang 0.5.23 adds 1 to DeepSeek-family ids only when the first "
            "id is 1, so a first aux layer of 1 cannot be expressed; choose a first layer >= 2")
    return ids


def capture_layer_ids(aux_layers: Sequence[int], architectures: Sequence[str] | str) -> List[int]:
    """The ids to pass as SGLang's --return-aux-hidden-state-layer-ids for a capture server.

    SGLang applies the same set_eagle3_layers_to_capture rule to these as to a draft config.
    """
    return engine_aux_ids(aux_layers, "sglang", architectures)


def _rules(engine: str) -> Dict[str, str]:
    if engine not in _RULES:
        raise ValueError(f"unknown engine {engine!r}: expected 'sglang' or 'vllm'")
    return _RULES[engine]


def _rule(rules: Dict[str, str], engine: str, architectures: List[str]) -> str:
    known = ", ".join(sorted(rules))
    unknown = [a for a in architectures if a not in rules]
    if not architectures or unknown:
        what = (f"architecture(s) {unknown}" if architectures
                else "a target whose config.json names no `architectures`")
        raise ValueError(
            f"{engine}: aux-layer ids were not checked for {what}. Known: {known}. Read the engine's "
            "set_eagle3_layers_to_capture (SGLang) or aux-state capture (vLLM) for that model class "
            "and add it to eagle3/engine_ids.py")
    found = {rules[a] for a in architectures}
    if len(found) > 1:
        raise ValueError(f"{engine}: architectures {architectures} follow different aux-id rules {sorted(found)}")
    return found.pop()


def _check_version(engine: str, version: str | None) -> None:
    known = _VERSIONS[engine]
    if version is not None and version not in known:
        raise ValueError(
            f"{engine} {version}: aux-id offsets were verified for {engine} {', '.join(known)} only; "
            "read that version's set_eagle3_layers_to_capture and add it to eagle3/engine_ids.py")


def check_aux_layers(aux_layers: Sequence[int], num_layers: int) -> List[int]:
    """aux_layers must name distinct decoder layers in increasing order, each with an input to capture
    (1 <= i < num_layers): layer 0's input is the embedding, which no engine captures."""
    ids = [int(i) for i in aux_layers]
    if not ids or ids != sorted(set(ids)) or ids[0] < 1 or ids[-1] >= num_layers:
        raise ValueError(f"aux_layers {ids}: need distinct increasing ids in [1, {num_layers - 1}] for a "
                         f"{num_layers}-layer target (set aux_layers=[...] explicitly for small targets)")
    return ids
