#!/usr/bin/env bash
# The fp8 GPU checks in one command on a bare CUDA machine: a Python with CUDA torch and triton,
# no Transformer Engine, no vLLM, no Docker image, nothing installed (`pip install -e .` is not
# needed: the repository root goes on PYTHONPATH). Only pytest and safetensors (the golden
# vectors) must import; the script says so instead of installing anything. On a lent bare machine
# use benchmarks/gpu/device_session.sh (docs/gpu.md), which carries the package's own dependencies.
#
#   bash scripts/gpu_check.sh                 # compiled Triton kernels, GEMMs, FP8 linear, syncs
#   PYTHON=/opt/venv/bin/python bash scripts/gpu_check.sh -x -k gemm   # extra pytest args
#   JETRL_RUN_SLOW=1 bash scripts/gpu_check.sh   # also the slow cases (e.g. 131k-token offsets)
#   bash scripts/gpu_check.sh --list          # the GPU test modules, one a line; nothing runs
#
# JETRL_GPU_TESTS="a.py b.py" runs those modules instead of the list below. JETRL_TEST_TIMEOUT=N:
# a per-test limit of N seconds (`--timeout N`) where pytest-timeout is installed; without it the
# script says so and runs without one (pytest would exit 4 on an unknown `--timeout`, running no
# test: a `--timeout` among the arguments is dropped the same way). JETRL_GPU_TEST_WORKERS=N: the
# modules run in N pytest-xdist processes sharing the GPU, each module in one of them
# (`--dist loadfile`: its fixtures and order kept), so N compile Triton kernels at once (most of a
# cold run's time); default half the CPU cores, at most 8; 0 or 1: one process, as without xdist.
#
# Runs with TRITON_INTERPRET unset, so every `triton` test runs the compiled kernels and every
# `gpu` test runs (CUDA graphs, torch.cuda.set_sync_debug_mode("error") over the trainer's FP8
# linear, amax = 1e-37 scales vs the reference), then (no pytest arguments) the MoE layer benchmark
# benchmarks/gpu/bench_moe_layer.py: table and verdicts printed, its record written to
# $JETRL_BENCH_DIR/bench_moe_layer.json (default benchmarks/gpu/results/).
# Exit code: pytest's, else the benchmark's; 2 without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.." || exit
py=${PYTHON:-python3}
workers=${JETRL_GPU_TEST_WORKERS:-auto}
case "$workers" in
  auto) workers=$(($(nproc) / 2)); ((workers <= 8)) || workers=8 ;;
  ''|*[!0-9]*) echo "gpu_check: JETRL_GPU_TEST_WORKERS=$workers: use a whole number of pytest workers (0: one process)" >&2; exit 2 ;;
esac
unset TRITON_INTERPRET

tests=(tests/fp8/test_triton_kernels.py tests/fp8/test_triton_large_offsets.py
  tests/fp8/test_fp8_gemm_backends.py tests/fp8/test_fp8_dispatch.py
  tests/fp8/test_fp8_serving_path.py tests/fp8/test_fp8_linear.py
  tests/fp8/test_fp8_linear_sync_free.py tests/fp8/test_sync_check.py
  tests/fp8/test_fp8_experts.py tests/fp8/test_fp8_experts_triton.py
  tests/fp8/test_quantizer_rowcol.py tests/fp8/test_quantizer_flag_and_cast.py
  tests/fp8/test_fp8_experts_layer.py
  tests/fp8/test_fp8_weight_cache.py tests/fp8/test_fp8_linear_plan.py
  tests/fp8/test_fp8_linear_inventory.py tests/vllm_patch/test_moe_inventory.py
  tests/vllm_patch/test_serving_bits.py tests/vllm_patch/test_serving_inventory.py
  tests/invariant/test_invariant_kernels.py tests/invariant/test_invariant_attention_kernel.py
  tests/invariant/test_invariant_kernels_gpu.py tests/fp8/test_split_gemm.py
  tests/fp8/test_fp8_experts_prefill.py tests/fp8/test_linear_host_budget.py
  tests/fp8/test_fp8_graphed_gpu.py tests/backends/test_local_sampling.py
  tests/vllm_patch/test_graph_bindings.py tests/backends/test_local_device.py)
if [[ "${1:-}" == --list ]]; then
  printf '%s\n' "${tests[@]}"
  exit 0
fi
if [[ -n "${JETRL_GPU_TESTS:-}" ]]; then
  read -r -a tests <<<"$JETRL_GPU_TESTS"
fi

"$py" - <<'PY' || exit 2
import importlib.util, sys
import torch
missing = [m for m in ("triton", "pytest", "safetensors") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing {missing} (pip install {' '.join(missing)})")
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU visible to torch")
print(f"gpu_check: {torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}, "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}")
PY

args=("$@")
if ! "$py" -c 'import pytest_timeout' 2>/dev/null; then
  kept=()
  skip_next=0
  for a in "${args[@]}"; do
    if ((skip_next)); then skip_next=0; continue; fi
    case $a in
      --timeout) skip_next=1; echo "gpu_check: pytest-timeout is not installed: '--timeout' dropped" ;;
      --timeout=*) echo "gpu_check: pytest-timeout is not installed: '$a' dropped" ;;
      *) kept+=("$a") ;;
    esac
  done
  args=("${kept[@]}")
  [[ -z "${JETRL_TEST_TIMEOUT:-}" ]] ||
    echo "gpu_check: pytest-timeout is not installed: no per-test limit (JETRL_TEST_TIMEOUT ignored)"
elif [[ -n "${JETRL_TEST_TIMEOUT:-}" ]]; then
  args=(--timeout "$JETRL_TEST_TIMEOUT" "${args[@]}")
fi
if ((workers > 1 && ${#tests[@]} > 1)); then
  if "$py" -c 'import xdist' 2>/dev/null; then
    ((workers <= ${#tests[@]})) || workers=${#tests[@]}  # one module a worker at most
    args=(-n "$workers" --dist loadfile "${args[@]}")
    echo "gpu_check: ${#tests[@]} modules in $workers pytest-xdist workers (JETRL_GPU_TEST_WORKERS)"
  else
    echo "gpu_check: pytest-xdist is not installed: one process (JETRL_GPU_TEST_WORKERS ignored)"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" -m pytest -ra -p no:cacheprovider "${tests[@]}" "${args[@]}" || exit
# Then, once the kernels pass, the MoE layer benchmark (ours vs vLLM's block-FP8 MoE where vLLM
# imports, vs BF16; exits 1 if ours != the training forward). Skipped with JETRL_GPU_BENCH=0 or
# when pytest arguments were given (a narrowed run checks only what it names).
[ "${JETRL_GPU_BENCH:-1}" = 0 ] || [ $# -gt 0 ] && exit 0
exec "$py" benchmarks/gpu/bench_moe_layer.py \
  --json "${JETRL_BENCH_DIR:-benchmarks/gpu/results}/bench_moe_layer.json"
