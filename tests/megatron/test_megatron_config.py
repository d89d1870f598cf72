"""Recipe -> Megatron TransformerConfig (real megatron-core on CPU) and TE's real recipe class.

TE's recipe module comes from the ``transformer-engine`` meta wheel installed *outside* .venv
(``pip install --no-deps --target .venv-te-recipe transformer-engine==2.20.2``): installed into
.venv it breaks ``import megatron.core`` (TE's package ``__init__`` raises RuntimeError /
FileNotFoundError without its CUDA libraries, which megatron's ``except ImportError`` does not
catch). The TE tests therefore run in a subprocess with that directory on PYTHONPATH and
``NVTE_PROJECT_BUILDING=1`` (which makes TE skip loading its CUDA core library).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from nemo_jetrl.megatron import config as mc
from nemo_jetrl.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]
TE_DIR = Path(os.environ.get("JETRL_TE_RECIPE_DIR", REPO / ".venv-te-recipe"))

JETRL = Recipe.preset("jetrl")
JETRL_FP32 = JETRL.with_(
    train=JETRL.train.with_(pow2_weight_scales=False, pow2_activation_scales=False),
    rollout=JETRL.rollout.with_(pow2_weight_scales=False, pow2_activation_scales=False),
)


def test_fields_for_jetrl_preset():
    s = mc.megatron_fp8_settings(JETRL, num_layers=4)
    assert dict(s.transformer_config) == {
        "fp8": "e4m3",
        "fp8_recipe": "blockwise",
        "fp8_param": False,
        "first_last_layers_bf16": False,
        "num_layers_at_start_in_bf16": 0,
        "num_layers_at_end_in_bf16": 0,
    }
    assert dict(s.env_vars) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}
    assert s.te_recipe == mc.TeBlockScaling("E4M3", True)


def test_fields_fp32_hybrid_bf16_ends_fp8_param():
    r = JETRL_FP32.with_(
        train=JETRL_FP32.train.with_(
            fmt="hybrid", bf16_first_layers=1, bf16_last_layers=2, fp8_param=True
        )
    )
    s = mc.megatron_fp8_settings(r, num_layers=6)
    assert s.transformer_config["fp8"] == "hybrid"
    assert s.transformer_config["first_last_layers_bf16"] is True
    assert s.transformer_config["num_layers_at_start_in_bf16"] == 1
    assert s.transformer_config["num_layers_at_end_in_bf16"] == 2
    assert s.transformer_config["fp8_param"] is True
    assert s.env_vars["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "1"
    assert s.te_recipe.fp8_format == "HYBRID" and s.te_recipe.power_2_scale is False


def test_bf16_recipe_turns_fp8_off():
    s = mc.megatron_fp8_settings(Recipe.preset("bf16"), num_layers=4)
    assert dict(s.transformer_config) == {"fp8": None, "fp8_param": False}
    assert dict(s.env_vars) == {} and s.te_recipe is None


def test_refusals_are_collected():
    r = JETRL.with_(
        train=JETRL.train.with_(
            pow2_activation_scales=False, bf16_first_layers=3, bf16_last_layers=3
        )
    )
    with pytest.raises(mc.MegatronRecipeError) as ei:
        mc.megatron_fp8_settings(r, num_layers=4, pipeline_parallel_size=2)
    msg = str(ei.value)
    assert "one switch (NVTE_FP8_BLOCK_SCALING_FP32_SCALES)" in msg
    assert "jetrl.train_num_first_layers_in_bf16" in msg
    assert "cover all 4 layers" in msg


def test_env_guard_sets_reverts_and_detects_conflict():
    env: dict[str, str] = {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    with mc.ensure_te_scale_env(True, environ=env, modules={}):
        assert env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "0"
    assert env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "1"
    env2: dict[str, str] = {}
    h = mc.ensure_te_scale_env(False, environ=env2, modules={})
    assert env2 == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    h.revert()
    h.revert()  # idempotent
    assert env2 == {}

    # A module shaped like TE's, already "imported" with power-of-two scales.
    q = types.SimpleNamespace(power_2_scale=True, amax_epsilon=0.0)
    fake_te = types.SimpleNamespace(
        Float8BlockScaling=types.SimpleNamespace(
            fp8_quant_fwd_inp=q, fp8_quant_fwd_weight=q, fp8_quant_bwd_grad=q
        )
    )
    mods = {mc.TE_RECIPE_MODULE: fake_te}
    assert mc.te_loaded_scale_rule(mods) is True
    mc.ensure_te_scale_env(True, environ={}, modules=mods).revert()  # consistent: fine
    with pytest.raises(mc.TeScaleEnvConflict, match=r"policy\.megatron_cfg\.env_vars"):
        mc.ensure_te_scale_env(False, environ={}, modules=mods)


@pytest.mark.megatron
def test_real_transformer_config_accepts_fields():
    tc = mc.build_transformer_config(
        JETRL.with_(train=JETRL.train.with_(bf16_first_layers=1, bf16_last_layers=1)),
        num_layers=4,
        hidden_size=512,  # head dim 128: TE's fused-QKV blocks are the rollout's (blocks.py)
        num_attention_heads=4,
        bf16=True,
    )
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert isinstance(tc, TransformerConfig)
    assert (tc.fp8, tc.fp8_recipe, tc.fp8_param) == ("e4m3", "blockwise", False)
    # Megatron's own per-layer decision agrees with the recipe on every layer.
    r = JETRL.with_(train=JETRL.train.with_(bf16_first_layers=1, bf16_last_layers=1))
    assert (
        [is_first_last_bf16_layer(tc, i) for i in range(4)]
        == [r.is_bf16_layer(i, 4, "train") for i in range(4)]
        == [True, False, False, True]
    )
    # Every field we set exists on the real dataclass (a renamed field would fail here).
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    s = mc.megatron_fp8_settings(JETRL_FP32, num_layers=4)
    assert set(s.transformer_config) <= names

    with pytest.raises(mc.MegatronRecipeError, match="fp8='hybrid'"):
        mc.build_transformer_config(
            JETRL, num_layers=4, hidden_size=256, num_attention_heads=4, fp8="hybrid"
        )


@pytest.mark.megatron
def test_real_megatron_refuses_bad_counts_the_same_way():
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError, match="num_layers_at_start_in_bf16"):
        TransformerConfig(
            num_layers=2,
            hidden_size=128,
            num_attention_heads=2,
            fp8="e4m3",
            fp8_recipe="blockwise",
            first_last_layers_bf16=True,
            num_layers_at_start_in_bf16=3,
        )
    r = JETRL.with_(train=JETRL.train.with_(bf16_first_layers=3))
    with pytest.raises(mc.MegatronRecipeError):
        mc.megatron_fp8_settings(r, num_layers=2)


_TE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from nemo_jetrl.megatron import config as mc
    from nemo_jetrl.recipe import Recipe
    pow2 = sys.argv[1] == "pow2"
    r = Recipe.preset("jetrl")
    if not pow2:
        r = r.with_(train=r.train.with_(pow2_weight_scales=False, pow2_activation_scales=False))
    te = mc.build_te_recipe(r)           # sets the env var, then imports TE's recipe module
    import transformer_engine.common.recipe as ter
    out = {
        "cls_file": ter.__file__,
        "env": os.environ[mc.FP32_SCALES_ENV],
        "p2": [getattr(te, n).power_2_scale for n in mc.TE_QPARAMS],
        "dims": [te.x_block_scaling_dim, te.w_block_scaling_dim, te.grad_block_scaling_dim],
        "fmt": te.fp8_format.name,
    }
    try:                                  # the other rule must now be refused
        mc.ensure_te_scale_env(not pow2)
        out["conflict"] = None
    except mc.TeScaleEnvConflict as exc:
        out["conflict"] = str(exc)
    print(json.dumps(out))
    """
)


