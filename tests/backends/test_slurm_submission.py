"""slurm/launch.sh's refusals before the queue (DRY_RUN=1 or a fake sbatch on PATH): what `jetrl
train` would refuse at the job's start is never submitted (both NeMo-RL trees' rules, with or
without torch on the login node), paths outside every mount, ray.sub's own readings (a banner,
GRES), node and GPU counts that are not the partition's or not whole numbers. The launch's
node/GPU plumbing and mounts: test_slurm_launch.py, whose helpers these tests share.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_slurm_launch import (
    NO_JETRL_PYTHON,
    ONE_NODE_CONFIG,
    TWO_NODES,
    _launch,
    _sbatch_calls,
    _script,
    fakes,
)

__all__ = ["fakes"]  # the fixture these tests take


def test_a_ray_sub_with_a_banner_in_front_is_refused(fakes):
    Path(fakes["RAY_SUB"]).write_text("== CUDA ==\n#!/bin/bash\nDRIVER_COMMAND_FILE=\n")
    proc = _launch(TWO_NODES, **fakes)
    assert proc.returncode == 2 and _sbatch_calls(fakes["FAKE_DIR"]) == []
    assert "is not NeMo-RL's ray.sub (no #! first line" in proc.stderr
    assert "without the image's entrypoint" in proc.stderr


def test_what_jetrl_train_would_refuse_at_the_jobs_start_is_never_submitted(fakes):
    """A job jetrl train refuses has waited in the queue and started Ray first: with a PYTHON
    that imports nemo_jetrl the same refusals come before sbatch (exit 2, nothing submitted),
    also where NODES / GPUS_PER_NODE are set as the docs say."""
    qwen = "examples/configs/qwen3_8b_base/jetrl.yaml"
    cases = [  # (config, override, what the refusal names)
        (qwen, "grpo.max_num_stepz=3", "did you mean grpo.max_num_steps"),  # a typo'd key
        ("examples/configs/nemo_rl_fp8_e2e.yaml", None, "jetrl.allow_off_policy"),  # off-policy
        # a NeMo-RL backend rule both trees share (the refit checks run within one stage)
        (qwen, "policy.generation.vllm_cfg.pipeline_parallel_size=2", "set it to 1"),
    ]
    for config, override, named in cases:
        args = [config] + ([override] if override else [])
        proc = _launch(*args, NODES="1" if "qwen" in config else "2", GPUS_PER_NODE="8", **fakes)
        assert proc.returncode == 2, proc.stderr
        assert "would refuse" in proc.stderr and "nothing submitted" in proc.stderr
        assert named in proc.stderr, proc.stderr
        assert _sbatch_calls(fakes["FAKE_DIR"]) == []
    # what one tree refuses is a note naming it (the image's tree is not known here)
    proc = _launch(qwen, "policy.megatron_cfg.fp8_cfg.fp8_param=true", **fakes)
    assert proc.returncode == 0, proc.stderr
    assert "launch.sh: note: on NeMo-RL main jetrl train would refuse it: " in proc.stderr
    assert "v0.7.0 jetrl train would refuse" not in proc.stderr
    assert len(_sbatch_calls(fakes["FAKE_DIR"])) == 1


def test_a_python_without_torch_checks_the_config_and_says_what_it_left(tmp_path):
    """The docs' light login-node venv has no torch: the config is still validated, and a note
    says the NeMo-RL launch rules are left to the job."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = {"PYTHONPATH": str(site)}
    proc = _launch("examples/configs/qwen3_8b_base/jetrl.yaml", **env)
    assert proc.returncode == 0, proc.stderr
    assert (
        "this Python has no torch: the NeMo-RL backend's launch rules other than the GPU split"
        in (proc.stderr)
    )
    proc = _launch("examples/configs/qwen3_8b_base/jetrl.yaml", "grpo.max_num_stepz=3", **env)
    assert proc.returncode == 2 and "did you mean grpo.max_num_steps" in proc.stderr
    apart = [
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.gpus_per_node=4",  # 4 left for TP x PP x CP = 8
    ]
    proc = _launch("examples/configs/qwen3_8b_base/jetrl.yaml", *apart, **env)
    assert proc.returncode == 2, proc.stderr
    assert "policy.megatron_cfg.tensor_model_parallel_size=2: NeMo-RL gives training 4" in (
        proc.stderr
    )


