#!/usr/bin/env bash
# Run scripts/cuda_check.py on a GPU machine that has the vLLM 0.32 bundle of
# ../shared/gpu-vllm copied to .gpu-vllm (see its README). Results: $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
  || echo "(editable install failed; the plugin registers itself when the config is unpickled)"
python3 scripts/cuda_check.py
