#!/usr/bin/env bash
# Submit `jetrl train CONFIG --backend nemo-rl` to SLURM through NeMo-RL's own ray.sub.
#
# NeMo-RL's convention (README.md in NVIDIA-NeMo/RL): ray.sub brings up a Ray cluster in the
# container on every allocated node and runs $COMMAND on the head node; it reads CONTAINER,
# MOUNTS, COMMAND (and optional SETUP_COMMAND, GPUS_PER_NODE, ...) from the environment, and the
# sbatch flags (--nodes, --account, --partition, --time, --gres=gpu:8) from the command line.
# This script only fills those in; it does not replace ray.sub.
#
# Nodes and GPUs are never guessed. They come from the config's cluster.num_nodes /
# cluster.gpus_per_node, read with nemo_jetrl's loader (defaults chain and command-line
# overrides applied) when $PYTHON can import nemo_jetrl; NODES / GPUS_PER_NODE that disagree
# with the config are refused, naming both. When $PYTHON cannot read the config (the usual
# login node), a cluster.num_nodes=N / cluster.gpus_per_node=G override on the command line
# counts as the config's value; otherwise NODES and GPUS_PER_NODE must both be set (exit 2
# naming them). Either way the values SLURM is asked for reach the run as cluster.num_nodes=... /
# cluster.gpus_per_node=... overrides (last override wins): read from the config, they change
# nothing; set by you when the config could not be read, they replace the config's values.
# A $PYTHON that imports nemo_jetrl also refuses (exit 2, nothing submitted) what `jetrl train`
# would refuse when the job starts (nemo_jetrl/backends/nemo_rl/submission.py).
#
# Usage (on the login node, from the repository root):
#   RAY_SUB=./ray.sub CONTAINER=/path/nemo-jetrl.sqsh ACCOUNT=myacct PARTITION=batch \
#   TIME=4:00:00 PYTHON=~/jetrl-venv/bin/python \
#     bash slurm/launch.sh examples/configs/qwen3_8b_base/jetrl.yaml [key=value ...]
#   (without such a PYTHON: NODES=1 GPUS_PER_NODE=8 bash slurm/launch.sh ..., the config's values)
# It prints the job id on stdout (sbatch --parsable), so a second job can wait for it:
#   first=$(bash slurm/launch.sh A.yaml) && DEPENDENCY=afterany:$first bash slurm/launch.sh B.yaml
#
# Get ray.sub from the image once (it is NeMo-RL's file, we do not ship a copy; the image's
# entrypoint must not run, or its banner lands in the file):
#   docker run --rm --entrypoint cat nemo-jetrl:latest /opt/nemo-rl/ray.sub > ray.sub   (Docker)
#   srun -N1 --no-container-entrypoint --container-image=$PWD/nemo-jetrl.sqsh \
#     cat /opt/nemo-rl/ray.sub > ray.sub                                                 (pyxis)
#
# Environment:
#   RAY_SUB     path to NeMo-RL's ray.sub                      (default: ./ray.sub)
#   CONTAINER   image for srun --container-image (enroot .sqsh or registry name; required)
#   MOUNTS      extra container mounts, comma-separated, added to "$PWD:$PWD" (the clone; its
#               physical path too when it differs: SLURM_SUBMIT_DIR) and to $BASE_LOG_DIR and
#               $HF_HOME when set; no spaces or commas inside a path
#   BASE_LOG_DIR  where ray.sub writes <jobid>-logs (default: the submission directory)
#   ACCOUNT, PARTITION, TIME (default 4:00:00),
#   NODES       default: the config's cluster.num_nodes; required when it cannot be read
#   GPUS_PER_NODE  default: the config's cluster.gpus_per_node; required when it cannot be read
#   GRES        sbatch --gres (default: gpu:$GPUS_PER_NODE, as NeMo-RL's README passes
#               --gres=gpu:8); GRES=gpu:h100:8 passes that; GRES= (empty) or GRES=none passes
#               none, for clusters that refuse --gres
#   DEPENDENCY  sbatch --dependency, e.g. afterany:<jobid> (docs/cluster.md section 6: the first
#               recipe converts the HF model into $HF_HOME/nemo_rl, the others wait for it)
#   PYTHON      a Python that imports nemo_jetrl, to read the config (default: python3)
#   JOB_NAME (default: jetrl-<config stem>), HF_HOME (created, mounted and exported when set;
#               required for more than one node: the HF cache and NeMo-RL's converted checkpoints
#               must be on storage every node sees, and ray.sub does not mount $HOME),
#   HF_TOKEN    for gated models (Llama): exported in your shell, sbatch/srun pass it on; it is
#               never written into the command line
#   DEDICATED_RAY_HEAD=1  NeMo-RL main's ray.sub: the first node runs only the Ray head, so
#               sbatch asks for NODES + 1 nodes (the run keeps cluster.num_nodes=$NODES); the
#               config's env.nemo_gym.num_gpu_nodes are asked for on top as well
#   DRY_RUN=1   print the sbatch command instead of running it.
# The driver command (COMMAND) runs `jetrl train` with PYTHONUNBUFFERED=1 (ray.sub sends its
# output to <jobid>-logs/ray-driver.log) and first compares the image's nemo_jetrl commit
# (`jetrl --version`) with this clone's (git rev-parse HEAD at submission, JETRL_CLONE_COMMIT):
# a difference is a warning in the driver log, not an error.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  sed -n '2,64p' "$0" >&2
  exit 2
