"""Synthetic, verifiable multi-step arithmetic whose answer length is a knob.

A problem is a chain of single-digit operations evaluated left to right modulo 10, e.g.
``3+4-9+5=``. The expected response writes every intermediate step, then the final answer::

    prompt   <bos>3+4-9+5=
    response 3+4=7;7-9=8;8+5=3;#3<eos>

With ``num_ops`` operations the response has ``6 * num_ops + 3`` tokens, so raising ``num_ops``
lengthens rollouts in a controlled way: that is how the local backend studies how the
train/rollout mismatch grows with answer length. The reward is verifiable: 1.0 when the text
after ``#`` is the correct final digit and the response ended with ``<eos>``, plus an optional
``format_reward`` when every step has the expected shape (right or wrong). All prompts of one
task have the same length, so batches need no padding on the prompt side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_OPS = {
    "+": lambda a, b: (a + b) % 10,
    "-": lambda a, b: (a - b) % 10,
    "*": lambda a, b: (a * b) % 10,
}


@dataclass(frozen=True)
class TaskConfig:
    """What problems look like and how responses are rewarded."""

    num_ops: int = 1
    """Operations per problem = intermediate steps written out (answer length 6*num_ops+3)."""
    ops: str = "+-"
    """Operators drawn uniformly; any of '+', '-', '*' (all modulo 10)."""
    show_steps: bool = True
    """Write each step out (``a+b=c;``); False makes the response just ``#d``."""
    format_reward: float = 0.0
    """Added to the reward when the response is well formed, right answer or not."""
    val_size: int = 64
    """Number of held-out validation problems (fixed by the seed)."""

    def response_len(self) -> int:
        """Tokens in a correct response, ``<eos>`` included."""
        return (6 * self.num_ops if self.show_steps else 0) + 3

    def prompt_len(self) -> int:
        """Tokens in a prompt, ``<bos>`` included."""
        return 2 * self.num_ops + 3


@dataclass(frozen=True)
class Problem:
    """One problem: its prompt text (without ``<bos>``), target response text and answer."""

    prompt: str
    target: str
    answer: int


def make_problem(digits: list[int], ops: list[str], cfg: TaskConfig) -> Problem:
    """Build the prompt and the step-by-step target for ``d0 op1 d1 op2 d2 ...``."""
    prompt = str(digits[0]) + "".join(f"{o}{d}" for o, d in zip(ops, digits[1:], strict=True)) + "="
    acc, steps = digits[0], []
    for o, d in zip(ops, digits[1:], strict=True):
        nxt = _OPS[o](acc, d)
        steps.append(f"{acc}{o}{d}={nxt};")
        acc = nxt
    target = ("".join(steps) if cfg.show_steps else "") + f"#{acc}"
    return Problem(prompt, target, acc)


def chain_values(problem: Problem) -> list[int]:
    """Running values of the chain, ``[d0, after op 1, ..., after op n]`` (last = answer)."""
    text = problem.prompt.rstrip("=")
    vals = [int(text[0])]
    for i in range(1, len(text), 2):
        vals.append(_OPS[text[i]](vals[-1], int(text[i + 1])))
    return vals


def early_answer_target(problem: Problem) -> str:
    """The target with every step written out but the final answer one step early (the value
    before the last operation): the habit the warm start plants for GRPO to correct."""
    return problem.target.rsplit("#", 1)[0] + f"#{chain_values(problem)[-2]}"


def sample_problems(n: int, cfg: TaskConfig, generator: torch.Generator) -> list[Problem]:
    """``n`` random problems drawn with ``generator`` (so runs and resumes are reproducible)."""
    digits = torch.randint(0, 10, (n, cfg.num_ops + 1), generator=generator).tolist()
    op_idx = torch.randint(0, len(cfg.ops), (n, cfg.num_ops), generator=generator).tolist()
    return [
        make_problem(d, [cfg.ops[i] for i in o], cfg) for d, o in zip(digits, op_idx, strict=True)
    ]


def validation_problems(cfg: TaskConfig, seed: int) -> list[Problem]:
    """The fixed held-out set: same for every recipe and every resume of a run."""
    g = torch.Generator().manual_seed(seed + 7919)
    return sample_problems(cfg.val_size, cfg, g)


def _format_re(cfg: TaskConfig) -> re.Pattern[str]:
    step = r"\d[+\-*]\d=\d;"
    return re.compile((f"(?:{step}){{{cfg.num_ops}}}" if cfg.show_steps else "") + r"#\d")


def score(problem: Problem, response: str, finished: bool, cfg: TaskConfig) -> tuple[float, bool]:
    """(reward, correct) for one decoded response (``<eos>`` and padding already stripped).

    ``finished`` says whether the response ended with ``<eos>``; a truncated response is never
    correct.
    """
    correct = finished and "#" in response and response.rsplit("#", 1)[1] == str(problem.answer)
    reward = 1.0 if correct else 0.0
    if cfg.format_reward and finished and _format_re(cfg).fullmatch(response):
        reward += cfg.format_reward
    return reward, bool(correct)


def encode_prompts(problems: list[Problem], tokenizer) -> torch.Tensor:
    """``[B, P]`` token ids of ``<bos>`` + prompt (all prompts of a task have one length)."""
    rows = [
        [tokenizer.bos_token_id, *tokenizer(p.prompt, add_special_tokens=False)["input_ids"]]
        for p in problems
    ]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("prompts of one task must have equal length")
    return torch.tensor(rows, dtype=torch.long)


def encode_targets(problems: list[Problem], tokenizer) -> torch.Tensor:
    """``[B, R]`` token ids of target response + ``<eos>`` (used by the supervised warm start)."""
    rows = [
        [*tokenizer(p.target, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        for p in problems
    ]
    return torch.tensor(rows, dtype=torch.long)


def decode_responses(
    response_ids: torch.Tensor, tokenizer
) -> tuple[list[str], list[bool], torch.Tensor]:
    """Texts up to ``<eos>``, whether each finished, and the ``[B, R]`` response-token mask.

    The mask covers every generated token up to and including the first ``<eos>``; tokens after
    it are padding (the rollout stops feeding them to the model as soon as all rows finished).
    """
    eos = tokenizer.eos_token_id
    is_eos = response_ids == eos
    finished = is_eos.any(dim=1)
    first = torch.where(finished, is_eos.float().argmax(dim=1), response_ids.shape[1])
    pos = torch.arange(response_ids.shape[1], device=response_ids.device)[None, :]
    mask = pos <= first[:, None]
    mask &= pos < response_ids.shape[1]
    texts = [
        tokenizer.decode(row[: int(n)].tolist(), skip_special_tokens=True)
        for row, n in zip(response_ids, first, strict=True)
    ]
    return texts, finished.tolist(), mask
