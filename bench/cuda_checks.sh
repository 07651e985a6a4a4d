#!/usr/bin/env bash
# What a machine with one NVIDIA GPU checks, in one run sized for a short loan of it
# (docs/benchmarks.md §10): the lossless tests on CUDA with graphs on (tiny models built on the
# device), then `specserve bench decode` for Llama-3-8B's shape and the reference target's, then
# `specserve bench imagegen` on the reference image generator.
#
#   bench/cuda_checks.sh [OUT_DIR]        # from the repository root, specserve importable
#
# TEST_SECONDS, BENCH_SECONDS and IMAGEGEN_SECONDS bound the three parts (together under one
# 600 s call); each writes its log into OUT_DIR.
set -u
out=${1:-cuda-checks}
python=${PYTHON:-python3}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
"$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$out/gpu.txt"
cat "$out/gpu.txt"
SPECSERVE_TEST_DEVICE=cuda timeout "${TEST_SECONDS:-200}" "$python" -m pytest -q -m "not reference" -p no:cacheprovider \
  tests/replicas/model/test_cuda_graphs.py tests/replicas/model/test_fused_elementwise.py tests/replicas/model/test_llama_forward.py tests/replicas/test_greedy_equality.py \
  tests/replicas/test_head_graphs.py tests/replicas/test_sampling_distribution.py > "$out/tests.log" 2>&1
echo "tests: exit $?"; tail -3 "$out/tests.log"
timeout "${BENCH_SECONDS:-240}" "$python" -m specserve.cli.main bench decode --shapes 8b,reference --batches 1,16 --profile \
  --tokens 64 --prompt-len 128 --budget-s 140 --out "$out/bench-decode.json" > "$out/bench.log" 2>&1
echo "bench: exit $?"; tail -20 "$out/bench.log"
# The ADT-Tree paper's setting on its own hardware kind: the image generator, one picture at a time.
timeout "${IMAGEGEN_SECONDS:-140}" "$python" -m specserve.cli.main bench imagegen --device cuda --pictures 10 \
  --tree 4,4,40 --out "$out/bench-imagegen.json" > "$out/imagegen.log" 2>&1
echo "imagegen: exit $?"; tail -5 "$out/imagegen.log"
