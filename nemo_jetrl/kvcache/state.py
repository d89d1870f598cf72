"""What an attention integration needs to apply the rollout's FP8 KV to q/k/v on the trainer.

Both integrations (`nemo_jetrl.kvcache.hf_attention` for transformers models and
`nemo_jetrl.megatron.attention` for Megatron-Core) hold the same per-model settings, read at
every attention call: the per-layer scales, whether to fake-quantize keys/values (and queries),
with or without a straight-through gradient, which vLLM cache writer to reproduce, and an
optional amax observer. `KVQuantState` is that shared part; each integration subclasses it to
add its own bookkeeping and defaults.

Scale lookup follows vLLM: a layer or tensor without a loaded scale uses 1.0. Queries are the
exception where the integration asks for it (``require_q_scale``): fake-quantizing queries with
a scale that was never calibrated is then refused, naming the layer.

Depends on torch and `nemo_jetrl.kvcache` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from nemo_jetrl.kvcache.calibration import AmaxObserver
from nemo_jetrl.kvcache.quant import Kernel, fake_quantize_kv, fake_quantize_kv_ste
from nemo_jetrl.kvcache.scales import DEFAULT_SCALE, KVScales


@dataclass
class KVQuantState:
    """Mutable per-model FP8 KV settings read by the attention hooks at every call."""

    require_q_scale: ClassVar[bool] = False
    """True: a missing q_scale is an error when queries are quantized; False: vLLM's default 1.0."""

    scales: KVScales | None = None
    """Per-layer scales (global decoder index); None means vLLM's default 1.0 everywhere."""

    quantize: bool = False
    """Fake-quantize keys and values (and queries if quantize_q) as the rollout's FP8 cache does."""

    quantize_q: bool = False
    """Also fake-quantize queries with q_scale (engines whose attention kernel takes FP8 queries)."""

    ste: bool = False
    """Straight-through gradient through the fake quantization (trainer, on-policy KV)."""

    kernel: Kernel = "cuda"
    """Which vLLM cache writer to reproduce: "cuda" (round to nearest even, H100) or "cpu"
    (truncate)."""

    fmt: str = "e4m3"
    """FP8 format of the cache."""

    observer: AmaxObserver | None = None
    """Observer fed on every attention call while set (calibration)."""

    def scale(self, layer: int, tensor: str) -> float:
        """The scale of ``tensor`` ("q", "k" or "v") in decoder layer ``layer``."""
        s = None if self.scales is None else self.scales.get(layer, tensor, default=None)
        if s is not None:
            return float(s)
        if tensor == "q" and self.require_q_scale and self.scales is not None:
            raise ValueError(
                f"FP8 queries: layer {layer} has no q_scale; calibrate with include_q=True "
                "or attach with quantize_q=False"
            )
        return DEFAULT_SCALE  # vLLM's default for a layer without a loaded scale

    def fake_quant(self, x: torch.Tensor, layer: int, tensor: str) -> torch.Tensor:
        """``x`` as the rollout's FP8 KV cache gives it back, with this layer's scale."""
        # Without autograd the straight-through version computes the same values; skip it.
        fn = fake_quantize_kv_ste if (self.ste and torch.is_grad_enabled()) else fake_quantize_kv
        return fn(x, self.scale(layer, tensor), fmt=self.fmt, kernel=self.kernel)