def test_submission_refuses_what_both_trees_refuse_and_notes_the_rest(tmp_path):
    """`submission_problems` in process (launch.sh runs it in $PYTHON): a rule of both NeMo-RL
    trees is a refusal, a rule of one tree a note naming it."""
    from nemo_jetrl.backends.nemo_rl.submission import submission_problems
    from nemo_jetrl.config import ConfigError

    qwen = "examples/configs/qwen3_8b_base/jetrl.yaml"
    refusals, notes, _ = submission_problems(
        qwen, ["policy.generation.vllm_cfg.pipeline_parallel_size=2"]
    )
    assert [r.split("=")[0] for r in refusals] == [
        "policy.generation.vllm_cfg.pipeline_parallel_size"
    ]
    assert notes == []
    refusals, notes, cfg = submission_problems(qwen, ["policy.megatron_cfg.fp8_cfg.fp8_param=true"])
    assert refusals == [] and len(notes) == 1 and notes[0].startswith("on NeMo-RL main jetrl ")
    assert cfg.cluster.num_nodes == 1
    # a defaults file only the image holds: not judged here (launch.sh takes NODES as set)
    image_only = "defaults: /opt/nemo-rl/examples/configs/grpo_math_1B_megatron.yaml\n"
    (tmp_path / "image.yaml").write_text(image_only)
    with pytest.raises(ConfigError, match="config file not found"):
        submission_problems(str(tmp_path / "image.yaml"), [])


def test_a_config_or_local_model_outside_every_mount_is_refused(tmp_path):
    """The job reads the config and a local model path inside the container: outside every
    mount it could not (found by review: only the written paths were checked)."""
    outside = tmp_path / "mine" / "run.yaml"
    outside.parent.mkdir()
    outside.write_text(ONE_NODE_CONFIG)
    proc = _launch(str(outside))
    assert proc.returncode == 2, proc.stderr
    assert f"the config={outside} is outside every container mount" in proc.stderr
    assert "the job could not read it" in proc.stderr
    proc = _launch(str(outside), MOUNTS=f"{tmp_path}:{tmp_path}")
    assert proc.returncode == 0, proc.stderr
    model = "policy.model_name=/models/qwen3-8b"
    proc = _launch("examples/configs/qwen3_8b_base/jetrl.yaml", model)
    assert proc.returncode == 2 and "policy.model_name=/models/qwen3-8b is outside" in proc.stderr
    proc = _launch("examples/configs/qwen3_8b_base/jetrl.yaml", model, MOUNTS="/models:/models")
    assert proc.returncode == 0, proc.stderr


def test_a_dedicated_ray_head_asks_slurm_for_one_node_more(tmp_path, fakes):
    """NeMo-RL main's ray.sub keeps the first node for the Ray head under DEDICATED_RAY_HEAD=1:
    the run's cluster.num_nodes GPU nodes plus that one (v0.7.0's ray.sub has no such mode)."""
    proc = _launch(TWO_NODES, DEDICATED_RAY_HEAD="1")
    assert proc.returncode == 0, proc.stderr
    assert "--nodes=3" in proc.stdout and "DEDICATED_RAY_HEAD=1" in proc.stdout
    assert "cluster.num_nodes=2" in proc.stdout
    assert "--nodes=2" in _launch(TWO_NODES).stdout
    proc = _launch(TWO_NODES, DEDICATED_RAY_HEAD="1", **fakes)  # the fake ray.sub: no such mode
    assert proc.returncode == 2 and "has no dedicated-head mode" in proc.stderr
    assert _sbatch_calls(fakes["FAKE_DIR"]) == []
    main_sub = Path(fakes["RAY_SUB"])
    main_sub.write_text(main_sub.read_text() + "DEDICATED_RAY_HEAD=${DEDICATED_RAY_HEAD:-0}\n")
    proc = _launch(TWO_NODES, DEDICATED_RAY_HEAD="1", **fakes)
    assert proc.returncode == 0, proc.stderr
    [(args, _)] = _sbatch_calls(fakes["FAKE_DIR"])
    assert "--nodes=3" in args
    assert _launch(TWO_NODES, DEDICATED_RAY_HEAD="yes").returncode == 2


def test_a_config_only_the_jobs_machine_can_read_falls_back_to_nodes_as_set(tmp_path):
    """A defaults file in the image (/opt/nemo-rl/...) or an environment variable set only in
    the job: not an invalid config (review: it was refused); NODES / GPUS_PER_NODE are then
    needed, as for a Python that cannot read it at all."""
    image_only = tmp_path / "image.yaml"
    image_only.write_text("defaults: /opt/nemo-rl/examples/configs/grpo_math_1B_megatron.yaml\n")
    job_env = tmp_path / "env.yaml"
    job_env.write_text(ONE_NODE_CONFIG + "logger:\n  log_dir: ${oc.env:JOB_ONLY_DIR}/logs\n")
    mounts = f"{tmp_path}:{tmp_path}"
    for cfg in (image_only, job_env):
        proc = _launch(str(cfg), MOUNTS=mounts)
        assert proc.returncode == 2 and "NODES" in proc.stderr, proc.stderr
        assert "only the job's machine can read it" in proc.stderr
        assert "would refuse" not in proc.stderr
        proc = _launch(str(cfg), MOUNTS=mounts, NODES="1", GPUS_PER_NODE="8")
        assert proc.returncode == 0, proc.stderr
        assert "cluster.num_nodes=1" in proc.stdout


