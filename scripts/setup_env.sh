#!/usr/bin/env bash
# Create (or update) the project's CPU environment in .venv.
# torch is pinned to 2.13.0 through constraints-cpu.txt so pip never resolves a multi-GB CUDA
# build on CPU machines. Extras: dev (pytest, ruff), local (CPU backend), megatron, triton.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip_retry.sh  # every pip call retries on failure (JETRL_PIP_ATTEMPTS, default 3)
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# scripts/locks/default.txt: every other package at the version whose suite last passed
# (scripts/lock_envs.py; an unpinned resolve changes what CI tests against overnight).
# JETRL_NO_LOCK=1 resolves afresh, to move the lock (docs/testing.md).
LOCK=scripts/locks/default.txt
[ "${JETRL_NO_LOCK:-}" != 1 ] || LOCK=/dev/null
pip_retry .venv/bin/python install -c constraints-cpu.txt -c "$LOCK" -e '.[dev,local,megatron,triton]' \
  > .venv/pip-install.log 2>&1 || { tail -n 40 .venv/pip-install.log; echo "setup_env: pip install failed (full log: .venv/pip-install.log)" >&2; exit 1; }
# Transformer Engine's recipe module (pure Python, imports with NVTE_PROJECT_BUILDING=1) goes to its
# own directory: inside .venv it would break `import megatron.core.fp8_utils` (TE raises
# RuntimeError/FileNotFoundError, which Megatron does not catch). Tests add it to PYTHONPATH.
if [ ! -d .venv-te-recipe/transformer_engine ]; then
  pip_retry .venv/bin/python install --no-deps --target .venv-te-recipe transformer-engine==2.20.2 \
    >> .venv/pip-install.log 2>&1 || { tail -n 20 .venv/pip-install.log; echo "setup_env: TE recipe install failed" >&2; exit 1; }
fi
# The GPU image's Triton (its version's home: scripts/census_cache.py), in its own directory like
# TE's recipe module: scripts/sm90_census.py compiles every kernel for sm_90 with it as well as with
# the installed one, so a kernel the image's compiler refuses fails here, not in a 15-minute GPU call.
gpu_triton=$(sed -n 's/^GPU_IMAGE_TRITON = "\([0-9.]*\)".*/\1/p' scripts/census_cache.py)
[ -n "$gpu_triton" ] || { echo "setup_env: no GPU_IMAGE_TRITON in scripts/census_cache.py" >&2; exit 1; }
if [ ! -d ".venv-triton-gpu/triton-$gpu_triton.dist-info" ]; then
  rm -rf .venv-triton-gpu
  pip_retry .venv/bin/python install --no-deps --target .venv-triton-gpu "triton==$gpu_triton" \
    >> .venv/pip-install.log 2>&1 || { tail -n 20 .venv/pip-install.log; echo "setup_env: GPU image Triton install failed" >&2; exit 1; }
fi
.venv/bin/python -c "import torch, nemo_jetrl; print('env ready: torch', torch.__version__)"
