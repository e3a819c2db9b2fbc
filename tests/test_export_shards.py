"""Sharded drafter exports (eagle3.export.reshard_export): small files for git, same tensors.

    .venv/bin/python -m pytest tests/test_export_shards.py -q

Independent truth: the source export's model.safetensors, read with safetensors itself, and the
shard files read one by one through the index's weight_map (not through load_export). SGLang's own
weight-file discovery of a sharded dir is checked in tests/sglang/test_loader_sharded.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.export import INDEX_NAME, export_drafter, load_export, main, reshard_export
from eagle3.model import Eagle3Drafter
from eagle3.shape import DrafterShape

# About 100 kB of bf16 weights; fc.weight (64 x 144 bf16, 18,432 bytes) is the largest tensor.
SHAPE = DrafterShape(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=300, draft_vocab_size=50, target_hidden_size=48, num_aux=3)
LIMIT = 20_000


@pytest.fixture
def source(tmp_path) -> Path:
    torch.manual_seed(0)
    model = Eagle3Drafter(SHAPE)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    d2t = torch.randint(0, 200, (SHAPE.draft_vocab_size,))
    t2d = torch.zeros(SHAPE.vocab_size, dtype=torch.bool)
    t2d[d2t + torch.arange(SHAPE.draft_vocab_size)] = True
    return export_drafter(tmp_path / "export", model.exportable_state_dict(), SHAPE, d2t, t2d, [2, 4, 5],
                          ["LlamaForCausalLM"], engines=["vllm"])["vllm"]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.flatten().view(torch.uint8),
                                                                     b.flatten().view(torch.uint8))


def read_shards(export_dir: Path) -> dict:
    weight_map = json.loads((export_dir / INDEX_NAME).read_text())["weight_map"]
    return {name: load_file(str(export_dir / file))[name] for name, file in weight_map.items()}


def test_reshard_keeps_every_tensor_and_respects_the_limit(source, tmp_path):
    dst = tmp_path / "sharded"
    written = reshard_export(source, dst, max_shard_bytes=LIMIT)
    ours = load_file(str(source / "model.safetensors"))
    index = json.loads((dst / INDEX_NAME).read_text())

    shards = sorted(dst.glob("*.safetensors"))
    assert len(shards) >= 3
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                        for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in dst.iterdir()) == sorted([p.name for p in shards] + [INDEX_NAME, "config.json"])
    assert written == shards + [dst / INDEX_NAME, dst / "config.json"]
    assert all(p.stat().st_size <= LIMIT for p in shards), {p.name: p.stat().st_size for p in shards}

    assert set(index["weight_map"]) == set(ours)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ours.values())
    theirs = read_shards(dst)
    assert all(same_bits(theirs[name], ours[name]) for name in ours)
    assert (dst / "config.json").read_bytes() == (source / "config.json").read_bytes()

    # load_export reads both layouts the same way.
    tensors, cfg = load_export(dst)
    assert set(tensors) == set(ours) and all(same_bits(tensors[n], ours[n]) for n in ours)
    assert cfg == json.loads((source / "config.json").read_text())


def test_reshard_of_a_sharded_export_and_in_place(source, tmp_path):
    ours = load_file(str(source / "model.safetensors"))
    dst = tmp_path / "sharded"
    reshard_export(source, dst, max_shard_bytes=LIMIT)
    reshard_export(dst, dst, max_shard_bytes=4 * LIMIT)          # fewer, larger shards, same dir
    assert 1 < len(list(dst.glob("*.safetensors"))) < 3
    assert not list(tmp_path.glob(".sharded-*"))                  # the temp dir was renamed, not left
    theirs = read_shards(dst)
    assert set(theirs) == set(ours) and all(same_bits(theirs[n], ours[n]) for n in ours)


def test_a_tensor_larger_than_the_limit_is_named(source, tmp_path):
    with pytest.raises(ValueError, match=r"fc\.weight \(18,432 bytes"):
        reshard_export(source, tmp_path / "sharded", max_shard_bytes=10_000)
    assert not (tmp_path / "sharded").exists()


def test_load_export_names_what_is_missing(source, tmp_path):
    (source / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors is missing"):
        load_export(source)
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_export(tmp_path)


def test_cli_prints_the_files_and_refuses_a_non_export_destination(source, tmp_path, capsys):
    main(["reshard", str(source), str(tmp_path / "sharded"), "--max-mb", str(LIMIT / 1e6)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(list((tmp_path / "sharded").iterdir()))
    path, size, _ = lines[0].split()
    assert Path(path).parent == tmp_path / "sharded" and int(size.replace(",", "")) == Path(path).stat().st_size
    with pytest.raises(SystemExit, match="is not a drafter export; refusing"):
        main(["reshard", str(source), str(tmp_path)])


def test_pruning_the_draft_vocab_keeps_the_logits_of_kept_tokens():
    """prune_draft_vocab against the full drafter: for every kept token, the pruned lm_head row (and so
    its logit for any hidden state) is the original's; d2t/t2d map exactly the kept target ids."""
    from eagle3.export import prune_draft_vocab

    torch.manual_seed(0)
    V, Vd, H = 50, 12, 8
    ids = torch.sort(torch.randperm(V)[:Vd]).values
    tensors = {"lm_head.weight": torch.randn(Vd, H), "fc.weight": torch.randn(H, 3 * H),
               "d2t": ids - torch.arange(Vd), "t2d": torch.zeros(V, dtype=torch.bool)}
    tensors["t2d"][ids] = True
    keep = ids[torch.tensor([7, 0, 3, 11])]                       # any order
    out, cfg = prune_draft_vocab(tensors, {"draft_vocab_size": Vd, "x": 1}, keep)
    assert cfg == {"draft_vocab_size": 4, "x": 1}
    kept_sorted = torch.sort(keep).values
    assert torch.equal(out["d2t"] + torch.arange(4), kept_sorted)
    assert torch.equal(torch.nonzero(out["t2d"]).flatten(), kept_sorted)
    h = torch.randn(5, H)
    full = h @ tensors["lm_head.weight"].T
    pruned = h @ out["lm_head.weight"].T
    for j, tid in enumerate(kept_sorted.tolist()):
        row = ids.tolist().index(tid)
        assert torch.equal(out["lm_head.weight"][j], tensors["lm_head.weight"][row])
        assert torch.allclose(pruned[:, j], full[:, row], rtol=0, atol=1e-6)
    assert torch.equal(out["fc.weight"], tensors["fc.weight"])
    with pytest.raises(ValueError, match="not in the draft vocabulary"):
        prune_draft_vocab(tensors, {}, torch.tensor([int(torch.nonzero(~tensors["t2d"])[0])]))


