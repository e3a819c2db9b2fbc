"""SGLang server plugin: spool the target's aux and final hidden states of every prompt prefill.

SGLang loads it itself: pyproject declares the entry point `eagle3_capture =
"capture.sglang_plugin:register"` in group `sglang.srt.plugins`, and SGLang's `load_plugins()`
calls `register()` in every server process before the model is built. Start a capture server with
capture/sglang_server.py's `capture_server_cmd` and EAGLE3_SPOOL_DIR set; without that variable
this module registers nothing.

What it writes (docs/design.md, "Spool format"): one `req_<rid>/` per request with `aux_0.pt ..
aux_{k-1}.pt` and `final.pt` (bf16 [T, H], T = whole prompt), `meta.json`, then an empty `done`.
`final` is the `hidden_states` argument of LogitsProcessor.forward: the post-norm state the LM
head consumes. Failures never reach the serving path: they go to the log and to
`req_<rid>/error.txt` (or `<spool>/errors.txt` when no request can be named). A rid is captured
once per server process: a client sends every attempt of a prompt under a fresh rid.

Written for SGLang 0.5.23 and checked against its source:
- `LogitsProcessor.forward(self, input_ids, hidden_states, lm_head, logits_metadata,
  aux_hidden_states=None, hidden_states_before_norm=None)`; aux states arrive as a list of k
  [N, H] tensors (Llama) or one packed [N, k*H] tensor (DeepSeek/Kimi, AuxHiddenStatePacker).
- ForwardBatch carries `rids`, `extend_prefix_lens_cpu`, `extend_seq_lens_cpu` (host lists) and
  `orig_seq_lens` (device, = max(extend_end, len(origin_input_ids)): the whole prompt length).
- MIXED batches append running decode rows as 1-token extends at prefix seq_len-1; under DP
  attention a decode batch may be relabelled EXTEND the same way (convert_decode_to_extend), and
  token rows may be padded past sum(extend lens). Decode rows belong to requests already written.
- Ranks: `get_parallel().attn_tp_rank` / `attn_cp_rank` (0 on exactly one rank per DP group).
"""
from __future__ import annotations

import atexit
import functools
import inspect
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from capture.sglang_assembly import AssemblyState, Outcome, assemble, split_rows, unpack_aux

logger = logging.getLogger("eagle3.capture.sglang_plugin")

SPOOL_ENV = "EAGLE3_SPOOL_DIR"          # the spool directory; unset = plugin inert
AUX_LAYERS_ENV = "EAGLE3_AUX_LAYERS"    # "3,31,59": this project's aux_layers, recorded in meta.json
SGLANG_VERSION = "0.5.23"
HOOK_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
# Bounds on host memory: passes waiting to be assembled, and completed requests waiting for a
# writer thread. Beyond them serving waits for the spool (backpressure instead of host OOM).
_QUEUE_PASSES = 4
_WRITES_IN_FLIGHT = 16
# torch.save releases the GIL while it writes, so a few writer threads fill tmpfs several times
# faster than one. A Kimi token is 4 x 7168 bf16 = 57 KB of spool.
_WRITER_THREADS = 4
_RID_RE = re.compile(r"[A-Za-z0-9_.:=+-]{1,200}")


# ----------------------------------------------------------------------------------------------
# Spool writing (background thread).

def safe_rid(rid: str) -> bool:
    """A rid becomes a directory name: no separators, no leading dot."""
    return bool(_RID_RE.fullmatch(rid)) and not rid.startswith(".")


def write_request(spool: Path, rid: str, aux: Sequence[torch.Tensor], final: torch.Tensor,
                  aux_layers: Optional[List[int]], engine_layer_ids: Optional[List[int]]) -> Path:
    """Write req_<rid>/ under a temporary name, rename it into place, then write `done` last."""
    out = spool / f"req_{rid}"
    if (out / "done").exists():
        return out   # a previous server process already wrote it
    tmp = spool / f".tmp_req_{rid}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for i, a in enumerate(aux):
        torch.save(_own(a), tmp / f"aux_{i}.pt")
    torch.save(_own(final), tmp / "final.pt")
    meta = {"rid": rid, "num_tokens": int(final.shape[0]), "hidden_size": int(final.shape[1]),
            "aux_layers": aux_layers, "num_aux": len(aux), "engine_layer_ids": engine_layer_ids,
            "dtype": "bfloat16", "final": "post-norm (LM head input)", "sglang": SGLANG_VERSION}
    (tmp / "meta.json").write_text(json.dumps(meta))
    if out.exists():
        shutil.rmtree(out)   # leftover of a process that died before `done`
    os.replace(tmp, out)
    (out / ".done.tmp").touch()
    os.replace(out / ".done.tmp", out / "done")
    return out


