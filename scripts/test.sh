#!/usr/bin/env bash
# The test command. On a fresh machine it creates both environments it needs:
#   .venv       torch 2.13.0+cpu, megatron-core, triton (interpreter), transformers, tensorboard
#   .venv-vllm  the real vLLM 0.32 CPU build with the patch (scripts/setup_vllm_env.sh)
# and runs:
#   1. the default suite (unit, megatron-core on CPU, Triton interpreter, slow tests included);
#   2. the vLLM tier against a real engine.
# gpu and nemo_rl tests skip with a reason here; they run in the Docker image
# (scripts/run_gpu_tests.sh).
#
# With pytest arguments (e.g. `bash scripts/test.sh -k fp8 -x`) only the default suite runs,
# with those arguments. JETRL_SKIP_VLLM=1 skips the vLLM tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi

rc=0
echo "== default suite (.venv) =="
.venv/bin/python -m pytest -q --runslow || rc=$?
if [ "${JETRL_SKIP_VLLM:-0}" != "1" ]; then
  echo "== vLLM tier (.venv-vllm, real vLLM CPU engine) =="
  if [ ! -x .venv-vllm/bin/python ] || ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
    bash scripts/setup_vllm_env.sh > "${TMPDIR:-/tmp}/jetrl-vllm-setup.log" 2>&1 \
      || { tail -n 40 "${TMPDIR:-/tmp}/jetrl-vllm-setup.log"; echo "test.sh: vLLM environment setup failed" >&2; exit 1; }
  fi
  bash scripts/test_vllm.sh --runslow || rc=$?
fi
exit $rc
