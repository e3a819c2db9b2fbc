"""Wait for jobs of scripts/gpu/proof.py, then pack what the device tool can bring back.

    python scripts/gpu/collect.py --work /tmp/proof --out $OUT --wait 540 --exports peer_lr1e-3,scale_all

Waits until every job in WORK/status.json has ended or --wait seconds pass, prints the status, then
writes OUT/small.tar.gz (status, log tails, metrics, curves, configs, evaluation reports) and, for each
run named in --exports that has finished and was not sent before, its export/vllm directory as a tar
split into parts of 15 MiB (the tool brings back at most 8 files of 16 MiB, 64 MiB in all), and
with --answers the regenerated-answers file, xz-compressed, in parts of 15 MiB (join with cat,
then xz -d).

--snapshot NAMES: for each named training that has NOT finished (still running, or failed), export
its latest checkpoint (its own command with export_only=true, beside the running job) and send
that as exp_<run>_snapshot.tar: what a lease that ends before the run does still brings back.
"""
from __future__ import annotations

import argparse
import io
import json
import subprocess
import tarfile
import time
from pathlib import Path

PART = 15 << 20
BUDGET = 60 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--wait", type=float, default=0)
    ap.add_argument("--exports", default="")
    ap.add_argument("--snapshot", default="", help="unfinished runs: export and send their latest checkpoint")
    ap.add_argument("--answers", type=Path, help="a regenerated-answers JSONL to bring back, xz-compressed "
                                                 "(a fresh machine cannot resume it otherwise)")
    args = ap.parse_args()
    work, t0 = args.work, time.time()
    status = {}
    while True:
        if (work / "status.json").exists():
            try:
                status = json.loads((work / "status.json").read_text())
            except ValueError:
                pass
        running = [k for k, v in status.items() if v["state"] in ("wait", "run")]
        if (status and not running) or time.time() - t0 > args.wait:
            break
        time.sleep(5)
    for k, v in status.items():
        print(f"{k:28s} {v['state']:5s} start {v['start_s']}s took {v['secs']}s gpus {v['gpus']}")

    with tarfile.open(args.out / "small.tar.gz", "w:gz") as tar:
        for p in sorted(work.rglob("*")):
            rel = p.relative_to(work)
            if not p.is_file() or "checkpoints" in rel.parts or "hydra" in rel.parts:
                continue
            if p.suffix == ".log":
                data = p.read_bytes()[-200_000:]
                info = tarfile.TarInfo(str(rel))
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            elif p.suffix in (".json", ".jsonl", ".png", ".md", ".yaml") and "export" not in rel.parts[:-1] \
                    or p.name == "config.json":
                tar.add(p, arcname=str(rel))
    used, files = (args.out / "small.tar.gz").stat().st_size, 1
    sent_path = work / "sent.txt"
    sent = set(sent_path.read_text().split()) if sent_path.exists() else set()

    def send(key: str, data: bytes, name: str) -> None:
        """data as OUT/name.00, .01, ... parts if this call has room left; remembered as sent."""
        nonlocal used, files
        parts = [data[i:i + PART] for i in range(0, len(data), PART)]
        if used + len(data) > BUDGET or files + len(parts) > 8:
            print(f"[collect] {key}: no room left this time ({len(data) / 2**20:.1f} MiB)")
            return
        for i, part in enumerate(parts):
            (args.out / f"{name}.{i:02d}").write_bytes(part)
        used, files = used + len(data), files + len(parts)
        sent.add(key)
        print(f"[collect] {key}: {len(data) / 2**20:.1f} MiB in {len(parts)} parts")

    def send_export(key: str, run: str, src: Path, name: str) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(src, arcname=f"{run}/vllm")
        send(key, buf.getvalue(), name)

    for run in [r for r in args.exports.split(",") if r]:
        src = work / "runs" / run / "export" / "vllm"
        if run in sent or status.get(run, {}).get("state") != "ok" or not (src / "model.safetensors").exists():
            continue
        send_export(run, run, src, f"exp_{run}.tar")
    for run in [r for r in args.snapshot.split(",") if r]:
        if status.get(run, {}).get("state") not in ("run", "fail"):
            continue
        src = snapshot_export(work, run)
        if src is not None:
            send_export(f"{run}@snapshot", run, src, f"exp_{run}_snapshot.tar")
    if args.answers and args.answers.exists() and str(args.answers) not in sent:
        import lzma
        send(str(args.answers), lzma.compress(args.answers.read_bytes(), preset=6), "answers.jsonl.xz")
    sent_path.write_text("\n".join(sorted(sent)))
    print(f"[collect] {files} files, {used / 2**20:.1f} MiB")


def snapshot_export(work: Path, run: str):
    """Run the job's own command (the first line of its log) with export_only=true: the export of its
    latest checkpoint, in its run_dir/export. Returns the vllm export dir, or None (no checkpoint yet)."""
    cmd = (work / "logs" / f"{run}.log").read_text().splitlines()[0].split()
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([*cmd, "export_only=true"], cwd=root, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"[collect] {run}: no snapshot ({p.returncode}): {(p.stdout + p.stderr)[-600:]}")
        return None
    ck = work / "runs" / run / "checkpoints"
    step = json.loads((ck / (ck / "latest").read_text().strip() / "trainer_state.json").read_text())["step"]
    print(f"[collect] {run}: exported its checkpoint of step {step}")
    return work / "runs" / run / "export" / "vllm"


if __name__ == "__main__":
    main()
