"""Non-finite FP8 operands found without a host sync (the FP8 linear layers on CUDA).

On CPU the layers quantize with ``check_finite=True``: NaN/inf input raises at once, naming the
tensor. On CUDA that check is a device sync per quantization (five per linear per step), so
there they quantize with ``check_finite=False`` (a block holding NaN/inf gets a NaN
``scale_inv``, so what it touches turns NaN) and `record` ORs "this operand had a NaN scale"
into a device flag per tensor name. `check_non_finite` reads every flag with one host read and
raises the error naming the tensors; call it once per step where the trainer already syncs
(after reading the loss).
"""

from __future__ import annotations

import torch

_FLAGS: dict[tuple[str, torch.device], torch.Tensor] = {}
_TEMPLATES: set[str] = set()  # names recorded by `record_each` (one flag per group)


def sync_free(t: torch.Tensor) -> bool:
    """Whether quantizations of ``t`` defer the finiteness check (CUDA tensors)."""
    return t.is_cuda


def record(name: str, scale_inv: torch.Tensor) -> None:
    """Note on the device whether ``scale_inv`` holds a NaN (no host read)."""
    bad = torch.isnan(scale_inv).any()
    key = (name, scale_inv.device)
    flag = _FLAGS.get(key)
    if flag is None:
        _FLAGS[key] = bad
    else:
        flag.logical_or_(bad)


def record_each(template: str, bad: torch.Tensor) -> None:
    """Per-group flags in one tensor (no host read): ``bad[i]`` True names
    ``template.format(i)`` (e.g. ``"moe.expert{}.input"``: the grouped expert linear)."""
    key = (template, bad.device)
    _TEMPLATES.add(template)
    bad = bad.reshape(-1)
    flag = _FLAGS.get(key)
    if flag is None:
        _FLAGS[key] = bad.clone()
        return
    if flag.numel() < bad.numel():
        # More groups than the pending flag holds (a flag left by a step that never reached
        # check_non_finite, or another layer under the same template): flag i stays group i.
        flag = _FLAGS[key] = torch.cat([flag, flag.new_zeros(bad.numel() - flag.numel())])
    flag[: bad.numel()].logical_or_(bad)


def pending() -> int:
    """How many tensor names have a flag waiting to be read."""
    return len(_FLAGS)


def check_non_finite() -> None:
    """Raise ValueError naming every tensor recorded with non-finite values since the last call
    (one host read per device); the flags are cleared either way."""
    keys = list(_FLAGS)
    flags = [_FLAGS.pop(k) for k in keys]
    bad: list[str] = []
    for device in dict.fromkeys(k[1] for k in keys):
        idx = [i for i, k in enumerate(keys) if k[1] == device]
        values = torch.cat([flags[i].reshape(-1) for i in idx]).tolist()
        for i in idx:
            n, name = flags[i].numel(), keys[i][0]
            vals, values = values[:n], values[n:]
            if name in _TEMPLATES:
                bad += [name.format(j) for j, v in enumerate(vals) if v]
            elif any(vals):
                bad.append(name)
    if bad:
        raise ValueError(
            f"non-finite values in FP8 operand(s) {bad} (found on the device without a host "
            "sync: their blocks got NaN scale_inv, so this step's outputs and gradients hold "
            "NaN). Refusing to go on: fix the producer of these tensors (diverged update? bad "
            "checkpoint?)."
        )


__all__ = ["check_non_finite", "pending", "record", "record_each", "sync_free"]
