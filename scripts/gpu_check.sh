#!/usr/bin/env bash
# The fp8 GPU checks in one command on a bare CUDA machine: a Python with CUDA torch and triton,
# no Transformer Engine, no vLLM, no Docker image, nothing installed (`pip install -e .` is not
# needed: the repository root goes on PYTHONPATH). Only pytest and safetensors (the golden
# vectors) must import; the script says so instead of installing anything.
#
#   bash scripts/gpu_check.sh                 # compiled Triton kernels, GEMMs, FP8 linear, syncs
#   PYTHON=/opt/venv/bin/python bash scripts/gpu_check.sh -x -k gemm   # extra pytest args
#   JETRL_RUN_SLOW=1 bash scripts/gpu_check.sh   # also the slow cases (e.g. 131k-token offsets)
#
# Runs with TRITON_INTERPRET unset, so every `triton` test runs the compiled kernels and every
# `gpu` test runs (CUDA graphs, torch.cuda.set_sync_debug_mode("error") over the trainer's FP8
# linear, amax = 1e-37 scales vs the reference), then (no pytest arguments) the MoE layer benchmark
# benchmarks/gpu/bench_moe_layer.py: table and verdicts printed, its record written to
# $JETRL_BENCH_DIR/bench_moe_layer.json (default benchmarks/gpu/results/).
# Exit code: pytest's, else the benchmark's; 2 without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
unset TRITON_INTERPRET

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

tests=(tests/fp8/test_triton_kernels.py tests/fp8/test_triton_large_offsets.py
  tests/fp8/test_fp8_gemm_backends.py tests/fp8/test_fp8_dispatch.py
  tests/fp8/test_fp8_serving_path.py tests/fp8/test_fp8_linear.py
  tests/fp8/test_fp8_linear_sync_free.py tests/fp8/test_sync_check.py
  tests/fp8/test_fp8_experts.py tests/fp8/test_fp8_experts_triton.py
  tests/fp8/test_quantizer_fused.py tests/fp8/test_fp8_experts_layer.py
  tests/fp8/test_fp8_weight_cache.py tests/fp8/test_fp8_linear_plan.py
  tests/fp8/test_fp8_linear_inventory.py tests/vllm_patch/test_moe_inventory.py
  tests/vllm_patch/test_serving_bits.py tests/vllm_patch/test_serving_inventory.py
  tests/invariant/test_invariant_kernels.py tests/invariant/test_invariant_attention_kernel.py
  tests/invariant/test_invariant_kernels_gpu.py)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" -m pytest -ra -p no:cacheprovider "${tests[@]}" "$@" || exit
# Then, once the kernels pass, the MoE layer benchmark (ours vs vLLM's block-FP8 MoE where vLLM
# imports, vs BF16; exits 1 if ours != the training forward). Skipped with JETRL_GPU_BENCH=0 or
# when pytest arguments were given (a narrowed run checks only what it names).
[ "${JETRL_GPU_BENCH:-1}" = 0 ] || [ $# -gt 0 ] && exit 0
exec "$py" benchmarks/gpu/bench_moe_layer.py \
  --json "${JETRL_BENCH_DIR:-benchmarks/gpu/results}/bench_moe_layer.json"
