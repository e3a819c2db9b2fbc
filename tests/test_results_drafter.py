"""The committed SmolLM2 drafter (results/smollm2-drafter): small files, both engines' ids
right for the target, the two directories the same weights.

Its acceptance is measured by evaluate.py (docs/results.md); here only what can go wrong silently:
a shard over the size limit, a config an engine would mis-wire, a link that points nowhere.
"""
from pathlib import Path

import torch

from eagle3.engine_ids import engine_aux_ids
from eagle3.evaluation import check_drafter_fits
from eagle3.export import find_export, load_export
from eagle3.targets import resolve_target, target_info

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "smollm2-drafter"


def test_files_are_small_and_the_weights_are_stored_once():
    files = [p for p in RESULTS.rglob("*") if p.is_file() and not p.is_symlink()]
    assert files and all(p.stat().st_size <= 5_000_000 for p in files)
    assert sum(p.stat().st_size for p in files) <= 25_000_000
    links = [p for p in RESULTS.rglob("*") if p.is_symlink()]
    assert links and all(p.resolve().is_file() and p.resolve().parent.name == "vllm" for p in links)


def test_both_exports_fit_smollm2_with_their_engines_ids():
    info = target_info(resolve_target("gguf", "", "smollm2", "llama", {}, 0), "smollm2")
    loaded = {}
    for engine in ("vllm", "sglang"):
        tensors, cfg = load_export(find_export(RESULTS, engine))
        aux = check_drafter_fits(cfg, info, tensors, engine=engine, where=f"results {engine}")
        assert aux == [2, 15, 27]                      # [2, n//2, n-3] of its 30 layers
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == engine_aux_ids(aux, engine, info.architectures)
        loaded[engine] = tensors
    assert loaded["vllm"].keys() == loaded["sglang"].keys()
    assert all(torch.equal(loaded["vllm"][k], loaded["sglang"][k]) for k in loaded["vllm"])
