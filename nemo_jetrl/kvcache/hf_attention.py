"""FP8 KV cache and Q/K/V observers inside HuggingFace transformers models, reversibly: the
attention wrapper, `attach_kv` and its `KVHandle` (`nemo_jetrl.kvcache.hf` calibrates with them).

transformers routes every attention computation of Llama/Qwen2/Qwen3-style models through one
function looked up by name in its ``AttentionInterface`` (``config._attn_implementation``). That
function receives exactly what we need: the attention module (with its ``layer_idx``) and the
query, key and value after the projections, any q/k norm and RoPE, with keys/values already
concatenated with the KV cache. `attach_kv` registers a wrapper under a fresh name that

1. feeds an `AmaxObserver` (calibration),
2. fake-quantizes keys and values (and optionally queries) to FP8 with the layer's scales,
   exactly as vLLM's cache write/read does (`quant.py`); with a straight-through gradient when
   the trainer runs on-policy KV,
3. calls the implementation the model used before (``eager`` or ``sdpa`` ...),

and switches the model to it (on a private copy of its config: models built from one config
object share their attention implementation); the handle's `restore` puts the original config
object back and unregisters the name.

KV cache during generation. transformers writes new keys/values into the cache *before* calling
the attention function. `KVHandle.new_cache` returns a cache whose layers fake-quantize what is
written, so the cache holds exactly the values vLLM's FP8 cache would hand back and each token is
quantized once, when written, as in vLLM. The wrapper recognises tensors coming from that cache
and does not quantize them again (for the ``cuda`` kernel re-quantizing would be harmless, fake
quantization being idempotent; vLLM's ``cpu`` kernel truncates and is not).

Nothing here runs at import time; transformers is imported lazily.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from nemo_jetrl._optional import require
from nemo_jetrl.kvcache.calibration import AmaxObserver
from nemo_jetrl.kvcache.quant import KERNELS, Kernel
from nemo_jetrl.kvcache.scales import KVScales
from nemo_jetrl.kvcache.state import KVQuantState

MIN_TRANSFORMERS = (4, 48)  # AttentionInterface / AttentionMaskInterface
_HANDLE_ATTR = "_jetrl_kv_handle"


def _transformers() -> Any:
    tf = require("transformers", feature="FP8 KV cache on HuggingFace models")
    version = tuple(int(p) for p in tf.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS:
        raise RuntimeError(
            f"FP8 KV on HF models needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} "
            f"(AttentionInterface); found {tf.__version__}"
        )
    return tf


@dataclass
class KVAttentionState(KVQuantState):
    """`KVQuantState` of one transformers model, plus what its FP8 cache layers returned."""

    require_q_scale: ClassVar[bool] = True
    """Quantizing queries without a calibrated q_scale is refused (see `KVQuantState.scale`)."""

    cached: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Last (keys, values) returned by our cache per layer: already quantized, skip in attention."""