fi
config=$1
shift
[[ -f "$config" ]] || { echo "launch.sh: config not found: $config" >&2; exit 2; }

RAY_SUB=${RAY_SUB:-./ray.sub}
if [[ -z "${DRY_RUN:-}" ]]; then
  [[ -f "$RAY_SUB" ]] || {
    echo "launch.sh: $RAY_SUB not found; extract it from the image (see the top of this file)" >&2
    exit 2
  }
  # an entrypoint's banner in front of it: sbatch would refuse the file at submission
  if [[ "$(head -c 2 "$RAY_SUB")" != "#!" ]] || ! grep -q DRIVER_COMMAND_FILE "$RAY_SUB"; then
    echo "launch.sh: $RAY_SUB is not NeMo-RL's ray.sub (no #! first line, or no DRIVER_COMMAND_FILE);" \
      "extract it again without the image's entrypoint (see the top of this file)" >&2
    exit 2
  fi
fi
: "${CONTAINER:?set CONTAINER to the nemo-jetrl image (see docs/cluster.md)}"
: "${ACCOUNT:?set ACCOUNT (sbatch --account)}"
: "${PARTITION:?set PARTITION (sbatch --partition)}"
TIME=${TIME:-4:00:00}
DEPENDENCY=${DEPENDENCY:-}
if [[ "$DEPENDENCY" == *: || "$DEPENDENCY" == *:[,?]* ]]; then
  echo "launch.sh: DEPENDENCY=$DEPENDENCY names no job id (did the first submission fail?)" >&2
  exit 2
fi

# The config's cluster size and model (with its defaults: chain and the command-line overrides).
PYTHON=${PYTHON:-python3}
py_err=$(mktemp)
trap 'rm -f "$py_err"' EXIT
read_error=""
# With nemo_jetrl importable this also refuses (exit 2, nothing submitted) what `jetrl train`
# would refuse at the job's start: nemo_jetrl/backends/nemo_rl/submission.py.
py_rc=0
cfg_line=$("$PYTHON" - "$config" "$@" 2>"$py_err" <<'PY'
import sys
try:
    from nemo_jetrl.backends.nemo_rl.submission import main
except ImportError as exc:  # a login-node Python without nemo_jetrl: say so, exit 3
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(3)
sys.exit(main(sys.argv[1:]))
PY
) || py_rc=$?
if ((py_rc == 2)); then
  {
    echo "launch.sh: jetrl train would refuse $config when the job starts; nothing submitted:"
    sed 's/^/  /' "$py_err"
  } >&2
  exit 2
