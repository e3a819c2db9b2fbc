"""Engine-ready drafter directories: <run_dir>/export/{sglang,vllm}/ (config.json + model.safetensors).

    python -m eagle3.export reshard SRC DST [--max-mb 5]   # the same export as shards of <= 5 MB each
    python -m eagle3.export RUN_DIR                        # export a run's latest checkpoint as it is

The RUN_DIR form reads RUN_DIR/config.yaml (target, drafter shape, aux layers), vocab.safetensors
and the weights of the checkpoint `checkpoints/latest` names, and writes what the end of training
would have written at that step (a run stopped, killed or still running). It trains nothing and
leaves metrics and checkpoints alone.

Layout (docs/design.md): LlamaForCausalLMEagle3 with `fc`, `midlayer.*` (with num_layers > 1 also
`layers.{j}.*`, each pre-norm under both engines' names), `norm`, `lm_head` over the draft vocab, `d2t [Vd] int64` (target_id - draft_id) and `t2d [V] bool`; with EAGLE-3.1's fc_norm
also `fc_norm.{i}.weight`, and config.json's `fc_norm` / `norm_output` say which of its two norms
the drafter uses (docs/ttt.md). The target's embedding is not exported: engines share the target's.
The two directories differ only in `eagle_config.eagle_aux_hidden_state_layer_ids`, which each
engine reads with its own offset (eagle3/engine_ids.py).

A resharded export (for committing a drafter to git) holds the same tensors in Hugging Face's
sharded layout: model-0000i-of-0000N.safetensors plus model.safetensors.index.json, which SGLang,
vLLM and transformers read in place of model.safetensors.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, Sequence, Tuple

import torch
from safetensors.torch import load_file, save_file

from eagle3 import checkpoint
from eagle3.durable import disk_full, fsync_dir, fsync_tree, is_disk_full
from eagle3.engine_ids import engine_aux_ids
from eagle3.model import Eagle3Drafter
from eagle3.shape import DrafterShape, drafter_shape
from eagle3.targets import Target, prepare_target
from eagle3.vocab import DraftVocab, mapped_rows

ENGINES = ("sglang", "vllm")
INDEX_NAME = "model.safetensors.index.json"
_NOT_EXPORTED = ("embed_tokens.",)   # shared with the target inside the engine
_METADATA = {"format": "pt"}


def drafter_config(shape, aux_layers: Sequence[int], engine: str, target_architectures: Sequence[str],
                   target_name: str = "", target_fingerprint: str = "") -> dict:
    """config.json for one engine. `shape` is eagle3.shape.DrafterShape; target_architectures is the
    target's config.json `architectures` (eagle3/engine_ids.py keys the engine's ids on it)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **shape.to_hf_config(),
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": engine_aux_ids(aux_layers, engine, target_architectures),
            "use_aux_hidden_state": True,
        },
        # Our own record, in this project's meaning (residual stream entering layer i).
        "eagle3": {"aux_layers": list(aux_layers), "engine": engine,
                   "target_architectures": _names(target_architectures),
                   "target": target_name, "target_fingerprint": target_fingerprint},
    }


def _names(architectures: Sequence[str] | str) -> list:
    return [architectures] if isinstance(architectures, str) else list(architectures)


def export_state_dict(model_state: Dict[str, torch.Tensor], d2t: torch.Tensor, t2d: torch.Tensor,
                      dtype: torch.dtype = torch.bfloat16) -> Dict[str, torch.Tensor]:
    out = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model_state.items()
           if not k.startswith(_NOT_EXPORTED)}
    out["d2t"] = d2t.detach().to("cpu", torch.int64).contiguous()
    out["t2d"] = t2d.detach().to("cpu", torch.bool).contiguous()
    return out


