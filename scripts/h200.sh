#!/usr/bin/env bash
# Everything that needs the GPU (a GPU machine with vLLM 0.32's CUDA build, or
# its bundle in .gpu-vllm, and the packed house model of
# python -m scripts.pack_for_gpu in .device-carry/house-qwen3). Results: $OUT.
# Steps, all by default, or the ones named: bash scripts/h200.sh check e2e
#   tests  the Triton kernel tests at serving shapes, compiled: 254 tests, ~15 min in one process, so in 6
#          pytest-xdist workers (compiling in parallel) when its wheels are in .device-carry/wheels
#          (pip download --no-deps pytest-xdist==3.8.* execnet -d .device-carry/wheels; ~3 min on an H100),
#          then those that failed (out of memory among six, on an 80 GB card) again in one process (~3 min);
#          each test's outcome in $OUT/triton_tests.log and triton_tests_rerun.log;
#   tests-hybrid  the kernel tests at hybrid models' block sizes (48/80-token blocks, head size 64) and the
#          speculative steps, each test in its own process with CUDA_LAUNCH_BLOCKING=1, so that a fault is
#          reported by the kernel that made it and does not fail the tests after it (~3 min; not by default);
#   statetests  the STEPQuant step tests at serving shapes, compiled (exact and fast fits; the writeback on its
#          own stream, eagerly and in a CUDA graph; the KDA step);
#   bench  the kernel benchmarks, benchmarks/oscar_kernels.py (~4 min);
#   bench-hybrid  only its decode and extend at hybrid models' block sizes and its decode against the split
#          count, the rest kept from the saved results (~2 min; not by default);
#   check  the CUDA check in real vLLM, six engines (BF16, OSCAR INT2 and the tiered artifact through the
#          kernels and the reference ops), scripts/cuda_check.py (~7 min);
#   graphs OSCAR decode under full CUDA graphs and under vLLM's default (torch.compile, FULL_AND_PIECEWISE)
#          against eager, TRITON_ATTN as the control, scripts/cuda_graph_check.py (~7 min);
#   e2e    the serving job in real vLLM, benchmarks/oscar_vllm_e2e.py (~8 min);
#   e2e-graphs  the same job with full CUDA graphs for decodes in both engines (~8 min; not by default);
#   state  the GDN state pool in real vLLM, scripts/cuda_state_check.py (<= 9 min: it stops
#          starting engines after 520 s; Triton decode vs staged vs FP32 states). On a cold machine
#          the whole check takes two calls: each finished engine is kept in $KEEP on the machine, and the
#          next call there (state, state-graphs, state-oscar) takes it from there instead of
#          running it again; a fresh machine starts with none, rm -rf $KEEP to rerun on a warm one;
#   state-e2e  serving with the packed pools against FP32 states at one cache budget (each pool 260 s:
#          the first engine on a cold machine compiles vLLM's kernels, ~200 s),
#          benchmarks/stepquant_vllm_e2e.py (~8 min; not by default);
#   state-graphs  the pool under full CUDA graphs for decode-only batches against eager, and the
#          refusal of vLLM's default graph mode, scripts/cuda_state_check.py (~6 min; not by default);
#   state-e2e-refit  the same job with the @6 plan refitted every step and every 4 steps (held updates), against
#          FP32 states (~8 min; not by default);
#   state-e2e-batch  the issue's same-batch figure: 512 requests and a cache budget (9 GiB) that holds all of them
#          in every pool, so each pool decodes at batch 512 (the job's steady-state decode steps, timed one by
#          one, under full CUDA graphs for decodes), @6 refitted every step, every 4 and every 8 steps against
#          FP32 states; key cuda-graphs-batch512 (~9 min; not by default);
#   state-e2e-graphs  the state-e2e job with full CUDA graphs for decodes in every engine (~8 min; not by default);
#   state-oscar  OSCAR's Triton kernels on the hybrid's attention layers with the pool, against its reference
#          ops and under graphs, scripts/cuda_state_check.py (~5 min; not by default);
#   state-bench  the split STEPQuant step at the op level, batch 512 (foreground, writeback and both against
#          vLLM's FP32 update), benchmarks/stepquant_kernels.py op (<= 9 min; not by default);
#   state-overlap  the split step in a stack of 27B-like decoder layers at batch 512, the writeback on its own
#          stream, against FP32 updates, benchmarks/stepquant_kernels.py overlap (~4 min; not by default);
#   kda-bench  the KDA row-unit codec's step against vLLM's KDA decode op, benchmarks/kda_kernels.py
#          (~5 min; not by default);
#   accuracy  the default tiered artifact's accuracy rows (benchmarks/accuracy.py, decode regime) through the
#          reference ops and through the Triton kernels on the same weights (house-qwen3's int8-packed copy
#          restored to bf16), with BF16; results: $OUT/accuracy-house-qwen3-cuda.json (~5 min; not by default);
#   fp8    OSCAR on a block-FP8 checkpoint in real vLLM, scripts/cuda_fp8_check.py (~2 min);
#   calib  calibration time at Qwen3-8B shape, benchmarks/calibration_time.py (~1 min);
#   prefix the multi-turn chat job at 32 conversations x 6 turns over a 16K-token document: OSCAR with and
#          without prefix caching and TRITON_ATTN with it, all at gpu_memory_utilization 0.15,
#          benchmarks/prefix_chat.py (~9 min: each engine submits no turn after 70 s and aborts what still runs
#          30 s later; not by default);
#   spec   decode tokens/s with and without ngram speculation, OSCAR (its Triton kernels verify the 1 + k
#          tokens a request in the decode kernel) and TRITON_ATTN, benchmarks/prefix_chat.py (~6 min; not by default);
#   eagle  OSCAR and TRITON_ATTN with an EAGLE-3 head of random weights (nearly nothing accepted: the cost of
#          drafting) and without, one section of its own (gpu-eagle3), benchmarks/prefix_chat.py (~6 min; not by default);
#   spec-graphs  the spec job with full CUDA graphs for uniform decode batches (~8 min; not by default).
# The prefix, spec, eagle and spec-graphs steps add their engines to one JSON kept on the machine
# ($PREFIX_JSON) and copy it to $OUT/prefix_chat.json; bring each copy back and run
#   python -m benchmarks.prefix_chat merge FILE... --doc docs/prefix_caching.md
# (the eagle step's section: it is the same file, its gpu-eagle3 label kept by a plain merge)
set -uo pipefail
cd "$(dirname "$0")/.."
[ -f .gpu-vllm/env.sh ] && source .gpu-vllm/env.sh 0.32.0  # the version explicitly: a bare source passes on this script's arguments
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/kvq_out}
mkdir -p "$OUT"
steps=" ${*:-tests statetests bench check graphs e2e state fp8 calib} "
KEEP=/tmp/kvq_state_keep  # the state check's finished engines, for the next call on this machine
PREFIX_JSON=/tmp/kvq_prefix_chat.json  # the prefix/spec/eagle steps' figures, for the next call on this machine
# inputs the steps read from the working tree: stop before any engine starts if one is missing
need() { [[ -e $2 ]] || { echo "step $1 needs $2 ($3)"; exit 2; }; }
for s in check graphs calib; do
  [[ $steps == *" $s "* ]] && need $s .device-carry/house-qwen3/config.json \
    "python -m scripts.pack_for_gpu .device-carry/house-qwen3"
