"""MXFP8 rollouts (NeMo-RL's ``vllm_cfg.is_mx``): why they are off-policy, what align changes.

The one home of these facts; `flow.check` takes its verdict text from here, `jetrl align` its
"what changes" lines, and docs/configs.md quotes them.

NeMo-RL main's MXFP8 recipes (``grpo-qwen3-*-mxfp8-rollout``, Blackwell) quantize vLLM's linears
to MXFP8 (E4M3 in 1x32 blocks along K, one E8M0 power-of-two scale per block, weights and
activations alike) while the Megatron trainer stays BF16: the rollout samples from a quantized
policy the trainer never computes. Turning on TE's MXFP8 recipe in training does not fix it
either: TE's MXFP8 quantizer and vLLM's MXFP8 kernel are different code that nothing here shows
to give the same bits, and nemo_jetrl's vLLM patch supplies TE's numbers for blockwise FP8 only.

The on-policy answer is the Jet-RL blockwise recipe on both sides. It runs on the same hardware:
Transformer Engine allows ``Float8BlockScaling`` when
``transformer_engine/pytorch/quantization.py::_compute_fp8_block_scaling_support`` finds
``get_device_compute_capability() >= (9, 0) and float(torch.version.cuda) >= 12.9`` (read at
TE commit d0067d0, version 2.20.0.dev0; ``check_recipe_support`` raises otherwise), so
Blackwell (SM 10.x) qualifies as Hopper does, given CUDA 12.9 or newer.
"""

from __future__ import annotations

from nemo_jetrl.config import schema as S
from nemo_jetrl.flow.graph import BLOCK_MX, Precision
from nemo_jetrl.recipe import Recipe

MX_FORMAT = "MXFP8: E4M3 in 1x32 blocks with E8M0 (power-of-two) scales"
BLOCKWISE_FORMAT = (
    "blockwise FP8: E4M3 in 1x128 activation blocks and 128x128 weight blocks, FP32 or "
    "power-of-two scales (TE's Float8BlockScaling)"
)
TE_BLOCKWISE_RULE = (
    "TE runs Float8BlockScaling on compute capability >= 9.0 with CUDA >= 12.9 "
    "(transformer_engine/pytorch/quantization.py, _compute_fp8_block_scaling_support), "
    "so Hopper and Blackwell both qualify"
)
_ALIGN_HINT = "`jetrl align CONFIG --recipe jetrl -o OUT.yaml` writes that recipe"
_BLOCKWISE_FIX = (f"{S.VLLM_IS_MX}=false", f"{S.FP8_ENABLED}=true", "jetrl.vllm_patch=true")


def is_mx(p: Precision) -> bool:
    return p.is_fp8 and p.block == BLOCK_MX


def mx_rollout_vs_bf16(
    bf16_too: tuple[str, ...] = (),
) -> tuple[str, tuple[str, ...], tuple[str, ...], str]:
    """(reason, keys, fixes, severity): an MXFP8 rollout against BF16 training. The BF16
    rollout alternative turns is_mx off (validation refuses it without FP8), with
    ``bf16_too`` (``"and key=value"``: an FP8 KV cache's dtype)."""
    return (
        f"the rollout runs these linears in {MX_FORMAT} ({S.VLLM_IS_MX}=true, vLLM's MXFP8 "
        "kernel) but training keeps them in BF16: the sampler is a quantized policy the "
        "trainer never computes. TE's MXFP8 training would not match it either (a different "
        "quantizer from vLLM's, not shown to give the same bits); the on-policy FP8 recipe is "
        f"{BLOCKWISE_FORMAT} on both sides with our vLLM patch; {TE_BLOCKWISE_RULE}. "
        f"{_ALIGN_HINT}",
        (S.VLLM_IS_MX, S.FP8_ENABLED, S.VLLM_PRECISION),
        (
            *_BLOCKWISE_FIX,
            f"or {S.VLLM_PRECISION}=bfloat16",
            f"and {S.VLLM_IS_MX}=false",
            *bf16_too,
        ),
        "always",
    )


def mx_fp8_mismatch(train: Precision, roll: Precision) -> tuple:
    """(reason, keys, fixes, severity) when MXFP8 is on some side and both sides are FP8."""
    if is_mx(train) and is_mx(roll):
        return (
            "MXFP8 on both sides, but computed by TE's MXFP8 quantizer in training and vLLM's "
            "MXFP8 kernel in the rollout: different code, not shown to give the same bits, and "
            "nemo_jetrl's vLLM patch covers blockwise FP8 only. On-policy FP8 is "
            f"{BLOCKWISE_FORMAT} on both sides; {TE_BLOCKWISE_RULE}. {_ALIGN_HINT}",
            (S.FP8_RECIPE, S.VLLM_IS_MX),
            (f"{S.FP8_RECIPE}=blockwise", *_BLOCKWISE_FIX),
            "always",
        )
    side = "rollout" if is_mx(roll) else "training"
    key = S.VLLM_IS_MX if side == "rollout" else S.FP8_RECIPE
    fix = (*_BLOCKWISE_FIX[:1], "jetrl.vllm_patch=true") if side == "rollout" else ()
    return (
        f"different FP8 scaling granularity (training {train.short()}, rollout "
        f"{roll.short()}): the {side} uses {MX_FORMAT}, the other side other blocks, so the "
        f"quantized values differ. {_ALIGN_HINT}",
        (S.FP8_RECIPE, S.VLLM_IS_MX),
        fix or (f"{key}=blockwise",),
        "always",
    )


def align_notes(before: Recipe, after: Recipe) -> list[str]:
    """What `jetrl align` changes for the user of an MXFP8 rollout (empty otherwise)."""
    was = before.rollout
    if not (was.fp8_linears and was.scaling == "mxfp8"):
        return []
    now = after.rollout
    if not now.fp8_linears:
        return [
            f"the rollout was {MX_FORMAT} (vLLM's MXFP8 kernel) and training BF16; it is now "
            "BF16 like training: on-policy, without FP8's speed. `--recipe jetrl` keeps FP8 on "
            f"both sides instead ({BLOCKWISE_FORMAT}; {TE_BLOCKWISE_RULE})"
        ]
    scales = "power-of-two" if now.pow2_weight_scales else "FP32"
    return [
        f"format: rollout {MX_FORMAT} -> {BLOCKWISE_FORMAT}, here with {scales} scales; "
        "training BF16 -> the same blockwise FP8",
        "kernels: rollout: vLLM's block-FP8 linear with nemo_jetrl's vLLM patch (TE's quantizer "
        "for activations, trainer-quantized weights at each refit; the GEMM backend planned by "
        "nemo_jetrl.fp8.gemm_backends, where DeepGEMM on SM100 needs power-of-two scales) "
        "instead of vLLM's MXFP8 kernel; training: TE's Float8BlockScaling GEMMs instead of "
        "BF16 GEMMs",
        f"why: the same quantizer and blocks on both sides make every FP8 tensor of the rollout "
        f"carry the training forward's bits; nothing here makes an MXFP8 rollout match any "
        f"training. Hardware: {TE_BLOCKWISE_RULE} (the MXFP8 recipes target Blackwell)",
    ]
