"""`jetrl check` / `jetrl align` on the three MoE models NeMo-RL's FP8 configs refused for
reasons other than kernels (issue 28): DeepSeek-V3 behind NeMo-RL's placeholder model name, the
576-row MLA kv_a_proj_with_mqa of Moonlight / DeepSeek-V3, and MiniMax-M2.7 on NeMo-RL's DTensor
policy. The configs are this repo's NeMo-RL-shaped e2e example with the models' keys."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from nemo_jetrl.arch import resolve_arch
from nemo_jetrl.config import load_config

EX = Path(__file__).resolve().parents[2] / "examples" / "configs"
E2E = EX / "nemo_rl_fp8_e2e.yaml"
ROLL = "policy.generation.vllm_cfg.quantization_ignored_layer_kws"
TRAIN = "jetrl.train_bf16_layer_kws"
# policy.model_name of NeMo-RL's DeepSeek-V3 configs (both trees), as shipped.
PLACEHOLDER = (
    "Follow instructions in https://github.com/NVIDIA-NeMo/RL/blob/main/docs/guides/deepseek.md"
)
DS_LIST = f"+{ROLL}=[a_proj,b_proj]"  # what NeMo-RL's DeepSeek-V3 / Moonlight FP8 configs list


def _lists(path: Path) -> tuple[list, list]:
    cfg = load_config(path)
    return (
        list(OmegaConf.select(cfg, ROLL) or []),
        list(OmegaConf.select(cfg, TRAIN) or []),
    )


def test_placeholder_name_is_deepseek_v3_and_a_real_path_wins(cli, tmp_path):
    assert resolve_arch(PLACEHOLDER).name == "deepseek-ai/DeepSeek-V3"
    assert resolve_arch(PLACEHOLDER + " (edited)") is None  # recognised narrowly
    code, out = cli("check", E2E, f"policy.model_name={PLACEHOLDER}", DS_LIST)
    # The list now names q_a/kv_a/q_b/kv_b; training has none, so the 576-row linear is FP8 there.
    assert code == 2 and "match no decoder linear" not in out
    assert "deepseek-ai/DeepSeek-V3 has model.layers.0.self_attn.kv_a_proj_with_mqa 576x7168" in out
    assert "note: policy.model_name: NeMo-RL's placeholder" in out and "jetrl.model_config" in out
    # The converted checkpoint the guide makes: its config.json decides, no note.
    ckpt = tmp_path / "DeepSeek-V3-BF16"
    ckpt.mkdir()
    tiny = {**resolve_arch(PLACEHOLDER).hf_config, "num_hidden_layers": 4}
    (ckpt / "config.json").write_text(json.dumps(tiny))
    code, out = cli("check", E2E, f"policy.model_name={ckpt}", DS_LIST)
    assert code == 2 and "NeMo-RL's placeholder" not in out and "576x7168" in out


def test_align_models_the_placeholder_and_copies_the_list_to_training(cli, tmp_path):
    out_yaml = tmp_path / "ds.yaml"
    _, out = cli(  # exit code: what the shared-experts / parallelism checks say today
        "align", E2E, f"policy.model_name={PLACEHOLDER}", DS_LIST, "--recipe", "jetrl",
        "-o", out_yaml,
    )  # fmt: skip
    assert out_yaml.exists(), out
    assert f"+{TRAIN}=[a_proj,b_proj]: the input keeps these linears BF16" in out
    assert "model:  deepseek-ai/DeepSeek-V3" in out and "NeMo-RL's placeholder" in out
    assert "[576, 7168] in 61 layer(s)" in out and "through the per-name word 'a_proj'" in out
    assert _lists(out_yaml) == (["a_proj", "b_proj"], ["a_proj", "b_proj"])
    assert "multiples of 128" not in out.split("config: ")[-1]  # the written file tiles


def test_align_adds_words_for_exactly_the_untiled_linears(cli, tmp_path):
    """Moonlight (no q LoRA): kv_a_proj_with_mqa alone; DeepSeek-V3: with q_a_proj, which vLLM
    runs with it as one GEMM (fused_qkv_a_proj). Both lists get them; the check of the input
    names the FP8 training key."""
    moon = "policy.model_name=moonshotai/Moonlight-16B-A3B-Instruct"
    code, out = cli("check", E2E, moon)
    assert code == 2 and "policy.megatron_cfg.fp8_cfg.enabled: blockwise FP8 needs" in out
    for model, words in (
        (moon, ["kv_a_proj_with_mqa"]),
        (f"policy.model_name={PLACEHOLDER}", ["kv_a_proj_with_mqa", "q_a_proj"]),
    ):
        out_yaml = tmp_path / f"{len(words)}.yaml"
        _, out = cli("align", E2E, model, "--recipe", "jetrl", "-o", out_yaml)
        assert out_yaml.exists(), out
        assert f"align adds 'kv_a_proj_with_mqa' to {ROLL} and {TRAIN}" in out
        assert ("'q_a_proj' added too: vLLM runs it with kv_a_proj_with_mqa" in out) == (
            len(words) == 2
        )
        assert _lists(out_yaml) == (words, words)
        written = out.split("config: ")[-1]
        assert "multiples of 128" not in written and "per-name BF16 list" not in written


MINIMAX = [
    "policy.model_name=MiniMaxAI/MiniMax-M2.7",
    "policy.megatron_cfg.enabled=false",  # NeMo-RL's config: the DTensor (automodel) policy
    "policy.megatron_cfg.fp8_cfg.enabled=false",
]


def test_minimax_m27_is_described_and_its_dtensor_verdict_is_truthful(cli, tmp_path):
    code, out = cli("check", E2E, *MINIMAX)
    assert code == 1 and "jetrl.model_config" not in out
    assert "model:  MiniMaxAI/MiniMax-M2.7 (62 layers, hidden 3072" in out
    assert "experts  BF16" in out and "verdict: OFF-POLICY (1 mismatch)" in out
    # --recipe jetrl: FP8 keys written, but NeMo-RL's DTensor policy trains BF16: named off.
    code, out = cli("align", E2E, *MINIMAX, "--recipe", "jetrl", "-o", tmp_path / "a.yaml")
    assert code == 1, out
    assert "note: routing is not replayed" in out
    assert (
        "align writes the recipe's training FP8 keys but cannot change the training policy" in out
    )
    assert "nemo-rl v0.7.0: OFF-policy: training FP8 (policy.megatron_cfg.fp8_cfg.enabled)" in out
    assert "verdict: OFF-POLICY on nemo-rl v0.7.0, nemo-rl main" in out
    # Without a preset align follows BF16 training: a BF16 rollout, on-policy.
    code, out = cli("align", E2E, *MINIMAX, "-o", tmp_path / "b.yaml")
    assert code == 0 and "verdict: ON-POLICY" in out and "cannot change" not in out
