"""Our block-FP8 linear kernel for vLLM: activations quantized by ``nemo_jetrl.fp8``.

vLLM builds each block-FP8 linear layer (``Fp8LinearMethod``) around a *kernel* object chosen
from a per-platform registry (``vllm.model_executor.kernels.linear._POSSIBLE_FP8_BLOCK_KERNELS``;
version differences of that registry are handled in ``compat.py``): the first class whose ``is_supported()`` and ``can_implement(config)`` both say yes wins. vLLM's
own kernels quantize activations with ``QuantFP8`` (``x / RN(amax/448)``, scale floor
``1/(448*512)``), which is not TE's formula (``x * RN(448/amax)``, no floor). Our kernel is put
first in that registry by ``apply_patches``; it

* quantizes each token's activations in groups of 128 along K with nemo_jetrl.fp8's quantizer
  itself (``quantize_blockwise(x, (1, 128), check_finite=False)``: the Triton kernel on CUDA,
  the torch reference elsewhere; no host sync, so vLLM can capture it in CUDA graphs) in the
  recipe's scale mode (pow2 or fp32), i.e. the exact bits the trainer's FP8 forward produces
  for the same input;
* multiplies with the GEMM backend chosen ONCE per layer when the kernel is built
  (``nemo_jetrl.fp8.gemm_backends.plan_gemm``: DeepGEMM through vLLM's vendored module, cuBLASLt
  blockwise ``scaled_mm`` or our Triton block GEMM on CUDA, the reference on CPU; an output dtype
  no GPU backend writes is refused there, with the reason) against the layer's FP8 ``weight``
  and ``weight_scale_inv`` as loaded (no repacking, no requantization). The scales are stored
  at load in the layout the planned GEMM reads (``gemm_layouts.gemm_ready_weight_scales``:
  cuBLASLt's K-padded array), the parameter a view of that storage, so refits still overwrite
  it in place and the parity read-back still reads it. The quantizer writes the activations
  in the GEMM's layout too (``gemm_layouts.activation_layout``: MN-major scales, M padded to
  cuBLASLt's multiple of 4 inside its output buffers; the padded rows are never returned), so
  a serving call is the quantizer's launch, the GEMM and their output allocations, nothing
  else, and no batch size moves a layer to another GEMM kernel. The choice is readable as
  ``layer.jetrl_gemm_backend`` (and ``kernel.jetrl_gemm_backend``);
* works on every platform, which also gives vLLM's CPU build a block-FP8 path on CPUs without
  AMX, where vLLM's own CPU kernels refuse to run.

Both steps run as opaque torch custom ops (``torch.ops.nemo_jetrl.*``, `serving_ops`) so that
vLLM's torch.compile/inductor cannot trace into and re-derive the quantizer. In eager mode a layer can
record what enters the GEMM (``layer._jetrl_capture``, set by the worker extension) so tests can
compare it bit for bit with ``nemo_jetrl.fp8`` on the same input.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_jetrl.fp8.gemm_backends import GemmBackendError, plan_gemm
from nemo_jetrl.fp8.gemm_layouts import gemm_ready_weight_scales
from nemo_jetrl.fp8.spec import ACTIVATION_BLOCK as ACT_BLOCK
from nemo_jetrl.fp8.spec import WEIGHT_BLOCK
from nemo_jetrl.vllm_patch import compat
from nemo_jetrl.vllm_patch.serving_ops import (  # noqa: F401  (re-exported: experts.py, tests)
    OP_NAMESPACE,
    _gemm_impl,
    _quantize_act_impl,
    _serving_device,
    ensure_ops,
    serving_forward,
)
from nemo_jetrl.vllm_patch.settings import KERNEL_NAME, PatchSettings

# Marks our kernel classes in vLLM's registry (so revert and idempotence need no global state).
MARKER = "_nemo_jetrl_kernel"


def make_kernel_class(settings: PatchSettings) -> type:
    """A vLLM ``Fp8BlockScaledMMLinearKernel`` subclass bound to ``settings`` (needs vLLM)."""
    Fp8BlockScaledMMLinearKernel, MMLinearKernel = compat.kernel_base_classes()
    ops = ensure_ops()
    pow2, w_pow2, eps = settings.pow2_activation_scales, settings.pow2_weight_scales, settings.eps
    # GEMM signatures already warmed by this patch's layers: once per shape, as vLLM does, and
    # never again when a refit reloads weights through process_weights_after_loading.
    warmed: set[tuple[Any, ...]] = set()

    class JetRLFp8BlockLinearKernel(Fp8BlockScaledMMLinearKernel):
        """Block-FP8 linear with activations quantized by nemo_jetrl.fp8 (see kernel.py)."""

        jetrl_settings_json = settings.to_json()
        apply_input_quant = True

        def __init__(self, config: Any) -> None:
            # Skip the parent's __init__: it builds vLLM's QuantFP8, which we never use.
            MMLinearKernel.__init__(self, config)
            self.weight_group_shape = config.weight_quant_key.scale.group_shape
            # The GEMM backend, decided here once for this layer (see kernel.py's docstring).
            self._plan_gemm(_serving_device())
            # and the fp32-output one a biased layer needs, planned here too: NeMo-RL's own
            # Fp8LinearMethod.process_weights_after_loading never calls ours, and planning in
            # the first forward breaks vLLM's torch.compile (fullgraph) on Qwen2's q/k/v.
            try:
                self._jetrl_bias_backend = self._plan_gemm(_serving_device(), None, torch.float32)
                self._jetrl_bias_error: Exception | None = None
            except ValueError as exc:  # raised by a biased layer's forward, if one comes
                self._jetrl_bias_backend, self._jetrl_bias_error = None, exc

        def _plan_gemm(
            self,
            device: torch.device,
            shape: tuple[int, int] | None = None,
            out_dtype: torch.dtype | None = None,
        ) -> str:
            config = self.config
            out_dtype = out_dtype or config.out_dtype
            shape = shape or getattr(config, "weight_shape", None)
            excluded = serving_exclusions(shape, device)
            try:
                plan = plan_gemm(
                    device,
                    out_dtype=out_dtype,
                    pow2_scales=pow2 and w_pow2,
                    kind="fprop",
                    excluded=excluded,
                )
            except GemmBackendError as exc:
                shape = getattr(config, "weight_shape", "?")
                raise ValueError(
                    f"nemo_jetrl kernel: block-FP8 linear {shape} with {out_dtype} "
                    f"output on {device}: {exc}"
                ) from exc
            if out_dtype == config.out_dtype:
                self.jetrl_gemm_device, self.jetrl_gemm_backend = device, plan.backend
                self._jetrl_excluded = excluded
            return plan.backend

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        @classmethod
        def can_implement(cls, config: Any) -> tuple[bool, str | None]:
            act, wgt = config.activation_quant_key, config.weight_quant_key
            if act.scale.static:
                return False, "nemo_jetrl kernel: needs dynamic activation scales"
            a_shape = (act.scale.group_shape.row, act.scale.group_shape.col)
            w_shape = (wgt.scale.group_shape.row, wgt.scale.group_shape.col)
            if a_shape != ACT_BLOCK or w_shape != WEIGHT_BLOCK:
                return False, (
                    f"nemo_jetrl kernel: needs activation groups {ACT_BLOCK} and weight blocks "
                    f"{WEIGHT_BLOCK}, got {a_shape} and {w_shape}"
                )
            if wgt.dtype != torch.float8_e4m3fn or act.dtype != torch.float8_e4m3fn:
                return False, "nemo_jetrl kernel: needs float8_e4m3fn weights and activations"
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            # Nothing to transform: the loaded FP8 data and scales are used as they are, and the
            # parameters stay the same objects (refit writes into them in place).
            w, s = layer.weight, layer.weight_scale_inv
            n, k = w.shape
            want = (-(-n // WEIGHT_BLOCK[0]), -(-k // WEIGHT_BLOCK[1]))
            if w.dtype != torch.float8_e4m3fn or tuple(s.shape) != want or s.dtype != torch.float32:
                raise ValueError(
                    f"nemo_jetrl kernel: layer weight {tuple(w.shape)} {w.dtype} with "
                    f"weight_scale_inv {tuple(s.shape)} {s.dtype}; expected float8_e4m3fn and "
                    f"fp32 scales of shape {want}"
                )
            # Plan again, at load, only if the weights live elsewhere than planned (e.g.
            # offloaded) or their real shape rules a backend out that vLLM's config did not
            # show (its weight_shape may be missing).
            if (w.device, serving_exclusions((n, k), w.device)) != (
                self.jetrl_gemm_device,
                self._jetrl_excluded,
            ):
                self._plan_gemm(w.device, (n, k))
            layer.jetrl_gemm_backend = self.jetrl_gemm_backend
            # Scales stored once in the layout the GEMM reads; the parameter becomes a view of
            # that storage (same object, same values: refits copy into it in place, and a
            # reload's copy back lands in the same storage). Other backends read strides.
            stored = s.data
            ready = gemm_ready_weight_scales(self.jetrl_gemm_backend, stored)
            if ready is not stored:
                s.data = ready
            # A biased layer adds its bias to the fp32 accumulator and rounds once, as the
            # trainer does (TE's GEMM epilogue; fp8.linear.fp8_linear_forward): its GEMM writes
            # fp32, so it may need another backend (DeepGEMM writes bf16 only).
            if getattr(layer, "bias", None) is not None:
                layer.jetrl_bias_gemm_backend = self._plan_gemm(w.device, (n, k), torch.float32)
            key = (n, k, str(w.device), self.config.out_dtype, self.jetrl_gemm_backend)
            if self.jetrl_gemm_backend == "deep_gemm" and key not in warmed:
                warm_up_gemm(w, s, self.config.out_dtype, pow2, w_pow2, "deep_gemm")
                warmed.add(key)

        def apply_block_scaled_mm(self, A, B, As, Bs):  # type: ignore[no-untyped-def]
            return ops.fp8_block_gemm(
                A, As, B, Bs, self.config.out_dtype, pow2, w_pow2, self.jetrl_gemm_backend
            )

        def apply_weights(
            self,
            layer: torch.nn.Module,
            x: torch.Tensor,
            bias: torch.Tensor | None = None,
            **kw: Any,
        ) -> torch.Tensor:
            x2 = x.reshape(-1, x.shape[-1])
            if bias is None:
                backend, gemm_dtype = self.jetrl_gemm_backend, self.config.out_dtype
            else:
                # the layer's, planned at its load; else (no load step of ours ran) the init's
                backend = (
                    getattr(layer, "jetrl_bias_gemm_backend", None) or self._jetrl_bias_backend
                )
                if backend is None:
                    raise self._jetrl_bias_error or ValueError("no fp32-output GEMM backend")
                gemm_dtype = torch.float32
            out = serving_forward(
                ops, x2, layer.weight, layer.weight_scale_inv, backend, gemm_dtype,
                (pow2, w_pow2, eps), getattr(layer, "_jetrl_capture", None),
            )  # fmt: skip
            if bias is not None:
                out = (out + bias.float()).to(self.config.out_dtype)
            return out.view(*x.shape[:-1], layer.weight.shape[0])

    setattr(JetRLFp8BlockLinearKernel, MARKER, True)
    assert JetRLFp8BlockLinearKernel.__name__ == KERNEL_NAME  # the name users disable it by
    return JetRLFp8BlockLinearKernel


# vLLM runs a block-FP8 linear on DeepGEMM only for these weight multiples
# (vllm.utils.deep_gemm.should_use_deepgemm_for_fp8_linear in 0.20 to 0.33).
DEEP_GEMM_N_MULTIPLE, DEEP_GEMM_K_MULTIPLE = 64, 128


def serving_exclusions(
    shape: tuple[int, int] | None, device: torch.device
) -> tuple[tuple[str, str], ...]:
    """GEMM backends vLLM itself would not run for this layer (``plan_gemm(excluded=...)``):
    DeepGEMM when the engine's ``VLLM_USE_DEEP_GEMM`` is off, or when the weight's N is not a
    multiple of 64 or K of 128. Off CUDA nothing is excluded (the reference runs there)."""
    if torch.device(device).type != "cuda":
        return ()
    if not compat.vllm_env("VLLM_USE_DEEP_GEMM"):
        return (("deep_gemm", "VLLM_USE_DEEP_GEMM=0 in this vLLM process"),)
    if shape is not None:
        n, k = shape
        if n % DEEP_GEMM_N_MULTIPLE or k % DEEP_GEMM_K_MULTIPLE:
            why = (
                f"weight [{n}, {k}]: vLLM runs DeepGEMM linears only with N % "
                f"{DEEP_GEMM_N_MULTIPLE} == 0 and K % {DEEP_GEMM_K_MULTIPLE} == 0"
            )
            return (("deep_gemm", why),)
    return ()


def warm_up_gemm(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    a_pow2: bool,
    w_pow2: bool,
    backend: str,
) -> int:
    """Run the layer's GEMM once for every token count vLLM's own DeepGEMM warm-up covers
    (`compat.deep_gemm_warmup_m_values`): vLLM warms only its own DeepGEMM kernel class, so
    without this our layers would JIT-compile in the middle of the first rollouts. Zero
    activations with unit scales; returns how many GEMMs ran."""
    m_values = compat.deep_gemm_warmup_m_values(weight)
    if not m_values:
        return 0
    k = weight.shape[1]
    kb = -(-k // ACT_BLOCK[1])
    a = torch.zeros(max(m_values), k, dtype=torch.float8_e4m3fn, device=weight.device)
    a_s = torch.ones(max(m_values), kb, dtype=torch.float32, device=weight.device)
    for m in m_values:
        _gemm_impl(a[:m], a_s[:m], weight, scale_inv, out_dtype, a_pow2, w_pow2, backend)
    return len(m_values)


def fp8_block_registry() -> dict:
    """vLLM's per-platform list of block-FP8 linear kernels (see ``compat.fp8_block_registry``)."""
    return compat.fp8_block_registry()


def registered_kernel(platform: Any = None) -> type | None:
    """Our kernel class if it is in the registry for ``platform`` (default: current)."""
    plat = compat.current_platform_key() if platform is None else platform
    for cls in fp8_block_registry().get(plat, []):
        if getattr(cls, MARKER, False):
            return cls
    return None


def register_kernel(settings: PatchSettings) -> type:
    """Put our kernel first in the current platform's block-FP8 list (idempotent)."""
    existing = registered_kernel()
    if existing is not None:
        if existing.jetrl_settings_json != settings.to_json():
            raise RuntimeError(
                "nemo_jetrl kernel already registered with different settings "
                f"({existing.jetrl_settings_json}); revert the previous patch first"
            )
        return existing
    cls = make_kernel_class(settings)
    compat.registry_insert_first(cls)
    return cls


def unregister_kernel() -> int:
    """Remove our kernel classes from every platform's list (and any list we had to create);
    returns how many classes were removed."""
    return compat.registry_remove_ours(MARKER)
