"""The batch the drafter and its loss see, whichever source it came from (a feature dataset on disk,
an in-process target, a stream): right-padded samples, moved to the training device without making
the host wait for the GPU."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from eagle3 import codec
from eagle3.codec import StoredTeacher


@dataclass
class Batch:
    """What the drafter and loss see, whether features came from disk or an in-process target.

    input_ids [B,T] int64, loss_mask [B,T] float32, attention_mask [B,T] bool (True on real
    tokens; right padding), aux [B,T,k*H], final [B,T,H]; from a compact dataset final is None
    and teacher holds the stored teacher instead (eagle3.loss.batch_teacher reads either), and aux
    arrives coded (aux_codes [B,T,k*H/2], aux_scale [B,T,k*H/G]; aux None) until `to` decodes it.
    """
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    aux: Optional[torch.Tensor]
    final: Optional[torch.Tensor]
    sample_ids: List[str]
    teacher: Optional[StoredTeacher] = None
    aux_codes: Optional[torch.Tensor] = None
    aux_scale: Optional[torch.Tensor] = None

    def to(self, device, dtype: Optional[torch.dtype] = None) -> "Batch":
        """Move to device (see to_device); aux/final also to dtype (the masks and the stored teacher
        keep theirs). Coded aux is copied as codes and decoded there."""
        aux = (to_device(self.aux, device, dtype) if self.aux is not None else
               codec.dequantize_aux(to_device(self.aux_codes, device), to_device(self.aux_scale, device)).to(dtype))
        return Batch(to_device(self.input_ids, device), to_device(self.loss_mask, device),
                     to_device(self.attention_mask, device), aux,
                     None if self.final is None else to_device(self.final, device, dtype),
                     list(self.sample_ids), None if self.teacher is None else self.teacher.to(device, to_device))


def to_device(t: torch.Tensor, device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """t on device (and in dtype, converted there). From host memory to a GPU the copy goes through
    pinned memory and does not wait: a copy from pageable memory waits until the GPU has run all the
    work queued before it, and the GPU then idles while the host prepares the next batch."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    return t.to(device, dtype)


def collate(items: List[Dict[str, torch.Tensor]], sample_ids: Sequence[str], pin: bool = False) -> Batch:
    """Right-pad ds[i] dicts with zeros into a Batch (aux/final keep their stored dtype). pin: in pinned
    host memory, so the copy to a GPU reads it as it is (to_device pins nothing twice). The wide
    tensors are not zero-filled whole: each row's padding is zeroed after its tokens are written."""
    B, T = len(items), max(len(it["input_ids"]) for it in items)
    stored = "teacher_p" in items[0]
    coded = "aux_codes" in items[0]

    def blank(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, pin_memory=pin)

    ids = torch.zeros(B, T, dtype=torch.long, pin_memory=pin)
    loss = torch.zeros(B, T, dtype=torch.float32, pin_memory=pin)
    att = torch.zeros(B, T, dtype=torch.bool, pin_memory=pin)
    wide = []                                   # [B, T, ...] tensors, row tails zeroed below
    if coded:                                   # zero scales pad: padded rows decode to zeros
        codes = blank(B, T, items[0]["aux_codes"].shape[-1], dtype=items[0]["aux_codes"].dtype)
        scale = blank(B, T, items[0]["aux_scale"].shape[-1], dtype=items[0]["aux_scale"].dtype)
        aux = None
        wide += [codes, scale]
    else:
        aux = blank(B, T, items[0]["aux"].shape[-1], dtype=items[0]["aux"].dtype)
        wide.append(aux)
    final = None if stored else blank(B, T, items[0]["final"].shape[-1], dtype=items[0]["final"].dtype)
    if stored:
        K = items[0]["teacher_p"].shape[-1]
        teacher = StoredTeacher(blank(B, T, K, dtype=torch.long), blank(B, T, K, dtype=torch.float32),
                                blank(B, T, dtype=torch.float32), blank(B, T, dtype=torch.long))
        wide += [teacher.ids, teacher.p, teacher.mass, teacher.top]
    else:
        wide.append(final)
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        ids[b, :n] = it["input_ids"]
        loss[b, :n] = it["loss_mask"]
        att[b, :n] = True
        if coded:
            codes[b, :n], scale[b, :n] = it["aux_codes"], it["aux_scale"]
        else:
            aux[b, :n] = it["aux"]
        if stored:
            teacher.ids[b, :n], teacher.p[b, :n] = it["teacher_ids"], it["teacher_p"]
            teacher.mass[b, :n], teacher.top[b, :n] = it["teacher_mass"], it["teacher_top"]
        else:
            final[b, :n] = it["final"]
        for t in wide:
            t[b, n:] = 0
    return Batch(ids, loss, att, aux, final, list(sample_ids), teacher if stored else None,
                 *((codes, scale) if coded else ()))


class Prefetch:
    """A step's host-side batches, built on a worker thread while the GPU runs the step before.

    `get(step, then)` returns build(step) (already built when it was the `then` of the call before)
    and starts building `then`. Building a batch from a feature dataset is host work (reading the
    shards, padding, pinning) that would otherwise leave the GPU idle at the start of every step.
    The batches are the ones build gives either way, in the same order; disabled, it builds in line.
    Only the worker calls build while a step is pending: `settle()` waits for it before anyone else
    reads the same source (the held-out evaluation)."""

    def __init__(self, build: Callable[[int], list], enabled: bool):
        self.build = build
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if enabled else None
        self.pending: Optional[Tuple[int, Future]] = None     # (step, its batches being built)

    def get(self, step: int, then: Optional[int] = None) -> list:
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == step:
            out = pending[1].result()
        else:
            if pending is not None:
                pending[1].exception()             # another step: let the worker finish before building here
            out = self.build(step)
        if self.pool is not None and then is not None:
            self.pending = (then, self.pool.submit(self.build, then))
        return out

    def settle(self) -> None:
        if self.pending is not None:
            self.pending[1].exception()            # waits; an error surfaces when its step is asked for

    def close(self) -> None:
        if self.pool is not None:
            self.settle()
            self.pool.shutdown()
