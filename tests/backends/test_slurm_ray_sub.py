"""slurm/launch.sh handing its job to NeMo-RL's real ray.sub, on a stand-in SLURM.

launch.sh only fills in what ray.sub reads; whether the job then starts is ray.sub's code
running on what launch.sh exported. Here the real ray.sub of each NeMo-RL tree (../shared/upstream
or $JETRL_NEMO_RL_UPSTREAM) runs under stand-ins for what a cluster provides:

- ``sbatch`` runs the batch script at once with the variables SLURM sets (``SLURM_SUBMIT_DIR`` is
  the physical working directory, getcwd(), as SLURM's sbatch sets it), then ends every process
  the job left, as SLURM does at the end of a job;
- ``scontrol``/``sinfo``/``host`` answer for N nodes of 8 GPUs;
- ``srun`` with ``--container-image`` runs each task in a pyxis-like container: a private mount
  namespace whose root holds /usr, /etc, /dev, /proc, the image's ``jetrl``/``ray`` and only the
  ``--container-mounts`` (SRC:DST), with the image's PATH, and fails like pyxis when
  ``--container-workdir`` is not in the container;
- ``ray`` records each node's ``worker_units`` and reports their sum in ``ray status``;
- the image's ``jetrl train`` prints what it got and fails, as NeMo-RL does, when
  ``cluster.num_nodes x cluster.gpus_per_node`` exceeds the GPUs Ray has.

Needs ``unshare`` with mount namespaces (root, or unprivileged user namespaces).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NEMO_RL_UPSTREAM

REPO = Path(__file__).resolve().parents[2]
TREES = ("v0.7.0", "main-7ea279a")
# A config of one's own outside the clone: a shipped 1-node recipe (8 GPUs, TP2 x PP2 x CP2).
ONE_NODE_CONFIG = f"defaults: {REPO}/examples/configs/qwen3_8b_base/jetrl.yaml\n"

SBATCH = r"""#!/bin/bash
nodes=1 part= acct= name=
for a in "$@"; do
  case $a in
    --nodes=*) nodes=${a#*=} ;; --partition=*) part=${a#*=} ;;
    --account=*) acct=${a#*=} ;; --job-name=*) name=${a#*=} ;;
  esac
done
id=$(( $(cat "$FAKE_DIR/last_job" 2>/dev/null || echo 4241) + 1 ))
echo "$id" > "$FAKE_DIR/last_job"
printf '%s\n' "$@" > "$FAKE_DIR/sbatch.$id.args"
rm -f "$FAKE_STATE"/units.*   # a new job: a new Ray cluster
script=${!#}
export SLURM_JOB_ID=$id SLURM_JOB_NUM_NODES=$nodes SLURM_JOB_PARTITION=$part \
  SLURM_JOB_ACCOUNT=$acct SLURM_JOB_NAME=$name SLURM_SUBMIT_DIR=$(pwd -P) \
  SLURM_JOB_NODELIST="node[01-$(printf %02d "$nodes")]"
# the job, in a session of its own; its time limit: 150 s
setsid timeout -s KILL 150 bash "$script" > "$FAKE_DIR/slurm-$id.out" 2>&1 < /dev/null &
job=$!
wait "$job"
echo $? > "$FAKE_DIR/job.$id.rc"
kill -KILL -- "-$job" 2>/dev/null   # the end of the job ends its steps
echo "$id;fakecluster"
"""

SCONTROL = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") for i in $(seq 1 "$SLURM_JOB_NUM_NODES"); do printf 'node%02d\n' "$i"; done ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CPUTot=16 CPULoad=0.01 RealMemory=2000000" ;;
  *) echo "fake scontrol: $*" >&2; exit 1 ;;
esac
"""

SINFO = r"""#!/bin/bash
echo "${FAKE_GRES-gpu:h100:8(S:0-1)}"
"""

HOST = r"""#!/bin/bash
echo "$1 has address 10.0.0.${1#node}"
"""

SRUN = r"""#!/bin/bash
# Stand-in srun with a pyxis-like container (see the module docstring).
img= mounts= workdir= out=/dev/null ntasks=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --container-image=*) img=${1#*=} ;;
    --container-mounts=*) mounts=${1#*=} ;;
    --container-workdir=*) workdir=${1#*=} ;;
    --ntasks=*) ntasks=${1#*=} ;;
    -o) out=$2; shift ;;
    -p | -A | -w | -N | -n | -c | -e | -t) shift ;;
    -*) ;;
    *) break ;;
  esac
  shift
done
[[ -n $img ]] || { echo "fake srun: only container steps are stood in for" >&2; exit 1; }
task() {
  local i=$1 root; shift
  root=$(mktemp -d "$FAKE_DIR/roots/task.XXXXXX")
  export SLURM_PROCID=$i SLURMD_NODENAME
  if [[ $ntasks == 1 && $i == 0 && $out != *%* ]]; then SLURMD_NODENAME=node01
  else SLURMD_NODENAME=$(printf 'node%02d' $((i + 2))); fi
  local log; log=$(printf '%s' "$out" | sed -E "s/%0?[0-9]*t/$i/")
  # shellcheck disable=SC2086
  unshare $FAKE_UNSHARE_FLAGS --mount --propagation private \
    bash "$(dirname "$0")/pyxis-container" "$root" "$mounts" "${workdir:-/}" "$@" > "$log" 2>&1
}
if [[ $ntasks == 1 ]]; then task 0 "$@"; exit $?; fi
pids=()
for ((i = 0; i < ntasks; i++)); do task "$i" "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""

# Inside srun's new mount namespace: the container's root, then the task in it.
CONTAINER = r"""#!/bin/bash
set -e
R=$1 mounts=$2 workdir=$3
shift 3
mkdir -p "$R"/usr "$R"/etc "$R"/dev "$R"/proc "$R"/tmp "$R"/image "$R"/state
for d in usr etc; do mount --rbind "/$d" "$R/$d"; mount -o remount,bind,ro "$R/$d"; done
mount --rbind /dev "$R/dev"
mount --rbind /proc "$R/proc"
for d in bin sbin lib lib64; do
  if [[ -L /$d ]]; then
    cp -P "/$d" "$R/$d"
  elif [[ -d /$d ]]; then
    mkdir -p "$R/$d"; mount --rbind "/$d" "$R/$d"; mount -o remount,bind,ro "$R/$d"
  fi
done
mount --bind "$FAKE_IMAGE" "$R/image"
mount --bind "$FAKE_STATE" "$R/state"
IFS=, read -r -a ms <<<"$mounts"
for m in "${ms[@]}"; do
  src=${m%%:*} rest=${m#*:}
  dst=${rest%%:*}
  [[ $m == *:* ]] || dst=$src
  [[ -e $src ]] || { echo "pyxis: mount source $src does not exist" >&2; exit 1; }
  if [[ -d $src ]]; then mkdir -p "$R$dst"; else mkdir -p "$(dirname "$R$dst")"; touch "$R$dst"; fi
  mount --bind "$src" "$R$dst"
done
exec "$FAKE_CHROOT" "$R" /usr/bin/env PATH=/image:/usr/bin:/bin bash /image/.enter "$workdir" "$@"
"""

ENTER = r"""cd "$1" 2>/dev/null || { echo "pyxis: couldn't chdir to $1" >&2; exit 1; }
shift
exec "$@"
"""

RAY = r"""#!/bin/bash
# The image's ray: each started node records its worker_units; status reports their sum.
record() {
  local r="" a u
  for a in "$@"; do case $a in --resources=*) r=${a#*=} ;; esac; done
  u=$(printf '%s' "$r" | grep -o '"worker_units": *[0-9]*' | grep -o '[0-9]*$' || true)
  echo "${u:-0}" > "/state/units.$RANDOM$$"
}
case "$1" in
  start)
    record "$@"
    for a in "$@"; do [[ $a == --block ]] && while :; do sleep 1; done; done
    exit 0 ;;
  status)
    total=$(cat /state/units.* 2>/dev/null | awk '{s += $1} END {print s + 0}')
    echo "Resources"; echo " 0.0/$total.0 worker_units"; exit 0 ;;
  *) exit 0 ;;
