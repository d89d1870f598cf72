#!/usr/bin/env bash
# One lease of a bare CUDA machine, spent in order of value: the fp8 GPU tests (compiled Triton
# kernels, GEMM backends, CUDA graphs, sync-free FP8 linear), then the benchmarks at reduced
# iteration counts. Each step is bounded by its own timeout so one hang cannot eat the lease,
# and every log is written as it goes to $RESULTS (default benchmarks/gpu/results).
#   bash benchmarks/gpu/device_session.sh [RESULTS_DIR]
# Needs CUDA torch, triton, pytest, safetensors; bench_fp8_linear.py also the package's own
# dependencies (pydantic, omegaconf: a bare CUDA image lacks them; install the wheels first).
# JETRL_{TESTS,PROBE,MOE,QUANT,QUANT_TILES,LINEAR,SERVING,INVARIANT_OPS,LOCAL_GRPO}_S set each step's limit in seconds
# (0 skips it).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-benchmarks/gpu/results}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
# A bare image lacks the package's pure-Python dependencies: wheels installed here beforehand with
#   pip install --target .gpu-deps --python-version 3.12 --only-binary=:all: \
#     --platform manylinux2014_x86_64 pydantic omegaconf pyyaml safetensors
# travel with the tree (run's carry) and go on the path only where the image lacks them.
if ! "$py" -c 'import pydantic, omegaconf, safetensors' 2>/dev/null && [ -d .gpu-deps ]; then
  export PYTHONPATH="$PYTHONPATH:$PWD/.gpu-deps"
fi
step() {  # step NAME SECONDS CMD...: CMD under a timeout (0: skip), log to $out/NAME.log, note its rc
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  [ "$secs" -gt 0 ] || { echo "== $name skipped (limit 0)" | tee -a "$out/summary.txt"; return; }
  echo "== $name (limit ${secs}s): $*" | tee "$out/$name.log"
  timeout -k 5 "$secs" "$@" 2>&1 | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$out/$name.log" "$out/summary.txt"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  git log -1 --format='commit %H' 2>/dev/null; } > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
# Tests: no bench (arguments given), per-test timeout so a hung kernel fails with a stack. The
# 373 tests took ~370 s on an H100 (results/h100_run4-5, mostly Triton compiles): with the
# benchmarks (~110 s) that is over one device call's 600 s, so a lease runs two calls, e.g.
# JETRL_TESTS_S=0 for the second.
step gpu_tests "${JETRL_TESTS_S:-420}" bash scripts/gpu_check.sh -q --timeout 90 -rfE
step probe_scaled_mm "${JETRL_PROBE_S:-60}" "$py" benchmarks/gpu/probe_scaled_mm.py \
  --json "$out/probe_scaled_mm.json"
step bench_moe_layer "${JETRL_MOE_S:-150}" "$py" benchmarks/gpu/bench_moe_layer.py \
  --iters 20 --json "$out/bench_moe_layer.json"
step bench_quantizer "${JETRL_QUANT_S:-60}" "$py" benchmarks/gpu/bench_quantizer_bandwidth.py --iters 20
step bench_quantizer_tiles "${JETRL_QUANT_TILES_S:-30}" "$py" \
  benchmarks/gpu/bench_quantizer_bandwidth.py --sweep-tiles --iters 20
step bench_fp8_linear "${JETRL_LINEAR_S:-90}" "$py" benchmarks/gpu/bench_fp8_linear.py --iters 10
step bench_serving_kernel "${JETRL_SERVING_S:-60}" "$py" benchmarks/gpu/bench_serving_kernel.py \
  --iters 20 --json "$out/bench_serving_kernel.json"
# The batch-invariant ops (issue 37): Triton kernels vs torch's own ops vs the elementwise path.
step bench_invariant_ops "${JETRL_INVARIANT_OPS_S:-60}" "$py" benchmarks/gpu/bench_invariant_ops.py \
  --iters 20 --json "$out/bench_invariant_ops.json"
# Local GRPO per recipe on cuda (demo model, then the ~0.6B Qwen3-shaped one): tmpe exactly 1 for
# jetrl/jetrl_kv, mismatch, step time, tokens/s, invariant-ops share. Needs transformers and
# tokenizers too (add them to the .gpu-deps wheels where the image lacks them).
step bench_local_grpo "${JETRL_LOCAL_GRPO_S:-120}" "$py" benchmarks/gpu/bench_local_grpo.py \
  --steps 3 --json "$out/bench_local_grpo.json"
cat "$out/summary.txt"
