"""The device a local run computes on (``jetrl.local.device``, ``--device``): what this machine
can give, checked before any work.

`jetrl check` validates only the key's form (`config.is_device_name`): a config naming ``cuda``
is valid on every machine. Whether *this* machine has the device is a property of the run, so
`device_issues` is called by `nemo_jetrl.backends.local.setup.resolve_run`, which reports it
together with every other problem of the config (one `ConfigError`, exit 2).
"""

from __future__ import annotations

import torch

from nemo_jetrl.config.load import ConfigIssue

KEY = "jetrl.local.device"


def _cuda_count() -> int:
    """Visible CUDA devices (0 on a CPU-only torch build or without a driver)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except (RuntimeError, AssertionError):  # a broken driver reads as "no CUDA"
        return 0


def device_issues(name: str) -> list[ConfigIssue]:
    """[] when this machine has device ``name`` (``cpu``, ``cuda``, ``cuda:N``), else the issue
    naming the key, the flag and what to change."""
    if name == "cpu":
        return []
    n = _cuda_count()
    idx = int(name.partition(":")[2] or 0)
    if n == 0:
        why = (
            f"{name!r} asks for a CUDA GPU, but this machine has none visible to torch "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})"
        )
    elif idx >= n:
        why = f"{name!r} asks for GPU {idx}, but this machine has {n} visible (cuda:0..{n - 1})"
    else:
        return []
    return [
        ConfigIssue(
            KEY,
            f"{why}; set jetrl.local.device: cpu (or pass --device cpu), or run on a machine "
            "with that GPU (check CUDA_VISIBLE_DEVICES)",
        )
    ]


def make_current(device: torch.device) -> None:
    """Make ``device`` the current CUDA device (nothing on CPU). Our Triton kernels launch on the
    current device and its stream (as Triton's own launcher does), not on their tensors': a run
    on ``cuda:1`` would launch them on GPU 0 with pointers into GPU 1's memory."""
    if device.type == "cuda" and device.index is not None:  # plain "cuda": the current one
        torch.cuda.set_device(device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (the same tensor when it is already there)."""
    return t if t.device == device else t.to(device)


def malformed_flag(device: str) -> str:
    """What is wrong with a ``--device`` value of the wrong form."""
    from nemo_jetrl.backends.local.config import DEVICE_FORM

    return f"--device {device!r}: expected {DEVICE_FORM} ({KEY})"


def check_device_flag(device: str) -> None:
    """``--device`` of a command that starts runs later (`jetrl demo`): `UserError` (exit 2)
    before any work when its form is wrong or this machine lacks it."""
    from nemo_jetrl.backends.local.config import is_device_name
    from nemo_jetrl.errors import UserError

    if not is_device_name(device):
        raise UserError(malformed_flag(device))
    issues = device_issues(device)
    if issues:
        raise UserError(f"--device: {issues[0]}")