def test_export_refuses_norm_weights_its_config_does_not_describe(tmp_path):
    """SGLang builds fc_norm from config.json and skips weights it has no module for: an export
    whose fc_norm flag and weights disagree would serve another drafter, so it is refused."""
    import dataclasses
    d2t, t2d = torch.zeros(SHAPE.draft_vocab_size, dtype=torch.int64), torch.zeros(SHAPE.vocab_size, dtype=torch.bool)
    with_norms = dataclasses.replace(SHAPE, fc_norm=True)
    state = Eagle3Drafter(with_norms).exportable_state_dict()
    with pytest.raises(ValueError, match="fc_norm=False"):
        export_drafter(tmp_path / "a", state, SHAPE, d2t, t2d, [2, 4, 5], ["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="fc_norm=True"):
        export_drafter(tmp_path / "b", Eagle3Drafter(SHAPE).exportable_state_dict(), with_norms, d2t, t2d,
                       [2, 4, 5], ["LlamaForCausalLM"])
    out = export_drafter(tmp_path / "c", state, with_norms, d2t, t2d, [2, 4, 5], ["LlamaForCausalLM"], engines=["vllm"])["vllm"]
    tensors, cfg = load_export(out)
    assert cfg["fc_norm"] is True and cfg["norm_output"] is False
    assert sorted(k for k in tensors if k.startswith("fc_norm.")) == ["fc_norm.0.weight", "fc_norm.1.weight",
                                                                      "fc_norm.2.weight"]
