#!/usr/bin/env bash
# Submit `jetrl train CONFIG --backend nemo-rl` to SLURM through NeMo-RL's own ray.sub.
#
# NeMo-RL's convention (docs/cluster.md in NVIDIA-NeMo/RL): ray.sub brings up a Ray cluster in
# the container on every allocated node and runs $COMMAND on the head node; it reads CONTAINER,
# MOUNTS, COMMAND (and optional SETUP_COMMAND, GPUS_PER_NODE, ...) from the environment, and the
# sbatch flags (--nodes, --account, --partition, --time, --gres) from the command line. This
# script only fills those in; it does not replace ray.sub.
#
# Usage (on the login node, from the repository root):
#   RAY_SUB=./ray.sub CONTAINER=/path/nemo-jetrl.sqsh ACCOUNT=myacct PARTITION=batch \
#   NODES=1 TIME=4:00:00 \
#     bash slurm/launch.sh examples/configs/qwen3_8b_base/jetrl.yaml [key=value ...]
#
# Get ray.sub from the image once (it is NeMo-RL's file, we do not ship a copy):
#   docker run --rm nemo-jetrl:latest cat /opt/nemo-rl/ray.sub > ray.sub
#
# Environment:
#   RAY_SUB     path to NeMo-RL's ray.sub                      (default: ./ray.sub)
#   CONTAINER   image for srun --container-image (enroot .sqsh or registry name; required)
#   MOUNTS      extra container mounts, comma-separated        (default: "$PWD:$PWD")
#   ACCOUNT, PARTITION, NODES (default 1), TIME (default 4:00:00), GPUS_PER_NODE (default 8),
#   JOB_NAME (default: jetrl-<config stem>), HF_HOME (mounted and exported when set),
#   DRY_RUN=1   print the sbatch command instead of running it.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  sed -n '2,24p' "$0" >&2
  exit 2
fi
config=$1
shift
[[ -f "$config" ]] || { echo "launch.sh: config not found: $config" >&2; exit 2; }

RAY_SUB=${RAY_SUB:-./ray.sub}
if [[ -z "${DRY_RUN:-}" ]]; then
  [[ -f "$RAY_SUB" ]] || {
    echo "launch.sh: $RAY_SUB not found; extract it: docker run --rm nemo-jetrl:latest cat /opt/nemo-rl/ray.sub > ray.sub" >&2
    exit 2
  }
fi
: "${CONTAINER:?set CONTAINER to the nemo-jetrl image (see docs/cluster.md)}"
: "${ACCOUNT:?set ACCOUNT (sbatch --account)}"
: "${PARTITION:?set PARTITION (sbatch --partition)}"
NODES=${NODES:-1}
TIME=${TIME:-4:00:00}
export GPUS_PER_NODE=${GPUS_PER_NODE:-8}
stem=$(basename "$(dirname "$config")")-$(basename "$config" .yaml)
JOB_NAME=${JOB_NAME:-jetrl-$stem}

MOUNTS=${MOUNTS:-"$PWD:$PWD"}
env_prefix=""
if [[ -n "${HF_HOME:-}" ]]; then
  MOUNTS+=",$HF_HOME:$HF_HOME"
  env_prefix="HF_HOME=$(printf '%q' "$HF_HOME") "
fi

# The driver command ray.sub runs on the head node, inside the container.
overrides=""
for o in "$@"; do overrides+=" $(printf '%q' "$o")"; done
COMMAND="cd $(printf '%q' "$PWD") && ${env_prefix}jetrl train $(printf '%q' "$config") --backend nemo-rl${overrides}"
export CONTAINER MOUNTS COMMAND

cmd=(sbatch --nodes="$NODES" --account="$ACCOUNT" --partition="$PARTITION" --time="$TIME"
     --job-name="$JOB_NAME" --gres=gpu:"$GPUS_PER_NODE" "$RAY_SUB")
if [[ -n "${DRY_RUN:-}" ]]; then
  printf 'CONTAINER=%q MOUNTS=%q COMMAND=%q GPUS_PER_NODE=%q \\\n  ' \
    "$CONTAINER" "$MOUNTS" "$COMMAND" "$GPUS_PER_NODE"
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
"${cmd[@]}"
