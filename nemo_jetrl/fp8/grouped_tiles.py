"""The program shapes of the grouped rows GEMM (`triton_grouped.gemm_rows`) and how one is chosen.

Chosen from the shapes alone (routed rows M, experts E), never from the expert counts on the
device, so choosing reads nothing on the host. Every shape runs the same per-element
arithmetic: the 128-wide K tile's dot on one wgmma m64n128k32 per 64 rows on Hopper (a 16-row
tile would take mma.sync and other bits, seen on an H100: never below 64 rows), then
`_triton_common.scaled_accumulate` in K order; so a row's bits do not depend on the shape, and
the training forward and the serving layer agree whichever shape each picks (tested under the
interpreter; the PTX of each shape is checked for the same wgmma in tests/fp8).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from nemo_jetrl.fp8.triton_launch import sm_count


@dataclass(frozen=True)
class RowsTile:
    """A program shape of `gemm_rows`: ``bm`` rows (64 or 128: never fewer on the FP8 dot, a
    16-row tile takes another MMA instruction and other bits, seen on an H100), ``warps``
    (4 per 64 rows: one wgmma warpgroup each, the same m64n128k32 instruction in every
    shape), ``stages`` of the load pipeline, ``ctas_per_sm``: 0 launches one program per
    possible tile, else a persistent grid of that many programs per SM; ``tma``: the operands
    that are whole contiguous matrices (the weights [E, N, K], an ungathered A) are loaded by
    TMA descriptors, the rest by pointers; ``maxnreg``: a register cap so that more programs
    fit on an SM (168 lets three 4-warp programs share one's 64K registers)."""

    bm: int
    warps: int
    stages: int
    ctas_per_sm: int
    tma: bool = False
    maxnreg: int | None = None

    @property
    def label(self) -> str:
        grid = f"persistent x{self.ctas_per_sm}/SM" if self.ctas_per_sm else "one tile/program"
        tma = ", TMA" if self.tma else ""
        cap = f", maxnreg {self.maxnreg}" if self.maxnreg else ""
        return f"{self.bm}x128, {self.warps} warps, {self.stages} stages, {grid}{tma}{cap}"

    @property
    def options(self) -> dict:
        """Launch options (``num_stages`` is the caller's: 1 on the value-table path)."""
        return {"num_warps": self.warps, **({"maxnreg": self.maxnreg} if self.maxnreg else {})}


# Named shapes (``JETRL_FP8_GROUPED_ROWS_TILE`` forces one); every one gives the same bits.
ROWS_TILES = {
    "d64": RowsTile(64, 4, 3, 0),  # decode: the old kernel's shape (1.43x BF16, H100, graph)
    "p64": RowsTile(64, 4, 3, 2),
    "p128": RowsTile(128, 8, 3, 1),  # prefill default: two warpgroups a tile, one program/SM
    "g128": RowsTile(128, 8, 3, 0),
    "p128t": RowsTile(128, 8, 3, 1, tma=True),
    "p64t": RowsTile(64, 4, 3, 2, tma=True),
    # 168 registers: no spill in the down GEMM, 60 bytes in gate_up (ptxas 13.4 on sm_90a).
    "p64t3": RowsTile(64, 4, 3, 3, tma=True, maxnreg=168),
}
ENV_ROWS_TILE = "JETRL_FP8_GROUPED_ROWS_TILE"
INTERPRETER_PROGRAMS = 3  # a persistent grid under the interpreter: each program loops


def rows_tile(m: int, num_experts: int) -> str:
    """The `ROWS_TILES` name for ``m`` routed rows over ``num_experts``: 128-row persistent
    tiles once the experts average 128 rows (prefill), else 64-row tiles. Shapes only: no
    host read, and the bits do not depend on the choice."""
    forced = os.environ.get(ENV_ROWS_TILE, "auto").strip().lower()
    if forced != "auto":
        if forced not in ROWS_TILES:
            raise ValueError(f"{ENV_ROWS_TILE}={forced!r}: use auto or one of {list(ROWS_TILES)}")
        return forced
    return "p128" if m >= 128 * num_experts else "d64"


def rows_grid(
    tile: RowsTile, m: int, n: int, num_experts: int, device: torch.device, interpreter: bool
) -> int:
    """Programs of `gemm_rows`: a bound on the (row tile, column tile) pairs from the shapes
    (``sum_e ceil(count_e / BM) <= M // BM + E``), capped by the persistent grid."""
    bound = (m // tile.bm + num_experts) * (-(-n // 128))
    if not tile.ctas_per_sm:
        return bound
    per_sm = INTERPRETER_PROGRAMS if interpreter else sm_count(device) * tile.ctas_per_sm
    return min(bound, per_sm)
