#!/usr/bin/env bash
# The test command. On a fresh machine it creates the environments it needs:
#   .venv       torch 2.13.0+cpu, megatron-core, triton (interpreter), transformers, tensorboard
#   .venv-vllm     the real vLLM 0.32 CPU build with the patch (scripts/setup_vllm_env.sh)
#   .venv-vllm020  vLLM 0.20, the version NeMo-RL v0.7.0 ships (PyPI's torch 2.11, ~6 GB)
# and runs:
#   1. the default suite (unit, megatron-core on CPU, Triton interpreter, slow tests included);
#   2. the vLLM tier against a real engine, once per version in $JETRL_VLLM_VERSIONS
#      (default "0.32.0 0.20.0"); the 0.32 tier also runs vLLM 0.33.0's kernel selection code
#      from its CUDA wheel (scripts/fetch_vllm_src.sh: one cached 336 MB download);
#   3. the NeMo-RL tier (tests marked nemo_rl) against NeMo-RL's real source, once per tree in
#      $JETRL_NEMO_RL_TREES (default "v0.7.0 main-7ea279a"), in the env made by
#      scripts/setup_nemo_rl_env.sh (the tree's vLLM env, .venv-vllm020 / .venv-vllm025, plus a
#      pinned dependency overlay, .venv-nemo-rl).
# gpu tests skip with a reason here; they run in the Docker image (scripts/run_gpu_tests.sh).
# The environments of tiers 2-4 (download- and disk-bound: ~6 GB for 0.20; 0.25 links its torch
# from it and 0.32 .venv's, scripts/link_packages.py; test.sh warns up front when the disk is too
# small) are built in the background, one after another, while the default suite runs
# (scripts/tier.sh env_queue: only those this run's tiers need; one already importing vllm is not
# rebuilt); each tier waits for its own, and a failed build is that tier's "not run, environment
# setup failed (log: ...)".
# While a tier runs, the next one's libraries and sources are read into the page cache
# (scripts/tier.sh warm_start; JETRL_WARM=0: off), and each tier ends with a "[tier] NAME: N s
# wall, machine CPU busy X%" line.
#
# With pytest arguments (e.g. `bash scripts/test.sh -k fp8 -x`) only the default suite runs,
# with those arguments. JETRL_SKIP_VLLM=1 skips the vLLM tier, JETRL_SKIP_NEMO_RL=1 the
# NeMo-RL tier. Each tier runs under a wall-clock limit, JETRL_TIER_TIMEOUT_S (default 2700 s;
# scripts/tier.sh): at the limit pytest gets SIGINT and prints the test it was in, the tier's
# processes are killed, the summary shows "<tier>: timed out after N s (exit 124)", the script
# exits non-zero and the remaining tiers still run. A tier whose environment cannot be made (pip
# retries each install first: scripts/pip_retry.sh) is likewise reported in the summary as not run,
# with its setup log's tail above, and the script goes on to the next tier and then exits 1.
# With CI=true (.ci/run sets it) a tier that cannot run (e.g. no NeMo-RL source) fails the run,
# and so does a tier skipped with a JETRL_SKIP_* flag.
#   4. the mutation check (scripts/mutation_check.py, mutants in scripts/mutants.py): each mutant
#      on a temporary copy, judged by the tests listed for it; a survivor fails the run. A kill
#      counts where its test passes unmutated: the tests the tiers above saw pass are not rerun.
#      JETRL_SKIP_MUTANTS=1 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode, written once: CI's image sets PYTHONDONTWRITEBYTECODE=1 and the vLLM envs are installed
# --no-compile, so every Python process of every tier (each vLLM engine, Ray actor, pytest) would
# compile torch, vLLM and transformers from source again: test_vllm_engine.py on vLLM 0.20 took
# 112 s of CPU that way against 70 s with bytecode (docs/ci_times.md). Python writes it on first
# import, under .cache/pycache only (never into ../shared's NeMo-RL source or beside the venvs'
# files). The mutation check's mutant runs still write none (scripts/mutation_check.py).
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$PWD/.cache/pycache}"
# Inductor's CPU ISA probe, once per new process that compiles (every vLLM CPU engine's worker
# compiles vLLM's sampler at warm-up, even with enforce_eager): it starts `python -c "import torch"`
# six times on an AVX-512 machine to confirm ISAs /proc/cpuinfo already lists, 12.5 s of each
# engine start here (6.2 s with this set; LLM() 36.9 -> 27.8 s, vLLM 0.20, 2-core EPYC). The flag
# skips only the base "does it build and load" probe of an ISA the CPU reports; the ISA chosen is
# the same (VecAVX512VNNI here), so no kernel changes (docs/ci_times.md).
export TORCHINDUCTOR_VEC_ISA_OK="${TORCHINDUCTOR_VEC_ISA_OK:-1}"
# One OpenMP thread per process. Every tier runs several processes at once on CI's 2 cores (two
# pytest workers; pytest + vLLM's engine core + its worker; Ray actors; the environments built in
# the background), and a torch op's second OpenMP thread then spins at each barrier waiting for a
# core another process holds: tests/fp8+flow+rl+kvcache on a busy 2-core machine took 217 s wall,
# 232 s CPU with torch's default 2 threads and 109 s / 105 s with 1 (docs/ci_times.md). vLLM's CPU
# engine takes its thread count from this too (it sets none on CPU). Results do not depend on it:
# both sides of every exact comparison run one thread, and no test asks for more.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
workers=${JETRL_TEST_WORKERS:-2}  # pytest-xdist workers of the default suite and vLLM tiers
case "$workers" in
  ''|*[!0-9]*) echo "test.sh: JETRL_TEST_WORKERS=$workers: use a whole number of pytest workers (0: one process)" >&2; exit 2 ;;
