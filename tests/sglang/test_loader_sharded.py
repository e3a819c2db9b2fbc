"""A resharded export (eagle3.export.reshard_export), found and read by SGLang 0.5.23's own code.

    .venv-sglang/bin/python -m pytest tests/sglang/test_loader_sharded.py -q

The weight files are found as DefaultModelLoader._prepare_weights finds them for safetensors (glob
the dir, keep the files model.safetensors.index.json lists, sort) and read with SGLang's
safetensors_weights_iterator. What that iterator yields is what SGLang hands to
LlamaForCausalLMEagle3.load_weights, which test_loader.py pins parameter by parameter; so the
sharded dir must yield exactly the single-file export's (name, tensor) pairs, bit for bit.

Not done here: load_weights itself on the sharded dir. SGLang's parallel groups can be made once
per process (a second initialize_model_parallel asserts, and its destroy_model_parallel needs
uvicorn), and test_loader.py's module-scoped world makes and ends them; _prepare_weights itself
also reads the published server context that world ends.
"""
from __future__ import annotations

import glob
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.model_loader.weight_utils",
                    reason="SGLang is not installed; run with .venv-sglang/bin/python -m pytest tests/sglang")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from eagle3.export import INDEX_NAME, reshard_export  # noqa: E402
from test_loader import export  # noqa: E402


def sglang_weight_files(export_dir: Path) -> list:
    from sglang.srt.model_loader.weight_utils import filter_duplicate_safetensors_files

    return sorted(filter_duplicate_safetensors_files(glob.glob(f"{export_dir}/*.safetensors"), str(export_dir),
                                                     INDEX_NAME))


def test_sharded_export_reads_as_the_single_file_one(tmp_path):
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    source = export(tmp_path, [2, 4, 5], "llama")
    sharded = tmp_path / "sharded"
    shards = reshard_export(source, sharded, max_shard_bytes=20_000)[:-2]     # without index and config
    assert len(shards) >= 3
    assert sglang_weight_files(sharded) == [str(p) for p in shards]

    ours = load_file(str(source / "model.safetensors"))
    theirs = list(safetensors_weights_iterator(sglang_weight_files(sharded)))
    assert sorted(name for name, _ in theirs) == sorted(ours)                  # each once, none missing
    for name, tensor in theirs:
        assert tensor.dtype == ours[name].dtype and tensor.shape == ours[name].shape, name
        assert torch.equal(tensor.flatten().view(torch.uint8), ours[name].flatten().view(torch.uint8)), name


def test_the_committed_drafter_reads_through_its_links():
    """results/smollm2-drafter/export/sglang holds links to the vllm shards (weights stored once):
    SGLang's discovery must find them and read the very tensors of the vllm directory."""
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    from eagle3.export import load_export

    root = Path(__file__).resolve().parents[2] / "results" / "smollm2-drafter" / "export"
    files = sglang_weight_files(root / "sglang")
    assert len(files) >= 3 and all(Path(f).is_symlink() for f in files)
    ours, _ = load_export(root / "vllm")
    theirs = dict(safetensors_weights_iterator(files))
    assert sorted(theirs) == sorted(ours)
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)
