# The host side of benchmarks/gpu/device_session.sh (sourced by it, never run alone): --prepare
# (the sm_90 census and its cache, the wheel set, the source stamp, what a call sends) and
# --collect (a call's files into benchmarks/gpu/results, its Triton cache kept for the next).
# Uses device_session.sh's settings: py, wheels, carry_cache, triton_dir, CARRY_MIB, dry_run.
# shellcheck shell=bash disable=SC2154  # those settings are device_session.sh's

travel_mib() {  # what a call sends: tracked and untracked-not-ignored files, plus carried paths
  local tree carried=0 p
  tree=$({ git ls-files -z -c -o --exclude-standard | xargs -0 stat -c %s -- 2>/dev/null || true; } |
    awk '{s += $1} END {print s + 0}')
  for p in "$@"; do
    [[ -e "$p" ]] && carried=$((carried + $(du -sb "$p" | cut -f1)))
  done
  echo "$tree $carried"
}

prepare() {
  # Every kernel the steps launch, compiled for sm_90 by the GPU image's Triton (3.6.0, from
  # scripts/setup_env.sh) before the call spends a minute on it: a refusal stops here.
  if [[ ! -f .venv-triton-gpu/triton/__init__.py ]]; then
    echo "device_session: no GPU image Triton in .venv-triton-gpu (run scripts/setup_env.sh)" >&2
    return 1
  fi
  # The kernels it compiles travel with the call (carry: $carry_cache), under the cache key the
  # image computes: the steps read them instead of compiling (summary.txt says whether it hit).
  echo "sm_90 census with the GPU image's Triton (scripts/sm90_census.py, ~1 min)"
  mkdir -p "$carry_cache"
  PYTHONPATH=.venv-triton-gpu .venv/bin/python scripts/sm90_census.py \
    --pack-cache "$carry_cache/sm90-census-cache.tar.gz" --cache-root "$triton_dir" | tail -n 4 || {
    echo "device_session: a kernel fails the sm_90 census (above): fix it before the call" >&2
    return 1
  }
  bash scripts/gpu_wheels.sh "$wheels"
  local head dirty
  head=$(git rev-parse HEAD)
  dirty=$(git status --porcelain --untracked-files=normal | wc -l)
  if ((dirty == 0)); then
    echo "commit $head ($(git log -1 --format=%cs)), tree clean" >"$wheels/SOURCE.txt"
  else
    echo "commit $head ($(git log -1 --format=%cs)) + $dirty paths changed or untracked (git status --porcelain)" >"$wheels/SOURCE.txt"
  fi
  echo "source stamp: $(cat "$wheels/SOURCE.txt")"
  mkdir -p "$carry_cache"
  if [[ -f "$carry_cache/triton-cache.tar.gz" ]]; then
    echo "triton cache: $(du -h "$carry_cache/triton-cache.tar.gz" | cut -f1), made under: $(tar -xzOf "$carry_cache/triton-cache.tar.gz" ./STAMP 2>/dev/null || echo '?')"
  else
    echo "triton cache: none yet (the first call compiles every kernel; --collect keeps its cache)"
  fi
  local sizes tree carried total
  sizes=$(travel_mib "$wheels" "$carry_cache")
  tree=${sizes% *} carried=${sizes#* }
  total=$((tree + carried))
  awk -v t="$tree" -v c="$carried" -v m="$CARRY_MIB" 'BEGIN {
    printf "travels: tree %.1f MiB + carried %.1f MiB = %.1f MiB (limit %d MiB)\n", t/1048576, c/1048576, (t+c)/1048576, m }'
  if ((total > CARRY_MIB * 1048576)); then
    echo "device_session: over the ${CARRY_MIB} MiB a call may send: drop the Triton cache or ignore large untracked files" >&2
    return 1
  fi
  dry_run
  cat <<EOF
The call (device tool 'run'):
  command:   bash benchmarks/gpu/device_session.sh "\$OUT"
  timeout_s: 590
  carry:     ["$wheels", "$carry_cache"]
Or two calls on one warm machine (15 min of device time holds ~525 + ~290 s, run 8: 381 + 270): the same carry,
  1. JETRL_PART=47 bash benchmarks/gpu/device_session.sh "\$OUT"   (timeout_s 590)
  2. JETRL_PART=48 JETRL_BUDGET_S=<s left - 60> bash benchmarks/gpu/device_session.sh "\$OUT"
     (timeout_s = that budget + 50; --collect each into its own folder: JETRL_RESULTS_ROOT)
EOF
}

collect() {  # here, after a call: results into benchmarks/gpu/results/<date>_<gpu>/, cache kept
  local from=$1 dest=${2:-}
  [[ -f "$from/summary.txt" ]] || { echo "device_session: no summary.txt in $from" >&2; return 1; }
  if [[ -z "$dest" ]]; then
    local name
    name=$("$py" - "$from/results.json" <<'PY'
import json, re, sys
head = json.load(open(sys.argv[1]))["header"]
date = next((h.split()[1][:10] for h in head if h.startswith("date: ")), "undated")
gpu = next((h[5:].split(",")[0] for h in head if h.startswith("gpu: ")), "gpu")
print(f"{date}_{re.sub(r'[^a-z0-9]+', '-', gpu.lower().replace('nvidia', '')).strip('-')}")
PY
)
    dest=${JETRL_RESULTS_ROOT:-benchmarks/gpu/results}/$name
  fi
  mkdir -p "$dest"
  cp "$from/summary.txt" "$from/results.json" "$dest/"
  [[ ! -f "$from/logs.tar.gz" ]] ||
    tar -xzf "$from/logs.tar.gz" -C "$dest" --strip-components=1
  if [[ -f "$from/triton-cache.tar.gz" ]]; then
    mkdir -p "$carry_cache"
    cp "$from/triton-cache.tar.gz" "$carry_cache/"
    echo "triton cache -> $carry_cache/triton-cache.tar.gz (carried by the next call)"
  fi
  echo "results -> $dest: $(cd "$dest" && printf '%s ' *)"
  echo "commit them: git add $dest && git commit -m '...'  (the source line of summary.txt names the tree)"
}