esac
bash scripts/setup_env.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi

rc=0
summary=()
# tier NAME CMD...: one tier under JETRL_TIER_TIMEOUT_S, its line in $summary; not_run NAME WHY;
# skipped_tiers (the JETRL_SKIP_* flags: a failure under CI=true); env_queue/env_start/env_wait:
# the environments below, built in the background while the default suite runs; warm_start /
# warm_stop: the next tier's files read while the tier before it computes
source scripts/tier.sh
# The tests each tier saw pass (tests/conftest.py writes $JETRL_PASSED_LOG), one file per
# environment kind of the mutation check: its last phase does not rerun, unmutated, a killing
# test this run already saw pass there (scripts/mutation_confirm.py; 243 s of CI's 693 s).
passed_dir=$(mktemp -d "${TMPDIR:-/tmp}/jetrl-passed-XXXXXX")
trap 'lane_stop; env_stop; warm_stop; rm -rf "$passed_dir"' EXIT
disk_check  # what is free against what a fresh clone's full run writes (a warning, not a stop)
vllm_versions=() nemo_rl_trees=()
[ "${JETRL_SKIP_VLLM:-0}" = "1" ] || read -r -a vllm_versions <<< "${JETRL_VLLM_VERSIONS:-0.32.0 0.20.0}"
[ "${JETRL_SKIP_NEMO_RL:-0}" = "1" ] || read -r -a nemo_rl_trees <<< "${JETRL_NEMO_RL_TREES:-v0.7.0 main-7ea279a}"
upstream="${JETRL_NEMO_RL_UPSTREAM:-../shared/upstream/nemo-rl}"
vllm_venv() {  # VERSION: its environment (0.32: .venv-vllm; 0.20.0: .venv-vllm020, ...)
  case "$1" in
    0.32.*) echo .venv-vllm ;;
    *) echo ".venv-vllm$(echo "$1" | cut -d. -f1-2 | tr -d .)" ;;
  esac
}
# Only what this run's tiers need is built, each once, in the order the tiers come.
for version in "${vllm_versions[@]}"; do
  case "$version" in
    0.32.*)  # this tier also runs vLLM 0.33.0's CUDA-wheel selection code (no CPU build)
      env_queue vllm-src "${TMPDIR:-/tmp}/jetrl-vllm-src.log" \
        env PYTHON=.venv/bin/python bash scripts/fetch_vllm_src.sh ;;
  esac
  venv=$(vllm_venv "$version")  # made only where it does not import vllm yet
  env_queue "vllm-$version" "${TMPDIR:-/tmp}/jetrl-vllm-setup-$version.log" env VLLM_VERSION="$version" \
    VLLM_VENV="$venv" bash -c '"$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null && echo "$VLLM_VENV: ready" ||
      exec bash scripts/setup_vllm_env.sh'
done
for tree in "${nemo_rl_trees[@]}"; do  # its vLLM env (if no vLLM tier made it), then the overlay
  [ ! -d "$upstream/$tree/nemo_rl" ] || env_queue "nemo-rl-$tree" \
    "${TMPDIR:-/tmp}/jetrl-nemo-rl-setup-$tree.log" bash scripts/setup_nemo_rl_env.sh "$tree"
