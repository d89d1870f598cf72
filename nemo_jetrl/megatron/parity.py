"""Compare two FP8 refit exports tensor by tensor (`export.parity_check`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nemo_jetrl.fp8 import BlockQuantized


def parity_check(
    reference: Mapping[str, BlockQuantized], other: Mapping[str, BlockQuantized]
) -> list[str]:
    """Every difference between two FP8 exports, one line per tensor (empty list: bit-identical)."""
    problems = []
    for name in sorted(set(reference) | set(other)):
        a, b = reference.get(name), other.get(name)
        if a is None or b is None:
            problems.append(f"{name}: only in {'reference' if b is None else 'other'} export")
            continue
        if a.data.shape != b.data.shape or a.scale_inv.shape != b.scale_inv.shape:
            problems.append(
                f"{name}: shapes differ (data {tuple(a.data.shape)} vs {tuple(b.data.shape)}, "
                f"scale_inv {tuple(a.scale_inv.shape)} vs {tuple(b.scale_inv.shape)})"
            )
            continue
        da = a.data.view(torch.uint8).cpu()
        db = b.data.view(torch.uint8).cpu()
        nd = int((da != db).sum())
        ns = int(
            (
                a.scale_inv.float().cpu().view(torch.int32)
                != b.scale_inv.float().cpu().view(torch.int32)
            ).sum()
        )
        if nd or ns:
            problems.append(f"{name}: {nd} FP8 bytes and {ns} block scales differ")
    return problems
