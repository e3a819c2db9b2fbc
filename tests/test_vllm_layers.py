"""Our exported drafter, loaded and run by vLLM 0.32.0's own eagle3 LlamaModel (llama_eagle3.py) on CPU.

Its load_weights (midlayer. -> layers.0., q/k/v and gate/up stacked) reads the export's tensors
and every parameter but the shared embedding must come from them; its forward (every decoder
layer, the final norm and the hidden it hands the next draft step) must give our logits and that
hidden, two draft steps deep. Only the attention kernel is replaced, by plain causal attention
(vLLM's needs an attention backend and KV cache), and torch.compile is off. vLLM's layers j >= 1
pre-norm the residual stream with input_layernorm, SGLang's with hidden_norm
(tests/sglang/test_loader.py runs the same drafters through SGLang).
"""
from __future__ import annotations

import json
import socket
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm.model_executor.models.llama_eagle3", reason="vLLM is not installed")

from safetensors.torch import load_file  # noqa: E402

from eagle3.export import export_drafter  # noqa: E402
from eagle3.model import Eagle3Drafter  # noqa: E402
from eagle3.shape import DrafterShape  # noqa: E402

SHAPE = DrafterShape(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=300, draft_vocab_size=50, target_hidden_size=48, num_aux=3)


class CausalAttention(torch.nn.Module):
    """Stands in for vLLM's Attention: each row over itself and the rows before it, q [T, nh*d],
    k, v [T, nkv*d]."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, **unused):
        super().__init__()
        self.nh, self.nkv, self.d = num_heads, num_kv_heads, head_size

    def forward(self, q, k, v):
        T = q.shape[0]
        q, k, v = (x.view(T, n, self.d).transpose(0, 1) for x, n in ((q, self.nh), (k, self.nkv), (v, self.nkv)))
        rep = self.nh // self.nkv
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0),
                                             is_causal=True)
        return out.transpose(0, 1).reshape(T, self.nh * self.d)


@pytest.fixture(scope="module")
def vllm_world():
    """A gloo world of one and a current VllmConfig without torch.compile."""
    import vllm.model_executor.models.llama as llama
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config), pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama, "Attention", CausalAttention)
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        yield config
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def load_into_vllm(config, export_dir):
    """vLLM's eagle3 LlamaModel built from the export's config.json, its weights loaded by its own
    load_weights; every parameter first set to a value no exported tensor holds."""
    from transformers import LlamaConfig
    from vllm.model_executor.models.llama_eagle3 import LlamaModel

    hf = LlamaConfig(**json.loads((export_dir / "config.json").read_text()))
    # what Eagle3LlamaForCausalLM hands its LlamaModel: the draft's hf_config, the compute dtype
    config.__dict__["speculative_config"] = types.SimpleNamespace(
        draft_model_config=types.SimpleNamespace(hf_config=hf, quantization=None))
    config.__dict__["model_config"] = types.SimpleNamespace(dtype=torch.float32)
    try:
        model = LlamaModel(vllm_config=config, prefix="model", start_layer_id=30)
    finally:
        config.__dict__["speculative_config"] = config.__dict__["model_config"] = None
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(12345.0)
    tensors = load_file(str(export_dir / "model.safetensors"))
    # Eagle3LlamaForCausalLM.load_weights keeps lm_head and d2t for itself, drops t2d
    loaded = model.load_weights((k, v) for k, v in tensors.items() if k not in ("lm_head.weight", "d2t", "t2d"))
    for module in model.modules():                     # what vLLM's loader runs after loading
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return model, loaded, tensors


@pytest.mark.parametrize("norms", [{}, {"num_layers": 2}, {"num_layers": 3, "norm_output": True}])
def test_vllm_computes_our_drafter(vllm_world, tmp_path, norms):
    import dataclasses

    torch.manual_seed(0)
    shape = dataclasses.replace(SHAPE, **norms)
    d = Eagle3Drafter(shape)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.5 if p.ndim > 1 else 1)       # norms too: an un-loaded value would not pass as ours
    d2t = torch.randint(0, 200, (shape.draft_vocab_size,))
    t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
    t2d[d2t + torch.arange(shape.draft_vocab_size)] = True
    export_dir = export_drafter(tmp_path, d.exportable_state_dict(), shape, d2t, t2d, [2, 4, 5],
                                ["LlamaForCausalLM"], engines=["vllm"])["vllm"]
    model, loaded, tensors = load_into_vllm(vllm_world, export_dir)
    assert len(model.layers) == shape.num_layers
    params = dict(model.named_parameters())
    assert set(params) - loaded == {"embed_tokens.weight"}
    assert not any((p == 12345.0).any() for n, p in params.items() if n != "embed_tokens.weight")
    for j in range(1, shape.num_layers):              # vLLM's pre-norm of layer j is our one norm
        torch.testing.assert_close(params[f"layers.{j}.input_layernorm.weight"].data,
                                   tensors[f"layers.{j}.input_layernorm.weight"].float(), rtol=0, atol=0)

    ours = Eagle3Drafter(shape)                       # ours from the same (bf16) tensors
    ours.load_state_dict({**{k: v.float() for k, v in tensors.items() if k not in ("d2t", "t2d")},
                          "embed_tokens.weight": d.embed_tokens.weight})
    T = 7
    ids, positions = torch.randint(0, shape.vocab_size, (T,)), torch.arange(T)
    aux = torch.randn(T, shape.num_aux * shape.target_hidden_size)
    with torch.no_grad():
        model.embed_tokens.weight[:shape.vocab_size] = d.embed_tokens.weight
        lm_head = ours.lm_head.weight
        normed, hidden = model(ids, positions, model.fc(aux))        # fc: vLLM's combine_hidden_states
        normed2, _ = model(ids, positions + 1, hidden)                # a second draft step
        our_logits, our_hidden = ours(aux[None], ids[None])
        w = ours.weights()
        h_out, _, _ = ours.layer(ours.embed_qkv(ids[None], w), our_hidden, ours.rope_angles(positions[None] + 1), w)
        close = dict(rtol=1e-3, atol=1e-3)            # fp32, up to three layers' GEMM chains; relative to the largest
        for a, b in ((our_hidden[0], hidden), (our_logits[0], normed @ lm_head.T),
                     (ours.logits(h_out, w)[0], normed2 @ lm_head.T)):
            scale = b.abs().max()
            torch.testing.assert_close(a / scale, b / scale, **close)
