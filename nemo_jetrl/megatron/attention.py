"""Q/K/V observers and on-policy FP8 KV on Megatron-Core attention, reversibly.

Where the numbers are. In Megatron-Core 0.16 ``SelfAttention.forward`` computes
``linear_qkv`` -> split into query/key/value (``get_query_key_value_tensors``, which also applies
the optional q/k layernorm of Qwen3) -> RoPE (``apply_rotary_pos_emb``) and then calls
``self.core_attention(query, key, value, attention_mask, attn_mask_type=..., ...)``. The core
attention module (``DotProductAttention`` in the local spec, ``TEDotProductAttention`` in the TE
spec) therefore receives, as its first three positional arguments, exactly what an inference
engine's KV cache stores: post-norm, post-RoPE keys and values, one head per KV group
(``[s, b, num_query_groups, head_dim]``, "sbhd"; ``[t, groups, head_dim]`` with packed
sequences, "thd"). A forward *pre*-hook on that module sees them before attention runs and may
replace them. NeMo-RL's own KV calibration hooks the same module.

What the hook does, per decoder layer (global index = local index + the pipeline stage's
``layer_offset``):

1. observe: with an `AmaxObserver` attached, record the masked amax of q, k, v for this
   micro-batch (the math and the token masks live in `nemo_jetrl.kvcache.calibration`);
2. on-policy KV: when enabled, replace k and v (and q if asked) by
   ``fake_quantize_kv_ste(x, scale)``, i.e. the values vLLM's FP8 cache gives back for them,
   with a straight-through gradient (`nemo_jetrl.kvcache.quant`). Observation happens first, on
   the unquantized tensors, as the rollout engine's cache sees them before writing.

`attach_megatron_kv` registers the hooks and returns a handle (``restore()`` removes them;
attaching twice returns the same live handle). Nothing is patched: hooks are PyTorch's public
module-hook API, so any Megatron version whose core attention takes (q, k, v, ...) works;
the module is found by name (``*.self_attention.core_attention``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_jetrl.kvcache import names
from nemo_jetrl.kvcache.calibration import AmaxObserver, CalibrationResult, scales_from_amax
from nemo_jetrl.kvcache.quant import KERNELS, Kernel
from nemo_jetrl.kvcache.scales import KVScales
from nemo_jetrl.kvcache.settings import CalibrationSettings
from nemo_jetrl.kvcache.state import KVQuantState

CORE_ATTENTION_SUFFIX = "self_attention.core_attention"
_HANDLE_ATTR = "_jetrl_megatron_kv_handle"


@dataclass
class MegatronKVState(KVQuantState):
    """`KVQuantState` owned by one `MegatronKVHandle`; a missing q_scale uses vLLM's 1.0."""

    ste: bool = True
    """Straight-through gradient by default: the trainer's forward feeds a backward."""

    calls: dict[int, int] = field(default_factory=dict)
    """Calls seen per layer (diagnostics and tests)."""


AUXILIARY_TOWERS = ("mtp", "vision_model")
"""Submodules whose attention is not the language decoder's KV cache, so never hooked: the
multi-token-prediction layers (``mtp.layers.N.transformer_layer...`` in Megatron-Core 0.16,
``mtp.layers.N.mtp_model_layer...`` later; a draft head, not the policy's logprobs) and a vision
tower (Megatron-Bridge's Qwen3-VL/Qwen3.5 ``vision_model.decoder.layers.N``, whose indices would
collide with the language model's ``language_model.decoder.layers.N``)."""


def core_attention_modules(
    model: torch.nn.Module, *, layer_offset: int = 0
) -> list[tuple[int, str, torch.nn.Module]]:
    """``(global layer index, module name, module)`` of every core attention of the language
    decoder in ``model`` (`AUXILIARY_TOWERS` left out); one module per layer index."""
    out: list[tuple[int, str, torch.nn.Module]] = []
    seen: dict[int, str] = {}
    for name, mod in model.named_modules():
        if not name.endswith(CORE_ATTENTION_SUFFIX):
            continue
        if any(part in AUXILIARY_TOWERS for part in name.split(".")):
            continue
        layer = names.layer_index_from_megatron(name, layer_offset=layer_offset)
        if layer is None:
            raise ValueError(f"cannot read the decoder layer index from module name {name!r}")
        if layer in seen:
            raise ValueError(
                f"decoder layer {layer} has two core attentions, {seen[layer]!r} and {name!r}: "
                "one KV scale per layer cannot serve both"
            )
        seen[layer] = name
        out.append((layer, name, mod))
    return out


