#!/usr/bin/env bash
# Submit `jetrl train CONFIG --backend nemo-rl` to SLURM through NeMo-RL's own ray.sub.
#
# NeMo-RL's convention (docs/cluster.md in NVIDIA-NeMo/RL): ray.sub brings up a Ray cluster in
# the container on every allocated node and runs $COMMAND on the head node; it reads CONTAINER,
# MOUNTS, COMMAND (and optional SETUP_COMMAND, GPUS_PER_NODE, ...) from the environment, and the
# sbatch flags (--nodes, --account, --partition, --time) from the command line. This script only
# fills those in; it does not replace ray.sub.
#
# Nodes and GPUs come from one place: the config's cluster.num_nodes / cluster.gpus_per_node
# (read with nemo_jetrl's loader when $PYTHON can import it) set sbatch --nodes and GPUS_PER_NODE,
# and the values SLURM is asked for are passed to the run as cluster.num_nodes=... /
# cluster.gpus_per_node=... overrides. NODES / GPUS_PER_NODE (or cluster.* overrides on the
# command line) that disagree with the config are refused, naming both.
#
# Usage (on the login node, from the repository root):
#   RAY_SUB=./ray.sub CONTAINER=/path/nemo-jetrl.sqsh ACCOUNT=myacct PARTITION=batch \
#   NODES=1 TIME=4:00:00 \
#     bash slurm/launch.sh examples/configs/qwen3_8b_base/jetrl.yaml [key=value ...]
#
# Get ray.sub from the image once (it is NeMo-RL's file, we do not ship a copy):
#   docker run --rm nemo-jetrl:latest cat /opt/nemo-rl/ray.sub > ray.sub        (Docker)
#   srun -N1 --container-image=$PWD/nemo-jetrl.sqsh cat /opt/nemo-rl/ray.sub > ray.sub  (pyxis)
#
# Environment:
#   RAY_SUB     path to NeMo-RL's ray.sub                      (default: ./ray.sub)
#   CONTAINER   image for srun --container-image (enroot .sqsh or registry name; required)
#   MOUNTS      extra container mounts, comma-separated        (default: "$PWD:$PWD")
#   ACCOUNT, PARTITION, TIME (default 4:00:00),
#   NODES       default: the config's cluster.num_nodes (1 if it cannot be read)
#   GPUS_PER_NODE  default: the config's cluster.gpus_per_node (8 if it cannot be read)
#   GRES        e.g. gpu:8; passed to sbatch as --gres only when set (ray.sub detects GRES
#               for its own srun steps)
#   PYTHON      a Python that imports nemo_jetrl, to read the config (default: python3)
#   JOB_NAME (default: jetrl-<config stem>), HF_HOME (mounted and exported when set),
#   HF_TOKEN    for gated models (Llama): exported in your shell, sbatch/srun pass it on; it is
#               never written into the command line
#   DRY_RUN=1   print the sbatch command instead of running it.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  sed -n '2,40p' "$0" >&2
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
fi
: "${CONTAINER:?set CONTAINER to the nemo-jetrl image (see docs/cluster.md)}"
: "${ACCOUNT:?set ACCOUNT (sbatch --account)}"
: "${PARTITION:?set PARTITION (sbatch --partition)}"
TIME=${TIME:-4:00:00}

# The config's cluster size and model (with its defaults: chain and the command-line overrides).
read -r cfg_nodes cfg_gpus cfg_model < <(
  "${PYTHON:-python3}" - "$config" "$@" 2>/dev/null <<'PY' || echo "- - -"
import sys
from omegaconf import OmegaConf
from nemo_jetrl.config import load_config
cfg = load_config(sys.argv[1], [o for o in sys.argv[2:] if "=" in o])
sel = lambda k: OmegaConf.select(cfg, k, default=None)
print(sel("cluster.num_nodes") or "-", sel("cluster.gpus_per_node") or "-", sel("policy.model_name") or "-")
PY
)
if [[ "$cfg_nodes" == "-" ]]; then
  echo "launch.sh: note: could not read cluster.num_nodes from $config (set PYTHON to a Python that imports nemo_jetrl); using NODES=${NODES:-1}" >&2
  cfg_nodes=${NODES:-1}
fi
[[ "$cfg_gpus" == "-" ]] && cfg_gpus=${GPUS_PER_NODE:-8}
NODES=${NODES:-$cfg_nodes}
GPUS_PER_NODE=${GPUS_PER_NODE:-$cfg_gpus}
if [[ "$NODES" != "$cfg_nodes" ]]; then
  echo "launch.sh: NODES=$NODES but the config has cluster.num_nodes=$cfg_nodes ($config):" \
    "unset NODES, or pass cluster.num_nodes=$NODES" >&2
  exit 2
fi
if [[ "$GPUS_PER_NODE" != "$cfg_gpus" ]]; then
  echo "launch.sh: GPUS_PER_NODE=$GPUS_PER_NODE but the config has cluster.gpus_per_node=$cfg_gpus ($config):" \
    "unset GPUS_PER_NODE, or pass cluster.gpus_per_node=$GPUS_PER_NODE" >&2
  exit 2
fi
export GPUS_PER_NODE
if [[ "$cfg_model" == meta-llama/* && -z "${HF_TOKEN:-}" ]]; then
  echo "launch.sh: note: $cfg_model is gated on the HuggingFace hub: export HF_TOKEN (or have it in \$HF_HOME) before submitting" >&2
fi
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
# What SLURM is asked for reaches the config (last override wins).
overrides+=" cluster.num_nodes=$NODES cluster.gpus_per_node=$GPUS_PER_NODE"
COMMAND="cd $(printf '%q' "$PWD") && ${env_prefix}jetrl train $(printf '%q' "$config") --backend nemo-rl${overrides}"
export CONTAINER MOUNTS COMMAND

cmd=(sbatch --nodes="$NODES" --account="$ACCOUNT" --partition="$PARTITION" --time="$TIME"
     --job-name="$JOB_NAME")
[[ -n "${GRES:-}" ]] && cmd+=(--gres="$GRES")
cmd+=("$RAY_SUB")
if [[ -n "${DRY_RUN:-}" ]]; then
  printf 'CONTAINER=%q MOUNTS=%q COMMAND=%q GPUS_PER_NODE=%q \\\n  ' \
    "$CONTAINER" "$MOUNTS" "$COMMAND" "$GPUS_PER_NODE"
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
"${cmd[@]}"
