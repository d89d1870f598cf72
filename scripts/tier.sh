# Sourced by scripts/test.sh (and tests/test_test_script.py): `tier NAME CMD...` runs one test tier
# under a wall-clock limit, appends "NAME: <pytest summary line> (exit N)" to the array $summary
# and sets $rc to a failing tier's exit status; the caller prints $summary and exits $rc.
#
#   JETRL_TIER_TIMEOUT_S     seconds each tier may run (default 1500), so that one hung test (e.g. a
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
    "${JETRL_TIER_TIMEOUT_S:-1500}" "$@" &
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

tier() {  # NAME CMD...
  local name=$1; shift
  local out="${TMPDIR:-/tmp}/jetrl-tier-$$.log" trc=0 s0 line limit=${JETRL_TIER_TIMEOUT_S:-1500}
  s0=$(date +%s)
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
  [ "$trc" -eq 0 ] || rc=$trc
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
