# Sourced by scripts/test.sh (and tests/test_tier_and_pip_retry.py): `tier NAME CMD...` runs one
# test tier under a wall-clock limit, appends "NAME: <pytest summary line> (exit N)" to the array
# $summary and sets $rc to a failing tier's exit status; the caller prints $summary and exits $rc.
#
#   JETRL_TIER_TIMEOUT_S     seconds each tier may run (default 2700: the NeMo-RL trees share 2 cores side by side, and
#                            v0.7.0 alone took 1,699 s on a 2-core EPYC without AVX-512), so that one hung test (e.g. a
#                            destructor waiting forever) costs one tier, not CI's whole budget
#   JETRL_TIER_KILL_AFTER_S  seconds from the limit's SIGINT to SIGKILL (default 60)
#
# At the limit `timeout` sends SIGINT to the tier's whole process group (it makes itself the
# group's leader; --foreground would signal only its direct child, which for the vLLM and NeMo-RL
# tiers is a bash wrapper that waits on pytest and never passes SIGINT on): pytest prints a
# KeyboardInterrupt traceback naming the hung test, then its summary. Whatever is still alive
# JETRL_TIER_KILL_AFTER_S later gets SIGKILL, and so does whatever the tier leaves behind when it
# ends (a child that ignored SIGINT would otherwise hold tee's pipe open and hang this script).
# Processes that start a session of their own (setsid) are out of the group's reach.

_tier_limited() {  # CMD...: run CMD in a process group of its own under the limit
  timeout --signal=INT --kill-after="${JETRL_TIER_KILL_AFTER_S:-60}" \
    "${JETRL_TIER_TIMEOUT_S:-2700}" "$@" &
  local pid=$! trc=0 stop=0
  # Ctrl-C at a terminal (or a TERM from CI) reaches only the foreground group (this subshell),
  # not the tier's group: pass it to timeout, which passes it to its group (signalling the group
  # here too would interrupt pytest twice, the second time inside its report of the first).
  trap 'stop=130; kill -INT "$pid" 2>/dev/null' INT
  trap 'stop=143; kill -TERM "$pid" 2>/dev/null' TERM
  wait "$pid" || trc=$?
  # wait returns early (status > 128) when a trapped signal arrives: wait again for the real status.
  while [ "$trc" -gt 128 ] && kill -0 "$pid" 2>/dev/null; do
    trc=0
    wait "$pid" || trc=$?
  done
  trap - INT TERM
  kill -KILL -- "-$pid" 2>/dev/null
  [ "$stop" -eq 0 ] || return "$stop"
  return "$trc"
}

_cpu_jiffies() {  # busy and total jiffies of the whole machine since boot, and its core count
  # (/proc/stat: not nproc, which answers OMP_NUM_THREADS, set to 1 for every tier)
  awk '/^cpu /{b=$2+$3+$4+$7+$8+$9; t=b+$5+$6} /^cpu[0-9]/{n++} END{print b+0, t+0, n+0}' \
    /proc/stat 2>/dev/null || echo "0 0 0"
}

tier() {  # NAME CMD...
  local name=$1; shift
  local out="${TMPDIR:-/tmp}/jetrl-tier-$$.log" trc=0 s0 line limit=${JETRL_TIER_TIMEOUT_S:-2700}
  local busy0 total0 busy1 total1 cores
  s0=$(date +%s)
  read -r busy0 total0 cores < <(_cpu_jiffies)
  set +e  # a failing tier must not end the script (set -e + pipefail): the others still run
  # tee ignores SIGINT so that pytest's report of a Ctrl-C still shows.
  _tier_limited "$@" 2>&1 | (trap '' INT; exec tee "$out")
  trc=${PIPESTATUS[0]}
  set -e
  if [ "$trc" -eq 130 ] || [ "$trc" -eq 143 ]; then  # interrupted: the remaining tiers do not run
    rm -f "$out"
    echo "test.sh: $name interrupted (exit $trc)" >&2
    exit "$trc"
  fi
  # timeout exits 124 after SIGINT, 137 when the group needed SIGKILL (which takes timeout too);
  # a 137 before the limit is some other SIGKILL (e.g. the OOM killer) and keeps pytest's line.
  if [ "$trc" -eq 124 ] || { [ "$trc" -eq 137 ] && [ $(( $(date +%s) - s0 )) -ge "$limit" ]; }; then
    summary+=("$name: timed out after $limit s (exit $trc)")
  else  # `|| true`: a tier that ends before pytest's summary (no env, crash) must not end the script
    line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|killed)|no tests ran' "$out" | tail -n 1 | tr -d '=' | xargs || true)
    summary+=("$name: ${line:-no pytest summary} (exit $trc)")  # (or mutation_check's last line)
  fi
  rm -f "$out"
  # How busy the whole machine was while this tier ran (every lane and background build counts):
  # a tier under ~100% has idle cores a second lane could use; CI time is cut from these lines.
  read -r busy1 total1 cores < <(_cpu_jiffies)
  if [ "$total1" -gt "$total0" ]; then
    echo "[tier] $name: $(( $(date +%s) - s0 )) s wall, machine CPU busy $(( 100 * (busy1 - busy0) / (total1 - total0) ))% of $cores cores"
  fi
  echo "[disk] after $name: $(disk_free_gib) GiB free"
  [ "$trc" -eq 0 ] || rc=$trc
}

