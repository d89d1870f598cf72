"""A local run's sequence lengths against its model's positions, measured before any work.

Every sequence a run makes is a prompt plus up to ``max_new_tokens`` new tokens, and the trainer
scores all of it in one forward (positions ``0 .. prompt + new - 1``). So the rule, the same for
both rollout engines: the longest prompt + ``max_new_tokens`` <= ``max_position_embeddings``.
Unchecked, a config past it ran until its first generate and then failed inside the run on the
HF rollout (the batch-invariant rotary table holds that many positions; a table one position short
even passed the rollout and failed in the trainer's scoring), while the vLLM engine cut the
responses short at its ``max_model_len`` without a word: two engines, two results, one config.

The prompts are those of the two datasets a run generates from: the fixed validation set and the
training problems each step draws (`training_problems` replays that stream, as `step.RunStep`
draws it, from the run's data generator, `data_generator`; with the repo's one-token-a-character
tokenizer every prompt of a task has one length, so the first step is enough). `measure` tokenizes
them as the run's batches do (`task.encode_prompts`) and `setup.resolve_run` reports
`sequence_issues` with the config's other errors (exit 2, no run directory). The vLLM engine's
``max_model_len`` is `SequenceLengths.longest_sequence`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_jetrl.backends.local.config import LocalSettings, RunSettings
from nemo_jetrl.backends.local.task import (
    Problem,
    TaskConfig,
    encode_prompts,
    sample_problems,
    validation_problems,
)
from nemo_jetrl.config.load import ConfigIssue

MAX_NEW_TOKENS_KEY = "policy.generation.max_new_tokens"
_DATA_SEED_OFFSET = 2  # training problems: grpo.seed + 2 (`LocalRun.data_gen`, checkpointed)


def data_generator(seed: int) -> torch.Generator:
    """The generator a run draws its training problems from (``grpo.seed`` = ``seed``)."""
    return torch.Generator().manual_seed(seed + _DATA_SEED_OFFSET)


def max_new_tokens_of(run: RunSettings, task: TaskConfig) -> int:
    """``policy.generation.max_new_tokens``; null: the task's answer length + 4."""
    return run.max_new_tokens or task.response_len() + 4


def training_problems(task: TaskConfig, seed: int, steps: int, per_step: int) -> list[Problem]:
    """One problem per distinct prompt among those a run of ``steps`` steps draws, ``per_step``
    a step, from `data_generator` (a resumed run continues the same stream). Stops early once
    every prompt the task can write has been seen."""
    gen = data_generator(seed)
    space = 10 ** (task.num_ops + 1) * len(set(task.ops)) ** task.num_ops
    seen: dict[str, Problem] = {}
    for _ in range(steps):
        for p in sample_problems(per_step, task, gen):
            seen.setdefault(p.prompt, p)
        if len(seen) == space:
            break
    return list(seen.values())


def longest_prompt(problems: list[Problem], tokenizer: Any) -> int:
    """Tokens of the longest prompt (``<bos>`` included) as a run's batch encodes it; 0: none."""
    if not problems:
        return 0
    try:  # one batch when every prompt has one length (the task's design)
        return int(encode_prompts(problems, tokenizer).shape[1])
    except ValueError:  # a tokenizer that gives prompts of one task different lengths
        return max(int(encode_prompts([p], tokenizer).shape[1]) for p in problems)


@dataclass(frozen=True)
class SequenceLengths:
    """What `measure` found (tokens)."""

    train_prompt: int
    """Longest prompt the run's training steps draw."""
    val_prompt: int
    """Longest validation prompt."""
    max_new_tokens: int
    """New tokens a rollout may generate (`max_new_tokens_of`)."""
    max_positions: int
    """The model's ``max_position_embeddings``."""

    @property
    def longest_prompt(self) -> int:
        return max(self.train_prompt, self.val_prompt)

    @property
    def longest_sequence(self) -> int:
        """Longest prompt + ``max_new_tokens``: the vLLM engine's ``max_model_len``."""
        return self.longest_prompt + self.max_new_tokens


def measure(
    run: RunSettings, local: LocalSettings
) -> tuple[SequenceLengths | None, list[ConfigIssue]]:
    """The run's `SequenceLengths` and its problems (`sequence_issues`; a tokenizer or model
    config that does not load is named at its key). Loads the tokenizer and the model config
    only: no weights, no run directory."""
    from nemo_jetrl.backends.local.model import MODEL_CONFIG_JSON, load_model_config
    from nemo_jetrl.backends.local.tokenizer import load_tokenizer

    loaded: dict[str, Any] = {}
    issues: list[ConfigIssue] = []
    for key, load in (("tokenizer", load_tokenizer), ("model_config", load_model_config)):
        try:
            loaded[key] = load(getattr(local, key))
        except Exception as exc:  # any failure to load is the key's problem, named before work
            issues.append(ConfigIssue(f"jetrl.local.{key}", f"cannot be loaded: {exc}"))
    if issues:
        return None, issues
    tok, task = loaded["tokenizer"], local.task
    # the repo's tokenizer writes one token per character, so every prompt of a task has one
    # length and the first step measures it; another tokenizer: every step the run will draw
    # (a few seconds for 10,000 steps of 4-operation problems, ~78,000 distinct prompts)
    steps = run.max_num_steps if local.tokenizer else 1
    train = training_problems(task, run.seed, steps, run.num_prompts_per_step)
    lengths = SequenceLengths(
        train_prompt=longest_prompt(train, tok),
        val_prompt=longest_prompt(validation_problems(task, run.seed), tok),
        max_new_tokens=max_new_tokens_of(run, task),
        max_positions=int(loaded["model_config"].max_position_embeddings),
    )
    model = local.model_config or f"{MODEL_CONFIG_JSON.name}, the repo's 2-layer Llama"
    return lengths, sequence_issues(lengths, run.max_new_tokens, task, model)


def sequence_issues(
    lengths: SequenceLengths, given: int | None, task: TaskConfig, model: str
) -> list[ConfigIssue]:
    """[] when the longest prompt + ``max_new_tokens`` fits the model's positions, else the
    issue naming the numbers and the keys to change. ``given``: the config's
    ``max_new_tokens`` (None: the default); ``model``: which model config says the bound."""
    need, room = lengths.longest_sequence, lengths.max_positions - lengths.longest_prompt
    if need <= lengths.max_positions:
        return []
    default = "" if given else f" (null: the task's answer length {task.response_len()} + 4)"
    fixes = [f"lower jetrl.local.task.num_ops (now {task.num_ops})"]
    if room > 0:
        fixes.insert(0, f"set {MAX_NEW_TOKENS_KEY} <= {room}")
    fixes.append(f"set jetrl.local.model_config to a model with max_position_embeddings >= {need}")
    return [
        ConfigIssue(
            MAX_NEW_TOKENS_KEY,
            f"the longest prompt ({lengths.longest_prompt} tokens: training "
            f"{lengths.train_prompt}, validation {lengths.val_prompt}) + max_new_tokens "
            f"{lengths.max_new_tokens}{default} = {need} positions, past the model's "
            f"max_position_embeddings {lengths.max_positions} ({model}): the trainer scores "
            "every position, the HF rollout would fail at its first generate and the vLLM "
            f"engine would cut responses short. To fit: {'; or '.join(fixes)}",
        )
    ]