def _own(t: torch.Tensor) -> torch.Tensor:
    """bf16, contiguous, owning exactly its bytes: torch.save writes a view's whole storage."""
    t = t.to(torch.bfloat16).contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def write_error(spool: Path, rid: Optional[str], message: str) -> None:
    """Per-request error.txt when the rid can name a directory, else a line in <spool>/errors.txt."""
    try:
        spool.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        if rid is not None and safe_rid(rid):
            d = spool / f"req_{rid}"
            d.mkdir(exist_ok=True)
            # whole or absent: the client reads error.txt as soon as it exists (an appending write
            # was once read empty, between the file's creation and its first line)
            path, tmp = d / "error.txt", d / f".error.{os.getpid()}.{threading.get_ident()}"
            tmp.write_text((path.read_text() if path.exists() else "") + f"{stamp} {message}\n")
            os.replace(tmp, path)
        else:
            with open(spool / "errors.txt", "a") as f:
                f.write(f"{stamp} rid={rid!r} {message}\n")
    except Exception:
        logger.exception("eagle3 capture: could not write the error file for %r", rid)


@dataclass
class PassCopy:
    """One forward pass's rows on their way to the host: copies are in flight until `event`."""
    rids: List[str]
    prefix_lens: List[int]
    extend_lens: List[int]
    total_lens: torch.Tensor      # [B] int (host)
    aux: List[torch.Tensor]       # k x [N, H] bf16 (host, pinned on CUDA)
    final: torch.Tensor           # [N, H] bf16 (host)
    event: Optional[object]       # torch.cuda.Event recorded after the copies, or None on CPU


def write_outcome(spool: Path, out: Outcome, aux_layers: Optional[List[int]],
                  engine_layer_ids: Optional[List[int]]) -> None:
    """Write one completed request; a failure becomes its error.txt, never an exception."""
    try:
        write_request(spool, out.rid, out.aux, out.final, aux_layers, engine_layer_ids)
    except Exception as e:
        logger.exception("eagle3 capture: writing request %s failed", out.rid)
        write_error(spool, out.rid, f"write failed: {e!r}")


def process_pass(spool: Path, state: AssemblyState, item: PassCopy,
                 aux_layers: Optional[List[int]], engine_layer_ids: Optional[List[int]],
                 submit: Callable[[Callable[[], None]], None] = lambda job: job()) -> List[Outcome]:
    """Writer side of one pass: wait for its copies, assemble, hand completed requests to `submit`
    (inline by default; _Capture runs them on a few writer threads)."""
    if item.event is not None:
        item.event.synchronize()
    pieces = split_rows(item.rids, item.prefix_lens, item.extend_lens, item.total_lens.tolist(),
                        item.aux, item.final)
    outcomes = []
    for piece in pieces:
        out = assemble(state, piece)
        if out.kind == "complete" and not safe_rid(out.rid):
            out = Outcome("error", out.rid, message=f"request id {out.rid!r} cannot name a spool "
                          "directory (allowed: letters, digits, _.:=+-); request not written")
        if out.kind == "complete":
            submit(functools.partial(write_outcome, spool, out, aux_layers, engine_layer_ids))
        elif out.kind == "duplicate":
            logger.warning("eagle3 capture: %s prefilled again (a retracted request, or a client "
                           "resending a rid it sent before): kept the first capture, wrote nothing",
                           out.rid)
        elif out.kind == "error":
            logger.error("eagle3 capture: %s", out.message)
            write_error(spool, out.rid, out.message)
        outcomes.append(out)
    return outcomes


# ----------------------------------------------------------------------------------------------
# The hook (serving thread): decide, start the device->host copies, hand the pass to the writer.

