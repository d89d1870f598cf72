#!/usr/bin/env bash
# Create .venv-trl: this repo (editable, `local` extra) plus TRL, for the benchmark-only anchor
# benchmarks/bench_grpo_vs_trl.py (the package never imports trl). Idempotent; torch pinned by
# constraints-cpu.txt so pip never pulls a CUDA build.
#
# Usage: bash scripts/setup_trl_env.sh [VENV_DIR]   (default: $TRL_VENV or <repo>/.venv-trl)
# Env:   PYTHON=python3.11 (interpreter for the venv)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/pip_retry.sh"
VENV="${1:-${TRL_VENV:-$REPO/.venv-trl}}"
PYTHON="${PYTHON:-python3.11}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip_retry "$VENV/bin/python" install -q -c "$REPO/constraints-cpu.txt" -e "$REPO[local,bench-trl]" \
  > "$VENV/pip-install.log" 2>&1 || { tail -n 40 "$VENV/pip-install.log"; echo "setup_trl_env: pip install failed" >&2; exit 1; }
"$VENV/bin/python" -c "import trl, torch; print('trl env ready: trl', trl.__version__, 'torch', torch.__version__)"