def _inner_attention(previous: str, tf_modeling_utils: Any) -> Callable[..., Any]:
    """The attention function the model used before: its own eager one, or a registered one."""
    if previous == "eager":
        cache: dict[type, Callable[..., Any]] = {}

        def eager(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            fn = cache.get(type(module))
            if fn is None:
                fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
                if fn is None:
                    raise RuntimeError(
                        f"{type(module).__name__} has no eager_attention_forward in its modeling "
                        "module; attach FP8 KV with attn_implementation 'sdpa' instead"
                    )
                cache[type(module)] = fn
            return fn(module, *args, **kwargs)

        return eager
    return tf_modeling_utils.ALL_ATTENTION_FUNCTIONS[previous]


def _make_attention(state: KVAttentionState, inner: Callable[..., Any]) -> Callable[..., Any]:
    def jetrl_kv_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        layer = int(module.layer_idx)
        if state.observer is not None:
            state.observer.observe(layer, query, key, value)
        if state.quantize:
            from_cache = state.cached.get(layer)
            if from_cache is None or from_cache[0] is not key or from_cache[1] is not value:
                if state.kernel == "cpu" and key.shape[-2] > query.shape[-2]:
                    raise RuntimeError(
                        f"layer {layer}: FP8 KV with kernel='cpu' read a KV cache that did not "
                        "quantize on write; generate with past_key_values=handle.new_cache()"
                    )
                key = state.fake_quant(key, layer, "k")
                value = state.fake_quant(value, layer, "v")
            if state.quantize_q:
                query = state.fake_quant(query, layer, "q")
        return inner(module, query, key, value, attention_mask, **kwargs)

    return jetrl_kv_attention


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    mods = [
        (n, m)
        for n, m in model.named_modules()
        if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")
    ]
    if not mods:
        raise ValueError(
            f"{type(model).__name__}: no attention modules with a layer_idx found; FP8 KV needs a "
            "transformers model that dispatches attention through AttentionInterface "
            "(Llama, Qwen2, Qwen3, ...)"
        )
    return mods


class KVHandle:
    """FP8 KV / observers attached to one model; `restore` puts the model back as it was."""

    def __init__(self, model: torch.nn.Module, state: KVAttentionState) -> None:
        tf = _transformers()
        from transformers import masking_utils, modeling_utils

        self.model = model
        self.state = state
        self.layers = sorted(int(m.layer_idx) for _, m in _attention_modules(model))
        self.previous = model.config._attn_implementation or "eager"
        if self.previous.startswith("jetrl_kv_"):
            raise RuntimeError("model already runs a jetrl_kv attention not owned by a live handle")
        mask_fns = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
        if self.previous not in mask_fns:
            raise ValueError(
                f"attn_implementation {self.previous!r} has no mask function in transformers "
                f"{tf.__version__}; use 'eager' or 'sdpa' for FP8 KV"
            )
        self.name = f"jetrl_kv_{self.previous}_{id(state):x}"
        # transformers keeps the attention implementation on the config object, and models built
        # from one config object share it: give this model a private copy so attaching to (say)
        # the rollout model leaves a trainer model built from the same config untouched.
        self._config = model.config
        private = copy.deepcopy(model.config)
        self._repointed = [m for m in model.modules() if getattr(m, "config", None) is self._config]
        for m in self._repointed:
            m.config = private
        modeling_utils.AttentionInterface.register(
            self.name, _make_attention(state, _inner_attention(self.previous, modeling_utils))
        )
        masking_utils.AttentionMaskInterface.register(self.name, mask_fns[self.previous])
        model.set_attn_implementation(self.name)
        setattr(model, _HANDLE_ATTR, self)
        self.active = True

    # -- settings --------------------------------------------------------------------------------

    def set_scales(self, scales: KVScales | None) -> None:
        """Scales used from the next forward on (None: vLLM's default 1.0)."""
        self.state.scales = scales

    def set_mode(
        self, *, quantize: bool, ste: bool = False, quantize_q: bool | None = None
    ) -> None:
        """Fake-quantize K/V (``quantize``), with straight-through gradient (``ste``)."""
        self.state.quantize = bool(quantize)
        self.state.ste = bool(ste)
        if quantize_q is not None:
            self.state.quantize_q = bool(quantize_q)

    @contextmanager
    def observing(self, observer: AmaxObserver) -> Iterator[AmaxObserver]:
        """Feed ``observer`` from every attention call inside the block."""
        prev, self.state.observer = self.state.observer, observer
        try:
            yield observer
        finally:
            self.state.observer = prev

    def new_cache(self) -> Any:
        """A transformers DynamicCache whose layers store FP8-fake-quantized keys and values."""
        _transformers()
        from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

        state = self.state

        class Fp8KVLayer(DynamicLayer):
            """Quantizes on write, like vLLM's reshape_and_cache; reads return the stored values."""

            def __init__(self, layer: int) -> None:
                super().__init__()
                self.layer = layer

            def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[override]
                if state.quantize:
                    key_states = state.fake_quant(key_states, self.layer, "k")
                    value_states = state.fake_quant(value_states, self.layer, "v")
                keys, values = super().update(key_states, value_states, *args, **kwargs)
                state.cached[self.layer] = (keys, values)
                return keys, values

        class Fp8KVCache(DynamicCache):
            def __init__(self, layers: list[int]) -> None:
                Cache.__init__(self, layers=[Fp8KVLayer(i) for i in range(max(layers) + 1)])

        state.cached.clear()
        return Fp8KVCache(self.layers)

    # -- revert ----------------------------------------------------------------------------------

    def restore(self) -> None:
        """Put the previous attention implementation back and unregister ours (idempotent)."""
        if not self.active:
            return
        from transformers import masking_utils, modeling_utils

        for m in self._repointed:
            m.config = self._config  # the original object, never modified
        modeling_utils.AttentionInterface._global_mapping.pop(self.name, None)
        masking_utils.AttentionMaskInterface._global_mapping.pop(self.name, None)
        if getattr(self.model, _HANDLE_ATTR, None) is self:
            delattr(self.model, _HANDLE_ATTR)
        self.state.cached.clear()
        self.state.observer = None
        self.active = False

    def __enter__(self) -> KVHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def attach_kv(
    model: torch.nn.Module,
    *,
    scales: KVScales | None = None,
    quantize: bool = False,
    ste: bool = False,
    quantize_q: bool = False,
    kernel: Kernel = "cuda",
    fmt: str = "e4m3",
) -> KVHandle:
    """Route ``model``'s attention through the FP8 KV wrapper; returns the revert handle.

    Idempotent: attaching to a model that already has a live handle updates and returns it.
    ``quantize=False`` attaches observers only (calibration without changing the numbers).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: use one of {KERNELS}")
    existing = getattr(model, _HANDLE_ATTR, None)
    if isinstance(existing, KVHandle) and existing.active:
        existing.set_scales(scales if scales is not None else existing.state.scales)
        existing.set_mode(quantize=quantize, ste=ste, quantize_q=quantize_q)
        existing.state.kernel, existing.state.fmt = kernel, fmt
        return existing
    state = KVAttentionState(
        scales=scales, quantize=quantize, ste=ste, quantize_q=quantize_q, kernel=kernel, fmt=fmt
    )
    return KVHandle(model, state)
