#!/usr/bin/env bash
# Everything that needs the GPU, in one go (a GPU machine with the vLLM 0.32
# bundle of ../shared/gpu-vllm copied to .gpu-vllm and the packed house model
# of scripts/pack_for_gpu.py in .device-carry/house-qwen3). Results: $OUT.
#   1. the Triton kernel tests at serving shapes, compiled;
#   2. the kernel benchmarks (benchmarks/oscar_kernels.py);
#   3. the CUDA check in real vLLM (scripts/cuda_check.py [runs]).
set -uo pipefail
cd "$(dirname "$0")/.."
[ -f .gpu-vllm/env.sh ] && source .gpu-vllm/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/kvq_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
OSCAR_REAL_SHAPES=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_oscar_triton.py \
  > "$OUT/triton_tests.log" 2>&1; echo "triton tests rc=$?"; tail -3 "$OUT/triton_tests.log"
timeout 170 python3 benchmarks/oscar_kernels.py 2>&1 | grep -v "^{" | tail -60; echo "bench rc=$?"
timeout 160 python3 scripts/cuda_check.py ${CUDA_CHECK_RUNS:-} > "$OUT/cuda_check.log" 2>&1; echo "cuda check rc=$?"
[ -f "$OUT/cuda_check.json" ] && cat "$OUT/cuda_check.json"
