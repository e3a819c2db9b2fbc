"""The SGLang capture server: its command line and environment, and a launcher that waits for /health.

    cmd = capture_server_cmd("/models/Kimi-K2.5", 8, [3, 31, 59], ["KimiK25ForConditionalGeneration"], 30000, [])
    with running_server(cmd, capture_server_env("/dev/shm/eagle3_spool", [3, 31, 59]),
                        Path("runs/kimi_k25/capture_server.log"), 30000) as (url, proc):
        ...

Every flag was checked against SGLang 0.5.23's ServerArgs (tests/sglang/test_server_args.py
parses these command lines with SGLang's own parser and resolution). Pure Python: importing this
module needs no SGLang, so the capture client can run in an environment without it.
"""
from __future__ import annotations

import contextlib
import os
import socket
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence

from eagle3.engine_ids import capture_layer_ids
from eagle3.serving import SERVER_START_TIMEOUT, server_cmd

SPOOL_ENV = "EAGLE3_SPOOL_DIR"        # same names as capture/sglang_plugin.py (which imports sglang)
AUX_LAYERS_ENV = "EAGLE3_AUX_LAYERS"

# Flags that silently break capture. Two-batch overlap runs DeepSeek layers past
# first_k_dense_replace through model_forward_stages, which captures nothing there.
_CAPTURE_FORBIDDEN = ("--enable-two-batch-overlap", "--speculative-draft-model-path")


def capture_server_cmd(model_path: str, tp_size: int, aux_layers: Sequence[int], architectures: Sequence[str],
                       port: int, extra_args: Sequence[str] = (), *,
                       trust_remote_code: bool = False, python: str = sys.executable) -> List[str]:
    """`python -m sglang.launch_server` for a capture server; set capture_server_env() too.

    --enable-return-aux-hidden-states + --speculative-algorithm EAGLE3: the target itself captures
    the aux states (SGLang resets the algorithm to none, no draft loads); the ids go through the
    same set_eagle3_layers_to_capture rule as a draft config's, hence capture_layer_ids, keyed on the
    target's config.json `architectures`.
    --disable-prefill-cuda-graph: the prefill graph runner rebuilds the ForwardBatch without rids.
    --disable-radix-cache: a cached prefix is never recomputed, so its rows would be missing.
    --skip-server-warmup: warmup's own request would otherwise land in the spool.
    Chunked prefill stays on: the plugin assembles chunks.
    """
    bad = [a for a in extra_args if a.split("=")[0] in _CAPTURE_FORBIDDEN]
    if bad:
        raise ValueError(f"capture server: {bad} break capture (see _CAPTURE_FORBIDDEN)")
    ids = capture_layer_ids(aux_layers, architectures)
    flags = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
             "--return-aux-hidden-state-layer-ids", *[str(i) for i in ids],
             "--disable-prefill-cuda-graph", "--disable-radix-cache", "--skip-server-warmup"]
    return server_cmd(model_path, tp_size, port, [*flags, *extra_args], trust_remote_code=trust_remote_code,
                      python=python)


def capture_server_env(spool_dir: str, aux_layers: Sequence[int],
                       base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment that switches the plugin on: spool dir + aux_layers for meta.json."""
    env = dict(os.environ if base is None else base)
    env[SPOOL_ENV] = str(spool_dir)
    env[AUX_LAYERS_ENV] = ",".join(str(int(i)) for i in aux_layers)
    return env


def log_tail(path: str, n: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))   # the last 256 KiB hold 40 lines of any log
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError as e:
        return f"(no log: {e})"


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the server's process group (SGLang spawns schedulers), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def launch(cmd: Sequence[str], env: Optional[Mapping[str, str]], log_path: str, health_url: str,
           timeout: float) -> subprocess.Popen:
    """Start `cmd` (output to log_path), return once health_url answers 200.

    If the server exits first, or timeout seconds pass (then it is stopped), raise RuntimeError /
    TimeoutError carrying the last 40 lines of its log.
    """
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(cmd), env=None if env is None else dict(env), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)   # own process group: stop() gets children
    deadline = time.monotonic() + timeout
    while True:
        rc = proc.poll()
        if rc is not None:
            raise RuntimeError(f"server exited with code {rc} before {health_url} answered; "
                               f"last lines of {log_path}:\n{log_tail(log_path)}")
        if _healthy(health_url):
            return proc
        if time.monotonic() > deadline:
            stop(proc)
            raise TimeoutError(f"server did not answer {health_url} within {timeout:.0f} s "
                               f"(stopped it); last lines of {log_path}:\n{log_tail(log_path)}")
        time.sleep(1.0)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a server we launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(cmd: Sequence[str], env: Optional[Mapping[str, str]], log_path: Path, port: int,
                   timeout: float = SERVER_START_TIMEOUT) -> Iterator[tuple]:
    """Launch `cmd`, yield (url, process) once /health answers; stop it on exit, error or Ctrl-C."""
    url = f"http://127.0.0.1:{port}"
    print(f"[sglang] starting the server ({log_path}): {' '.join(cmd)}")
    proc = launch(cmd, env, str(log_path), url + "/health", timeout)
    try:
        yield url, proc
    finally:
        print("[sglang] stopping the server")
        stop(proc)
