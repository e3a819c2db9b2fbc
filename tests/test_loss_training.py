"""Every `train.loss` choice trains: a few AdamW steps of training-time test on a tiny random
Llama target's own hidden states lower each loss, with and without EAGLE-3.1's norms. The losses'
values and gradients against their textbook forms are in tests/test_loss.py."""
import math

import pytest
import torch

from eagle3.loss import ttt_loss
from eagle3.losses import LOSSES
from eagle3.model import Eagle3Drafter
from eagle3.vocab import build_vocab

BOTH_NORMS = dict(fc_norm=True, norm_output=True)


@pytest.fixture(scope="module")
def tiny_target_batch():
    """Two sequences of real text through the tiny random Llama target (conf/target/tiny_llama.yaml):
    aux states of layers [2, 3, 4], the final hidden and the lm_head, as training reads them. The
    random target's next-token distribution is nearly flat (top probability about 5e-4), which no
    acceptance-based loss can learn from (alpha <= the tiny mass on the draft vocab, and its gradient
    vanishes); its lm_head is scaled by 10 so that it is as confident as a trained model (top
    probability about 0.6)."""
    from eagle3.targets import load_head, load_target_model, load_tokenizer, resolve_target, target_info
    from eagle3.vocab import count_tokens

    rc = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048)
    tdir = resolve_target("random", "", "tiny_llama", "llama", rc, 0)
    info, tok = target_info(tdir), load_tokenizer(tdir)
    model = load_target_model(tdir, torch.float32, "cpu")
    texts = ["The quick brown fox jumps over the lazy dog, and then the dog sleeps all afternoon.",
             "Speculative decoding drafts a few tokens cheaply and lets the large model check them."]
    ids = [tok(t)["input_ids"] for t in texts]
    T = max(map(len, ids))
    input_ids = torch.tensor([x + [0] * (T - len(x)) for x in ids])
    attention_mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in ids])
    with torch.no_grad():
        hs = model(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    embed, head = load_head(tdir)
    head = 10 * head.float()
    # a draft vocab holding the target's own greedy choices, so that rows are counted
    top = (hs[-1] @ head.T).argmax(-1)
    vocab = build_vocab(count_tokens([top[0], top[1]], [attention_mask[0], attention_mask[1]], info.vocab_size), 256)
    batch = dict(input_ids=input_ids, loss_mask=attention_mask, attention_mask=attention_mask,
                 aux=torch.cat([hs[i] for i in (2, 3, 4)], -1), final=hs[-1], target_lm_head=head)
    return info, embed.float(), vocab, batch


@pytest.mark.parametrize("loss, norms", [(name, {}) for name in LOSSES] + [("lk", BOTH_NORMS), ("soft_ce", BOTH_NORMS)])
def test_training_with_each_loss_lowers_it_on_the_tiny_target(tiny_target_batch, loss, norms):
    """A few AdamW steps of TTT (3 steps, decay 0.8, a 256-token draft vocab) on the tiny target's
    own states: every loss choice, with and without the EAGLE-3.1 norms, trains and goes down."""
    from eagle3.config import DrafterConfig
    from eagle3.shape import drafter_shape

    info, embed, vocab, batch = tiny_target_batch
    cfg = DrafterConfig(**norms)
    shape = drafter_shape(info, cfg, num_aux=3, draft_vocab_size=vocab.size)
    assert (shape.fc_norm, shape.norm_output) == (cfg.fc_norm, cfg.norm_output)
    torch.manual_seed(0)
    d = Eagle3Drafter(shape)
    d.set_target_embedding(embed)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        out = ttt_loss(d, **batch, vocab=vocab, ttt_steps=3, decay=0.8, loss=loss)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert out.count[0] > 0 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.9 * losses[0], losses
