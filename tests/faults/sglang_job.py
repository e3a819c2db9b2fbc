"""A capture through the SGLang client against the fake capture server, as one process to kill.

    python tests/faults/sglang_job.py TARGET_DIR SPOOL OUT

The fake server (tests/test_sglang_client.py) runs in this process, so a SIGKILL takes down the
client, its packer and the server's spool writes at once. TARGET_DIR holds the tiny target (made on
first use); a rerun with the same SPOOL and OUT resumes.
"""
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_sglang_client import FakeServer, make_samples, run_client  # noqa: E402

from eagle3.targets import target_info  # noqa: E402


def main(target_dir: Path, spool: Path, out: Path) -> None:
    if not (target_dir / "config.json").exists():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
        LlamaForCausalLM(cfg).save_pretrained(target_dir)
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    server = FakeServer(model, spool, delay=0.02)
    try:
        run_client((model, target_info(target_dir, "tiny_llama")), make_samples(24, seed=2), out, spool, server,
                   concurrency=2)
    finally:
        server.close()


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:4]))
