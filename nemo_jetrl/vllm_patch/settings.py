"""What the vLLM patch needs to know, in one frozen value that can cross process boundaries.

vLLM runs the model in worker processes it spawns itself. The patch reaches them through vLLM's
plugin entry point (see ``plugin.py``), which can only read the environment, so the settings are
serialized to JSON in one environment variable. Everything here is plain data: no torch, no vLLM.

The numbers are fixed by the design (DESIGN.md, "The quantization spec"): weights in 128x128
blocks, activations in 1x128 blocks (per token, along K), E4M3 for every forward tensor (the
``hybrid`` training format only changes gradients, which the rollout never sees). What varies per
recipe is the scale mode (power-of-two or FP32 scales), which linear layers stay BF16, and the KV
cache dtype.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pydantic import Field

from nemo_jetrl.config.typed import OurSection, choice, flag, number, parse, rule, words
from nemo_jetrl.fp8.spec import WEIGHT_BLOCK as WEIGHT_BLOCK  # re-exported

# The environment variable that carries the settings to vLLM's worker processes.
ENV_VAR = "NEMO_JETRL_VLLM_PATCH"
# Our kernel class's name in vLLM's registry (kernel.make_kernel_class), as VLLM_DISABLED_KERNELS
# would name it.
KERNEL_NAME = "JetRLFp8BlockLinearKernel"
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")
# HF projection names of a Llama/Qwen decoder layer, and the module that holds each.
ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
# The latent-attention (MLA: DeepSeek-V2/V3, Moonlight) projections besides o_proj (arch/mla.py);
# vLLM fuses q_a_proj + kv_a_proj_with_mqa into fused_qkv_a_proj when q_lora_rank is set.
MLA_PROJS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# The gated DeltaNet's linears (Qwen3.5's checkpoint names; vLLM fuses in_proj_qkv + in_proj_z
# into in_proj_qkvz and in_proj_b + in_proj_a into in_proj_ba); the recipe's BF16 keywords keep
# some BF16 (NeMo-RL's Qwen3.5 configs: in_proj_a, in_proj_b, conv1d).
GDN_PROJS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@dataclass(frozen=True)
class PatchSettings:
    """How the patched vLLM quantizes; built from a Recipe by ``settings_from_recipe``."""

    fp8_weights: bool = True
    """Block-FP8 linear layers in the rollout. False (BF16 rollout) needs no quantizer patch."""
    pow2_weight_scales: bool = True
    """Weight (128x128) block scales are powers of two (TE's default) or exact FP32 quotients."""
    pow2_activation_scales: bool = True
    """Activation (1x128) scales are powers of two or FP32 quotients. With FP32 scales vLLM's own
    quantizer differs from TE's formula; the patch supplies TE's formula (nemo_jetrl.fp8)."""
    fmt: str = "e4m3"
    """FP8 format of forward tensors (weights and activations). Always e4m3 for the rollout."""
    modules_to_not_convert: tuple[str, ...] = ("lm_head",)
    """vLLM module prefixes kept in BF16 (exact names, e.g. ``model.layers.0.self_attn.q_proj``);
    must be the same set the training side keeps in BF16."""
    bf16_layer_kws: tuple[str, ...] = ()
    """Per-name BF16 linears (the recipe's rollout list): a linear whose name contains one of
    these words is never quantized by a refit; their vLLM names are also in
    ``modules_to_not_convert`` when the model's layer count was known."""
    kv_cache_dtype: str = "auto"
    """vLLM ``kv_cache_dtype``: ``auto`` (model dtype) or ``fp8``/``fp8_e4m3`` (per-tensor scales
    calibrated by the trainer and sent at refit)."""
    eps: float = 0.0
    """Floor on per-block amax before the scale is computed (the spec's eps; 0 = none)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """Free-form notes carried along (never read by the patch)."""

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("modules_to_not_convert", "bf16_layer_kws"):
            v = values[name]
            values[name] = list(v) if isinstance(v, (list, tuple)) else v
        _checked(values, "PatchSettings")
        for name in ("modules_to_not_convert", "bf16_layer_kws"):  # lists from JSON
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    def to_json(self) -> str:
        d = asdict(self)
        d["modules_to_not_convert"] = list(self.modules_to_not_convert)
        d["bf16_layer_kws"] = list(self.bf16_layer_kws)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PatchSettings:
        """Settings from `to_json`'s text; ValueError naming every bad key (strict: the string
        "false" is not a boolean)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV_VAR} is not valid JSON ({exc}): {text[:200]!r}") from exc
        return cls(**_checked(d, ENV_VAR))


