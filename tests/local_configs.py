"""Tiny local-backend configs shared by the local tests (hf and vllm rollout engines)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "configs" / "local"

# 1-operation problems, 2x2 samples per step, 2 steps, a 3-step warm start.
TINY_OVERRIDES = (
    "grpo.max_num_steps=2",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.val_period=1",
    "jetrl.local.task.num_ops=1",
    "jetrl.local.task.val_size=4",
    "jetrl.local.warmstart.steps=3",
    "jetrl.local.warmstart.batch_size=8",
)


def tiny_cfg(recipe: str, log_dir: Path, cache_dir: Path, *extra: str):
    """The shipped local example for ``recipe`` at test sizes, writing under ``log_dir``."""
    from nemo_jetrl.config import load_config

    return load_config(
        EXAMPLES / f"{recipe}.yaml",
        [
            *TINY_OVERRIDES,
            f"jetrl.local.cache_dir={cache_dir}",
            f"logger.log_dir={log_dir}",
            *extra,
        ],
    )


def refused_issues(tmp_path: Path, *extra: str) -> dict[str, str]:
    """``{key: message}`` of the `ConfigError` the local backend's door raises for a tiny jetrl
    run with ``extra`` overrides (it must raise), which made no run directory."""
    import pytest

    from nemo_jetrl.backends.local.loop import resolve_run
    from nemo_jetrl.config import ConfigError

    with pytest.raises(ConfigError) as exc:
        resolve_run(tiny_cfg("jetrl", tmp_path / "run", tmp_path / "cache", *extra))
    assert not (tmp_path / "run").exists()
    return {i.path: i.message for i in exc.value.issues}


def resolve_tiny(tmp_path: Path, *extra: str):
    """The local backend's door on a tiny jetrl run with ``extra`` overrides (`ResolvedRun`)."""
    from nemo_jetrl.backends.local.loop import resolve_run

    return resolve_run(tiny_cfg("jetrl", tmp_path / "run", tmp_path / "cache", *extra))
