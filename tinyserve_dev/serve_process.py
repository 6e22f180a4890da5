"""``tinyserve serve`` as a subprocess on a free 127.0.0.1 port, for tests and benchmarks.

The process imports this checkout's ``tinyserve_trt`` (``ROOT`` leads its PYTHONPATH), not an
installed one; its stdout and stderr are one text pipe the caller reads (``communicate``) when
it is done. :func:`start_serve` returns once ``/health`` answers 200; the caller stops it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port free on 127.0.0.1 now (released just before the server binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(package, *flags: str, timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """(the process, its base URL) of ``tinyserve serve PACKAGE --port PORT FLAGS...`` once its
    ``/health`` answers 200. RuntimeError with the end of its output, the process killed, when it
    exits first or is not healthy after ``timeout`` seconds."""
    import httpx

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tinyserve_trt.runtime.cli", "serve", str(package), "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"tinyserve serve did not come up: {proc.communicate()[0][-2000:]}")
        time.sleep(0.2)


def metrics(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The server's ``/metrics``, parsed (``runtime.server.metrics.parse_metrics``)."""
    import httpx

    from tinyserve_trt.runtime.server.metrics import parse_metrics

    return parse_metrics(httpx.get(url + "/metrics", timeout=timeout).text)