fi
grep '^launch.sh: note: ' "$py_err" >&2 || true
if ((py_rc == 0)); then
  read -r cfg_nodes cfg_gpus cfg_model cfg_ckpt cfg_logs cfg_gym <<<"$cfg_line"
  source_of="the config"
else
  read_error=$(grep -v '^\s*$' "$py_err" | tail -n 1 || true)
  cfg_nodes=- cfg_gpus=- cfg_model=- cfg_ckpt=- cfg_logs=- cfg_gym=-
  # A cluster.* override on the command line is what the run will use (last one wins).
  for o in "$@"; do
    case "$o" in
      cluster.num_nodes=* | +cluster.num_nodes=* | ++cluster.num_nodes=*) cfg_nodes=${o#*=} ;;
      cluster.gpus_per_node=* | +cluster.gpus_per_node=* | ++cluster.gpus_per_node=*) cfg_gpus=${o#*=} ;;
    esac
  done
  source_of="the command line"
fi
if [[ "$source_of" == "the config" ]]; then
  why="it has no cluster.num_nodes / cluster.gpus_per_node"
else
  why="PYTHON=$PYTHON could not read it${read_error:+ ($read_error)}"
fi
if [[ "$cfg_nodes" == "-" && -z "${NODES:-}" ]] || [[ "$cfg_gpus" == "-" && -z "${GPUS_PER_NODE:-}" ]]; then
  {
    echo "launch.sh: cannot tell how many nodes and GPUs $config needs: $why."
    echo "  Either set PYTHON to a Python that imports nemo_jetrl (e.g. python3 -m venv ~/jetrl-venv &&"
    echo "  ~/jetrl-venv/bin/pip install --no-deps -e . && ~/jetrl-venv/bin/pip install omegaconf pydantic),"
    echo "  or set NODES and GPUS_PER_NODE to the config's cluster.num_nodes and cluster.gpus_per_node"
    echo "  (they are then passed to the run as cluster.num_nodes=\$NODES cluster.gpus_per_node=\$GPUS_PER_NODE)."
  } >&2
  exit 2
fi
if [[ "$source_of" != "the config" || "$cfg_nodes" == "-" || "$cfg_gpus" == "-" ]]; then
  echo "launch.sh: note: $config: $why; using NODES=${NODES:-$cfg_nodes} GPUS_PER_NODE=${GPUS_PER_NODE:-$cfg_gpus}" \
    "as set, passed to the run as cluster.num_nodes=${NODES:-$cfg_nodes}" \
    "cluster.gpus_per_node=${GPUS_PER_NODE:-$cfg_gpus} (they replace the config's values)" >&2
fi
[[ "$cfg_nodes" == "-" ]] && cfg_nodes=$NODES
[[ "$cfg_gpus" == "-" ]] && cfg_gpus=$GPUS_PER_NODE
NODES=${NODES:-$cfg_nodes}
GPUS_PER_NODE=${GPUS_PER_NODE:-$cfg_gpus}
for v in NODES GPUS_PER_NODE; do
  if ! [[ "${!v}" =~ ^[1-9][0-9]*$ ]]; then
    echo "launch.sh: $v=${!v} (from $source_of if not set): a whole number of at least 1 is needed" >&2
    exit 2
  fi
done
if [[ "$NODES" != "$cfg_nodes" ]]; then
  echo "launch.sh: NODES=$NODES but $source_of has cluster.num_nodes=$cfg_nodes ($config):" \
    "unset NODES, or pass cluster.num_nodes=$NODES" >&2
  exit 2
fi
if [[ "$GPUS_PER_NODE" != "$cfg_gpus" ]]; then
  echo "launch.sh: GPUS_PER_NODE=$GPUS_PER_NODE but $source_of has cluster.gpus_per_node=$cfg_gpus ($config):" \
    "unset GPUS_PER_NODE, or pass cluster.gpus_per_node=$GPUS_PER_NODE" >&2
  exit 2
fi
export GPUS_PER_NODE
# ray.sub (v0.7.0 and main) exits 1 at the job's start, after the queue, when the partition's
# GRES (sinfo %G) names a GPU count other than GPUS_PER_NODE: it claims whole nodes. Where sinfo
# answers with one count, a different one is refused here instead.
if command -v sinfo >/dev/null 2>&1; then
  part_gres=$(sinfo -p "$PARTITION" -h -o %G 2>/dev/null || true)
  # ray.sub's own reading: the last ':' field of the line (of "gpu:8,nvme:1" that is 1)
  raysub_gpus=$(awk '/gpu:/ { sub(/\(.*/, ""); n = split($0, f, ":"); print f[n] }' <<<"$part_gres" | sort -u)
  # the GPU count itself: the gpu: entry of the comma-separated list
  part_gpus=$(tr ',' '\n' <<<"$part_gres" | awk '/^gpu:/ { sub(/\(.*/, ""); n = split($0, f, ":"); print f[n] }' | sort -u)
  if [[ "$raysub_gpus" =~ ^[0-9]+$ ]] && ((raysub_gpus != GPUS_PER_NODE)); then
    if [[ "$part_gpus" =~ ^[0-9]+$ ]] && ((part_gpus == GPUS_PER_NODE)); then
      echo "launch.sh: partition $PARTITION's GRES ($(tr '\n' ' ' <<<"$part_gres")) has" \
        "$part_gpus GPUs a node, but NeMo-RL's ray.sub reads it as $raysub_gpus (the last ':'" \
        "field) and exits 1 at the job's start: use a partition whose GRES lists gpu last, or" \
        "fix ray.sub's maybe_gres_arg" >&2
    else
      echo "launch.sh: GPUS_PER_NODE=$GPUS_PER_NODE but partition $PARTITION's nodes have" \
        "${part_gpus:-$raysub_gpus} GPUs (sinfo: $(tr '\n' ' ' <<<"$part_gres")): NeMo-RL's ray.sub" \
        "refuses that at the job's start (it claims every GPU of a node); use" \
        "cluster.gpus_per_node=${part_gpus:-$raysub_gpus} or a partition of $GPUS_PER_NODE-GPU nodes" >&2
    fi
    exit 2
  fi
fi
if [[ "$cfg_model" == meta-llama/* && -z "${HF_TOKEN:-}" ]]; then
  echo "launch.sh: note: $cfg_model is gated on the HuggingFace hub: export HF_TOKEN (or have it in \$HF_HOME) before submitting" >&2
fi
stem=$(basename "$(dirname "$config")")-$(basename "$config" .yaml)
JOB_NAME=${JOB_NAME:-jetrl-$stem}

# The submission directory as SLURM records it: sbatch sets SLURM_SUBMIT_DIR with getcwd(), the
# path with its symlinks resolved ($HOME -> /lustre/...), and ray.sub makes <jobid>-logs there
# and starts every container in it (--container-workdir): it must be mounted as well as $PWD.
submit_dir=$(pwd -P)
# ray.sub passes MOUNTS to srun unquoted and comma-separated: a path with either breaks it
for v in PWD submit_dir HF_HOME BASE_LOG_DIR MOUNTS; do
  if [[ "${!v:-}" =~ [[:space:]] ]] || [[ $v != MOUNTS && "${!v:-}" == *,* ]]; then
    echo "launch.sh: $v=${!v} has a space or a comma, which ray.sub's srun mounts cannot carry;" \
      "use a path without them" >&2
    exit 2
  fi
done
extra_mounts=${MOUNTS:-}
MOUNTS="$PWD:$PWD"  # the clone always: the driver runs there
[[ "$submit_dir" == "$PWD" ]] || MOUNTS+=",$submit_dir:$submit_dir"
MOUNTS+="${extra_mounts:+,$extra_mounts}"
env_prefix="PYTHONUNBUFFERED=1 "   # ray.sub sends the driver's stdout to a file
if [[ -n "${BASE_LOG_DIR:-}" ]]; then
  MOUNTS+=",$BASE_LOG_DIR:$BASE_LOG_DIR"  # ray.sub's head container checks a file there
fi
if [[ -n "${HF_HOME:-}" ]]; then
  [[ -n "${DRY_RUN:-}" ]] || mkdir -p "$HF_HOME"  # a bind mount of a missing path fails
  MOUNTS+=",$HF_HOME:$HF_HOME"
  env_prefix+="HF_HOME=$(printf '%q' "$HF_HOME") "
elif ((NODES > 1)); then
  echo "launch.sh: set HF_HOME to a directory every node mounts: with $NODES nodes the HF cache and" \
    "NeMo-RL's converted checkpoints must be shared (ray.sub does not mount \$HOME)" >&2
  exit 2
else
  echo "launch.sh: note: HF_HOME is not set: the model download and NeMo-RL's converted checkpoint" \
    "stay inside this job's container (ray.sub does not mount \$HOME) and are redone by every job" >&2
fi
# Where the run writes outside the clone must be mounted too, or it stays in one container.
# The run sees a mount's container side: SRC:DST[:FLAGS] (pyxis), DST is what it writes to.
mounted() {
  local p=$1 m dst
  IFS=, read -r -a ms <<<"$MOUNTS"
  for m in "${ms[@]}"; do
    dst=${m#*:} && dst=${dst%%:*}
    [[ "$p" == "$dst" || "$p" == "$dst"/* ]] && return 0
  done
  return 1
}
# And what it reads: the config itself (the driver runs in the clone) and a local model path.
config_abs=$(cd "$(dirname "$config")" && pwd)/$(basename "$config")
for pair in "checkpointing.checkpoint_dir=${cfg_ckpt:--}" "logger.log_dir=${cfg_logs:--}" \
  "the config=$config_abs" "policy.model_name=${cfg_model:--}"; do
  key=${pair%%=*} path=${pair#*=}
  path=${path//\\040/ }
  [[ "$path" == /* ]] || continue  # relative: under the clone, which is mounted (or a hub id)
  if ! mounted "$path" && ! mounted "$(realpath -m "$path")"; then
    case $key in
      checkpointing.* | logger.*) what="the run would write it inside one node's container and lose it" ;;
      *) what="the job could not read it" ;;
    esac
    echo "launch.sh: $key=$path is outside every container mount ($MOUNTS): $what;" \
      "add its directory to MOUNTS" >&2
    exit 2
  fi
done

# The image's nemo_jetrl against this clone's commit (the configs were written for the clone's
# HEAD), run in the container before the driver: a warning in the driver log, never a failure.
# The commits compare as equal when one is a prefix (>= 7 hex digits) of the other.
clone_commit=$(git -C "$(dirname "$config")" rev-parse HEAD 2>/dev/null || true)
commit_check=""
if [[ -n "$clone_commit" ]]; then
  commit_check=$(cat <<'SH'
img=$(jetrl --version 2>/dev/null | sed -n 's/.*(commit \([^)]*\)).*/\1/p');
clone=$JETRL_CLONE_COMMIT;
if [[ -z $img || $img == unknown ]]; then
  echo "launch: note: the image's nemo_jetrl does not say its commit (jetrl --version); not compared with this clone's $clone" >&2;
elif [[ ${#img} -ge 7 && $clone == "$img"* ]] || [[ ${#clone} -ge 7 && $img == "$clone"* ]]; then
  echo "launch: the image's nemo_jetrl is commit $img, as this clone" >&2;
else
  echo "launch: warning: the image's nemo_jetrl is commit $img, this clone is at $clone: the clone's configs may need what that commit lacks; rebuild the image from this clone (docs/cluster.md 1a) or check out $img" >&2;
fi;
SH
)
  commit_check="export JETRL_CLONE_COMMIT=$clone_commit; ${commit_check//$'\n'/ } "
else
  echo "launch.sh: note: $(dirname "$config") is not in a git checkout (git rev-parse HEAD failed there): the image's nemo_jetrl commit is not compared with it" >&2
fi

# The driver command ray.sub runs on the head node, inside the container (it writes COMMAND to
# a file and runs it with bash).
overrides=""
for o in "$@"; do overrides+=" $(printf '%q' "$o")"; done
# What SLURM is asked for reaches the config (last override wins).
overrides+=" cluster.num_nodes=$NODES cluster.gpus_per_node=$GPUS_PER_NODE"
COMMAND="cd $(printf '%q' "$PWD") || exit 2; ${commit_check}${env_prefix}jetrl train $(printf '%q' "$config") --backend nemo-rl${overrides}"
export CONTAINER MOUNTS COMMAND

# NeMo-RL main's ray.sub can keep the first node for the Ray head alone (DEDICATED_RAY_HEAD=1):
# SLURM is then asked for one node more than the run's cluster.num_nodes GPU nodes.
DEDICATED_RAY_HEAD=${DEDICATED_RAY_HEAD:-0}
if [[ "$DEDICATED_RAY_HEAD" != 0 && "$DEDICATED_RAY_HEAD" != 1 ]]; then
  echo "launch.sh: DEDICATED_RAY_HEAD=$DEDICATED_RAY_HEAD: use 0 or 1" >&2
  exit 2
fi
if ((DEDICATED_RAY_HEAD)) && [[ -f "$RAY_SUB" ]] && ! grep -q DEDICATED_RAY_HEAD "$RAY_SUB"; then
  echo "launch.sh: DEDICATED_RAY_HEAD=1 but $RAY_SUB has no dedicated-head mode (NeMo-RL v0.7.0's" \
    "has none; main's has): unset it" >&2
  exit 2
fi
export DEDICATED_RAY_HEAD
# NeMo-Gym's GPU nodes (env.nemo_gym.num_gpu_nodes) come on top of cluster.num_nodes (NeMo-RL
# main's ray.sub says so): SLURM is asked for them too.
gym_nodes=0
if [[ "${cfg_gym:--}" =~ ^[0-9]+$ ]] && ((cfg_gym > 0)); then
  gym_nodes=$cfg_gym
  echo "launch.sh: note: env.nemo_gym.num_gpu_nodes=$gym_nodes: asking SLURM for" \
    "$((NODES + gym_nodes + DEDICATED_RAY_HEAD)) nodes (cluster.num_nodes=$NODES stays the run's)" >&2
fi
cmd=(sbatch --parsable --nodes="$((NODES + gym_nodes + DEDICATED_RAY_HEAD))" --account="$ACCOUNT" --partition="$PARTITION"
     --time="$TIME" --job-name="$JOB_NAME")
GRES=${GRES-gpu:$GPUS_PER_NODE}
[[ -n "$GRES" && "$GRES" != none ]] && cmd+=(--gres="$GRES")
[[ -n "$DEPENDENCY" ]] && cmd+=(--dependency="$DEPENDENCY")
cmd+=("$RAY_SUB")
if [[ -n "${DRY_RUN:-}" ]]; then
  printf 'CONTAINER=%q MOUNTS=%q COMMAND=%q GPUS_PER_NODE=%q ' \
    "$CONTAINER" "$MOUNTS" "$COMMAND" "$GPUS_PER_NODE"
  ((DEDICATED_RAY_HEAD)) && printf 'DEDICATED_RAY_HEAD=1 '
  printf '\\\n  '
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
out=$("${cmd[@]}")
jobid=${out%%;*}   # --parsable prints <jobid>[;<cluster>]
echo "launch.sh: submitted job $jobid ($JOB_NAME); driver log: ${BASE_LOG_DIR:-$PWD}/$jobid-logs/ray-driver.log" >&2
echo "$jobid"
