"""One serving job stepped by hand in a vLLM engine, every step classified.

Shared by the end-to-end benchmarks (``oscar_vllm_e2e.py``,
``stepquant_vllm_e2e.py``): all requests are queued at once, more than the
cache holds, and the engine is stepped in this process so that each step can
be told apart:

- concurrent batch: the most requests running in one step;
- steady-state decode tokens/s: tokens over the time of the steps in which
  every running request decodes and none is admitted or prefilled;
- prefill tokens/s: prompt tokens over the time of the steps with a prefill;
- job tokens/s: generated tokens over the job's wall time.

Partial figures are printed as ``PROGRESS`` lines every 30 s, so a run cut
by a time limit still says how far it got. Each engine runs in its own
process (``run_child``), which prints its figures as one ``RESULT`` line.
"""

from __future__ import annotations

import json
import subprocess
import time

# Full CUDA graphs for decode-only batches, no torch.compile, every other batch
# eager (vLLM's default capture sizes): the serving configuration both
# backends' jobs use with --cuda-graphs.
GRAPHS = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


def run_child(cmd: list[str], env: dict, timeout_s: float | None) -> dict:
    """Run one engine's process; its ``RESULT`` line as a dict, or ``error``
    (the stderr tail) and the last ``PROGRESS`` line when it failed or ran
    past ``timeout_s``."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:  # keep this run's progress
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = f"timed out after {timeout_s} s"
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    progress = [x for x in stdout.splitlines() if x.startswith("PROGRESS ")]
    return json.loads(lines[-1][7:]) if lines else {"error": stderr[-2000:], "progress": progress[-1:]}


def run_job(llm, prompts: list, params) -> dict:
    """Queue ``prompts`` (vLLM prompt dicts) with ``params`` and step the
    engine until all finish; returns the figures above."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    for i, prompt in enumerate(prompts):
        engine.add_request(f"job-{i}", prompt, params)
    decode_t = decode_tok = prefill_t = 0.0
    prefill_tok = batch = 0
    prompt_done: dict[str, int] = {}  # prompt tokens computed so far, per request
    start = report = time.perf_counter()
    while engine.has_unfinished_requests():
        if time.perf_counter() - report > 30:
            report = time.perf_counter()
            print("PROGRESS", {"s": round(report - start), "prompt_tokens": prefill_tok, "prefill_s": prefill_t,
                               "decode_tokens": decode_tok, "decode_s": decode_t, "batch": batch}, flush=True)
        running = {r.request_id for r in scheduler.running}
        decoding = bool(running) and all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        batch = max(batch, len(scheduler.running))
        new = 0
        for r in scheduler.running:
            done = min(r.num_computed_tokens, r.num_prompt_tokens)
            new += done - prompt_done.get(r.request_id, 0)
            prompt_done[r.request_id] = done
        if decoding and new == 0:
            decode_t += dt
            decode_tok += len(running)
        elif new:
            prefill_t += dt
            prefill_tok += new
    wall = time.perf_counter() - start
    return {"concurrent_batch": batch,
            "decode_tokens_per_s": decode_tok / decode_t if decode_t else None,
            "decode_steps_time_s": decode_t, "prefill_tokens_per_s": prefill_tok / prefill_t if prefill_t else None,
            "job_wall_s": wall, "job_generated_tokens_per_s": len(prompts) * params.max_tokens / wall}
