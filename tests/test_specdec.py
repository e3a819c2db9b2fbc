"""The hf reference backend: greedy chain speculative decoding (eagle3/specdec.py).

Checked against independent computations: transformers' own `generate` for the plain greedy
loop; a hand-computed sequence of accept lengths for tau counting (a scripted drafter whose
proposals we control); and a cache-free recompute of the drafter for every proposal the cached
drafter makes.
"""
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from eagle3.export import export_drafter
from eagle3.model import Eagle3Drafter
from eagle3.shape import DrafterShape
from eagle3.specdec import Eagle3ChainDrafter, greedy_decode, load_hf_drafter, spec_decode

V, H, LAYERS, AUX = 256, 64, 5, [1, 2, 4]


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def tiny_deepseek(seed=0):
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(vocab_size=V, hidden_size=H, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=LAYERS, first_k_dense_replace=1, n_routed_experts=8,
                           num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                           max_position_embeddings=512, initializer_range=0.2)
    return DeepseekV3ForCausalLM(cfg).eval()


def random_drafter(target, seed=1, vd=V):
    torch.manual_seed(seed)
    shape = DrafterShape(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=V, draft_vocab_size=vd, target_hidden_size=H, num_aux=3)
    m = Eagle3Drafter(shape)
    for p in m.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    m.set_target_embedding(target.get_input_embeddings().weight)
    # every other token id in the draft vocab when vd < V: d2t non-decreasing, as exported
    ids = torch.arange(vd) * (V // vd)
    return m.eval(), ids - torch.arange(vd)


def prompts(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# ---------------------------------------------------------------------------------------------

def test_greedy_decode_equals_transformers_generate():
    model = tiny_llama()
    for p in prompts(3):
        ours, _ = greedy_decode(model, p, 20, stop_ids=[])
        ref = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                             pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert ours == ref


class ScriptedDrafter:
    """Proposes the true continuation for the first plan[i] positions of round i, then wrong tokens."""

    def __init__(self, reference, plan, k):
        self.ref, self.plan, self.k, self.round = reference, plan, k, 0

    def reset(self):
        self.round = 0

    def propose(self, aux, next_ids, start_pos, num_steps):
        assert num_steps == self.k and aux.shape[0] == next_ids.shape[0]
        # the last fed row is position start_pos+n-1 holding token start_pos+n: drafts follow it
        base = start_pos + next_ids.shape[0]
        assert next_ids.tolist() == self.ref[start_pos + 1:base + 1]
        good = self.plan[self.round]
        self.round += 1
        return [self.ref[base + 1 + j] if j < good else (self.ref[base + 1 + j] + 1) % V
                for j in range(num_steps)]


@pytest.mark.parametrize("plan,max_new", [([3, 0, 2, 1, 3, 0], 16), ([3, 3, 1, 2], 13)])
def test_tau_counting_matches_hand_computed_accept_lengths(plan, max_new):
    model = tiny_llama()
    p = prompts(1, seed=7)[0]
    base, _ = greedy_decode(model, p, max_new + 8, stop_ids=[])
    k = 3
    out, counts, _ = spec_decode(model, ScriptedDrafter(p + base, plan, k), p, AUX, k, max_new, stop_ids=[])
    assert out == base[:max_new]
    # Hand count. Plan 1: 1 (prefill) + 4 + 1 + 3 + 2 + 4 + 1 = 16 tokens in 6 verify steps.
    # Plan 2: 1 + 4 + 4 + 2 + 3 = 14 >= 13: the last step's 2 accepted drafts count although the
    # output is cut at 13 (vLLM counts before truncation).
    drafts, accepted = len(plan), sum(plan)
    assert counts.num_drafts == drafts and counts.num_accepted == accepted
    assert counts.num_draft_tokens == k * drafts
    assert counts.accepted_per_pos == [sum(a >= j for a in plan) for j in (1, 2, 3)]
    tau = 1 + counts.num_accepted / counts.num_drafts
    assert tau == pytest.approx({16: 1 + 9 / 6, 13: 1 + 9 / 4}[max_new])


def test_stop_token_ends_output_inside_an_accepted_chain():
    model = tiny_llama()
    p = prompts(1, seed=11)[0]
    base, _ = greedy_decode(model, p, 30, stop_ids=[])
    stop = base[6]                       # stop at the first occurrence of this token
    first = base.index(stop)
    out, counts, _ = spec_decode(model, ScriptedDrafter(p + base, [3] * 10, 3), p, AUX, 3, 30, [stop])
    assert out == base[:first + 1]
    ref, _ = greedy_decode(model, p, 30, stop_ids=[stop])
    assert out == ref


class NaiveDrafter:
    """The same drafter recomputed from scratch for every proposal: all rows fed so far in one
    causal pass, draft rows re-run one longer pass at a time (no cache, no truncation)."""

    def __init__(self, model, d2t):
        self.m, self.d2t = model, d2t
        self.aux, self.next = None, None

    def reset(self):
        self.aux = self.next = None

    @torch.no_grad()
    def propose(self, aux, next_ids, start_pos, num_steps):
        if self.aux is None:
            self.aux, self.next = aux, next_ids
        else:
            self.aux = torch.cat([self.aux[:start_pos], aux])
            self.next = torch.cat([self.next[:start_pos], next_ids])
        h_target = self.m.project(self.aux[None])                    # [1, n, H]
        ids, hs, drafts = self.next[None], h_target, []
        for _ in range(num_steps):
            logits, h_out = self.m.forward_step(ids, hs, torch.arange(ids.shape[1])[None], _fresh())
            d = int(logits[0, -1].argmax())
            tok = d + int(self.d2t[d])
            drafts.append(tok)
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)
            hs = torch.cat([hs, h_out[:, -1:]], 1)
        return drafts


def _fresh():
    from eagle3.model import DraftKVCache
    return DraftKVCache()


class Recorder:
    def __init__(self, inner):
        self.inner, self.log = inner, []

    def reset(self):
        self.inner.reset()

    def propose(self, *a):
        d = self.inner.propose(*a)
        self.log.append(d)
        return d


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_deepseek])
@pytest.mark.parametrize("all_accepted", [False, True])
def test_real_drafter_equals_baseline_and_cache_free_recompute(make_target, all_accepted):
    model = make_target()
    drafter, d2t = random_drafter(model, vd=V // 2)
    if all_accepted:
        # A target whose final norm is zero predicts token 0 everywhere, a drafter with a zero
        # lm_head proposes draft id 0 (= target id 0): every draft is accepted, so the drafter is
        # fed k+1 accepted rows per round.
        model.model.norm.weight.data.zero_()
        drafter.lm_head.weight.data.zero_()
    k = 3
    total_drafts = 0
    for p in prompts(3):
        base, _ = greedy_decode(model, p, 24, stop_ids=[])
        cached, naive = Recorder(Eagle3ChainDrafter(drafter, d2t)), Recorder(NaiveDrafter(drafter, d2t))
        out1, c1, _ = spec_decode(model, cached, p, AUX, k, 24, stop_ids=[])
        out2, c2, _ = spec_decode(model, naive, p, AUX, k, 24, stop_ids=[])
        assert out1 == base and out2 == base
        assert cached.log == naive.log and c1 == c2
        total_drafts += c1.num_drafts
        if all_accepted:
            assert c1.num_accepted == k * c1.num_drafts
    assert total_drafts > 0


def test_aux_rows_are_the_entering_layer_hidden_states():
    """The drafter receives output_hidden_states[i] of exactly the accepted tokens."""
    model = tiny_llama()
    p = prompts(1, seed=5)[0]
    base, _ = greedy_decode(model, p, 24, stop_ids=[])
    seen = {}

    class Spy(ScriptedDrafter):
        def propose(self, aux, next_ids, start_pos, num_steps):
            for r in range(aux.shape[0]):
                seen[start_pos + r] = aux[r]
            return super().propose(aux, next_ids, start_pos, num_steps)

    spec_decode(model, Spy(p + base, [2, 0, 3, 1, 2, 2], 3), p, AUX, 3, 12, stop_ids=[])
    full = torch.tensor([p + base])
    with torch.no_grad():
        hs = model(full, output_hidden_states=True).hidden_states
    want = torch.cat([hs[i][0] for i in AUX], -1)
    # rows fed before the last verify step: every position up to the last accepted token's
    assert sorted(seen) == list(range(max(seen) + 1)) and max(seen) >= len(p) + 5
    for pos, row in seen.items():
        torch.testing.assert_close(row, want[pos], atol=1e-4, rtol=1e-4)


def _export_vllm(tmp_path, drafter, d2t):
    """The drafter's vLLM export directory, its t2d marking the draft ids."""
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[d2t + torch.arange(d2t.numel())] = True
    dirs = export_drafter(tmp_path, drafter.exportable_state_dict(), drafter.shape, d2t, t2d, AUX, ["LlamaForCausalLM"],
                          engines=("vllm",))
    return dirs["vllm"]


def test_load_hf_drafter_from_export_proposes_as_the_model(tmp_path):
    model = tiny_llama()
    drafter, d2t = random_drafter(model, vd=V // 4)
    for prm in drafter.parameters():             # exact in bf16, so the export round trip is lossless
        prm.data = prm.data.to(torch.bfloat16).float()
    loaded = load_hf_drafter(_export_vllm(tmp_path, drafter, d2t), model)
    p = prompts(1, seed=9)[0]
    ra, rb = Recorder(Eagle3ChainDrafter(drafter, d2t)), Recorder(loaded)
    a = spec_decode(model, ra, p, AUX, 3, 16, [])
    b = spec_decode(model, rb, p, AUX, 3, 16, [])
    assert a[0] == b[0] and a[1] == b[1] and ra.log == rb.log and ra.log


def test_load_drafter_and_vocab_reads_the_vocab_the_drafter_was_exported_with(tmp_path):
    """From the export's parent (a run dir) too: the draft ids are the exported d2t's, and the
    drafter proposes as load_hf_drafter's does."""
    from eagle3.specdec import load_drafter_and_vocab
    model = tiny_llama()
    drafter, d2t = random_drafter(model, vd=V // 4)
    export = _export_vllm(tmp_path / "run" / "export", drafter, d2t)
    assert export == tmp_path / "run" / "export" / "vllm"
    vocab, loaded = load_drafter_and_vocab(tmp_path / "run", model)
    assert torch.equal(vocab.d2t, d2t) and torch.equal(vocab.draft_ids, d2t + torch.arange(d2t.numel()))
    assert vocab.t2d.sum() == d2t.numel() and vocab.t2d[vocab.draft_ids].all()
    p = prompts(1, seed=9)[0]
    ra, rb = Recorder(load_hf_drafter(export, model)), Recorder(loaded)
    assert spec_decode(model, ra, p, AUX, 3, 16, [])[0] == spec_decode(model, rb, p, AUX, 3, 16, [])[0]
    assert ra.log == rb.log and ra.log


def test_load_hf_drafter_refuses_an_export_whose_tensors_do_not_match(tmp_path):
    """A renamed tensor would otherwise leave its parameter at its initial values without a word."""
    from safetensors.torch import load_file, save_file
    model = tiny_llama()
    export = _export_vllm(tmp_path, *random_drafter(model, vd=V // 4))
    f = export / "model.safetensors"
    tensors = load_file(f)
    tensors["fc.weight_renamed"] = tensors.pop("fc.weight")
    save_file(tensors, f)
    with pytest.raises(ValueError, match=r"missing \['fc.weight'\], unexpected \['fc.weight_renamed'\]"):
        load_hf_drafter(export, model)
