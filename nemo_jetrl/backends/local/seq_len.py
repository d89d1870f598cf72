"""A local run's sequence lengths against its model's positions, measured before any work.

Every sequence a run makes is a prompt plus up to ``max_new_tokens`` new tokens, and the trainer
scores all of it in one forward (positions ``0 .. prompt + new - 1``). So the rule, the same for
both rollout engines: the longest prompt + ``max_new_tokens`` <= ``max_position_embeddings``, and
<= ``policy.max_total_sequence_length`` when the config sets one (NeMo-RL cuts responses there;
this backend never cuts a response short, so a config that would need a cut is refused instead).
Unchecked, a config past the positions ran until its first generate and then failed inside the
run on the HF rollout (the batch-invariant rotary table holds that many positions; a table one
position short even passed the rollout and failed in the trainer's scoring), while the vLLM engine
cut the responses short at its ``max_model_len`` without a word: two engines, two results, one
config. The supervised warm start trains on a prompt + its full answer, whatever
``max_new_tokens`` says: its longest sequence must fit ``max_position_embeddings`` too (HF's plain
rotary trained the positions past the table without a word).

The prompts are those of the two datasets a run generates from: the fixed validation set and the
training problems each step draws (`training_problems` replays that stream, as `step.RunStep`
draws it, from the run's data generator, `data_generator`; with the repo's one-token-a-character
tokenizer every prompt of a task has one length, so the first step is enough). `measure` tokenizes
them as the run's batches do (`task.encode_prompts`); the warm start's batches are replayed
from its own stream (`warmstart.warmstart_batches`). `setup.resolve_run` reports
`sequence_issues` with the config's other errors (exit 2, no run directory), and `jetrl check`
the same issues through `setup.SECTION`. The vLLM engine's ``max_model_len`` is
`SequenceLengths.longest_sequence`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch

from nemo_jetrl.backends.local.config import LocalSettings, RunSettings
from nemo_jetrl.backends.local.task import (
    Problem,
    TaskConfig,
    encode_prompts,
    encode_targets,
    sample_problems,
    validation_problems,
)
from nemo_jetrl.backends.local.warmstart import warmstart_batches
from nemo_jetrl.config.load import ConfigIssue

MAX_NEW_TOKENS_KEY = "policy.generation.max_new_tokens"
MAX_TOTAL_KEY = "policy.max_total_sequence_length"
NUM_OPS_KEY = "jetrl.local.task.num_ops"
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


def _longest_target(problems: list[Problem], tokenizer: Any) -> int:
    """Tokens of the longest supervised target (``<eos>`` included) as the warm start encodes it."""
    try:
        return int(encode_targets(problems, tokenizer).shape[1])
    except ValueError:  # targets of different lengths (not a batch the warm start can train on)
        return max(int(encode_targets([p], tokenizer).shape[1]) for p in problems)


def warmstart_sequence(local: LocalSettings, seed: int, tokenizer: Any, steps: int) -> int:
    """Tokens of the longest prompt + full answer the warm start's first ``steps`` steps train
    on (each step's batch is that wide); 0: no warm start (``enabled: false`` or 0 steps)."""
    ws = local.warmstart
    if not (ws.enabled and ws.steps > 0):
        return 0
    return max(
        longest_prompt(batch, tokenizer) + _longest_target(batch, tokenizer)
        for batch in islice(warmstart_batches(local.task, ws, seed), steps)
    )


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
    max_total: int | None = None
    """``policy.max_total_sequence_length`` (None: not set)."""
    warmstart: int = 0
    """Longest prompt + full answer the warm start trains on (0: no warm start)."""

    @property
    def longest_prompt(self) -> int:
        return max(self.train_prompt, self.val_prompt)

    @property
    def longest_sequence(self) -> int:
        """Longest prompt + ``max_new_tokens``: the vLLM engine's ``max_model_len``."""
        return self.longest_prompt + self.max_new_tokens


MEASURE_READS = frozenset(
    {"max_num_steps", "seed", "num_prompts_per_step", "max_new_tokens", "max_total_sequence_length"}
)
"""The run keys (`RunSettings` fields) `measure` reads: a config whose value of one failed to
parse is not measured (it would measure a default the user did not give)."""


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
    # (a few seconds for 10,000 steps of 4-operation problems, ~78,000 distinct prompts); the
    # warm start's steps alike (its targets have one length per task too)
    steps = run.max_num_steps if local.tokenizer else 1
    train = training_problems(task, run.seed, steps, run.num_prompts_per_step)
    lengths = SequenceLengths(
        train_prompt=longest_prompt(train, tok),
        val_prompt=longest_prompt(validation_problems(task, run.seed), tok),
        max_new_tokens=max_new_tokens_of(run, task),
        max_positions=int(loaded["model_config"].max_position_embeddings),
        max_total=run.max_total_sequence_length,
        warmstart=warmstart_sequence(
            local, run.seed, tok, local.warmstart.steps if local.tokenizer else 1
        ),
    )
    model = local.model_config or f"{MODEL_CONFIG_JSON.name}, the repo's 2-layer Llama"
    return lengths, sequence_issues(lengths, run.max_new_tokens, task, model)


def sequence_issues(
    lengths: SequenceLengths, given: int | None, task: TaskConfig, model: str
) -> list[ConfigIssue]:
    """[] when the run's sequences fit, else the issues naming the numbers and the keys to change:
    the longest prompt + ``max_new_tokens`` past the tighter of the model's positions and
    ``policy.max_total_sequence_length`` (one issue, at the key of that bound), and the warm
    start's longest sequence past the model's positions. ``given``: the config's
    ``max_new_tokens`` (None: the default); ``model``: which model config says the bound."""
    need, top = lengths.longest_sequence, lengths.max_positions
    total = lengths.max_total if lengths.max_total is not None and lengths.max_total < top else None
    default = "" if given else f" (null: the task's answer length {task.response_len()} + 4)"
    sequence = (
        f"the longest prompt ({lengths.longest_prompt} tokens: training {lengths.train_prompt}, "
        f"validation {lengths.val_prompt}) + max_new_tokens {lengths.max_new_tokens}{default} = "
        f"{need}"
    )
    num_ops = f"lower {NUM_OPS_KEY} (now {task.num_ops})"
    bigger = "set jetrl.local.model_config to a model with max_position_embeddings >= {}"
    issues = []
    if total is not None and need > total:  # the config's own bound, below the model's
        prompt, fixes = lengths.longest_prompt, [num_ops]
        if need <= top:
            fixes.insert(0, f"raise {MAX_TOTAL_KEY} to >= {need}")
        elif top > prompt:  # the model's positions bound it too
            fixes.insert(
                0,
                f"raise {MAX_TOTAL_KEY} (up to the model's max_position_embeddings {top}) with "
                f"{MAX_NEW_TOKENS_KEY} <= {top - prompt}",
            )
        if total > prompt:
            fixes.insert(0, f"set {MAX_NEW_TOKENS_KEY} <= {total - prompt}")
        issues.append(
            ConfigIssue(
                MAX_TOTAL_KEY,
                f"{sequence} tokens, past max_total_sequence_length {total}: NeMo-RL would cut "
                "the responses there, the local backend does not cut a response short (one "
                f"cut before its <eos> is never rewarded). To fit: {'; or '.join(fixes)}",
            )
        )
    elif need > top:
        room = top - lengths.longest_prompt
        fixes = [num_ops, bigger.format(need)]
        if room > 0:
            fixes.insert(0, f"set {MAX_NEW_TOKENS_KEY} <= {room}")
        issues.append(
            ConfigIssue(
                MAX_NEW_TOKENS_KEY,
                f"{sequence} positions, past the model's max_position_embeddings {top} "
                f"({model}): the trainer scores every position, the HF rollout would fail at "
                "its first generate and the vLLM engine would cut responses short. To fit: "
                f"{'; or '.join(fixes)}",
            )
        )
    if lengths.warmstart > top:  # reachable with max_new_tokens below the answer's length
        fixes = [
            num_ops,
            "set jetrl.local.warmstart.enabled=false",
            bigger.format(lengths.warmstart),
        ]
        issues.append(
            ConfigIssue(
                NUM_OPS_KEY,
                f"the warm start trains on a prompt + its full answer (<eos> included) of up to "
                f"{lengths.warmstart} tokens, whatever max_new_tokens says: past the model's "
                f"max_position_embeddings {top} ({model}), positions the run's rotary table "
                "does not hold (the warm start's plain HF rotary would train them without a "
                f"word). To fit: {'; or '.join(fixes)}",
            )
        )
    return issues
