#!/usr/bin/env bash
# Run the vLLM tier (tests marked `vllm`) in .venv-vllm, the environment made by
# scripts/setup_vllm_env.sh. Extra arguments go to pytest.
#
#   bash scripts/setup_vllm_env.sh      # once (~3.5 min, ~3.5 GB)
#   bash scripts/test_vllm.sh           # the tier (one real engine; a few minutes on 2 cores)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "no vLLM environment at $VENV: run bash scripts/setup_vllm_env.sh first" >&2
    exit 2
fi
# vLLM's CPU build sizes its KV cache from host memory: keep it small on shared machines.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# Do not pin OpenMP threads to cores (the default reserves and pins cores, which starves
# everything else on a 2-core machine).
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
cd "$REPO"
start=$(date +%s)
rc=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_vllm_engine.py tests/test_vllm_compiled.py tests/test_vllm_kernel.py tests/test_vllm_patch_unit.py "$@" || rc=$?
echo "[test_vllm] finished in $(( $(date +%s) - start )) s"
exit $rc
