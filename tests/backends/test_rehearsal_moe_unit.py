"""``jetrl rehearse``'s mixture-of-experts stand-in without NeMo-RL: the tiny Qwen3-MoE of a
real one (what it keeps, what it shrinks), the families still refused by name, and the CPU
policy's refit export under the per-expert checkpoint names vLLM's Qwen3-MoE loader reads and
NeMo-RL's Megatron bridge exports (the whole MoE rehearsal: test_nemo_rl_rehearse_moe.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from nemo_jetrl.arch.builtins import resolve_arch
from nemo_jetrl.arch.model import ModelArch
from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny

REPO = Path(__file__).resolve().parents[2]
LOCAL_TINY_MOE = REPO / "examples" / "configs" / "local" / "moe" / "qwen3_moe_tiny.json"


def _arch_of(cfg) -> ModelArch:
    return ModelArch.from_hf_config(cfg.to_dict())


def test_the_qwen3_30b_a3b_stand_in_keeps_its_moe_rules_in_whole_blocks():
    real = resolve_arch("Qwen/Qwen3-30B-A3B")
    cfg = tiny.tiny_config(real, vocab_size=128)
    assert cfg.architectures == ["Qwen3MoeForCausalLM"] and cfg.model_type == "qwen3_moe"
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (tiny.EXPERTS, tiny.TOP_K)
    assert 1 < cfg.num_experts_per_tok < cfg.num_experts  # routed, more than one per token
    # Qwen3-30B-A3B's config.json renormalises the top-k weights; transformers' default does not
    assert cfg.norm_topk_prob is True
    assert cfg.moe_intermediate_size == 128 and cfg.hidden_size == 256 and cfg.head_dim == 128
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped KV, as the real one
    got = _arch_of(cfg)  # what jetrl check reads from the stand-in's config.json
    assert got.family == "moe" and got.moe.moe_layers == frozenset(range(tiny.LAYERS))
    assert got.moe.shared_size == 0 and not got.tie_word_embeddings


def test_the_stand_in_keeps_a_tail_block_dense_layers_and_the_router_rule():
    real = resolve_arch("Qwen/Qwen3-30B-A3B")
    tail = dataclasses.replace(real, moe=dataclasses.replace(real.moe, expert_size=768 + 64))
    assert tiny.tiny_config(tail, 128).moe_intermediate_size == 128 + 64
    # the local backend's tiny Qwen3-MoE: layer 0 dense (mlp_only_layers), no renormalisation
    raw = json.loads(LOCAL_TINY_MOE.read_text())
    for norm in (True, False):
        arch = ModelArch.from_hf_config({**raw, "norm_topk_prob": norm})
        cfg = tiny.tiny_config(arch, 128)
        assert cfg.norm_topk_prob is norm
        assert cfg.mlp_only_layers == [0] and _arch_of(cfg).moe.moe_layers == frozenset({1})
    # no MoE layer among the kept ones: the last kept layer is made MoE (still a MoE stand-in)
    late = ModelArch.from_hf_config({**raw, "num_hidden_layers": 4, "mlp_only_layers": [0, 1]})
    assert _arch_of(tiny.tiny_config(late, 128)).moe.moe_layers == frozenset({1})


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("MiniMaxAI/MiniMax-M2", r"minimax_m2, mixture of experts\): .* for qwen3_moe only"),
        ("moonshotai/Moonlight-16B-A3B", r"deepseek_v3, MLA\): .*no stand-in for MLA"),
    ],
)
def test_families_without_a_stand_in_are_refused_by_name(name, said):
    with pytest.raises(tiny.UnsupportedFamily, match=said):
        tiny.tiny_config(resolve_arch(name), 128)


def test_the_refit_sends_per_expert_checkpoint_names_with_the_trainers_values(tmp_path):
    """`CpuPolicy._weights`: transformers 5 holds the experts fused ([E, 2I, H] gate rows first,
    [E, H, I]); the refit must send what the HF checkpoint holds (vLLM loads it at start and
    NeMo-RL's Megatron bridge exports it): the same names, the same values."""
    from safetensors import safe_open

    from nemo_jetrl.backends.nemo_rl.rehearsal.policy import _CpuPolicyBody
    from nemo_jetrl.recipe import Recipe

    model_dir = tiny.write_model(resolve_arch("Qwen/Qwen3-30B-A3B"), tmp_path / "m")
    gen = {"vllm_cfg": {"precision": "fp8", "kv_cache_dtype": "auto"}, "temperature": 1.0}
    policy = _CpuPolicyBody(
        None, {"model_name": str(model_dir), "generation": gen}, None,
        init_optimizer=False, init_reference_model=False, recipe=Recipe.preset("jetrl"),
    )  # fmt: skip
    params = dict(policy.model.named_parameters())
    assert params["model.layers.1.mlp.experts.gate_up_proj"].dim() == 3  # fused in the trainer
    sent = policy._weights()
    with safe_open(str(model_dir / "model.safetensors"), "pt") as ckpt:
        assert set(sent) == set(ckpt.keys())
        for name in sorted(sent):
            assert torch.equal(sent[name], ckpt.get_tensor(name)), name
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in sent)
    fused = params["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(sent["model.layers.1.mlp.experts.3.up_proj.weight"], fused[3, 128:])
    assert sent["model.layers.0.mlp.experts.2.down_proj.weight"].shape == (256, 128)
    assert sent["model.layers.0.mlp.gate.weight"].shape == (tiny.EXPERTS, 256)  # the router
    info = policy.prepare_refit_info()
    assert set(info) == set(sent)  # what vLLM is told to expect is what is sent
    assert info["model.layers.0.mlp.experts.0.gate_proj.weight"] == (
        torch.Size([128, 256]), torch.bfloat16,
    )  # fmt: skip


def test_the_engine_check_line_counts_expert_layers_and_their_experts(capsys):
    """An MoE engine's line says how many FP8 linears and FP8 expert layers (with experts) our
    kernel serves; a dense one's line is unchanged. Reports shaped as ``worker_status``'s."""
    from worker_group_shape import CallShapeWorkerGroup

    from nemo_jetrl.backends.nemo_rl import engine_check as ec
    from nemo_jetrl.backends.nemo_rl.translate import _vllm_env, _vllm_patch_json
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    env = _vllm_env({}, _vllm_patch_json(Recipe.preset("jetrl"), 2))
    patch = env["NEMO_JETRL_VLLM_PATCH"]
    want = PatchSettings.from_json(patch).to_json()
    linear = {"kernel": "JetRLFp8BlockLinearKernel", "ours": True, "settings": want}
    experts = {"kernel": "JetRLFp8MoEMethod", "ours": True, "settings": want, "moe": True,
               "experts": 4}  # fmt: skip
    layers = {f"model.layers.{i}.self_attn.{p}": linear for i in (0, 1) for p in ("qkv", "o")}
    layers |= {f"model.layers.{i}.mlp.experts": experts for i in (0, 1)}
    rep = {
        "layers": layers, "registered": True, "python": "py",
        "env": {"NEMO_JETRL_VLLM_PATCH": patch, "NEMO_JETRL_NRL_REFIT": env["NEMO_JETRL_NRL_REFIT"]},
        "refit_hook": {"active": True, "layout": "v0.7.0"},
        "entry_points": dict(ec.ENTRY_POINTS),
    }  # fmt: skip
    res = ec.judge([rep], patch, True)
    assert res["line"].endswith(
        "kernel serves 4/4 FP8 linears and 2/2 FP8 expert layers (8 experts), refit hook "
        "installed (v0.7.0)"
    )
    assert (res["fp8_linears"], res["on_our_kernel"]) == (6, 6)  # the logged fraction: both
    off = {**experts, "ours": False, "kernel": "Fp8MoEMethod with TritonExperts"}
    with pytest.raises(ec.EngineNotProven, match="Fp8MoEMethod with TritonExperts"):
        ec.judge([{**rep, "layers": {**layers, "model.layers.1.mlp.experts": off}}], patch, True)
    dense = {"workers": 1, "fp8_linears": 8, "on_our_kernel": 8, "line": ""}  # no "served"
    gen = type("G", (), {"worker_group": CallShapeWorkerGroup(results=[res, dense])})()
    ec.prove_generation_engines(gen, env, None, get=lambda f: f)
    assert "kernel serves 12/12 FP8 linears and 2/2 FP8 expert layers (8 experts), refit hook" in (
        capsys.readouterr().out
    )