disk_free_gib() {  # free space where the environments and caches go (the repository), in GiB
  df -Pk . 2>/dev/null | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'
}

# What a full run on a fresh clone writes at its peak, in GiB: the environments, the bytecode,
# vLLM 0.33's source, pytest's and Inductor's temporary files. Measured from df's free space on
# fresh-clone runs: 14.6 GiB at 312e819 (the clone 14 GiB by du), 16.7 at 707ce02 (before the
# 0.32 env linked .venv's torch and Triton); the clone alone was 22 GiB before the envs linked
# torch at all (docs/ci_times.md).
FULL_RUN_DISK_GIB=15

disk_check() {  # a warning up front when the disk cannot hold what the run will write
  local free
  free=$(disk_free_gib)
  echo "disk: ${free:-?} GiB free here; a full run on a fresh clone writes up to ~$FULL_RUN_DISK_GIB GiB"
  if [ -n "$free" ] && awk -v f="$free" -v n="$FULL_RUN_DISK_GIB" 'BEGIN { exit !(f < n) }'; then
    echo "test.sh: warning: only $free GiB free on $(df -P . | awk 'NR == 2 { print $6 }'), under the" \
      "~$FULL_RUN_DISK_GIB GiB a full run may write: the later tiers' environments may fail with" \
      "\"No space left on device\" (free space, or run fewer tiers: JETRL_VLLM_VERSIONS," \
      "JETRL_NEMO_RL_TREES)" >&2
  fi
}

setup_failed() {  # LOG: why a tier's environment is missing, for its summary line. A full disk is
  # named (with what is free now): one CI run lost three tiers' environments to it, each reported
  # only as "environment setup failed", the cause 40 lines up in the log's tail (docs/ci_times.md).
  # pip's resolver conflict is named too (CI's report keeps the summary, not the setup log: one
  # run lost both NeMo-RL tiers to a lock pin its wheelhouse lacked, said only as "setup failed").
  local why
  if grep -q "No space left on device" "$1" 2>/dev/null; then
    echo "environment setup failed: no space left on device ($(disk_free_gib) GiB free now; log: $1)"
  elif why=$(_setup_error "$1") && [ -n "$why" ]; then
    echo "environment setup failed: $why (log: $1)"
  else
    echo "environment setup failed (log: $1)"
  fi
}

_setup_error() {  # LOG: pip's last conflict ("torch 2.11.0 depends on filelock; The user requested
  # (constraint) filelock==4.3.1"), else the last ERROR/error line or Python exception (a setup
  # script's sanity import: "ValueError: Either a revision or a version must be specified" lost a
  # tier once, said only as "setup failed"), on one line, at most 300 chars
  awk '
    /^The conflict is caused by:/ { grab = 1; conflict = ""; next }
    grab && /^[[:space:]]*$/ { grab = 0; if (conflict != "") last = conflict; next }
    grab { sub(/^[[:space:]]+/, ""); conflict = conflict (conflict == "" ? "" : "; ") $0; next }
    /^(ERROR|error|Error)[: ]/ && !/ResolutionImpossible: for help/ && !/^ERROR: Cannot install/ { err = $0 }
    /^[A-Za-z_][A-Za-z0-9_.]*(Error|Exception): / { err = $0 }
    END { print (last != "" ? "pip conflict: " last : err) }
  ' "$1" 2>/dev/null | cut -c1-300
}

not_run() {  # NAME WHY: a tier that could not start fails the run; the others still run
  echo "test.sh: $1: $2" >&2
  summary+=("$1: not run, $2 (exit 1)")
  rc=1
}

skipped_tiers() {  # a tier skipped by a JETRL_SKIP_* flag did not run: under CI=true that fails
  local skip
  for skip in JETRL_SKIP_VLLM JETRL_SKIP_NEMO_RL JETRL_SKIP_MUTANTS; do
    [ "${!skip:-0}" = "1" ] || continue
    if [ "${CI:-}" = "true" ]; then
      not_run "$skip=1" "CI=true runs every tier; unset $skip"
    else
      summary+=("$skip=1: that tier was skipped")
    fi
  done
}

