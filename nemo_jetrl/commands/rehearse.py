"""``jetrl rehearse CONFIG [k=v ...]``: the cluster launch of CONFIG rehearsed on this CPU."""

from __future__ import annotations

import argparse

NAME = "rehearse"
HELP = (
    "Rehearse `jetrl train CONFIG --backend nemo-rl` on this machine's CPU: NeMo-RL's own launch "
    "(Ray, worker groups, vLLM workers with our kernel and refit hook, grpo_train) for 2 GRPO "
    "steps on a tiny model of the config's family; prints what to check before a cluster job."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="NeMo-RL-shaped YAML (as for jetrl train)")
    parser.add_argument(
        "overrides", nargs="*", default=[], help="key=value overrides (as for jetrl train)"
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="where the tiny model, prompts, logs and checkpoints go (default: a new temp dir)",
    )


def run(args: argparse.Namespace) -> int:
    from nemo_jetrl.backends.nemo_rl.rehearsal.run import rehearse

    return rehearse(args.config, args.overrides, args.workdir)
