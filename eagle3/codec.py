"""The compact feature format (`capture.format=compact`): aux in 4 bits, the teacher as the loss reads it.

Per token, for H hidden, k aux states, G = GROUP_SIZE, K = teacher top-k, Vd the draft vocab:

    aux_codes    [k*H/2] uint8   4-bit NF4 codes, two a byte (even element in the low nibble)
    aux_scale    [k*H/G] bf16    per group of G consecutive values: the group's largest magnitude,
                                 rounded up to bf16, so code c means LEVELS[c] * scale
    teacher_ids  [K] int16       draft ids of the K most probable draft tokens (int32 when Vd > 32768)
    teacher_p    [K] fp16        their probabilities under the target's softmax over the draft vocab
    teacher_mass []  fp32        c: the target's full-vocab probability mass on the draft vocab
    teacher_top  []  int32       the target's full-vocab argmax

The teacher replaces `final` [H]: it is what eagle3/loss.py computes from final and the target's
lm_head, so it depends on the draft vocab, which is fixed at capture (capture_vocab: the top-Vd
assistant tokens of the training split, the same rule as train.py's) and stored with the dataset.
Training spreads the K probabilities over the draft vocab and renormalises them (eagle3.loss.dense_teacher).
docs/perf.md has the measurements behind the levels, G and the default K.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from eagle3.vocab import DraftVocab, build_vocab, count_tokens

NAME = "compact"
VERSION = 1
GROUP_SIZE = 16
# NF4 (QLoRA's 4-bit NormalFloat): 16 levels over [-1, 1] at normal quantiles, 0.0 exact. On real
# hidden states it beats evenly spaced int4 levels at every group size (docs/perf.md has the table
# behind the levels and G).
LEVELS = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])
INT4 = torch.arange(-7, 8) / 7.0           # 15 evenly spaced levels, 0.0 exact: bench/feature_bytes.py's comparison
CODE = "nf4"


@dataclass
class FeatureFormat:
    """What a capture is asked to store: `capture.format` and its parameters (eagle3/config.py)."""
    name: str = "full"                 # full: aux + final (eagle3/features.py) | compact: this module
    teacher_topk: int = 32
    draft_vocab_size: int = 32000


@dataclass
class Compact:
    """A compact capture's settings: the draft vocab the teacher is over, K, and the target's lm_head
    [V, H] the teacher is computed with (capture only; reading needs none)."""
    vocab: DraftVocab
    topk: int
    lm_head: Optional[torch.Tensor] = None

    def params(self) -> Dict:
        """The manifest's feature_format record (and what a resumed capture must agree with)."""
        return {"name": NAME, "version": VERSION,
                "aux": {"code": CODE, "group_size": GROUP_SIZE, "scale": "bfloat16"},
                "teacher": {"topk": self.topk, "ids": ids_dtype(self.vocab.size), "p": "float16",
                            "draft_vocab_size": self.vocab.size, "vocab_size": self.vocab.vocab_size,
                            "draft_vocab_sha256": vocab_sha256(self.vocab)}}


def size_params(vocab_size: int, draft_vocab_size: int, topk: int) -> Dict:
    """The part of Compact.params() that a compact shard's size depends on, known before the capture's
    draft vocab is counted: what a stream reserves for each shard it has yet to write."""
    vd = min(draft_vocab_size, vocab_size)
    return {"aux": {"code": CODE, "group_size": GROUP_SIZE, "scale": "bfloat16"},
            "teacher": {"topk": min(topk, vd), "ids": ids_dtype(vd), "draft_vocab_size": vd}}


def ids_dtype(draft_vocab_size: int) -> str:
    return "int16" if draft_vocab_size <= 1 << 15 else "int32"


