"""Carry what a run needs to a GPU node without internet access: wheels, models, data, in parts.

On a machine with internet access (docs/offline.md):

    python scripts/offline_bundle.py pack bundle/ --part-mb 1000 \
        --python-version 3.12 --platform manylinux_2_28_x86_64 \
        --requirements requirements-gpu.txt --require gguf==0.17.1 \
        --add ~/models/SmolLM2-135M-Instruct.Q4_1.gguf --add data/answers.jsonl --add ~/models/kimi=kimi

Then carry bundle/ (the parts and bundle.manifest.json, in as many transfers as you like) to one
folder on the GPU node and, from that folder:

    python offline_bundle.py unpack --dest /scratch/run          # or: unpack --check, to see what is missing

pack downloads the wheels (`pip download --only-binary=:all: --no-deps`, for the Python version and
platform given; --wheel adds wheel files you already have) and writes them with the added files and
directories as one tar, split into parts of --part-mb as it is written (nothing is staged twice).
bundle.manifest.json holds the sha256 of every part and of every file. unpack refuses, naming each
part that is missing or corrupt, until all are there; then it joins them, restores the files under
--dest (each added path by its name), checks every file against the manifest, installs the wheels
with `pip install --no-index --no-deps` into --site (default DEST/site-packages; --into-env: the
current environment) and prints the line that puts them on PYTHONPATH. Dependencies are not
resolved: list every package the run needs that the node lacks (`pip freeze` of a working
environment is a good start).

This file needs only the Python standard library and pip, so it can be copied to the node alone
(or run from the repository's checkout there).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional

FORMAT = "eagle3-offline-bundle"
CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


class PartWriter(io.RawIOBase):
    """A write-only stream that lands in files NAME.part000, NAME.part001, ... of at most part_bytes
    each, hashing every part as it is written."""

    def __init__(self, out_dir: Path, name: str, part_bytes: int):
        self.out_dir, self.name, self.part_bytes = out_dir, name, part_bytes
        self.parts: List[Dict] = []
        self._f: Optional[BinaryIO] = None
        self._h = None
        self._n = 0

    def writable(self) -> bool:
        return True

    def _next(self) -> None:
        self._close_part()
        path = self.out_dir / f"{self.name}.part{len(self.parts):03d}"
        self._f, self._h, self._n = open(path, "wb"), hashlib.sha256(), 0
        self.parts.append({"name": path.name})

    def _close_part(self) -> None:
        if self._f is not None:
            self._f.close()
            self.parts[-1].update(bytes=self._n, sha256=self._h.hexdigest())
            self._f = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if self._f is None or self._n == self.part_bytes:
                self._next()
            take = min(len(view) - done, self.part_bytes - self._n)
            chunk = view[done:done + take]
            self._f.write(chunk)
            self._h.update(chunk)
            self._n += take
            done += take
        return done

    def close(self) -> None:
        self._close_part()
        super().close()


class JoinedReader(io.RawIOBase):
    """The parts read back to back as one stream."""

    def __init__(self, paths: List[Path]):
        self._paths = list(paths)
        self._f: Optional[BinaryIO] = None

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while True:
            if self._f is None:
                if not self._paths:
                    return 0
                self._f = open(self._paths.pop(0), "rb")
            n = self._f.readinto(buf)
            if n:
                return n
            self._f.close()
            self._f = None


def download_wheels(dest: Path, requirements: List[str], req_files: List[Path], python_version: str,
                    platforms: List[str], abi: str, implementation: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "-d", str(dest)]
    if python_version:
        cmd += ["--python-version", python_version]
    for p in platforms:
        cmd += ["--platform", p]
    if abi:
        cmd += ["--abi", abi]
    if implementation:
        cmd += ["--implementation", implementation]
    for f in req_files:
        cmd += ["-r", str(f)]
    cmd += requirements
    print("[bundle] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def parse_add(spec: str) -> tuple[Path, str]:
    """PATH or PATH=NAME: NAME is where it is restored under --dest (default: PATH's own name)."""
    path, _, name = spec.partition("=")
    path = Path(path).expanduser()
    name = name or path.resolve().name
    if Path(name).is_absolute() or ".." in Path(name).parts or name in ("", "wheels"):
        raise SystemExit(f"--add {spec}: the name must be a relative path inside --dest, not 'wheels'")
    if not path.exists():
        raise SystemExit(f"--add {spec}: {path} does not exist")
    return path, name


def pack(args) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if (out / f"{args.name}.manifest.json").exists() or list(out.glob(f"{args.name}.part*")):
        raise SystemExit(f"{out} already holds a bundle named {args.name!r}: choose another --out or --name")
    adds = [parse_add(s) for s in args.add]
    names = [n for _, n in adds]
    if len(set(names)) != len(names):
        raise SystemExit(f"two --add entries share a name: {names}")
    files: List[Dict] = []
    wheels: List[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        wheel_dir = Path(tmp) / "wheels"
        wheel_dir.mkdir()
        if args.require or args.requirements:
            download_wheels(wheel_dir, args.require, args.requirements, args.python_version, args.platform,
                            args.abi, args.implementation)
        for w in args.wheel:
            for p in (sorted(Path(w).glob("*.whl")) if Path(w).is_dir() else [Path(w)]):
                (wheel_dir / p.name).write_bytes(p.read_bytes())
        writer = PartWriter(out, args.name, int(args.part_mb * (1 << 20)))
        with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            entries = [(p, f"wheels/{p.name}") for p in sorted(wheel_dir.glob("*.whl"))]
            wheels = [arc.split("/", 1)[1] for _, arc in entries]
            for path, name in adds:
                if path.is_dir():
                    entries += [(p, f"{name}/{p.relative_to(path).as_posix()}")
                                for p in sorted(path.rglob("*")) if p.is_file()]
                else:
                    entries.append((path, name))
            for path, arc in entries:
                files.append({"path": arc, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
                tar.add(path, arcname=arc, recursive=False)
        writer.close()
    manifest = {"format": FORMAT, "version": 1, "name": args.name, "parts": writer.parts,
                "files": files, "wheels": wheels}
    (out / f"{args.name}.manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p["bytes"] for p in writer.parts)
    print(f"[bundle] {out}: {len(writer.parts)} part(s) of at most {args.part_mb:g} MiB, {total / (1 << 20):.1f} MiB "
          f"in all; {len(wheels)} wheels, {len(files) - len(wheels)} files; manifest {args.name}.manifest.json")
    print(f"[bundle] carry every {args.name}.part* and {args.name}.manifest.json to one folder, then run there: "
          f"python offline_bundle.py unpack --dest DIR")


def find_manifest(folder: Path, name: Optional[str]) -> Path:
    if name:
        path = folder / f"{name}.manifest.json"
        if not path.exists():
            raise SystemExit(f"{path} not found: carry the manifest with the parts")
        return path
    found = sorted(folder.glob("*.manifest.json"))
    if len(found) != 1:
        raise SystemExit(f"{folder}: expected one *.manifest.json, found "
                         f"{[p.name for p in found] or 'none'}; carry it with the parts, or give --name")
    return found[0]


def check_parts(folder: Path, manifest: Dict) -> List[str]:
    """One line per part that is missing, of the wrong size or with the wrong sha256; empty if all are fine."""
    problems = []
    for part in manifest["parts"]:
        path = folder / part["name"]
        if not path.exists():
            problems.append(f"{part['name']}: missing")
        elif path.stat().st_size != part["bytes"]:
            problems.append(f"{part['name']}: {path.stat().st_size} bytes, expected {part['bytes']} "
                            "(incomplete or corrupt transfer)")
        elif sha256_file(path) != part["sha256"]:
            problems.append(f"{part['name']}: sha256 mismatch (corrupt transfer)")
    return problems


def unpack(args) -> None:
    folder = args.parts.resolve()
    mpath = find_manifest(folder, args.name)
    manifest = json.loads(mpath.read_text())
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"{mpath} is not an offline bundle manifest")
    problems = check_parts(folder, manifest)
    n = len(manifest["parts"])
    if problems:
        print(f"[bundle] {n - len(problems)} of {n} parts present and intact; not unpacking:", file=sys.stderr)
        for line in problems:
            print(f"[bundle]   {line}", file=sys.stderr)
        raise SystemExit(1)
    print(f"[bundle] all {n} parts present and intact")
    if args.check:
        return
    for f in manifest["files"]:
        if Path(f["path"]).is_absolute() or ".." in Path(f["path"]).parts:
            raise SystemExit(f"{mpath}: refusing a path outside --dest: {f['path']}")
    dest = args.dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=JoinedReader([folder / p["name"] for p in manifest["parts"]]), mode="r|") as tar:
        if hasattr(tarfile, "data_filter"):          # Pythons without it: the names were checked above
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)
    bad = [f["path"] for f in manifest["files"]
           if not (dest / f["path"]).is_file() or sha256_file(dest / f["path"]) != f["sha256"]]
    if bad:
        raise SystemExit(f"[bundle] restored files that do not match the manifest: {bad}")
    restored = sorted({f["path"].split("/", 1)[0] for f in manifest["files"]} - {"wheels"})
    print(f"[bundle] restored and checked {len(manifest['files'])} files under {dest}: {', '.join(restored) or '-'}")
    wheels = [dest / "wheels" / w for w in manifest["wheels"]]
    if not wheels:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
    site = None
    if not args.into_env:
        site = (args.site or dest / "site-packages").resolve()
        cmd += ["--upgrade", "--target", str(site)]        # --upgrade: a rerun replaces, not skips
    print("[bundle] " + " ".join(cmd + ["<%d wheels>" % len(wheels)]), flush=True)
    subprocess.run(cmd + [str(w) for w in wheels], check=True)
    if site is not None:
        print(f"[bundle] {len(wheels)} wheels installed; use them with:\n"
              f"export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}}")
    else:
        print(f"[bundle] {len(wheels)} wheels installed into {sys.prefix}")


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="gather wheels and files into parts and a manifest")
    p.add_argument("out", type=Path, help="folder for the parts and the manifest")
    p.add_argument("--part-mb", type=float, default=1024, help="size of each part in MiB (the last may be smaller)")
    p.add_argument("--name", default="bundle", help="file name prefix of the parts and manifest")
    p.add_argument("--require", nargs="*", default=[], help="requirement strings to download wheels for")
    p.add_argument("--requirements", type=Path, action="append", default=[], help="a requirements file (repeatable)")
    p.add_argument("--wheel", action="append", default=[], help="a .whl file or a folder of them (repeatable)")
    p.add_argument("--python-version", default="", help="the node's Python, e.g. 3.12 (default: this one's)")
    p.add_argument("--platform", action="append", default=[],
                   help="the node's platform tag, e.g. manylinux_2_28_x86_64 (repeatable; default: this machine's)")
    p.add_argument("--abi", default="", help="e.g. cp312 (default: pip's for --python-version)")
    p.add_argument("--implementation", default="", help="e.g. cp (default: pip's)")
    p.add_argument("--add", action="append", default=[],
                   help="PATH or PATH=NAME: a file or directory restored as DEST/NAME (repeatable)")
    u = sub.add_parser("unpack", help="check the parts, join them, restore the files, install the wheels")
    u.add_argument("--parts", type=Path, default=Path("."), help="folder holding the parts and manifest (default: .)")
    u.add_argument("--name", default=None, help="the bundle's name, if the folder holds several")
    u.add_argument("--dest", type=Path, default=Path("offline"), help="where files are restored (default: ./offline)")
    u.add_argument("--site", type=Path, default=None, help="where wheels are installed (default: DEST/site-packages)")
    u.add_argument("--into-env", action="store_true", help="install the wheels into the current environment instead")
    u.add_argument("--check", action="store_true", help="only report which parts are missing or corrupt")
    args = ap.parse_args(argv)
    pack(args) if args.cmd == "pack" else unpack(args)


if __name__ == "__main__":
    main()