def _te_recipe_dir() -> Path | None:
    """Where TE's recipe module comes from: None = the real TE installed here (Docker image)."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return None
    marker = TE_DIR / "transformer_engine" / "common" / "recipe" / "__init__.py"
    if not marker.is_file():
        pytest.fail(
            f"TE's recipe module not found under {TE_DIR}: install it with "
            "`.venv/bin/pip install --no-deps --target .venv-te-recipe transformer-engine==2.20.2`"
        )
    return TE_DIR


@pytest.mark.megatron
@pytest.mark.parametrize("mode", ["pow2", "fp32"])
def test_real_te_recipe_class_follows_env_guard(mode, tmp_path):
    import json

    te_dir = _te_recipe_dir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    # A stale opposite value in the parent environment must be overridden by the guard.
    env[mc.FP32_SCALES_ENV] = "1" if mode == "pow2" else "0"
    if te_dir is None:  # real TE (GPU image)
        env["PYTHONPATH"] = str(REPO)
    else:  # the meta wheel's pure-Python recipe module, without TE's CUDA libraries
        env["NVTE_PROJECT_BUILDING"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(te_dir), str(REPO)])
    script = tmp_path / "te_probe.py"
    script.write_text(_TE_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if te_dir is not None:
        assert out["cls_file"].startswith(str(te_dir))
    assert out["p2"] == [mode == "pow2"] * 3
    assert out["env"] == ("0" if mode == "pow2" else "1")
    assert out["dims"] == [1, 2, 1] and out["fmt"] == "E4M3"
    assert out["conflict"] is not None and "already imported" in out["conflict"]


def test_a_te_backward_override_is_named_as_a_recipe_difference():
    """TE >= 2.15 reads ``NVTE_BACKWARD_OVERRIDE`` into ``Float8BlockScaling.backward_override``
    at import (2.20.2's recipe module here: ``os.getenv("NVTE_BACKWARD_OVERRIDE", None)``); a stray
    value switches the backward's precision silently. A stand-in shaped like TE's object."""
    want = mc.te_block_scaling(JETRL)
    q = types.SimpleNamespace(power_2_scale=want.power_2_scale, amax_epsilon=want.amax_epsilon)
    obj = types.SimpleNamespace(
        fp8_format=types.SimpleNamespace(name=want.fp8_format), fp8_quant_fwd_inp=q,
        fp8_quant_fwd_weight=q, fp8_quant_bwd_grad=q, x_block_scaling_dim=want.x_block_scaling_dim,
        w_block_scaling_dim=want.w_block_scaling_dim,
        grad_block_scaling_dim=want.grad_block_scaling_dim, backward_override=None,
    )  # fmt: skip
    mc.check_te_recipe(obj, want)  # as the recipe says: fine
    obj.backward_override = "dequantized"
    with pytest.raises(mc.MegatronRecipeError, match=r"backward_override='dequantized'.*NVTE_BACK"):
        mc.check_te_recipe(obj, want)


def test_a_built_model_with_other_bf16_edge_layers_is_named():
    from types import SimpleNamespace

    from nemo_jetrl.megatron.config import built_bf16_edges_problem

    train = Recipe.preset("jetrl").train
    nemotron_h = SimpleNamespace(
        fp8="e4m3",
        first_last_layers_bf16=True,
        num_layers_at_start_in_bf16=1,
        num_layers_at_end_in_bf16=1,
    )
    why = built_bf16_edges_problem(nemotron_h, train)
    assert why is not None and why.startswith("the model was built with 1 first and 1 last")
    assert "fp8_cfg.enabled=false" in why
    # the recipe's own edges, a BF16 build, a BF16 recipe: nothing to say
    same = train.with_(bf16_first_layers=1, bf16_last_layers=1)
    assert built_bf16_edges_problem(nemotron_h, same) is None
    assert built_bf16_edges_problem(SimpleNamespace(fp8=None), train) is None
    bf16 = Recipe.preset("bf16").train
    assert built_bf16_edges_problem(nemotron_h, bf16) is None
    # the flag off: its counts (Megatron's defaults of 1) do not apply
    off = SimpleNamespace(**{**vars(nemotron_h), "first_last_layers_bf16": False})
    assert built_bf16_edges_problem(off, train) is None
