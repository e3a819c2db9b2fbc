"""Streaming against offline training of one experiment: the trainer's tokens/s when its features
come from a producer within a disk budget (train.mode=stream) and when they come from a finished
feature dataset on disk, the producer's capture rate, and the most the stream directory held.

    python bench/stream.py --experiment tiny --budget-gb 0.005 train.steps=40 capture.shard_tokens=2048
    python bench/stream.py --experiment smollm2 --budget-gb 0.5 --reuse
    python bench/stream.py --experiment kimi_k25 --budget-gb 2000 capture.server_url=http://HOST:30000

Every run is the entry point's own command (printed before it runs), each in a directory of its own
under --out; trailing key=value arguments go to all of them. The offline run trains in shard order
(train.order=shards), the order a stream run trains in, so both read the same batches. A stream
trainer faster than its producer waits: its tokens/s is then the producer's, which is what this
measures; its rate also counts the wait for the producer's first shard (loading the target, the
held-out features), so give it enough steps. The capture run's rate includes loading the target.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.stream import dir_bytes  # noqa: E402


def run(cmd: list, what: str) -> float:
    """Run an entry point to completion; its wall time in seconds."""
    print(f"[bench] {what}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    p = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=dict(os.environ, WANDB_MODE="disabled"),
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"[bench] {what} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return time.time() - t0


def trainer_tok_s(run_dir: Path) -> float:
    """The last train row's tokens/s: all tokens trained over the loop's time, waits included."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"][-1]["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="tiny")
    ap.add_argument("--budget-gb", type=float, required=True, help="data.disk_budget_gb of the stream run")
    ap.add_argument("--reuse", action="store_true", help="data.stream_reuse=true in the stream run")
    ap.add_argument("--out", default="runs/bench_stream")
    args, overrides = ap.parse_known_args()
    out = Path(args.out).resolve()
    exp = [f"+experiment={args.experiment}", "train.wandb=false", *overrides]
    features = out / "features"

    capture_s = run(["-m", "capture", *exp, f"data.features_dir={features}", f"run_dir={out}/capture"], "capture")
    tokens = json.loads((features / "manifest.json").read_text())["totals"]["num_tokens"]
    run(["train.py", *exp, f"run_dir={out}/offline", f"data.features_dir={features}", "train.order=shards"], "offline")

    stream_dir = out / "stream_dir"
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], dir_bytes(stream_dir) if stream_dir.exists() else 0)
            time.sleep(0.01)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run(["train.py", *exp, f"run_dir={out}/stream", "train.mode=stream", f"data.stream_dir={stream_dir}",
             f"data.disk_budget_gb={args.budget_gb}", f"data.stream_reuse={str(args.reuse).lower()}",
             f"data.features_dir={features}"], "stream")
    finally:
        stop.set()
        sampler.join()
    producer = json.loads((stream_dir / "producer.json").read_text())
    stream_info = json.loads((stream_dir / "stream.json").read_text())

    offline_tok_s, stream_tok_s = trainer_tok_s(out / "offline"), trainer_tok_s(out / "stream")
    print(f"\n{args.experiment}: budget {args.budget_gb:g} GB, {'reuse' if args.reuse else 'capture every epoch'}, "
          f"{stream_info['num_shards']} shards an epoch, {stream_info['total_steps']} steps")
    print(f"{'':28}{'tok/s':>12}")
    print(f"{'trainer, offline from disk':28}{offline_tok_s:>12,.0f}")
    print(f"{'trainer, stream':28}{stream_tok_s:>12,.0f}   ({stream_tok_s / offline_tok_s:.2f}x offline)")
    print(f"{'producer (stream)':28}{producer['tok_s']:>12,.0f}   ({producer['units']} shards written)")
    print(f"{'capture (offline, whole)':28}{tokens / capture_s:>12,.0f}   ({tokens:,} tokens in {capture_s:.0f}s)")
    print(f"stream directory at most {peak[0] / 1e9:.4g} GB of {args.budget_gb:g} GB; "
          f"feature dataset on disk {dir_bytes(features) / 1e9:.4g} GB")


if __name__ == "__main__":
    main()