def should_capture(forward_batch, aux_hidden_states) -> bool:
    """Prompt prefills of the target only: EXTEND or MIXED, no speculative state, aux present.

    TARGET_VERIFY and DRAFT_EXTEND_V2 are speculative; a draft model's extend carries spec_info;
    SPLIT_PREFILL and DLLM_EXTEND never pass aux states.
    """
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    if aux_hidden_states is None or not isinstance(forward_batch, ForwardBatch):
        return False
    if forward_batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED):
        return False
    algo = forward_batch.spec_algorithm
    return forward_batch.spec_info is None and (algo is None or algo.is_none())


def is_writer_rank() -> bool:
    """Attention-TP rank 0 (and attention-CP rank 0) holds every row of its DP group's batch."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return p.attn_tp_rank == 0 and p.attn_cp_rank == 0


def _to_host(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Start a copy to host memory without waiting; pinned (truly async) when on CUDA."""
    t = t if dtype is None else t.to(dtype)
    if t.is_cuda:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
    # CPU: copy now; the source may be a buffer the model reuses next pass (AuxHiddenStatePacker).
    return t.clone()


def parse_aux_layers(text: str) -> Optional[List[int]]:
    text = text.strip()
    if not text:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").strip("[]").split(",") if x]
    except ValueError:
        logger.error("eagle3 capture: %s=%r is not a comma-separated list of ints", AUX_LAYERS_ENV, text)
        return None


def check_sglang_version() -> str:
    from sglang.version import __version__ as version

    if version != SGLANG_VERSION:
        logger.warning("%s\neagle3 capture plugin was written and tested for SGLang %s, this is %s.\n"
                       "Re-check LogitsProcessor.forward, ForwardBatch fields and the rank helpers "
                       "before trusting the spool.\n%s", "!" * 80, SGLANG_VERSION, version, "!" * 80)
    return version


