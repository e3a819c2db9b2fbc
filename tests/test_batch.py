"""eagle3/batch.py: collate pads with zeros whatever memory it is handed, and Prefetch builds the
next step's batches on its worker, the same batches in the same order as building them in line."""
import threading

import pytest
import torch

from eagle3 import batch as batch_mod
from eagle3.batch import Prefetch, collate


def dirty_empty(monkeypatch):
    """torch.empty returning memory full of 7s, as a reused allocation may be."""
    real = torch.empty

    def empty(*shape, **kw):
        return real(*shape, **kw).fill_(7)
    monkeypatch.setattr(batch_mod.torch, "empty", empty)


def padded(rows, width=None, dtype=None):
    """Right-pad a list of [n_b, ...] tensors with zeros into [B, max n, ...]: the reference."""
    T = max(len(r) for r in rows)
    out = torch.zeros(len(rows), T, *rows[0].shape[1:], dtype=dtype or rows[0].dtype)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out


def test_collate_full_format_pads_with_zeros_over_dirty_memory(monkeypatch):
    g = torch.Generator().manual_seed(0)
    items = [{"input_ids": torch.randint(1, 100, (n,), generator=g), "loss_mask": torch.randint(0, 2, (n,)),
              "aux": torch.randn(n, 12, generator=g).bfloat16(), "final": torch.randn(n, 4, generator=g).bfloat16()}
             for n in (5, 2, 7)]
    dirty_empty(monkeypatch)
    b = collate(items, ["a", "b", "c"])
    assert torch.equal(b.input_ids, padded([it["input_ids"] for it in items], dtype=torch.long))
    assert torch.equal(b.loss_mask, padded([it["loss_mask"] for it in items], dtype=torch.float32))
    assert torch.equal(b.attention_mask, padded([torch.ones(len(it["input_ids"]), dtype=torch.bool) for it in items]))
    assert torch.equal(b.aux, padded([it["aux"] for it in items]))
    assert torch.equal(b.final, padded([it["final"] for it in items]))
    assert b.sample_ids == ["a", "b", "c"] and b.teacher is None


def test_collate_compact_format_pads_codes_scales_and_teacher_with_zeros(monkeypatch):
    g = torch.Generator().manual_seed(1)

    def item(n):
        return {"input_ids": torch.randint(1, 100, (n,), generator=g), "loss_mask": torch.ones(n, dtype=torch.uint8),
                "aux_codes": torch.randint(0, 255, (n, 6), generator=g).to(torch.uint8),
                "aux_scale": torch.rand(n, 3, generator=g).half(),
                "teacher_ids": torch.randint(0, 50, (n, 4), generator=g), "teacher_p": torch.rand(n, 4, generator=g).half(),
                "teacher_mass": torch.rand(n, generator=g), "teacher_top": torch.randint(0, 99, (n,), generator=g)}
    items = [item(3), item(6)]
    dirty_empty(monkeypatch)
    b = collate(items, ["x", "y"])
    assert b.aux is None and b.final is None
    assert torch.equal(b.aux_codes, padded([it["aux_codes"] for it in items]))
    assert torch.equal(b.aux_scale, padded([it["aux_scale"] for it in items]))
    assert torch.equal(b.teacher.ids, padded([it["teacher_ids"] for it in items], dtype=torch.long))
    assert torch.equal(b.teacher.p, padded([it["teacher_p"] for it in items], dtype=torch.float32))
    assert torch.equal(b.teacher.mass, padded([it["teacher_mass"] for it in items], dtype=torch.float32))
    assert torch.equal(b.teacher.top, padded([it["teacher_top"] for it in items], dtype=torch.long))


def test_prefetch_builds_the_next_step_on_its_worker_and_returns_the_same_batches():
    built = []

    def build(step):
        built.append((step, threading.current_thread().name))
        return [step * 10, step * 10 + 1]

    ahead = Prefetch(build, enabled=True)
    got = [ahead.get(k, then=k + 1 if k + 1 < 5 else None) for k in range(5)]
    ahead.close()
    assert got == [[k * 10, k * 10 + 1] for k in range(5)]
    worker = {s: name for s, name in built}
    assert sorted(s for s, _ in built) == list(range(5))            # each step built once
    assert worker[0] == threading.current_thread().name                # nothing was ahead of step 0
    assert all(worker[k].startswith("prefetch") for k in range(1, 5))

    built.clear()
    inline = Prefetch(build, enabled=False)
    assert [inline.get(k, then=k + 1) for k in range(3)] == [[0, 1], [10, 11], [20, 21]]
    assert [name for _, name in built] == [threading.current_thread().name] * 3 and inline.pending is None


def test_prefetch_raises_a_builds_error_when_its_step_is_asked_for():
    def build(step):
        if step == 2:
            raise ValueError("shard 7 is truncated")
        return step

    ahead = Prefetch(build, enabled=True)
    assert ahead.get(0, then=1) == 0 and ahead.get(1, then=2) == 1
    with pytest.raises(ValueError, match="shard 7 is truncated"):
        ahead.get(2, then=3)
    ahead.close()
