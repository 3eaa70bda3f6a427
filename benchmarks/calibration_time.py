"""Wall time of ``vllm-kvq calibrate`` on CPU, the whole command (process
start, imports, tokenization, capture, fitting, writing the artifact).

    python benchmarks/calibration_time.py      # house-qwen3, fixed and fitted clip
Writes ``benchmarks/results/calibration-time.json``; ``benchmarks/accuracy.py``
renders it into docs/accuracy.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "eval" / "code-dev.txt.gz"


def time_calibrate(model: str, clip: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "vllm_kvq.cli", "calibrate", model, "--data", str(DATA),
               "--out", f"{tmp}/a", "--clip", clip, *extra]
        load = os.getloadavg()[0]
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.time()
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.time() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        prov = json.loads((Path(tmp) / "a" / "manifest.json").read_text())["provenance"]
    return {"model": Path(model).name, "clip": clip, "wall_s": round(wall, 1), "inside_s": prov["seconds"],
            "tokens": prov["tokens"], "cpu_s": round(cpu, 1), "load_before": round(load, 2),
            "load_after": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="examples/models/house-qwen3")
    ap.add_argument("--clips", nargs="*", default=["fixed", "fitted"])
    a = ap.parse_args()
    runs = [time_calibrate(a.model, c, []) for c in a.clips]
    for r in runs:
        print(json.dumps(r))
    (REPO / "benchmarks" / "results" / "calibration-time.json").write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
