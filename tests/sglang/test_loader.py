"""Our exported drafter, loaded by SGLang 0.5.23's own LlamaForCausalLMEagle3 on CPU.

    .venv-sglang/bin/python -m pytest tests/sglang/test_loader.py -q

Independent truth: the tensors of the Eagle3Drafter we exported (eagle3.export.export_drafter).
SGLang's load_weights silently skips names it does not know, so every SGLang parameter is
compared with ours after loading: none may be left at its initial value. q/k/v and gate/up are
stacked in SGLang (qkv_proj, gate_up_proj): compared slice by slice. Vocab-parallel tables are
padded to a multiple of 64 rows: the first rows are compared.

Also the config-id chain on the draft side: our export's eagle_config ids -> SGLang's spec
aux-hidden-state resolution -> the target's set_eagle3_layers_to_capture -> layers_to_capture,
which must equal our aux_layers (Llama: written i-1; DeepSeek/Kimi: as given).

EAGLE-3.1's norms (fc_norm, norm_output) are also run through SGLang's own LlamaModel.forward: its
fc_norm chunks, fc, layer, final norm and the choice of the hidden it hands the next draft step,
with only the attention kernel (RadixAttention, which needs an attention backend and KV pools)
replaced by plain causal attention. The logits and that hidden must equal ours, two draft steps
deep; with the flags off in ours they must not, so the comparison sees the norms.
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("sglang.srt.models.llama_eagle3",
                    reason="SGLang is not installed; run with .venv-sglang/bin/python -m pytest tests/sglang")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from capture.sglang_server import free_port  # noqa: E402
from eagle3.serving import eval_server_cmd  # noqa: E402
from eagle3.export import export_drafter  # noqa: E402
from eagle3.model import Eagle3Drafter  # noqa: E402
from eagle3.shape import DrafterShape  # noqa: E402
from sglang_chain import layers_sglang_captures  # noqa: E402

SHAPE = DrafterShape(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=300, draft_vocab_size=50, target_hidden_size=48, num_aux=3)


@pytest.fixture(scope="module")
def sglang_world(tmp_path_factory):
    """A gloo world of one with SGLang's runtime context published for a CPU server."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    # Its rotary embedding imports vllm._custom_ops off CUDA; the loader never calls it.
    if "vllm._custom_ops" not in sys.modules:
        ops = types.ModuleType("vllm._custom_ops")

        def rotary_embedding(*args, **kwargs):
            raise RuntimeError("stand-in vllm._custom_ops: not for computing")
        ops.rotary_embedding = rotary_embedding
        vllm = sys.modules.setdefault("vllm", types.ModuleType("vllm"))
        vllm._custom_ops = ops
        sys.modules["vllm._custom_ops"] = ops
    d = tmp_path_factory.mktemp("cfg")
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                               "hidden_size": 64, "num_attention_heads": 4,
                                               "num_hidden_layers": 2, "vocab_size": 300}))
    reset_context()
    publish(ServerArgs(model_path=str(d), tp_size=1, device="cpu"), role="scheduler",
            ranks=SpawnRanks(world_rank=0))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    initialize_model_parallel(backend="gloo")
    yield
    # SGLang's destroy_model_parallel imports its HTTP launcher (uvicorn, not installed here): end
    # the gloo group itself; SGLang's group handles stay set for the rest of this process.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    reset_context()


ARCHITECTURES = {"llama": ["LlamaForCausalLM"], "deepseek_v3": ["DeepseekV3ForCausalLM"]}   # config.json's


def export(tmp_path: Path, aux_layers, target_arch: str, seed: int = 0, **norms) -> Path:
    import dataclasses
    torch.manual_seed(seed)
    shape = dataclasses.replace(SHAPE, **norms)
    model = Eagle3Drafter(shape)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()                      # norms too: an un-loaded ones() would not pass as ours
    d2t = torch.randint(0, 200, (SHAPE.draft_vocab_size,))
    t2d = torch.zeros(SHAPE.vocab_size, dtype=torch.bool)
    t2d[d2t + torch.arange(SHAPE.draft_vocab_size)] = True
    return export_drafter(tmp_path / "export", model.exportable_state_dict(), shape, d2t, t2d, aux_layers,
                          ARCHITECTURES[target_arch], engines=["sglang"])["sglang"]


