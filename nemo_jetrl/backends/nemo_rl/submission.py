"""What `slurm/launch.sh` asks of a config on the login node, before anything is submitted.

A job that `jetrl train --backend nemo-rl` refuses at its start has already waited in the queue,
allocated its nodes and started Ray: the refusals that need nothing of the launch machine are
made here instead, with the same code (exit 2, every problem listed): the config's validation
and on-policy verdict (`flow.pipeline`), NeMo-RL's split of the GPUs (`resources`), then, where
this Python has torch (our translation to NeMo-RL's keys imports it), the NeMo-RL backend's
other rules (`launch.launch_problems`) on both NeMo-RL trees we know: what both refuse is
refused, what one refuses is a note naming it (the image's tree is not known here). Paths,
venvs and the installed vLLM are the job's to check, and so is a config only the job's machine
can read (a ``defaults:`` file in the image, a variable set in the job: exit 3).

On success stdout is one line, the values launch.sh reads (`KEYS`, spaces as ``\\040``, ``-``
when unset). Run as ``python -m nemo_jetrl.backends.nemo_rl.submission CONFIG [key=value ...]``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf

from nemo_jetrl.backends.nemo_rl.resources import resource_problems
from nemo_jetrl.config import ConfigError
from nemo_jetrl.flow.pipeline import check_config, off_policy_refusal

#: the config values launch.sh needs, in the order it reads them.
KEYS = (
    "cluster.num_nodes",
    "cluster.gpus_per_node",
    "policy.model_name",
    "checkpointing.checkpoint_dir",
    "logger.log_dir",
    "env.nemo_gym.num_gpu_nodes",
)


def submission_problems(path: str, overrides: Sequence[str]) -> tuple[list[str], list[str], Any]:
    """(refusals, notes, the loaded config): refusals are what `jetrl train --backend nemo-rl`
    would refuse at the job's start on either known NeMo-RL tree."""
    try:
        checked = check_config(path, list(overrides))
    except ConfigError as exc:
        if _job_machine_only(exc):
            raise  # not judged here: launch.sh falls back to NODES / GPUS_PER_NODE
        return [f"invalid config\n{exc}"], [], None
    refusal = off_policy_refusal(checked, backend="nemo-rl")
    if refusal:
        return [refusal], [], checked.cfg
    try:
        import torch  # noqa: F401  (translate's vLLM patch settings import it)
    except ImportError:
        note = (
            "this Python has no torch: the NeMo-RL backend's launch rules other than the GPU "
            "split were not checked here (jetrl train checks them when the job starts; `jetrl "
            "check CONFIG` lists them where torch is installed)"
        )
        cfg = OmegaConf.to_container(checked.cfg, resolve=True)
        gpus = resource_problems(cfg)  # type: ignore[arg-type]
        return [f"{key}={why}" for key, why in gpus], [note], checked.cfg
    from nemo_jetrl.backends.nemo_rl.launch import launch_problems
    from nemo_jetrl.backends.nemo_rl.tree_rules import KNOWN_TREES

    per_tree = {tree: launch_problems(checked, facts) for tree, facts in KNOWN_TREES.items()}
    first, *others = per_tree.values()
    common = [p for p in first if all(p in o for o in others)]
    refusals = [f"{key}={why}" for key, why in common]
    notes = [
        f"on NeMo-RL {tree} jetrl train would refuse it: {key}={why}"
        for tree, problems in per_tree.items()
        for key, why in problems
        if (key, why) not in common
    ]
    return refusals, notes, checked.cfg


def _job_machine_only(exc: ConfigError) -> bool:
    """Whether every error is one the job's machine may not have: a ``defaults:`` file that
    exists only in the image (``/opt/nemo-rl/...``), an environment variable set only there."""
    errors = [i for i in exc.issues if i.level == "error"]
    return bool(errors) and all(
        (i.path == "defaults" and i.message.startswith("config file not found"))
        or "Environment variable" in i.message
        for i in errors
    )


def main(argv: Sequence[str]) -> int:
    """Exit 0 printing the `KEYS` line, 2 with every refusal on stderr, or 3 when the config
    can only be read on the job's machine (launch.sh then takes NODES / GPUS_PER_NODE)."""
    path, overrides = argv[0], [o for o in argv[1:] if "=" in o]
    try:
        refusals, notes, cfg = submission_problems(path, overrides)
    except ConfigError as exc:
        print(f"only the job's machine can read it: {exc}".replace("\n", " "), file=sys.stderr)
        return 3
    for note in notes:
        print(f"launch.sh: note: {note}", file=sys.stderr)
    if refusals:
        print("\n".join(refusals), file=sys.stderr)
        return 2
    values = (OmegaConf.select(cfg, k, default=None) for k in KEYS)
    print(*(str(v or "-").replace(" ", "\\040") for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
