"""capture/sglang_server.launch against stand-in servers (plain Python; needs no SGLang).

    python -m pytest tests/sglang/test_server_launch.py -q
"""
from __future__ import annotations

import socket
import sys
import time

import pytest

from capture.sglang_server import capture_server_env, free_port, launch, stop

# A server that answers /health with 200 only after `delay` seconds, like SGLang while it loads.
_SERVER = """
import http.server, sys, time
port, delay = int(sys.argv[1]), float(sys.argv[2])
ready = time.time() + delay
print("loading weights", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" and time.time() >= ready
        self.send_response(200 if ok else 503); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_launch_waits_for_health_then_stop(tmp_path):
    port = free_port()
    t0 = time.monotonic()
    proc = launch([sys.executable, "-c", _SERVER, str(port), "1.5"], None, str(tmp_path / "s.log"),
                  f"http://127.0.0.1:{port}/health", timeout=60)
    try:
        assert time.monotonic() - t0 >= 1.5 and proc.poll() is None
    finally:
        stop(proc, timeout=10)
    assert proc.poll() is not None


def test_launch_raises_with_log_tail_when_server_dies(tmp_path):
    script = "import sys\nfor i in range(100): print('line', i)\nprint('CUDA out of memory'); sys.exit(3)"
    with pytest.raises(RuntimeError) as e:
        launch([sys.executable, "-c", script], None, str(tmp_path / "s.log"),
               f"http://127.0.0.1:{free_port()}/health", timeout=60)
    msg = str(e.value)
    assert "code 3" in msg and "CUDA out of memory" in msg and "line 99" in msg
    assert "line 61" in msg and "line 60" not in msg          # exactly the last 40 lines


def test_launch_times_out_and_stops_the_server(tmp_path):
    port = free_port()
    with pytest.raises(TimeoutError) as e:
        launch([sys.executable, "-c", _SERVER, str(port), "1000"], None, str(tmp_path / "s.log"),
               f"http://127.0.0.1:{port}/health", timeout=3)
    assert "loading weights" in str(e.value)
    time.sleep(0.5)
    with pytest.raises(ConnectionRefusedError):                # the stand-in was stopped
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_capture_server_env():
    env = capture_server_env("/dev/shm/spool", [3, 31, 59], base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "EAGLE3_SPOOL_DIR": "/dev/shm/spool", "EAGLE3_AUX_LAYERS": "3,31,59"}
