"""The typed schema layer (`nemo_jetrl.config.typed`): strict types, our wording, key paths."""

from __future__ import annotations

import pytest

from nemo_jetrl.config.jetrl_model import JetrlSection, default_of
from nemo_jetrl.config.nemo_rl_model import RunConfig
from nemo_jetrl.config.typed import parse, parse_rest


def _issues(data: dict) -> dict[str, str]:
    return {i.path: i.message for i in parse(RunConfig, data)[1]}


@pytest.mark.parametrize(
    ("data", "path", "message"),
    [
        ({"grpo": {"val_at_start": "false"}}, "grpo.val_at_start", "got 'false'; expected true"),
        ({"grpo": {"seed": True}}, "grpo.seed", "got True; expected an integer"),
        ({"grpo": {"seed": 1.0}}, "grpo.seed", "got 1.0; expected an integer"),
        (
            {"policy": {"optimizer": {"kwargs": {"lr": "1e-5"}}}},
            "policy.optimizer.kwargs.lr",
            "got '1e-5'; expected a finite number > 0",
        ),
        (
            {"loss_fn": {"reference_policy_kl_penalty": float("nan")}},
            "loss_fn.reference_policy_kl_penalty",
            "got nan; expected a finite number",
        ),
        ({"jetrl": {"onpolicy_kv": 1}}, "jetrl.onpolicy_kv", "got 1; expected true or false"),
    ],
)
def test_strict_types_and_finite_numbers(data, path, message):
    found = _issues(data)
    assert path in found and found[path].startswith(message), found


def test_every_error_is_reported_together_with_its_path():
    found = _issues(
        {
            "grpo": {"seed": -1, "num_prompts_per_step": "8"},
            "policy": {"generation": {"vllm_cfg": {"precision": "fp4"}}},
            "jetrl": {"kv_calibration": {"margin": 0.5}},
        }
    )
    assert set(found) == {
        "grpo.seed",
        "grpo.num_prompts_per_step",
        "policy.generation.vllm_cfg.precision",
        "jetrl.kv_calibration.margin",
    }


def test_unknown_keys_pass_in_nemo_rl_sections_and_fail_in_ours():
    assert _issues({"policy": {"brand_new_key": [1]}, "grpo": {"x": "y"}, "foo": 3}) == {}
    found = _issues({"jetrl": {"refit_hok": True, "model_confg": "a.json"}})
    assert found["jetrl.refit_hok"] == "unknown key; did you mean jetrl.refit_hook?"
    # model_config is spelled by its alias in messages (pydantic reserves the field name)
    assert found["jetrl.model_confg"] == "unknown key; did you mean jetrl.model_config?"
    assert parse(JetrlSection, {"model_config": "a.json"})[0] is not None
    assert default_of("jetrl.refit_hook") is True and default_of("jetrl.kv_calibration.mask")


def test_absent_is_allowed_null_section_is_not_where_nemo_rl_requires_a_mapping():
    assert _issues({"grpo": {}}) == {}
    assert (
        _issues({"cluster": None})["cluster"] == "got None; expected a mapping (a section of keys)"
    )
    assert _issues({"jetrl": None, "policy": {"generation": None}}) == {}


def test_parse_rest_keeps_the_well_typed_keys():
    model, issues = parse_rest(JetrlSection, {"vllm_patch": "yes", "onpolicy_kv": True})
    assert [i.path for i in issues] == ["vllm_patch"]
    assert (
        model is not None
        and model.onpolicy_kv is True
        and "vllm_patch" not in model.model_fields_set
    )


@pytest.mark.parametrize(
    ("data", "path", "expected"),
    [
        (
            {"loss_fn": {"ratio_clip_c": 1}},
            "loss_fn.ratio_clip_c",
            "a finite number > 1 (usually 3), or null to disable dual clipping",
        ),
        ({"policy": {"max_grad_norm": -1}}, "policy.max_grad_norm", "a finite number > 0, or null"),
        ({"loss_fn": {"kl_input_clamp_value": 0}}, "loss_fn.kl_input_clamp_value", "> 0, or null"),
    ],
)
def test_a_nullable_key_says_or_null_once(data, path, expected):
    """A rule whose words already say what null means got ", or null" appended again
    ("..., or null to disable dual clipping, or null"; docs audit, session 38)."""
    message = _issues(data)[path]
    assert message.endswith(expected) and message.count("null") == 1, message
