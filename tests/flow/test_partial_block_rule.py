"""The flow's rule for linears whose dims are not multiples of 128 (issue 39).

Blockwise FP8 runs partial 128-blocks on both sides: TE's quantizers guard the tail tiles and its
FP8 GEMM needs only in % 16 and out % 8 (``assert_dim_for_fp8_exec``); vLLM's block-FP8 linear
takes ceil-sized scale grids (DeepSeek-V3's own checkpoint stores ``kv_a_proj_with_mqa`` 576x7168
with a 5x56 ``weight_scale_inv``). What stays refused by name: dims TE refuses, fused experts
(and MXFP8) off 128, and a tail that vLLM's tensor parallelism splits off a block edge
(``validate_fp8_block_shape``: the rank's slice would not be training's blocks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import NEMO_RL_UPSTREAM

from nemo_jetrl.arch import builtin_arch
from nemo_jetrl.arch.linear import Linear
from nemo_jetrl.config import errors, load_config, validate

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "examples" / "configs" / "base" / "grpo_megatron.yaml"
MOONLIGHT = builtin_arch("moonshotai/Moonlight-16B-A3B-Instruct")
QWEN35 = builtin_arch("Qwen/Qwen3.5-9B-Base")
RECIPES = "examples/configs/recipes/llm"


def _lin(kind, k, n, **kw):
    return Linear(f"model.layers.0.x.{kind}", kind, 0, k, n, **kw)


def test_fits_is_tes_rule_for_linears_and_128_for_experts_and_mxfp8():
    kv_a = next(x for x in MOONLIGHT.layer_linears(0) if x.kind == "kv_a_proj_with_mqa")
    assert (kv_a.out_features, kv_a.in_features) == (576, 2048)
    assert kv_a.fits("blockwise") and not kv_a.aligned and not kv_a.fits("mxfp8")
    b = next(x for x in QWEN35.layer_linears(0) if x.kind == "in_proj_b")
    assert (b.out_features, b.in_features) == (32, 4096) and b.fits("blockwise")
    assert not _lin("up_proj", 256, 324).fits()  # 324 % 8
    assert not _lin("down_proj", 324, 256).fits()  # 324 % 16
    experts = _lin("experts", 2048, 1400, experts=64, group="experts")
    assert not experts.fits("blockwise")  # each expert's blocks stack: 128 rule kept


def test_vllm_tp_split_off_a_block_edge_is_named():
    kv_a = next(x for x in MOONLIGHT.layer_linears(0) if x.kind == "kv_a_proj_with_mqa")
    assert kv_a.vllm_tp_problem(8) is None  # vLLM replicates it (ReplicatedLinear)
    b = next(x for x in QWEN35.layer_linears(0) if x.kind == "in_proj_b")
    assert b.vllm_tp_problem(1) is None
    why = b.vllm_tp_problem(2)  # column-parallel (merged in_proj_ba): 16 rows per rank
    assert why is not None and "splits its 32 output rows into 16 per rank" in why
    down = _lin("down_proj", 576, 256)  # row-parallel: 576 = 4*128 + 64
    assert down.vllm_tp_problem(1) is None
    assert "splits its 576 input columns into 288 per rank" in down.vllm_tp_problem(2)
    assert _lin("o_proj", 1024, 256).vllm_tp_problem(8) is None  # 128-multiples: not asked here


def _toy(tmp_path, intermediate):
    p = tmp_path / f"m{intermediate}" / "config.json"
    p.parent.mkdir(parents=True)
    p.write_text(
        '{"model_type": "llama", "hidden_size": 256, "intermediate_size": '
        f'{intermediate}, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 1000}}'
    )
    return p


@pytest.mark.parametrize(("intermediate", "tp", "refused"), [
    (576, 1, None), (640, 2, None),  # 640: 128-multiples, not this rule's business
    (576, 2, "down_proj 256x576: vLLM tensor_parallel_size=2 splits its 576 input columns"),
    (208, 1, None), (208, 2, "gate_proj 208x256: vLLM tensor_parallel_size=2 splits its 208"),
    (684, 1, "gate_proj 684x256: out_features=684 is not a multiple of 8"),
])  # fmt: skip
def test_config_check(tmp_path, intermediate, tp, refused):
    cfg = load_config(BASE, [
        f"+jetrl.model_config={_toy(tmp_path, intermediate)}",
        "policy.megatron_cfg.fp8_cfg.enabled=true",
        "++policy.generation.vllm_cfg.precision=fp8",
        f"++policy.generation.vllm_cfg.tensor_parallel_size={tp}",
    ])  # fmt: skip
    msgs = [i.message for i in errors(validate(cfg)) if i.path.endswith("fp8_cfg.enabled")]
    if refused is None:
        assert msgs == []
    else:
        assert len(msgs) == 1 and refused in msgs[0], msgs


def _shipped(tree, name):
    path = NEMO_RL_UPSTREAM / tree / RECIPES / name
    if not path.is_file():
        pytest.skip(f"NeMo-RL's shipped config not found: {path} (set JETRL_NEMO_RL_UPSTREAM)")
    return path


MOON = "grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml"


@pytest.mark.parametrize("tree", ["v0.7.0", "main-7ea279a"])
def test_shipped_moonlight_fp8_config_is_not_invalid_and_aligns_on_policy(cli, tmp_path, tree):
    path = _shipped(tree, MOON)
    code, out = cli("check", path)
    assert code == 1, out  # mismatches named (its rollout-only list, vLLM's own quantizer)
    assert "invalid config" not in out and "kv_a_proj_with_mqa 576x2048" not in out
    out_yaml = tmp_path / "m.yaml"
    code, out = cli("align", path, "--recipe", "jetrl", "-o", out_yaml)
    written = out.split("config: ")[-1]
    # the precision flow is on-policy; NeMo-RL's vLLM (0.20 / 0.25) cannot serve its FP8
    # experts with DeepSeek's grouped routing under our kernel (it routes, softmax top-k only)
    assert code == 1 and "verdict: OFF-POLICY on nemo-rl v0.7.0, nemo-rl main" in written, out
    assert written.count("FP8 routed experts with grouped top-k (DeepSeek) routing") == 2
    # the BF16 list is the user's own (a_proj, b_proj), now on both sides; nothing added
    assert "align adds" not in out
    assert "'train_bf16_layer_kws': ['a_proj', 'b_proj']" in out


@pytest.mark.parametrize(
    "name",
    [
        "grpo-qwen3.5-9b-1n8g-megatron-fp8.yaml",
        "grpo-qwen3.5-35ba3b-2n8g-megatron-ep16tp2-fp8.yaml",
    ],
)
def test_shipped_qwen35_fp8_configs_report_the_fused_split_and_align_on_policy(cli, tmp_path, name):
    """Their in_proj_a/b (32 x hidden) are not refused for their dims; the rollout list keeping
    part of Megatron's one in_proj GEMM BF16 is a real mismatch, reported by name (exit 1, was
    2); align writes the user's BF16 choice as the whole in_proj on both sides: ON-POLICY."""
    path = _shipped("main-7ea279a", name)
    code, out = cli("check", path)
    assert "32x4096" not in out and "blockwise FP8 cannot run" not in out
    assert code == 1 and "invalid config" not in out, out
    assert "warning: policy.generation.vllm_cfg.quantization_ignored_layer_kws: keeps" in out
    code, out = cli("align", path, "--recipe", "jetrl", "-o", tmp_path / "q.yaml")
    assert code == 0 and "verdict: ON-POLICY" in out.split("config: ")[-1], out
    assert "'train_bf16_layer_kws': ['linear_attn.conv1d', 'linear_attn.in_proj', 'visual']" in out
