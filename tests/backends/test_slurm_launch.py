"""slurm/launch.sh under DRY_RUN=1 (or a fake sbatch on PATH).

Nodes and GPUs per node come from one place and are never guessed (issue 36); --gres by default;
the driver runs unbuffered and compares the image's commit with the clone's; DEPENDENCY chains
jobs (docs/cluster.md section 6).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# NeMo-RL's 2-node FP8 settings made on-policy (cluster.num_nodes: 2, gpus_per_node: 8)
TWO_NODES = "tests/data/slurm/two_nodes.yaml"

# A login-node python3 without nemo_jetrl (the usual case): fails the way a real one does.
NO_JETRL_PYTHON = """#!/bin/sh
echo "Traceback (most recent call last):" >&2
echo "ModuleNotFoundError: No module named 'nemo_jetrl'" >&2
exit 1
"""
# sbatch --parsable: records its arguments and $COMMAND, prints <jobid>;<cluster>.
FAKE_SBATCH = """#!/bin/sh
n=$(( $(cat "$FAKE_DIR/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$FAKE_DIR/count"
printf '%s\\n' "$@" > "$FAKE_DIR/sbatch.$n.args"
printf '%s' "$COMMAND" > "$FAKE_DIR/sbatch.$n.command"
echo "$((4240 + n));testcluster"
"""
# The image's jetrl: --version names $FAKE_IMAGE_COMMIT; anything else reports what it got.
FAKE_JETRL = """#!/bin/sh
if [ "$1" = --version ]; then echo "nemo_jetrl 0.1.0 (commit $FAKE_IMAGE_COMMIT)"; exit 0; fi
echo "jetrl-args: $*"
echo "PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-unset}"
"""

# A config of one's own outside the clone: a shipped 1-node recipe as its defaults.
ONE_NODE_CONFIG = f"defaults: {REPO}/examples/configs/qwen3_8b_base/jetrl.yaml\n"


def _launch(*args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    base = {
        "PATH": "/usr/bin:/bin",
        "DRY_RUN": "1",
        "CONTAINER": "/images/nemo-jetrl.sqsh",
        "ACCOUNT": "acct",
        "PARTITION": "batch",
        # A Python that imports nemo_jetrl (the login node's venv) reads the config.
        "PYTHON": sys.executable,
        "HOME": os.environ.get("HOME", "/tmp"),
        # more than one node needs a shared HF_HOME (DRY_RUN creates nothing)
        "HF_HOME": "/tmp/jetrl-test-hf-home",
    }
    return subprocess.run(
        ["bash", str(REPO / "slurm/launch.sh"), *args],
        cwd=cwd,
        env={k: v for k, v in {**base, **env}.items() if v is not None},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _script(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fakes(tmp_path: Path) -> dict[str, str]:
    """Env for a real (not DRY_RUN) submission: fake sbatch and jetrl first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "sbatch", FAKE_SBATCH)
    _script(bin_dir / "jetrl", FAKE_JETRL)
    # what launch.sh checks NeMo-RL's ray.sub by: a #! first line and its driver command file
    (tmp_path / "ray.sub").write_text("#!/bin/bash\n# NeMo-RL's ray.sub\nDRIVER_COMMAND_FILE=\n")
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_DIR": str(tmp_path),
        "RAY_SUB": str(tmp_path / "ray.sub"),
        "DRY_RUN": None,
        "HF_HOME": str(tmp_path / "hf"),  # a real submission creates it
    }


def _sbatch_calls(fake_dir: str) -> list[tuple[list[str], str]]:
    d = Path(fake_dir)
    n = int((d / "count").read_text()) if (d / "count").exists() else 0
    return [
        ((d / f"sbatch.{i}.args").read_text().splitlines(), (d / f"sbatch.{i}.command").read_text())
        for i in range(1, n + 1)
    ]


def _run_command(command: str, fakes: dict[str, str], image_commit: str):
    """Run COMMAND as ray.sub does (written to a file, `bash FILE`) with the fake jetrl."""
    f = Path(fakes["FAKE_DIR"]) / "driver_command.sh"
    f.write_text(command)
    env = {"PATH": fakes["PATH"], "FAKE_IMAGE_COMMIT": image_commit, "HOME": "/tmp"}
    return subprocess.run(["bash", str(f)], env=env, capture_output=True, text=True, timeout=60)


def _git_clone_with_config(root: Path) -> tuple[Path, str]:
    """A git checkout holding one config; returns the config and the checkout's HEAD."""
    root.mkdir()
    cfg = root / "run.yaml"
    cfg.write_text(ONE_NODE_CONFIG)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "run.yaml"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    return cfg, head


def test_config_node_count_reaches_sbatch_and_the_run():
    proc = _launch(TWO_NODES, "grpo.max_num_steps=3")
    assert proc.returncode == 0, proc.stderr
    assert "--nodes=2" in proc.stdout
    assert "cluster.num_nodes=2\\ cluster.gpus_per_node=8" in proc.stdout
    assert "--gres=gpu:8" in proc.stdout  # NeMo-RL's README passes it with ray.sub
    assert "--parsable" in proc.stdout  # the job id alone on stdout, for DEPENDENCY
    assert "HF_TOKEN" in proc.stderr  # Llama is gated: the note says what to export


def test_mismatch_with_the_config_is_refused_naming_both():
    proc = _launch(TWO_NODES, NODES="1")
    assert proc.returncode == 2
    assert "NODES=1 but the config has cluster.num_nodes=2" in proc.stderr
    proc = _launch(TWO_NODES, GPUS_PER_NODE="4")
    assert proc.returncode == 2
    assert "GPUS_PER_NODE=4 but the config has cluster.gpus_per_node=8" in proc.stderr


def test_override_on_the_command_line_sets_both():
    proc = _launch(TWO_NODES, "cluster.num_nodes=1", NODES="1", GRES="gpu:8")
    assert proc.returncode == 0, proc.stderr
    assert "--nodes=1" in proc.stdout and "--gres=gpu:8" in proc.stdout
    assert "cluster.num_nodes=1\\ cluster.gpus_per_node=8" in proc.stdout


def test_unreadable_config_without_nodes_is_refused_not_shrunk(tmp_path):
    """The 2-node config and a PYTHON without nemo_jetrl: exit 2 naming what to set, never 1 node."""
    py = _script(tmp_path / "python3", NO_JETRL_PYTHON)
    proc = _launch(TWO_NODES, PYTHON=py)
    assert proc.returncode == 2, proc.stdout
    assert "--nodes" not in proc.stdout and "cluster.num_nodes=1" not in proc.stdout
    for word in ("NODES", "GPUS_PER_NODE", f"PYTHON={py}", "No module named 'nemo_jetrl'"):
        assert word in proc.stderr, (word, proc.stderr)
    # One of the two alone is not enough either.
    proc = _launch(TWO_NODES, PYTHON=py, NODES="2")
    assert proc.returncode == 2 and "GPUS_PER_NODE" in proc.stderr


def test_unreadable_config_takes_nodes_as_set_and_says_they_replace_the_config(tmp_path):
    py = _script(tmp_path / "python3", NO_JETRL_PYTHON)
    proc = _launch(TWO_NODES, PYTHON=py, NODES="2", GPUS_PER_NODE="8")
    assert proc.returncode == 0, proc.stderr
    assert "--nodes=2" in proc.stdout
    assert "cluster.num_nodes=2\\ cluster.gpus_per_node=8" in proc.stdout
    assert "they replace the config's values" in proc.stderr


def test_unreadable_config_takes_cluster_overrides_from_the_command_line(tmp_path):
    py = _script(tmp_path / "python3", NO_JETRL_PYTHON)
    args = (TWO_NODES, "cluster.num_nodes=2", "cluster.gpus_per_node=8")
    proc = _launch(*args, PYTHON=py)
    assert proc.returncode == 0, proc.stderr
    assert "--nodes=2" in proc.stdout and "--gres=gpu:8" in proc.stdout
    proc = _launch(*args, PYTHON=py, NODES="1")
    assert proc.returncode == 2
    assert "NODES=1 but the command line has cluster.num_nodes=2" in proc.stderr


@pytest.mark.parametrize(
    ("gres", "expected"),
    [
        (None, "--gres=gpu:4"),  # default: gpu:$GPUS_PER_NODE
        ("gpu:h100:4", "--gres=gpu:h100:4"),
        ("", None),  # set to empty: no --gres
        ("none", None),
    ],
)
def test_gres_default_and_opt_out(gres, expected):
    proc = _launch(TWO_NODES, "cluster.gpus_per_node=4", GRES=gres)
    assert proc.returncode == 0, proc.stderr
    if expected is None:
        assert "--gres" not in proc.stdout
    else:
        assert expected in proc.stdout


def test_driver_runs_unbuffered(fakes):
    proc = _launch(TWO_NODES, "grpo.max_num_steps=3")
    assert proc.returncode == 0, proc.stderr
    assert "PYTHONUNBUFFERED=1\\ HF_HOME=/tmp/jetrl-test-hf-home\\ jetrl\\ train" in proc.stdout
    proc = _launch(TWO_NODES, **fakes)
    assert proc.returncode == 0, proc.stderr
    [(_, command)] = _sbatch_calls(fakes["FAKE_DIR"])
    ran = _run_command(command, fakes, image_commit="unknown")
    assert ran.returncode == 0, ran.stderr
    assert "PYTHONUNBUFFERED=1" in ran.stdout
    assert f"jetrl-args: train {TWO_NODES} --backend nemo-rl" in ran.stdout


def test_image_commit_is_compared_with_the_clone(tmp_path, fakes):
    cfg, head = _git_clone_with_config(tmp_path / "clone")
    other = "0123456789ab"
    mounts = f"{tmp_path}:{tmp_path}"  # the clone of the config, which the job reads
    proc = _launch(str(cfg), MOUNTS=mounts, **fakes)
    assert proc.returncode == 0, proc.stderr
    [(_, command)] = _sbatch_calls(fakes["FAKE_DIR"])
    assert f"export JETRL_CLONE_COMMIT={head};" in command
    assert command.index("JETRL_CLONE_COMMIT") < command.index("jetrl train")
    # DRY_RUN shows the same check.
    dry = _launch(str(cfg), MOUNTS=mounts)
    assert f"JETRL_CLONE_COMMIT={head}" in dry.stdout and "launch:\\ warning:" in dry.stdout

    differs = _run_command(command, fakes, image_commit=other)
    assert differs.returncode == 0  # a warning, not a failure: the run still starts
    assert (
        f"launch: warning: the image's nemo_jetrl is commit {other}, this clone is at {head}"
        in differs.stderr
    )
    assert f"check out {other}" in differs.stderr and "rebuild the image" in differs.stderr
    assert "jetrl-args: train" in differs.stdout

    for same in (head, head[:12]):  # the image records --short=12 (docs/cluster.md 1a)
        ran = _run_command(command, fakes, image_commit=same)
        assert ran.returncode == 0 and "jetrl-args: train" in ran.stdout
        assert "warning" not in ran.stderr, ran.stderr

    unknown = _run_command(command, fakes, image_commit="unknown")
    assert unknown.returncode == 0 and "warning" not in unknown.stderr
    assert "does not say its commit" in unknown.stderr


def test_no_git_checkout_skips_the_commit_check_with_a_note(tmp_path, fakes):
    cfg = tmp_path / "loose" / "run.yaml"
    cfg.parent.mkdir()
    cfg.write_text(ONE_NODE_CONFIG)
    mounts = f"{tmp_path}:{tmp_path}"
    proc = _launch(str(cfg), GIT_CEILING_DIRECTORIES=str(tmp_path), MOUNTS=mounts, **fakes)
    assert proc.returncode == 0, proc.stderr
    assert "not in a git checkout" in proc.stderr
    [(_, command)] = _sbatch_calls(fakes["FAKE_DIR"])
    assert "JETRL_CLONE_COMMIT" not in command and "jetrl train" in command


def test_dependency_reaches_sbatch_and_the_job_id_is_printed(fakes):
    proc = _launch(TWO_NODES, DEPENDENCY="afterany:4241")
    assert proc.returncode == 0, proc.stderr
    assert "--dependency=afterany:4241" in proc.stdout
    assert "--dependency" not in _launch(TWO_NODES).stdout
    # Real submission: stdout is the job id alone (sbatch --parsable's "<id>;<cluster>").
    proc = _launch(TWO_NODES, DEPENDENCY="afterok:7", **fakes)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "4241\n"
    [(args, _)] = _sbatch_calls(fakes["FAKE_DIR"])
    assert "--parsable" in args and "--dependency=afterok:7" in args
    # A dependency without a job id (the first submission failed) is refused.
    proc = _launch(TWO_NODES, DEPENDENCY="afterany:")
    assert proc.returncode == 2 and "names no job id" in proc.stderr


def _section_6_snippet() -> str:
    doc = (REPO / "docs/cluster.md").read_text()
    start = doc.index("\n## 6.")
    section = doc[start : doc.index("\n## ", start + 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return next(b for b in blocks if "slurm/launch.sh" in b)


def test_docs_section_6_converts_once_then_chains_the_other_recipes(tmp_path, fakes):
    """The three-recipe submission of docs/cluster.md section 6, run against a fake sbatch."""
    snippet = _section_6_snippet()
    assert "DEPENDENCY=afterany:$first" in snippet
    env = {
        "PATH": fakes["PATH"],
        "FAKE_DIR": fakes["FAKE_DIR"],
        "RAY_SUB": fakes["RAY_SUB"],
        "CONTAINER": "/images/nemo-jetrl.sqsh",
        "ACCOUNT": "acct",
        "PARTITION": "batch",
        "HF_HOME": str(tmp_path / "hf"),
        "PYTHON": sys.executable,
        "HOME": str(tmp_path / "home"),  # its ~/jetrl-venv/bin/jetrl (compare): the fake
        "FAKE_IMAGE_COMMIT": "unknown",
    }
    venv_bin = tmp_path / "home" / "jetrl-venv" / "bin"
    venv_bin.mkdir(parents=True)
    _script(venv_bin / "jetrl", FAKE_JETRL)
    proc = subprocess.run(
        ["bash", "-c", snippet],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    calls = _sbatch_calls(fakes["FAKE_DIR"])
    assert len(calls) == 3, proc.stderr
    first_args, first_cmd = calls[0]
    assert not any(a.startswith("--dependency") for a in first_args)
    assert "qwen3_8b_base/bf16.yaml" in first_cmd
    for args, _ in calls[1:]:
        assert "--dependency=afterany:4241" in args, args  # 4241: the first job's id
    assert "qwen3_8b_base/fp8_rollout.yaml" in calls[1][1]
    assert "jetrl.allow_off_policy=true" in calls[1][1]
    assert "qwen3_8b_base/jetrl.yaml" in calls[2][1]
    # then the comparison, from the login node's venv (section 1b)
    assert "jetrl-args: compare runs/bf16/exp_* runs/fp8_rollout/exp_* runs/jetrl/exp_*" in (
        proc.stdout
    )


# -- mounts and paths as NeMo-RL's ray.sub runs them (found by reading its v0.7.0 ray.sub and
# running launch.sh against it with stand-in srun/sbatch, 2026-12-01) ------------------------


def _mounts(stdout: str) -> list[str]:
    """The MOUNTS a DRY_RUN prints (``%q``-quoted: escaped commas)."""
    value = re.search(r"MOUNTS=(\S+)", stdout).group(1)  # type: ignore[union-attr]
    return value.replace("\\,", ",").split(",")


def test_mounts_add_to_the_clone_the_log_dir_and_the_hf_cache():
    """ray.sub's head container looks for a file in <BASE_LOG_DIR>/<jobid>-logs and the driver
    runs in the clone: both must be mounted, whatever MOUNTS adds."""
    proc = _launch(TWO_NODES, MOUNTS="/data:/data", BASE_LOG_DIR="/scratch/logs")
    assert proc.returncode == 0, proc.stderr
    assert _mounts(proc.stdout) == [
        f"{REPO}:{REPO}", "/data:/data", "/scratch/logs:/scratch/logs",
        "/tmp/jetrl-test-hf-home:/tmp/jetrl-test-hf-home",
    ]  # fmt: skip


def test_more_than_one_node_needs_a_shared_hf_home():
    proc = _launch(TWO_NODES, HF_HOME=None)
    assert proc.returncode == 2 and "--nodes" not in proc.stdout
    assert "set HF_HOME to a directory every node mounts: with 2 nodes" in proc.stderr
    proc = _launch(TWO_NODES, "cluster.num_nodes=1", NODES="1", HF_HOME=None)
    assert proc.returncode == 0, proc.stderr  # one node: it runs, and says what is lost
    assert "note: HF_HOME is not set: the model download and NeMo-RL's converted" in proc.stderr
    proc = _launch(TWO_NODES, "cluster.num_nodes=1", NODES="1")
    assert proc.returncode == 0 and "HF_HOME is not set" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("var", ["HF_HOME", "BASE_LOG_DIR", "MOUNTS"])
def test_a_path_that_srun_mounts_cannot_carry_is_refused(var):
    proc = _launch(TWO_NODES, **{var: "/lustre/my runs"})
    assert proc.returncode == 2
    assert f"launch.sh: {var}=/lustre/my runs has a space or a comma" in proc.stderr


def test_a_checkpoint_dir_outside_every_mount_is_refused_naming_the_key():
    proc = _launch(TWO_NODES, "checkpointing.checkpoint_dir=/lustre/ckpt")
    assert proc.returncode == 2 and "--nodes" not in proc.stdout
    assert "checkpointing.checkpoint_dir=/lustre/ckpt is outside every container mount" in (
        proc.stderr
    )
    proc = _launch(TWO_NODES, "checkpointing.checkpoint_dir=/lustre/ckpt", MOUNTS="/lustre:/lustre")
    assert proc.returncode == 0, proc.stderr
    # the run writes to a mount's container side (pyxis SRC:DST[:FLAGS]), not its host side
    proc = _launch(TWO_NODES, "checkpointing.checkpoint_dir=/ckpt/run", MOUNTS="/lustre/c:/ckpt:rw")
    assert proc.returncode == 0, proc.stderr
    proc = _launch(
        TWO_NODES, "checkpointing.checkpoint_dir=/lustre/c/run", MOUNTS="/lustre/c:/ckpt"
    )
    assert proc.returncode == 2 and "outside every container mount" in proc.stderr
    proc = _launch(TWO_NODES, "logger.log_dir=/tmp/jetrl-test-hf-home/logs")  # under HF_HOME
    assert proc.returncode == 0, proc.stderr
    proc = _launch(TWO_NODES, "logger.log_dir=runs/x")  # relative: in the clone
    assert proc.returncode == 0, proc.stderr
