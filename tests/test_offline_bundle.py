"""scripts/offline_bundle.py: pack files, a directory and a wheel into small parts, unpack them in
another folder, compare bytes; a missing or corrupt part is refused by name; parts that arrive in
separate transfers unpack once the last is there."""
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "offline_bundle.py"


def bundle(*args, cwd=None, ok=True):
    p = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert (p.returncode == 0) == ok, f"{args}:\n{p.stdout}\n{p.stderr}"
    return p.stdout + p.stderr


def make_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel of a module `offline_probe`."""
    name, dist = "offline_probe-0.1-py3-none-any.whl", "offline_probe-0.1.dist-info"
    files = {"offline_probe.py": "ANSWER = 42\n",
             f"{dist}/METADATA": "Metadata-Version: 2.1\nName: offline_probe\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{k},sha256={hashlib.sha256(v.encode()).hexdigest()},{len(v)}\n" for k, v in files.items())
    files[f"{dist}/RECORD"] = record + f"{dist}/RECORD,,\n"
    path = folder / name
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


@pytest.fixture
def sources(tmp_path):
    src = tmp_path / "src"
    (src / "model" / "sub").mkdir(parents=True)
    rng = __import__("random").Random(0)
    (src / "model" / "weights.bin").write_bytes(rng.randbytes(150_000))
    (src / "model" / "sub" / "config.json").write_text('{"hidden": 576}\n')
    (src / "target.gguf").write_bytes(rng.randbytes(70_000))
    (src / "answers.jsonl").write_text('{"messages": []}\n' * 100)
    return src


def same_tree(a: Path, b: Path) -> bool:
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return fa == fb and all((a / p).read_bytes() == (b / p).read_bytes() for p in fa)


def test_files_round_trip_through_small_parts(tmp_path, sources):
    out = tmp_path / "out"
    log = bundle("pack", out, "--part-mb", 0.05, "--add", sources / "model", "--add", sources / "target.gguf",
                 "--add", f"{sources / 'answers.jsonl'}=data/answers.jsonl")
    parts = sorted(out.glob("bundle.part*"))
    assert len(parts) >= 5 and all(p.stat().st_size <= 0.05 * (1 << 20) for p in parts), log
    node = tmp_path / "node"                      # the GPU node's folder: parts and manifest only
    shutil.copytree(out, node)
    log = bundle("unpack", "--dest", "restored", cwd=node)
    dest = node / "restored"
    assert same_tree(sources / "model", dest / "model")
    assert (dest / "target.gguf").read_bytes() == (sources / "target.gguf").read_bytes()
    assert (dest / "data" / "answers.jsonl").read_bytes() == (sources / "answers.jsonl").read_bytes()
    assert "PYTHONPATH" not in log                # no wheels, nothing to install


def test_missing_and_corrupt_parts_are_refused_by_name_until_all_arrive(tmp_path, sources):
    out = tmp_path / "out"
    bundle("pack", out, "--part-mb", 0.05, "--add", sources / "model")
    parts = sorted(out.glob("bundle.part*"))
    node = tmp_path / "node"
    node.mkdir()
    shutil.copy(out / "bundle.manifest.json", node)
    for p in parts[:2]:                           # the first transfer
        shutil.copy(p, node)
    log = bundle("unpack", "--check", cwd=node, ok=False)
    assert all(f"{p.name}: missing" in log for p in parts[2:]) and parts[0].name not in log
    for p in parts[2:]:                           # the second transfer, one part damaged on the way
        shutil.copy(p, node)
    data = bytearray((node / parts[1].name).read_bytes())
    data[100] ^= 1
    (node / parts[1].name).write_bytes(data)
    log = bundle("unpack", "--dest", "restored", cwd=node, ok=False)
    assert f"{parts[1].name}: sha256 mismatch" in log and "missing" not in log
    assert not (node / "restored").exists()
    (node / parts[1].name).write_bytes(data[:-10])
    assert f"{parts[1].name}: {len(data) - 10} bytes" in bundle("unpack", "--check", cwd=node, ok=False)
    shutil.copy(parts[1], node)                   # sent again
    bundle("unpack", "--dest", "restored", cwd=node)
    assert same_tree(sources / "model", node / "restored" / "model")


def test_wheels_are_installed_offline_into_a_target_dir(tmp_path, sources):
    wheel = make_wheel(tmp_path)
    out = tmp_path / "out"
    bundle("pack", out, "--part-mb", 0.05, "--wheel", wheel, "--add", sources / "target.gguf")
    log = bundle("unpack", "--parts", out, "--dest", tmp_path / "node")
    site = tmp_path / "node" / "site-packages"
    assert f"export PYTHONPATH={site}" in log
    p = subprocess.run([sys.executable, "-c", "import offline_probe; print(offline_probe.ANSWER)"],
                       env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True, text=True)
    assert p.stdout.strip() == "42", p.stderr
