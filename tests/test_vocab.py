"""Draft vocabulary: counting, top-Vd choice, d2t/t2d consistency, save/load, coverage."""
import pytest
import torch

from eagle3.vocab import DraftVocab, build_vocab, count_tokens, coverage_curve, mapped_rows


def test_count_tokens_counts_only_assistant_tokens():
    ids = [torch.tensor([1, 2, 3, 3, 4]), torch.tensor([[3, 5, 5]])]
    masks = [torch.tensor([0, 1, 1, 0, 1], dtype=torch.uint8), torch.tensor([[1, 0, 1]])]
    counts = count_tokens(ids, masks, vocab_size=7)
    # masked-in tokens: 2, 3, 4 from the first sample; 3, 5 from the second
    assert counts.tolist() == [0, 0, 1, 2, 1, 1, 0]


def test_count_tokens_rejects_mismatched_mask():
    with pytest.raises(ValueError):
        count_tokens([torch.tensor([1, 2])], [torch.tensor([1, 1, 1])], vocab_size=4)


def test_build_vocab_top_k_with_ties_by_id():
    # id:       0  1  2  3  4  5  6  7
    counts = torch.tensor([5, 0, 9, 5, 1, 5, 0, 2])
    vocab = build_vocab(counts, draft_vocab_size=4)
    # by count: 2 (9), then the tie at 5 broken by id: 0, 3, 5 -> top-4 = {2, 0, 3, 5}
    assert vocab.draft_ids.tolist() == [0, 2, 3, 5]
    assert vocab.d2t.tolist() == [0, 1, 1, 2]
    assert vocab.t2d.tolist() == [True, False, True, True, False, True, False, False]
    assert bool((vocab.d2t[1:] >= vocab.d2t[:-1]).all())           # non-decreasing
    assert torch.equal(torch.nonzero(vocab.t2d).flatten(), vocab.draft_ids)
    assert vocab.coverage == pytest.approx(24 / 27)


def test_build_vocab_fills_with_lowest_unseen_ids_and_caps_at_v():
    counts = torch.tensor([0, 0, 4, 0, 1, 0])
    vocab = build_vocab(counts, draft_vocab_size=4)
    assert vocab.draft_ids.tolist() == [0, 1, 2, 4]                 # 2, 4 seen; 0, 1 fill
    capped = build_vocab(counts, draft_vocab_size=100)
    assert capped.size == 6 and capped.draft_ids.tolist() == list(range(6))
    assert capped.d2t.tolist() == [0] * 6 and capped.coverage == 1.0


def test_save_load_roundtrip(tmp_path):
    counts = torch.randint(0, 50, (100,))
    vocab = build_vocab(counts, 30)
    vocab.save(tmp_path / "vocab.safetensors")
    back = DraftVocab.load(tmp_path / "vocab.safetensors")
    assert torch.equal(back.d2t, vocab.d2t) and back.d2t.dtype == torch.int64
    assert torch.equal(back.t2d, vocab.t2d) and back.t2d.dtype == torch.bool
    assert torch.equal(back.counts, counts)
    DraftVocab(vocab.d2t, vocab.t2d).save(tmp_path / "nocounts.safetensors")
    assert DraftVocab.load(tmp_path / "nocounts.safetensors").counts is None


def test_load_rejects_inconsistent_maps(tmp_path):
    vocab = build_vocab(torch.arange(10), 4)                         # ids 6..9
    t2d = vocab.t2d.clone()
    t2d[0] = True
    DraftVocab(vocab.d2t, t2d).save(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError):
        DraftVocab.load(tmp_path / "bad.safetensors")


def test_coverage_curve():
    counts = torch.tensor([1, 6, 0, 3])                              # total 10; sorted 6, 3, 1, 0
    assert coverage_curve(counts, [1, 2, 3, 4, 8]) == [
        (1, 0.6), (2, 0.9), (3, 1.0), (4, 1.0), (8, 1.0)]
    for size, cov in coverage_curve(counts, [1, 2, 3]):
        assert build_vocab(counts, size).coverage == pytest.approx(cov)


def test_mapped_rows_copies_shared_tokens_and_maps_the_rest_by_ridge_least_squares():
    """Against numpy: ridge least squares as an ordinary one on the system stacked with sqrt(lam) I."""
    import numpy as np
    g = torch.Generator().manual_seed(0)
    V, Ht, H = 50, 6, 4
    head = torch.randn(V, Ht, generator=g, dtype=torch.float64)
    row_ids = torch.tensor([1, 4, 7, 9, 12, 20, 21, 30, 33, 40])
    rows = torch.randn(len(row_ids), H, generator=g, dtype=torch.float64)
    new_ids = torch.tensor([0, 4, 9, 15, 21, 44])
    out = mapped_rows(rows, row_ids, new_ids, head, ridge=0.1)
    X, Y = head[row_ids].numpy(), rows.numpy()
    lam = 0.1 * np.mean(np.diag(X.T @ X))
    A_t = np.linalg.lstsq(np.vstack([X, np.sqrt(lam) * np.eye(Ht)]), np.vstack([Y, np.zeros((Ht, H))]), rcond=None)[0]
    want = head[new_ids].numpy() @ A_t
    for i, t in enumerate(new_ids.tolist()):
        if t in row_ids.tolist():
            want[i] = Y[row_ids.tolist().index(t)]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1], rows[1].float()) and out.dtype == torch.float32
    # a target head that is the trained rows through a map: the map is found again (ridge -> 0)
    A = torch.randn(H, Ht, generator=g, dtype=torch.float64)
    exact = mapped_rows(head[row_ids] @ A.T, row_ids, new_ids, head, ridge=1e-12)
    torch.testing.assert_close(exact, (head[new_ids] @ A.T).float(), rtol=1e-4, atol=1e-5)
