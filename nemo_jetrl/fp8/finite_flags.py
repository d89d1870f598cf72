"""Non-finite FP8 operands found without a host sync (the FP8 linear layers on CUDA).

On CPU the layers quantize with ``check_finite=True``: NaN/inf input raises at once, naming the
tensor. On CUDA that check is a device sync per quantization (five per linear per step), so
there they quantize with ``check_finite=False`` (a block holding NaN/inf gets a NaN
``scale_inv``, so what it touches turns NaN) and note "this operand had a NaN scale" in a device
flag per tensor name. The Triton quantizers write that flag themselves: pass
``nonfinite_flag=flag(name, device)`` and the kernel stores 1 there from the NaN marker it
computes anyway (no isnan/any kernels per call; the buffer is reused step after step). Other
paths call `record` (isnan + any + or on the scales). `check_non_finite` reads every flag with
one host read and raises the error naming the tensors; call it once per step where the trainer
already syncs (after reading the loss).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_FLAGS: dict[tuple[str, torch.device], torch.Tensor] = {}
_TEMPLATES: set[str] = set()  # names recorded by `record_each` (one flag per group)
_SPARE: dict[tuple[str, torch.device], torch.Tensor] = {}  # read `flag` buffers, zeroed for reuse


def sync_free(t: torch.Tensor) -> bool:
    """Whether quantizations of ``t`` defer the finiteness check (CUDA tensors)."""
    return t.is_cuda


def flag(name: str, device: torch.device | str) -> torch.Tensor:
    """The int32 ``[1]`` device flag for ``name`` a quantizer kernel sets to 1 on non-finite
    input (its ``nonfinite_flag``); pending until `check_non_finite` reads it. One allocation
    per name and device for the whole run: a read flag is zeroed and handed out again."""
    key = (name, torch.device(device))
    got = _FLAGS.get(key)
    if got is None:
        got = _SPARE.pop(key, None)
        if got is None:
            got = torch.zeros(1, dtype=torch.int32, device=key[1])
        _FLAGS[key] = got
    return got


def note(flag_t: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Set ``flag_t`` (from `flag`) where ``scale_inv`` holds a NaN: paths whose quantizer does
    not write the flag itself (the torch reference). No host read."""
    flag_t.logical_or_(torch.isnan(scale_inv).any())


def record(name: str, scale_inv: torch.Tensor) -> None:
    """Note on the device whether ``scale_inv`` holds a NaN (no host read)."""
    note(flag(name, scale_inv.device), scale_inv)


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
        values = torch.cat([flags[i].reshape(-1).int() for i in idx]).tolist()
        for i in idx:
            n, name = flags[i].numel(), keys[i][0]
            vals, values = values[:n], values[n:]
            if name in _TEMPLATES:
                bad += [name.format(j) for j, v in enumerate(vals) if v]
            elif any(vals):
                bad.append(name)
    reuse = [(k, f) for k, f in zip(keys, flags, strict=True) if k[0] not in _TEMPLATES]
    if reuse:  # after the read: zeroing is ordered after it on the device's stream
        torch._foreach_zero_([f for _, f in reuse])
        _SPARE.update(reuse)
    if bad:
        raise ValueError(
            f"non-finite values in FP8 operand(s) {bad} (found on the device without a host "
            "sync: their blocks got NaN scale_inv, so this step's outputs and gradients hold "
            "NaN). Refusing to go on: fix the producer of these tensors (diverged update? bad "
            "checkpoint?)."
        )


@contextmanager
def isolated() -> Iterator[dict[tuple[str, torch.device], torch.Tensor]]:
    """Run the body with no pending or spare flag, so every `flag` it asks for is a new buffer
    (made where the body first asks: before a CUDA graph capture, not inside it). Yields the
    body's pending flags; the flags from before are back afterwards (`graphed`)."""
    global _FLAGS, _SPARE
    saved = _FLAGS, _SPARE
    _FLAGS, _SPARE = {}, {}
    try:
        yield _FLAGS
    finally:
        _FLAGS, _SPARE = saved


def rearm(flags: dict[tuple[str, torch.device], torch.Tensor]) -> None:
    """Hand a CUDA graph's flag buffers back as pending (a replay sets them, and runs no host
    code that would call `flag`), so `check_non_finite` reads them. A name pending with another
    buffer (the same layer run eagerly since) keeps both: the graph's as "NAME (CUDA graph)"."""
    for key, buf in flags.items():
        cur = _FLAGS.get(key)
        if cur is None:
            if _SPARE.get(key) is buf:
                del _SPARE[key]
            _FLAGS[key] = buf
        elif cur is not buf:
            _FLAGS[(f"{key[0]} (CUDA graph)", key[1])] = buf


__all__ = [
    "check_non_finite", "flag", "isolated", "note", "pending", "rearm", "record", "record_each",
    "sync_free",
]  # fmt: skip