esac
"""

JETRL = r"""#!/bin/bash
# The image's jetrl.
if [[ $1 == --version ]]; then echo "nemo_jetrl 0.1.0 (commit unknown)"; exit 0; fi
echo "jetrl-args: $*"
echo "jetrl-cwd: $(pwd)"
sleep 3  # a driver outlives ray.sub's 2 s polls (one that ends first reads as a dead srun)
nodes=1 gpus=8
for a in "$@"; do
  case $a in cluster.num_nodes=*) nodes=${a#*=} ;; cluster.gpus_per_node=*) gpus=${a#*=} ;; esac
done
have=$(ray status | awk -F'[/. ]' '/worker_units/ {print $4}')
if ((nodes * gpus > have)); then
  echo "jetrl: NeMo-RL needs $((nodes * gpus)) GPUs, Ray has $have" >&2; exit 1
fi
exit "${FAKE_TRAIN_RC:-0}"
"""


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _unshare_flags() -> str | None:
    """Flags under which ``unshare`` gives this user a mount namespace, or None."""
    if shutil.which("unshare") is None or shutil.which("chroot") is None:  # /usr/sbin: not on PATH
        return None
    for flags in ([] if os.geteuid() else [""]) + ["--map-root-user"]:
        cmd = ["unshare", *flags.split(), "--mount", "true"]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            return flags
    return None


UNSHARE = _unshare_flags()
pytestmark = pytest.mark.skipif(UNSHARE is None, reason="needs unshare with a mount namespace")


def _ray_sub(tree: str) -> Path:
    path = NEMO_RL_UPSTREAM / tree / "ray.sub"
    if not path.is_file():
        pytest.skip(f"NeMo-RL's ray.sub ({path}) absent")
    return path


@pytest.fixture
def cluster(tmp_path: Path) -> dict:
    """A stand-in cluster: PATH with the SLURM commands, the image's bin, state dirs."""
    bin_dir, image, state = tmp_path / "bin", tmp_path / "image", tmp_path / "state"
    for d in (bin_dir, image, state, tmp_path / "roots"):
        d.mkdir()
    for name, text in (("sbatch", SBATCH), ("scontrol", SCONTROL), ("sinfo", SINFO),
                       ("host", HOST), ("srun", SRUN), ("pyxis-container", CONTAINER)):  # fmt: skip
        _write(bin_dir / name, text)
    _write(image / "ray", RAY)
    _write(image / "jetrl", JETRL)
    _write(image / ".enter", ENTER)
    return {
        "dir": tmp_path,
        "env": {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOME": str(tmp_path / "home"),
            "FAKE_DIR": str(tmp_path),
            "FAKE_IMAGE": str(image),
            "FAKE_STATE": str(state),
            "FAKE_UNSHARE_FLAGS": UNSHARE or "",
            "FAKE_CHROOT": shutil.which("chroot") or "chroot",
            "CONTAINER": "/images/nemo-jetrl.sqsh",
            "ACCOUNT": "acct",
            "PARTITION": "batch",
            "PYTHON": sys.executable,
            "HF_HOME": str(tmp_path / "hf"),
            "GIT_CEILING_DIRECTORIES": str(tmp_path),
        },
    }


def _clone(root: Path) -> Path:
    """A directory to submit from, holding a 1-node config."""
    root.mkdir(parents=True)
    (root / "run.yaml").write_text(ONE_NODE_CONFIG)
    return root


def _submit(cluster: dict, tree: str, cwd: Path, *args: str, **env: str):
    """launch.sh run.yaml ARGS from cwd (PWD as the user's shell has it), the job run to its end;
    returns (launch.sh's process, the job's exit code, the job's batch output)."""
    full = {**cluster["env"], "RAY_SUB": str(_ray_sub(tree)), "PWD": str(cwd), **env}
    proc = subprocess.run(
        ["bash", str(REPO / "slurm/launch.sh"), "run.yaml", *args],
        cwd=cwd,
        env={k: v for k, v in full.items() if v is not None},
        capture_output=True,
        text=True,
        timeout=300,
    )
    d: Path = cluster["dir"]
    job = proc.stdout.strip()
    rc = int((d / f"job.{job}.rc").read_text()) if (d / f"job.{job}.rc").exists() else None
    out = (d / f"slurm-{job}.out").read_text() if (d / f"slurm-{job}.out").exists() else ""
    return proc, rc, out


def _driver_log(submit_dir: Path, job: str = "4242") -> str:
    return (submit_dir / f"{job}-logs" / "ray-driver.log").read_text()


@pytest.mark.parametrize("tree", TREES)
def test_the_job_runs_jetrl_train_and_its_exit_code_is_the_jobs(cluster, tree):
    """ray.sub runs COMMAND on the head once every node's GPUs joined Ray; the driver's exit
    code becomes the job's, and its output is in <submit dir>/<jobid>-logs/ray-driver.log, as
    launch.sh prints."""
    clone = _clone(cluster["dir"] / "clone")
    proc, rc, out = _submit(cluster, tree, clone, "cluster.num_nodes=2", FAKE_TRAIN_RC="3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "4242\n"
    assert f"driver log: {clone}/4242-logs/ray-driver.log" in proc.stderr
    assert rc == 3, out[-3000:]
    log = _driver_log(clone)
    assert "jetrl-args: train run.yaml --backend nemo-rl" in log, log
    assert "cluster.num_nodes=2 cluster.gpus_per_node=8" in log
    assert f"jetrl-cwd: {clone}" in log
    proc, rc, out = _submit(cluster, tree, clone, "cluster.num_nodes=2")
    assert rc == 0, out[-3000:]


def test_a_clone_reached_through_a_symlink_starts(cluster):
    """SLURM's sbatch sets SLURM_SUBMIT_DIR with getcwd() (the physical path); ray.sub makes
    its logs there and starts each container in it (--container-workdir). Submitted from
    a path through a symlink ($HOME -> /lustre/...), only the path the shell shows was mounted:
    the head container could not start (found by review)."""
    real = _clone(cluster["dir"] / "lustre" / "u" / "clone")
    link = cluster["dir"] / "home"
    link.symlink_to(real.parent)
    proc, rc, out = _submit(cluster, "v0.7.0", link / "clone")
    assert proc.returncode == 0, proc.stderr
    assert rc == 0, out[-3000:]
    log = _driver_log(real)
    assert "jetrl-args: train run.yaml" in log and f"jetrl-cwd: {link}/clone" in log


def test_gpus_per_node_the_partitions_gres_does_not_have_is_not_submitted(cluster):
    """ray.sub's maybe_gres_arg exits 1 at the job's start when GPUS_PER_NODE is not the
    partition's GRES GPU count (sinfo %G): launch.sh asks sinfo first (found by review)."""
    clone = _clone(cluster["dir"] / "clone")
    args = ("cluster.num_nodes=2", "cluster.gpus_per_node=4")
    proc, rc, out = _submit(cluster, "v0.7.0", clone, *args)
    assert rc is None, f"submitted; the job exited {rc}: " + out[-1500:]
    assert proc.returncode == 2 and proc.stdout == ""
    assert "GPUS_PER_NODE=4 but partition batch's nodes have 8 GPUs" in proc.stderr
    proc, rc, out = _submit(cluster, "v0.7.0", clone, *args, FAKE_GRES="gpu:4")
    assert rc == 0, out[-3000:]
    assert "cluster.num_nodes=2 cluster.gpus_per_node=4" in _driver_log(clone)


def test_a_dedicated_ray_head_leaves_the_runs_gpu_nodes_to_it(cluster):
    """NeMo-RL main's ray.sub under DEDICATED_RAY_HEAD=1: the first node advertises no GPUs;
    launch.sh asks SLURM for one node more, so Ray still has cluster.num_nodes x
    gpus_per_node GPUs for the run."""
    clone = _clone(cluster["dir"] / "clone")
    proc, rc, out = _submit(cluster, "main-7ea279a", clone, DEDICATED_RAY_HEAD="1")
    assert proc.returncode == 0, proc.stderr
    assert "--nodes=2" in (cluster["dir"] / "sbatch.4242.args").read_text().split("\n")
    assert rc == 0, out[-3000:]
    assert "cluster.num_nodes=1 cluster.gpus_per_node=8" in _driver_log(clone)