done
env_start
vllm_tier() {  # VERSION: the vLLM tier of one version, once its environment is built
  local version=$1 venv log
  venv=$(vllm_venv "$version")
  echo "== vLLM $version tier ($venv, real vLLM CPU engine) =="
  case "$version" in
    0.32.*)
      if ! env_wait vllm-src; then
        tail -n 20 "${TMPDIR:-/tmp}/jetrl-vllm-src.log"
        not_run "vLLM $version tier ($venv)" "fetching vLLM 0.33.0's source failed"
        return 0
      fi ;;
  esac
  log="${TMPDIR:-/tmp}/jetrl-vllm-setup-$version.log"
  if ! env_wait "vllm-$version"; then
    tail -n 40 "$log"
    not_run "vLLM $version tier ($venv)" "$(setup_failed "$log")"
    return 0
  fi
  local passed=()  # the mutation check's vllm kind is .venv-vllm
  [ "$venv" != .venv-vllm ] || passed=(JETRL_PASSED_LOG="$passed_dir/vllm.txt")
  tier "vLLM $version tier ($venv)" env VLLM_VENV="$venv" "${passed[@]}" \
    bash scripts/test_vllm.sh --runslow
}
nemo_rl_tier() {  # TREE: the NeMo-RL tier of one tree, once its environment is built
  local tree=$1 log
  echo "== NeMo-RL $tree tier (NeMo-RL's real source, CPU) =="
  if [ ! -d "$upstream/$tree/nemo_rl" ]; then
    echo "no NeMo-RL source at $upstream/$tree (set JETRL_NEMO_RL_UPSTREAM): tier not run"
    if [ "${CI:-}" = "true" ]; then  # in CI a tier that cannot run fails the run
      not_run "NeMo-RL $tree tier" "no source at $upstream/$tree (set JETRL_NEMO_RL_UPSTREAM)"
    else
      summary+=("NeMo-RL $tree tier: not run, no source at $upstream/$tree")
    fi
    return 0
  fi
  log="${TMPDIR:-/tmp}/jetrl-nemo-rl-setup-$tree.log"
  if ! env_wait "nemo-rl-$tree"; then
    tail -n 40 "$log"
    not_run "NeMo-RL $tree tier" "$(setup_failed "$log")"
    return 0
  fi
  local passed=()  # the mutation check's nemo_rl kind is v0.7.0's environment
  [ "$tree" != v0.7.0 ] || passed=(JETRL_PASSED_LOG="$passed_dir/nemo_rl.txt")
  tier "NeMo-RL $tree tier" env "${passed[@]}" bash scripts/test_nemo_rl.sh "$tree" --runslow
}
# The tiers after the default suite, in summary order. 0.32: the current vLLM CPU build; 0.20:
# the vLLM NeMo-RL v0.7.0 ships (the cluster target); then each NeMo-RL tree.
jobs=()
for version in "${vllm_versions[@]}"; do jobs+=("vllm_tier $version"); done
for tree in "${nemo_rl_trees[@]}"; do jobs+=("nemo_rl_tier $tree"); done
# Lanes (JETRL_TIER_LANES). Default "nemo-rl": the tiers one at a time, except the NeMo-RL
# trees, which run side by side (the first in this lane, the others in a second lane started
# when this lane reaches the first). A NeMo-RL tier is one pytest process whose rehearsals and
# engines wait on Ray and vLLM's processes most of the time: a rehearsal alone kept a 2-core
# machine half idle (vmstat, 2026-11-29), and on a 2-core EPYC without AVX-512 the two trees took
# 1,699 s and 1,216 s one after the other (docs/ci_times.md). Side by side they do not meet on a
# port: v0.7.0's vLLM rendezvous starts at NeMo-RL's fixed VLLM_PORT (20001), main's vLLM takes
# an ephemeral one, each tier starts its own Ray, and NeMo-RL draws master ports at random.
# 2: the odd-numbered tiers (0.20, NeMo-RL main) in a second lane beside the default suite and
# the even ones (on 2 cores two vLLM tiers side by side were CPU-bound and the 0.32 tier ran past
# its limit: fresh-clone run of f5f37b1, docs/ci_times.md; for 4+ cores). 1: one at a time.
lanes=${JETRL_TIER_LANES:-nemo-rl}
case "$lanes" in
  1|2|nemo-rl) ;;
  *) echo "test.sh: JETRL_TIER_LANES=$lanes: use nemo-rl (the NeMo-RL trees side by side), 1 (one tier at a time) or 2" >&2; exit 2 ;;
