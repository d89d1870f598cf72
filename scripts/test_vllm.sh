#!/usr/bin/env bash
# Run the vLLM tier (tests marked `vllm`) in .venv-vllm (or $VLLM_VENV), the environment made
# by scripts/setup_vllm_env.sh. Extra arguments go to pytest.
#
#   bash scripts/setup_vllm_env.sh      # once (~3.5 min, ~3.5 GB)
#   bash scripts/test_vllm.sh           # the tier (one real engine; a few minutes on 2 cores)
#   VLLM_VERSION=0.20.0 VLLM_VENV=.venv-vllm020 bash scripts/setup_vllm_env.sh   # vLLM 0.20
#   VLLM_VENV=.venv-vllm020 bash scripts/test_vllm.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "no vLLM environment at $VENV: run bash scripts/setup_vllm_env.sh first" >&2
    exit 2
fi
# vLLM's CPU build sizes its KV cache from host memory: keep it small on shared machines.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# OpenMP core pinning: the tests' fixtures choose a value that pins nothing (vLLM's default
# reserves and pins cores, which starves everything else on a 2-core machine; the value that
# avoids it differs by vLLM version: nemo_jetrl.vllm_patch.compat.cpu_omp_threads_bind).
cd "$REPO"
# Two pytest-xdist workers (JETRL_TEST_WORKERS, 0 = one process), each file in one worker (its
# engines, module-scoped, start once): an engine start is one Python thread most of the time, so
# two at once use both cores (0.32 tier, one OpenMP thread each: 800 s -> 436 s, docs/ci_times.md).
# An environment made before pytest-xdist was in the dev extra gets it here. One OpenMP thread per
# process unless set (scripts/test.sh says why).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
workers=${JETRL_TEST_WORKERS:-2}
case "$workers" in
    ''|*[!0-9]*) echo "test_vllm.sh: JETRL_TEST_WORKERS=$workers: use a whole number of pytest workers (0: one process)" >&2; exit 2 ;;
esac
if ! "$VENV/bin/python" -c "import xdist" 2>/dev/null; then
    source "$REPO/scripts/pip_retry.sh"
    pip_retry "$VENV/bin/python" install -q pytest-xdist
fi
start=$(date +%s)
rc=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=20 \
    -n "$workers" --dist loadfile \
    tests/vllm_patch tests/backends/test_local_vllm.py tests/backends/test_local_vllm_moe.py \
    tests/backends/test_local_vllm_seq_len.py \
    tests/runs/test_faults_stale_rollout_vllm.py "$@" || rc=$?
echo "[test_vllm] finished in $(( $(date +%s) - start )) s"
exit $rc
