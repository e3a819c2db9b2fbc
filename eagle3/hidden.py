"""In-process hidden states: forward hooks on a transformers target give `aux` and `final`.

    aux, final = capture_hidden(model, input_ids, attention_mask, aux_layers)   # the tensors
    batch = capture_batch(model, input_ids, attention_mask, loss_mask, aux_layers, ids)  # online training

`aux` at layer i is the residual stream ENTERING decoder layer i (= output_hidden_states[i]), taken
by a forward pre-hook; `final` is the base model's last_hidden_state (after the final norm), so
target logits = final @ lm_head.weight.T. The base model runs without the LM head: no logits are
computed. capture/hf.py writes these into a feature dataset; eagle3/online.py trains on them as
they come.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
from torch import nn

from eagle3.batch import Batch


def decoder_parts(model: nn.Module) -> Tuple[nn.Module, nn.ModuleList]:
    """(base model, its decoder layer list) of a CausalLM, a base model, or a multimodal wrapper.

    Follows .model / .language_model / .text_model until a module with `layers` and `norm`:
    LlamaForCausalLM.model, DeepseekV3ForCausalLM.model, Kimi-K2.5's language_model.model.
    """
    m = model
    for _ in range(5):
        if isinstance(getattr(m, "layers", None), nn.ModuleList) and isinstance(getattr(m, "norm", None), nn.Module):
            return m, m.layers
        child = next((getattr(m, n) for n in ("model", "language_model", "text_model")
                      if isinstance(getattr(m, n, None), nn.Module)), None)
        if child is None:
            break
        m = child
    raise ValueError(f"{type(model).__name__}: no decoder (a module with .layers and .norm) found "
                     "under .model / .language_model / .text_model")


def capture_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   aux_layers: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """input_ids/attention_mask [B,T] (right padding) -> aux [B,T,k*H], final [B,T,H] in the model dtype.

    Positions past a row's length hold whatever the model computed for padding. No I/O, no
    gradients; hooks are removed even when the forward raises.
    """
    base, layers = decoder_parts(model)
    bad = [i for i in aux_layers if not 0 <= int(i) < len(layers)]
    if bad:
        raise ValueError(f"aux_layers {list(aux_layers)}: {bad} outside 0..{len(layers) - 1} "
                         f"(layer i = the residual stream entering decoder layer i)")
    seen: Dict[int, torch.Tensor] = {}

    def hook_for(i: int):
        def hook(module, args, kwargs):
            # A reference, not a copy: eager llama/deepseek layers never modify their input in
            # place (the tests compare against output_hidden_states to keep that true).
            seen[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [layers[i].register_forward_pre_hook(hook_for(i), with_kwargs=True)
               for i in sorted({int(i) for i in aux_layers})]
    try:
        with torch.no_grad():   # not inference_mode: online training feeds these into autograd
            out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    final = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    aux = torch.cat([seen[int(i)] for i in aux_layers], dim=-1)
    return aux, final


def capture_batch(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  loss_mask: torch.Tensor, aux_layers: Sequence[int], sample_ids: Sequence[str]) -> Batch:
    """Online training's batch: the same Batch a feature dataset gives, computed in-process.

    input_ids/attention_mask/loss_mask [B,T], right padding. Padded positions of aux/final are
    zeroed, as collate() pads them, so the two sources differ only by storage rounding.
    """
    aux, final = capture_hidden(model, input_ids, attention_mask, aux_layers)
    keep = attention_mask.bool()
    return Batch(input_ids.long(), loss_mask.float() * keep, keep, aux * keep[..., None],
                 final * keep[..., None], list(sample_ids))


def pad_right(seqs: Sequence[Sequence[int]], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> input_ids [B,T] int64 (0-padded), attention_mask [B,T] int64."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    att = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        att[b, :len(s)] = 1
    return ids.to(device), att.to(device)
