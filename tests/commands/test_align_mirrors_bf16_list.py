"""`jetrl align` keeps the rollout's per-name BF16 list in training too, also when the input is
invalid only for want of it (NeMo-RL main's Qwen3.5 FP8 recipes: the rollout keeps the 32-row
linear_attn.in_proj_a/b BF16, training would run them in blockwise FP8; issue 26). Megatron
computes those with in_proj_qkv/z as one in_proj GEMM, so align writes the word true on both
sides, linear_attn.in_proj, to both lists."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from nemo_jetrl.config import load_config

EX = Path(__file__).resolve().parents[2] / "examples" / "configs"
KWS = "[linear_attn.conv1d,linear_attn.in_proj_a,linear_attn.in_proj_b,visual]"
QWEN35 = [
    "policy.model_name=Qwen/Qwen3.5-9B-Base",
    f"+policy.generation.vllm_cfg.quantization_ignored_layer_kws={KWS}",
]
ROLLOUT = "policy.generation.vllm_cfg.quantization_ignored_layer_kws"


def test_input_is_refused_naming_the_unaligned_training_linears(cli):
    # in_proj_a/b (32x4096) run blockwise FP8 in partial blocks (issue 39), and vLLM can keep its
    # in_proj_ba BF16: the input is a mismatch with training (which runs Megatron's one in_proj
    # GEMM in FP8), named with the word true on both sides; exit 1, no longer 2
    code, out = cli("check", EX / "nemo_rl_fp8_e2e.yaml", *QWEN35)
    assert code == 1 and "invalid config" not in out
    warn = next(x for x in out.splitlines() if x.startswith(f"warning: {ROLLOUT}:"))
    assert "one in_proj GEMM" in warn and "use 'linear_attn.in_proj'" in warn
    assert "training runs the whole in_proj in FP8" in warn
    assert "multiples of 128" not in out and "blockwise FP8 cannot run" not in out
    assert "OFF-POLICY" in out


def test_align_mirrors_the_list_says_so_and_is_on_policy(cli, tmp_path):
    out_yaml = tmp_path / "a.yaml"
    code, out = cli(
        "align", EX / "nemo_rl_fp8_e2e.yaml", *QWEN35, "--recipe", "jetrl", "-o", out_yaml
    )
    assert code == 0, out
    whole = "['linear_attn.conv1d', 'linear_attn.in_proj', 'visual']"
    assert f"  jetrl.train_bf16_layer_kws: '<unset>' -> {whole}" in out
    assert f"  {ROLLOUT}: ['linear_attn.conv1d', 'linear_attn.in_proj_a'" in out
    assert "-> ['linear_attn.in_proj']: megatron-core computes the gated delta net's in_proj" in out
    assert "verdict: ON-POLICY" in out
    assert f"with overrides {' '.join(QWEN35)}" in out_yaml.read_text()
    cfg = load_config(out_yaml)
    want = ["linear_attn.conv1d", "linear_attn.in_proj", "visual"]
    assert list(OmegaConf.select(cfg, "jetrl.train_bf16_layer_kws")) == want
    assert list(OmegaConf.select(cfg, ROLLOUT)) == want
    child = tmp_path / "child.yaml"
    code, out = cli(
        "align",
        EX / "nemo_rl_fp8_e2e.yaml",
        *QWEN35,
        "--recipe",
        "jetrl",
        "--as-child",
        "-o",
        child,
    )
    assert code == 0, out
    assert list(OmegaConf.select(load_config(child), "jetrl.train_bf16_layer_kws")) == want


def test_other_refusals_are_not_retried(cli, tmp_path):
    """A training list that splits Megatron's in_proj, or an error the list cannot fix: the
    input's own error. A training list already set that does not split it: align merges the
    lists (the rollout's partial in_proj words become the whole in_proj on both sides)."""
    code, out = cli(
        "align",
        EX / "nemo_rl_fp8_e2e.yaml",
        *QWEN35,
        "+jetrl.train_bf16_layer_kws=[linear_attn.in_proj_a]",
        "-o",
        tmp_path / "b.yaml",
    )
    assert code == 2 and "one in_proj GEMM" in out and not (tmp_path / "b.yaml").exists()
    code, out = cli(
        "align", EX / "nemo_rl_fp8_e2e.yaml", *QWEN35, "+jetrl.train_bf16_layer_kws=[visual]",
        "-o", tmp_path / "b2.yaml",
    )  # fmt: skip
    assert code == 0 and "verdict: ON-POLICY" in out, out
    assert "jetrl.train_bf16_layer_kws: ['visual'] -> ['visual', 'linear_attn.conv1d', " in out
    code, out = cli(
        "align", EX / "nemo_rl_fp8_e2e.yaml", "+jetrl.nope=1", "-o", tmp_path / "c.yaml"
    )
    assert code == 2 and "jetrl.nope" in out and "the input keeps these linears" not in out


def test_align_with_fp8_primary_weights_writes_a_list_training_honours(cli, tmp_path):
    """A rollout BF16 list beside ``fp8_param: true``: align copied the list to training and kept
    FP8 primary weights, a pair its own check refuses (it wrote the file, then exited 2). It sets
    fp8_param false, says so, and the file it writes is on-policy."""
    out_yaml = tmp_path / "a.yaml"
    code, out = cli(
        "align",
        EX / "qwen3_8b_base" / "jetrl.yaml",
        "policy.megatron_cfg.fp8_cfg.fp8_param=true",
        f"+{ROLLOUT}=[down_proj]",
        "-o",
        out_yaml,
    )
    assert code == 0, out
    assert "  policy.megatron_cfg.fp8_cfg.fp8_param: True -> False" in out
    assert "note: policy.megatron_cfg.fp8_cfg.fp8_param goes false: training keeps" in out
    assert "verdict: ON-POLICY" in out and "invalid config" not in out
    cfg = load_config(out_yaml)
    assert OmegaConf.select(cfg, "policy.megatron_cfg.fp8_cfg.fp8_param") is False
    assert list(OmegaConf.select(cfg, "jetrl.train_bf16_layer_kws")) == ["down_proj"]
