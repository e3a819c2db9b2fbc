"""Aux layer ids as each serving engine wants them in the drafter's config.json.

This project's `aux_layers: [i, j, k]` always means the residual stream *entering* decoder layer i
(= transformers' `output_hidden_states[i]`). Engines read
`eagle_config.eagle_aux_hidden_state_layer_ids` with their own offsets, and a wrong one crashes
nothing: it silently ruins acceptance. This is the one place that knows the offsets.
"""
from __future__ import annotations

from typing import List, Sequence

# Target architectures SGLang handles with the DeepSeek rule (models/deepseek_v2.py, which
# Kimi-K2.5's text backbone uses).
_DEEPSEEK_FAMILY = {"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "kimi_vl"}
_SGLANG_VERSIONS = ("0.5.23",)
_VLLM_VERSIONS = ("0.32.0",)


def engine_aux_ids(aux_layers: Sequence[int], engine: str, target_arch: str,
                   engine_version: str | None = None) -> List[int]:
    """Map aux_layers (entering-layer meaning) to the ids `engine` expects in config.json.

    SGLang 0.5.23: Llama-family targets add 1 to every id (models/llama.py,
    set_eagle3_layers_to_capture), so write i-1; DeepSeek-V2/V3 targets add 1 only when the first
    id is 1 and use the ids as given otherwise, so write i as given, and a first aux layer of 1
    cannot be expressed. vLLM 0.32: records layer idx's output under idx+1, i.e. ids as given.
    """
    ids = [int(i) for i in aux_layers]
    if any(i < 1 for i in ids):
        raise ValueError(f"aux_layers {ids}: layer 0 is the embedding output; engines cannot capture it")
    arch = target_arch.lower()
    if engine == "vllm":
        _check_version("vllm", engine_version, _VLLM_VERSIONS)
        return ids
    if engine == "sglang":
        _check_version("sglang", engine_version, _SGLANG_VERSIONS)
        if arch in _DEEPSEEK_FAMILY:
            if ids[0] == 1:
                raise ValueError(
                    f"aux_layers {ids}: SGLang 0.5.23 adds 1 to DeepSeek-family ids only when the first "
                    "id is 1, so a first aux layer of 1 cannot be expressed; choose a first layer >= 2")
            return ids
        return [i - 1 for i in ids]
    raise ValueError(f"unknown engine {engine!r}: expected 'sglang' or 'vllm'")


def capture_layer_ids(aux_layers: Sequence[int], target_arch: str) -> List[int]:
    """The ids to pass as SGLang's --return-aux-hidden-state-layer-ids for a capture server.

    SGLang applies the same set_eagle3_layers_to_capture rule to these as to a draft config.
    """
    return engine_aux_ids(aux_layers, "sglang", target_arch)


def _check_version(engine: str, version: str | None, known: tuple) -> None:
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