def test_nemo_gym_gpu_nodes_are_asked_of_slurm_on_top_of_the_runs():
    """NeMo-RL main's ray.sub: the job's nodes are cluster.num_nodes plus
    env.nemo_gym.num_gpu_nodes (found by review: the gym's nodes were not asked for)."""
    qwen = "examples/configs/qwen3_8b_base/jetrl.yaml"
    proc = _launch(qwen, "+env.nemo_gym.num_gpu_nodes=2")
    assert proc.returncode == 0, proc.stderr
    assert "--nodes=3" in proc.stdout and "cluster.num_nodes=1" in proc.stdout
    assert "env.nemo_gym.num_gpu_nodes=2: asking SLURM for 3 nodes" in proc.stderr
    proc = _launch(qwen, "+env.nemo_gym.num_gpu_nodes=2", DEDICATED_RAY_HEAD="1")
    assert "--nodes=4" in proc.stdout
    assert "--nodes=1" in _launch(qwen).stdout


def test_a_node_or_gpu_count_that_is_not_a_whole_number_is_refused_naming_it(tmp_path):
    """Review: a non-numeric NODES died in bash arithmetic ("unbound variable")."""
    py = _script(tmp_path / "python3", NO_JETRL_PYTHON)
    proc = _launch(TWO_NODES, PYTHON=py, NODES="two", GPUS_PER_NODE="8")
    assert proc.returncode == 2 and "NODES=two" in proc.stderr
    assert "a whole number of at least 1 is needed" in proc.stderr
    proc = _launch(TWO_NODES, PYTHON=py, NODES="2", GPUS_PER_NODE="0")
    assert proc.returncode == 2 and "GPUS_PER_NODE=0" in proc.stderr
    proc = _launch(TWO_NODES, PYTHON=py, NODES="2", GPUS_PER_NODE="8")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("gres", "refused"),
    [
        ("gpu:h100:8(S:0-1)", True),  # 8-GPU nodes, the run asks 4 a node: ray.sub exits 1
        ("gpu:4", False),
        ("gpu:h100:8\ngpu:h100:4", False),  # mixed partition: left to ray.sub
        ("(null)", False),  # no GRES: ray.sub runs without --gres
        ("gpu:8,nvme:1", True),  # 8 GPUs; ray.sub reads the last ':' field, 1 (diff review)
    ],
)
def test_gpus_per_node_other_than_the_partitions_is_refused_before_the_queue(
    tmp_path, gres, refused
):
    """NeMo-RL's ray.sub (both trees, maybe_gres_arg) exits 1 at the job's start when the
    partition's GRES names another GPU count than GPUS_PER_NODE (found by review: the job
    waited in the queue to die there). With sinfo on PATH, launch.sh refuses it first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "sinfo", f"#!/bin/sh\nprintf '%s\\n' '{gres}'\n")
    args = (TWO_NODES, "cluster.num_nodes=4", "cluster.gpus_per_node=4")
    proc = _launch(*args, PATH=f"{bin_dir}:/usr/bin:/bin")
    if refused:
        assert proc.returncode == 2 and "--nodes" not in proc.stdout
        assert "GPUS_PER_NODE=4 but partition batch's nodes have 8 GPUs" in proc.stderr
        assert "use cluster.gpus_per_node=8" in proc.stderr  # the gpu: entry's count, not 1
    else:
        assert proc.returncode == 0, proc.stderr
        assert "--nodes=4" in proc.stdout


def test_a_gres_ray_sub_misreads_is_refused_naming_ray_subs_reading(tmp_path):
    """8 GPUs a node listed before another resource: ray.sub reads 1 and exits at the job's
    start even when GPUS_PER_NODE is 8; launch.sh says so instead of advising 1 GPU a node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "sinfo", "#!/bin/sh\nprintf '%s\\n' 'gpu:8,nvme:1'\n")
    proc = _launch(TWO_NODES, PATH=f"{bin_dir}:/usr/bin:/bin")
    assert proc.returncode == 2 and "--nodes" not in proc.stdout
    assert "has 8 GPUs a node, but NeMo-RL's ray.sub reads it as 1" in proc.stderr, proc.stderr
