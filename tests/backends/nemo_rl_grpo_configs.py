"""Every GRPO config of a NeMo-RL tree, read by NeMo-RL's own loader, and what its verdict must be.

`grpo_configs(tree)` walks every YAML under the tree's ``examples/`` (recipes included) and keeps
those whose config, as NeMo-RL's loader resolves it (``defaults:`` inheritance, its resolvers),
has a ``grpo`` and a ``policy`` section. `classify` decides from that resolved dict alone, with
none of nemo_jetrl's code, what a true verdict is: the precision class of each side, whether
weights lag (async GRPO: legacy, or main's single controller by its sampler), and whether the
model is mixture-of-experts or hybrid (refused by name today when FP8). ``${oc.env:...}``
data/venv paths get placeholders when unset.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ENV_PLACEHOLDERS = {"HF_HOME": "/tmp/hf_home", "PERSISTENT_CACHE": "/tmp/persistent_cache"}

# Mixture-of-experts families among NeMo-RL's configs: "<N>B-A<M>B" names (Qwen3-30B-A3B,
# Qwen3-235B-A22B, Moonlight-16B-A3B, Nemotron 30B-A3B), DeepSeek-V3, MiniMax, gpt-oss, Mixtral.
MOE_NAME = re.compile(r"\d+(\.\d+)?b-a\d+(\.\d+)?b|deepseek-v3|minimax|gpt-oss|mixtral", re.I)
# Hybrid linear/full-attention models with a vision tower.
HYBRID_NAME = re.compile(r"qwen3\.5", re.I)
# Nemotron-H models (Mamba layers): Nemotron 3 (Nano, Super, Omni) and 3.5, Nemotron Nano v2.
STATE_SPACE_NAME = re.compile(r"nemotron-3|nemotron-nano-\d+b-v2", re.I)


def set_env_placeholders(monkeypatch) -> None:
    for key, value in ENV_PLACEHOLDERS.items():
        if key not in os.environ:
            monkeypatch.setenv(key, value)


def raw_declares_grpo(path: Path) -> bool:
    """The file itself (raw YAML) has a top-level ``grpo:`` section."""
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return False
    return isinstance(doc, dict) and "grpo" in doc


# One walk per tree and process: three modules of the tier read every config (~1 min per walk on
# 2 cores). The resolved dicts depend only on the files and the two ``oc.env`` variables the
# trees use (ENV_PLACEHOLDERS' keys), which key the cache; callers get their own deep copies.
_WALKS: dict[tuple, tuple[list[tuple[Path, dict]], list[Path]]] = {}


def grpo_configs(tree: Path) -> tuple[list[tuple[Path, dict]], list[Path]]:
    """((path, resolved dict) of every GRPO config, YAML files NeMo-RL's loader cannot read).

    A file the loader cannot read must not declare ``grpo:`` itself (asserted by callers)."""
    from nemo_rl_upstream import nemo_rl_load

    key = (str(Path(tree).resolve()), *(os.environ.get(k) for k in ENV_PLACEHOLDERS))
    if key not in _WALKS:
        found, unreadable = [], []
        for path in sorted((tree / "examples").rglob("*.yaml")):
            try:
                cfg = nemo_rl_load(path)
            except Exception:
                unreadable.append(path)
                continue
            if isinstance(cfg.get("grpo"), dict) and isinstance(cfg.get("policy"), dict):
                found.append((path, cfg))
        _WALKS[key] = (found, unreadable)
    found, unreadable = _WALKS[key]
    return copy.deepcopy(found), list(unreadable)


@dataclass(frozen=True)
class Expected:
    """What a true verdict says about one config."""

    precision: str
    """"bf16", "fp8_rollout_bf16_train", "fp8_both", "fp8_train_bf16_rollout", "mxfp8_rollout"
    or "modelopt" (NVFP4 quantization-aware RL keys set)."""

    lag: int | None
    """max_trajectory_age_steps when async GRPO is on; on main's single-controller path
    (``grpo.async_grpo: null``) the sampler's window when > 0; else None."""

    moe: bool
    """Mixture-of-experts model with FP8 on some side (refused by name today)."""

    hybrid: bool
    """Hybrid (Qwen3.5) model with FP8 on some side."""

    quant_keys: tuple[str, ...] = ()

    lag_key: str | None = None
    """The single-controller sampler's window key (``async_rl.sampler.*``), None for the legacy
    ``grpo.async_grpo`` lag."""

    state_space: bool = False
    """A model with Mamba layers (Nemotron-H) with FP8 on some side: refused as such by name."""

    @property
    def fp8(self) -> bool:
        return self.precision not in ("bf16", "modelopt")

    @property
    def may_be_on_policy(self) -> bool:
        """BF16 on both sides with no lag: the only class NeMo-RL ships that is on-policy.

        An FP8 rollout as shipped runs vLLM's own quantizer (``x / RN(amax/448)``), never TE's
        (``x * RN(448/amax)``): no shipped config sets ``jetrl.vllm_patch``."""
        return self.precision == "bf16" and self.lag is None


def classify(cfg: dict) -> Expected:
    pol = cfg["policy"]
    gen = pol.get("generation") or {}
    vllm = gen.get("vllm_cfg") or {}
    meg = pol.get("megatron_cfg") or {}
    quant = tuple(
        k
        for k, v in (
            ("policy.quant_cfg", pol.get("quant_cfg")),
            ("policy.generation.quant_cfg", gen.get("quant_cfg")),
        )
        if v
    )
    roll = vllm.get("precision") == "fp8"
    kv = str(vllm.get("kv_cache_dtype") or "auto").startswith("fp8")
    train = bool(meg.get("enabled")) and (meg.get("fp8_cfg") or {}).get("enabled") is True
    if quant:
        precision = "modelopt"
    elif roll and vllm.get("is_mx") is True:
        precision = "mxfp8_rollout"
    elif roll and train:
        precision = "fp8_both"
    elif roll or kv:
        precision = "fp8_rollout_bf16_train"
    elif train:
        precision = "fp8_train_bf16_rollout"
    else:
        precision = "bf16"
    grpo = cfg.get("grpo") or {}
    async_cfg = grpo.get("async_grpo") or {}
    lag, lag_key = None, None
    if "async_grpo" in grpo and grpo["async_grpo"] is None:
        # main's single controller (run_grpo_single_controller.py): the lag is the sampler's
        # window (staleness_sampler.py; AsyncRLConfig's default sampler is in_order, every
        # window defaults to 1, and 0 is its is_on_policy case)
        sampler = (cfg.get("async_rl") or {}).get("sampler") or {}
        name = sampler.get("name", "in_order")
        assert name != "custom", "a custom sampler's lag is its own code's: classify it by hand"
        window = "max_lookahead_versions" if name == "in_order" else "max_staleness_versions"
        if sampler.get(window, 1):
            lag, lag_key = int(sampler.get(window, 1)), f"async_rl.sampler.{window}"
    elif async_cfg.get("enabled") is True:
        age = async_cfg.get("max_trajectory_age_steps")
        lag = 1 if age is None else int(age)
    name = str(pol.get("model_name") or "")
    fp8 = roll or kv or train
    experts = any(
        isinstance(meg.get(k), int) and meg.get(k) > 1
        for k in ("expert_model_parallel_size", "num_moe_experts")
    )
    return Expected(
        precision,
        lag,
        fp8 and bool(MOE_NAME.search(name) or experts) and not HYBRID_NAME.search(name),
        fp8 and bool(HYBRID_NAME.search(name)),
        quant,
        lag_key,
        fp8 and bool(STATE_SPACE_NAME.search(name)),
    )
