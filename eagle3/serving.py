"""SGLang server command lines: a plain server, and one that serves the target with an EAGLE-3 drafter.

    cmd = server_cmd("/models/Kimi-K2.5", 8, 30000, trust_remote_code=True, python=sglang_python())
    cmd = eval_server_cmd("/models/Kimi-K2.5", "runs/kimi_k25/export/sglang", 8, 3, 1, 4, 30000)

Only command lines and memory arithmetic, no SGLang import: every flag is checked against SGLang
0.5.23's ServerArgs by tests/sglang/test_server_args.py. capture/sglang_server.py builds the capture
server's command on server_cmd and launches servers.

The draft's KV cache (docs/runbook_kimi.md, "Serving the drafter"): SGLang 0.5.23 sizes
the KV pool per token as the target's bytes x (1 + draft_layers / target_layers)
(model_executor/pool_configurator.py), i.e. as if the draft's layer were one of the target's. For
an MLA target that charges the draft 576 values per token, while a Llama-layout drafter stores
2 x kv_heads x head_dim (split over TP); the difference comes out of the memory SGLang keeps free
for activations and CUDA graphs unless the pool is capped (eval_kv_args, batch 1) or the static
fraction lowered (draft_mem_fraction, serving many streams).
"""
from __future__ import annotations

import os
import sys
from typing import List, Sequence

SGLANG_PYTHON_ENV = "EAGLE3_SGLANG_PYTHON"
# Every SGLang server we start waits this long for /health: Kimi-K2.5 (1T parameters, 8 GPUs)
# loads for many minutes, and an evaluation server loads the same target.
SERVER_START_TIMEOUT = 3600.0
# KV slots of an evaluation server (batch 1): the longest MT-Bench conversation with its answers
# is a few thousand tokens; the cap keeps both pools far below SGLang's KV budget (see eval_kv_args).
EVAL_MAX_TOTAL_TOKENS = 65536
_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def sglang_python() -> str:
    """The Python that runs SGLang: $EAGLE3_SGLANG_PYTHON (SGLang lives in its own environment), else this one."""
    return os.environ.get(SGLANG_PYTHON_ENV) or sys.executable


def server_cmd(model_path: str, tp_size: int, port: int, extra_args: Sequence[str] = (), *,
               trust_remote_code: bool = False, python: str = sys.executable) -> List[str]:
    """`python -m sglang.launch_server` serving the target alone; extra_args go last."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--tp-size", str(int(tp_size)), "--port", str(int(port))]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd + [str(a) for a in extra_args]


def eval_server_cmd(model_path: str, draft_path: str, tp_size: int, num_steps: int, topk: int,
                    num_draft_tokens: int, port: int, extra_args: Sequence[str] = (), *,
                    trust_remote_code: bool = False, python: str = sys.executable) -> List[str]:
    """The target served with an EAGLE-3 drafter; num_draft_tokens 0 = num_steps + 1 (a chain)."""
    n_draft = int(num_draft_tokens) or int(num_steps) + 1
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_path),
            "--speculative-num-steps", str(int(num_steps)), "--speculative-eagle-topk", str(int(topk)),
            "--speculative-num-draft-tokens", str(n_draft)]
    return server_cmd(model_path, tp_size, port, [*spec, *extra_args], trust_remote_code=trust_remote_code,
                      python=python)


# ----------------------------------------------------------------------------------------------
# Memory of the draft's KV cache, per GPU. cfg: a config.json as a dict (Kimi's text_config is
# read when present); bytes per value: 2 (bf16 KV cache, SGLang's default for a bf16 model).

def _text(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def kv_bytes_per_token(cfg: dict, tp_size: int, value_bytes: int = 2) -> int:
    """KV-cache bytes per token on one GPU for all of the model's layers, as SGLang stores them:
    MLA keeps the latent (kv_lora_rank + qk_rope_head_dim) on every rank; other attention keeps
    K and V of max(1, kv_heads // tp) heads per rank."""
    c = _text(cfg)
    layers = int(c["num_hidden_layers"])
    if c.get("model_type") in _MLA_TYPES or "kv_lora_rank" in c:
        return (int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])) * layers * value_bytes
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    return max(1, heads // int(tp_size)) * 2 * head_dim * layers * value_bytes


def draft_kv_bytes(target_cfg: dict, draft_cfg: dict, tp_size: int) -> tuple:
    """(bytes/token SGLang charges the draft, bytes/token the draft stores), one GPU."""
    target = kv_bytes_per_token(target_cfg, tp_size)
    charged = target * int(draft_cfg.get("num_hidden_layers", 1)) // int(_text(target_cfg)["num_hidden_layers"])
    return charged, kv_bytes_per_token(draft_cfg, tp_size)


def draft_mem_fraction(base: float, target_cfg: dict, draft_cfg: dict, tp_size: int) -> float:
    """--mem-fraction-static that keeps SGLang's own activation/graph reserve for a drafter whose
    KV cache is larger than SGLang charges for it; `base` is the fraction the server would use
    anyway (its log prints mem_fraction_static).

    With M the GPU's memory, W the weights and r = (stored - charged) / (target + charged), the
    pool of N = (f M - W) / (target + charged) tokens stores r (f M - W) bytes more than budgeted;
    keeping the free memory at (1 - base) M needs f = (base + r W/M) / (1 + r). Taking W = 0 gives
    base / (1 + r): never less room than needed, at most r/(1+r) of the KV budget given up.
    Rounded down to 3 decimals; `base` unchanged when the draft stores no more than it is charged."""
    charged, stored = draft_kv_bytes(target_cfg, draft_cfg, tp_size)
    if stored <= charged:
        return base
    r = (stored - charged) / (kv_bytes_per_token(target_cfg, tp_size) + charged)
    return int(base / (1 + r) * 1000) / 1000


def eval_kv_args(target_cfg: dict, draft_cfg: dict, tp_size: int,
                 max_total_tokens: int = EVAL_MAX_TOTAL_TOKENS) -> List[str]:
    """Server flags that leave room for the draft's KV cache at batch 1: cap the pool at
    max_total_tokens slots, so the draft's bytes SGLang does not charge are at most
    max_total_tokens x (stored - charged) (65536 x 2944 B = 193 MB for Kimi-K2.5 at TP 8), against
    the 10 GiB SGLang 0.5.23 reserves at least for an MLA target on a GPU over 60 GiB. [] when
    nothing is uncharged."""
    charged, stored = draft_kv_bytes(target_cfg, draft_cfg, tp_size)
    return ["--max-total-tokens", str(int(max_total_tokens))] if stored > charged else []