esac
second=() first_nemo=""
if [ "$lanes" = 2 ] && [ "${#jobs[@]}" -gt 1 ]; then
  for i in "${!jobs[@]}"; do [ $((i % 2)) -eq 0 ] || second+=("$i"); done
elif [ "$lanes" = nemo-rl ]; then
  for i in "${!jobs[@]}"; do
    case "${jobs[$i]}" in
      nemo_rl_tier*) if [ -z "$first_nemo" ]; then first_nemo=$i; else second+=("$i"); fi ;;
    esac
  done
fi
in_second() { local j; for j in "${second[@]}"; do [ "$j" != "$1" ] || return 0; done; return 1; }
# What a job's processes read (its venv, the NeMo-RL overlay and tree, their bytecode under
# $PYTHONPYCACHEPREFIX), for warm_start: the next tier's files are read while this one computes.
with_pyc() { local d; for d in "$@"; do [ ! -d "$d" ] || printf '%s\n' "$d" "$PYTHONPYCACHEPREFIX$(cd "$d" && pwd)"; done; }
job_dirs() {  # I...
  local i kind arg
  for i in "$@"; do
    read -r kind arg <<< "${jobs[$i]}"
    case "$kind" in
      vllm_tier) with_pyc "$(vllm_venv "$arg")" ;;
      nemo_rl_tier) (source scripts/nemo_rl_env.sh && nemo_rl_env "$arg" > /dev/null 2>&1 &&
        with_pyc "$NEMO_RL_VENV" "$(dirname "$NEMO_RL_OVERLAY")" "$NEMO_RL_TREE_DIR") || true ;;
    esac
  done
}
ahead=()  # the lane-1 jobs in order; before each, the files of the one after it are warmed
for i in "${!jobs[@]}"; do in_second "$i" || ahead+=("$i"); done
warm_for() {  # K: warm what the K-th lane-1 job reads (and the second lane's, if it starts there)
  local dirs=()
  if [ "$1" -lt "${#ahead[@]}" ]; then
    mapfile -t dirs < <(job_dirs "${ahead[$1]}"; [ "${ahead[$1]}" != "$first_nemo" ] || job_dirs "${second[@]}")
  elif [ "${JETRL_SKIP_MUTANTS:-0}" != "1" ]; then  # the mutation check: the environments the
    mapfile -t dirs < <(with_pyc .venv .venv-vllm)  # NeMo-RL tiers it follows did not just read
  fi
  warm_start "${dirs[@]}"
}
echo "default suite, then: ${jobs[*]} (lanes: $lanes)"
[ "$lanes" != 2 ] || [ "${#second[@]}" -eq 0 ] || lane_start "${second[@]}"
warm_for 0
echo "== default suite (.venv) =="
# --durations: each tier's slowest tests in the log, what CI time is cut from (docs/ci_times.md).
# -n 2 (pytest-xdist): the suite is one Python thread most of the time (108% CPU alone), so two
# workers use both cores; --dist loadfile keeps each file (and its module fixtures) in one worker.
tier "default suite (.venv)" env JETRL_PASSED_LOG="$passed_dir/default.txt" \
  .venv/bin/python -m pytest -q --runslow --durations=20 -n "$workers" --dist loadfile
for k in "${!ahead[@]}"; do
  i=${ahead[$k]}
  if [ "$i" = "$first_nemo" ] && [ "${#second[@]}" -gt 0 ]; then
    lane_start "${second[@]}"  # the other NeMo-RL trees, beside this one
  fi
  warm_for $((k + 1))
  job_run "$i"
done
lane_finish  # waits for the second lane, shows its output; every job's summary lines in order
warm_stop
if [ "${JETRL_SKIP_MUTANTS:-0}" != "1" ]; then
  # Last: its NeMo-RL mutants run in the env the NeMo-RL tier set up (scripts/mutants.py).
  echo "== mutation check (scripts/mutation_check.py: each mutant on a temporary copy) =="
  tier "mutation check" env JETRL_PASSED_DIR="$passed_dir" .venv/bin/python scripts/mutation_check.py
fi
skipped_tiers
echo "== summary =="
printf '%s\n' "${summary[@]}"
exit $rc
