"""Swap ``nn.Linear`` layers of a model for FP8 ones, in place, and report what was kept.

The recipe rule (DESIGN.md): a layer runs in FP8 only if the filter accepts it *and* its dims
pass TE's FP8 rule (`spec.linear_dims_problem`: in % 16, out % 8; partial 128-blocks run);
everything else stays in BF16, on both sides of an RL step, so the
trainer and the rollout must make the same choice. Training layers share the original
``Parameter`` objects, so an optimizer built before the swap keeps working. The returned
``ConversionReport`` (also logged) says which layers were converted and why others were kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from nemo_jetrl.fp8.config import Fp8LinearConfig
from nemo_jetrl.fp8.inference_linear import Fp8InferenceLinear, Quantizer
from nemo_jetrl.fp8.linear import Fp8BlockLinear
from nemo_jetrl.fp8.spec import linear_dims_problem

log = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]
"""``fn(module, fully_qualified_name) -> bool``: True to allow FP8 (torchao's convention)."""


@dataclass(frozen=True)
class ConversionReport:
    """Outcome of a conversion: converted layer names, and kept layers with the reason."""

    converted: tuple[str, ...] = ()
    """Fully qualified names of the ``nn.Linear`` layers now running in FP8."""

    kept: dict[str, str] = field(default_factory=dict)
    """Fully qualified name -> why it stayed high precision."""

    def summary(self) -> str:
        lines = [f"FP8 conversion: {len(self.converted)} converted, {len(self.kept)} kept"]
        lines += [f"  fp8  {name}" for name in self.converted]
        lines += [f"  kept {name}: {why}" for name, why in self.kept.items()]
        return "\n".join(lines)


def _plan(
    model: nn.Module, module_filter_fn: ModuleFilter | None
) -> tuple[list[tuple[str, nn.Linear]], dict[str, str]]:
    chosen, kept = [], {}
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear:  # already converted layers and subclasses are left alone
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, name):
            kept[name] = "rejected by module_filter_fn"
        elif (why := linear_dims_problem(mod.in_features, mod.out_features)) is not None:
            kept[name] = f"dims ({mod.out_features}, {mod.in_features}): {why}"
        else:
            chosen.append((name, mod))
    return chosen, kept


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _convert(model, module_filter_fn, make) -> ConversionReport:
    if isinstance(model, nn.Linear) and type(model) is nn.Linear:
        raise ValueError("convert the model that contains the nn.Linear, not the layer itself")
    chosen, kept = _plan(model, module_filter_fn)
    for name, mod in chosen:
        _swap(model, name, make(mod, name))
    report = ConversionReport(tuple(n for n, _ in chosen), kept)
    log.info("%s", report.summary())
    return report


def convert_to_fp8_training(
    model: nn.Module,
    config: Fp8LinearConfig | None = None,
    *,
    module_filter_fn: ModuleFilter | None = None,
) -> ConversionReport:
    """Replace eligible ``nn.Linear`` layers by ``Fp8BlockLinear`` (sharing their parameters)."""
    cfg = config or Fp8LinearConfig()
    return _convert(
        model, module_filter_fn, lambda mod, name: Fp8BlockLinear.from_linear(mod, cfg, name=name)
    )


def convert_to_fp8_inference(
    model: nn.Module,
    config: Fp8LinearConfig | None = None,
    *,
    module_filter_fn: ModuleFilter | None = None,
    quantizer: Quantizer = "jetrl",
) -> ConversionReport:
    """Replace eligible ``nn.Linear`` layers by ``Fp8InferenceLinear`` (weights quantized now).

    The rollout-side twin of ``convert_to_fp8_training``: given the same filter it converts the
    same set of layers. Refit later with ``layer.load_weight(w)`` / ``load_quantized(...)``.
    """
    cfg = config or Fp8LinearConfig()
    return _convert(
        model,
        module_filter_fn,
        lambda mod, name: Fp8InferenceLinear.from_linear(mod, cfg, quantizer=quantizer, name=name),
    )
