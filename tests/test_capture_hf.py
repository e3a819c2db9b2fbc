"""In-process capture (capture/hf.py) against transformers' own output_hidden_states and logits.

Run: .venv/bin/python -m pytest tests/test_capture_hf.py -q          (-m slow: only the SmolLM2 one)

Tolerances. fp32 capture is compared at 1e-5 (same kernels, so in practice exact). Stored bf16
features: a bf16 cast is off by at most 2^-9 relative, and a batch of another shape may move the
fp32 value a little first, so we allow 2 ulp: rtol 2^-7, plus an fp32 noise floor of 1e-4 x the
layer's RMS for elements near zero (SmolLM2's residual stream has outliers of ~25000 beside an RMS
of ~100; a padded batch moves near-zero elements by ~2e-6 x RMS). Logits from stored bf16 `final`: each
term of final @ W.T is off by at most 2^-8 |f_h w_h| (one bf16 rounding of f, with margin), so
|logit error| <= 2^-8 * (|final| @ |W|.T), checked element by element.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from capture.hf import hf_meta, plan_batches, run_capture
from eagle3.hidden import capture_batch, capture_hidden, decoder_parts, pad_right
from eagle3.batch import collate
from eagle3.features import FeatureDataset, FeatureDatasetError

ROOT = Path(__file__).resolve().parents[1]
BF16_RTOL = 2 ** -7


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).eval()


def tiny_deepseek(seed=0):
    """conf/target/tiny_deepseek.yaml's shape: MLA (q/kv LoRA, rope/nope split) + MoE (8 experts, 2 groups)."""
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=6, first_k_dense_replace=1, n_routed_experts=8,
                           num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=2048)
    return DeepseekV3ForCausalLM(cfg).eval()


