"""Supervised warm start, cached on disk, so that GRPO starts from a non-zero reward.

A randomly initialised model never writes a correct answer, and GRPO learns nothing from a group
whose rewards are all zero. So before RL the policy is trained briefly by teacher forcing on the
task's step-by-step targets (cross-entropy on response tokens, fp32, AdamW with a short warm-up),
the way an RL run starts from an SFT checkpoint. The result is stored as safetensors under the
cache directory, keyed by a hash of everything that determines it (model config, tokenizer,
task, warm-start settings, seed, torch version), and reused by every recipe of a comparison:
all recipes start from the same weights. Writes are atomic (temporary file + rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nemo_jetrl.backends.local.config import WarmStartSettings
from nemo_jetrl.backends.local.model import build_model
from nemo_jetrl.backends.local.run_identity import model_config_content, tokenizer_digest
from nemo_jetrl.backends.local.task import (
    Problem,
    TaskConfig,
    early_answer_target,
    encode_prompts,
    encode_targets,
    sample_problems,
)
from nemo_jetrl.config.run_keys import path_problem

CACHE_VERSION = 2  # bump when the warm-start procedure changes


def cache_key(
    model_config: Any, tokenizer_json: str, task: TaskConfig, ws: WarmStartSettings, seed: int
) -> str:
    """Hex digest of everything that determines the warm-start weights."""
    ws_fields = {k: v for k, v in asdict(ws).items() if k != "seed"}
    seed = ws.seed if ws.seed is not None else seed
    blob = json.dumps(
        {
            "v": CACHE_VERSION,
            "model": model_config_content(model_config),  # one home for "the same model"
            "tokenizer": tokenizer_digest(tokenizer_json),
            "task": asdict(task),
            "warmstart": ws_fields,
            "seed": seed,
            "torch": torch.__version__.split("+")[0],
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def warmstart_targets(
    problems: list[Problem], ws: WarmStartSettings, generator: torch.Generator
) -> list[Problem]:
    """The supervised targets: each problem's step-by-step target, except that a fraction
    ``ws.early_answer_frac`` (drawn with ``generator``) answers one step early."""
    early = torch.rand(len(problems), generator=generator) < ws.early_answer_frac
    return [
        replace(p, target=early_answer_target(p)) if e else p
        for p, e in zip(problems, early.tolist(), strict=True)
    ]


def warmstart_batches(
    task: TaskConfig, ws: WarmStartSettings, seed: int
) -> Iterator[list[Problem]]:
    """The supervised problems of each warm-start step, in order (``seed``: ``grpo.seed``, used
    when ``ws.seed`` is None): the stream `train_warmstart` trains on and `seq_len` measures."""
    g = torch.Generator().manual_seed((ws.seed if ws.seed is not None else seed) + 1)
    for _ in range(ws.steps):
        yield warmstart_targets(sample_problems(ws.batch_size, task, g), ws, g)


def train_warmstart(
    model_config: Any,
    tokenizer: Any,
    task: TaskConfig,
    ws: WarmStartSettings,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Run the supervised warm start (fp32) and return the weights; ``log`` gets a progress
    line about every 10% of the steps."""
    seed = ws.seed if ws.seed is not None else seed
    model = build_model(model_config, dtype=torch.float32, seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = 20
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    t0, every = time.perf_counter(), max(1, ws.steps // 10)
    # prompt + the full answer: `seq_len` refused a config whose longest passes the model's
    # positions (HF's rotary would extend past the table without a word)
    for step, problems in enumerate(warmstart_batches(task, ws, seed)):
        prompts = encode_prompts(problems, tokenizer)
        targets = encode_targets(problems, tokenizer)
        ids = torch.cat([prompts, targets], dim=1)
        if ids.shape[1] > model_config.max_position_embeddings:  # a backstop: seq_len refuses it
            raise ValueError(
                f"warm start: a prompt + answer of {ids.shape[1]} tokens is past the model's "
                f"max_position_embeddings {model_config.max_position_embeddings}"
            )
        logits = model(input_ids=ids, use_cache=False).logits[:, prompts.shape[1] - 1 : -1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log is not None and ((step + 1) % every == 0 or step + 1 == ws.steps):
            el = time.perf_counter() - t0
            log(
                f"  warm start {step + 1}/{ws.steps} steps, loss {float(loss.detach()):.3f}, "
                f"{el:.0f}s elapsed, ~{el / (step + 1) * (ws.steps - step - 1):.0f}s left"
            )
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def load_or_train(
    model_config: Any,
    tokenizer: Any,
    tokenizer_json: str,
    task: TaskConfig,
    ws: WarmStartSettings,
    seed: int,
    cache_dir: Path,
    log=print,
) -> tuple[dict[str, torch.Tensor], Path, bool]:
    """(weights, cache file, loaded_from_cache). Trains and stores on a cache miss."""
    from safetensors.torch import load_file, save_file

    key = cache_key(model_config, tokenizer_json, task, ws, seed)
    path = Path(cache_dir) / f"warmstart-{key}.safetensors"
    if path.is_file():
        try:
            return load_file(str(path)), path, True
        except Exception as exc:  # a corrupt cache entry is retrained, never trusted
            log(f"warm start cache {path} unreadable ({exc}); retraining")
    t0 = time.perf_counter()
    # a cache that cannot be written costs the next run a retrain, never this run its weights:
    # said before training, and a failed write is a warning
    unwritable = path_problem(path.parent)
    where = f"not cached: {unwritable[0]}" if unwritable else f"cached afterwards in {path.parent}"
    log(f"warm start: {ws.steps} supervised steps ({where})")
    weights = train_warmstart(model_config, tokenizer, task, ws, seed, log=log)
    if unwritable is None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(tmp), metadata={"key": key})
            tmp.replace(path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            unwritable = (str(exc), False)
    if unwritable is not None:
        log(
            f"warning: the warm start was not cached ({unwritable[0]}); this run goes on with "
            "its weights. Set jetrl.local.cache_dir (or $JETRL_CACHE_DIR) to a writable "
            "directory so the next run loads it"
        )
    log(f"warm start done in {time.perf_counter() - t0:.1f}s")
    return weights, path, False
