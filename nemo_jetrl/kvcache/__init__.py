"""FP8 KV cache: per-tensor quantization as vLLM does it, Q/K/V scale calibration on the
trainer, scale naming for vLLM and Megatron, and the HuggingFace attention integration.

``quant``, ``calibration`` (with its ``settings`` and the ``scales`` it produces), ``names`` and
``state`` need torch only; ``hf`` and ``hf_attention`` import transformers lazily.
"""

from nemo_jetrl.kvcache.calibration import (
    AmaxObserver,
    CalibrationResult,
    KVScaleRefusedWarning,
    masked_amax,
    reduce_samples,
    scale_from_amax,
    scales_from_amax,
    select_sequences,
    token_mask,
)
from nemo_jetrl.kvcache.quant import (
    dequantize_kv,
    fake_quantize_kv,
    fake_quantize_kv_ste,
    quantize_kv,
    rollout_cache_kernel,
)
from nemo_jetrl.kvcache.scales import KVScales
from nemo_jetrl.kvcache.settings import CalibrationSettings
from nemo_jetrl.kvcache.state import KVQuantState

__all__ = [
    "AmaxObserver",
    "CalibrationResult",
    "CalibrationSettings",
    "KVQuantState",
    "KVScaleRefusedWarning",
    "KVScales",
    "dequantize_kv",
    "fake_quantize_kv",
    "fake_quantize_kv_ste",
    "masked_amax",
    "quantize_kv",
    "reduce_samples",
    "rollout_cache_kernel",
    "scale_from_amax",
    "scales_from_amax",
    "select_sequences",
    "token_mask",
]
