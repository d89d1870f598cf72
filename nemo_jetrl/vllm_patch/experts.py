"""Our block-FP8 experts kernel for vLLM's mixture-of-experts layers (vLLM 0.20.0, 0.25.1, 0.32.x;
what differs between them: ``moe_versions.py``).

vLLM builds each routed-experts layer of a block-FP8 checkpoint with ``Fp8MoEMethod``
(``vllm.model_executor.layers.quantization.fp8``), which picks one of vLLM's own FP8 expert
kernels (``fused_moe/oracle/fp8.py``: DeepGEMM, Triton, CUTLASS, FlashInfer on GPUs;
``CPUExpertsFp8`` W8A16 or ``CPUExpertsFp8W8A8`` on AMX CPUs; ``NONE``, an error at load, on
other CPUs). Each quantizes the routed tokens with vLLM's own per-token-group quantizer (or not at
all: W8A16), and some repack the weights. ``install_moe_method`` replaces the ``Fp8MoEMethod``
name that ``Fp8Config.get_quant_method`` constructs (checked to be the one it reads) by our
subclass; ``uninstall_moe_method`` puts vLLM's back. Our method

* keeps vLLM's parameters (``w13_weight`` ``[E, 2I, H]``, ``w2_weight`` ``[E, H, I]`` FP8 and
  their fp32 ``*_weight_scale_inv`` per 128x128 block) exactly as loaded: no repacking and no
  requantization, so refits write the trainer's bytes into them and parity reads them back;
* never builds a vLLM experts kernel (``moe_kernel`` stays None, so none of vLLM's can run);
* computes the experts with ``nemo_jetrl.fp8.experts`` (the trainer's grouped expert linear,
  per expert bit for bit the dense path; `experts_forward`): the tokens quantized 1x128 once
  in the patch's scale mode and read per routed row, the gate/up GEMM, SiLU(gate) * up
  (``fp8.silu_mul``'s rule, model dtype) fused with its 1x128 quantization, the down GEMM; the
  outputs weighted by the router's top-k weights and summed in fp32 in a fixed order
  (``fp8.experts_layer.combine``).

The router (``mlp.gate``) is an ordinary linear and must stay BF16 (the checkpoint's
``modules_to_not_convert``; ``guard.kernel_problems`` refuses an FP8 one). What is not covered is
refused when the layer is built, naming it: TP shards of the expert width that are not
128-aligned and vLLM data parallel (``expert_shards.py``, which also serves TP/EP shards),
biased experts, activations other than SiLU, weight blocks other than 128x128. Shared experts are run and
added by vLLM's MoE runner (``shared_experts.py``).

Only recipes whose activation and weight scale modes differ take a per-expert loop over our
dense kernel's ops, which reads the token counts on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_jetrl.fp8.gemm_backends import plan_gemm
from nemo_jetrl.fp8.spec import WEIGHT_BLOCK
from nemo_jetrl.vllm_patch import moe_versions
from nemo_jetrl.vllm_patch.expert_shards import expert_map, shard_problems, sorted_routes
from nemo_jetrl.vllm_patch.kernel import _serving_device, ensure_ops, serving_exclusions
from nemo_jetrl.vllm_patch.moe_versions import MOE_RANGES, moe_supported  # noqa: F401 (API)
from nemo_jetrl.vllm_patch.settings import PatchSettings
from nemo_jetrl.vllm_patch.shared_experts import check_runner_runs_shared

# Marks our MoE method classes (revert and idempotence need no global state).
MOE_MARKER = "_nemo_jetrl_moe_method"
# The module whose global ``Fp8MoEMethod`` ``Fp8Config.get_quant_method`` constructs.
FP8_MODULE = "vllm.model_executor.layers.quantization.fp8"
SLOT = "Fp8MoEMethod"


class MoeNotSupported(RuntimeError):
    """The installed vLLM's MoE layers are not covered by our experts kernel."""


def _fp8_module() -> Any:
    import importlib

    return importlib.import_module(FP8_MODULE)


def _slot_in_effect(mod: Any) -> bool:
    """``Fp8Config.get_quant_method`` reads the module global we replace (else our class would
    never be built: the patch would not be in effect)."""
    fn = getattr(getattr(mod, "Fp8Config", None), "get_quant_method", None)
    return fn is not None and SLOT in fn.__code__.co_names and fn.__globals__ is vars(mod)


