"""Settings of the local backend: the ``jetrl.local:`` section and the NeMo-RL keys it reads.

A local run is described by the same NeMo-RL-shaped YAML as a cluster run. What NeMo-RL has keys
for (batch sizes, steps, temperature, optimizer, loss, checkpointing, log dir) is read from those
keys (`RunSettings`); what only the local backend needs (which small model, the synthetic task,
the warm start, the compute dtype) lives under ``jetrl.local:`` (`LocalSettings`). Neither reads
the config tree: `LocalSettings.from_cfg` takes the ``jetrl.local`` mapping, `RunSettings.from_keys`
the NeMo-RL keys `setup.resolve_run` (this backend's door) read, and the rules on other keys take
the typed `nemo_jetrl.config.Settings`; each collects *every* problem with its full key path
and raises one `ConfigError`. `validate_local_config` / `validate_local_run` are hooks
`jetrl check` calls (`setup.SECTION`, which adds the rules on this section and the run keys
together: `seq_len`).
Every key is documented in docs/local_backend.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from nemo_jetrl.backends.local.model import MODEL_CONFIG_JSON, SUPPORTED_TYPES
from nemo_jetrl.backends.local.moe_config import moe_run_issues
from nemo_jetrl.backends.local.task import TaskConfig
from nemo_jetrl.config.load import ConfigError, ConfigIssue
from nemo_jetrl.config.run_keys import path_problem
from nemo_jetrl.config.settings import Settings
from nemo_jetrl.config.typed import (
    OurSection,
    choice,
    count,
    flag,
    number,
    parse_rest,
    plain,
    rule,
    section,
    text,
)
from nemo_jetrl.errors import cwd_hint

DTYPES = ("bfloat16", "float32")
ROLLOUT_ENGINES = ("hf", "vllm")
DEVICE_FORM = "cpu, cuda or cuda:N (N a GPU index)"


def is_device_name(v: str) -> bool:
    """``cpu``, ``cuda`` or ``cuda:N``: the devices the local backend runs on (whether this
    machine has them is `nemo_jetrl.backends.local.device.device_issues`' to say)."""
    if v in ("cpu", "cuda"):
        return True
    head, _, idx = v.partition(":")
    return head == "cuda" and idx.isdigit() and not (len(idx) > 1 and idx[0] == "0")


@dataclass(frozen=True)
class WarmStartSettings:
    """Short supervised warm start so GRPO begins with a non-zero reward (cached on disk)."""

    enabled: bool = True
    """Run (or load from the cache) the warm start; False starts GRPO from random weights."""
    steps: int = 150
    """Supervised steps (teacher forcing on the task's step-by-step targets). The 2-layer model
    writes 1-operation steps right (greedy) after ~150 steps and 2-operation chains only after
    ~400-500 (batch 64, lr 1e-3; measured)."""
    batch_size: int = 64
    """Problems per supervised step."""
    lr: float = 1.0e-3
    """AdamW learning rate of the warm start (20-step linear warm-up)."""
    early_answer_frac: float = 0.8
    """Fraction of the supervised targets that write every step right but answer one step early
    (the value before the last operation). Above 0.5 the warm-started policy answers early by
    habit, a behaviour the verifiable reward can teach away: what the demo's GRPO learns."""
    seed: int | None = None
    """Seed of the warm start (model init and its problems); None: ``grpo.seed``. Fixing it
    lets runs with different GRPO seeds start from the same cached weights."""


@dataclass(frozen=True)
class LocalSettings:
    """Everything under ``jetrl.local:`` (see docs/local_backend.md)."""

    model_config: str | None = None
    """HF config.json (Llama, Qwen2, Qwen3-MoE or Mixtral) of the policy; None: the repo's
    2-layer Llama."""
    tokenizer: str | None = None
    """tokenizers JSON file; None: the repo's character-level tokenizer."""
    dtype: str = "bfloat16"
    """Activation/weight dtype of the BF16 parts of both sides ("bfloat16", or "float32" to
    trade the BF16 rounding for speed on CPUs without native BF16 GEMMs)."""
    num_threads: int | None = 1
    """torch intra-op threads. 1 (default): this model's ops are far too small to gain from
    threads, and on a shared CPU OpenMP spin-waiting made 2 threads 10-30x slower (measured);
    None leaves torch's default."""
    cache_dir: str | None = None
    """Warm-start cache; None: $JETRL_CACHE_DIR or ~/.cache/nemo_jetrl."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The synthetic arithmetic task (``jetrl.local.task.*``)."""
    warmstart: WarmStartSettings = field(default_factory=WarmStartSettings)
    """The cached supervised warm start (``jetrl.local.warmstart.*``)."""
    batch_invariant: bool = True
    """Both sides compute each token with batch-invariant ops (`nemo_jetrl.invariant`: norms,
    rotary, SiLU, attention, softmax, ``lm_head``, and the exact FP8 GEMM), so a token's
    probability has the same bits in the rollout's decode step and the trainer's full-sequence
    forward: ``jetrl`` / ``jetrl_kv`` are then exactly on-policy on every CPU. BF16 decoder linears
    (``bf16`` recipe, BF16 first/last layers) keep torch's GEMM. False: HF's eager ops."""
    val_greedy: bool = True
    """Validation decodes greedily (deterministic accuracy); False samples at the temperature."""
    rollout_engine: str = "hf"
    """What samples the rollouts: "hf" (the HF model with `Fp8InferenceLinear` layers, in this
    process) or "vllm" (a real vLLM CPU engine under the nemo_jetrl patch, refit every step
    through the guarded path with the parity check on; needs the .venv-vllm environment from
    scripts/setup_vllm_env.sh; recipes bf16 and jetrl, jetrl_kv where vLLM runs an FP8 KV cache on
    this CPU, bfloat16 dtype)."""
    device: str = "cpu"
    """Where the models, the rollout, the trainer, the invariant ops and the metrics run: "cpu",
    "cuda" or "cuda:N" (``jetrl train/demo --device``). A CUDA device this machine lacks is
    refused before any work (`nemo_jetrl.backends.local.device`). The warm start stays on the
    CPU (its cached weights are the same for every device)."""

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        env = os.environ.get("JETRL_CACHE_DIR")
        return Path(env).expanduser() if env else Path.home() / ".cache" / "nemo_jetrl"

    @classmethod
    def from_cfg(
        cls, section: Mapping[str, Any] | None, path: str = "jetrl.local"
    ) -> LocalSettings:
        """Settings from the ``jetrl.local`` mapping; `ConfigError` listing every problem."""
        issues: list[ConfigIssue] = []
        out = _read_local(section, path, issues)
        if [i for i in issues if i.level == "error"]:
            raise ConfigError(issues)
        assert out is not None
        return out


def _as_dict(section: Any) -> dict[str, Any] | None:
    if section is None:
        return {}
    section = plain(section)  # a key that cannot be resolved is the validator's to name
    return dict(section) if isinstance(section, Mapping) else None


# 1e9 made libgomp run out of memory. The bound does not depend on this machine (a config valid
# on one machine is valid on all); more threads than CPUs only contends, which setup warns about.
_MAX_THREADS = 1024
_UNIT = number("a number in [0, 1]", Field(ge=0, le=1))


class _TaskKeys(OurSection):
    """``jetrl.local.task`` (defaults: `TaskConfig`'s)."""

    num_ops: count(1, 32) = None  # type: ignore[valid-type]
    ops: rule(str, "a non-empty string of + - *", ok=lambda v: bool(v) and set(v) <= set("+-*")) = (
        None  # type: ignore[valid-type]
    )
    show_steps: flag() = None  # type: ignore[valid-type]
    format_reward: _UNIT = None  # type: ignore[valid-type]
    val_size: count(1) = None  # type: ignore[valid-type]


class _WarmStartKeys(OurSection):
    """``jetrl.local.warmstart`` (defaults: `WarmStartSettings`'s)."""

    enabled: flag() = None  # type: ignore[valid-type]
    steps: count(0, 10**7) = None  # type: ignore[valid-type]
    batch_size: count(1, 1 << 16) = None  # type: ignore[valid-type]
    lr: number("a number in (0, 1)", Field(gt=0, lt=1)) = None  # type: ignore[valid-type]
    early_answer_frac: _UNIT = None  # type: ignore[valid-type]
    seed: count(0, null=True) = None  # type: ignore[valid-type]


class _LocalKeys(OurSection):
    """``jetrl.local`` (defaults: `LocalSettings`'s)."""

    model_json: text("a path to a config.json, or null", null=True) = Field(
        None, alias="model_config"
    )  # type: ignore[valid-type]
    tokenizer: text("a path to a tokenizers JSON file, or null", null=True) = None  # type: ignore[valid-type]
    dtype: choice(*DTYPES) = None  # type: ignore[valid-type]
    num_threads: count(1, _MAX_THREADS, null=True) = None  # type: ignore[valid-type]
    cache_dir: text("a directory path, or null", null=True) = None  # type: ignore[valid-type]
    task: section(_TaskKeys) = None  # type: ignore[valid-type]
    warmstart: section(_WarmStartKeys) = None  # type: ignore[valid-type]
    val_greedy: flag() = None  # type: ignore[valid-type]
    batch_invariant: flag() = None  # type: ignore[valid-type]
    rollout_engine: choice(*ROLLOUT_ENGINES) = None  # type: ignore[valid-type]
    device: rule(str, DEVICE_FORM, ok=is_device_name) = None  # type: ignore[valid-type]


def _given(model: Any) -> dict[str, Any]:
    """The keys a section sets (by field name), so that every default stays the dataclass's."""
    return {name: getattr(model, name) for name in model.model_fields_set}


def _read_local(section: Any, path: str, issues: list[ConfigIssue]) -> LocalSettings | None:
    raw = _as_dict(section)
    if raw is None:
        got = f"got {section!r}; expected a mapping (a section of keys)"
        issues.append(ConfigIssue(path, got))
        return None
    keys, found = parse_rest(_LocalKeys, raw, path)
    issues.extend(found)
    if keys is None:
        return None
    kw = _given(keys)
    task_kw = _given(kw.pop("task", None) or _TaskKeys())
    ws_kw = _given(kw.pop("warmstart", None) or _WarmStartKeys())
    if "model_json" in kw:
        kw["model_config"] = kw.pop("model_json")
    for key in ("model_config", "tokenizer"):
        problem = _json_file_problem(kw.get(key), key == "model_config")
        if problem:
            issues.append(ConfigIssue(f"{path}.{key}", problem))
            kw.pop(key)
    cache = path_problem(kw["cache_dir"]) if kw.get("cache_dir") else None
    if cache is not None and cache[1]:  # under a regular file: the warm start cannot be cached
        issues.append(ConfigIssue(f"{path}.cache_dir", f"{cache[0]}; choose a directory"))
    return LocalSettings(**kw, task=TaskConfig(**task_kw), warmstart=WarmStartSettings(**ws_kw))


def _json_file_problem(p: str | None, model_config: bool) -> str | None:
    """Why the JSON file ``p`` (model config or tokenizer) cannot be used, or None."""
    if not p:
        return None
    f = Path(p).expanduser()
    if not f.is_file() and model_config:  # the architecture check names it (once)
        return None
    if f.is_dir():  # a HF tokenizer directory: the local backend reads its tokenizer.json
        inside = f / "tokenizer.json"
        hint = f"; use {str(inside)!r}" if inside.is_file() else ", with no tokenizer.json in it"
        return f"{p!r} is a directory, not a tokenizers JSON file{hint}"
    if not f.is_file():
        return f"file {p!r} not found{cwd_hint(f)}"
    if model_config:  # read by the model's architecture check, which reports what is unreadable
        try:
            data = json.loads(f.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        if isinstance(data, dict) and data.get("model_type") not in SUPPORTED_TYPES:
            return (
                f"model_type {data.get('model_type')!r} in {p!r} is not supported by the local "
                f"backend; use one of {', '.join(SUPPORTED_TYPES)}"
            )
        return None
    try:
        data = json.loads(f.read_bytes().decode("utf-8"))
    except OSError as exc:
        return f"cannot read {p!r}: {exc.strerror}"
    except UnicodeDecodeError as exc:
        return f"{p!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})"
    except json.JSONDecodeError as exc:
        return f"{p!r} is not valid JSON: {exc}"
    if not isinstance(data, dict) or "model" not in data:
        return f'{p!r} is not a tokenizers JSON file (no "model" object)'
    return None


def validate_local_config(section: Any, path: str = "jetrl.local") -> list[ConfigIssue]:
    """Every problem of a ``jetrl.local`` section (`SECTION.validate`)."""
    issues: list[ConfigIssue] = []
    _read_local(section, path, issues)
    return issues


def validate_local_run(settings: Settings) -> list[ConfigIssue]:
    """Problems of NeMo-RL keys only the local backend restricts (`SECTION.validate_run`),
    and of an MoE run (`moe_config.moe_run_issues`: router replay, the model's routing)."""
    return optimizer_issues(settings) + moe_run_issues(settings)


def local_model_config(section: Any) -> str:
    """The config.json the local backend builds its model from (``jetrl.local.model_config``,
    else the repo's 2-layer Llama): what `jetrl check` checks the recipe against."""
    raw = _as_dict(section) or {}
    p = raw.get("model_config")
    return str(Path(p).expanduser()) if isinstance(p, str) and p else str(MODEL_CONFIG_JSON)


# ---------------------------------------------------------------------------------------------
# NeMo-RL keys the local backend reads


@dataclass(frozen=True)
class RunSettings:
    """The NeMo-RL keys of a GRPO run, as the local backend uses them (NeMo-RL's defaults)."""

    num_prompts_per_step: int = 8
    """``grpo.num_prompts_per_step``: distinct prompts per step."""
    num_generations_per_prompt: int = 4
    """``grpo.num_generations_per_prompt``: responses per prompt (the GRPO group)."""
    max_num_steps: int = 10
    """``grpo.max_num_steps``: GRPO steps to run."""
    val_period: int = 5
    """``grpo.val_period``: validate every N steps (0: never)."""
    val_at_start: bool = True
    """``grpo.val_at_start``: validate before the first step (logged at step 0)."""
    seed: int = 42
    """``grpo.seed``: seeds model init, warm start, data and sampling."""
    normalize_rewards: bool = True
    """``grpo.normalize_rewards``: divide advantages by the group's std."""
    use_leave_one_out_baseline: bool = True
    """``grpo.use_leave_one_out_baseline``: baseline = mean of the other responses."""
    temperature: float = 1.0
    """``policy.generation.temperature``: sampling temperature (logprobs use logits / T)."""
    max_new_tokens: int | None = None
    """``policy.generation.max_new_tokens``; None: the task's answer length + 4."""
    max_total_sequence_length: int | None = None
    """``policy.max_total_sequence_length``: prompt + response tokens a sequence may hold; the
    local backend refuses a config that would need a cut there (`seq_len`); None: no bound but
    the model's ``max_position_embeddings``."""
    lr: float = 1.0e-4
    """``policy.optimizer.kwargs.lr`` (AdamW on the fp32 master weights)."""
    weight_decay: float = 0.0
    """``policy.optimizer.kwargs.weight_decay``."""
    betas: tuple[float, float] = (0.9, 0.999)
    """``policy.optimizer.kwargs.betas``."""
    eps: float = 1e-8
    """``policy.optimizer.kwargs.eps``."""
    max_grad_norm: float | None = 1.0
    """``policy.max_grad_norm``: gradient clipping (None: off)."""
    train_global_batch_size: int | None = None
    """``policy.train_global_batch_size``: read to say it is not honoured (`global_batch_note`):
    this backend takes one optimizer step per GRPO step, over all its responses."""
    checkpoint_enabled: bool = True
    """``checkpointing.enabled``."""
    checkpoint_dir: str | None = None
    """``checkpointing.checkpoint_dir``; None: ``<log_dir>/checkpoints``."""
    save_period: int = 1
    """``checkpointing.save_period``: checkpoint every N steps (1: lose at most the step in
    flight when killed)."""
    keep_top_k: int | None = 2
    """``checkpointing.keep_top_k``: most recent checkpoints kept (None: all)."""
    log_dir: str = "logs/local"
    """``logger.log_dir``: the run directory (TensorBoard, train_data_step{N}.jsonl, config)."""

    @classmethod
    def from_keys(
        cls, kw: Mapping[str, Any], issues: list[ConfigIssue], settings: Settings
    ) -> RunSettings:
        """From the NeMo-RL keys the door read (`nemo_jetrl.config.run_keys.read_run_keys`, with
        the ``issues`` it found); `ConfigError` listing every problem."""
        issues = [*issues, *optimizer_issues(settings)]
        if issues:
            raise ConfigError(issues)
        return cls(**kw)

    @property
    def batch_size(self) -> int:
        """Responses per step (prompts x generations)."""
        return self.num_prompts_per_step * self.num_generations_per_prompt

    def global_batch_note(self) -> str | None:
        """What a config's ``policy.train_global_batch_size`` below the step's responses would
        do on NeMo-RL and does not do here (None when it says one optimizer step too)."""
        gbs, n = self.train_global_batch_size, self.batch_size
        if gbs is None or gbs == n:
            return None
        here = f"the local backend takes one optimizer step per GRPO step over all {n} responses"
        if gbs > n:  # NeMo-RL's Megatron worker takes n // gbs = 0 optimizer steps
            return (
                f"policy.train_global_batch_size={gbs} exceeds the {n} responses a step makes: "
                f"NeMo-RL would take no optimizer step (it trains on whole global batches); {here}"
            )
        left = f", leaving {n % gbs} responses out" if n % gbs else ""
        return (
            f"policy.train_global_batch_size={gbs} is not honoured: {here} (NeMo-RL takes "
            f"{n // gbs} of {gbs} responses each{left}, the later ones a step behind the "
            "sampling policy)"
        )

    def resolved_checkpoint_dir(self) -> Path:
        return (
            Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.log_dir) / "checkpoints"
        )


def optimizer_issues(settings: Settings) -> list[ConfigIssue]:
    """The local backend trains with AdamW only: any other ``policy.optimizer.name`` is refused."""
    name = settings.optimizer_name
    if name in (None, "torch.optim.AdamW", "adamw", "AdamW"):
        return []
    return [
        ConfigIssue(
            "policy.optimizer.name",
            f"the local backend trains with torch.optim.AdamW, got {name!r}",
            ("torch.optim.AdamW",),
        )
    ]
