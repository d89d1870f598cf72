"""An independent, slow-but-simple statement of the quantization spec in float64 / exact rationals.

Used only by tests. It shares no code with ``nemo_jetrl.fp8``: the per-block scale is computed
with exact fractions and rounded to fp32 by hand (round-half-even via ``Fraction.__round__``), the
fp32 product ``x * scale`` and the saturating round-to-nearest-even to FP8 are done arithmetically
in float64 (exact power-of-two scaling plus ``torch.round``, which rounds half to even), never
with torch's float8 cast. Spec (DESIGN.md)::

    amax = max(max |x| over the block, eps);  scale = 1 if amax == 0 else fp32(fmax / amax)
    (inf -> finfo(input dtype).max; pow2: 2**floor(log2(scale)));  scale_inv = fp32(1 / scale)
    q = rne_saturating(clamp(fp32(x * scale), -fmax, fmax))
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import torch

# (significand bits incl. the implicit one, min normal exponent, max finite)
FP32 = (24, -126, float(torch.finfo(torch.float32).max))
E4M3 = (4, -6, 448.0)
E5M2 = (3, -14, 57344.0)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def fp32_of_fraction(q: Fraction) -> float:
    """Round a positive rational to fp32, half to even; inf on overflow (subnormals handled)."""
    p, emin, _ = FP32
    e = q.numerator.bit_length() - q.denominator.bit_length()  # floor(log2 q) or one more
    if Fraction(2) ** e > q:
        e -= 1
    e = max(e, emin)
    ulp = Fraction(2) ** (e - p + 1)
    v = round(q / ulp) * ulp  # Fraction rounding is half-to-even
    return math.inf if v >= 2**128 else float(v)


def fp32_of_float(x: float) -> float:
    """Nearest fp32 to a Python float (used only for eps, as torch casts a scalar argument)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def round_float64(v: torch.Tensor, fmt: tuple[int, int, float], *, saturate: bool) -> torch.Tensor:
    """Round exact float64 values to a binary format, half to even, arithmetically.

    With ``saturate`` values beyond max become +-max, otherwise +-inf (IEEE overflow).
    """
    p, emin, vmax = fmt
    _, e = torch.frexp(v)  # |v| = m * 2**e, m in [0.5, 1)  =>  floor(log2|v|) = e - 1
    e = torch.clamp(e.to(torch.float64) - 1, min=emin)
    ulp = torch.exp2(e - (p - 1))
    r = torch.round(v / ulp) * ulp  # exact: power-of-two scaling, then round half to even
    r = torch.where(v == 0, v, r)  # keep the sign of zero
    over = r.abs() > vmax
    big = torch.full_like(r, vmax if saturate else math.inf)
    return torch.where(over, torch.copysign(big, r), r)


def reference_quantize(
    x: torch.Tensor, block: tuple[int, int], fmt: str, pow2: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q values as float64 [input shape], scale_inv as float64 [ceil(M/bm), ceil(K/bk)])."""
    f = FORMATS[fmt]
    fmax = f[2]
    x2 = x.reshape(-1, x.shape[-1]).double()
    m, k = x2.shape
    bm, bk = block
    mb, kb = -(-m // bm), -(-k // bk)
    in_max = float(torch.finfo(x.dtype).max)
    eps32 = fp32_of_float(eps)
    # per-block amax (exact in float64), then the scale rule block by block on Python floats
    padded = torch.zeros(mb * bm, kb * bk, dtype=torch.float64)
    padded[:m, :k] = x2.abs()
    amaxes = padded.reshape(mb, bm, kb, bk).amax(dim=(1, 3)).tolist()
    scales, invs = [], []
    for amax in (a for row in amaxes for a in row):
        amax = max(amax, eps32)
        if amax == 0:
            s = 1.0
        else:
            s = fp32_of_fraction(Fraction(fmax) / Fraction(amax))
            if math.isinf(s):
                s = in_max
            if pow2:
                s = 2.0 ** (math.frexp(s)[1] - 1)
        scales.append(s)
        invs.append(fp32_of_fraction(1 / Fraction(s)))
    scale = torch.tensor(scales, dtype=torch.float64).reshape(mb, kb)
    scale_inv = torch.tensor(invs, dtype=torch.float64).reshape(mb, kb)
    full = scale.repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]
    prod = round_float64(x2 * full, FP32, saturate=False)  # x * scale is exact in float64
    q = round_float64(torch.clamp(prod, -fmax, fmax), f, saturate=True)
    return q.reshape(x.shape), scale_inv
