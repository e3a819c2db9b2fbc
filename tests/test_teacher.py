"""The teacher the loss is taught by (eagle3.loss): the target's softmax over the draft columns, at
train.teacher_temperature, a chunk of rows at a time, a compact dataset's stored top-K tempered the
same way, and the target's probability mass on the draft vocabulary; each against the softmax
computed directly from the full logits."""
from types import SimpleNamespace

import pytest
import torch

from eagle3.loss import batch_teacher, draft_mass, target_teacher


def test_teacher_chunks_agree_with_full_logits():
    torch.manual_seed(0)
    final, head = torch.randn(2, 5, 6), torch.randn(30, 6)
    ids = torch.tensor([1, 4, 9, 20, 29])
    p, top = target_teacher(final, head, ids, chunk_rows=3)
    full = final @ head.T
    torch.testing.assert_close(p, full[..., ids].softmax(-1))
    assert torch.equal(top, full.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.2, 2.0])
def test_tempered_teacher_is_exp_logits_over_t_normalised(temperature):
    """train.teacher_temperature: the teacher row is exp(l_v / T) / sum_u exp(l_u / T) over the draft
    columns, computed here in float64 by hand; the argmax stays the full-vocab one at any T. The
    stored (compact) teacher, top-K probabilities p, gives the same rows over its K columns."""
    torch.manual_seed(1)
    final, head = torch.randn(2, 5, 6, dtype=torch.float64), torch.randn(30, 6, dtype=torch.float64)
    ids = torch.tensor([1, 4, 9, 20, 29])
    p, top = target_teacher(final, head, ids, chunk_rows=3, temperature=temperature)
    logits = (final @ head.T)[..., ids]
    e = torch.exp((logits - logits.max(-1, keepdim=True).values) / temperature)
    torch.testing.assert_close(p, e / e.sum(-1, keepdim=True), rtol=1e-12, atol=1e-14)
    assert torch.equal(top, (final @ head.T).argmax(-1))
    if temperature < 1:       # sharper: the top draft column gains, on every row
        p1, _ = target_teacher(final, head, ids)
        assert (p.max(-1).values > p1.max(-1).values).all()
    # a stored teacher keeps K=3 of the 5 columns at T=1; tempering them is the tempered softmax over those 3
    p1, top1 = target_teacher(final, head, ids)
    kp, ki = p1.topk(3, -1)
    stored = SimpleNamespace(teacher=SimpleNamespace(ids=ki, p=kp.float(), top=top1, mass=None))
    dense, _, _ = batch_teacher(stored, head, ids, temperature)
    kl = logits.gather(-1, ki)
    ek = torch.exp((kl - kl.max(-1, keepdim=True).values) / temperature)
    want = torch.zeros_like(p1).scatter_(-1, ki, ek / ek.sum(-1, keepdim=True))
    torch.testing.assert_close(dense.double(), want, rtol=1e-5, atol=1e-6)


def test_draft_mass_is_the_full_softmax_on_the_draft_columns():
    torch.manual_seed(0)
    final, head = torch.randn(2, 5, 6, dtype=torch.float64), torch.randn(30, 6, dtype=torch.float64)
    ids = torch.tensor([1, 4, 9, 20, 29])
    got = draft_mass(final, head, ids, chunk_rows=3)
    torch.testing.assert_close(got, (final @ head.T).softmax(-1)[..., ids].sum(-1), rtol=1e-12, atol=1e-12)
