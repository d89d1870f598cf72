"""MoE runs on the local backend (issue 27): the shipped tiny Qwen3-MoE example (layer 0 dense,
layer 1 with 4 experts, top-2) under all four recipes, Mixtral with routing replay, a planted
router divergence, resume, the CLI, and the refusals (exit 2 naming the key). The blocks, the
routing metric's definition and the bytes: test_local_moe.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from local_configs import REPO, TINY_OVERRIDES

from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local
from nemo_jetrl.backends.local.routing import ROUTING_MISMATCH

RECIPES = ("bf16", "fp8_rollout", "jetrl", "jetrl_kv")
MOE_EXAMPLE = REPO / "examples" / "configs" / "local" / "moe"
QWEN3_MOE_JSON = MOE_EXAMPLE / "qwen3_moe_tiny.json"
ROUTER = "model.layers.1.mlp.gate.weight"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jetrl_moe_cache")


# ------------------------------------------------------------------------------------ runs


def _moe_run(recipe: str, tmp_path: Path, cache_dir: Path, *extra: str, hooks=None):
    """The shipped MoE example of ``recipe`` at test sizes (model path made absolute)."""
    from nemo_jetrl.config import load_config

    cfg = load_config(
        MOE_EXAMPLE / f"{recipe}.yaml",
        [
            *TINY_OVERRIDES,
            f"jetrl.local.model_config={QWEN3_MOE_JSON}",
            f"jetrl.local.cache_dir={cache_dir}",
            f"logger.log_dir={tmp_path / 'run'}",
            *extra,
        ],
    )
    return run_local(resolve_run(cfg), progress=False, log=print, hooks=hooks)


def test_moe_examples_ship_for_every_recipe():
    from nemo_jetrl.config import load_config

    for recipe in RECIPES:
        cfg = load_config(MOE_EXAMPLE / f"{recipe}.yaml")
        assert cfg.jetrl.recipe == recipe
        assert (REPO / cfg.jetrl.local.model_config).resolve() == QWEN3_MOE_JSON.resolve()
        assert cfg.policy.router_replay.enabled is False
    assert json.loads(QWEN3_MOE_JSON.read_text())["mlp_only_layers"] == [0]


@pytest.mark.parametrize("recipe", RECIPES)
def test_tiny_moe_trains_under_every_recipe(recipe, tmp_path, cache_dir):
    res = _moe_run(recipe, tmp_path, cache_dir)
    assert res.recipe == recipe and len(res.history) == 2
    for h in res.history:
        assert 0.0 <= h[ROUTING_MISMATCH] <= 1.0, h
        assert math.isfinite(h["train/loss"]) and h["jetrl/local/update_refused"] == 0.0
        tmpe = h["train/token_mult_prob_error"]
        if recipe in ("jetrl", "jetrl_kv"):  # FP8 both sides, same quantizer, invariant ops
            assert tmpe == 1.0 and h["train/gen_kl_error"] == 0.0
            assert h[ROUTING_MISMATCH] == 0.0
        elif recipe == "fp8_rollout":  # vLLM's quantizer in the rollout only
            assert tmpe > 1.0
    from nemo_jetrl.runs.logs import read_scalars

    scalars, _ = read_scalars(tmp_path / "run")
    assert [int(s) for s in scalars[ROUTING_MISMATCH].steps] == [1, 2]


def test_mixtral_and_replay_run_exactly_on_policy(tmp_path, cache_dir):
    mixtral = tmp_path / "mixtral.json"
    data = json.loads(QWEN3_MOE_JSON.read_text())
    for k in ("moe_intermediate_size", "num_experts", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers"):  # fmt: skip
        data.pop(k)
    data |= {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
             "intermediate_size": 128, "num_local_experts": 4}  # fmt: skip
    mixtral.write_text(json.dumps(data))
    res = _moe_run(
        "jetrl", tmp_path, cache_dir, f"jetrl.local.model_config={mixtral}",
        "policy.router_replay.enabled=true",
    )  # fmt: skip
    for h in res.history:
        assert h["train/token_mult_prob_error"] == 1.0 and h[ROUTING_MISMATCH] == 0.0


def test_planted_router_divergence_is_measured_every_step_with_and_without_replay(
    tmp_path, cache_dir
):
    def skew_router(_step, weights):  # the rollout gets a different router than the trainer
        g = torch.Generator().manual_seed(0)
        w = weights[ROUTER]
        weights[ROUTER] = w + torch.randn(w.shape, generator=g).to(w.dtype) * 0.05
        return weights

    for replay in ("false", "true"):
        res = _moe_run(
            "jetrl", tmp_path / replay, cache_dir, f"policy.router_replay.enabled={replay}",
            hooks=Hooks(before_refit=skew_router),
        )  # fmt: skip
        for h in res.history:
            assert 0.0 < h[ROUTING_MISMATCH] <= 1.0, (replay, h[ROUTING_MISMATCH])
            assert h["train/token_mult_prob_error"] > 1.0  # the router itself differs


def test_moe_resume_with_replay_reproduces_the_uninterrupted_run(tmp_path, cache_dir):
    """Routing is per step (recorded, replayed, compared, dropped): nothing of it needs a
    checkpoint, and a resumed replay run repeats the uninterrupted one exactly."""
    replay = ("policy.router_replay.enabled=true", "grpo.val_period=2")
    full = _moe_run("fp8_rollout", tmp_path / "full", cache_dir, "grpo.max_num_steps=3", *replay)
    _moe_run("fp8_rollout", tmp_path / "part", cache_dir, "grpo.max_num_steps=2", *replay)
    from nemo_jetrl.config import load_config

    cfg = load_config(
        MOE_EXAMPLE / "fp8_rollout.yaml",
        [*TINY_OVERRIDES, f"jetrl.local.model_config={QWEN3_MOE_JSON}",
         f"jetrl.local.cache_dir={cache_dir}", f"logger.log_dir={tmp_path / 'part' / 'run'}",
         "grpo.max_num_steps=3", *replay],
    )  # fmt: skip
    second = run_local(resolve_run(cfg), resume=True, progress=False, log=print)
    assert second.first_step == 2 and second.last_step == 3
    keep = ("train/", "jetrl/moe/")
    a = {k: v for k, v in full.history[2].items() if k.startswith(keep)}
    b = {k: v for k, v in second.history[0].items() if k.startswith(keep)}
    assert a == b and ROUTING_MISMATCH in a


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_example_trains_from_the_cli(recipe, cli, tmp_path, cache_dir):
    """As a user runs it: `jetrl train` on the shipped MoE example of every recipe (FP8 ones
    included: the experts run our experts computation on both sides of the local backend)."""
    from nemo_jetrl.runs.logs import read_scalars

    code, out = cli(
        "train", "--no-progress", MOE_EXAMPLE / f"{recipe}.yaml", *TINY_OVERRIDES,
        f"jetrl.local.model_config={QWEN3_MOE_JSON}", f"jetrl.local.cache_dir={cache_dir}",
        f"logger.log_dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert code == 0, out
    scalars, _ = read_scalars(tmp_path / "run")
    assert [int(s) for s in scalars[ROUTING_MISMATCH].steps] == [1, 2]
    tmpe = scalars["train/token_mult_prob_error"].values
    if recipe.startswith("jetrl"):
        assert list(tmpe) == [1.0, 1.0]  # exactly on-policy, experts included
    elif recipe == "fp8_rollout":
        assert all(v > 1.0 for v in tmpe)


# ---------------------------------------------------------------------------------- config


def _refused(cli, tmp_path, *overrides: str) -> str:
    code, out = cli(
        "train", str(MOE_EXAMPLE / "jetrl.yaml"), *TINY_OVERRIDES,
        f"logger.log_dir={tmp_path / 'run'}", *overrides,
    )  # fmt: skip
    assert code == 2, out
    assert not (tmp_path / "run").exists()  # refused before any work
    return out


def test_bad_moe_combinations_exit_2_naming_the_key(cli, tmp_path):
    dense = REPO / "nemo_jetrl" / "backends" / "local" / "assets" / "model_config.json"
    out = _refused(cli, tmp_path, f"jetrl.local.model_config={dense}",
                   "policy.router_replay.enabled=true")  # fmt: skip
    assert "policy.router_replay.enabled" in out and "no experts" in out
    out = _refused(cli, tmp_path, f"jetrl.local.model_config={QWEN3_MOE_JSON}",
                   "policy.router_replay.enabled=yes")  # fmt: skip
    assert "policy.router_replay.enabled" in out and "true or false" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(json.loads(QWEN3_MOE_JSON.read_text()) | {"num_experts_per_tok": 5}))
    out = _refused(cli, tmp_path, f"jetrl.local.model_config={bad}")
    assert "jetrl.local.model_config" in out and "num_experts_per_tok=5" in out
    aux = tmp_path / "aux.json"
    aux.write_text(
        json.dumps(json.loads(QWEN3_MOE_JSON.read_text()) | {"output_router_logits": True})
    )
    out = _refused(cli, tmp_path, f"jetrl.local.model_config={aux}")
    assert "output_router_logits=true" in out
