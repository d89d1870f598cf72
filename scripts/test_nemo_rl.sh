#!/usr/bin/env bash
# Run the NeMo-RL tier (tests marked `nemo_rl`) against NeMo-RL's real source for one upstream
# tree, in the environment scripts/setup_nemo_rl_env.sh makes. Extra arguments go to pytest.
#
#   bash scripts/setup_nemo_rl_env.sh v0.7.0      # once
#   bash scripts/test_nemo_rl.sh v0.7.0           # the tier for NeMo-RL v0.7.0 (vLLM 0.20)
#   bash scripts/test_nemo_rl.sh main-7ea279a -k align
# Tests see the tree as $JETRL_NEMO_RL_TREE (its path: $JETRL_NEMO_RL_TREE_DIR).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/nemo_rl_env.sh"
tree="${1:?usage: test_nemo_rl.sh TREE [pytest args] (TREE: v0.7.0 or main-<sha>)}"
shift
nemo_rl_env "$tree"
if [ ! -x "$NEMO_RL_VENV/bin/python" ] || [ ! -f "$NEMO_RL_OVERLAY/sitecustomize.py" ]; then
    echo "no NeMo-RL tier environment for $tree: run bash scripts/setup_nemo_rl_env.sh $tree first" >&2
    exit 2
fi
export PYTHONPATH="$NEMO_RL_PYTHONPATH"
export JETRL_NEMO_RL_TREE="$tree" JETRL_NEMO_RL_TREE_DIR="$NEMO_RL_TREE_DIR"
# NeMo-RL's import sets Ray's env defaults; keep Ray and vLLM off the 2-core machine's throat.
export RAY_USAGE_STATS_ENABLED=0 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# A tree whose vLLM has no vLLM tier of its own (main's 0.25.1; test.sh's vLLM tiers are 0.32
# and 0.20) also runs the vLLM engine tests marked vllm_in_nemo_rl here (the MoE experts
# kernel's, one engine per module).
marks="nemo_rl"
case "$NEMO_RL_VLLM_VERSION" in
    0.25.*) marks="nemo_rl or vllm_in_nemo_rl" ;;
esac
cd "$REPO"
start=$(date +%s)
rc=0
"$NEMO_RL_VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=20 -m "$marks" tests "$@" || rc=$?
echo "[test_nemo_rl] $tree finished in $(( $(date +%s) - start )) s"
exit $rc
