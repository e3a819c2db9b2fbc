"""The bytes of one feature shard: a safetensors file written by hand at fixed positions.

eagle3/features.py owns the dataset (plan, manifest, reader), eagle3/feature_writer.py its writing;
this module owns what one shard holds and where: the storage dtypes, the layout (tensors in
descending element size, so each can be viewed straight out of a memory map), the header, the
positioned writes, fp8 aux with its row scales, the compact format's columns (eagle3/codec.py), and
the checks of a shard's header against its manifest record.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from eagle3 import codec
from eagle3.durable import disk_full, fsync_dir, is_disk_full

FORMAT = "eagle3-features"
FORMAT_VERSION = 1

# storage dtype name -> (torch dtype, safetensors dtype, numpy dtype the bytes are viewed as)
FLOAT_DTYPES = {
    "bfloat16": (torch.bfloat16, "BF16", np.int16),
    "float16": (torch.float16, "F16", np.float16),
    "float32": (torch.float32, "F32", np.float32),
}
FP8 = "float8_e4m3fn"                        # aux only, scaled per row and aux state
AUX_DTYPES = dict(FLOAT_DTYPES, **{FP8: (torch.float8_e4m3fn, "F8_E4M3", np.uint8)})
E4M3_MAX = 448.0
_NP = {"BF16": np.int16, "F16": np.float16, "F32": np.float32, "F8_E4M3": np.uint8,
       "I64": np.int64, "I32": np.int32, "I16": np.int16, "U8": np.uint8}


class FeatureDatasetError(Exception):
    """A feature dataset on disk is missing, truncated, malformed or not the one expected."""


# ----------------------------------------------------------------------------- shard layout

# Tensors sit in descending element size (ties in this order), so each starts aligned to its size.
_ORDER = ("offsets", "input_ids", "aux_scale", "aux", "final", "teacher_mass", "teacher_top", "teacher_ids",
          "teacher_p", "aux_codes", "loss_mask")


def layout(num_samples: int, num_tokens: int, num_aux: int, hidden: int, float_st: str,
           aux_st: Optional[str] = None, compact: Optional[Dict[str, Any]] = None):
    """Header dict and total byte-buffer size of a shard with these sizes (deterministic).
    float_st: final's safetensors dtype (and aux's unless aux_st says otherwise); compact: the
    manifest's feature_format record of a compact dataset (eagle3/codec.py), whose columns replace
    aux and final."""
    aux_st = aux_st or float_st
    cols = {"offsets": ("I64", [num_samples + 1]), "input_ids": ("I32", [num_tokens]),
            "loss_mask": ("U8", [num_tokens])}
    if compact is not None:
        cols.update({n: (st, [num_tokens] + shape)
                     for n, (st, shape) in codec.column_specs(num_aux, hidden, compact).items()})
    else:
        cols.update(aux=(aux_st, [num_tokens, num_aux * hidden]), final=(float_st, [num_tokens, hidden]))
        if aux_st == "F8_E4M3":
            cols["aux_scale"] = ("F32", [num_tokens, num_aux])
    order = sorted(cols, key=lambda n: (-np.dtype(_NP[cols[n][0]]).itemsize, _ORDER.index(n)))
    header: Dict[str, Any] = {"__metadata__": {"format": FORMAT, "format_version": str(FORMAT_VERSION)}}
    pos = 0
    for name in order:
        st, shape = cols[name]
        nbytes = int(np.prod(shape)) * np.dtype(_NP[st]).itemsize
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    return header, pos


def header_bytes(header: Dict[str, Any]) -> bytes:
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)        # data starts 8-aligned, as safetensors pads it
    return struct.pack("<Q", len(raw)) + raw


def read_header(path: Path, size: int):
    """(header dict, data start) of a shard; FeatureDatasetError naming the file on any problem."""
    if size < 8:
        raise FeatureDatasetError(f"{path.name}: truncated: {size} bytes, no header")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size:
            raise FeatureDatasetError(f"{path.name}: truncated: {size} bytes, header length says {8 + n}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FeatureDatasetError(f"{path.name}: header does not parse: {e}") from None
    return header, 8 + n


def write_all(fd: int, data: np.ndarray, offset: int) -> None:
    buf = memoryview(np.ascontiguousarray(data)).cast("B")
    while len(buf):                                  # pwrite may write less than asked (>2 GiB)
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def np_bytes(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    t = t.detach().to("cpu", dtype).contiguous()
    if dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()               # numpy has no bf16 / fp8: their bits
    return t.view(torch.uint8).numpy() if dtype == torch.float8_e4m3fn else t.numpy()


def quantize_fp8(aux: torch.Tensor, num_aux: int) -> tuple:
    """aux [T, k*H] -> (fp8 e4m3 [T, k*H], scale [T, k] fp32): each row of each aux state divided by
    its largest magnitude / 448, so it spans e4m3's range. dequantize_fp8 is the inverse."""
    x = aux.detach().float().cpu()
    x = x.view(x.shape[0], num_aux, -1)
    scale = (x.abs().amax(-1) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale[..., None]).to(torch.float8_e4m3fn).view(x.shape[0], -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(fp8 [T, k*H], scale [T, k]) -> bf16 [T, k*H]."""
    T, k = scale.shape
    return (q.float().view(T, k, -1) * scale[..., None]).view(T, -1).to(torch.bfloat16)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


class OpenShard:
    """A shard being filled: a preallocated temp file written at fixed positions."""

    def __init__(self, path: Path, lengths: List[int], num_aux: int, hidden: int, float_st: str,
                 aux_st: str, compact: Optional[Dict[str, Any]] = None):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)   # [S+1]
        self.starts, self.pending, self.loss_tokens = starts, set(range(len(lengths))), 0
        header, size = layout(len(lengths), int(starts[-1]), num_aux, hidden, float_st, aux_st, compact)
        head = header_bytes(header)
        self.base, self.size = len(head), len(head) + size
        self.off = {k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self.fd, self.size)
            write_all(self.fd, np.frombuffer(head, np.uint8), 0)
            write_all(self.fd, starts, self.base + self.off["offsets"])
        except OSError as e:
            self._fail(e)

    def write(self, j: int, parts: Dict[str, np.ndarray]) -> None:
        row = int(self.starts[j])
        try:
            for name, arr in parts.items():
                row_bytes = arr.nbytes // arr.shape[0]
                write_all(self.fd, arr, self.base + self.off[name] + row * row_bytes)
        except OSError as e:
            self._fail(e)
        self.pending.discard(j)
        self.loss_tokens += int(parts["loss_mask"].sum())

    def _fail(self, e: OSError):
        """A failed write leaves no temp file behind (the shard is rewritten whole by the rerun);
        a full disk is named with the shard's size."""
        os.close(self.fd)
        self.tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise disk_full(self.tmp, self.size, "a feature shard") from e
        raise e

    def commit(self) -> tuple:
        """fsync, hash, rename into place: (size in bytes, sha256 of the file's bytes)."""
        try:
            os.fsync(self.fd)
        except OSError as e:
            self._fail(e)
        digest = file_sha256(self.tmp)
        os.close(self.fd)
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return self.size, digest


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def check_sha256(path: Path, data, rec: Dict[str, Any]) -> None:
    """data: the whole file's bytes (a memory map). Datasets written before shards carried a
    checksum have none in their records and are read unchecked."""
    want = rec.get("sha256")
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        raise FeatureDatasetError(f"{path.name}: its bytes do not match the sha256 the manifest recorded when it "
                                  f"was written (a flipped bit or an overwrite); recapture the dataset or replace "
                                  f"{path}")


def check_shard(path: Path, rec: Dict[str, Any], manifest: Dict[str, Any]):
    """Header checks of one shard against the manifest. Returns (header, data start)."""
    size = path.stat().st_size
    header, start = read_header(path, size)
    want, body = manifest_layout(rec, manifest)
    for name in [n for n in want if n != "__metadata__"]:
        got = header.get(name)
        if got is None:
            raise FeatureDatasetError(f"{path.name}: tensor {name!r} missing")
        for key in ("dtype", "shape"):
            if got.get(key) != want[name][key]:
                raise FeatureDatasetError(f"{path.name}: {name} {key} is {got.get(key)}, "
                                          f"manifest says {want[name][key]}")
        if got.get("data_offsets") != want[name]["data_offsets"]:
            raise FeatureDatasetError(f"{path.name}: {name} data_offsets {got.get('data_offsets')} "
                                      f"are not contiguous (expected {want[name]['data_offsets']})")
    if size != start + body:
        raise FeatureDatasetError(f"{path.name}: truncated: {size} bytes, header says {start + body}"
                                  if size < start + body else
                                  f"{path.name}: {size} bytes, header says {start + body}")
    if size != rec["num_bytes"]:
        raise FeatureDatasetError(f"{path.name}: {size} bytes, manifest says {rec['num_bytes']}")
    return header, start


def manifest_layout(rec: Dict[str, Any], manifest: Dict[str, Any]):
    """layout() of the shard `rec` of a dataset with this manifest (full or compact)."""
    fmt = manifest.get("feature_format")
    if fmt is not None and fmt["name"] == codec.NAME:
        return layout(rec["num_samples"], rec["num_tokens"], manifest["num_aux"], manifest["hidden_size"],
                      "BF16", compact=fmt)
    dtypes = manifest["dtypes"]
    return layout(rec["num_samples"], rec["num_tokens"], manifest["num_aux"], manifest["hidden_size"],
                  FLOAT_DTYPES[dtypes["final"]][1], AUX_DTYPES[dtypes["aux"]][1])


def tensor_views(data: np.ndarray, header: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Every tensor of a shard as a view of `data` (the bytes after the header, e.g. a memory map):
    no copies. numpy has no bf16 or fp8, so those are viewed as their bits, then retyped."""
    out = {}
    for name in [n for n in header if n != "__metadata__"]:
        h = header[name]
        a, b = h["data_offsets"]
        t = torch.from_numpy(data[a:b].view(_NP[h["dtype"]]).reshape(h["shape"]))
        if h["dtype"] == "BF16":
            t = t.view(torch.bfloat16)
        elif h["dtype"] == "F8_E4M3":
            t = t.view(torch.float8_e4m3fn)
        out[name] = t
    return out
