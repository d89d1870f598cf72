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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_jetrl.vllm_patch.moe_names import resolve_expert_tensor

WEIGHTS = ("w13_weight", "w2_weight")


def _cpu_experts_isa(layer: torch.nn.Module) -> str | None:
    """The ISA a CPU unquantized experts kernel packed ``layer``'s weights for (None: none)."""
    if hasattr(layer, "w13_weight_scale_inv") or not hasattr(layer, "w13_weight"):
        return None
    kernel = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)  # fmt: skip
    if kernel is None or getattr(kernel, "_use_zentorch", False):
        return None
    if not any(c.__name__ == "CPUUnquantizedExperts" for c in type(kernel).__mro__):
        return None
    return getattr(kernel, "isa", None)


def repack_reloaded_experts(model: torch.nn.Module, sent: Mapping[str, torch.Tensor]) -> list[str]:
    """Pack again the CPU BF16 experts layers the reload left plain (module docstring); returns
    their names. ``sent``: the HF-named tensors this refit loaded."""
    by_layer: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, t in sent.items():
        got = resolve_expert_tensor(model, name)
        if got is not None:
            vname, param, start, rows = got
            by_layer.setdefault(vname.rpartition(".")[0], []).append(
                (param[start : start + rows], t)
            )
    repacked = []
    for path, pairs in by_layer.items():
        layer = model.get_submodule(path)
        isa = _cpu_experts_isa(layer)
        if isa is None or not all(torch.equal(p, t.to(p.dtype)) for p, t in pairs):
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
