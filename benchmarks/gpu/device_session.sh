#!/usr/bin/env bash
# Every GPU check of issues 47 and 48 in ONE call of a lent bare GPU machine, or one issue's part
# per call with JETRL_PART (docs/gpu.md, "Two calls on one loan"):
#
#   bash benchmarks/gpu/device_session.sh --prepare      # here, first: wheels, source stamp, sizes,
#                                                        # and the exact `run` call to make
#   bash benchmarks/gpu/device_session.sh "$OUT"         # on the device (run: timeout_s 590)
#   bash benchmarks/gpu/device_session.sh --collect DIR  # here, after: DIR = the call's files_at
#   bash benchmarks/gpu/device_session.sh --dry-run      # the steps and limits; exit 1 over 540 s
#
# On the device: a preflight (the carried wheels installed into a temporary --target and put on
# PYTHONPATH, then benchmarks/gpu/session.py imports every module the steps need, collects the
# GPU test modules and compiles one Triton kernel; a failed preflight stops the call, exit 3),
# then the steps in order of value, each under `timeout -k 3` and all within 540 s: issue 47's
# on-policy run first (the invariant kernels' GPU tests, bench_local_grpo.py on both models,
# every recipe, 3 steps), then issue 48's benchmarks (serving kernel in both scale modes, MoE
# layer, Fp8BlockLinear, quantizer) and the fp8 GPU tests, which get whatever time is left.
# A failed step is recorded and the next one runs. OUTDIR receives at most 4 files, rewritten
# after every step (a call stopped early still returns what ran): summary.txt (source commit,
# device, versions, each step's rc and time, then every MET / NOT MET line of every log),
# results.json (the same plus the benchmarks' JSON records), logs.tar.gz (logs/*.log, json/*),
# triton-cache.tar.gz (the compiled kernels, reused by the next call on the same
# torch/Triton/CUDA/driver/GPU: --collect puts it in .cache/triton-gpu, which the call carries).
#
# Limits (seconds): JETRL_{PREFLIGHT,INVARIANT_TESTS,LOCAL_GRPO,INVARIANT_OPS,KERNEL_TESTS,
# SERVING_FP32,SERVING_POW2,SERVING_SWEEP,MOE,LINEAR,PROFILE_HOST,PROFILE_KERNELS,QUANT,MOE_TILES,
# FP8_TESTS}_S (0 skips a step), JETRL_PART
# (all, 47, 48), JETRL_BUDGET_S (540 or less). Others: PYTHON (python3),
# JETRL_GPU_WHEELS_DIR (.cache/gpu-wheels; empty: install nothing, use the interpreter as it is),
# JETRL_TRITON_CARRY (.cache/triton-gpu), JETRL_TRITON_CACHE_DIR (/tmp/jetrl-triton-cache: a fixed
# path, since Triton's cache index stores absolute paths), JETRL_TRITON_BINARY_ONLY (1: cache
# cubins only), JETRL_CENSUS_REKEY (1: file the census cache under this image's key when only
# libtriton's build differs; scripts/census_cache.py), JETRL_SESSION_NO_CUDA=1 (CPU test of this
# script), JETRL_PREFLIGHT_REQUIRE
# (extra modules the preflight must import), JETRL_SOURCE (the source line, else
# $JETRL_GPU_WHEELS_DIR/SOURCE.txt written by --prepare; the device copy's git is not the tree's),
# JETRL_RESULTS_ROOT (--collect's folder, benchmarks/gpu/results).
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$0")/../.."
readonly MAX_BUDGET_S=540 PACK_S=15 KILL_S=3 CARRY_MIB=64 RETURN_MIB=15
# A 15-minute loan holds two calls on a warm machine (run 8: 381 + 270 s of 900 s with the
# start, then a third of 106 s): JETRL_PART=47 runs issue 47's steps with the time the
# invariant tests (47 of them: 75 s cold was too little, run 8) and both models' fourteen
# recipes (271 s on an H200, run 8) need, JETRL_PART=48 the speed steps with limits at run 8's
# times plus a margin (profile_host and profile_kernels timed out at 10 s), as a second call
# whose JETRL_BUDGET_S (at most 540) is what the loan has left; all (default) runs every step.
BUDGET_S=${JETRL_BUDGET_S:-$MAX_BUDGET_S}
part=${JETRL_PART:-all}
if [[ ! $BUDGET_S =~ ^[0-9]+$ ]] || ((BUDGET_S > MAX_BUDGET_S || BUDGET_S <= PACK_S)); then
  echo "device_session.sh: JETRL_BUDGET_S=$BUDGET_S: use whole seconds, $((PACK_S + 1))-$MAX_BUDGET_S" >&2
  exit 2