def export_drafter(out_root: Path, model_state: Dict[str, torch.Tensor], shape, d2t, t2d,
                   aux_layers: Sequence[int], target_architectures: Sequence[str], target_name: str = "",
                   target_fingerprint: str = "", engines: Sequence[str] = ENGINES,
                   aux_ids_override: Dict[str, list] | None = None) -> Dict[str, Path]:
    """Write out_root/<engine>/ for each engine, atomically (temp dir, fsync, rename): a kill or a full
    disk leaves the previous export of that engine whole, never a mix.

    aux_ids_override replaces the engine's ids; it exists only so tests can export deliberately
    mis-wired drafters and show that acceptance catches them.
    """
    tensors = export_state_dict(model_state, d2t, t2d)
    check_norm_weights(tensors, shape)
    check_layers(tensors, shape)
    written = {}
    for engine in engines:
        cfg = drafter_config(shape, aux_layers, engine, target_architectures, target_name, target_fingerprint)
        if aux_ids_override and engine in aux_ids_override:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(aux_ids_override[engine])
        final = Path(out_root) / engine
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in final.parent.glob(f".{engine}-*"):     # left by an export that was killed
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{engine}-", dir=final.parent))
        try:
            save_file(tensors, str(tmp / "model.safetensors"), metadata=_METADATA)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            fsync_tree(tmp)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not is_disk_full(e):
                raise
            need = sum(t.nbytes for t in tensors.values())
            raise disk_full(tmp, need, f"the {engine} export (the previous one at {final} is kept)") from e
        replace_dir(tmp, final)
        written[engine] = final
    return written


def replace_dir(tmp: Path, final: Path) -> None:
    """Move tmp to final; an existing final is moved aside first and removed after, so at every
    moment one complete directory is at final or at its aside name."""
    old = final.with_name(f".{final.name}-old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def check_layers(tensors: Dict[str, torch.Tensor], shape) -> None:
    """config.json's num_hidden_layers must count the layers the weights hold (each engine builds
    that many and leaves the weights of missing ones at their initial values), and every layer
    j >= 1 must carry its pre-norm under both names with one value (vLLM reads input_layernorm,
    SGLang hidden_norm)."""
    have = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.")})
    if have != list(range(1, shape.num_layers)):
        raise ValueError(f"drafter weights hold layers {[0, *have]} but num_layers={shape.num_layers}: "
                         f"export the shape the drafter was built with")
    for j in have:
        missing = [n for n in _UPPER_LAYER if f"layers.{j}.{n}.weight" not in tensors]
        if missing:
            raise ValueError(f"layers.{j} lacks {missing}")
        a, b = (tensors[f"layers.{j}.{n}.weight"] for n in ("input_layernorm", "hidden_norm"))
        if not torch.equal(a, b):
            raise ValueError(f"layers.{j}: input_layernorm and hidden_norm must be equal")


_UPPER_LAYER = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj",
                "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj")


def check_norm_weights(tensors: Dict[str, torch.Tensor], shape) -> None:
    """The config must describe the weights: SGLang builds fc_norm from config.json's `fc_norm`
    and silently skips weights it has no module for, so fc_norm weights under a config without it
    (or the reverse, norms left at ones) would serve a different drafter than the one trained."""
    have = sorted(k for k in tensors if k.startswith("fc_norm."))
    want = sorted(f"fc_norm.{i}.weight" for i in range(shape.num_aux)) if shape.fc_norm else []
    if have != want:
        raise ValueError(f"drafter weights {have or 'without fc_norm'} do not match fc_norm={shape.fc_norm} "
                         f"(expected {want or 'none'}): export the shape the drafter was built with")


def load_export(export_dir: Path) -> Tuple[Dict[str, torch.Tensor], dict]:
    """(tensors, config) of an export directory, single-file or sharded, with a clear error when it
    is not one. An index wins over a model.safetensors beside it, as it does in the engines."""
    export_dir = Path(export_dir)
    cfg_path, index_path, st_path = (export_dir / n for n in ("config.json", INDEX_NAME, "model.safetensors"))
    hint = "(pass an export dir such as <run_dir>/export/vllm, or a run dir)"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{export_dir} is not a drafter export: config.json is missing {hint}")
    cfg = json.loads(cfg_path.read_text())
    if index_path.exists():
        return _load_shards(export_dir, json.loads(index_path.read_text())["weight_map"]), cfg
    if st_path.exists():
        return load_file(str(st_path)), cfg
    raise FileNotFoundError(f"{export_dir} is not a drafter export: model.safetensors is missing "
                            f"(and there is no {INDEX_NAME} either) {hint}")


