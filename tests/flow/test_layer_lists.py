"""Per-name BF16 layer lists (issue 26 item 1): NeMo-RL's quantization_ignored_layer_kws on the
rollout and jetrl.train_bf16_layer_kws in training are part of the recipe; the flow compares
them linear by linear, align keeps the user's list on both sides, bad lists exit 2 naming the
key, and the local backend trains with those linears BF16 on both sides, exactly on-policy."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JETRL = REPO / "examples" / "configs" / "qwen3_8b_base" / "jetrl.yaml"
ROLL = "policy.generation.vllm_cfg.quantization_ignored_layer_kws"
TRAIN = "jetrl.train_bf16_layer_kws"
ATTN = "[q_proj,k_proj,v_proj,o_proj]"


def test_a_rollout_only_list_is_off_policy_naming_both_keys(cli):
    code, out = cli("check", JETRL, f"+{ROLL}={ATTN}")
    assert code == 1
    assert "0-35    attn     FP8 e4m3 pow2 (te)  BF16" in out
    assert "per-name BF16 list" in out and TRAIN in out and ROLL in out


def test_the_same_list_on_both_sides_is_on_policy_and_attn_is_bf16_on_both(cli):
    code, out = cli("check", JETRL, f"+{ROLL}={ATTN}", f"+{TRAIN}={ATTN}")
    assert code == 0 and "verdict: ON-POLICY" in out
    assert "0-35    attn     BF16" in out and "0-35    mlp      FP8 e4m3 pow2 (te)  FP8" in out


def test_align_keeps_the_users_list_on_both_sides(cli, tmp_path):
    from omegaconf import OmegaConf

    out_yaml = tmp_path / "aligned.yaml"
    code, out = cli("align", JETRL, f"+{ROLL}={ATTN}", "-o", out_yaml)
    assert code == 0 and "verdict: ON-POLICY" in out
    cfg = OmegaConf.load(out_yaml)
    want = ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert list(OmegaConf.select(cfg, ROLL)) == want and list(OmegaConf.select(cfg, TRAIN)) == want


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        (f"+{ROLL}=[q_proj]", ROLL, "fused GEMM"),  # q without k, v
        (f"+{TRAIN}=[up_proj]", TRAIN, "fused GEMM"),  # up without gate
        (f"+{ROLL}=[visual,linear_attn]", ROLL, "match no decoder linear"),
        (f"+{TRAIN}=q_proj", TRAIN, "expected a list of non-empty strings"),
        (f"+{TRAIN}={ATTN} policy.megatron_cfg.fp8_cfg.fp8_param=true", TRAIN, "fp8_param=false"),
    ],
)
def test_bad_lists_exit_2_naming_the_key(cli, extra, key, words):
    code, out = cli("check", JETRL, *extra.split())
    assert code == 2 and key in out and words in out and "Traceback" not in out


def test_local_backend_keeps_listed_linears_bf16_on_both_sides_exactly_on_policy(tmp_path):
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from local_configs import tiny_cfg

    from nemo_jetrl.backends.local.bf16_gemm import Bf16CpuLinear
    from nemo_jetrl.backends.local.loop import Hooks, LocalRun, resolve_run
    from nemo_jetrl.fp8 import Fp8BlockLinear, Fp8InferenceLinear

    cfg = tiny_cfg(
        "jetrl", tmp_path / "run", tmp_path / "cache", f"+{ROLL}={ATTN}", f"+{TRAIN}={ATTN}"
    )
    run_ = LocalRun(resolve_run(cfg), log=lambda m: None)
    try:
        for model, fp8_type in (
            (run_.trainer.model, Fp8BlockLinear),
            (run_.rollout_model, Fp8InferenceLinear),
        ):
            kinds = {
                n.rsplit(".", 1)[-1]: type(m) for n, m in model.named_modules() if "layers.0." in n
            }
            # BF16 on a CPU: float32 GEMMs of the BF16 values (backends/local/bf16_gemm.py)
            assert all(kinds[k] is Bf16CpuLinear for k in ("q_proj", "k_proj", "v_proj", "o_proj"))
            assert all(kinds[k] is fp8_type for k in ("gate_proj", "up_proj", "down_proj"))
        for _ in range(2):
            stats, _ = run_.train_step(Hooks())
            assert stats["train/token_mult_prob_error"] == 1.0 and stats["train/gen_kl_error"] == 0
    finally:
        run_.close()
