"""One streamed batch of NeMo-RL's vLLM refit through our quantizer, and the parity check after.

NeMo-RL's vLLM worker hands the refit to ``fp8.load_weights`` batch by batch; the hook in
`vllm_refit` replaces that function with one that calls `quantize_batch`: each weight the recipe
runs in FP8 becomes our FP8 ``weight`` + ``weight_scale_inv`` (``refit.quantize_state_dict``,
its guards included), the rest passes through, and what was sent is kept in a `SentTensors`
for `check_refit_parity`, which compares it with what the engine holds once the transport is
done (FP8 bytes and scales bit for bit, other tensors byte for byte, KV scales by value).
MoE expert weights (per expert or main's grouped slabs) go the same way, one expert at a time,
and are read back from vLLM's fused expert parameters (`refit_experts`).

Host memory (parity on): one host copy of this rank's part of what was sent (the reference: NeMo-RL
streams every full tensor to every vLLM rank, so each rank narrows to its tensor-parallel shard
and its experts before copying, and keeps host memory at its share of the model, not TP times
it), plus one engine tensor at a time while comparing (``worker_ext.read_back``; no read-back
clones of everything, no safetensors round trip in the worker). Measured:
benchmarks/bench_refit_host_memory.py.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_jetrl.backends.nemo_rl import refit_experts
from nemo_jetrl.vllm_patch import compat, expert_shards
from nemo_jetrl.vllm_patch.refit import (
    REFUSED,
    SCALE_SUFFIX,
    ParityError,
    ParityReport,
    QuantizedStateDict,
    RefitError,
    check_parity,
    is_fp8_weight,
    quantize_state_dict,
)
from nemo_jetrl.vllm_patch.settings import PatchSettings
from nemo_jetrl.vllm_patch.worker_ext import resolve_hf_name

KV_NAME = re.compile(r"^(?P<layer>.+\.self_attn)\.(?:attn\.)?(?P<t>[qkv])_scale$")


@dataclass
class SentTensors:
    """What one refit sent through the hook (tensors kept only while parity is on; the KV
    scales always)."""

    fp8: dict[str, torch.Tensor] = field(default_factory=dict)
    """This rank's part of each FP8 weight and scale sent (``expert_shards.rank_expected``)."""
    fp8_layers: list[str] = field(default_factory=list)
    other: dict[str, torch.Tensor] = field(default_factory=dict)
    """This rank's part of each other tensor sent that the engine holds."""
    kv: dict[str, dict[str, float]] = field(default_factory=dict)
    elsewhere: int = 0
    """Tensors sent of routed experts another expert-parallel rank holds (not kept)."""
    error: Exception | None = None
    keep: bool = True
    """False when parity is off: nothing is kept, errors are still recorded."""

    def keep_part(self, model: torch.nn.Module, into: dict, name: str, t: torch.Tensor) -> None:
        """One host copy of this rank's part of ``t``, sent as ``name`` (narrowed first: a
        copy of the full tensor on every tensor-parallel rank costs TP times the model)."""
        try:  # a shard off 128-block edges, or anything else: refused, the stream goes on
            slab = refit_experts.grouped_param(model, name) is not None  # a BF16 slab, whole
            mine = (refit_experts.slab_rank_expected if slab else expert_shards.rank_expected)(
                model, name, t
            )
        except Exception as exc:
            raise RefitError(f"refit refused: {name}: {type(exc).__name__}: {exc}") from exc
        if mine is None:
            self.elsewhere += 1
        else:
            into[name] = mine.detach().to("cpu", copy=True)


def _engine_dtype(model: torch.nn.Module, name: str) -> torch.dtype | None:
    if (slab := refit_experts.grouped_param(model, name)) is not None:
        return slab.dtype
    if (dtype := expert_shards.fused_dtype(model, name)) is not None:
        return dtype  # also for an expert another expert-parallel rank holds
    try:
        return resolve_hf_name(model, name)[1].dtype
    except (KeyError, AttributeError, IndexError):
        return None


