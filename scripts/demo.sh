#!/usr/bin/env bash
# The main job: set up .venv if needed, then run the end-to-end demo on CPU.
# A first run installs the environment (a few minutes on a fresh machine): pip's progress is
# echoed every few seconds so the wait is never silent; later runs skip straight to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/jetrl ] && .venv/bin/python -c "import nemo_jetrl, transformers, tqdm" 2>/dev/null; then
  echo "demo: environment .venv ready"
else
  echo "demo: installing the environment into .venv (first run only; torch, transformers, ...)"
  bash scripts/setup_env.sh &
  pid=$!
  start=$SECONDS
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    last=$(grep -E '^(Collecting|Downloading|Installing|Building|Successfully)' .venv/pip-install.log 2>/dev/null | tail -n 1 | cut -c1-90 || true)
    echo "demo: install $((SECONDS - start))s: ${last:-starting pip}"
  done
  wait "$pid"
fi
exec .venv/bin/jetrl demo "$@"