def vocab_sha256(vocab: DraftVocab) -> str:
    """Identifies a draft vocab by its target ids (d2t), whatever device or counts it carries."""
    return hashlib.sha256(vocab.d2t.to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()


def capture_vocab(samples: Sequence, heldout_ids: Sequence[str], vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """The draft vocab of a capture: the top-Vd assistant tokens of its training samples (objects
    with .id, .input_ids, .loss_mask), exactly what train.py's draft_vocab builds from the dataset."""
    held = set(map(str, heldout_ids))
    train = [s for s in samples if str(s.id) not in held]
    counts = count_tokens([torch.as_tensor(s.input_ids) for s in train],
                          [torch.as_tensor(s.loss_mask) for s in train], vocab_size)
    return build_vocab(counts, min(draft_vocab_size, vocab_size))


def compact_for(fmt: Optional[FeatureFormat], samples: Sequence, heldout_ids: Sequence[str],
                lm_head: torch.Tensor) -> Optional[Compact]:
    """The Compact of a capture asked for `fmt` (None for the full format): the draft vocab of its
    training samples and the target's lm_head [V, H], on the device the encoding should run on."""
    if fmt is None or fmt.name == "full":
        return None
    if fmt.name != NAME:
        raise ValueError(f"capture.format={fmt.name!r}: expected 'full' or {NAME!r}")
    vocab = capture_vocab(samples, heldout_ids, lm_head.shape[0], fmt.draft_vocab_size)
    return Compact(vocab, min(fmt.teacher_topk, vocab.size), lm_head)


_ST = {torch.uint8: "U8", torch.bfloat16: "BF16", torch.int16: "I16", torch.int32: "I32",
       torch.float16: "F16", torch.float32: "F32"}


def column_dtypes(params: Dict) -> Dict[str, torch.dtype]:
    """name -> storage dtype of the compact columns (params: Compact.params(), a manifest's feature_format)."""
    return {"aux_codes": torch.uint8, "aux_scale": torch.bfloat16,
            "teacher_ids": getattr(torch, params["teacher"]["ids"]), "teacher_p": torch.float16,
            "teacher_mass": torch.float32, "teacher_top": torch.int32}


def column_specs(num_aux: int, hidden: int, params: Dict) -> Dict[str, tuple]:
    """name -> (safetensors dtype, per-token shape) of the compact columns."""
    kH = num_aux * hidden
    if hidden % GROUP_SIZE or params["aux"]["group_size"] != GROUP_SIZE:   # a group never spans two states
        raise ValueError(f"the compact format needs the hidden size ({hidden}) divisible by its group size "
                         f"{GROUP_SIZE}")
    topk = params["teacher"]["topk"]
    shapes = {"aux_codes": [kH // 2], "aux_scale": [kH // GROUP_SIZE], "teacher_ids": [topk], "teacher_p": [topk],
              "teacher_mass": [], "teacher_top": []}
    return {name: (_ST[dt], shapes[name]) for name, dt in column_dtypes(params).items()}


# ----------------------------------------------------------------------------- aux

def _round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """x >= 0 (fp32) -> the smallest bf16 >= x, so |value| / scale never exceeds 1."""
    s = x.to(torch.bfloat16)
    below = s.float() < x
    return (s.view(torch.int16) + below.to(torch.int16)).view(torch.bfloat16)


def quantize_aux(aux: torch.Tensor, levels: torch.Tensor = LEVELS, group: int = GROUP_SIZE) -> tuple:
    """aux [..., n] (n a multiple of the group) -> (codes [..., n/2] uint8, scale [..., n/G] bf16).
    Each value gets the code of its nearest level (levels ascending) after dividing by its group's scale; on the
    device aux is on. (levels and group are parameters for bench/feature_bytes.py's comparison.)"""
    x = aux.detach().float()
    g = x.view(*x.shape[:-1], -1, group)
    scale = _round_up_bf16(g.abs().amax(-1))
    y = g / scale.float().clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    lv = levels.to(x.device)                                           # ascending
    codes = torch.bucketize(y, (lv[1:] + lv[:-1]) / 2, out_int32=True).to(torch.uint8).view(*x.shape[:-1], -1, 2)
    return codes[..., 0] | (codes[..., 1] << 4), scale


def dequantize_aux(codes: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor = LEVELS) -> torch.Tensor:
    """(codes [..., n/2] uint8, scale [..., n/G] bf16) -> bf16 [..., n]."""
    lv = levels.to(codes.device)
    pair = torch.stack([codes & 15, codes >> 4], -1).long()                # [..., n/2, 2]
    vals = lv[pair].view(*scale.shape, -1)
    return (vals * scale.float()[..., None]).view(*codes.shape[:-1], -1).to(torch.bfloat16)


# ----------------------------------------------------------------------------- teacher

@torch.no_grad()
def encode_teacher(final: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, topk: int,
                   chunk_rows: int = 2048) -> Dict[str, torch.Tensor]:
    """final [..., H] -> teacher_ids [..., K], teacher_p [..., K] fp16, teacher_mass [...] fp32,
    teacher_top [...] int32: eagle3.loss's teacher (softmax over the draft columns, full-vocab
    argmax) and c, computed with the same functions, kept to the top K."""
    from eagle3.loss import draft_mass, target_teacher

    rows = final.reshape(-1, final.shape[-1])
    draft_ids = draft_ids.to(final.device)
    k = min(topk, draft_ids.numel())
    parts = {n: [] for n in ("teacher_ids", "teacher_p", "teacher_mass", "teacher_top")}
    for i in range(0, rows.shape[0], chunk_rows):
        r = rows[i:i + chunk_rows][None]
        p, top = target_teacher(r, lm_head, draft_ids)
        pk, ik = p[0].topk(k, -1)
        parts["teacher_ids"].append(ik.to(getattr(torch, ids_dtype(draft_ids.numel()))))
        parts["teacher_p"].append(pk.to(torch.float16))
        parts["teacher_mass"].append(draft_mass(r, lm_head, draft_ids)[0].float())
        parts["teacher_top"].append(top[0].to(torch.int32))
    lead = final.shape[:-1]
    return {n: (torch.cat(v) if v else torch.zeros(0)).view(*lead, *([k] if n in ("teacher_ids", "teacher_p") else []))
            for n, v in parts.items()}


def encode(fmt: Compact, aux: torch.Tensor, final: torch.Tensor) -> Dict[str, torch.Tensor]:
    """aux [..., k*H], final [..., H] -> the compact columns (column_specs), computed on the lm_head's device."""
    dev = fmt.lm_head.device
    codes, scale = quantize_aux(aux.to(dev))
    return {"aux_codes": codes, "aux_scale": scale,
            **encode_teacher(final.to(dev), fmt.lm_head, fmt.vocab.draft_ids.to(dev), fmt.topk)}


@dataclass
class StoredTeacher:
    """A compact dataset's teacher for a batch: ids [B, T, K] int64, p [B, T, K] fp32,
    mass [B, T] fp32, top [B, T] int64 (padding rows hold zeros)."""
    ids: torch.Tensor
    p: torch.Tensor
    mass: torch.Tensor
    top: torch.Tensor

    def to(self, device, move=None) -> "StoredTeacher":
        """move(tensor, device): how each tensor travels (default: Tensor.to)."""
        move = move or (lambda t, d: t.to(d))
        return StoredTeacher(*(move(t, device) for t in (self.ids, self.p, self.mass, self.top)))


def bytes_per_token(hidden: int, num_aux: int, draft_vocab_size: int, topk: int) -> int:
    """Bytes a compact dataset stores per token, input_ids and loss_mask included."""
    kH = num_aux * hidden
    ids = 2 if ids_dtype(draft_vocab_size) == "int16" else 4
    return kH // 2 + 2 * (kH // GROUP_SIZE) + topk * (ids + 2) + 4 + 4 + 4 + 1