fi
case $part in all | 47 | 48) ;; *)
  echo "device_session.sh: JETRL_PART=$part: use all, 47 (on-policy steps) or 48 (speed steps)" >&2
  exit 2 ;;
esac
readonly BUDGET_S part
py=${PYTHON:-python3}
wheels=${JETRL_GPU_WHEELS_DIR-.cache/gpu-wheels}
carry_cache=${JETRL_TRITON_CARRY:-.cache/triton-gpu}
triton_dir=${JETRL_TRITON_CACHE_DIR:-/tmp/jetrl-triton-cache}
site=${JETRL_GPU_SITE:-/tmp/jetrl-gpu-site}
benches=(bench_local_grpo bench_invariant_ops bench_serving_kernel bench_moe_layer
  bench_fp8_linear profile_host profile_kernels bench_quantizer_bandwidth)
mapfile -t all_tests < <(bash scripts/gpu_check.sh --list)
inv_tests=() kernel_tests=() fp8_tests=()
for t in "${all_tests[@]}"; do
  case $t in
    # issue 47's: the invariant kernels, and the local rollout's sampling on the device
    tests/invariant/* | tests/backends/test_local_sampling.py) inv_tests+=("$t") ;;
    # what changed since the last GPU run first: the split-K GEMM, the quantizers, a refit
    # under a captured CUDA graph (graph_bindings), the rows padded for cuBLASLt (fp8_linear:
    # a row's bits at M = 1, 3, 64, 2048), the graphed training linear
    tests/fp8/test_split_gemm.py | tests/fp8/test_quantizer_rowcol.py | \
      tests/fp8/test_quantizer_flag_and_cast.py | tests/vllm_patch/test_graph_bindings.py | \
      tests/fp8/test_fp8_linear.py | tests/fp8/test_fp8_graphed_gpu.py)
      kernel_tests+=("$t") ;;
    *) fp8_tests+=("$t") ;;
  esac
done

# lim NAME ISSUE DEFAULT [ALONE]: a step's limit: $JETRL_NAME_S when set; else 0 when the call
# runs the other issue's part (JETRL_PART); else ALONE when it runs ISSUE's part alone, DEFAULT
# otherwise. ISSUE "-": every part (the preflight).
lim() {
  local var="JETRL_$1_S"
  if [[ -n ${!var:-} ]]; then
    echo "${!var}"
  elif [[ $part != all && $2 != - && $2 != "$part" ]]; then
    echo 0
  elif [[ $part != all && -n ${4:-} ]]; then
    echo "$4"
  else
    echo "$3"
  fi
}

# The steps, in order of value: `step NAME LIMIT [--elastic] CMD...`. --elastic: the step also
# gets what the steps before it left unused of the budget.
plan() {
  step preflight "$(lim PREFLIGHT - 35)" bash benchmarks/gpu/device_session.sh --_preflight
  # Issue 47: exactly on-policy on a GPU.
  step invariant_tests "$(lim INVARIANT_TESTS 47 75 145)" env JETRL_GPU_TESTS="${inv_tests[*]}" \
    JETRL_GPU_BENCH=0 JETRL_TEST_TIMEOUT=45 bash scripts/gpu_check.sh -rfE --durations=5
  # Both models (the demo's, then the ~0.6B Qwen3-shaped one), the exact recipes first, then
  # what the tokens/s table compares them with (fp8_rollout, bf16, jetrl without the invariant
  # ops), then jetrl's other modes: the JSON is rewritten after every recipe, so a timeout keeps
  # what ran. 5 steps: the step time is the median of steps 2-4 (run 8 had 3 steps, one timed
  # step: jetrl 3.67 s, jetrl_kv 2.34 s, jetrl@fast 3.18 s on the 0.6B model, all host-bound,
  # spread wider than the cost of exactness it measures).
  step bench_local_grpo "$(lim LOCAL_GRPO 47 120 330)" "$py" benchmarks/gpu/bench_local_grpo.py \
    --steps 5 --recipes jetrl,jetrl_kv,fp8_rollout,bf16,jetrl@fast,jetrl@fp32,jetrl@splitk \
    --json "$work/json/bench_local_grpo.json"
  step bench_invariant_ops "$(lim INVARIANT_OPS 47 20 15)" "$py" benchmarks/gpu/bench_invariant_ops.py \
    --iters 20 --json "$work/json/bench_invariant_ops.json"
  # Issue 48: FP8 that pays (H100 runs 4-6: 11-25 s each with a cold Triton cache). The GPU tests
  # of the kernels changed since the last run first (the split-K GEMM: rows = the trainer's
  # forward at M = 1..8192; the quantizers' row-chunked launches: every finite bf16), then the
  # serving kernel on cuBLASLt (auto) and on split-K, against one BF16 time per M, each linear
  # after an L2 flush and the four as one decode layer (its `layer_*` columns; run 8 took 11 s
  # without the layer).
  step kernel_tests "$(lim KERNEL_TESTS 48 45 60)" env JETRL_GPU_TESTS="${kernel_tests[*]}" \
    JETRL_GPU_BENCH=0 JETRL_TEST_TIMEOUT=40 bash scripts/gpu_check.sh -rfE --durations=5 -k gpu
  step bench_serving_fp32 "$(lim SERVING_FP32 48 30 20)" "$py" benchmarks/gpu/bench_serving_kernel.py \
    --no-pow2 --iters 20 --backends auto,triton_splitk --json "$work/json/bench_serving_fp32.json"
  # (pow2: not in JETRL_PART=48's ~290 s: run 7 measured it, no pow2-only code changed since)
  step bench_serving_pow2 "$(lim SERVING_POW2 48 20 0)" "$py" benchmarks/gpu/bench_serving_kernel.py \
    --pow2 --iters 20 --backends auto,triton_splitk --json "$work/json/bench_serving_pow2.json"
  # the split-K kernel's launch variants at the decode sizes (point 2: the default to set; the
  # census compiles them): fused quantization at every M and at none, K-loop pipelines of 4
  # and 2 stages, TMA weight loads, the weight chunk prefetched into L2
  step bench_serving_sweep "$(lim SERVING_SWEEP 48 25 30)" "$py" benchmarks/gpu/bench_serving_kernel.py \
    --no-pow2 --iters 10 --tokens 1 8 32 64 --backends split-sweep \
    --json "$work/json/bench_serving_sweep.json"
  step bench_moe_layer "$(lim MOE 48 30 20)" "$py" benchmarks/gpu/bench_moe_layer.py --iters 20 \
    --json "$work/json/bench_moe_layer.json"
  step bench_fp8_linear "$(lim LINEAR 48 45 35)" "$py" benchmarks/gpu/bench_fp8_linear.py --iters 10
  # host enqueue vs GPU time per Qwen3-8B shape (point 5), on the kernels bench_fp8_linear compiled,
  # beside torch's BF16 linear and the same layer on Triton GEMMs (no cuBLASLt call per GEMM)
  step profile_host "$(lim PROFILE_HOST 48 25 30)" "$py" benchmarks/gpu/profile_host.py --iters 10 \
    --ops 8
  # which kernel takes the time where a target is missed (MoE prefill, decode, the linear)
  step profile_kernels "$(lim PROFILE_KERNELS 48 0 15)" "$py" benchmarks/gpu/profile_kernels.py \
    --steps 5 --top 10
  # then the tile sweep (point 4: the tiles to make the defaults; the census cache holds them)
  step bench_quantizer "$(lim QUANT 48 35 35)" "$py" benchmarks/gpu/bench_quantizer_bandwidth.py \
    --iters 20 --sweep-tiles
  # the MoE prefill's grouped GEMM under each shape (point 3: the default to set; compiled by the
  # census), at the prefill models and counts, each checked against the training forward's bits
  # (not in JETRL_PART=48's ~290 s: run 7 swept the tiles, the grouped GEMM is unchanged since)
  step bench_moe_tiles "$(lim MOE_TILES 48 15 0)" "$py" benchmarks/gpu/bench_moe_layer.py \
    --models Qwen/Qwen3-30B-A3B deepseek-ai/DeepSeek-V3 --tokens 2048 8192 --iters 10 \
    --tiles sweep --json "$work/json/bench_moe_tiles.json"
  # ~370 s with a cold Triton cache on an H100: the rest of the budget, more with a warm cache.
  step fp8_tests "$(lim FP8_TESTS 48 5)" --elastic env JETRL_GPU_TESTS="${fp8_tests[*]}" \
    JETRL_GPU_BENCH=0 JETRL_TEST_TIMEOUT=60 bash scripts/gpu_check.sh -rfE --durations=10
}

dry_run() {
  local total=0 n=0
  step() {
    local name=$1 limit=$2 extra=""
    shift 2
    if [[ ${1:-} == --elastic ]]; then
      shift
      extra=" + what the steps before leave"
    fi
    total=$((total + limit)) n=$((n + 1))
    local shown=() a listed
    for a in "$@"; do  # a test list as its count
      if [[ $a == JETRL_GPU_TESTS=* ]]; then
        read -r -a listed <<<"${a#*=}"
        a="JETRL_GPU_TESTS=(${#listed[@]} modules of gpu_check.sh --list)"
      fi
      shown+=("$a")
    done
    printf '  %-20s %4d s%s: %s\n' "$name" "$limit" "$extra" "${shown[*]}"
  }
  echo "device_session.sh: steps in order of value (budget ${BUDGET_S} s, each under timeout -k ${KILL_S}):"
  work=\$WORK  # shown as written, not expanded
  plan
  printf '  %-20s %4d s: summary.txt, results.json, logs.tar.gz, triton-cache.tar.gz\n' pack "$PACK_S"
  total=$((total + PACK_S))
  if ((total > BUDGET_S)); then
    echo "sum ${total} s > ${BUDGET_S} s: over the budget of one call (JETRL_BUDGET_S, at most $MAX_BUDGET_S under run's timeout_s 590)"
    return 1
  fi
  echo "sum ${total} s <= ${BUDGET_S} s ($n steps + pack, part $part); run it with timeout_s $((BUDGET_S + 50))"
}

inner_preflight() {  # the preflight step's command (its own process, under the step's timeout)
  if [[ -n "$wheels" ]]; then
    shopt -s nullglob
    local whl=("$wheels"/*.whl)
    if ((${#whl[@]} == 0)); then
      echo "preflight: FAILED: no wheels in $wheels (run 'bash benchmarks/gpu/device_session.sh --prepare' here and carry $wheels)"
      return 3
    fi
    rm -rf "$site"
    local t0=$SECONDS
    "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --no-cache-dir --target "$site" "${whl[@]}" ||
      { echo "preflight: FAILED: pip could not install the ${#whl[@]} wheels of $wheels"; return 3; }
    echo "preflight: installed ${#whl[@]} wheels from $wheels into $site in $((SECONDS - t0)) s"
  fi
  local cuda=()
  [[ "${JETRL_SESSION_NO_CUDA:-0}" != 1 ]] || cuda=(--no-cuda)
  # shellcheck disable=SC2086  # JETRL_PREFLIGHT_REQUIRE: a space-separated list
  "$py" benchmarks/gpu/session.py preflight "${cuda[@]}" --stamp "$work/stamp" \
    --require ${JETRL_PREFLIGHT_REQUIRE:-} --bench "${benches[@]}" --tests "${all_tests[@]}" ||
    return
  # Direct Triton launches (triton_launch.launch) checked in their own process: if they crash or
  # give other bits, every later step runs with them off instead of losing every FP8 step.
  ((${#cuda[@]} == 0)) || return 0
  local rc=0 line
  line=$("$py" benchmarks/gpu/session.py direct-launch-check 2>&1 | tail -n 1) || rc=$?
  echo "$line"
  ((rc == 0)) || line="failed (rc=$rc: ${line:-no output}): JETRL_TRITON_DIRECT_LAUNCH=0 from here on"
  echo "$line" >"$work/direct_launch.txt"
}

report() {
  "$py" benchmarks/gpu/session.py report "$work" "$out" || echo "device_session: report failed"
  tar -czf "$out/logs.tar.gz" -C "$work" logs json 2>/dev/null || echo "device_session: tar failed"
}

pack_cache() {  # the Triton cache back into OUTDIR, under what one returned file may weigh
  [[ -s "$work/stamp" ]] || return 0
  echo "triton cache: $(find "$triton_dir" -mindepth 1 -maxdepth 1 -type d -newer "$work/start" | wc -l) kernels compiled during this call" >>"$work/header.txt"
  cp "$work/stamp" "$triton_dir/STAMP"
  local tarball=$out/triton-cache.tar.gz
  tar -czf "$tarball" -C "$triton_dir" .
  if (($(stat -c %s "$tarball") > RETURN_MIB * 1048576)); then  # keep this call's kernels only
    (cd "$triton_dir" && find . -newer "$work/start" -type f -print0 |
      tar -czf "$tarball" --null -T -)
    echo "triton cache: over ${RETURN_MIB} MiB, only this call's kernels kept" >>"$work/header.txt"
  fi
  if (($(stat -c %s "$tarball") > RETURN_MIB * 1048576)); then
    rm -f "$tarball"
    echo "triton cache: not returned (over ${RETURN_MIB} MiB)" >>"$work/header.txt"
  fi
}

session() {
  out=$1
  mkdir -p "$out"
  [[ -z "$(ls -A "$out")" ]] || echo "device_session: $out is not empty: its files are rewritten"
  work=$(mktemp -d /tmp/jetrl-session.XXXXXX)
  mkdir -p "$work/logs" "$work/json" "$triton_dir"
  preload_census  # before the start mark: what the call compiles itself is newer than it
  touch "$work/start"
  export work
  export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
  export TRITON_CACHE_DIR=$triton_dir TRITON_STORE_BINARY_ONLY=${JETRL_TRITON_BINARY_ONLY:-1}
  unset TRITON_INTERPRET
  if [[ -n "${JETRL_SOURCE:-}" ]]; then
    echo "$JETRL_SOURCE" >"$work/source.txt"
  elif [[ -n "$wheels" && -f "$wheels/SOURCE.txt" ]]; then
    cp "$wheels/SOURCE.txt" "$work/source.txt"
  fi
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "budget: ${BUDGET_S} s, run in one call (JETRL_PART $part)"
    if command -v nvidia-smi >/dev/null; then
      echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
    fi
  } >"$work/header.txt"
  : >"$work/steps.tsv"
  local t_start=$SECONDS failed=0 stopped=0
  step() {
    local name=$1 limit=$2 elastic=0
    shift 2
    if [[ ${1:-} == --elastic ]]; then elastic=1; shift; fi
    local left=$((BUDGET_S - PACK_S - (SECONDS - t_start)))
    if ((stopped)); then
      printf '%s\t%s\t\t0\t%s\n' "$name" "$limit" "not run: the preflight failed" >>"$work/steps.tsv"
      return
    fi
    if ((limit == 0)); then
      printf '%s\t0\t\t0\t%s\n' "$name" "skipped (limit 0)" >>"$work/steps.tsv"
      echo "== $name skipped (limit 0)"
      return
    fi
    ((elastic)) && limit=$left
    ((limit <= left)) || limit=$left
    if ((limit <= 0)); then
      printf '%s\t%s\t\t0\t%s\n' "$name" "$limit" "not run: no time left" >>"$work/steps.tsv"
      echo "== $name not run (no time left)"
      return
    fi
    local log=$work/logs/$name.log t0=$SECONDS rc note=""
    echo "== $name (limit ${limit}s)"
    echo "== $name (limit ${limit}s): $*" >"$log"
    set +e
    timeout -k "$KILL_S" "$limit" "$@" >>"$log" 2>&1
    rc=$?
    set -e
    ((rc != 124 && rc != 137)) || note="TIMEOUT"
    ((rc == 0)) || failed=1
    echo "== $name rc=$rc in $((SECONDS - t0))s ${note}" >>"$log"
    tail -n +2 "$log" | tail -n 4
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$limit" "$rc" "$((SECONDS - t0))" "$note" >>"$work/steps.tsv"
    if [[ $name == preflight ]]; then
      grep '^preflight: version' "$log" | sed 's/^preflight: //' >>"$work/header.txt" || true
      if ((rc != 0)); then
        stopped=1
        echo "device_session: the preflight failed (rc=$rc): no step runs; see its log's last line"
      else
        echo "stamp: $(cat "$work/stamp")" >>"$work/header.txt"
        reuse_cache
        direct_launches
      fi
    fi
    report
  }
  plan
  pack_cache
  echo "finished in $((SECONDS - t_start)) s of ${BUDGET_S}" >>"$work/header.txt"
  report
  rm -rf "$work"
  echo "device_session: wrote $(cd "$out" && printf '%s ' *)in $out"
  cat "$out/summary.txt"
  ((stopped)) && return 3
  return "$failed"
}

direct_launches() {  # after the preflight: the check's verdict (inner_preflight) for every later step
  [[ -f "$work/direct_launch.txt" ]] || return 0
  local line
  line=$(cat "$work/direct_launch.txt")
  [[ $line != failed* ]] || export JETRL_TRITON_DIRECT_LAUNCH=0
  echo "direct launches: $line" >>"$work/header.txt"
}

preload_census() {  # --prepare's sm_90 census cache, as filed, re-keyed or not (census_cache.py)
  local tarball=$carry_cache/sm90-census-cache.tar.gz
  [[ -f "$tarball" ]] || return 0
  "$py" scripts/census_cache.py unpack "$tarball" "$triton_dir" >"$work/census.txt" 2>&1 || true
}

reuse_cache() {  # the carried Triton cache, only under the same versions
  local tarball=$carry_cache/triton-cache.tar.gz note
  if [[ ! -f "$tarball" ]]; then
    note="cold (no $tarball carried)"
  else
    local old
    old=$(tar -xzOf "$tarball" ./STAMP 2>/dev/null || true)
    if [[ "$old" == "$(cat "$work/stamp")" ]]; then
      tar -xzf "$tarball" -C "$triton_dir"
      note="reused $(tar -tzf "$tarball" | grep -vc '/$' || true) files from $tarball"
    else
      note="cold (carried cache not reused: made under '${old:-no stamp}')"
    fi
  fi
  echo "triton cache: $note" >>"$work/header.txt"
  [[ ! -f "$work/census.txt" ]] || cat "$work/census.txt" >>"$work/header.txt"
}

# --prepare and --collect run here, not on the device: their functions live beside this script
# shellcheck source=benchmarks/gpu/device_host.sh
source benchmarks/gpu/device_host.sh
case ${1:-} in
  --dry-run) dry_run ;;
  --prepare) prepare ;;
  --collect) collect "${2:?--collect DIR [DEST]}" "${3:-}" ;;
  --_preflight) inner_preflight ;;
  "" | -h | --help) sed -n '2,/^set -euo/p' "$self" | sed '$d' ;;
  -*) echo "device_session: unknown option $1 (see --help)" >&2; exit 2 ;;
  *) session "$1" ;;
esac
