"""Dense Qwen3 on the local backend: the family of NeMo-RL's Qwen3 configs, whose attention
normalises each head's queries and keys (``self_attn.q_norm`` / ``k_norm``, RMSNorm over the head
dimension) before RoPE: two more norms a layer that must be batch-invariant too.

A tiny Qwen3 (the shipped 2-layer config with ``model_type`` qwen3) runs 2 GRPO steps per recipe:
every q/k norm of both the rollout and the trainer model is swapped for the invariant one, and
``jetrl`` / ``jetrl_kv`` are exactly on-policy on every step (tmpe exactly 1, gen_kl exactly 0),
against ``fp8_rollout`` in the same test, above 1 on every step (the measurement can see a
difference).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from local_configs import tiny_cfg

from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local
from nemo_jetrl.backends.local.model import MODEL_CONFIG_JSON
from nemo_jetrl.invariant.hf import InvariantRMSNorm


@pytest.fixture(scope="module")
def qwen3_json(tmp_path_factory) -> Path:
    data = json.loads(MODEL_CONFIG_JSON.read_text())
    data |= {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    path = tmp_path_factory.mktemp("qwen3") / "qwen3_tiny.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jetrl_qwen3_cache")


def _run(recipe: str, tmp_path: Path, cache_dir: Path, model: Path) -> tuple[list[dict], dict]:
    seen: dict = {}
    cfg = tiny_cfg(recipe, tmp_path / recipe, cache_dir, f"jetrl.local.model_config={model}")
    res = run_local(
        resolve_run(cfg), progress=False, log=print,
        hooks=Hooks(on_run=lambda run: seen.setdefault("run", run)),
    )  # fmt: skip
    return res.history, seen


@pytest.mark.parametrize("recipe", ["jetrl", "jetrl_kv"])
def test_tiny_qwen3_runs_exactly_on_policy_with_invariant_qk_norms(
    recipe, tmp_path, cache_dir, qwen3_json
):
    history, seen = _run(recipe, tmp_path, cache_dir, qwen3_json)
    run = seen["run"]
    for model in (run.trainer.model, run.rollout_model):
        assert type(model).__name__ == "Qwen3ForCausalLM"
        norms = [m for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm"))]
        assert len(norms) == 4 and all(isinstance(m, InvariantRMSNorm) for m in norms), norms
    assert len(history) == 2
    for h in history:
        assert h["train/token_mult_prob_error"] == 1.0 and h["train/gen_kl_error"] == 0.0, h


def test_tiny_qwen3_fp8_rollout_is_off_policy_on_every_step(tmp_path, cache_dir, qwen3_json):
    history, _ = _run("fp8_rollout", tmp_path, cache_dir, qwen3_json)
    assert len(history) == 2
    assert all(h["train/token_mult_prob_error"] > 1.0 for h in history), history
