#!/usr/bin/env bash
# The main job: set up .venv if needed, then run the end-to-end demo on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/jetrl demo "$@"