def _scale_of_no_attention(model: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` is a KV scale of a decoder layer the engine built without softmax
    attention (no ``self_attn``: a hybrid model's linear-attention layer)."""
    m = KV_NAME.match(name)
    if m is None:
        return False
    decoder_layer, _, attn = m["layer"].rpartition(".")
    try:
        return not hasattr(model.get_submodule(decoder_layer), attn)
    except AttributeError:
        return False  # no such decoder layer: the loader and the parity check name it


def _float32_kv_scale(model: torch.nn.Module, layer: str, t: str) -> None:
    """Make the attention layer's ``{t}_scale`` parameter float32 before the loader copies into
    it: vLLM creates it under the model's default dtype (``torch.tensor(-1.0)`` inside
    ``set_default_torch_dtype(bf16)``), so a calibrated fp32 scale would land rounded to BF16
    and attention (whose ``_k_scale`` is float32) would use another scale than the trainer's
    on-policy KV. The hooked transport widens every layer's first (`float32_kv_scales`), so
    this finds them float32 there; a rollback leaves them float32, with the same values."""
    try:
        module = model.get_submodule(f"{layer}.attn")
    except AttributeError:
        return  # not an attention layer here: the loader and the parity check name it
    param = getattr(module, f"{t}_scale", None)
    if isinstance(param, torch.Tensor) and param.dtype != torch.float32:
        param.data = param.data.to(torch.float32)


def float32_kv_scales(model: torch.nn.Module) -> int:
    """Make every attention layer's q/k/v scale parameters float32 (`_float32_kv_scale`), before
    the refit's rollback snapshot and graph bindings are recorded: widening them inside the
    transport would look like a rebinding to another dtype (`graph_bindings`; the graphs read
    ``_k_scale``, never these). Returns how many were widened."""
    n = 0
    for m in model.modules():
        if not compat.is_attention_layer(m):
            continue
        for t in "qkv":
            param = getattr(m, f"{t}_scale", None)
            if isinstance(param, torch.Tensor) and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)
                n += 1
    return n


def quantize_batch(
    weights: list[tuple[str, torch.Tensor]],
    model: torch.nn.Module,
    settings: PatchSettings,
    sent: SentTensors | None,
    *,
    refused: str = REFUSED,
) -> list[tuple[str, torch.Tensor]]:
    """One streamed batch -> what the model's ``load_weights`` gets (our FP8 + scales);
    ``refused`` opens a refusal's message. MoE experts: per expert (`refit_experts`)."""
    codes = [k for k, v in weights if v.dtype.itemsize == 1 and v.dtype.is_floating_point]
    if codes:  # before launch, `tree_rules` refuses the config that sends them
        raise RefitError(
            f"refit refused: the trainer sent FP8 tensors ({', '.join(codes[:3])}"
            f"{', ...' if len(codes) > 3 else ''}): NeMo-RL refits TE's own FP8 weights with "
            "policy.megatron_cfg.fp8_cfg.fp8_param=true, which this hook does not load; set it "
            "to false (training stays FP8)"
        )
    weights = refit_experts.expand_grouped(weights, model, settings)
    # NeMo-RL names q/k/v scales for every decoder layer, the linear-attention layers of a
    # hybrid model too (1.0): vLLM 0.20's loader drops those, 0.25's raises. Not loaded here.
    weights = [(k, v) for k, v in weights if not _scale_of_no_attention(model, k)]
    fp8_names = {k for k, _ in weights if is_fp8_weight(k, settings)}
    wrong = []
    for k, _ in weights:
        if not k.endswith(".weight"):
            continue
        dtype = _engine_dtype(model, k)
        engine_fp8 = dtype is not None and dtype.itemsize == 1 and dtype.is_floating_point
        if (k in fp8_names) != engine_fp8 and (dtype is not None or k in fp8_names):
            wrong.append(
                f"{k}: the recipe runs it in {'FP8' if k in fp8_names else 'BF16'}, the engine "
                f"holds {dtype}"
            )
    if wrong:
        raise RefitError(
            "refit refused: the vLLM engine's FP8 layers differ from the recipe's (align "
            "policy.generation.vllm_cfg num_*_layers_in_bf16 / quantization_ignored_layer_kws "
            "with jetrl's BF16 layers):\n  - " + "\n  - ".join(wrong)
        )
    fp8 = {k: v for k, v in weights if k in fp8_names}
    qsd = quantize_state_dict(fp8, settings, refused=refused)
    out: list[tuple[str, torch.Tensor]] = []
    for k, v in weights:
        if k in fp8_names:
            scale = f"{k[: -len('.weight')]}.{SCALE_SUFFIX}"
            out += [(k, qsd.tensors[k]), (scale, qsd.tensors[scale])]
        elif (m := KV_NAME.match(k)) is not None:
            # NeMo-RL names q "<layer>.self_attn.attn.q_scale"; vLLM's loader (0.20's
            # maybe_remap_kv_scale_name) maps that to "...attn.attn.q_scale" and drops it. The
            # k/v form loads: "<layer>.self_attn.q_scale" -> "<layer>.self_attn.attn.q_scale".
            _float32_kv_scale(model, m["layer"], m["t"])
            out.append((f"{m['layer']}.{m['t']}_scale", v))
        else:
            out.append((k, v))
    if sent is not None:  # KV scales always (vLLM's wake-up resets them: kv_wake.py)
        for k, v in weights:
            if k not in fp8_names and (m := KV_NAME.match(k)) is not None:
                sent.kv.setdefault(f"{m['layer']}.attn", {})[m["t"]] = float(v.reshape(-1)[0])
    if sent is not None and sent.keep:
        for k, t in qsd.tensors.items():
            sent.keep_part(model, sent.fp8, k, t)
        sent.fp8_layers += qsd.fp8_layers
        for k, v in weights:
            if k in fp8_names or KV_NAME.match(k) is not None:
                continue
            if _engine_dtype(model, k) is not None:
                sent.keep_part(model, sent.other, k, v)
    return out


def _kv_differences(model: torch.nn.Module, kv: dict[str, dict[str, float]], fp8_kv: bool) -> list:
    """Sent KV scales vs the attention layers' loaded parameters (and, with an FP8 KV cache, the
    values its kernels use)."""
    out = []
    for layer, per in sorted(kv.items()):
        module = model.get_submodule(layer)
        used = compat.read_attention_kv_scales(module) if fp8_kv else {}
        for t, want in sorted(per.items()):
            w32 = float(torch.tensor(want, dtype=torch.float32))
            param = getattr(module, f"{t}_scale", None)
            got = float(param.reshape(-1)[0]) if isinstance(param, torch.Tensor) else None
            if got != w32:
                out.append(
                    f"{layer}.{t}_scale (sent {want!r}, the layer's parameter holds {got!r})"
                )
            elif fp8_kv and used.get(t) != w32:
                out.append(f"{layer}.{t}_scale (sent {want!r}, attention uses {used.get(t)!r})")
    return out


def check_refit_parity(worker: Any, sent: SentTensors) -> ParityReport:
    """Everything one refit sent vs what the engine now holds; ParityError names differences.
    ``sent`` holds this rank's part of each tensor (`SentTensors.keep_part`)."""
    model = worker.model_runner.model
    mine, elsewhere = {**sent.fp8, **sent.other}, sent.elsewhere
    layers = tuple(m for m in sent.fp8_layers if f"{m}.weight" in mine)
    qsd = QuantizedStateDict(mine, layers, tuple(n for n in sent.other if n in mine))
    report = check_parity(
        None, qsd, functools.partial(refit_experts.read_back_with_experts, worker)
    )
    fp8_kv = "fp8" in str(worker.vllm_config.cache_config.cache_dtype)
    kv = _kv_differences(model, sent.kv, fp8_kv)
    if kv:
        raise ParityError("refit parity check failed: KV scales differ:\n  - " + "\n  - ".join(kv))
    return ParityReport(
        compared=report.compared + sum(len(p) for p in sent.kv.values()),
        fp8=report.fp8,
        through_kernel=report.through_kernel,
        differing=(),
        not_local=elsewhere,
    )
