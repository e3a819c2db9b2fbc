"""The batch the drafter and its loss see, whichever source it came from (a feature dataset on disk,
an in-process target, a stream): right-padded samples, moved to the training device without making
the host wait for the GPU."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

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


def collate(items: List[Dict[str, torch.Tensor]], sample_ids: Sequence[str]) -> Batch:
    """Right-pad ds[i] dicts with zeros into a Batch (aux/final keep their stored dtype)."""
    B, T = len(items), max(len(it["input_ids"]) for it in items)
    stored = "teacher_p" in items[0]
    coded = "aux_codes" in items[0]
    ids = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.float32)
    att = torch.zeros(B, T, dtype=torch.bool)
    if coded:                                   # zero scales pad: padded rows decode to zeros
        codes = torch.zeros(B, T, items[0]["aux_codes"].shape[-1], dtype=items[0]["aux_codes"].dtype)
        scale = torch.zeros(B, T, items[0]["aux_scale"].shape[-1], dtype=items[0]["aux_scale"].dtype)
        aux = None
    else:
        aux = torch.zeros(B, T, items[0]["aux"].shape[-1], dtype=items[0]["aux"].dtype)
    final = None if stored else torch.zeros(B, T, items[0]["final"].shape[-1], dtype=items[0]["final"].dtype)
    if stored:
        K = items[0]["teacher_p"].shape[-1]
        teacher = StoredTeacher(torch.zeros(B, T, K, dtype=torch.long), torch.zeros(B, T, K, dtype=torch.float32),
                                torch.zeros(B, T, dtype=torch.float32), torch.zeros(B, T, dtype=torch.long))
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
    return Batch(ids, loss, att, aux, final, list(sample_ids), teacher if stored else None,
                 *((codes, scale) if coded else ()))