# -- environments built in the background ------------------------------------------------------
# The later tiers' environments (vLLM CPU builds, the NeMo-RL overlay) are download- and
# disk-bound: test.sh queues the ones this run needs (`env_queue KEY LOG CMD`), starts them one
# after another in the background while the default suite runs (`env_start`), and each tier waits
# for its own (`env_wait KEY`: CMD's exit status; CMD's output is in LOG). The builds run in a
# session of their own (setsid) so that a Ctrl-C stops the tier and not a half-written venv's pip
# mid-file; `env_stop` (test.sh's EXIT trap) ends them.
_env_args=()
ENV_STATE="" ENV_PID=""

env_queue() {  # KEY LOG CMD...: CMD (one shell word list) builds KEY's environment, output in LOG
  local key=$1 log=$2
  shift 2
  _env_args+=("$key" "$log" "$(printf '%q ' "$@")")
}

_env_chain() {  # STATE (KEY LOG CMD)...: run the queued builds in order, each one's status in STATE
  local state=$1 key log cmd s0 erc
  shift
  while [ "$#" -ge 3 ]; do
    key=$1 log=$2 cmd=$3
    shift 3
    s0=$(date +%s) erc=0
    eval "$cmd" > "$log" 2>&1 < /dev/null || erc=$?
    echo "$erc $(( $(date +%s) - s0 ))" > "$state/$key.tmp" && mv "$state/$key.tmp" "$state/$key.rc"
  done
}

env_start() {  # start the queued builds (nothing queued: nothing starts)
  ENV_STATE=$(mktemp -d "${TMPDIR:-/tmp}/jetrl-envs.XXXXXX")
  [ "${#_env_args[@]}" -gt 0 ] || return 0
  # nice: the builds take what CPU the tier on the critical path leaves; none is needed before the
  # default suite ends (the vLLM 0.32 env and source are, measured: 41-95 s of a ~6 min suite).
  setsid nice -n 10 bash -c 'source scripts/tier.sh; _env_chain "$@"' _env_chain "$ENV_STATE" "${_env_args[@]}" &
  ENV_PID=$!
  echo "environments building in the background: $(printf '%s\n' "${_env_args[@]}" | awk 'NR % 3 == 1' | xargs)"
}

env_wait() {  # KEY: wait for KEY's build; its exit status (1 when it was never queued or died)
  local f="$ENV_STATE/$1.rc" s0 erc took
  s0=$(date +%s)
  while [ ! -f "$f" ]; do
    if [ -z "$ENV_PID" ] || ! kill -0 "$ENV_PID" 2>/dev/null; then
      [ -f "$f" ] && break
      echo "test.sh: no environment build for $1 (never queued, or its build was killed)" >&2
      return 1
    fi
    sleep 2
  done
  read -r erc took < "$f"
  echo "environment $1: built in the background in $took s (exit $erc; waited $(( $(date +%s) - s0 )) s for it)"
  return "$erc"
}

env_stop() {  # end the background builds (they are a session of their own: signal all of it)
  if [ -n "$ENV_PID" ]; then kill -TERM -- "-$ENV_PID" 2>/dev/null || true; fi
  [ -z "$ENV_STATE" ] || rm -rf "$ENV_STATE"
  return 0
}

# -- two lanes of tiers ------------------------------------------------------------------------
# test.sh lists the tiers after the default suite as jobs ("vllm_tier 0.32.0", ...) in summary
# order. `job_run I` runs ${jobs[I]} and keeps its summary lines and status; `lane_start I...`
# runs those jobs one after another in a second lane (a session of its own, output in a log);
# `lane_finish` waits for it, prints its output, and appends every job's summary lines in order.
LANE_STATE="" LANE_PID=""

job_run() {  # I: run ${jobs[I]}; its summary lines and exit status go to $LANE_STATE
  local summary=() rc=0
  [ -n "$LANE_STATE" ] || LANE_STATE=$(mktemp -d "${TMPDIR:-/tmp}/jetrl-lanes.XXXXXX")
  ${jobs[$1]}  # word-split on purpose: "vllm_tier 0.32.0"
  [ "${#summary[@]}" -eq 0 ] || printf '%s\n' "${summary[@]}" > "$LANE_STATE/job-$1.summary"
  echo "$rc" > "$LANE_STATE/job-$1.rc"
}