class _Capture:
    """Per-process capture state: the assembler thread and its queue, the assembly state, and the
    writer threads (assembly is single-threaded; writes of finished requests run in parallel)."""

    def __init__(self, spool: Path, aux_layers: Optional[List[int]]):
        self.spool = spool
        self.aux_layers = aux_layers
        self.errors = 0
        self._reset()

    def _reset(self) -> None:
        # Also after a fork: threads and queues do not survive into the child.
        self.pid = os.getpid()
        self.queue: "queue.Queue[PassCopy]" = queue.Queue(maxsize=_QUEUE_PASSES)
        self.state = AssemblyState()
        self.thread: Optional[threading.Thread] = None
        self.engine_ids: Optional[List[int]] = None
        self.writers = ThreadPoolExecutor(_WRITER_THREADS, thread_name_prefix="eagle3-spool-write")
        self.slots = threading.Semaphore(_WRITES_IN_FLIGHT)
        self.lock = threading.Lock()
        self.writes_pending = 0

    def capture(self, bound: Dict[str, object]) -> None:
        fb, aux = bound.get("logits_metadata"), bound.get("aux_hidden_states")
        hidden = bound["hidden_states"]   # [N, H] post-norm
        if not should_capture(fb, aux) or not is_writer_rank():
            return
        if any(x is None for x in (fb.rids, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu,
                                   fb.orig_seq_lens)):
            raise ValueError("extend batch without rids / extend lens / orig_seq_lens: a prefill "
                             "CUDA graph drops them; run with --disable-prefill-cuda-graph")
        n_req = len(fb.rids)
        if n_req == 0:
            return   # an idle DP rank padded into a dummy extend
        n_rows = sum(int(x) for x in fb.extend_seq_lens_cpu[:n_req])
        if hidden.shape[0] < n_rows:
            raise ValueError(f"{hidden.shape[0]} hidden rows for {n_rows} extend tokens: rows are "
                             "sharded across ranks; capture needs them whole")
        aux_list = unpack_aux(aux, hidden.shape[-1])
        if self.aux_layers is not None and len(aux_list) != len(self.aux_layers):
            raise ValueError(f"{len(aux_list)} aux states but {AUX_LAYERS_ENV} names "
                             f"{len(self.aux_layers)} layers (two-batch overlap skips captures)")
        item = PassCopy(rids=[str(r) for r in fb.rids], prefix_lens=list(fb.extend_prefix_lens_cpu),
                        extend_lens=list(fb.extend_seq_lens_cpu),
                        total_lens=_to_host(fb.orig_seq_lens[:n_req], torch.int64),
                        aux=[_to_host(a[:n_rows], torch.bfloat16) for a in aux_list],
                        final=_to_host(hidden[:n_rows], torch.bfloat16), event=None)
        if hidden.is_cuda:
            item.event = torch.cuda.Event()
            item.event.record()
        self.submit(item)

    def submit(self, item: PassCopy) -> None:
        if self.pid != os.getpid():
            self._reset()
        if self.thread is None or not self.thread.is_alive():
            self.engine_ids = _engine_layer_ids()
            self.thread = threading.Thread(target=self._run, name="eagle3-spool-writer", daemon=True)
            self.thread.start()
        self.queue.put(item)   # blocks while the writer is _QUEUE_PASSES behind: bounded memory

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                process_pass(self.spool, self.state, item, self.aux_layers, self.engine_ids,
                             self._submit_write)
            except Exception as e:
                self.report(e)
            finally:
                # Drop the pass now, not at the next get(): its pinned blocks go back to torch's
                # host cache for the next pass instead of forcing a fresh (slow) pinned allocation.
                item = None
                self.queue.task_done()

    def _submit_write(self, job: Callable[[], None]) -> None:
        self.slots.acquire()   # blocks the assembler (then the queue, then serving) when writes lag
        with self.lock:
            self.writes_pending += 1

        def run() -> None:
            try:
                job()
            finally:
                with self.lock:
                    self.writes_pending -= 1
                self.slots.release()

        self.writers.submit(run)

    def busy(self) -> bool:
        return bool(self.queue.unfinished_tasks or self.writes_pending)

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every submitted pass is assembled and written (tests, process exit)."""
        deadline = time.monotonic() + timeout
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.busy()

    def report(self, exc: BaseException) -> None:
        # Errors without a rid go to <spool>/errors.txt; a misconfigured server repeats one error
        # every pass, so the log keeps the first 100 and then every 1000th.
        self.errors += 1
        if self.errors <= 100 or self.errors % 1000 == 0:
            logger.error("eagle3 capture: pass not captured (error %d): %r", self.errors, exc,
                         exc_info=exc)
            write_error(self.spool, None, f"pass not captured: {exc!r}")


def _engine_layer_ids() -> Optional[List[int]]:
    try:
        from sglang.srt.runtime_context import get_exec

        ids = get_exec().features.return_aux_hidden_state_layer_ids
        return None if ids is None else [int(i) for i in ids]
    except Exception:
        return None


_ACTIVE: Optional[_Capture] = None
_REGISTERED = False


@functools.lru_cache(maxsize=8)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def around_logits_forward(original, *args, **kwargs):
    """HookType.AROUND on LogitsProcessor.forward: capture first, then serve exactly as before."""
    cap = _ACTIVE
    if cap is not None:
        try:
            bound = _signature(original).bind(*args, **kwargs).arguments
            cap.capture(bound)
        except Exception as e:
            cap.report(e)
    return original(*args, **kwargs)


def active() -> Optional[_Capture]:
    return _ACTIVE


def register() -> None:
    """SGLang plugin entry point: wrap LogitsProcessor.forward when EAGLE3_SPOOL_DIR is set."""
    global _ACTIVE, _REGISTERED
    spool = os.environ.get(SPOOL_ENV, "").strip()
    if not spool:
        logger.debug("eagle3 capture plugin inert: %s is not set", SPOOL_ENV)
        return
    try:
        check_sglang_version()
        _ACTIVE = _Capture(Path(spool), parse_aux_layers(os.environ.get(AUX_LAYERS_ENV, "")))
        if not _REGISTERED:
            from sglang.srt.plugins.hook_registry import HookRegistry, HookType

            HookRegistry.register(HOOK_TARGET, around_logits_forward, HookType.AROUND)
            atexit.register(lambda: _ACTIVE is not None and _ACTIVE.drain(30.0))
            _REGISTERED = True
        logger.info("eagle3 capture plugin: spooling prefills to %s (aux_layers %s)",
                    spool, _ACTIVE.aux_layers)
    except Exception:
        logger.exception("eagle3 capture plugin failed to register; serving continues without it")