def _load_shards(export_dir: Path, weight_map: Dict[str, str]) -> Dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(set(weight_map.values())):
        if not (export_dir / name).exists():
            raise FileNotFoundError(f"{export_dir}: {name}, listed in {INDEX_NAME}, is missing")
        tensors.update(load_file(str(export_dir / name)))
    if set(tensors) != set(weight_map):
        raise ValueError(f"{export_dir}: the shards' tensors and {INDEX_NAME} disagree on "
                         f"{sorted(set(tensors) ^ set(weight_map))}")
    return tensors


def reshard_export(src: Path, dst: Path, max_shard_bytes: int = 5_000_000) -> list[Path]:
    """Write the export at src (either layout) to dst as shards of at most max_shard_bytes on disk.

    dst/ gets config.json (a byte copy), model-0000i-of-0000N.safetensors and INDEX_NAME
    ({"metadata": {"total_size": tensor bytes}, "weight_map": {tensor: file}}), atomically like
    export_drafter. Returns the files written: shards, index, config.
    """
    src, dst = Path(src), Path(dst)
    tensors, _ = load_export(src)
    shards = _pack(tensors, max_shard_bytes)
    if dst.exists() and not (dst / "config.json").exists():
        raise FileExistsError(f"{dst} exists and is not a drafter export; refusing to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    files, weight_map = [], {}
    for i, names in enumerate(shards, 1):
        files.append(f"model-{i:05d}-of-{len(shards):05d}.safetensors")
        save_file({n: tensors[n] for n in names}, str(tmp / files[-1]), metadata=_METADATA)
        assert (tmp / files[-1]).stat().st_size <= max_shard_bytes, f"{files[-1]}: _pack's bound undershot"
        weight_map.update(dict.fromkeys(names, files[-1]))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    shutil.copyfile(src / "config.json", tmp / "config.json")
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    return [dst / f for f in files + [INDEX_NAME, "config.json"]]


def _pack(tensors: Dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard: greedy in name order, each shard's file size bounded from above.

    A safetensors file is an 8-byte length, a JSON header padded with up to 7 spaces, then the data.
    Each tensor's header entry is sized with an 8-character dtype and offsets as wide as the limit
    (no offset inside a shard can be larger), so the bound never falls short of the real file.
    """
    fixed = 8 + 7 + len(json.dumps({"__metadata__": _METADATA}, separators=(",", ":")))
    shards, size = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        entry = {name: {"dtype": "X" * 8, "shape": list(t.shape), "data_offsets": [max_shard_bytes] * 2}}
        cost = len(json.dumps(entry, separators=(",", ":"))) - 2 + 1 + t.nbytes    # minus braces, plus a comma
        if fixed + cost > max_shard_bytes:
            raise ValueError(f"tensor {name} ({t.nbytes:,} bytes, {fixed + cost:,} as a safetensors file) does "
                             f"not fit in a shard of {max_shard_bytes:,} bytes; safetensors cannot split a "
                             "tensor across files: raise the limit")
        if not shards or size + cost > max_shard_bytes:
            shards.append([])
            size = fixed
        shards[-1].append(name)
        size += cost
    return shards


def prune_draft_vocab(tensors: Dict[str, torch.Tensor], config: dict, keep: torch.Tensor
                      ) -> Tuple[Dict[str, torch.Tensor], dict]:
    """The same drafter over a smaller draft vocabulary: `keep` (target ids, all in the current one).

    lm_head keeps the rows of those tokens, so for every kept token the logit is unchanged; d2t and
    t2d describe the new vocabulary (ascending target ids, as eagle3.vocab builds them). A token
    outside it can no longer be drafted. Used to fit a trained drafter into small files: lm_head is
    its largest tensor (draft vocab x hidden).
    """
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    current = d2t + torch.arange(d2t.numel())                      # target id of each draft row
    keep = torch.unique(torch.as_tensor(keep, dtype=torch.long))   # sorted ascending
    if not bool(t2d[keep].all()):
        raise ValueError(f"{int((~t2d[keep]).sum())} of the tokens to keep are not in the draft vocabulary")
    rows = torch.searchsorted(current, keep)
    out = dict(tensors)
    out["lm_head.weight"] = tensors["lm_head.weight"][rows].contiguous()
    out["d2t"] = (keep - torch.arange(keep.numel())).contiguous()
    out["t2d"] = torch.zeros_like(t2d)
    out["t2d"][keep] = True
    cfg = json.loads(json.dumps(config))
    cfg["draft_vocab_size"] = int(keep.numel())
    return out, cfg


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


def load_export_weights(drafter: Eagle3Drafter, tensors: Dict[str, torch.Tensor], embed: torch.Tensor,
                        where: str, replace: Dict[str, torch.Tensor] | None = None, new_layers: int = 0) -> None:
    """Copy the tensors of an export, as load_export returns them, into `drafter` in its dtype. An
    export holds no embedding table (the engines embed with the target's), so `embed` supplies it;
    `replace` swaps tensors by name (a remapped lm_head). Weights whose names do not match are
    refused, each named, except those of the drafter's last `new_layers` layers, which the export
    may lack (they keep their values)."""
    state = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    state.update(replace or {})
    state["embed_tokens.weight"] = embed
    dtype = next(drafter.parameters()).dtype
    with torch.no_grad():
        missing, unexpected = drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    fresh = tuple(f"layers.{j}." for j in range(drafter.shape.num_layers - new_layers, drafter.shape.num_layers))
    missing = [k for k in missing if not k.startswith(fresh)]   # startswith(()) is False
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match the drafter (missing {missing}, unexpected {unexpected})")


def warm_start(drafter: Eagle3Drafter, path: Path, vocab: DraftVocab, target_lm_head: torch.Tensor,
               target: Target) -> dict:
    """Load a trained drafter's export (or run dir) into a fresh one of the same shape, to train on
    (drafter.init_from). Its draft vocab may differ from this run's: rows of tokens both hold are
    copied, the rest come from the target's head through eagle3.vocab.mapped_rows. It may hold fewer
    layers than this run's drafter: the layers it lacks are added on top, each starting as the
    identity (its o_proj and down_proj zero, so both residual branches add nothing), and the drafter
    starts out computing exactly what the export does. Refuses, naming every difference, an export
    for another target, other aux layers, more layers or another shape.
    -> {"from": export dir, "kept_rows": n, "mapped_rows": m, "new_layers": k}."""
    import dataclasses

    from eagle3.evaluation import check_drafter_fits
    export = find_export(Path(path).expanduser(), "vllm")
    tensors, cfg = load_export(export)
    where = f"drafter.init_from {export}"
    aux = check_drafter_fits(cfg, target.info, tensors, engine="vllm", where=where)
    theirs, ours = DrafterShape.from_hf_config(cfg), drafter.shape
    diffs = [f"aux layers {aux} (this run: {list(target.aux_layers)})"] if aux != list(target.aux_layers) else []
    for f in dataclasses.fields(DrafterShape):
        a, b = getattr(theirs, f.name), getattr(ours, f.name)
        same = abs(a - b) <= 1e-6 * abs(b) if isinstance(b, float) else a == b
        if f.name == "num_layers" and a < b:
            continue   # the run's drafter grows: see below
        if f.name != "draft_vocab_size" and not same:
            diffs.append(f"{f.name} {a} (this run: {b})")
    if diffs:
        raise ValueError(f"{where} has another shape than this run's drafter: " + "; ".join(diffs)
                         + ". Set the drafter options to the export's (its config.json) or leave init_from empty.")
    old_ids, new_ids = DraftVocab(tensors["d2t"].long(), tensors["t2d"]).draft_ids, vocab.draft_ids.cpu()
    head = mapped_rows(tensors["lm_head.weight"], old_ids, new_ids, target_lm_head)
    new_layers = ours.num_layers - theirs.num_layers
    load_export_weights(drafter, tensors, drafter.embed_tokens.weight.detach(), where,
                        replace={"lm_head.weight": head}, new_layers=new_layers)
    with torch.no_grad():
        for j in range(theirs.num_layers, ours.num_layers):
            drafter.layers[str(j)].self_attn.o_proj.weight.zero_()
            drafter.layers[str(j)].mlp.down_proj.weight.zero_()
    kept = int(torch.isin(new_ids, old_ids).sum())
    return {"from": str(export), "kept_rows": kept, "mapped_rows": vocab.size - kept, "new_layers": new_layers}


def write_export(run_dir: Path, model_state: Dict[str, torch.Tensor], shape: DrafterShape, vocab: DraftVocab,
                 target: Target) -> Dict[str, Path]:
    """model_state: the trained module's weights (`drafter.` + parameter name), as training holds them
    and checkpoints store them."""
    with torch.device("meta"):
        names = Eagle3Drafter(shape)   # only for its engine names: the meta device allocates nothing
    state = names.to_engine_names({k.removeprefix("drafter."): v for k, v in model_state.items()})
    return export_drafter(Path(run_dir) / "export", state, shape, vocab.d2t, vocab.t2d, target.aux_layers,
                          target.info.architectures, target.info.name, target.info.fingerprint)


def run_config(run_dir: Path):
    """The typed config a run saved. Only the sections the export reads are taken, so a run saved
    before a key elsewhere was added or removed still exports."""
    from omegaconf import OmegaConf

    from eagle3.config import Config
    saved = OmegaConf.load(Path(run_dir) / "config.yaml")
    needed = {k: saved[k] for k in ("target", "drafter", "aux_layers") if k in saved}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), needed))


def export_checkpoint(run_dir: Path) -> tuple[int, Dict[str, Path]]:
    """Export RUN_DIR's latest checkpoint as it is; returns its step and the directories written."""
    run_dir = Path(run_dir)
    ckpt = checkpoint.latest(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir / 'checkpoints'} holds no checkpoint; pass the run_dir of a run "
                                f"that saved one (every train.save_every steps)")
    for need in ("config.yaml", "vocab.safetensors"):
        if not (run_dir / need).exists():
            raise FileNotFoundError(f"{run_dir / need} is missing; {run_dir} is not a training run's directory")
    c = run_config(run_dir)
    target = prepare_target(c.target.source, c.target.path, c.target.name, c.target.arch, c.target.random_config,
                            c.target.seed, c.aux_layers)
    vocab = DraftVocab.load(run_dir / "vocab.safetensors")
    shape = drafter_shape(target.info, c.drafter, num_aux=len(target.aux_layers), draft_vocab_size=len(vocab.d2t))
    return checkpoint.step_of(ckpt), write_export(run_dir, checkpoint.load_model_state(ckpt), shape, vocab, target)


def export_run_main(argv) -> None:
    p = argparse.ArgumentParser(prog="python -m eagle3.export",
                                description="Export a run's latest checkpoint to RUN_DIR/export/{sglang,vllm}.",
                                epilog="python -m eagle3.export reshard --help: an export as small shards")
    p.add_argument("run_dir", type=Path,
                   help="the run_dir of a training run (config.yaml, vocab.safetensors, checkpoints/)")
    args = p.parse_args(argv)
    try:
        step, written = export_checkpoint(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"[export] {args.run_dir} at step {step}: {written['sglang']}  {written['vllm']}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] != ["reshard"]:
        return export_run_main(argv)
    p = argparse.ArgumentParser(description="Drafter export tools.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("reshard", help="rewrite an export as safetensors shards of at most --max-mb each")
    r.add_argument("src", type=Path, help="export dir (config.json + model.safetensors, or already sharded)")
    r.add_argument("dst", type=Path, help="sharded export dir to write (replaced if it is an export)")
    r.add_argument("--max-mb", type=float, default=5.0,
                   help="largest shard file in MB (10^6 bytes), safetensors header included")
    args = p.parse_args(argv)
    try:
        written = reshard_export(args.src, args.dst, int(args.max_mb * 1_000_000))
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    for path in written:
        print(f"{path}  {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
