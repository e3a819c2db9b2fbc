"""The SGLang capture plugin's bookkeeping: a forward pass's rows cut into per-request pieces, and
pieces assembled into whole prompts (chunked prefill, re-prefills, decode rows, radix-cache hits).

Plain functions on tensors and lists, no SGLang: capture/sglang_plugin.py calls them on the
writer thread, and tests drive them directly and through ForwardBatch.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

_FINISHED_MEMORY = 1 << 18  # rids remembered as written/refused (dedupe of re-prefills)


@dataclass
class Piece:
    """One request's rows from one forward pass."""
    rid: str
    start: int               # prompt position of the first row (= the extend's prefix length)
    total: int               # whole prompt length (orig_seq_lens)
    aux: List[torch.Tensor]  # k x [n, H]
    final: torch.Tensor      # [n, H]


def split_rows(rids: Sequence[str], prefix_lens: Sequence[int], extend_lens: Sequence[int],
               total_lens: Sequence[int], aux: Sequence[torch.Tensor],
               final: torch.Tensor) -> List[Piece]:
    """Cut a pass's rows [N, H] into per-request pieces; rows are laid out request after request.

    Lists may be longer than `rids` (DP padding): entries past len(rids) are padding, and so are
    rows past the real requests' rows.
    """
    n_req = len(rids)
    if min(len(prefix_lens), len(extend_lens), len(total_lens)) < n_req:
        raise ValueError(f"{n_req} rids but {len(prefix_lens)} prefix lens, {len(extend_lens)} "
                         f"extend lens, {len(total_lens)} prompt lens")
    n_rows = sum(int(x) for x in extend_lens[:n_req])
    for t in (final, *aux):
        if t.shape[0] < n_rows:
            raise ValueError(f"{t.shape[0]} rows for {n_rows} extend tokens: rows are sharded "
                             "(LayerNorm SP or attention CP?); capture needs every row on one rank")
    pieces, row = [], 0
    for i in range(n_req):
        n = int(extend_lens[i])
        pieces.append(Piece(rid=str(rids[i]), start=int(prefix_lens[i]), total=int(total_lens[i]),
                            aux=[a[row:row + n] for a in aux], final=final[row:row + n]))
        row += n
    return pieces


def unpack_aux(aux_hidden_states, hidden_size: int) -> List[torch.Tensor]:
    """SGLang passes a list of k [N, H] tensors or one packed [N, k*H]; return the list."""
    if isinstance(aux_hidden_states, torch.Tensor):
        width = aux_hidden_states.shape[-1]
        if width % hidden_size:
            raise ValueError(f"packed aux width {width} is not a multiple of hidden size {hidden_size}")
        return list(aux_hidden_states.split(hidden_size, dim=-1))
    return list(aux_hidden_states)


@dataclass
class _Partial:
    next_pos: int
    total: int
    aux: List[List[torch.Tensor]]
    final: List[torch.Tensor]


@dataclass
class AssemblyState:
    """What the writer knows between passes: prompts still arriving in chunks, and rids done."""
    pending: Dict[str, _Partial] = field(default_factory=dict)
    finished: "OrderedDict[str, str]" = field(default_factory=OrderedDict)  # rid -> written|refused


@dataclass
class Outcome:
    kind: str   # complete | pending | duplicate | ignored | error
    rid: str
    aux: Optional[List[torch.Tensor]] = None   # complete: k x [T, H]
    final: Optional[torch.Tensor] = None       # complete: [T, H]
    message: str = ""


def _finish(state: AssemblyState, rid: str, how: str) -> None:
    state.pending.pop(rid, None)
    state.finished[rid] = how
    state.finished.move_to_end(rid)
    while len(state.finished) > _FINISHED_MEMORY:
        state.finished.popitem(last=False)


def assemble(state: AssemblyState, piece: Piece) -> Outcome:
    """Add one piece; a request is complete when its rows cover positions [0, total).

    - start 0 for a rid already written or refused: SGLang prefilled it again (a retracted
      request comes back under the same rid with its output appended): duplicate, not rewritten.
      Hence clients send each attempt of a prompt under a fresh rid (capture/sglang_client.py).
    - start > 0 for such a rid: a decode row (MIXED batch, or DP's decode-as-extend): ignored.
    - start > 0 with no earlier rows: its prefix came from the radix cache (or earlier chunks were
      missed), so rows 0..start are unknowable here: refused with an error.
    """
    rid = piece.rid
    if rid in state.finished:
        kind = "duplicate" if piece.start == 0 else "ignored"
        return Outcome(kind, rid, message=f"request {rid} already {state.finished[rid]}")
    part = state.pending.get(rid)
    if piece.start == 0:
        # A new prompt, or one restarted from 0 (retracted mid-prefill): rows so far are void.
        part = _Partial(0, piece.total, [[] for _ in piece.aux], [])
        state.pending[rid] = part
    elif part is None or part.next_pos != piece.start or part.total != piece.total:
        _finish(state, rid, "refused")
        have = "no earlier rows" if part is None else f"rows up to {part.next_pos} of {part.total}"
        return Outcome("error", rid, message=(
            f"request {rid}: prefill starts at position {piece.start} (prompt length {piece.total}) "
            f"but the plugin holds {have}. Its prefix was served from the radix cache or an "
            "earlier chunk was missed; run the capture server with --disable-radix-cache and send "
            "each prompt once. Request not written."))
    for lst, a in zip(part.aux, piece.aux):
        lst.append(a)
    part.final.append(piece.final)
    part.next_pos += piece.final.shape[0]
    if part.next_pos < part.total:
        # Own the chunk: a view would hold its whole (pinned) pass alive until the prompt ends.
        part.final[-1] = part.final[-1].clone()
        part.aux = [lst[:-1] + [lst[-1].clone()] for lst in part.aux]
        return Outcome("pending", rid)
    if part.next_pos > part.total:
        _finish(state, rid, "refused")
        return Outcome("error", rid, message=(
            f"request {rid}: {part.next_pos} rows for a prompt of {part.total} tokens"))
    _finish(state, rid, "written")
    if len(part.final) == 1:   # one pass: hand on the views, write_request copies them once
        return Outcome("complete", rid, aux=[lst[0] for lst in part.aux], final=part.final[0])
    return Outcome("complete", rid, aux=[torch.cat(lst) for lst in part.aux],
                   final=torch.cat(part.final))
