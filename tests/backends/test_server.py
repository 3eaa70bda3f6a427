"""`vllm-kvq serve --attention-backend OSCAR` under concurrent clients, clients
that hang up mid-stream and bad requests: no server error, a 4xx with a
message for each bad request, and greedy text equal to offline vLLM.

One server per module (fp32, the calibrated INT2 artifact). The
references come from offline engines with the same settings: CPU_ATTN where
the BF16 sink and window cover the whole sequence (nothing is read as INT2),
OSCAR itself for prompts long enough to read INT2 rows. Also the KV budget
``serve`` picks on CPU when the user gives none (no engine needed).
"""

import http.client
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from evalkit.server import free_port, wait_healthy
from tests.conftest import REPO, make_llm, model_path, needles, shutdown

MAX_LEN = 2048
KVQ = {"artifact": str(REPO / "examples" / "artifacts" / "house-qwen3-oscar")}
SHORT_TOKENS = 16  # generated per short prompt; prompt + these stay inside sink + window (320)
LONG_TOKENS = 24


def _short_prompts() -> list[str]:
    lines = needles(max_tokens=4096)[0]["prompt"].splitlines()
    return ["\n".join(lines[i : i + 10]) + "\n" for i in range(0, 40, 10)]


def _long_prompts() -> list[str]:
    """Two needle recalls of about 1,000 tokens whose needle sits between the
    sink and the window: the answer must be read back from INT2 rows."""
    rows = [r["prompt"] for r in needles(min_tokens=700, max_tokens=1000) if 0.1 < r["depth"] < 0.4][:2]
    assert len(rows) == 2
    return rows


GIB = 1 << 30


@pytest.mark.parametrize("free, budget", [(10 * GIB + 12345, 10 * GIB // 4), (40 * GIB, 4 * GIB),
                                          (3 * GIB + 7 * (1 << 20) + 99, (3 * GIB + 4 * (1 << 20)) // 4)])
def test_serve_sizes_kv_cache_from_free_memory(monkeypatch, free, budget):
    """Without a user budget on CPU, ``serve`` adds a quarter of the free
    memory (whole MiB, at most 4 GiB) and says so in one log line."""
    import logging

    import psutil

    from vllm_kvq import cli

    class Lines(logging.Handler):
        def __init__(self, level):
            super().__init__(level)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Mem", (), {"available": free})())
    argv = ["examples/models/house-qwen3", "--attention-backend", "OSCAR"]
    cli._memory_flags_given(argv)  # vLLM's logging set-up, run by the first parse, clears child loggers' handlers
    handler = Lines(logging.INFO)
    logger = logging.getLogger("vllm." + cli.__name__)  # vLLM's loggers do not propagate to pytest's
    logger.addHandler(handler)
    try:
        assert cli._cpu_kv_budget(argv) == [*argv, "--kv-cache-memory-bytes", str(budget)]
    finally:
        logger.removeHandler(handler)
    lines = [line for line in handler.lines if "--kv-cache-memory-bytes" in line]
    assert len(lines) == 1 and f"{budget / GIB:.2f} GiB" in lines[0] and "pass either flag" in lines[0]


@pytest.mark.parametrize("flags", [["--kv-cache-memory-bytes", "1G"], ["--kv-cache-memory-bytes=536870912"],
                                   ["--gpu-memory-utilization", "0.5"], ["--gpu-memory-utilization=0.92"],
                                   "config", "env"])
def test_serve_keeps_the_users_kv_budget(monkeypatch, tmp_path, flags):
    from vllm_kvq import cli

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    if flags == "config":
        (tmp_path / "serve.yaml").write_text("gpu-memory-utilization: 0.5\n")
        flags = ["--config", str(tmp_path / "serve.yaml")]
    elif flags == "env":
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
        flags = []
    argv = ["examples/models/house-qwen3", "--max-model-len", "2048", *flags]
    assert cli._cpu_kv_budget(argv) == argv


@pytest.fixture(scope="module")
def references():
    """Offline greedy texts: CPU_ATTN for the short prompts, OSCAR for the long ones."""
    from vllm import SamplingParams

    out = {}
    for oscar, prompts, n in ((None, _short_prompts(), SHORT_TOKENS), (KVQ, _long_prompts(), LONG_TOKENS)):
        llm = make_llm(oscar=oscar, dtype="float32", max_model_len=MAX_LEN)
        for p, o in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0), use_tqdm=False)):
            if oscar is None:
                assert len(o.prompt_token_ids) + n <= 64 + 256, "short prompts must stay inside sink + window"
            else:
                assert len(o.prompt_token_ids) > 64 + 256 + 300, "long prompts must read INT2 rows"
            out[p] = o.outputs[0].text
        shutdown(llm)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm_kvq.cli", "serve", model_path(),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--attention-backend", "OSCAR", "--additional-config", json.dumps({"kvq": KVQ}),
        "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16", "--enforce-eager",
        "--kv-cache-memory-bytes", str(512 << 20), "--no-enable-prefix-caching",
        "--chat-template", str(REPO / "examples" / "chat_template.jinja"),
        "--served-model-name", "house-qwen3",
    ]
    log_path = (REPO if os.environ.get("KVQ_KEEP_LOGS") else tmp_path_factory.mktemp("server")) / "server-test.log"
    log = open(log_path, "w")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")  # the server's processes as users run them
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    wait_healthy(proc, port, timeout=300, log=log_path)
    yield proc, port, log_path
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _post(port: int, body, stream_chunks: int | None = None) -> tuple[int, str]:
    """POST /v1/completions; ``body`` a dict or raw bytes. Returns (status,
    text): the completion, the concatenated stream, or the error message. With
    ``stream_chunks`` the client hangs up after that many stream events."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    try:
        if resp.status != 200:
            return resp.status, json.loads(resp.read())["error"]["message"]
        if not (isinstance(body, dict) and body.get("stream")):
            return 200, json.loads(resp.read())["choices"][0]["text"]
        text, events = [], 0
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            events += 1
            if stream_chunks is not None and events >= stream_chunks:
                break
        return 200, "".join(text)
    finally:
        conn.close()


def _greedy(prompt: str, n: int, stream: bool) -> dict:
    return {"model": "house-qwen3", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream}


def _alive(proc, port: int) -> None:
    assert proc.poll() is None, "server process exited"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        assert r.status == 200


def _metric(port: int, name: str) -> float:
    """A counter or gauge from the server's Prometheus endpoint (summed over labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith(name + "{") or x.startswith(name + " "))


