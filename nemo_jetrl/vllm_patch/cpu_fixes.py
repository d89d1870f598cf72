"""Fixes for vLLM's CPU builds that our CPU engines need, applied in vLLM's processes on request.

vLLM 0.20's CPU MoE fallback, ``cpu_fused_moe.CPUFusedMOE.forward_torch`` (taken where its build
has no grouped-GEMM MoE kernel, ``torch.ops._C.prepack_moe_weight``: x86 CPUs without AVX-512),
computes SiLU through ``_CPU_MOE_ACT_FN``, whose entry builds ``SiluAndMul(...)`` inside the
forward. A CustomOp asks for the current vLLM config when it is built and none is set during the
forward, so every unquantized MoE engine dies at its first (profile) run: "Current vLLM config is
not set" (seen on an AMD EPYC without AVX-512, 2026-11-29). The fix maps SiLU to
``SiluAndMul.forward_native``, the static method that entry called: the same arithmetic, nothing
built.

`apply` is an explicit call: `plugin.load_in_worker` makes it in vLLM's processes only when
``NEMO_JETRL_VLLM_CPU_FIXES=1``, which our CPU engine environments set (`ENV`). It changes only
what vLLM's own code shows to need it (an entry that is a lambda whose source builds
``SiluAndMul``: vLLM 0.32 has no such table), is idempotent, checks the fixed entry computes
``silu(x[:d]) * x[d:]`` and returns a handle that puts the entry back. What this process has
replaced, and with what it was, is `replaced()`: an earlier engine in the same process (an
in-process vLLM, a test worker) may have applied the fix already, and a second `apply` changes
nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ENV = "NEMO_JETRL_VLLM_CPU_FIXES"
SILU = "cpu_fused_moe._CPU_MOE_ACT_FN[SILU]"
_REPLACED: dict[str, object] = {}  # name -> the entry vLLM had, while our fix is in place


def replaced() -> dict[str, object]:
    """The entries this process's fix replaced (name -> vLLM's own entry), while in place."""
    return dict(_REPLACED)


@dataclass
class CpuFixes:
    """What `apply` changed (names), and how to undo it."""

    applied: tuple[str, ...] = ()
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def revert(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.applied = ()


def builds_custom_op(fn: object, op: str = "SiluAndMul") -> bool:
    """True if ``fn`` is a lambda whose source builds ``op`` (a CustomOp) when called."""
    if getattr(fn, "__name__", "") != "<lambda>":
        return False
    try:
        return f"{op}(" in inspect.getsource(fn)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False


def apply() -> CpuFixes:
    """Fix this process's vLLM where it needs it (see the module docstring); idempotent."""
    try:
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    except ImportError:  # no CPU MoE module in this vLLM
        return CpuFixes()
    table = getattr(cpu_fused_moe, "_CPU_MOE_ACT_FN", None)
    if not isinstance(table, dict):
        return CpuFixes()
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    key = MoEActivation.SILU
    if not builds_custom_op(table.get(key)):
        return CpuFixes()
    if not isinstance(inspect.getattr_static(SiluAndMul, "forward_native"), staticmethod):
        raise RuntimeError(
            "vLLM's CPU MoE builds SiluAndMul inside its forward and SiluAndMul.forward_native is "
            "not a static method in this vLLM: nemo_jetrl.vllm_patch.cpu_fixes cannot fix it "
            f"(unset {ENV} to run vLLM unchanged)"
        )
    old = table[key]
    table[key] = SiluAndMul.forward_native
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.silu(x[:, :8]) * x[:, 8:]
    if not torch.equal(table[key](x), want):
        table[key] = old
        raise RuntimeError("cpu_fixes: the fixed CPU MoE SiLU does not compute silu(x[:d]) * x[d:]")
    _REPLACED[SILU] = old

    def undo() -> None:
        table[key] = old
        _REPLACED.pop(SILU, None)

    return CpuFixes((SILU,), [undo])
