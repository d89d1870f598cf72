#!/usr/bin/env bash
# The Python source of a vLLM release that has no CPU build (0.33.0: CUDA wheel only), for the
# test that runs its kernel registry and selection code with our patch under a CUDA platform
# stand-in (tests/vllm_patch/test_vllm033_selection.py). Idempotent and cached:
#   1. `pip download vllm==X --no-deps` into $JETRL_WHEEL_CACHE (default .cache/wheels), skipped
#      when the wheel is there; its sha256 is checked against the pin below;
#   2. only `vllm/*.py` unzipped into .cache/vllm-src/X (~57 MB), skipped when done before.
# Prints the source directory. Cost on a fresh machine: one 336 MB download + ~1 s unzip.
#
#   bash scripts/fetch_vllm_src.sh            # 0.33.0
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/pip_retry.sh"
VERSION="${VLLM_SRC_VERSION:-0.33.0}"
case "$VERSION" in
  0.33.0) SHA256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa ;;
  *) echo "fetch_vllm_src: no pinned sha256 for vLLM $VERSION (add it here)" >&2; exit 2 ;;
esac
WHEEL_DIR="${JETRL_WHEEL_CACHE:-$REPO/.cache/wheels}"
SRC="$REPO/.cache/vllm-src/$VERSION"
WHEEL="$WHEEL_DIR/vllm-$VERSION-cp38-abi3-manylinux_2_28_x86_64.whl"
PYTHON="${PYTHON:-python3}"
if [ -f "$SRC/.complete" ]; then
  echo "$SRC"
  exit 0
fi
mkdir -p "$WHEEL_DIR"
if [ ! -f "$WHEEL" ]; then
  pip_retry "$PYTHON" download --quiet "vllm==$VERSION" --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.11 -d "$WHEEL_DIR" >&2
fi
echo "$SHA256  $WHEEL" | sha256sum --check --quiet - >&2 \
  || { echo "fetch_vllm_src: $WHEEL does not match the pinned sha256" >&2; exit 1; }
rm -rf "$SRC"
mkdir -p "$SRC"
"$PYTHON" - "$WHEEL" "$SRC" <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
EOF
touch "$SRC/.complete"
echo "$SRC"
