#!/usr/bin/env bash
# What a machine with one NVIDIA GPU checks, in one run sized for a short loan of it
# (docs/benchmarks.md §10), the GPU path's aims first: the lossless tests on CUDA with graphs and
# fused elementwise kernels on (tiny models built on the device); `specserve bench decode` at
# batches 1 and 16 on Llama-3-8B's shape (the manual capture fused and unfused, torch.compile's
# reduce-overhead, Hugging Face's compiled `generate`, the bandwidth limit); the reference target
# with its drafts on chat prompts at batch 1, then 16; the image generator only when asked.
#
#   bench/cuda_checks.sh [OUT_DIR]        # from the repository root, specserve importable
#
# TEST_SECONDS, DISTRIBUTION_SECONDS, DECODE_8B_SECONDS, CHAT_SECONDS and IMAGEGEN_SECONDS (0:
# skipped, the default) bound the parts, together under one 600 s call; each writes its log into
# OUT_DIR.
set -u
out=${1:-cuda-checks}
python=${PYTHON:-python3}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
"$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$out/gpu.txt"
cat "$out/gpu.txt"
decode() {   # decode SECONDS NAME ARGS...: one bench decode run, its JSON and log named NAME
  local seconds=$1 name=$2
  shift 2
  timeout "$seconds" "$python" -m specserve.cli.main bench decode --tokens 64 --prompt-len 128 \
    --budget-s $((seconds * 2 / 3)) --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?"; tail -12 "$out/$name.log"
}
SPECSERVE_TEST_DEVICE=cuda timeout "${TEST_SECONDS:-130}" "$python" -m pytest -q -rf -m "not reference" -p no:cacheprovider \
  tests/replicas/test_rejection_sampler.py::test_greedy_choices_wait_for_the_device_once_for_every_request \
  tests/replicas/test_rejection_sampler.py::test_sampled_choices_wait_for_the_device_once_for_every_request \
  tests/replicas/test_logprobs.py::test_token_logprobs_wait_for_the_device_once \
  tests/replicas/model/test_transfer.py tests/replicas/test_target.py tests/replicas/test_chain_builder.py \
  tests/replicas/test_rejection_sampler.py::test_a_sampled_verify_waits_for_the_device_a_fixed_number_of_times_a_row_it_walks \
  tests/replicas/test_draft_server.py::test_a_served_head_captures_its_graphs_before_its_first_proposal \
  tests/replicas/test_draft_server.py::test_a_served_draft_lm_reserves_its_cache_and_captures_its_graphs_at_start \
  tests/replicas/model/test_cuda_graphs.py tests/replicas/model/test_fused_elementwise.py tests/replicas/model/test_llama_forward.py \
  tests/replicas/test_head_graphs.py tests/replicas/test_greedy_equality.py \
  > "$out/tests.log" 2>&1
echo "tests: exit $?"; grep -E "^(FAILED|ERROR) " "$out/tests.log" | head -20; tail -1 "$out/tests.log"
# The distribution tests last and apart, one line a test: a timeout still leaves those that ran.
SPECSERVE_TEST_DEVICE=cuda timeout "${DISTRIBUTION_SECONDS:-40}" "$python" -m pytest -v -rf -m "not reference" \
  -p no:cacheprovider tests/replicas/test_sampling_distribution.py > "$out/distribution.log" 2>&1
echo "distribution tests: exit $?"; grep -cE "PASSED|FAILED" "$out/distribution.log"; grep FAILED "$out/distribution.log" | head -5
# Batch 16 in the same run: each row kind runs at both batches before the next kind, so the
# compiled rows (the longest, last) are what a short budget drops, and the 8B model loads once.
decode "${DECODE_8B_SECONDS:-240}" decode-8b --shapes 8b --batches 1,16 --profile --no-chat \
  --rows specserve-graphs,specserve-graphs-unfused,replay,specserve-compiled,hf-static-compiled
# The chat rows need the reference target's real weights: dequantised here when the GGUF's package is installed.
"$python" -m specserve.cli.main models fetch > "$out/fetch.log" 2>&1; echo "models fetch: exit $?"
decode "${CHAT_SECONDS:-150}" decode-reference --shapes reference --batches 1,16 --chat --rows specserve-graphs
if [ "${IMAGEGEN_SECONDS:-0}" -gt 0 ]; then
  # The ADT-Tree paper's setting on its own hardware kind: the image generator, one picture at a time.
  timeout "$IMAGEGEN_SECONDS" "$python" -m specserve.cli.main bench imagegen --device cuda --pictures 10 \
    --tree 4,4,40 --out "$out/bench-imagegen.json" > "$out/imagegen.log" 2>&1
  echo "imagegen: exit $?"; tail -5 "$out/imagegen.log"
fi