def load_into_sglang(export_dir: Path):
    from transformers import LlamaConfig
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    cfg = LlamaConfig(**json.loads((export_dir / "config.json").read_text()))
    model = LlamaForCausalLMEagle3(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(12345.0)                 # a value no exported tensor holds
    model.load_weights(load_file(str(export_dir / "model.safetensors")).items())
    return model


def expected_parameters(ours, s: DrafterShape):
    """SGLang parameter name -> (our tensor, the slice of SGLang's parameter it must fill)."""
    q, kv, inter = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim, s.intermediate_size
    L = "model.layers.0."
    fc_norm = {f"model.fc_norm.{i}.weight": [(ours[f"fc_norm.{i}.weight"], slice(None))]
               for i in range(s.num_aux) if s.fc_norm}
    return {**fc_norm,
        "model.fc.weight": [(ours["fc.weight"], slice(None))],
        L + "self_attn.qkv_proj.weight": [(ours["midlayer.self_attn.q_proj.weight"], slice(0, q)),
                                          (ours["midlayer.self_attn.k_proj.weight"], slice(q, q + kv)),
                                          (ours["midlayer.self_attn.v_proj.weight"], slice(q + kv, q + 2 * kv))],
        L + "self_attn.o_proj.weight": [(ours["midlayer.self_attn.o_proj.weight"], slice(None))],
        L + "mlp.gate_up_proj.weight": [(ours["midlayer.mlp.gate_proj.weight"], slice(0, inter)),
                                        (ours["midlayer.mlp.up_proj.weight"], slice(inter, 2 * inter))],
        L + "mlp.down_proj.weight": [(ours["midlayer.mlp.down_proj.weight"], slice(None))],
        L + "input_layernorm.weight": [(ours["midlayer.input_layernorm.weight"], slice(None))],
        L + "post_attention_layernorm.weight": [(ours["midlayer.post_attention_layernorm.weight"], slice(None))],
        L + "hidden_norm.weight": [(ours["midlayer.hidden_norm.weight"], slice(None))],
        "model.norm.weight": [(ours["norm.weight"], slice(None))],
        "lm_head.weight": [(ours["lm_head.weight"], slice(0, s.draft_vocab_size))],
        **{k: v for j in range(1, s.num_layers) for k, v in upper_layer_parameters(ours, s, j).items()},
    }


def upper_layer_parameters(ours, s: DrafterShape, j: int):
    """expected_parameters of a layer j >= 1 (q/k/v over [H] inputs). SGLang pre-norms it with
    hidden_norm and builds an input_layernorm it never reads: both must be our one pre-norm."""
    q, kv, inter = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim, s.intermediate_size
    L, o = f"model.layers.{j}.", f"layers.{j}."
    assert torch.equal(ours[o + "hidden_norm.weight"], ours[o + "input_layernorm.weight"])
    return {
        L + "self_attn.qkv_proj.weight": [(ours[o + "self_attn.q_proj.weight"], slice(0, q)),
                                          (ours[o + "self_attn.k_proj.weight"], slice(q, q + kv)),
                                          (ours[o + "self_attn.v_proj.weight"], slice(q + kv, q + 2 * kv))],
        L + "self_attn.o_proj.weight": [(ours[o + "self_attn.o_proj.weight"], slice(None))],
        L + "mlp.gate_up_proj.weight": [(ours[o + "mlp.gate_proj.weight"], slice(0, inter)),
                                        (ours[o + "mlp.up_proj.weight"], slice(inter, 2 * inter))],
        L + "mlp.down_proj.weight": [(ours[o + "mlp.down_proj.weight"], slice(None))],
        L + "input_layernorm.weight": [(ours[o + "input_layernorm.weight"], slice(None))],
        L + "post_attention_layernorm.weight": [(ours[o + "post_attention_layernorm.weight"], slice(None))],
        L + "hidden_norm.weight": [(ours[o + "hidden_norm.weight"], slice(None))],
    }


@pytest.mark.parametrize("target_arch,aux_layers,config_ids,norms", [
    ("llama", [2, 4, 5], [1, 3, 4], {}),               # SGLang's Llama rule adds 1: written i-1
    ("deepseek_v3", [3, 31, 59], [3, 31, 59], {}),     # DeepSeek/Kimi rule: as given
    ("llama", [2, 4, 5], [1, 3, 4], {"fc_norm": True, "norm_output": True}),
    ("llama", [2, 4, 5], [1, 3, 4], {"num_layers": 3}),
    ("llama", [2, 4, 5], [1, 3, 4], {"fc_norm": True, "norm_output": True, "num_layers": 2}),   # smollm2_scale's
])
def test_every_parameter_is_ours(sglang_world, tmp_path, target_arch, aux_layers, config_ids, norms):
    export_dir = export(tmp_path, aux_layers, target_arch, **norms)
    cfg = json.loads((export_dir / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == config_ids
    assert_every_parameter_is_ours(load_into_sglang(export_dir), load_file(str(export_dir / "model.safetensors")),
                                   DrafterShape.from_hf_config(cfg))


def assert_every_parameter_is_ours(model, ours, shape: DrafterShape):
    params = dict(model.named_parameters())
    want = expected_parameters(ours, shape)
    # The shared embedding is the target's (not exported); every other parameter must be covered.
    assert set(params) - set(want) == {"model.embed_tokens.weight"}
    for name, parts in want.items():
        p = params[name].detach()
        covered = torch.zeros(p.shape[0], dtype=torch.bool)
        for tensor, rows in parts:
            torch.testing.assert_close(p[rows].to(tensor.dtype), tensor, rtol=0, atol=0, msg=name)
            covered[rows] = True
        pad = p[~covered]                     # vocab padding rows only (lm_head 50 -> 64)
        assert name == "lm_head.weight" or pad.numel() == 0, name
        assert not (p[covered] == 12345.0).any(), f"{name}: left at its initial value"
    assert torch.equal(model.hot_token_id, ours["d2t"] + torch.arange(shape.draft_vocab_size))


class CausalAttention(torch.nn.Module):
    """Stands in for RadixAttention (which reads an attention backend and KV pools): softmax
    attention of each row over itself and the rows before it, q [T, nh*d], k, v [T, nkv*d]."""

    def __init__(self, nh: int, nkv: int, d: int):
        super().__init__()
        self.nh, self.nkv, self.d = nh, nkv, d

    def forward(self, q, k, v, forward_batch, **unused):
        T = q.shape[0]
        q, k, v = (x.view(T, n, self.d).transpose(0, 1) for x, n in ((q, self.nh), (k, self.nkv), (v, self.nkv)))
        rep = self.nh // self.nkv
        out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0),
                                                               v.repeat_interleave(rep, 0), is_causal=True)
        return out.transpose(0, 1).reshape(T, self.nh * self.d)


def sglang_draft_step(model, ids, positions, hidden):
    """SGLang's LlamaModel.forward over one sequence's rows (an extend batch): hidden [T, k*Ht]
    (target aux states, through fc) or [T, H] (a previous step's hidden). Returns (logits [T, Vd],
    the hidden SGLang hands the next draft step)."""
    from types import SimpleNamespace

    batch = SimpleNamespace(mm_input_embeds=None, spec_info=SimpleNamespace(hidden_states=hidden),
                            forward_mode=SimpleNamespace(is_extend=lambda: True),
                            contains_mm_inputs=lambda: False)
    to_logits, (aux,) = model.model(ids, positions, batch)
    return to_logits @ model.lm_head.weight[:SHAPE.draft_vocab_size].T, aux


@pytest.mark.parametrize("norms", [{"fc_norm": True}, {"norm_output": True}, {"fc_norm": True, "norm_output": True},
                                   {"num_layers": 2}, {"num_layers": 2, "norm_output": True}])
def test_sglang_computes_our_drafter_with_the_eagle31_norms(sglang_world, tmp_path, norms):
    """Also with num_layers > 1: SGLang's layers j >= 1 read the residual stream through
    hidden_norm, ours through input_layernorm; the export's one value under both names makes them
    the same network."""
    import dataclasses

    export_dir = export(tmp_path, [2, 4, 5], "llama", **norms)
    tensors = load_file(str(export_dir / "model.safetensors"))
    shape = DrafterShape.from_hf_config(json.loads((export_dir / "config.json").read_text()))
    assert (shape.fc_norm, shape.norm_output) == (norms.get("fc_norm", False), norms.get("norm_output", False))
    assert shape.num_layers == norms.get("num_layers", 1)
    model = load_into_sglang(export_dir)
    assert len(model.model.layers) == shape.num_layers
    torch.manual_seed(1)
    embed = torch.randn(SHAPE.vocab_size, SHAPE.hidden_size)
    for layer in model.model.layers:
        layer = layer.self_attn
        layer.attn = CausalAttention(SHAPE.num_attention_heads, SHAPE.num_key_value_heads, SHAPE.head_dim)
        layer.rotary_emb.forward = layer.rotary_emb.forward_native  # its CPU path calls a kernel library
    with torch.no_grad():
        model.model.embed_tokens.weight[:SHAPE.vocab_size] = embed

    def ours(s):
        d = Eagle3Drafter(s)
        weights = {k: v.float() for k, v in tensors.items() if k not in ("d2t", "t2d")}
        d.load_state_dict({**weights, "embed_tokens.weight": embed})
        return d

    T = 7
    ids, positions = torch.randint(0, SHAPE.vocab_size, (T,)), torch.arange(T)
    aux = 3 * torch.randn(T, SHAPE.num_aux * SHAPE.target_hidden_size)
    with torch.no_grad():
        logits, hidden = sglang_draft_step(model, ids, positions, aux)
        logits2, _ = sglang_draft_step(model, ids, positions + 1, hidden)     # a second draft step
        d = ours(shape)
        our_logits, our_hidden = d(aux[None], ids[None])
        w = d.weights()
        h_out, _, _ = d.layer(d.embed_qkv(ids[None], w), our_hidden, d.rope_angles(positions[None] + 1), w)
        close = dict(rtol=2e-3, atol=2e-3)          # fp32, two GEMM chains of unit-variance weights
        torch.testing.assert_close(our_logits[0], logits, **close)
        torch.testing.assert_close(our_hidden[0], hidden, **close)
        torch.testing.assert_close(d.logits(h_out, w)[0], logits2, **close)
        # the same weights without the flag: SGLang's numbers must tell them apart
        for flag in set(norms) - {"num_layers"}:
            other = Eagle3Drafter(dataclasses.replace(shape, **{flag: False}))
            sd = d.state_dict()
            other.load_state_dict({k: v for k, v in sd.items() if not k.startswith("fc_norm.")}
                                  if flag == "fc_norm" else sd)
            without_logits, without_hidden = other(aux[None], ids[None])
            assert not torch.allclose(without_hidden[0], hidden, **close), flag


def test_tiny_deepseek_pipeline_export_loads_into_sglang(sglang_world, tmp_path):
    """The Kimi code path end to end: a random tiny DeepseekV3 (MLA + MoE) target captured in-process,
    a drafter trained on it by train.py (project environment), its export/sglang loaded by SGLang's own
    LlamaForCausalLMEagle3, with the DeepSeek layer-id rule (ids as given)."""
    import os
    import subprocess
    main_python = ROOT / ".venv" / "bin" / "python"
    assert main_python.exists(), f"{main_python} missing: run scripts/setup.sh"
    p = subprocess.run([str(main_python), "train.py", "+experiment=tiny_deepseek", f"run_dir={tmp_path}/run",
                        f"data.features_dir={tmp_path}/features", "train.steps=3"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    export_dir = tmp_path / "run" / "export" / "sglang"
    cfg = json.loads((export_dir / "config.json").read_text())
    assert cfg["eagle3"]["target_architectures"] == ["DeepseekV3ForCausalLM"] and cfg["eagle3"]["aux_layers"] == [2, 3, 4]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert_every_parameter_is_ours(load_into_sglang(export_dir), load_file(str(export_dir / "model.safetensors")),
                                   DrafterShape.from_hf_config(cfg))


def _target_dir(tmp_path: Path, arch: str) -> Path:
    d = tmp_path / f"target_{arch}"
    d.mkdir()
    if arch == "llama":
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 48,
               "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 8, "vocab_size": 300, "max_position_embeddings": 2048,
               "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
    else:
        cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 48,
               "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
               "num_key_value_heads": 4, "num_hidden_layers": 61, "first_k_dense_replace": 1,
               "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
               "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
               "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": 300,
               "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("target_arch,aux_layers", [("llama", [2, 4, 5]), ("deepseek_v3", [3, 31, 59])])
def test_draft_config_ids_reach_layers_to_capture(tmp_path, target_arch, aux_layers):
    """eval_server_cmd with our export -> SGLang resolves the draft's eagle_config ids -> the
    target class's own set_eagle3_layers_to_capture -> layers_to_capture == aux_layers."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    target = _target_dir(tmp_path, target_arch)
    draft = export(tmp_path, aux_layers, target_arch)
    cmd = eval_server_cmd(str(target), str(draft), 1, 3, 1, 0, free_port(),
                          ["--device", "cpu", "--skip-tokenizer-init"])
    sa = prepare_server_args(cmd[3:])
    sa.resolve_once()
    assert resolved_view(sa).speculative_draft_model_path == str(draft)
    cls = LlamaForCausalLM if target_arch == "llama" else DeepseekV2ForCausalLM
    cfg, model = layers_sglang_captures(sa, cls, SpeculativeAlgorithm.EAGLE3)
    assert cfg.eagle_use_aux_hidden_state and model.capture_aux_hidden_states
    assert model.model.layers_to_capture == aux_layers