def experts_forward(
    ops: Any,
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_s: torch.Tensor,
    w2: torch.Tensor,
    w2_s: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    pow2: bool,
    w_pow2: bool,
    eps: float,
    backend: str,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU-gated experts on block-FP8 weights. ``x`` ``[M, H]``, ``topk_*`` ``[M, k]``.

    The routed rows, sorted by expert, go through ``nemo_jetrl.fp8.experts_layer``'s
    ``routed_experts_inference`` (``x`` quantized 1x128 once and read through each row's token,
    the trainer's grouped GEMM, SiLU*up fused with the down projection's quantization by
    ``fp8.silu_mul``'s rule, the grouped down GEMM: per expert the dense layer's bits; Triton on
    CUDA with no host read, the reference on CPU) and ``experts_layer.combine`` (each token's
    rows weighted and summed in fp32 in ascending expert id: no atomics, batch-invariant).
    Activation and weight scale modes that differ (one ``Fp8LinearConfig`` holds one) take the
    per-expert loop over our dense kernel's ops (``ops``: ``kernel.ensure_ops()``, ``backend``:
    its planned GEMM), which reads the counts on the host."""
    m, k = topk_ids.shape
    e, two_i, _ = w13.shape
    from nemo_jetrl.fp8.experts_layer import combine

    # expert parallel: global ids -> this rank's (expert_shards.local_routes); others dropped
    by_expert, token, weight = sorted_routes(topk_ids, topk_weights, expert_map)
    if pow2 == w_pow2:
        from nemo_jetrl.fp8.config import Fp8LinearConfig
        from nemo_jetrl.fp8.experts_layer import routed_experts_inference
        from nemo_jetrl.fp8.grouped_tensors import GroupedQuantizedWeights

        cfg = Fp8LinearConfig(pow2_scales=pow2, eps=eps)
        grid = torch.arange(e + 1, device=x.device)
        offsets = torch.searchsorted(by_expert, grid)  # no host read
        q13 = GroupedQuantizedWeights(w13, w13_s, "e4m3", pow2)
        q2 = GroupedQuantizedWeights(w2, w2_s, "e4m3", pow2)
        # Serving: no stop on non-finite input (vLLM's warm-up runs on uninitialised buffers),
        # as the dense serving kernel does.
        y = routed_experts_inference(x, token, offsets, q13, q2, cfg, "experts", check_finite=False)
        return combine(y, token, weight, m, k, x.dtype)
    from nemo_jetrl.fp8.silu_mul import silu_mul

    # One 1x128 quantization per token; a block's bits do not depend on its neighbours.
    qx, qx_s = ops.quantize_act_1x128(x, pow2, eps, False)
    q, q_s = qx[token], qx_s[token]
    counts = torch.bincount(by_expert, minlength=e)
    start, ys = 0, []
    for ex, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gu = ops.fp8_block_gemm(
            q[rows], q_s[rows], w13[ex], w13_s[ex], x.dtype, pow2, w_pow2, backend
        )
        gate, up = gu.split(two_i // 2, dim=-1)
        a, a_s = ops.quantize_act_1x128(silu_mul(gate, up), pow2, eps, False)
        ys.append(ops.fp8_block_gemm(a, a_s, w2[ex], w2_s[ex], x.dtype, pow2, w_pow2, backend))
        start += n
    y = torch.cat(ys) if ys else x.new_zeros(0, x.shape[1])
    return combine(y, token, weight, m, k, x.dtype)


def route_softmax_topk(
    layer: Any, router_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, expert ids int32) ``[M, top_k]``: softmax in fp32, top-k, renormalized
    if the layer says so; what vLLM's default router computes. Other routings are refused."""
    odd = routing_problems(layer)
    if odd:
        raise NotImplementedError(f"nemo_jetrl experts kernel: routing with {', '.join(odd)}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(layer.top_k, dim=-1)
    if layer.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def routing_problems(layer: Any) -> list[str]:
    """What ``layer``'s routing has beyond `route_softmax_topk`'s (DeepSeek's grouped top-k and
    sigmoid scores with a bias, MiniMax-M2's sigmoid...); empty: softmax top-k."""
    return [
        f"{k}={getattr(layer, k, None)!r}"
        for k, ok in (
            ("use_grouped_topk", lambda v: not v),
            ("custom_routing_function", lambda v: v is None),
            ("scoring_func", lambda v: v in (None, "softmax")),
            ("e_score_correction_bias", lambda v: v is None),
            ("routed_scaling_factor", lambda v: v in (None, 1.0)),
        )
        if not ok(getattr(layer, k, None))
    ]


def make_moe_method_class(settings: PatchSettings, base: type, *, own_routing: bool) -> type:
    """Our subclass of vLLM's ``Fp8MoEMethod`` (``base``) bound to ``settings``. With
    ``own_routing`` (vLLM 0.20 / 0.25, whose CPU builds lack the ``topk_softmax`` op their
    router needs for non-monolithic methods: `moe_versions.own_routing`) the method is
    monolithic and routes with `route_softmax_topk`; otherwise vLLM's router picks the
    experts."""
    ops = ensure_ops()
    pow2, w_pow2, eps = settings.pow2_activation_scales, settings.pow2_weight_scales, settings.eps
    method_base = next(c for c in base.__mro__[1:] if c.__name__ == "FusedMoEMethodBase")

    class JetRLFp8MoEMethod(base):  # type: ignore[misc, valid-type]
        """Block-FP8 routed experts computed by nemo_jetrl (see experts.py)."""

        jetrl_settings_json = settings.to_json()

        def __init__(self, quant_config: Any, layer: Any) -> None:
            # vLLM's __init__ would select one of its own expert kernels: skip it.
            method_base.__init__(self, layer.moe_config)
            self.quant_config = quant_config
            self.weight_block_size = quant_config.weight_block_size
            self.block_quant = self.weight_block_size is not None
            self.weight_scale_name = "weight_scale_inv"
            self.weight_scale_refine = None
            self.moe_block_shape = self.weight_block_size
            self.fp8_backend, self.experts_cls = None, None
            name = getattr(layer, "layer_name", type(layer).__name__)
            problems = _unsupported(quant_config, layer, own_routing)
            if problems:
                raise ValueError(
                    f"nemo_jetrl experts kernel cannot serve {name}: " + "; ".join(problems)
                )
            self.jetrl_gemm_backend = plan_gemm(
                _serving_device(),
                out_dtype=layer.moe_config.in_dtype,
                pow2_scales=pow2 and w_pow2,
                kind="fprop",
                excluded=serving_exclusions(None, _serving_device()),
            ).backend
            self.jetrl_calls = 0

        @property
        def is_monolithic(self) -> bool:
            return own_routing

        def apply_monolithic(
            self, layer: Any, x: torch.Tensor, router_logits: torch.Tensor, *args: Any, **kw: Any
        ) -> torch.Tensor:
            weights, ids = route_softmax_topk(layer, router_logits)
            # vLLM's routed-experts capture (enable_return_routed_experts) hooks its router.
            capture = moe_versions.router_capture_fn(layer)
            if capture is not None:
                capture(ids)
            return self.apply(layer, x, weights, ids)

        @property
        def supports_eplb(self) -> bool:
            return False

        def get_fused_moe_quant_config(self, layer: Any) -> None:
            return None  # no vLLM experts kernel reads one

        def process_weights_after_loading(self, layer: Any) -> None:
            # Nothing to convert: the loaded FP8 bytes and scales are used as they are, in the
            # same parameter objects (refits copy into them).
            for w_name in ("w13", "w2"):
                w = getattr(layer, f"{w_name}_weight")
                s = getattr(layer, f"{w_name}_weight_scale_inv")
                want = (w.shape[0], -(-w.shape[1] // WEIGHT_BLOCK[0]), -(-w.shape[2] // 128))
                if (
                    w.dtype != torch.float8_e4m3fn
                    or s.dtype != torch.float32
                    or tuple(s.shape) != want
                ):
                    raise ValueError(
                        f"nemo_jetrl experts kernel: {w_name}_weight {tuple(w.shape)} {w.dtype} "
                        f"with scales {tuple(s.shape)} {s.dtype}; expected float8_e4m3fn and "
                        f"fp32 scales of shape {want}"
                    )
            layer.jetrl_gemm_backend = self.jetrl_gemm_backend

        def apply(
            self,
            layer: Any,
            x: torch.Tensor,
            topk_weights: torch.Tensor,
            topk_ids: torch.Tensor,
            *args: Any,
            **kw: Any,
        ) -> torch.Tensor:
            # vLLM's runner runs shared experts and adds them (shared_experts.py).
            check_runner_runs_shared(self, layer, kw.get("shared_experts"))
            self.jetrl_calls += 1
            out = experts_forward(
                ops, x, layer.w13_weight, layer.w13_weight_scale_inv,
                layer.w2_weight, layer.w2_weight_scale_inv, topk_weights, topk_ids,
                pow2=pow2, w_pow2=w_pow2, eps=eps, backend=self.jetrl_gemm_backend,
                expert_map=expert_map(layer),
            )  # fmt: skip
            capture = getattr(layer, "_jetrl_capture", None)  # eager-mode tests (worker_ext)
            if capture is not None and len(capture) < capture.maxlen:
                got = {"x": x, "ids": topk_ids, "w": topk_weights, "out": out}
                capture.append({k: v.detach().clone() for k, v in got.items()})
            return out

    setattr(JetRLFp8MoEMethod, MOE_MARKER, True)
    JetRLFp8MoEMethod._jetrl_original = base  # type: ignore[attr-defined]
    return JetRLFp8MoEMethod


def _unsupported(quant_config: Any, layer: Any, own_routing: bool) -> list[str]:
    """Why our experts kernel cannot serve ``layer`` (empty: it can); ``own_routing``: it routes
    the tokens itself (asked when vLLM builds the layer, not at its first forward)."""
    moe = layer.moe_config
    problems = []
    if own_routing and (odd := routing_problems(layer)):  # vLLM < 0.32: see moe_versions
        problems.append(f"routing with {', '.join(odd)} (this kernel routes: softmax top-k only)")
    if list(quant_config.weight_block_size or []) != list(WEIGHT_BLOCK):
        problems.append(
            f"weight_block_size {quant_config.weight_block_size} (needs {list(WEIGHT_BLOCK)})"
        )
    if getattr(quant_config, "activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme {quant_config.activation_scheme!r}")
    problems += shard_problems(layer)  # TP shards 128-aligned, EP, no vLLM DP
    if moe.has_bias:
        problems.append("biased experts")
    if getattr(moe, "swiglu_limit", None) is not None or getattr(moe, "swiglu_alpha", None):
        problems.append("clamped/scaled swiglu")
    gated = getattr(moe, "is_act_and_mul", True)
    if getattr(moe.activation, "value", moe.activation) != "silu" or not gated:
        problems.append(f"activation {moe.activation} (needs gated silu)")
    if getattr(layer, "apply_router_weight_on_input", False):
        problems.append("apply_router_weight_on_input")
    return problems


def installed_moe_method() -> type | None:
    """Our MoE method class if it is installed in this process's vLLM."""
    cur = getattr(_fp8_module(), SLOT, None)
    return cur if getattr(cur, MOE_MARKER, False) else None


def install_moe_method(settings: PatchSettings) -> type:
    """Make ``Fp8Config`` build our experts method for block-FP8 MoE layers (idempotent;
    refused with other settings installed, or on a vLLM this module does not cover)."""
    import vllm

    if not moe_supported(vllm.__version__):
        raise MoeNotSupported(
            f"nemo_jetrl experts kernel: vLLM {vllm.__version__} is not covered "
            f"({moe_versions.COVERED})"
        )
    mod = _fp8_module()
    if not _slot_in_effect(mod):
        raise MoeNotSupported(
            f"nemo_jetrl experts kernel: {FP8_MODULE}.Fp8Config.get_quant_method does not build "
            f"{SLOT} from its module global in this vLLM; the patch would not be in effect"
        )
    existing = installed_moe_method()
    if existing is not None:
        if existing.jetrl_settings_json != settings.to_json():
            raise RuntimeError(
                "nemo_jetrl experts kernel already installed with different settings "
                f"({existing.jetrl_settings_json}); revert the previous patch first"
            )
        return existing
    own_routing = moe_versions.own_routing(vllm.__version__)
    cls = make_moe_method_class(settings, getattr(mod, SLOT), own_routing=own_routing)
    setattr(mod, SLOT, cls)
    if getattr(mod, SLOT) is not cls:
        raise MoeNotSupported(f"nemo_jetrl experts kernel: {FP8_MODULE}.{SLOT} did not take")
    return cls


def uninstall_moe_method() -> int:
    """Put vLLM's ``Fp8MoEMethod`` back; returns how many of our classes were removed."""
    import sys

    mod = sys.modules.get(FP8_MODULE)
    if mod is None:
        return 0
    cur, n = getattr(mod, SLOT, None), 0
    while getattr(cur, MOE_MARKER, False):
        cur, n = cur._jetrl_original, n + 1  # type: ignore[union-attr]
    if n:
        setattr(mod, SLOT, cur)
    return n


def moe_layer_report(module: Any) -> dict[str, Any] | None:
    """The guard's entry for a block-FP8 routed-experts layer (None: not one)."""
    if not hasattr(module, "w13_weight_scale_inv"):
        return None
    qm = getattr(module, "quant_method", None)
    vllm_kernel = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    ours = bool(getattr(type(qm), MOE_MARKER, False)) and vllm_kernel is None
    name = type(qm).__name__
    if vllm_kernel is not None or getattr(qm, "experts_cls", None) is not None:
        inner = vllm_kernel if vllm_kernel is not None else qm.experts_cls
        name += f" with {getattr(inner, '__name__', type(inner).__name__)}"
    return {
        "kernel": name,
        "ours": ours,
        "settings": getattr(qm, "jetrl_settings_json", None),
        "gemm_backend": getattr(qm, "jetrl_gemm_backend", None),
        "moe": True,
        "calls": int(getattr(qm, "jetrl_calls", 0)),
    }


def routed_experts(output: Any) -> Any:
    """The experts vLLM's router chose for each token of a request's first completion
    (``enable_return_routed_experts=True``): an int array ``[tokens, moe_layers, top_k]``;
    ValueError when the engine did not record them."""
    got = getattr(output.outputs[0], "routed_experts", None)
    if got is None:
        raise ValueError(
            "no routed experts in this output: start the engine with "
            "enable_return_routed_experts=True (vLLM >= 0.32's LLM argument)"
        )
    return got
