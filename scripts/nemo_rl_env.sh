# Sourced by scripts/setup_nemo_rl_env.sh and scripts/test_nemo_rl.sh: where the NeMo-RL tier's
# pieces live for one upstream tree. `nemo_rl_env TREE` sets
#   NEMO_RL_TREE_DIR      NeMo-RL's source ($JETRL_NEMO_RL_UPSTREAM or ../shared/upstream/nemo-rl)/TREE
#   NEMO_RL_VLLM_VERSION  the vLLM that tree ships (v0.7.0: 0.20.0; main-*: 0.25.1)
#   NEMO_RL_VENV          its vLLM CPU env (.venv-vllm020 / .venv-vllm025; override with
#                         VENV_VLLM020 / VENV_VLLM025)
#   NEMO_RL_OVERLAY       the pinned dependency overlay (.venv-nemo-rl/site; $JETRL_NEMO_RL_OVERLAY)
#   NEMO_RL_PYTHONPATH    repo : overlay : NeMo-RL tree (the repo first: nemo_jetrl from this checkout)
nemo_rl_env() {
    local tree=$1 repo
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local upstream="${JETRL_NEMO_RL_UPSTREAM:-$repo/../shared/upstream/nemo-rl}"
    case "$tree" in
        v0.7.0)
            NEMO_RL_VLLM_VERSION=0.20.0
            NEMO_RL_VENV="${VENV_VLLM020:-$repo/.venv-vllm020}" ;;
        main-*)
            NEMO_RL_VLLM_VERSION=0.25.1
            NEMO_RL_VENV="${VENV_VLLM025:-$repo/.venv-vllm025}" ;;
        *)
            echo "nemo_rl_env: unknown NeMo-RL tree '$tree' (v0.7.0 or main-<sha>)" >&2
            return 2 ;;
    esac
    NEMO_RL_TREE_DIR="$(cd "$upstream" 2>/dev/null && pwd)/$tree"
    NEMO_RL_OVERLAY="${JETRL_NEMO_RL_OVERLAY:-$repo/.venv-nemo-rl/site}"
    NEMO_RL_PYTHONPATH="$repo:$NEMO_RL_OVERLAY:$NEMO_RL_TREE_DIR"
    export NEMO_RL_TREE_DIR NEMO_RL_VLLM_VERSION NEMO_RL_VENV NEMO_RL_OVERLAY NEMO_RL_PYTHONPATH
}
