"""Waiting for a server (evalkit.server) against real processes: one that
answers /health, one that exits, one that never answers."""

import subprocess
import sys

import pytest

from evalkit.server import free_port, wait_healthy


def _start(code: str, tmp_path, *args) -> tuple[subprocess.Popen, object]:
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-c", code, *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=tmp_path), log


def test_a_server_that_answers_health(tmp_path):
    (tmp_path / "health").write_text("ok")
    port = free_port()
    proc, log = _start("import sys, http.server; http.server.test(http.server.SimpleHTTPRequestHandler, "
                       "port=int(sys.argv[1]), bind='127.0.0.1')", tmp_path, str(port))
    try:
        wait_healthy(proc, port, timeout=60, log=log)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_server_that_exits_names_its_code_and_log(tmp_path):
    proc, log = _start("import sys; print('no such model', flush=True); sys.exit(3)", tmp_path)
    with pytest.raises(RuntimeError, match="server exited with 3: no such model"):
        wait_healthy(proc, free_port(), timeout=60, log=log)


def test_a_server_that_never_answers_is_killed(tmp_path):
    proc, log = _start("import time; time.sleep(600)", tmp_path)
    with pytest.raises(RuntimeError, match="not healthy after 3 s"):
        wait_healthy(proc, free_port(), timeout=3, log=log)
    assert proc.wait(10) is not None
