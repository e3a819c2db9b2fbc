"""Engine-ready drafter directories: <run_dir>/export/{sglang,vllm}/ (config.json + model.safetensors).

Layout (DESIGN.md "Drafter export"): LlamaForCausalLMEagle3 with `fc`, `midlayer.*`, `norm`, `lm_head`
over the draft vocab, `d2t [Vd] int64` (target_id - draft_id) and `t2d [V] bool`. The target's
embedding is not exported: engines share the target's. The two directories differ only in
`eagle_config.eagle_aux_hidden_state_layer_ids`, which each engine reads with its own offset
(eagle3/engine_ids.py).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Sequence, Tuple

import torch
from safetensors.torch import load_file, save_file

from eagle3.engine_ids import engine_aux_ids

ENGINES = ("sglang", "vllm")
_NOT_EXPORTED = ("embed_tokens.",)   # shared with the target inside the engine


def drafter_config(shape, aux_layers: Sequence[int], engine: str, target_arch: str,
                   target_name: str = "", target_fingerprint: str = "") -> dict:
    """config.json for one engine. `shape` is eagle3.model.DrafterShape."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **shape.to_hf_config(),
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": engine_aux_ids(aux_layers, engine, target_arch),
            "use_aux_hidden_state": True,
        },
        # Our own record, in this project's meaning (residual stream entering layer i).
        "eagle3": {"aux_layers": list(aux_layers), "engine": engine, "target_arch": target_arch,
                   "target": target_name, "target_fingerprint": target_fingerprint},
    }


def export_state_dict(model_state: Dict[str, torch.Tensor], d2t: torch.Tensor, t2d: torch.Tensor,
                      dtype: torch.dtype = torch.bfloat16) -> Dict[str, torch.Tensor]:
    out = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model_state.items()
           if not k.startswith(_NOT_EXPORTED)}
    out["d2t"] = d2t.detach().to("cpu", torch.int64).contiguous()
    out["t2d"] = t2d.detach().to("cpu", torch.bool).contiguous()
    return out


def export_drafter(out_root: Path, model_state: Dict[str, torch.Tensor], shape, d2t, t2d,
                   aux_layers: Sequence[int], target_arch: str, target_name: str = "",
                   target_fingerprint: str = "", engines: Sequence[str] = ENGINES,
                   aux_ids_override: Dict[str, list] | None = None) -> Dict[str, Path]:
    """Write out_root/<engine>/ for each engine, atomically (temp dir, then rename).

    aux_ids_override replaces the engine's ids; it exists only so tests can export deliberately
    mis-wired drafters and show that acceptance catches them.
    """
    tensors = export_state_dict(model_state, d2t, t2d)
    written = {}
    for engine in engines:
        cfg = drafter_config(shape, aux_layers, engine, target_arch, target_name, target_fingerprint)
        if aux_ids_override and engine in aux_ids_override:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(aux_ids_override[engine])
        final = Path(out_root) / engine
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{engine}-", dir=final.parent))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        written[engine] = final
    return written


def load_export(export_dir: Path) -> Tuple[Dict[str, torch.Tensor], dict]:
    """(tensors, config) of an export directory, with a clear error when it is not one."""
    export_dir = Path(export_dir)
    cfg_path, st_path = export_dir / "config.json", export_dir / "model.safetensors"
    for p in (cfg_path, st_path):
        if not p.exists():
            raise FileNotFoundError(f"{export_dir} is not a drafter export: {p.name} is missing "
                                    "(pass an export dir such as <run_dir>/export/vllm, or a run dir)")
    return load_file(str(st_path)), json.loads(cfg_path.read_text())


def find_export(path: Path, engine: str) -> Path:
    """An export dir given either itself or the run dir above it."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    candidate = path / "export" / engine
    if (candidate / "config.json").exists():
        return candidate
    raise FileNotFoundError(f"{path}: neither an export dir (config.json) nor a run dir with "
                            f"export/{engine}/config.json; train first or pass the export directory")
