"""Starting an OpenAI server under test: a free port, and waiting until it
answers /health (or saying why it never will)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, log: Path | None = None) -> None:
    """Return once ``GET /health`` answers 200. A server that exits first, or
    is still not healthy after ``timeout`` seconds (then killed), raises with
    the tail of its ``log``."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    why = f"server exited with {proc.returncode}" if proc.poll() is not None else f"not healthy after {timeout:.0f} s"
    proc.kill()
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise RuntimeError(f"{why}{': ' + tail if tail else ''}")
