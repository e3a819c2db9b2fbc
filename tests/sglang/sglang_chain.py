"""SGLang 0.5.23's own aux-id chain, shared by the server-args and loader tests (imports sglang lazily).

server args -> resolve_spec_aux_hidden_state_config -> configure_aux_hidden_state_capture ->
the target class's set_eagle3_layers_to_capture -> model.layers_to_capture.
"""
from types import SimpleNamespace


def capturing_model(cls, num_layers: int = 61):
    """An object carrying SGLang's own set_eagle3_layers_to_capture of `cls` and what it touches."""
    holder = type("Holder", (), {"set_eagle3_layers_to_capture": cls.set_eagle3_layers_to_capture})()
    holder.pp_group = SimpleNamespace(is_last_rank=True)
    holder.model = SimpleNamespace(layers_to_capture=[])
    holder.config = SimpleNamespace(num_hidden_layers=num_layers)
    return holder


def layers_sglang_captures(server_args, model_cls, spec_algorithm):
    """(resolved aux config, stand-in model) after SGLang configures aux capture for `server_args`."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture)
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config)
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context

    reset_context()
    try:
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
        cfg = resolve_spec_aux_hidden_state_config(
            server_args=server_args, model_config=ModelConfig.from_server_args(server_args),
            spec_algorithm=spec_algorithm, is_draft_worker=False)
        model = capturing_model(model_cls)
        configure_aux_hidden_state_capture(
            model=model, eagle_use_aux_hidden_state=cfg.eagle_use_aux_hidden_state,
            eagle_aux_hidden_state_layer_ids=cfg.eagle_aux_hidden_state_layer_ids,
            dflash_use_aux_hidden_state=cfg.dflash_use_aux_hidden_state,
            dflash_target_layer_ids=cfg.dflash_target_layer_ids, is_dspark=cfg.is_dspark)
    finally:
        reset_context()
    return cfg, model
