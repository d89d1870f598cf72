#!/usr/bin/env bash
# The wheel set for a bare GPU image (docs/gpu.md): every pin of scripts/gpu_wheels.txt as a
# cp312 / manylinux x86_64 (or pure-Python) wheel in DEST, nothing else there, under 40 MiB.
#
#   bash scripts/gpu_wheels.sh [DEST]      # default .cache/gpu-wheels (git-ignored)
#
# Idempotent: a wheel already in DEST whose sha256 is the pinned one is kept, a pin without one
# is downloaded (`pip download --no-deps --only-binary=:all:`, one call for all of them), a wheel
# no pin names (an older version) is removed. Ends with the set's total size; exit 1 when a pin is
# missing, a hash differs, the set holds torch/triton/nvidia-* or it is over
# JETRL_GPU_WHEELS_MAX_MIB (default 40). PYTHON picks the interpreter that runs pip (default
# .venv/bin/python, else python3); it need not be 3.12.
#
# JETRL_GPU_WHEELS_PY=3.11 (any X.Y but 3.12) fetches the same pins for that Python instead, into
# DEST (give another folder): the CPU test's stand-in set, since a cp312 extension cannot load in
# this machine's 3.11. The sha256 pins are those of the cp312 set; another Python's compiled wheels
# differ, so that set is checked by name and version only.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.cache/gpu-wheels}
req=${JETRL_GPU_WHEELS_REQ:-scripts/gpu_wheels.txt}
max_mib=${JETRL_GPU_WHEELS_MAX_MIB:-40}
pyver=${JETRL_GPU_WHEELS_PY:-3.12}
py=${PYTHON:-}
if [[ -z "$py" ]]; then
  if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
mkdir -p "$dest"

# plan|check REQ DEST [MAX_MIB]: "plan" removes stale wheels and prints the requirement lines
# (with their hashes) that have no verified wheel in DEST; "check" verifies the whole set.
wheelset() {
  "$py" - "$@" <<'PY'
import hashlib
import re
import sys
from pathlib import Path

mode, req, dest, pyver = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
hashed = pyver == "3.12"  # the pinned sha256 are the cp312 set's
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()  # noqa: E731
FORBIDDEN = re.compile(r"^(torch|triton|nvidia_.*)$")

pins = {}  # normalized name -> (version, {sha256}, requirement line)
for raw in req.read_text().splitlines():
    line = raw.split("#", 1)[0].strip()
    if not line:
        continue
    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)((?:\s+--hash=sha256:[0-9a-f]{64})*)", line)
    if not m:
        sys.exit(f"gpu_wheels: {req}: not 'name==version [--hash=sha256:...]': {raw!r}")
    name = norm(m[1])
    if FORBIDDEN.match(name):
        sys.exit(f"gpu_wheels: {req} pins {m[1]}: never carry torch/triton/nvidia-* (the image has them)")
    if name in pins:
        sys.exit(f"gpu_wheels: {req} pins {m[1]} twice")
    hashes = set(re.findall(r"sha256:([0-9a-f]{64})", m[3])) if hashed else set()
    pins[name] = (m[2], hashes, line if hashed else f"{m[1]}=={m[2]}")

def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()

have = {}  # normalized name -> [wheel paths]
for whl in sorted(dest.glob("*.whl")):
    dist, version = whl.name.split("-")[:2]
    pin = pins.get(norm(dist))
    if pin is None or norm(version) != norm(pin[0]):
        if mode == "plan":
            print(f"gpu_wheels: removing {whl.name} (no pin names it)", file=sys.stderr)
            whl.unlink()
            continue
        sys.exit(f"gpu_wheels: {whl} is not in {req}")
    have.setdefault(norm(dist), []).append(whl)

bad = []
for name, (version, hashes, line) in pins.items():
    found = have.get(name, [])
    ok = len(found) == 1 and (not hashes or sha256(found[0]) in hashes)
    if mode == "plan":
        if not ok:
            for whl in found:
                whl.unlink()
            print(line)
    elif not ok:
        bad.append(f"{name}=={version}: " + (f"{len(found)} wheels" if len(found) != 1 else f"sha256 of {found[0].name} not pinned"))
if mode == "check":
    if bad:
        sys.exit("gpu_wheels: " + "; ".join(bad))
    total = sum(p.stat().st_size for ps in have.values() for p in ps)
    max_mib = float(sys.argv[5])
    print(f"gpu_wheels: {len(pins)} wheels in {dest}, {total / 2**20:.1f} MiB (limit {max_mib:g} MiB)")
    if total > max_mib * 2**20:
        sys.exit(f"gpu_wheels: the set is {total / 2**20:.1f} MiB, over {max_mib:g} MiB")
PY
}

missing=$(wheelset plan "$req" "$dest" "$pyver")
if [[ -n "$missing" ]]; then
  tmp=$(mktemp)
  trap 'rm -f "$tmp"' EXIT
  printf '%s\n' "$missing" >"$tmp"
  echo "gpu_wheels: downloading $(wc -l <"$tmp") wheel(s) for Python $pyver into $dest"
  platforms=()
  for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
    manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 \
    manylinux_2_5 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
  done
  # --no-deps: the pins are the whole set (a resolver would pull numpy, typer, httpx, ... that
  # the collection test shows are not needed). Hash-pinned lines make pip check each download.
  if ! log=$("$py" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}" \
    -d "$dest" -r "$tmp" 2>&1); then
    printf '%s\n' "$log" >&2
    echo "gpu_wheels: pip download failed (is the package registry reachable? pins: $req)" >&2
    exit 1
  fi
fi
wheelset check "$req" "$dest" "$pyver" "$max_mib"
