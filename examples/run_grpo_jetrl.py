"""Launch GRPO through NeMo-RL with a nemo_jetrl recipe, the way NeMo-RL's examples are launched.

    python examples/run_grpo_jetrl.py --config examples/configs/qwen3_8b_base/jetrl.yaml \\
        grpo.max_num_steps=100 cluster.gpus_per_node=8

with the Python that has NeMo-RL (in the image: /opt/nemo_rl_venv/bin/python, the `python` on
PATH). Not through uv's project runner: in the image UV_PROJECT_ENVIRONMENT=/opt/nemo_rl_venv,
so it would sync this repository's pyproject.toml into NeMo-RL's driver venv (replacing its
torch) and need the network. On SLURM use it as COMMAND for NeMo-RL's ray.sub, or
slurm/launch.sh. Same as
``jetrl train CONFIG --backend nemo-rl [overrides]``: the config is validated, an off-policy
recipe is refused unless ``jetrl.allow_off_policy=true``, and NeMo-RL's GRPO runs with our
policy worker, vLLM patch, KV calibration and mismatch metrics.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GRPO through NeMo-RL with a nemo_jetrl recipe")
    parser.add_argument("--config", required=True, help="NeMo-RL-shaped YAML")
    args, overrides = parser.parse_known_args(argv)

    from nemo_jetrl.backends.nemo_rl.launch import run_nemo_rl
    from nemo_jetrl.cli import UserError

    try:
        return run_nemo_rl(args.config, overrides)
    except UserError as exc:
        print(f"run_grpo_jetrl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
