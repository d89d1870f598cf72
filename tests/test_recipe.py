"""Recipe, SideRecipe, KvCalibration: invariants, presets, layer rules, alignment."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest

from nemo_jetrl import recipe as recipe_mod
from nemo_jetrl.recipe import PRESET_NAMES, PRESETS, KvCalibration, Recipe, SideRecipe


def test_presets_are_the_four_named_ones():
    assert tuple(PRESETS) == PRESET_NAMES == ("bf16", "fp8_rollout", "jetrl", "jetrl_kv")
    for name in PRESET_NAMES:
        assert Recipe.preset(name).name == name


def test_preset_contents():
    bf16 = Recipe.preset("bf16")
    assert not bf16.any_fp8
    fr = Recipe.preset("fp8_rollout")
    assert not fr.train.fp8_linears and fr.rollout.fp8_linears
    assert fr.rollout.quantizer == "vllm"
    assert fr.rollout.scale_mode("weight") == fr.rollout.scale_mode("activation") == "fp32"
    j = Recipe.preset("jetrl")
    assert j.train.fp8_linears and j.rollout.fp8_linears
    assert j.train.pow2_scales and j.rollout.pow2_scales
    assert j.train.quantizer == "te" and j.rollout.quantizer == "jetrl"
    assert j.train.formula == j.rollout.formula == "te"
    assert not j.kv_fp8
    kv = Recipe.preset("jetrl_kv")
    assert kv.kv_fp8 and kv.onpolicy_kv and kv.kv_scale_source == "trainer_calibrated"
    assert kv.train == j.train and kv.rollout == j.rollout


def test_unknown_preset_names_the_allowed_ones():
    with pytest.raises(ValueError, match="jetrl_kv"):
        Recipe.preset("jet")


def test_recipes_are_frozen():
    r = Recipe.preset("jetrl")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.train.fp8_linears = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"fmt": "e5m2"}, "fmt='e5m2'"),
        ({"scaling": "per_row"}, "scaling='per_row'"),
        ({"quantizer": "torchao"}, "quantizer='torchao'"),
        ({"bf16_first_layers": -1}, "bf16_first_layers=-1"),
        ({"bf16_last_layers": True}, "bf16_last_layers=True"),
    ],
)
def test_side_recipe_rejects_bad_fields(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        SideRecipe(**kwargs)


def test_side_recipe_reports_all_bad_fields_at_once():
    with pytest.raises(ValueError) as exc:
        SideRecipe(fmt="x", quantizer="y", bf16_first_layers=-2)
    msg = str(exc.value)
    assert "fmt='x'" in msg and "quantizer='y'" in msg and "bf16_first_layers=-2" in msg


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kv_cache_dtype": "fp8"}, "needs a kv_scale_source"),
        ({"kv_scale_source": "dynamic"}, "must be 'none'"),
        ({"onpolicy_kv": True}, "onpolicy_kv=True needs"),
        ({"train": SideRecipe(quantizer="vllm")}, "train.quantizer='vllm'"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype='int8'"),
    ],
)
def test_recipe_invariants(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Recipe(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"data_fraction": 0.0}, "data_fraction"),
        ({"percentile": 100.5}, "percentile"),
        ({"margin": 0.9}, "margin"),
        ({"mask": "padding"}, "mask"),
    ],
)
def test_kv_calibration_ranges(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        KvCalibration(**kwargs)


def test_fp8_layers_respect_first_and_last_bf16():
    s = SideRecipe(fp8_linears=True, bf16_first_layers=2, bf16_last_layers=1)
    assert s.fp8_layers(6) == [2, 3, 4]
    assert not s.is_fp8_layer(0, 6) and s.is_fp8_layer(2, 6) and not s.is_fp8_layer(5, 6)
    assert SideRecipe(fp8_linears=False).fp8_layers(4) == []
    with pytest.raises(ValueError, match="out of range"):
        s.is_fp8_layer(6, 6)
    r = Recipe(train=s, rollout=s.with_(quantizer="jetrl"))
    assert r.rollout_fp8_layers(6) == r.train_fp8_layers(6) == [2, 3, 4]
    assert r.is_bf16_layer(1, 6) and not r.is_bf16_layer(3, 6, side="train")


def test_mixed_scale_modes_are_explicit():
    s = SideRecipe(fp8_linears=True, pow2_weight_scales=True, pow2_activation_scales=False)
    assert s.scale_mode("weight") == "pow2" and s.scale_mode("activation") == "fp32"
    with pytest.raises(ValueError, match="mixes scale modes"):
        _ = s.pow2_scales


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_dict_round_trip(name):
    r = Recipe.preset(name)
    assert Recipe.from_dict(r.to_dict()) == r


def test_aligned_to_training():
    assert Recipe.preset("fp8_rollout").aligned_to_training().name == "bf16"
    off = Recipe.preset("jetrl").with_(
        rollout=SideRecipe(fp8_linears=True, quantizer="vllm", pow2_weight_scales=False)
    )
    assert off.aligned_to_training() == Recipe.preset("jetrl")
    kv_off = Recipe.preset("jetrl_kv").with_(onpolicy_kv=False, kv_scale_source="dynamic")
    assert kv_off.aligned_to_training() == Recipe.preset("jetrl_kv")
    assert kv_off.aligned_to_training(kv="bf16") == Recipe.preset("jetrl")
    # FP32 training scales are kept: the rollout follows training, through the patch.
    fp32 = Recipe.preset("jetrl").with_(
        train=SideRecipe(fp8_linears=True, pow2_weight_scales=False, pow2_activation_scales=False)
    )
    al = fp32.aligned_to_training()
    assert al.rollout.scale_mode("activation") == "fp32" and al.rollout.quantizer == "jetrl"
    with pytest.raises(ValueError, match="only 'blockwise'"):
        Recipe(train=SideRecipe(fp8_linears=True, scaling="tensorwise")).aligned_to_training()


def _documented_classes():
    from nemo_jetrl.arch import Linear, ModelArch
    from nemo_jetrl.commands.check import Checked
    from nemo_jetrl.config import ConfigIssue, ValidConfig
    from nemo_jetrl.flow.check import Edge, FlowCheck, Mismatch, Precision, PrecisionFlow
    from nemo_jetrl.fp8.config import Fp8LinearConfig
    from nemo_jetrl.kvcache.settings import CalibrationSettings
    from nemo_jetrl.megatron.config import MegatronFp8Settings, TeBlockScaling
    from nemo_jetrl.rl.correction import CorrectionConfig
    from nemo_jetrl.rl.loss_config import GRPOLossConfig

    return [
        Fp8LinearConfig,
        CalibrationSettings,
        GRPOLossConfig,
        CorrectionConfig,
        TeBlockScaling,
        MegatronFp8Settings,
        ValidConfig,
        SideRecipe,
        KvCalibration,
        Recipe,
        Linear,
        ModelArch,
        Checked,
        ConfigIssue,
        Edge,
        FlowCheck,
        Mismatch,
        Precision,
        PrecisionFlow,
    ]


@pytest.mark.parametrize("cls", _documented_classes(), ids=lambda c: c.__name__)
def test_every_field_is_documented_in_place(cls):
    """Each dataclass field has its own docstring: a string statement right after it (the style
    of `nemo_jetrl.fp8.config.Fp8LinearConfig`; editors and Sphinx show it with the field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    fields = {f.name for f in dataclasses.fields(cls)}
    seen = set()
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            if name in fields:
                doc = (
                    after.value.value
                    if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    else None
                )
                assert isinstance(doc, str) and doc.strip(), f"{cls.__name__}.{name}: no docstring"
                seen.add(name)
    assert seen == fields


def test_every_jetrl_key_is_documented_in_place():
    """The ``jetrl:`` section's models carry each key's meaning as the field's docstring."""
    from nemo_jetrl.config.jetrl_model import JetrlSection, KvCalibrationSection

    for model in (JetrlSection, KvCalibrationSection):
        for name, fld in model.model_fields.items():
            assert fld.description and fld.description.strip(), f"{model.__name__}.{name}"


def test_recipe_module_does_not_import_torch():
    src = inspect.getsource(recipe_mod)
    assert "import torch" not in src


def test_matching_preset_ignores_what_does_not_change_numbers():
    from nemo_jetrl.recipe import matching_preset, preset_differences

    j = Recipe.preset("jetrl")
    same = j.with_(
        train=j.train.with_(quantizer="jetrl"),  # CPU emulation of TE: same bits
        rollout=j.rollout.with_(use_deep_gemm=True),  # a kernel choice
        kv_calibration=KvCalibration(margin=1.2),  # unused without an FP8 KV cache
    )
    assert matching_preset(same) == "jetrl" and preset_differences(same, j) == []
    # a BF16 side's FP8 details do not matter
    b = Recipe.preset("bf16").with_(rollout=SideRecipe(quantizer="vllm", pow2_weight_scales=False))
    assert matching_preset(b) == "bf16"
    off = j.with_(rollout=j.rollout.with_(pow2_activation_scales=False))
    assert matching_preset(off) is None
    assert preset_differences(off, j) == [
        "rollout.pow2_activation_scales: config False, preset True"
    ]
    assert matching_preset(Recipe.preset("jetrl_kv"), prefer="jetrl") == "jetrl_kv"
