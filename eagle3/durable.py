"""Writes that survive a kill or a power cut, and a disk-full error a user can act on.

Every file a long job leaves behind (feature shards, checkpoints, exports) is written under a
temporary name, fsynced, and renamed into place; the directory is fsynced so the rename itself is
on disk. A reader therefore sees either the previous complete file or the new complete one.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Optional


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    """Replace the file at `path` with `text` atomically: a reader (on any machine of a shared
    filesystem) sees the old content or the new. The temporary name carries the writer's pid, so
    two processes writing one file never share it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then every directory (deepest first), so a rename of `path`
    publishes only bytes that are on disk."""
    dirs = []
    for root, _, files in os.walk(path):
        dirs.append(root)
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        fsync_dir(Path(d))


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full(path: Path, need: Optional[int], what: str) -> OSError:
    """The ENOSPC error to raise instead of the bare one: names the path, the bytes the write needs
    and the bytes free there, and what was kept."""
    path = Path(path)
    probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    need_s = f"needs {need:,} bytes" if need else "needs more space"
    return OSError(errno.ENOSPC, f"no space left on device writing {path}: {what} {need_s}, "
                                 f"{free:,} bytes free on that filesystem")


def save_safetensors(tensors, path: Path, metadata=None) -> None:
    """safetensors' save_file, made atomic: a kill mid-write leaves the previous file (or none)."""
    from safetensors.torch import save_file
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
