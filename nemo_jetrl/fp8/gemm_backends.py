"""FP8 GEMM backends, and the one place that decides which of them runs.

`plan_gemm` decides once (per device, output dtype, scale mode and operand kind; cached per
process) and returns a `GemmPlan`; `run_gemm(plan.backend, a, b, out_dtype)` then only runs what
was decided: no capability query, no import attempt, no host read. A vLLM layer plans at weight
load and records the choice as ``layer.jetrl_gemm_backend`` (``vllm_patch/kernel.py``).

Order of preference for CUDA operands (``auto``):

1. ``deep_gemm`` - DeepGEMM's ``fp8_gemm_nt``: FProp pair (1x128 x 128x128, E4M3), bf16 output
   (DeepGEMM has no fp16 output), SM90, or SM100 with power-of-two scales (SM100 stores scales as
   UE8M0, exact only for powers of two). In a vLLM process found through vLLM's wrapper
   ``vllm.utils.deep_gemm`` (vLLM 0.20, 0.32 and 0.33 all try a pip-installed ``deep_gemm`` and
   then the copy vendored in the CUDA wheel, ``vllm.third_party.deep_gemm``), else a top-level
   ``deep_gemm``.
2. ``scaled_mm`` - ``torch.nn.functional.scaled_mm`` with blockwise scaling (cuBLASLt: SM90,
   CUDA >= 12.9, a torch that has ``F.scaled_mm``/``F.ScalingType``), E4M3, bf16 output.
3. ``triton`` - our Triton block GEMM (`triton_gemm`): any CUDA GPU, any output dtype, E4M3 or
   E5M2 operands, FProp/DGrad and WGrad pairs.

``triton_splitk`` (`triton_split`; requested only, not ``auto``'s until measured on a GPU):
split-K in an order fixed by K alone, so a token's row has the same bits at every batch size.

Per call (`run_gemm`): cuBLASLt's activation rows are padded to its row multiple, and a GEMM
cuBLASLt or DeepGEMM still refuses (WGrad over 300 tokens, an expert's 129 rows on DeepGEMM, a
partial K block) runs on ``triton``; both rules live in `gemm_layouts` (`activation_layout`,
`shape_problem`).

None applies on a GPU: `GemmBackendError` naming what to install or change. CPU: ``reference``
(`gemm.blockwise_matmul`). ``JETRL_FP8_GEMM_BACKEND`` or ``backend=`` forces one (``reference``
on a GPU: debugging only), refused at planning if it cannot run.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from nemo_jetrl.fp8._deps import available
from nemo_jetrl.fp8.gemm import blockwise_matmul
from nemo_jetrl.fp8.gemm_layouts import (
    FP32_SCALE_ROW_MULTIPLE,
    activation_layout,
    gemm_ready_weight_scales,
    mn_major,
    padded_storage,
    shape_problem,
)
from nemo_jetrl.fp8.layouts import pad_rows
from nemo_jetrl.fp8.quantize import BlockQuantized

GEMM_BACKENDS = ("auto", "deep_gemm", "scaled_mm", "triton", "triton_splitk", "reference")
ENV_GEMM_BACKEND = "JETRL_FP8_GEMM_BACKEND"
# Operand pairs: "fprop" = a 1x128 x b 128x128 (FProp, DGrad); "wgrad" = a 1x128 x b 1x128.
GEMM_KINDS = ("fprop", "wgrad")


class GemmBackendError(ValueError):
    """No FP8 GEMM backend can run the requested GEMM (or a forced one cannot); says what to do."""


@dataclass(frozen=True)
class DeviceCaps:
    """What the device and the installed packages offer (the inputs of the decision)."""

    cuda: bool
    """The operands are CUDA tensors."""
    sm: tuple[int, int] = (0, 0)
    """Compute capability (major, minor); (0, 0) off CUDA."""
    deep_gemm: bool = False
    """A DeepGEMM ``fp8_gemm_nt`` is importable (`deep_gemm_module`)."""
    scaled_mm: bool = False
    """torch has blockwise ``F.scaled_mm`` and was built with CUDA >= 12.9."""
    triton: bool = False
    """triton imports (on CPU: and runs in its interpreter)."""


@dataclass(frozen=True)
class GemmPlan:
    """The backend chosen for one GEMM signature and the reason (for logs and errors)."""

    backend: str
    """One of `GEMM_BACKENDS` other than ``auto``."""
    reason: str  # why it was chosen (for logs)


def _cuda_at_least(major: int, minor: int) -> bool:
    return tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2]) >= (major, minor)


@functools.cache
def deep_gemm_module() -> ModuleType | None:
    """The module whose ``fp8_gemm_nt`` we call, or None; looked up once per process.

    Inside a vLLM process (``vllm`` already imported) vLLM's wrapper, which finds a pip-installed
    or the vendored DeepGEMM and sets up its JIT cache; elsewhere (a trainer) a top-level
    ``deep_gemm`` only: importing vLLM just to reach its copy is not worth it there.
    """
    if sys.modules.get("vllm") is not None:
        try:
            from vllm.utils import deep_gemm as vllm_deep_gemm
            from vllm.utils.import_utils import has_deep_gemm

            if has_deep_gemm():
                return vllm_deep_gemm
        except Exception:  # a vLLM without the wrapper: try the package itself
            pass
    if available("deep_gemm"):
        import deep_gemm

        return deep_gemm
    return None


@functools.cache
def device_caps(device: torch.device) -> DeviceCaps:
    """`DeviceCaps` of ``device`` (cached: queried once per device and process)."""
    from nemo_jetrl.fp8 import triton_kernels

    if device.type != "cuda":
        return DeviceCaps(cuda=False, triton=available("triton") and triton_kernels.interpreting())
    import torch.nn.functional as F

    return DeviceCaps(
        cuda=True,
        sm=torch.cuda.get_device_capability(device),
        deep_gemm=deep_gemm_module() is not None,
        scaled_mm=hasattr(F, "scaled_mm") and hasattr(F, "ScalingType") and _cuda_at_least(12, 9),
        triton=available("triton"),
    )


def _why_not(backend: str, caps: DeviceCaps, out_dtype, pow2: bool, kind: str, fmts) -> str | None:
    """Why ``backend`` cannot run this GEMM (None: it can)."""
    e4m3 = fmts == ("e4m3", "e4m3")
    if backend == "reference":
        return None
    if backend in ("triton", "triton_splitk"):
        if caps.triton:
            return None
        if caps.cuda:
            return "triton is not installed (pip install triton)"
        return "triton needs CUDA operands (or TRITON_INTERPRET=1 and triton for CPU tensors)"
    if backend == "deep_gemm" and (kind != "fprop" or not e4m3):
        return f"{backend} needs E4M3 operands a: 1x128 [M, K] and b: 128x128 [N, K]"
    if backend == "scaled_mm" and not e4m3:
        return f"{backend} needs E4M3 operands a: 1x128 [M, K] and b: 1x128 or 128x128 [N, K]"
    if not caps.cuda:
        return f"{backend} needs CUDA operands"
    sm = f"sm_{caps.sm[0]}{caps.sm[1]}"
    if backend == "deep_gemm":
        if not caps.deep_gemm:
            return "no DeepGEMM found (neither vLLM's vendored copy nor a deep_gemm package)"
        if caps.sm[0] != 9 and not (caps.sm[0] == 10 and pow2):
            return f"DeepGEMM runs on SM90, or SM100 with power-of-two scales (this is {sm})"
    else:  # scaled_mm
        if not caps.scaled_mm:
            return "this torch/CUDA has no blockwise scaled_mm (needs F.scaled_mm, CUDA >= 12.9)"
        if caps.sm[0] != 9:
            return f"cuBLASLt blockwise FP8 runs on SM90 only (this is {sm})"
    if out_dtype != torch.bfloat16:
        return f"{backend} writes bfloat16 only, not {out_dtype}"
    return None


def decide(
    caps: DeviceCaps,
    *,
    out_dtype: torch.dtype,
    pow2_scales: bool,
    kind: str = "fprop",
    fmts: tuple[str, str] = ("e4m3", "e4m3"),
    forced: str = "auto",
    excluded: tuple[tuple[str, str], ...] = (),
) -> GemmPlan:
    """The backend for these inputs (pure function of its arguments; see the module docstring).
    ``excluded``: ``(backend, why)`` pairs the caller rules out (e.g. the serving engine's own
    settings or shape rules); they are skipped, and a forced one is refused with ``why``."""
    if kind not in GEMM_KINDS:
        raise GemmBackendError(f"GEMM operand kind must be one of {GEMM_KINDS}, got {kind!r}")
    args = (caps, out_dtype, pow2_scales, kind, fmts)
    ruled_out = dict(excluded)

    def why_not(backend: str) -> str | None:
        return ruled_out.get(backend) or _why_not(backend, *args)

    if forced != "auto":
        why = why_not(forced)
        if why is not None:
            raise GemmBackendError(
                f"FP8 GEMM backend {forced!r} was requested ({ENV_GEMM_BACKEND} or backend=) but "
                f"cannot run this GEMM: {why}; unset it or choose another of {GEMM_BACKENDS}"
            )
        return GemmPlan(forced, "requested")
    if not caps.cuda:
        return GemmPlan("reference", "CPU operands: the torch reference")
    reasons = []
    for backend in ("deep_gemm", "scaled_mm", "triton"):
        why = why_not(backend)
        if why is None:
            return GemmPlan(backend, "first runnable of deep_gemm, scaled_mm, triton")
        reasons.append(f"{backend}: {why}")
    raise GemmBackendError(
        f"no FP8 GEMM backend can run a {kind} GEMM with {out_dtype} output on this GPU "
        f"({'; '.join(reasons)}). Install triton (pip install triton) or use a bfloat16 model "
        "dtype; dequantizing the weights on every call is not offered"
    )


def forced_backend(backend: str | None = None) -> str:
    """``backend``, else ``$JETRL_FP8_GEMM_BACKEND``, else ``"auto"``; checked against the names."""
    value = (backend if backend is not None else os.environ.get(ENV_GEMM_BACKEND, "auto")).lower()
    value = value.strip()
    if value not in GEMM_BACKENDS:
        source = "backend argument" if backend is not None else f"variable {ENV_GEMM_BACKEND}"
        raise ValueError(f"{source} is {value!r}; use one of {list(GEMM_BACKENDS)}")
    return value


@functools.cache
def _plan_cached(device, out_dtype, pow2_scales, kind, fmts, forced, excluded) -> GemmPlan:
    caps = device_caps(device)
    plan = decide(caps, out_dtype=out_dtype, pow2_scales=pow2_scales, kind=kind, fmts=fmts,
                  forced=forced, excluded=excluded)  # fmt: skip
    # Triton's value tables (and the split-K tile counters) must exist before any CUDA graph
    # capture (scaled_mm / deep_gemm plans too: the shapes they refuse run on Triton, `run_gemm`).
    fallback = plan.backend in ("scaled_mm", "deep_gemm") and device_caps(device).triton
    if plan.backend in ("triton", "triton_splitk") or fallback:
        from nemo_jetrl.fp8 import triton_gemm, triton_split

        triton_gemm.prepare(device, fmts)
        if plan.backend == "triton_splitk":
            triton_split.prepare(device)
    return plan


def plan_gemm(
    device: torch.device | str,
    *,
    out_dtype: torch.dtype,
    pow2_scales: bool,
    kind: str = "fprop",
    fmts: tuple[str, str] = ("e4m3", "e4m3"),
    backend: str | None = None,
    excluded: tuple[tuple[str, str], ...] = (),
) -> GemmPlan:
    """Choose the GEMM backend for operands on ``device`` (raises `GemmBackendError` if none);
    ``excluded`` as in `decide`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    forced = forced_backend(backend)
    return _plan_cached(
        device, out_dtype, bool(pow2_scales), kind, tuple(fmts), forced, tuple(excluded)
    )


