"""`vllm-kvq serve --attention-backend OSCAR` answers the OpenAI API."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import REPO, model_path

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    kvq = {"rotation": "hadamard", "sink": 16, "window": 32}
    cmd = [
        sys.executable, "-m", "vllm_kvq.cli", "serve", model_path(),
        "--host", "127.0.0.1", "--port", str(port),
        "--attention-backend", "OSCAR", "--additional-config", json.dumps({"kvq": kvq}),
        "--max-model-len", "2048", "--max-num-seqs", "32", "--enforce-eager",
        "--kv-cache-memory-bytes", str(512 << 20), "--no-enable-prefix-caching",
        "--chat-template", str(REPO / "examples" / "chat_template.jinja"),
        "--served-model-name", "house-qwen3",
    ]
    log = open(REPO / "server-test.log", "w") if os.environ.get("KVQ_KEEP_LOGS") else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(2)
    else:
        proc.kill()
        raise RuntimeError("server did not come up in 300 s")
    yield f"http://127.0.0.1:{port}/v1"
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_completions_chat_and_32_concurrent(server):
    from openai import OpenAI

    client = OpenAI(base_url=server, api_key="none")
    done = client.completions.create(model="house-qwen3", prompt="import numpy as np\n\ndef", max_tokens=16,
                                     temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens == 16
    chat = client.chat.completions.create(
        model="house-qwen3", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=12,
        temperature=0,
    )
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0

    prompt = open(REPO / "vllm_kvq" / "kernels" / "oscar" / "reference.py").read()[:3000]

    def one(i: int) -> int:
        r = client.completions.create(model="house-qwen3", prompt=prompt[i * 40 :], max_tokens=24,
                                      temperature=0)
        return r.usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        counts = list(pool.map(one, range(32)))
    assert counts == [24] * 32
