"""FP8 formats and scale modes.

E4M3 (4 exponent bits, 3 mantissa bits, max 448) has more precision and is used for weights and
activations; E5M2 (5 exponent bits, 2 mantissa bits, max 57344) has more range and is used for
gradients in the ``hybrid`` recipe. Both are torch's "fn"/IEEE-like variants that TE, vLLM and
DeepGEMM use on Hopper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 element format."""

    name: str  # "e4m3" or "e5m2"
    dtype: torch.dtype  # torch storage dtype
    fmax: float  # largest finite magnitude; quantized values saturate here


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0)
FORMATS: dict[str, Fp8Format] = {f.name: f for f in (E4M3, E5M2)}

# Recipe-level format names (TE's `fp8` knob): which format forward and backward tensors use.
RECIPE_FORMATS = ("e4m3", "hybrid")


def get_format(fmt: str | Fp8Format) -> Fp8Format:
    """Resolve a format name ("e4m3"/"e5m2") to its Fp8Format."""
    if isinstance(fmt, Fp8Format):
        return fmt
    try:
        return FORMATS[str(fmt).lower()]
    except KeyError:
        raise ValueError(f"unknown FP8 format {fmt!r}: use one of {sorted(FORMATS)}") from None


def grad_format(recipe_format: str) -> Fp8Format:
    """Format of gradients under a recipe format: E5M2 for ``hybrid``, else E4M3."""
    if recipe_format not in RECIPE_FORMATS:
        raise ValueError(
            f"unknown FP8 recipe format {recipe_format!r}: use one of {RECIPE_FORMATS}"
        )
    return E5M2 if recipe_format == "hybrid" else E4M3
