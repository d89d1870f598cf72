"""What NeMo-RL's Megatron policy workers learn from our driver through their environment
(``backends/nemo_rl/policy_env.py``): the recipe, ``jetrl.allow_off_policy``, the gated delta
net's HF in_proj split, each set by the translation (``launch.prepare``) and read back as the
worker reads it; the worker class without NeMo-RL. The worker itself, on NeMo-RL's real class:
test_nemo_rl_worker_checks.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nemo_jetrl.backends.nemo_rl import launch as nr
from nemo_jetrl.backends.nemo_rl import policy_env as pe
from nemo_jetrl.backends.nemo_rl import translate as nt
from nemo_jetrl.recipe import Recipe

QWEN = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_8b_base"


def test_allow_off_policy_reaches_the_policy_workers_env():
    """The policy worker stops a built model whose training forward is not the rollout's unless
    the run was launched with jetrl.allow_off_policy, which only the translation can tell it
    (`jetrl check`'s gate lets such a run start; the worker then warns:
    test_nemo_rl_worker_checks.py)."""
    env = nr.prepare(str(QWEN / "jetrl.yaml")).plan.master_config["policy"]["megatron_cfg"]
    assert pe.ALLOW_OFF_POLICY_ENV not in env["env_vars"]
    assert not pe.off_policy_allowed(env["env_vars"])
    p = nr.prepare(str(QWEN / "jetrl.yaml"), ["jetrl.allow_off_policy=true"])
    env = p.plan.master_config["policy"]["megatron_cfg"]["env_vars"]
    assert env[pe.ALLOW_OFF_POLICY_ENV] == "1" and pe.off_policy_allowed(env)
    assert dict(p.plan.workers.policy_env)[pe.ALLOW_OFF_POLICY_ENV] == "1"


def test_the_gated_delta_net_split_reaches_the_policy_workers_env(tmp_path):
    """Megatron's TransformerConfig does not say whether in_proj holds Qwen3.5's or Qwen3-Next's
    HF weights, and where the two differ the worker's block check needs it (tests/megatron/
    test_megatron_blocks_hybrid.py): only the driver, which read the HF config, can tell it."""
    kept = [  # in_proj BF16 on both sides: Qwen3.5 on-policy, so the launch goes on
        f"+{k}=[visual,linear_attn.in_proj]"
        for k in (
            "jetrl.train_bf16_layer_kws",
            "policy.generation.vllm_cfg.quantization_ignored_layer_kws",
        )
    ]
    qwen35 = ["policy.model_name=Qwen/Qwen3.5-9B-Base", *kept]
    env = nr.prepare(str(QWEN / "jetrl.yaml"), qwen35).plan.workers.policy_env
    assert env[pe.HF_IN_PROJ_SPLIT_ENV] == "1" and pe.hf_in_proj_split(env) is True
    next_cfg = tmp_path / "config.json"  # a small Qwen3-Next: in_proj fits at TP 1
    next_cfg.write_text(json.dumps({
        "model_type": "qwen3_next", "hidden_size": 1024, "intermediate_size": 2048,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 128, "vocab_size": 1024, "linear_num_key_heads": 4,
        "linear_num_value_heads": 8, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256, "decoder_sparse_step": 1,
    }))  # fmt: skip
    tp1 = [f"+jetrl.model_config={next_cfg}", "policy.megatron_cfg.tensor_model_parallel_size=1"]
    env = nr.prepare(str(QWEN / "jetrl.yaml"), tp1).plan.workers.policy_env
    assert env[pe.HF_IN_PROJ_SPLIT_ENV] == "0" and pe.hf_in_proj_split(env) is False
    env = nr.prepare(str(QWEN / "jetrl.yaml")).plan.workers.policy_env  # Qwen3-8B: no in_proj
    assert pe.HF_IN_PROJ_SPLIT_ENV not in env and pe.hf_in_proj_split(env) is None
    with pytest.raises(RuntimeError, match="NEMO_JETRL_HF_IN_PROJ_SPLIT='yes' in this worker"):
        pe.hf_in_proj_split({pe.HF_IN_PROJ_SPLIT_ENV: "yes"})


def test_worker_env_check():
    recipe = Recipe.preset("jetrl")
    env = {nt.RECIPE_ENV: nt.recipe_to_json(recipe), "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}
    assert pe.check_policy_env(env) == recipe
    with pytest.raises(RuntimeError, match="needs '0'"):
        pe.check_policy_env({**env, "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"})
    with pytest.raises(RuntimeError, match="NEMO_JETRL_RECIPE is not set"):
        pe.check_policy_env({})


def test_worker_class_needs_nemo_rl(monkeypatch):
    from nemo_jetrl.backends.nemo_rl import worker as nemo_rl_worker
    from nemo_jetrl.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "nemo_rl", None)
    nemo_rl_worker.make_worker_class.cache_clear()
    with pytest.raises(MissingDependencyError, match="Docker image"):
        nemo_rl_worker.JetrlMegatronPolicyWorker  # noqa: B018
    nemo_rl_worker.make_worker_class.cache_clear()
    with pytest.raises(AttributeError):
        nemo_rl_worker.NoSuchThing  # noqa: B018