lane_start() {  # I...: run these jobs in order in the second lane
  local args=() i
  [ -n "$LANE_STATE" ] || LANE_STATE=$(mktemp -d "${TMPDIR:-/tmp}/jetrl-lanes.XXXXXX")
  for i in "$@"; do args+=("$i" "${jobs[$i]}"); done
  export LANE_STATE ENV_STATE ENV_PID upstream
  export -f tier _tier_limited _cpu_jiffies disk_free_gib setup_failed not_run env_wait vllm_venv vllm_tier nemo_rl_tier job_run
  echo "second lane: $(for i in "$@"; do printf '%s; ' "${jobs[$i]}"; done)its output follows when it ends"
  setsid bash -c 'set -euo pipefail; jobs=(); while [ "$#" -ge 2 ]; do
      jobs[$1]=$2; job_run "$1"; shift 2; done' lane "${args[@]}" \
    > "$LANE_STATE/lane.log" 2>&1 < /dev/null &
  LANE_PID=$!
}

lane_finish() {  # wait for the second lane; every job's summary lines, in job order
  local i line jrc
  if [ -n "$LANE_PID" ]; then
    wait "$LANE_PID" || true  # each job's own status is in its file
    LANE_PID=""
    echo "== second lane's output (it ran beside the tiers above) =="
    cat "$LANE_STATE/lane.log"
  fi
  for i in "${!jobs[@]}"; do
    if [ -f "$LANE_STATE/job-$i.rc" ]; then
      if [ -f "$LANE_STATE/job-$i.summary" ]; then
        while IFS= read -r line; do summary+=("$line"); done < "$LANE_STATE/job-$i.summary"
      fi
      read -r jrc < "$LANE_STATE/job-$i.rc"
      [ "$jrc" -eq 0 ] || rc=$jrc
    else
      summary+=("${jobs[$i]}: no result, its lane ended early (exit 1)")
      rc=1
    fi
  done
}

lane_stop() {  # end the second lane (test.sh's EXIT trap): its tiers pass the TERM to pytest
  if [ -n "$LANE_PID" ]; then kill -TERM -- "-$LANE_PID" 2>/dev/null || true; fi
  [ -z "$LANE_STATE" ] || rm -rf "$LANE_STATE"
  return 0
}

# -- the next tier's files, read ahead ---------------------------------------------------------
# CI's disk reads ~40 MB/s cold, and a tier's first engine starts fault in its venv's libraries
# page by page: in a fresh-clone run the vLLM 0.32 tier ran its first ~200 s at 37-52% CPU with
# 29-30% iowait, and the 0.20 tier its first 240 s at 42-45% with 38%, each behind a tier that
# had kept the CPU busy and the disk idle. Loading torch's CUDA build touches its CUDA libraries
# too (fincore after the 0.20 tier: 273 of libcublasLt's 517 MB, 94 of cusparseLt's 223 MB).
# `warm_start DIR...` reads every shared library, executable (Ray's raylet, gcs_server), Python
# source and bytecode file under DIR in the background, niced, while the tier before it
# computes; it reads them again every JETRL_WARM_PERIOD_S (default 240 s; 0: once): files left
# this VM's page cache within minutes (fincore: a venv built 30 min earlier held 25% of its
# libtorch_cpu.so; a file just read lost 5% in 4 min), and a pass over cached files is ~1 s of
# system time. `warm_stop` ends it (when the tier it was for starts, and at exit);
# JETRL_WARM=0 turns it off.
WARM_PID=""

_warm_pass() {  # DIR...: read each library, executable, .py and .pyc under DIR once
  find "$@" -type f \( -name '*.so' -o -name '*.so.*' -o -name '*.py' -o -name '*.pyc' \
    -o -perm -u+x \) -print0 2>/dev/null | xargs -0 -r cat > /dev/null 2>&1 || true
}

warm_start() {  # DIR...: keep these folders' libraries in the page cache until warm_stop
  warm_stop
  local dirs=() d period=${JETRL_WARM_PERIOD_S:-240}
  for d in "$@"; do [ ! -d "$d" ] || dirs+=("$d"); done
  [ "${#dirs[@]}" -gt 0 ] && [ "${JETRL_WARM:-1}" != "0" ] || return 0
  export -f _warm_pass
  setsid nice -n 19 ionice -c 3 bash -c 'period=$1; shift
    while :; do _warm_pass "$@"; [ "$period" -gt 0 ] || exit 0; sleep "$period"; done' \
    _warm "$period" "${dirs[@]}" < /dev/null > /dev/null 2>&1 &
  WARM_PID=$!
}

warm_stop() {
  if [ -n "$WARM_PID" ]; then kill -TERM -- "-$WARM_PID" 2>/dev/null || true; fi
  WARM_PID=""
  return 0
}
