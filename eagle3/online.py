"""Online training data: the target runs in the training process and computes aux/final per batch
with the same hooks as the hf capture backend (eagle3/hidden.py); nothing touches disk."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from eagle3.config import CaptureConfig, DataConfig, TargetConfig
from eagle3.data import load_samples
from eagle3.batch import Batch
from eagle3.hidden import capture_batch, pad_right
from eagle3.targets import load_target_model


class OnlineSource:
    """samples = train + held-out (train first); batch(indices) -> the same Batch a feature dataset gives."""

    def __init__(self, target_dir: Path, target: TargetConfig, data: DataConfig, capture: CaptureConfig,
                 aux_layers: Sequence[int],
                 device, dtype: torch.dtype):
        self.tokenizer, self.train, self.heldout = load_samples(target_dir, target, data, capture)
        self.samples = self.train + self.heldout
        self.model = load_target_model(target_dir, dtype, str(device), target.trust_remote_code)
        self.aux_layers, self.device = list(aux_layers), device

    def tokens(self, i: int):
        s = self.samples[i]
        return torch.tensor(s.input_ids), torch.tensor(s.loss_mask)

    def batch(self, indices: Sequence[int]) -> Batch:
        picked = [self.samples[i] for i in indices]
        input_ids, att = pad_right([s.input_ids for s in picked], self.device)
        loss_mask, _ = pad_right([s.loss_mask for s in picked], self.device)
        return capture_batch(self.model, input_ids, att, loss_mask, self.aux_layers, [s.id for s in picked])