done
[[ $steps == *" check "* ]] && need check examples/artifacts/house-qwen3-oscar/manifest.json "the calibrated artifact"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
# the serving job's memory share: 0.15 of an H200 (141 GB); an 80 GB card needs 0.2 for BF16 to hold a 33K request
E2E_MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print ($1 < 100000) ? 0.2 : 0.15}')
# the kernel tests: -o addopts="" drops pyproject's loadfile scheduling (the CPU suite's: one module, one worker)
if [[ $steps == *" tests "* ]]; then
  workers=""
  if ls .device-carry/wheels/pytest_xdist-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index .device-carry/wheels/*.whl >/dev/null 2>&1 && workers="-n 6 --dist load"
  fi
  OSCAR_REAL_SHAPES=1 timeout 540 python3 -m pytest -q -rA -p no:cacheprovider -o addopts="" $workers \
    tests/kernels/test_oscar_triton.py > "$OUT/triton_tests.log" 2>&1; echo "triton tests rc=$? ($workers)"
  grep "^FAILED\|^ERROR" "$OUT/triton_tests.log" | head -20; tail -1 "$OUT/triton_tests.log"
  # six workers can together exhaust an 80 GB card (a serving-shape decode test holds up to 36 GiB):
  # the tests that failed run again one after another in one process, the verdict that counts
  mapfile -t failed < <(grep "^FAILED\|^ERROR" "$OUT/triton_tests.log" | sed 's/^[A-Z]* //; s/ - .*//')
  if [ -n "$workers" ] && [ ${#failed[@]} -gt 0 ]; then
    OSCAR_REAL_SHAPES=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" "${failed[@]}" \
      > "$OUT/triton_tests_rerun.log" 2>&1; echo "rerun of ${#failed[@]} in one process rc=$?"
    grep "^FAILED\|^ERROR" "$OUT/triton_tests_rerun.log" | head -20; tail -1 "$OUT/triton_tests_rerun.log"
  fi
fi
if [[ $steps == *" tests-hybrid "* ]]; then
  for t in $(OSCAR_REAL_SHAPES=1 python3 -m pytest -q -p no:cacheprovider -o addopts="" --collect-only \
      tests/kernels/test_oscar_triton.py -k "hybrid_blocks or partial_tiles or head_size_64 or speculative_steps" \
      2>/dev/null | grep "::"); do
    CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" "$t" \
      > "$OUT/t.log" 2>&1; rc=$?; echo "rc=$rc $t"; cat "$OUT/t.log" >> "$OUT/triton_tests_hybrid.log"
    [ $rc -ne 0 ] && grep "^E " "$OUT/t.log" | head -4
  done; rm -f "$OUT/t.log"
fi
if [[ $steps == *" statetests "* ]]; then
  STEPQUANT_REAL_SHAPES=1 timeout 480 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_stepquant_triton.py \
    tests/kernels/test_stepquant_kda.py > "$OUT/stepquant_tests.log" 2>&1; echo "stepquant tests rc=$?"
  tail -15 "$OUT/stepquant_tests.log"
fi
if [[ $steps == *" bench "* ]]; then
  timeout 300 python3 -m benchmarks.oscar_kernels 2>&1 | grep -v "^{" | tail -60; echo "bench rc=$?"
fi
if [[ $steps == *" bench-hybrid "* ]]; then
  timeout 300 python3 -m benchmarks.oscar_kernels --sections hybrid_blocks splits 2>&1 | grep "block_size\|splits"
  echo "bench hybrid rc=$?"
fi
if [[ $steps == *" check "* ]]; then
  timeout 560 python3 -m scripts.cuda_check > "$OUT/cuda_check.log" 2>&1; echo "cuda check rc=$?"
  [ -f "$OUT/cuda_check.json" ] && cat "$OUT/cuda_check.json"
fi
if [[ $steps == *" graphs "* ]]; then
  timeout 560 python3 -m scripts.cuda_graph_check > "$OUT/cuda_graph_check.log" 2>&1; echo "cuda graph check rc=$?"
  [ -f "$OUT/cuda_graph_check.json" ] && cat "$OUT/cuda_graph_check.json" || tail -40 "$OUT/cuda_graph_check.log"
fi
if [[ $steps == *" e2e "* ]]; then
  timeout 560 python3 -m benchmarks.oscar_vllm_e2e --prompt-len 32768 --gen 512 --requests 12 --gpu-mem $E2E_MEM \
    --timeout-s 270 --json "$OUT/oscar_vllm_e2e.json" 2>&1 | grep -v "INFO\|WARNING" | tail -20; echo "e2e rc=$?"
fi
if [[ $steps == *" e2e-graphs "* ]]; then
  timeout 560 python3 -m benchmarks.oscar_vllm_e2e --prompt-len 32768 --gen 512 --requests 18 --gpu-mem $E2E_MEM \
    --cuda-graphs --timeout-s 270 --json "$OUT/oscar_vllm_e2e.json" 2>&1 | grep -v "INFO\|WARNING" | tail -20; echo "e2e graphs rc=$?"
fi
if [[ $steps == *" state "* ]]; then
  timeout 570 python3 -m scripts.cuda_state_check --budget-s 520 --keep $KEEP > "$OUT/cuda_state_check.log" 2>&1
  echo "state check rc=$?"; tail -60 "$OUT/cuda_state_check.log"
  [ -f "$OUT/cuda_state_check.json" ] && cat "$OUT/cuda_state_check.json"
fi
if [[ $steps == *" state-e2e "* ]]; then
  timeout 580 python3 -m benchmarks.stepquant_vllm_e2e --requests 1024 --prompt-len 256 --gen 128 --kv-gib 2 \
    --timeout-s 260 --pools fp32 int6 stepquant6 --json "$OUT/stepquant_vllm_e2e.json" 2>&1 \
    | grep -v "INFO\|WARNING" | tail -12; echo "state e2e rc=$?"
fi
if [[ $steps == *" state-e2e-refit "* ]]; then
  timeout 580 python3 -m benchmarks.stepquant_vllm_e2e --requests 1024 --prompt-len 256 --gen 128 --kv-gib 2 \
    --timeout-s 260 --pools fp32 stepquant6 stepquant6-refit4 --json "$OUT/stepquant_vllm_e2e_refit.json" 2>&1 \
    | grep -v "INFO\|WARNING" | tail -12; echo "state e2e refit rc=$?"
fi
if [[ $steps == *" state-e2e-batch "* ]]; then
  timeout 580 python3 -m benchmarks.stepquant_vllm_e2e --requests 512 --prompt-len 256 --gen 128 --kv-gib 9 \
    --timeout-s 130 --pools fp32 stepquant6 stepquant6-refit4 stepquant6-refit8 --cuda-graphs --label cuda-graphs-batch512 \
    --json "$OUT/stepquant_vllm_e2e_batch.json" 2>&1 | grep -v "INFO\|WARNING" | tail -12; echo "state e2e batch rc=$?"
fi
if [[ $steps == *" state-graphs "* ]]; then
  timeout 570 python3 -m scripts.cuda_state_check check --budget-s 520 --keep $KEEP \
    --only stepquant_mixed stepquant_mixed_graphs uniform_int6_default_graphs > "$OUT/cuda_state_check.log" 2>&1
  echo "state graphs rc=$?"; tail -40 "$OUT/cuda_state_check.log"
  [ -f "$OUT/cuda_state_check.json" ] && cat "$OUT/cuda_state_check.json"
fi
if [[ $steps == *" state-oscar "* ]]; then
  timeout 570 python3 -m scripts.cuda_state_check check --budget-s 520 --keep $KEEP \
    --only stepquant_mixed oscar_stepquant_mixed oscar_stepquant_mixed_graphs \
    oscar_stepquant_mixed_staged > "$OUT/cuda_state_check.log" 2>&1
  echo "state oscar rc=$?"; tail -40 "$OUT/cuda_state_check.log"
  [ -f "$OUT/cuda_state_check.json" ] && cat "$OUT/cuda_state_check.json"
fi
if [[ $steps == *" state-bench "* ]]; then
  timeout 540 python3 -m benchmarks.stepquant_kernels op --budget-s 200 --json "$OUT/stepquant_kernels_op.json" 2>&1 \
    | grep -v "INFO\|WARNING" | tail -30; echo "state bench rc=$?"
fi
if [[ $steps == *" state-overlap "* ]]; then
  timeout 540 python3 -m benchmarks.stepquant_kernels overlap --json "$OUT/stepquant_kernels_overlap.json" \
    --json "$OUT/stepquant_kernels_op.json" 2>&1 | grep -v "INFO\|WARNING" | tail -20; echo "state overlap rc=$?"
fi
if [[ $steps == *" kda-bench "* ]]; then
  timeout 540 python3 -m benchmarks.kda_kernels --json "$OUT/kda_kernels.json" 2>&1 | grep -v "INFO\|WARNING" \
    | tail -20; echo "kda bench rc=$?"
fi
if [[ $steps == *" state-e2e-graphs "* ]]; then
  timeout 580 python3 -m benchmarks.stepquant_vllm_e2e --requests 1024 --prompt-len 256 --gen 128 --kv-gib 2 \
    --cuda-graphs --timeout-s 260 --json "$OUT/stepquant_vllm_e2e.json" 2>&1 | grep -v "INFO\|WARNING" | tail -12
  echo "state e2e graphs rc=$?"
fi
if [[ $steps == *" accuracy "* ]]; then
  ACC_MODEL=/tmp/kvq_accuracy/house-qwen3  # the directory's name picks examples/artifacts/house-qwen3-*
  KVQ_CUDA_MODEL=$ACC_MODEL python3 -c "from scripts.cuda_check import make_model; make_model()"
  cp .device-carry/house-qwen3/tokenizer*.json $ACC_MODEL/
  timeout 560 python3 -m benchmarks.accuracy --model $ACC_MODEL --label cuda --both-kernels --dtype bfloat16 \
    --variants bf16 "OSCAR tiers chosen by calibration, 80 B (the default)" > "$OUT/accuracy.log" 2>&1
  echo "accuracy rc=$?"; grep -v "INFO\|WARNING" "$OUT/accuracy.log" | tail -8
  cp benchmarks/results/accuracy-house-qwen3-cuda.json "$OUT/" 2>/dev/null
fi
if [[ $steps == *" fp8 "* ]]; then
  timeout 240 python3 -m scripts.cuda_fp8_check > "$OUT/cuda_fp8_check.log" 2>&1; echo "fp8 check rc=$?"
  [ -f "$OUT/cuda_fp8_check.json" ] && cat "$OUT/cuda_fp8_check.json"
fi
if [[ $steps == *" calib "* ]]; then
  timeout 420 python3 -m benchmarks.calibration_time --random-shape qwen3-8b --device cuda --dtype bfloat16 \
    --tokenizer .device-carry/house-qwen3 --json "$OUT/calibration-time-gpu.json" 2>&1 | tail -3
  echo "calib rc=$?"
fi
prefix_chat() {  # one prefix_chat.py job: step name, step time limit, then the job's arguments
  local step=$1 limit=$2; shift 2
  timeout "$limit" python3 -m benchmarks.prefix_chat --json "$PREFIX_JSON" "$@" 2>&1 | grep -v "INFO\|WARNING" \
    | tail -40; echo "$step rc=${PIPESTATUS[0]}"
  [ -f "$PREFIX_JSON" ] && cp "$PREFIX_JSON" "$OUT/prefix_chat.json"
}
if [[ $steps == *" prefix "* ]]; then
  prefix_chat prefix 560 --jobs chat --budget-s 70 --timeout-s 180
fi
if [[ $steps == *" spec "* ]]; then
  prefix_chat spec 560 --jobs spec --timeout-s 135
fi
if [[ $steps == *" eagle "* ]]; then
  prefix_chat eagle 560 --jobs eagle --label gpu-eagle3 --timeout-s 150
fi
if [[ $steps == *" spec-graphs "* ]]; then
  prefix_chat spec-graphs 560 --jobs spec --cuda-graphs --label gpu-graphs --timeout-s 135
fi