def fake_samples(n, vocab, seed=0, lo=4, hi=40):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(n):
        T = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(SimpleNamespace(id=f"c{s}", input_ids=torch.randint(3, vocab, (T,), generator=g).tolist(),
                                   loss_mask=[int(t >= T // 2) for t in range(T)]))
    return out


def meta_for(model, name, aux_layers, n):
    return hf_meta(target_name=name, target_fingerprint="random-seed0", arch=model.config.model_type,
                   aux_layers=aux_layers, hidden_size=model.config.hidden_size, tokenizer_name="none",
                   chat_template="", data={"source": "fake", "num_samples": n, "max_length": 40})


def assert_bf16_close(got, ref):
    torch.testing.assert_close(got.float(), ref, rtol=BF16_RTOL, atol=1e-4 * ref.pow(2).mean().sqrt().item())


def reference(model, ids):
    """transformers' own forward of one unpadded sample: (hidden_states tuple, logits [T, V])."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0]


def check_against_transformers(model, aux_layers, tmp_path, name):
    H = model.config.hidden_size
    samples = fake_samples(6, model.config.vocab_size)
    W = model.get_output_embeddings().weight.detach()
    # fp32, before storage: a padded batch of all six against each sample alone.
    ids = torch.zeros(6, 40, dtype=torch.long)
    att = torch.zeros(6, 40, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, :len(s.input_ids)] = torch.tensor(s.input_ids)
        att[b, :len(s.input_ids)] = 1
    aux, final = capture_hidden(model, ids, att, aux_layers)
    assert aux.shape == (6, 40, len(aux_layers) * H) and final.shape == (6, 40, H)
    refs = [reference(model, s.input_ids) for s in samples]
    for b, (s, (hs, logits)) in enumerate(zip(samples, refs)):
        n = len(s.input_ids)
        for k, i in enumerate(aux_layers):
            torch.testing.assert_close(aux[b, :n, k * H:(k + 1) * H], hs[i], rtol=0, atol=1e-5)
        torch.testing.assert_close(final[b, :n] @ W.T, logits, rtol=0, atol=1e-5)
    # After bf16 storage, through run_capture (its own batching, several shards).
    ds = FeatureDataset(run_capture(model, samples, tmp_path / name, aux_layers=aux_layers,
                                    meta=meta_for(model, name, aux_layers, 6), batch_tokens=64,
                                    shard_tokens=60, progress=False))
    ds.validate()
    assert ds.manifest["totals"]["num_shards"] > 1
    for j, (s, (hs, logits)) in enumerate(zip(samples, refs)):
        got = ds[j]
        assert ds.sample_id(j) == s.id and got["input_ids"].tolist() == s.input_ids
        assert got["loss_mask"].tolist() == s.loss_mask
        for k, i in enumerate(aux_layers):
            assert_bf16_close(got["aux"][:, k * H:(k + 1) * H], hs[i])
        f = got["final"].float()
        bound = 2 ** -8 * (f.abs() @ W.abs().T) + 1e-6
        assert ((f @ W.T - logits).abs() <= bound).all()


def test_llama_features_equal_output_hidden_states(tmp_path):
    check_against_transformers(tiny_llama(), [0, 2, 3, 5], tmp_path, "tiny_llama")


def test_deepseek_mla_moe_features_equal_output_hidden_states(tmp_path):
    check_against_transformers(tiny_deepseek(), [1, 3, 4], tmp_path, "tiny_deepseek")


def test_padding_does_not_change_a_sample():
    model = tiny_deepseek()
    short, long = [5, 6, 7, 8, 9], list(range(10, 40))
    alone, _ = capture_hidden(model, torch.tensor([short]), torch.ones(1, 5, dtype=torch.long), [1, 3])
    ids = torch.zeros(2, 30, dtype=torch.long)
    ids[0, :5], ids[1] = torch.tensor(short), torch.tensor(long)
    att = (torch.arange(30) < torch.tensor([[5], [30]])).long()
    batched, _ = capture_hidden(model, ids, att, [1, 3])
    torch.testing.assert_close(batched[0, :5], alone[0], rtol=0, atol=1e-5)
    assert not torch.allclose(batched[0, :5], batched[1, :5])         # the rows really differ


def test_online_batch_equals_offline_batch(tmp_path):
    """capture_batch (online training) and collate(FeatureDataset) (offline) give the same Batch."""
    model, aux_layers = tiny_llama(), [1, 3, 4]
    samples = fake_samples(5, 512, seed=3)
    ds = FeatureDataset(run_capture(model, samples, tmp_path / "ds", aux_layers=aux_layers, dtype="float32",
                                    meta=meta_for(model, "tiny_llama", aux_layers, 5), progress=False))
    offline = collate([ds[i] for i in range(5)], [ds.sample_id(i) for i in range(5)])
    ids, att = pad_right([s.input_ids for s in samples], "cpu")
    loss = torch.zeros_like(ids)
    for b, s in enumerate(samples):
        loss[b, :len(s.loss_mask)] = torch.tensor(s.loss_mask)
    online = capture_batch(model, ids, att, loss, aux_layers, [s.id for s in samples])
    assert online.sample_ids == offline.sample_ids
    for name in ("input_ids", "loss_mask", "attention_mask"):
        got, want = getattr(online, name), getattr(offline, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    torch.testing.assert_close(online.aux, offline.aux, rtol=0, atol=1e-5)    # padding zeroed in both
    torch.testing.assert_close(online.final, offline.final, rtol=0, atol=1e-5)


def test_finished_capture_is_kept_or_refused(tmp_path, capsys):
    model, aux_layers = tiny_llama(), [1, 3]
    samples = fake_samples(3, 512)
    out = run_capture(model, samples, tmp_path / "ds", aux_layers=aux_layers, progress=False,
                      meta=meta_for(model, "tiny_llama", aux_layers, 3))
    before = {f: (out / f).stat().st_mtime_ns for f in os.listdir(out)}
    run_capture(model, samples, out, aux_layers=aux_layers, progress=False,
                meta=meta_for(model, "tiny_llama", aux_layers, 3))
    assert "nothing to do" in capsys.readouterr().out
    assert before == {f: (out / f).stat().st_mtime_ns for f in os.listdir(out)}
    with pytest.raises(FeatureDatasetError, match=r"target\.name is 'tiny_llama', expected 'smollm2'"):
        run_capture(model, samples, out, aux_layers=aux_layers, progress=False,
                    meta=meta_for(model, "smollm2", aux_layers, 3))


def test_wrapper_and_hooks_removed_on_error():
    model = tiny_llama()
    wrapper = nn.Module()
    wrapper.language_model = model                                     # Kimi-K2.5's multimodal shape
    base, layers = decoder_parts(wrapper)
    assert base is model.model and len(layers) == 6
    ids, att = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    a1, f1 = capture_hidden(wrapper, ids, att, [2])
    a2, f2 = capture_hidden(model, ids, att, [2])
    assert torch.equal(a1, a2) and torch.equal(f1, f2)

    def boom(module, args):
        raise RuntimeError("boom")
    h = layers[4].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        capture_hidden(model, ids, att, [1, 2])
    h.remove()
    assert all(len(layer._forward_pre_hooks) == 0 for layer in layers)
    with pytest.raises(ValueError, match=r"\[6\] outside 0\.\.5"):
        capture_hidden(model, ids, att, [2, 6])


def test_plan_batches_budget_and_order():
    lengths = [10, 3, 50, 10, 7, 7, 2]
    batches = plan_batches(lengths, 30)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 30 or len(b) == 1
    assert batches == [[2], [0, 3, 4], [5, 1, 6]]          # longest first, 3 x 10 fits 30


# A capture in a child process, slowed by a sleeping hook so it can be killed mid-run.
CHILD = """
import sys, time, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from test_capture_hf import tiny_llama, fake_samples, meta_for
from capture.hf import run_capture
model = tiny_llama()
model.model.layers[0].register_forward_pre_hook(lambda m, a: time.sleep(float(sys.argv[2])))
samples = fake_samples(40, 512, seed=1)
run_capture(model, samples, sys.argv[1], aux_layers=[1, 3, 4], meta=meta_for(model, "tiny_llama", [1, 3, 4], 40),
            batch_tokens=80, shard_tokens=120, progress=False)
"""


def test_sigkill_then_resume_is_byte_identical(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT), tests=str(ROOT / "tests")))
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(out, sleep, **kw):
        return subprocess.Popen([sys.executable, str(script), str(out), str(sleep)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)

    out = tmp_path / "killed"
    child = run(out, 0.1)
    progress = tmp_path / "killed.partial" / "progress.json"
    deadline = time.time() + 120
    while time.time() < deadline and '"num_bytes"' not in (progress.read_text() if progress.exists() else ""):
        assert child.poll() is None, child.stdout.read()
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not out.exists() and (tmp_path / "killed.partial").exists()
    resumed = run(out, 0)
    log = resumed.communicate(timeout=120)[0]
    assert resumed.returncode == 0, log
    assert "resuming" in log and "already done" in log
    threads = torch.get_num_threads()                   # the uninterrupted run, here, like the child
    torch.set_num_threads(1)
    try:
        run_capture(tiny_llama(), fake_samples(40, 512, seed=1), tmp_path / "ref", aux_layers=[1, 3, 4],
                    meta=meta_for(tiny_llama(), "tiny_llama", [1, 3, 4], 40), batch_tokens=80,
                    shard_tokens=120, progress=False)
    finally:
        torch.set_num_threads(threads)
    files = sorted(os.listdir(tmp_path / "ref"))
    assert len(files) > 3 and files == sorted(os.listdir(out))
    for f in files:
        assert (out / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f


@pytest.mark.slow
def test_smollm2_features_equal_output_hidden_states(tmp_path):
    """Real SmolLM2 on real chat-rendered ShareGPT conversations (4 of them, cut to 24..64 tokens)."""
    from eagle3.data import build_samples
    from eagle3.targets import default_aux_layers, load_target_model, load_tokenizer, resolve_target
    path = resolve_target("gguf", "", "smollm2")
    model = load_target_model(path, torch.float32, "cpu")
    samples, _, _ = build_samples(load_tokenizer(path), "sharegpt", "", 4, 64, 0.0)
    samples = [SimpleNamespace(id=s.id, input_ids=s.input_ids[:n], loss_mask=s.loss_mask[:n])
               for s, n in zip(samples, (64, 48, 40, 24))]                       # a ragged batch
    aux_layers = default_aux_layers(model.config.num_hidden_layers)             # [2, 15, 27]
    H = model.config.hidden_size
    W = model.get_output_embeddings().weight.detach()
    ds = FeatureDataset(run_capture(model, samples, tmp_path / "smollm2", aux_layers=aux_layers,
                                    meta=meta_for(model, "smollm2", aux_layers, 4), progress=False))
    assert len(ds) == 4 and len({len(s.input_ids) for s in samples}) > 1      # a padded batch
    for j, s in enumerate(samples):
        hs, logits = reference(model, s.input_ids)
        got = ds[j]
        assert got["input_ids"].tolist() == s.input_ids and got["loss_mask"].tolist() == s.loss_mask
        for k, i in enumerate(aux_layers):
            assert_bf16_close(got["aux"][:, k * H:(k + 1) * H], hs[i])
        f = got["final"].float()
        assert ((f @ W.T - logits).abs() <= 2 ** -8 * (f.abs() @ W.abs().T) + 1e-4).all()