@pytest.mark.slow
def test_concurrent_clients_disconnects_and_bad_requests(server, references):
    proc, port, log_path = server
    short, long = _short_prompts(), _long_prompts()
    good = [(p, _greedy(p, SHORT_TOKENS, stream=i % 2 == 1)) for i, p in enumerate(short)]
    good += [(p, _greedy(p, LONG_TOKENS, stream=i == 1)) for i, p in enumerate(long)]
    hang_ups = [_greedy(p, 400, stream=True) for p in short[:2]]
    bad = {
        "prompt longer than max_model_len": _greedy("x = 1\n" * 2 * MAX_LEN, 8, stream=False),
        "negative temperature": {**_greedy(short[0], 8, stream=False), "temperature": -1.0},
        "invalid JSON body": b'{"model": "house-qwen3", "prompt": "def f(",',
    }
    with ThreadPoolExecutor(len(good) + len(hang_ups) + len(bad)) as pool:
        good_f = [pool.submit(_post, port, body) for _, body in good]
        hang_f = [pool.submit(_post, port, body, 2) for body in hang_ups]
        bad_f = {name: pool.submit(_post, port, body) for name, body in bad.items()}
        good_r = [f.result() for f in good_f]
        hang_r = [f.result() for f in hang_f]
        bad_r = {name: f.result() for name, f in bad_f.items()}

    assert [s for s, _ in good_r + hang_r] == [200] * (len(good_r) + len(hang_r))
    for (prompt, body), (_, text) in zip(good, good_r):
        assert text == references[prompt], f"{'stream' if body['stream'] else 'plain'} {len(prompt)} chars"
    for name, (status, message) in bad_r.items():
        assert 400 <= status < 500 and message, f"{name}: {status} {message!r}"
    _alive(proc, port)
    deadline = time.time() + 120
    while _metric(port, "vllm:num_requests_running") and time.time() < deadline:
        time.sleep(1)
    assert _metric(port, "vllm:num_requests_running") == 0
    # the hung-up streams were aborted, not decoded to their 400 tokens
    assert _metric(port, "vllm:generation_tokens_total") < 400
    log = log_path.read_text()
    assert "Traceback" not in log and " 500 " not in log


@pytest.mark.slow
def test_greedy_text_after_load_equals_offline(server, references):
    """Alone after the load: a short prompt against CPU_ATTN, a long one
    against offline OSCAR."""
    proc, port, _ = server
    short, long = _short_prompts()[0], _long_prompts()[0]
    assert _post(port, _greedy(short, SHORT_TOKENS, stream=False)) == (200, references[short])
    assert _post(port, _greedy(long, LONG_TOKENS, stream=True)) == (200, references[long])
    _alive(proc, port)
