#!/usr/bin/env bash
# Run the GPU tiers inside the nemo-jetrl image (docker/Dockerfile), on a machine with an
# NVIDIA GPU (H100 for the blockwise-FP8 TE paths). Docker:
#
#   docker run --gpus all --rm --ipc=host --shm-size=64g --ulimit memlock=-1 \
#     -v $HOME/.cache/huggingface:/root/.cache/huggingface -e HF_TOKEN \
#     nemo-jetrl:latest bash scripts/run_gpu_tests.sh [extra pytest args]
#
# SLURM with pyxis/enroot (the image imported as a .sqsh, docs/cluster.md):
#
#   srun -N1 --gpus-per-node=1 --container-image=$PWD/nemo-jetrl.sqsh \
#     --container-mounts=$HF_HOME:$HF_HOME --container-workdir=/opt/nemo-jetrl \
#     bash scripts/run_gpu_tests.sh [extra pytest args]
#
# Each tier runs with the Python environment that has its dependencies:
#   1. megatron + gpu  -> (not the nemo_rl ones: tier 4) the Megatron policy worker venv (megatron-core, Transformer Engine):
#      real TE recipe, TE FP8 weights (fp8_param) re-laid out for refit with the parity check,
#      the CPU megatron tests again on this megatron-core, and every other `gpu` test;
#   2. fp8 kernels     -> the same venv (CUDA torch + triton): tests/fp8/test_fp8_dispatch.py,
#      test_triton_kernels.py, test_fp8_gemm_backends.py and test_fp8_serving_path.py in full, so
#      the Triton quantizers and block GEMM run compiled on the GPU (TRITON_INTERPRET is unset),
#      dispatch picks DeepGEMM / scaled_mm / triton for real, and CUDA graphs are captured;
#   3. vllm            -> the image's vLLM worker venv (NeMo-RL's VllmGenerationWorker env, or
#      $VLLM_PYTHON): every `vllm` test on the CUDA build, except tests/vllm_patch/test_vllm_kv_cpu.py
#      (it checks what vLLM's CPU build does with an FP8 KV cache);
#   4. nemo_rl (+ gpu) -> the driver env (/opt/nemo_rl_venv, NeMo-RL + Ray): two GRPO steps
#      through `run_nemo_rl` with the jetrl_kv recipe (downloads Qwen/Qwen3-0.6B once).
# Exit code: non-zero if any tier failed (all tiers run).
set -uo pipefail
cd "$(dirname "$0")/.."

venv_dir=${NEMO_RL_VENV_DIR:-/opt/ray_venvs}
mcore_py="$venv_dir/nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker/bin/python"
driver_py=${DRIVER_PYTHON:-/opt/nemo_rl_venv/bin/python}
vllm_py=${VLLM_PYTHON:-"$venv_dir/nemo_rl.models.generation.vllm.vllm_worker.VllmGenerationWorker/bin/python"}
# The GPU tiers must run the compiled Triton kernels, never the CPU interpreter.
unset TRITON_INTERPRET

python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
  || "$driver_py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "run_gpu_tests: no CUDA GPU visible (docker run --gpus all ..., or srun --gpus-per-node=1 ...)" >&2; exit 2; }

status=0
run_tier() {
  local name=$1 py=$2; shift 2
  if [[ ! -x "$py" ]]; then
    echo "run_gpu_tests: [$name] python not found: $py (are you inside the nemo-jetrl image?)" >&2
    status=1
    return
  fi
  echo "=== [$name] $py -m pytest $*"
  "$py" -m pytest -ra "$@" || status=1
}

fp8_kernel_tests=(tests/fp8/test_fp8_dispatch.py tests/fp8/test_triton_kernels.py
  tests/fp8/test_fp8_gemm_backends.py tests/fp8/test_fp8_serving_path.py)
# the nemo_rl tests (the end-to-end GRPO run among them) are tier 4's, with NeMo-RL's driver env
run_tier "megatron+gpu" "$mcore_py" -m "(gpu or megatron) and not nemo_rl" tests \
  "${fp8_kernel_tests[@]/#/--ignore=}" "$@"
run_tier "fp8 kernels" "$mcore_py" "${fp8_kernel_tests[@]}" "$@"
run_tier "vllm" "$vllm_py" -m vllm tests --ignore=tests/vllm_patch/test_vllm_kv_cpu.py "$@"
run_tier "nemo_rl" "$driver_py" -m "nemo_rl" tests/backends/test_nemo_rl_backend.py "$@"

if [[ $status -ne 0 ]]; then
  echo "run_gpu_tests: some tier failed" >&2
fi
exit $status