def _observe(
    observer: AmaxObserver, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    if k.dim() == 4:  # [s, b, h, d]
        observer.observe(layer, q, k, v, layout="sbhd")
    elif k.dim() == 3:  # packed [t, h, d]: one "sequence" of t tokens
        observer.observe(layer, q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), layout="sbhd")
    else:
        raise ValueError(
            f"layer {layer}: core attention got keys of shape {tuple(k.shape)}; expected "
            "[s, b, groups, head_dim] or packed [t, groups, head_dim]"
        )


def _make_hook(state: MegatronKVState, layer: int) -> Callable[..., Any]:
    def jetrl_kv_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if len(args) < 3:
            raise TypeError(
                f"layer {layer}: core attention was called with {len(args)} positional arguments; "
                "nemo_jetrl expects (query, key, value, ...) as Megatron-Core 0.16 passes them"
            )
        q, k, v = args[0], args[1], args[2]
        state.calls[layer] = state.calls.get(layer, 0) + 1
        if state.observer is not None:
            _observe(state.observer, layer, q, k, v)
        if not state.quantize:
            return None
        k2 = state.fake_quant(k, layer, "k")
        v2 = state.fake_quant(v, layer, "v")
        q2 = state.fake_quant(q, layer, "q") if state.quantize_q else q
        return (q2, k2, v2, *args[3:]), kwargs

    return jetrl_kv_pre_hook


