#!/usr/bin/env bash
# The test command: set up .venv if needed, then run the default suite.
# Optional tiers (gpu, vllm, nemo_rl) skip with a reason when their dependency is absent;
# extra pytest arguments pass through (e.g. `bash scripts/test.sh -k fp8`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest "$@"
