"""vLLM's CPU BF16 experts after a refit: their weights packed again, as the kernel reads them.

vLLM 0.32's CPU experts kernels for unquantized MoE (``CPUUnquantizedExperts`` and its x86 AMX /
Arm / Power subclasses, ``fused_moe/experts/cpu_moe.py``) prepack ``w13_weight`` / ``w2_weight``
into their blocked layout when the model loads (``cpu_prepack_moe_weight``, same shape). vLLM's
layerwise reload, which every refit goes through, leaves the reloaded *plain* rows in those
parameters without packing them again (measured: after a refit the parameter holds the sent rows
byte for byte), and the kernel then multiplies by a permutation of the trainer's weights: a bf16
MoE run's engine logprobs were 0.3 nats per token (gen_kl_error) from the trainer's while the
plain read-back passed. `repack_reloaded_experts` runs after the reload, in the worker: for each
such layer whose parameters hold exactly the sent rows it packs them in place (the parameter
objects and storage stay) and keeps the plain rows as ``layer._jetrl_unpacked``; `plain_rows`
then gives the parity read-back those rows, after `repack_reloaded_experts` checked that the
packed parameter is ``cpu_prepack_moe_weight`` of them. A layer whose parameters do not hold the
sent rows (a vLLM that packs on reload) is left alone, and parity names it.

vLLM 0.20 packs on reload: its CPU experts (``cpu_fused_moe.CPUFusedMOE``, grouped GEMM, "vec"
on AVX-512 without AMX) prepack in ``process_weights_after_loading``, which the layerwise reload
runs, so after a refit the parameters hold the packed layout of the sent rows (measured on an
AMD EPYC: 58,601 of 65,536 bytes of an expert differ from the rows sent, and parity refused every
refit of a local bf16 MoE run). `repack_reloaded_experts` checks that each parameter is exactly
``cpu_prepack_moe_weight`` of the sent rows (every expert of the layer sent) and then keeps those
rows for the read-back as above; anything else is left for parity to name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_jetrl.vllm_patch.moe_names import resolve_expert_tensor

WEIGHTS = ("w13_weight", "w2_weight")


def _bf16_experts(layer: torch.nn.Module) -> bool:
    """An unquantized routed-experts layer (w13/w2 weights, no FP8 scales)."""
    return hasattr(layer, "w13_weight") and not hasattr(layer, "w13_weight_scale_inv")


def _cpu_experts_isa(layer: torch.nn.Module) -> str | None:
    """The ISA a CPU unquantized experts kernel packed ``layer``'s weights for (None: none)."""
    if not _bf16_experts(layer):
        return None
    kernel = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)  # fmt: skip
    if kernel is None or getattr(kernel, "_use_zentorch", False):
        return None
    if not any(c.__name__ == "CPUUnquantizedExperts" for c in type(kernel).__mro__):
        return None
    return getattr(kernel, "isa", None)


def _packed_on_load_isa(layer: torch.nn.Module) -> str | None:
    """vLLM 0.20: the ISA ``CPUFusedMOE`` packed ``layer``'s BF16 experts for (None: none)."""
    if not _bf16_experts(layer):
        return None
    fused = getattr(getattr(layer, "quant_method", None), "cpu_fused_moe", None)
    if type(fused).__name__ != "CPUFusedMOE":
        return None
    if getattr(getattr(fused, "forward_method", None), "__name__", "") != "forward_grouped_gemm":
        return None
    return getattr(fused, "isa", None)


def _plain_if_packed_on_load(layer: torch.nn.Module, sent_rows: list, isa: str) -> dict | None:
    """The sent rows as full parameters, if every parameter is exactly their packed layout."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    plain = {w: torch.full_like(getattr(layer, w).data, float("nan")) for w in WEIGHTS}
    for leaf, expert_view, start, rows, t in sent_rows:
        full = getattr(layer, leaf).data
        local = (expert_view.data_ptr() - full.data_ptr()) // (full.stride(0) * full.element_size())
        plain[leaf][local, start : start + rows] = t.to(full.dtype)
    if any(bool(torch.isnan(p).any()) for p in plain.values()):
        return None  # not every expert row of the layer was sent
    for w in WEIGHTS:
        if not torch.equal(getattr(layer, w).data, cpu_prepack_moe_weight(plain[w], isa)):
            return None
    return plain


def repack_reloaded_experts(model: torch.nn.Module, sent: Mapping[str, torch.Tensor]) -> list[str]:
    """Pack again the CPU BF16 experts layers the reload left plain, or check the ones it packed
    (module docstring); returns their names. ``sent``: the HF-named tensors this refit loaded."""
    by_layer: dict[str, list[tuple]] = {}
    for name, t in sent.items():
        got = resolve_expert_tensor(model, name)
        if got is not None:
            vname, param, start, rows = got
            path, _, leaf = vname.rpartition(".")
            by_layer.setdefault(path, []).append((leaf, param, start, rows, t))
    repacked = []
    for path, sent_rows in by_layer.items():
        layer = model.get_submodule(path)
        packed_isa = _packed_on_load_isa(layer)
        if packed_isa is not None:
            plain = _plain_if_packed_on_load(layer, sent_rows, packed_isa)
            if plain is not None:
                layer._jetrl_unpacked = plain
                repacked.append(path)
            continue
        isa = _cpu_experts_isa(layer)
        if isa is None or not all(
            torch.equal(p[s : s + r], t.to(p.dtype)) for _, p, s, r, t in sent_rows
        ):
            continue
        from vllm._custom_ops import cpu_prepack_moe_weight

        plain = {}
        for w in WEIGHTS:
            param = getattr(layer, w)
            plain[w] = param.data.clone()
            param.data.copy_(cpu_prepack_moe_weight(plain[w], isa))
            if not torch.equal(param.data, cpu_prepack_moe_weight(plain[w], isa)):
                raise RuntimeError(f"{path}.{w}: packing is not deterministic")
        layer._jetrl_unpacked = plain
        repacked.append(path)
    return repacked


def plain_rows(model: torch.nn.Module, hf_name: str, got: tuple[str, Any, int, int]) -> tuple:
    """`resolve_expert_tensor`'s answer with the plain rows of a layer `repack_reloaded_experts`
    packed (its parameter holds the packed layout)."""
    vname, _, start, rows = got
    path, _, leaf = vname.rpartition(".")
    plain = getattr(model.get_submodule(path), "_jetrl_unpacked", None)
    if plain is None or leaf not in plain:
        return got
    expert = int(hf_name.split(".experts.")[1].split(".")[0])
    return vname, plain[leaf][expert], start, rows