class MegatronKVHandle:
    """Hooks on every core attention of one Megatron model; `restore` removes them."""

    def __init__(
        self,
        model: torch.nn.Module,
        state: MegatronKVState,
        *,
        layer_offset: int = 0,
        allow_empty: bool = False,
    ) -> None:
        mods = core_attention_modules(model, layer_offset=layer_offset)
        if not mods and not allow_empty:
            raise ValueError(
                f"no '*.{CORE_ATTENTION_SUFFIX}' module in {type(model).__name__}: is this a "
                "Megatron-Core GPTModel (or a wrapper of one)?"
            )
        self._live = True  # a pipeline stage may hold no full attention (hybrid models)
        self.model = model
        self.state = state
        self.layer_offset = layer_offset
        self.layers = [layer for layer, _, _ in mods]
        self.module_names = [n for _, n, _ in mods]
        self._handles = [
            mod.register_forward_pre_hook(_make_hook(state, layer), with_kwargs=True)
            for layer, _, mod in mods
        ]
        setattr(model, _HANDLE_ATTR, self)

    @property
    def active(self) -> bool:
        return self._live

    def set_scales(self, scales: KVScales | None) -> None:
        """Scales used by on-policy KV from the next forward on."""
        self.state.scales = scales

    def set_mode(self, *, quantize: bool, ste: bool = True, quantize_q: bool = False) -> None:
        """Turn on-policy KV fake quantization on or off."""
        self.state.quantize = quantize
        self.state.ste = ste
        self.state.quantize_q = quantize_q

    @contextmanager
    def bf16(self) -> Iterator[None]:
        """KV in BF16 during the block, whatever the mode: for a forward no rollout samples from
        (NeMo-RL's reference policy, a KL anchor), as the local backend's reference runs."""
        saved = self.state.quantize
        self.state.quantize = False
        try:
            yield
        finally:
            self.state.quantize = saved

    @contextmanager
    def observing(self, observer: AmaxObserver) -> Iterator[AmaxObserver]:
        """Feed ``observer`` during the block."""
        if self.state.observer is not None:
            raise RuntimeError("an observer is already attached to this model's attention")
        self.state.observer = observer
        try:
            yield observer
        finally:
            self.state.observer = None

    def restore(self) -> None:
        """Remove every hook (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._live = False
        if getattr(self.model, _HANDLE_ATTR, None) is self:
            delattr(self.model, _HANDLE_ATTR)

    def __enter__(self) -> MegatronKVHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def attach_megatron_kv(
    model: torch.nn.Module,
    *,
    scales: KVScales | None = None,
    onpolicy: bool = False,
    quantize_q: bool = False,
    kernel: Kernel = "cuda",
    layer_offset: int = 0,
    allow_empty: bool = False,
) -> MegatronKVHandle:
    """Hook every Megatron core attention of ``model`` (idempotent: a live handle is reused).

    ``onpolicy=True`` applies the rollout's FP8 KV quantization with ``scales`` (straight-through
    gradient). ``layer_offset`` is the pipeline stage's first global layer. ``allow_empty``: a
    pipeline stage without full attention (a hybrid model's linear-attention layers only) gets a
    live handle with no hooks, which calibration runs through (its amax comes from other stages).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: use one of {KERNELS}")
    existing = getattr(model, _HANDLE_ATTR, None)
    if isinstance(existing, MegatronKVHandle) and existing.active:
        if existing.layer_offset != layer_offset:
            raise ValueError(
                f"model already hooked with layer_offset={existing.layer_offset}, not {layer_offset}"
            )
        existing.state.kernel = kernel
        existing.set_scales(scales if scales is not None else existing.state.scales)
        existing.set_mode(quantize=onpolicy, quantize_q=quantize_q)
        return existing
    state = MegatronKVState(scales=scales, quantize=onpolicy, quantize_q=quantize_q, kernel=kernel)
    return MegatronKVHandle(model, state, layer_offset=layer_offset, allow_empty=allow_empty)


class LengthsObserver(AmaxObserver):
    """An `AmaxObserver` that also accepts per-sequence real lengths instead of a token mask.

    Megatron pads micro-batches to a length it chooses (``make_sequence_length_divisible_by``,
    context parallel alignment...), which a caller building a ``[batch, tokens]`` mask in
    advance cannot know. With ``set_lengths`` the mask is built when the keys arrive: token
    ``t`` of sequence ``b`` counts iff ``t < lengths[b]`` (right padding).
    """

    def __init__(self, include_q: bool = True) -> None:
        super().__init__(include_q=include_q)
        self._lengths: torch.Tensor | None = None

    def set_mask(self, mask: torch.Tensor | None) -> None:
        self._lengths = None
        super().set_mask(mask)

    def set_lengths(self, lengths: torch.Tensor) -> None:
        """Real (unpadded) length of each sequence of the next micro-batch, right-padded."""
        super().set_mask(None)
        self._lengths = lengths.reshape(-1).to(torch.long)

    def observe(self, layer, q, k, v, *, layout="bhtd") -> None:  # type: ignore[override]
        if self._lengths is not None:
            tokens = {"bhtd": k.shape[2], "bthd": k.shape[1], "sbhd": k.shape[0]}[layout]
            batch = {"bhtd": k.shape[0], "bthd": k.shape[0], "sbhd": k.shape[1]}[layout]
            if batch != self._lengths.numel():
                raise ValueError(
                    f"KV observer, layer {layer}: {self._lengths.numel()} lengths for a "
                    f"micro-batch of {batch} sequences"
                )
            pos = torch.arange(tokens, device=self._lengths.device)
            self._mask = pos[None, :] < self._lengths[:, None]
        super().observe(layer, q, k, v, layout=layout)


def calibrate_megatron(
    model: torch.nn.Module,
    micro_batches: Iterable[tuple[Callable[[], Any], torch.Tensor | None]],
    *,
    settings: CalibrationSettings | None = None,
    previous: KVScales | None = None,
    layer_offset: int = 0,
    reduce_amax: Callable[[dict[int, dict[str, float]]], dict[int, dict[str, float]]] | None = None,
) -> CalibrationResult:
    """Observe post-RoPE Q/K/V amax over micro-batches and turn them into per-layer FP8 scales.

    ``micro_batches`` yields ``(forward, token_mask)``: ``forward()`` runs the model on one
    micro-batch (the caller knows how: plain GPTModel call, NeMo-RL's ``get_logprobs``...),
    ``token_mask`` is that micro-batch's ``[batch, tokens]`` bool mask (build it with
    `nemo_jetrl.kvcache.token_mask`), or a 1-D integer tensor of real sequence lengths (right
    padding; the mask is then built at the width Megatron actually runs, see `LengthsObserver`),
    or None (every token, e.g. packed sequences without padding).
    ``reduce_amax`` combines per-rank results (data/pipeline parallel: elementwise max across
    ranks) before scales are computed. Invalid layers keep ``previous`` (with a warning).
    """
    settings = settings or CalibrationSettings()
    t0 = time.perf_counter()
    existing = getattr(model, _HANDLE_ATTR, None)
    handle = (
        existing
        if isinstance(existing, MegatronKVHandle) and existing.active
        else attach_megatron_kv(model, layer_offset=layer_offset)
    )
    observer = LengthsObserver(include_q=settings.include_q)
    sequences = 0
    try:
        with handle.observing(observer), torch.no_grad():
            for forward, mask in micro_batches:
                if (
                    mask is not None
                    and mask.dim() == 1
                    and not mask.dtype.is_floating_point
                    and mask.dtype != torch.bool
                ):
                    observer.set_lengths(mask)
                else:
                    observer.set_mask(mask)
                if mask is not None:
                    sequences += int(mask.shape[0])
                forward()
        amax = observer.amax(settings.reduction, settings.percentile)
        if reduce_amax is not None:
            amax = reduce_amax(amax)
        scales, refused = scales_from_amax(amax, settings, previous)
    finally:
        if handle is not existing:
            handle.restore()
    return CalibrationResult(
        scales=scales,
        amax=amax,
        refused=refused,
        micro_batches=observer.micro_batches,
        sequences=sequences,
        seconds=time.perf_counter() - t0,
    )
