"""MoE expert weights in NeMo-RL's streamed vLLM refit: names, engine slices, grouped slabs.

NeMo-RL streams expert weights in one of two layouts (both trees' ``quantization/fp8.py``):

* per expert, ``<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight`` [N, K] (Qwen3-MoE,
  DeepSeek-V3, Moonlight): NeMo-RL quantizes each like a linear and loads ``weight`` +
  ``weight_scale_inv`` through vLLM's expert mapping (``FusedMoE.make_expert_params_mapping``);
* grouped slabs (main, Qwen3.5-MoE), ``<layer>.mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows,
  then up rows) and ``<layer>.mlp.experts.down_proj`` [E, H, I]: main's
  ``_expand_grouped_moe_expert_to_fp8`` re-emits them per expert when the engine's experts are
  FP8, and passes them through unchanged when they are BF16.

Here a grouped slab becomes the same per-expert BF16 names (`expand_grouped`, views, no copy),
so every expert weight goes through the dense path's quantizer and guards
(``refit.quantize_state_dict``: one ``quantize_blockwise(w_e, (128, 128))`` per expert, never a
block across two experts or across gate/up; a shape that would need one is refused by name).
The engine side is vLLM's fused expert parameters, ``w13_*`` [E, 2I, .] (gate shard first, up
second) and ``w2_*`` [E, H, .], on the ``FusedMoE`` module (vLLM 0.20) or the ``RoutedExperts``
a ``MoERunner`` owns (0.25+): a per-expert name resolves to its slice through
``worker_ext.resolve_hf_name`` (``vllm_patch.moe_names.resolve_expert_tensor``: this rank's
shard under tensor parallel, global ids mapped to local ones under expert parallel, where the
experts other ranks hold are left to vLLM's loader and out of this rank's parity check:
``vllm_patch.expert_shards``); a BF16 grouped slab to its rank's whole parameter
(`grouped_param`), compared with the part of the slab vLLM's loader writes there
(`slab_rank_expected`: local experts, this rank's slice of I).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from nemo_jetrl.vllm_patch import expert_shards
from nemo_jetrl.vllm_patch.refit import RefitError, is_fp8_weight
from nemo_jetrl.vllm_patch.settings import WEIGHT_BLOCK, PatchSettings
from nemo_jetrl.vllm_patch.worker_ext import read_back

GROUPED = re.compile(r"^(?P<base>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def experts_module(model: torch.nn.Module, base: str) -> torch.nn.Module | None:
    """The module holding ``w13_weight`` / ``w2_weight`` for HF prefix ``base`` (None if none)."""
    from nemo_jetrl.vllm_patch.engine_names import engine_path

    try:
        m = model.get_submodule(engine_path(model, base))
    except AttributeError:
        return None
    m = getattr(m, "routed_experts", m)  # vLLM >= 0.25: MoERunner -> RoutedExperts
    ok = all(isinstance(getattr(m, f"{g}_weight", None), torch.Tensor) for g in ("w13", "w2"))
    return m if ok else None


def _fp8(module: torch.nn.Module) -> bool:
    return all(getattr(module, f"{g}_weight").element_size() == 1 for g in ("w13", "w2"))


def grouped_param(model: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The fused parameter a grouped BF16 slab loads into (None: not a slab name, or no
    such experts in the engine)."""
    g = GROUPED.match(name)
    module = experts_module(model, g["base"]) if g is not None else None
    if module is None:
        return None
    return getattr(module, "w13_weight" if g["proj"] == "gate_up_proj" else "w2_weight")


def slab_rank_expected(model: torch.nn.Module, name: str, slab: torch.Tensor) -> torch.Tensor:
    """This rank's part of a grouped BF16 slab (``[E, 2I, H]`` gate_up / ``[E, H, I]`` down),
    as vLLM's fused loader writes it into the rank's ``w13_weight`` / ``w2_weight``: the local
    experts in local order (expert parallel), then gate rows and up rows of this rank's slice of
    ``I``, or its columns of ``I`` for down (tensor parallel; `expert_shards` for the layout)."""
    g = GROUPED.match(name)
    assert g is not None, name
    layer = experts_module(model, g["base"])
    par, emap = expert_shards.parallel(layer), expert_shards.expert_map(layer)
    if emap is not None:  # global -> local id, -1 elsewhere
        here = sorted((int(local), e) for e, local in enumerate(emap.tolist()) if local >= 0)
        slab = slab[[e for _, e in here]]
    tp, r = par.tp_size, par.tp_rank
    if tp == 1:
        return slab
    if g["proj"] == "down_proj":
        per = slab.shape[2] // tp
        return slab[:, :, r * per : (r + 1) * per]
    inter = slab.shape[1] // 2
    per = inter // tp
    gate, up = slab[:, r * per : (r + 1) * per], slab[:, inter + r * per : inter + (r + 1) * per]
    return torch.cat([gate, up], dim=1)


