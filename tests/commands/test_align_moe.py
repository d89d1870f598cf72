"""`jetrl align` on mixture-of-experts configs (issue 28): the keys it adds for routing replay and
dropless routing, and that it writes the file whatever the check then says. NeMo-RL's own code
reads the result in tests/backends/test_nemo_rl_align_moe.py (NeMo-RL tier)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nemo_jetrl.commands._align_moe import moe_align_updates as _updates
from nemo_jetrl.config import settings_of

MOE = {"model_name": "Qwen/Qwen3-30B-A3B", "generation": {"backend": "vllm"}}


def _cfg(megatron: dict | None = None, **top) -> OmegaConf:
    pol = dict(MOE, megatron_cfg={"enabled": True, **(megatron or {})})
    return OmegaConf.create({"policy": pol, **top})


def moe_align_updates(cfg):
    return _updates(settings_of(cfg))  # align passes the source's typed settings


def test_replay_router_dtype_and_dropless_keys():
    got, notes = moe_align_updates(_cfg())
    assert (
        got
        == {
            "policy.router_replay.enabled": True,
            "policy.megatron_cfg.moe_router_dtype": "fp32",
        }
        and notes == []
    )
    got, _ = moe_align_updates(
        _cfg(
            {
                "moe_router_dtype": "fp64",
                "virtual_pipeline_model_parallel_size": 2,
                "moe_expert_capacity_factor": 1.25,
                "moe_pad_expert_input_to_capacity": True,
            },
            grpo={"async_grpo": {"enabled": True}},
            data_plane={"enabled": True},
        )
    )
    assert got == {
        "policy.router_replay.enabled": True,
        "policy.megatron_cfg.virtual_pipeline_model_parallel_size": None,
        "data_plane.enabled": False,
        "policy.megatron_cfg.moe_expert_capacity_factor": None,
        "policy.megatron_cfg.moe_pad_expert_input_to_capacity": False,
    }  # fp64 router kept


def test_no_megatron_policy_is_said_not_replayed_and_dense_gets_nothing():
    cfg = OmegaConf.create({"policy": dict(MOE, megatron_cfg={"enabled": False})})
    got, notes = moe_align_updates(cfg)
    assert got == {} and "routing is not replayed" in notes[0]
    dense = OmegaConf.create({"policy": {"model_name": "Qwen/Qwen3-8B-Base"}})
    assert moe_align_updates(dense) == ({}, [])


@pytest.mark.parametrize("recipe", ["jetrl", "bf16"])
def test_align_writes_an_moe_file_with_replay_and_reports_the_check(cli, tmp_path, recipe):
    src = tmp_path / "moe.yaml"
    src.write_text(
        OmegaConf.to_yaml(
            {
                "policy": {
                    "model_name": "Qwen/Qwen3-30B-A3B",
                    "generation": {"backend": "vllm", "vllm_cfg": {"precision": "fp8"}},
                    "megatron_cfg": {
                        "enabled": True,
                        "moe_router_dtype": None,
                        "fp8_cfg": {"enabled": True, "fp8": "e4m3", "fp8_recipe": "blockwise"},
                    },
                }
            }
        )
    )
    out = tmp_path / "aligned.yaml"
    code, text = cli("align", str(src), "--recipe", recipe, "-o", str(out))
    assert out.is_file(), text  # written before the check, whatever it says
    cfg = OmegaConf.load(out)
    assert cfg.policy.router_replay.enabled is True
    assert cfg.policy.megatron_cfg.moe_router_dtype == "fp32"
    assert "policy.router_replay: '<unset>' -> {'enabled': True}" in text
    if code == 2:  # FP8 experts: the check's refusal, by name
        assert recipe == "jetrl" and "mixture-of-experts" in text
    else:
        assert code in (0, 1)


def test_qwen3_moe_router_kept_bf16_where_vllm_would_quantize_it(cli, tmp_path):
    """vLLM builds Qwen3-MoE's router with the model's quant_config (NeMo-RL's init_fp8 does not
    list it): align adds ``mlp.gate`` to both per-name lists; models whose vLLM router is
    unquantized, or with dense layers the word would also match, get no word."""
    from types import SimpleNamespace

    from nemo_jetrl.commands._align_moe import router_bf16_words
    from nemo_jetrl.recipe import Recipe

    src = tmp_path / "q3.yaml"
    src.write_text(
        OmegaConf.to_yaml(
            {
                "policy": {
                    "model_name": "Qwen/Qwen3-30B-A3B",
                    "generation": {"backend": "vllm", "vllm_cfg": {"precision": "fp8"}},
                    "megatron_cfg": {"enabled": True},
                }
            }
        )
    )
    out = tmp_path / "aligned.yaml"
    cli("align", str(src), "--recipe", "jetrl", "-o", str(out))
    cfg = OmegaConf.load(out)
    assert list(cfg.policy.generation.vllm_cfg.quantization_ignored_layer_kws) == ["mlp.gate"]
    assert list(cfg.jetrl.train_bf16_layer_kws) == ["mlp.gate"]
    jetrl = Recipe.preset("jetrl")
    moe = SimpleNamespace(moe_layers=(0, 1))
    q3 = SimpleNamespace(name="q3", model_type="qwen3_moe", num_layers=2, moe=moe)
    assert router_bf16_words(q3, jetrl, ()) == (("mlp.gate",), [])
    assert router_bf16_words(q3, jetrl, ("mlp.gate",)) == ((), [])
    assert router_bf16_words(q3, Recipe.preset("bf16"), ()) == ((), [])
    ds = SimpleNamespace(name="ds", model_type="deepseek_v3", num_layers=2, moe=moe)
    assert router_bf16_words(ds, jetrl, ()) == ((), [])
    dense_first = SimpleNamespace(name="q3d", model_type="qwen3_moe", num_layers=3, moe=moe)
    words, notes = router_bf16_words(dense_first, jetrl, ())
    assert words == () and "model.layers.N.mlp.gate" in notes[0]