def pair_kind(a: BlockQuantized, b: BlockQuantized) -> str | None:
    """``"fprop"`` (a 1x128, b 128x128), ``"wgrad"`` (both 1x128), or None (reference only)."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.block != (1, 128):
        return None
    return {(128, 128): "fprop", (1, 128): "wgrad"}.get(b.block)


# ------------------------------------------------------------------------------------- runners


def _deep_gemm(a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype) -> torch.Tensor:
    module = deep_gemm_module()
    out = torch.empty(a.data.shape[0], b.data.shape[0], dtype=out_dtype, device=a.data.device)
    pairs = ((a.data, a.scale_inv), (b.data.contiguous(), b.scale_inv.contiguous()))
    if module is not None and module.__name__.startswith("vllm."):
        # vLLM's wrapper decides the UE8M0 scale cast from its own env unless told: exact only
        # for power-of-two scales, which is what SM100 (the only UE8M0 user here) is planned for.
        sm100 = a.data.is_cuda and torch.cuda.get_device_capability(a.data.device)[0] == 10
        module.fp8_gemm_nt(*pairs, out, is_deep_gemm_e8m0_used=sm100)
    else:
        module.fp8_gemm_nt(*pairs, out)  # type: ignore[union-attr]
    return out


def _scaled_mm(a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype) -> torch.Tensor:
    import torch.nn.functional as F

    if b.block == (128, 128):
        # [pad4(kb), N/128], strides (1, pad4(kb)): a view of scales stored so at load (the
        # serving kernel); padded here, per call, for scales stored compact (the trainer).
        stored = gemm_ready_weight_scales("scaled_mm", b.scale_inv)
        scale_b, recipe_b = padded_storage(stored), F.ScalingType.BlockWise128x128
    else:
        scale_b, recipe_b = mn_major(b.scale_inv), F.ScalingType.BlockWise1x128
    # b is passed as [K, N] column-major (= b.data.t()), scale_a as [M, kb] strides (1, M).
    return F.scaled_mm(
        a.data.contiguous(),
        b.data.contiguous().t(),
        mn_major(a.scale_inv),
        F.ScalingType.BlockWise1x128,
        scale_b,
        recipe_b,
        output_dtype=out_dtype,
    )


def _triton(a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype, split: bool = False):
    from nemo_jetrl.fp8 import triton_gemm, triton_split

    if split:
        return triton_split.split_gemm(a, b, out_dtype=out_dtype)
    return triton_gemm.block_fp8_gemm_triton(a, b, out_dtype=out_dtype)


RUNNERS = {
    "deep_gemm": _deep_gemm,
    "scaled_mm": _scaled_mm,
    "triton": _triton,
    "triton_splitk": functools.partial(_triton, split=True),
    "reference": lambda a, b, out_dtype: blockwise_matmul(a, b, out_dtype=out_dtype),
}


def run_gemm(
    backend: str, a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype
) -> torch.Tensor:
    """``a @ b.T`` on a backend `plan_gemm` chose (nothing imported, no host read). cuBLASLt
    gets ``a``'s rows padded to `activation_layout`'s multiple (37 tokens: 40; FP32 scales: 64):
    a token's row has its bits at every M, on both RL sides. A shape still refused
    (`shape_problem`) runs on Triton, whose value tables the plan prepared."""
    if backend in ("scaled_mm", "deep_gemm"):
        (m, k), n = a.data.shape, b.data.shape[0]
        if m % FP32_SCALE_ROW_MULTIPLE:  # (a multiple of every row multiple: nothing to pad)
            rows = activation_layout(backend, a.pow2_scales and b.pow2_scales)[0]
            if m % rows and shape_problem(backend, -(-m // rows) * rows, n, k) is None:
                return RUNNERS[backend](pad_rows(a, -(-m // rows) * rows), b, out_dtype)[:m]
        why = shape_problem(backend, m, n, k)
        if why is not None:
            if not device_caps(a.data.device).triton:
                raise GemmBackendError(f"fp8_gemm: {why}, and triton is not installed")
            backend = "triton"
    return RUNNERS[backend](a, b, out_dtype)