class _Wire(OurSection):
    """The rules of every `PatchSettings` field (the typed schema, `nemo_jetrl.config.typed`);
    the defaults are `PatchSettings`'s (a key not given stays unset here)."""

    fp8_weights: flag() = None  # type: ignore[valid-type]
    pow2_weight_scales: flag() = None  # type: ignore[valid-type]
    pow2_activation_scales: flag() = None  # type: ignore[valid-type]
    fmt: choice("e4m3") = None  # type: ignore[valid-type]  # rollout forward tensors
    modules_to_not_convert: words(null=False) = None  # type: ignore[valid-type]
    bf16_layer_kws: words(null=False) = None  # type: ignore[valid-type]
    kv_cache_dtype: choice(*KV_CACHE_DTYPES) = None  # type: ignore[valid-type]
    eps: number("a finite number >= 0", Field(ge=0)) = None  # type: ignore[valid-type]
    extra: rule(dict, "a mapping") = None  # type: ignore[valid-type]


def _checked(values: Any, where: str) -> dict[str, Any]:
    """``values`` read by `_Wire`; ValueError listing every problem."""
    model, issues = parse(_Wire, values)
    if model is None:
        raise ValueError(f"invalid {where}: " + "; ".join(str(i) for i in issues))
    out = {name: getattr(model, name) for name in model.model_fields_set}
    for name in ("modules_to_not_convert", "bf16_layer_kws"):
        if name in out:
            out[name] = tuple(out[name])
    return out


def bf16_layer_modules(layer_indices: list[int] | range, prefix: str = "model.layers") -> list[str]:
    """vLLM module names of every linear in the given decoder layers (for first-N/last-M BF16)."""
    out = []
    for i in layer_indices:
        out += [f"{prefix}.{i}.self_attn.{p}" for p in ATTN_PROJS + MLA_PROJS]
        out += [f"{prefix}.{i}.mlp.{p}" for p in MLP_PROJS]
    return out


def settings_from_recipe(recipe: Any, *, num_layers: int | None = None) -> PatchSettings:
    """PatchSettings for the rollout side of a ``nemo_jetrl.recipe.Recipe`` (or a PatchSettings).

    Uses the rollout's FP8 switch, scale modes and BF16 first/last layers, and the recipe's KV
    cache dtype. ``num_layers`` (the model's decoder layer count) is needed when the recipe keeps
    the last M layers in BF16, to name them for vLLM. Raises ValueError for rollout settings the
    patch cannot serve (non-blockwise scaling, vLLM's own quantizer).
    """
    if isinstance(recipe, PatchSettings):
        return recipe
    rollout = getattr(recipe, "rollout", None)
    if rollout is None or not hasattr(rollout, "fp8_linears"):
        raise TypeError(
            f"expected a nemo_jetrl.recipe.Recipe or a PatchSettings, got {type(recipe).__name__}"
        )
    name = getattr(recipe, "name", "custom")
    if rollout.fp8_linears:
        problems = []
        if rollout.scaling != "blockwise":
            problems.append(
                f"rollout.scaling={rollout.scaling!r}: the patch serves 'blockwise' only"
            )
        if rollout.quantizer != "jetrl":
            problems.append(
                f"rollout.quantizer={rollout.quantizer!r}: the patch is what makes the rollout "
                "quantizer 'jetrl'; with 'vllm' run vLLM unpatched (off-policy)"
            )
        if problems:
            raise ValueError(f"recipe {name!r} cannot use the vLLM patch: " + "; ".join(problems))
    first_n, last_m = int(rollout.bf16_first_layers), int(rollout.bf16_last_layers)
    kws = tuple(getattr(rollout, "bf16_layer_kws", ()))
    layers: list[int] = list(range(first_n))
    if last_m:
        if num_layers is None:
            raise ValueError(
                f"recipe {name!r} keeps the last {last_m} decoder layers in BF16: pass "
                "num_layers= (the model's num_hidden_layers) so their names can be listed for vLLM"
            )
        layers += [i for i in range(num_layers - last_m, num_layers) if i not in layers]
    named = [
        m
        for m in bf16_layer_modules(range(num_layers or 0))
        if any(kw in m for kw in kws) and m not in bf16_layer_modules(layers)
    ]
    kv = str(getattr(recipe, "kv_cache_dtype", "auto"))
    return PatchSettings(
        fp8_weights=bool(rollout.fp8_linears),
        pow2_weight_scales=bool(rollout.pow2_weight_scales),
        pow2_activation_scales=bool(rollout.pow2_activation_scales),
        kv_cache_dtype=kv,
        modules_to_not_convert=("lm_head", *bf16_layer_modules(layers), *named),
        bf16_layer_kws=kws,
    )