def expand_grouped(
    weights: list[tuple[str, torch.Tensor]], model: torch.nn.Module, settings: PatchSettings
) -> list[tuple[str, torch.Tensor]]:
    """Grouped expert slabs whose engine experts are FP8 -> per-expert BF16 ``.weight`` views
    (what main's ``_expand_grouped_moe_expert_to_fp8`` emits before quantizing); the rest as is.
    RefitError naming the slab when a 128-row block would straddle two experts or gate/up."""
    out: list[tuple[str, torch.Tensor]] = []
    wrong = []
    for k, v in weights:
        g = GROUPED.match(k)
        module = experts_module(model, g["base"]) if g is not None else None
        if g is None or module is None:
            out.append((k, v))
            continue
        per_expert = f"{g['base']}.0.{'down_proj' if g['proj'] == 'down_proj' else 'gate_proj'}"
        recipe_fp8 = is_fp8_weight(f"{per_expert}.weight", settings)
        if not _fp8(module):
            if recipe_fp8:
                wrong.append(f"{k}: the recipe runs it in FP8, the engine holds BF16 experts")
            out.append((k, v))  # BF16 experts: vLLM's fused loader takes the slab as it is
            continue
        if not recipe_fp8:
            wrong.append(f"{k}: the recipe runs it in BF16, the engine holds FP8 experts")
            continue
        halves = 2 if g["proj"] == "gate_up_proj" else 1
        if v.dim() != 3 or v.shape[1] % halves:
            wrong.append(f"{k}: expected [experts, rows, cols], got {tuple(v.shape)}")
            continue
        # the hidden size sits where the engine's fused parameter has it ([E, 2I, H] / [E, H, I]);
        # a transposed slab (Llama 4's [E, H, 2I]) would be split along the wrong dim
        hidden_dim = 2 if halves == 2 else 1
        engine = getattr(module, "w13_weight" if halves == 2 else "w2_weight")
        if v.shape[hidden_dim] != engine.shape[hidden_dim]:
            wrong.append(
                f"{k}: {tuple(v.shape)} does not have the engine's hidden size "
                f"{engine.shape[hidden_dim]} in dim {hidden_dim} (its experts are "
                f"{tuple(engine.shape)}): a transposed slab layout"
            )
            continue
        rows = v.shape[1] // halves
        if rows % WEIGHT_BLOCK[0] or v.shape[2] % WEIGHT_BLOCK[1]:
            what = "expert or gate/up" if halves == 2 else "expert"
            wrong.append(
                f"{k}: {tuple(v.shape)} has {rows} rows per {'shard' if halves == 2 else 'expert'}"
                f" and {v.shape[2]} columns; a {WEIGHT_BLOCK} block would straddle an {what} "
                "boundary. Keep these experts in BF16 on both sides "
                "(quantization_ignored_layer_kws and jetrl.train_bf16_layer_kws)"
            )
            continue
        projs = ("gate_proj", "up_proj") if halves == 2 else ("down_proj",)
        for i, proj in enumerate(projs):
            for e in range(v.shape[0]):
                out.append((f"{g['base']}.{e}.{proj}.weight", v[e, i * rows : (i + 1) * rows]))
    if wrong:
        raise RefitError(
            "refit refused: grouped MoE expert weights cannot be quantized per expert:\n  - "
            + "\n  - ".join(wrong)
        )
    return out


def read_back_with_experts(
    worker: Any, names: list[str], through_kernel: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``worker_ext.read_back`` (per-expert names included: ``vllm_patch.experts``), grouped
    BF16 slabs read whole from their fused parameter."""
    model = worker.model_runner.model
    slabs = {n: p for n in names if (p := grouped_param(model, n)) is not None}
    yield from read_back(worker, [n for n in names if n not in slabs], through_kernel)
    for name, p in slabs.items():
        yield name, p.data.detach().to("cpu")
