"""SGLang server command lines: a plain server, and one that serves the target with an EAGLE-3 drafter.

    cmd = server_cmd("/models/Kimi-K2.5", 8, 30000, trust_remote_code=True, python=sglang_python())
    cmd = eval_server_cmd("/models/Kimi-K2.5", "runs/kimi_k25/export/sglang", 8, 3, 1, 4, 30000)

Only command lines, no SGLang import: every flag is checked against SGLang 0.5.23's ServerArgs by
tests/sglang/test_server_args.py. capture/sglang_server.py builds the capture server's command on
server_cmd and launches servers.
"""
from __future__ import annotations

import os
import sys
from typing import List, Sequence

SGLANG_PYTHON_ENV = "EAGLE3_SGLANG_PYTHON"


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
