"""Every experiment composes for every entry point; typos and wrong types fail at start-up."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from eagle3 import config as schema

CONF = Path(__file__).resolve().parents[1] / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
ENTRY_POINTS = ["train", "capture", "evaluate"]
schema.register()


def _compose(name, overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name=name, overrides=overrides)


def test_the_four_required_experiments_exist():
    assert {"smollm2", "tiny", "tiny_deepseek", "kimi_k25"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_into_the_typed_schema(entry, experiment):
    cfg = _compose(entry, [f"+experiment={experiment}"])
    c = schema.to_config(cfg)
    assert isinstance(c, schema.Config)
    assert c.target.name  # every experiment names its target
    assert c.run_dir and "${" not in c.run_dir


def test_default_is_the_embedded_smollm2():
    c = schema.to_config(_compose("train", []))
    assert (c.target.name, c.target.source, c.data.source) == ("smollm2", "gguf", "sharegpt")


def test_kimi_values():
    c = schema.to_config(_compose("train", ["+experiment=kimi_k25"]))
    assert c.aux_layers == [3, 31, 59]
    assert (c.drafter.draft_vocab_size, c.drafter.intermediate_size, c.drafter.num_attention_heads,
            c.drafter.num_key_value_heads, c.drafter.head_dim) == (32000, 18432, 64, 64, 128)
    assert (c.train.ttt_steps, c.data.max_length, c.optim.lr) == (4, 8192, 8e-5)
    assert c.dist.deepspeed and c.capture.backend == "sglang" and c.capture.tp_size == 8
    assert not c.capture.implicit            # train.py says which capture to run instead of starting one
    assert (c.eval.backend, c.eval.num_steps, c.eval.topk, c.eval.num_draft_tokens, c.eval.baseline_tok_s) == (
        "sglang", 3, 1, 4, 90)


def test_kimi_dims_builds_the_kimi_drafter_at_its_real_size():
    """The scale-out experiment's drafter is Kimi-K2.5's (1,190.9M trainable parameters, counted here
    by hand), on a random target of Kimi's hidden size and MLA dims, trained online under ZeRO-3."""
    from types import SimpleNamespace
    from eagle3.shape import drafter_shape

    c = schema.to_config(_compose("train", ["+experiment=kimi_dims"]))
    rc = c.target.random_config
    assert (c.target.source, c.target.arch, rc["hidden_size"], rc["kv_lora_rank"], rc["q_lora_rank"]) == (
        "random", "deepseek_v3", 7168, 512, 1536)
    assert c.dist.deepspeed and c.dist.zero_stage == 3 and c.train.mode == "online"
    target = SimpleNamespace(hidden_size=7168, model_type="deepseek_v3", num_attention_heads=64,
                             num_key_value_heads=64, head_dim=192, intermediate_size=2048, vocab_size=49152,
                             rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096)
    shape = drafter_shape(target, c.drafter, num_aux=len(c.aux_layers), draft_vocab_size=c.drafter.draft_vocab_size)
    H, I, Vd, heads = 7168, 18432, 32000, 64 * 128
    by_hand = 3 * H * H + 2 * H * 3 * heads + heads * H + 3 * H * I + 3 * H + H + H * Vd  # fc qkv o mlp norms head
    assert shape.num_trainable() == by_hand
    assert round(by_hand / 1e6, 1) == 1190.9


def test_smollm2_peer_is_specforges_recipe():
    """SpecForge's peer run (docs/results.md): first 8,000 ShareGPT first turns under 1,500
    characters, SmolLM2's own answers (256 new tokens), seq 512, draft vocab 16,384, TTT 7, AdamW 1e-4 cosine, clip 0.5,
    2 epochs of 16; judged on 20 MT-Bench first turns, 128 new tokens, 3 draft tokens."""
    c = schema.to_config(_compose("train", ["+experiment=smollm2_peer"]))
    assert (c.data.source, c.data.num_samples, c.data.turns, c.data.max_prompt_chars, c.data.max_length) == (
        "sharegpt", 8000, 1, 1500, 512)
    assert c.capture.regenerate and c.capture.regen_max_new_tokens == 256
    assert (c.drafter.draft_vocab_size, c.train.ttt_steps, c.optim.lr, c.optim.grad_clip, c.optim.min_lr_fraction) == (
        16384, 7, 1e-4, 0.5, 0.0)
    assert (c.train.epochs, c.train.batch_size, c.train.steps, c.train.mode) == (2, 16, 0, "online")
    assert (c.eval.prompts, c.eval.num_prompts, c.eval.max_new_tokens, c.eval.num_steps) == (["mt_bench"], 20, 128, 3)


def test_misspelled_key_fails():
    with pytest.raises(ConfigCompositionException) as e:
        _compose("train", ["train.stpes=5"])
    assert "stpes" in str(e.value)


def test_wrong_type_fails():
    with pytest.raises(ConfigCompositionException) as e:
        _compose("train", ["train.steps=many"])
    assert "steps" in str(e.value)


def test_unknown_experiment_fails():
    with pytest.raises(ConfigCompositionException):
        _compose("train", ["+experiment=no_such_thing"])


# what a run's recorded config may differ in from the experiment that trains it: where it ran and
# wrote, checkpoints and logging, and how its data were named (files on that machine; the experiment
# names the same two sets of answers by source and temperature, which capture writes and training reads)
WHERE = {"run_dir", "eval.out_dir", "data.features_dir", "data.mix", "capture.regenerate",
         "capture.draft_vocab_size", "train.save_every", "train.wandb", "drafter.init_from"}


def test_smollm2_scale_is_the_measured_best_recipe():
    """`+experiment=smollm2_scale` trains in two stages (as train.py plans them, `plan_stages`) that
    are, setting for setting, the runs results/training/<run>/config.yaml records: the 1,800-step
    drafter, then the 10% drafter's run from its export."""
    import yaml
    from omegaconf import OmegaConf

    
    plan = schema.plan_stages(_compose("train", ["+experiment=smollm2_scale"]))
    assert [s.run_dir for s in plan] == [Path("runs/smollm2_scale/stage1"), Path("runs/smollm2_scale")]
    for stage, run in zip(plan, ["init_v32768_sampled_all_1800", "init_v32768_all_1800_plus1200"]):
        ours = schema.flatten(OmegaConf.to_container(stage.cfg, resolve=True))
        assert ours.pop("train.stages") == []   # a stage's own config; the key is newer than these runs
        recorded = schema.flatten(yaml.safe_load((CONF.parent / "results" / "training" / run / "config.yaml").read_text()))
        assert ours.keys() == recorded.keys()
        differ = {k for k in ours if ours[k] != recorded[k]}
        assert differ <= WHERE, (run, {k: (ours[k], recorded[k]) for k in differ - WHERE})
        assert [(e["source"], e["temperature"]) for e in ours["data.mix"]] == [("sharegpt", 0.0), ("sharegpt", 0.7)]
        assert [Path(e["path"]).stem for e in recorded["data.mix"]] == ["answers", "sampled"]
        assert (ours["optim.lr"], ours["train.seed"], ours["train.steps"]) == (
            recorded["optim.lr"], recorded["train.seed"], recorded["train.steps"])
    assert plan[0].cfg.drafter.init_from == "results/smollm2-drafter"
    assert plan[1].cfg.drafter.init_from == "runs/smollm2_scale/stage1"   # the first stage's export
