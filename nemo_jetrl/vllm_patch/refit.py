"""Refit: trainer weights -> ``nemo_jetrl.fp8`` -> guards -> the running vLLM engine -> parity.

One refit does, in order (nothing is sent unless every check before it passed):

1. KV scales (optional) are validated first: each q/k/v scale a real number (not bool or
   string) finite and > 0 as fp32 (1e-46 is 0 there), every layer a decoder index >= 0 that the
   engine has, the recipe's KV cache FP8, and not stale (a `KVScales` calibrated for another
   ``weights_version`` than this refit's). Invalid scales refuse the whole refit before any
   weight is sent: the engine keeps its previous weights and scales.
2. ``quantize_state_dict``: every linear weight the recipe runs in FP8 is quantized with
   ``quantize_blockwise(w, (128, 128))`` in the recipe's scale mode, the same call the trainer's
   FP8 forward uses, giving the FP8 ``weight`` and fp32 ``weight_scale_inv`` vLLM stores. Other
   tensors (embeddings, norms, lm_head, BF16 layers) are sent in the model dtype. Non-finite values
   are refused naming the tensor, as are FP8 blocks whose dequantized values overflow fp32
   (a BF16/FP16-max weight with power-of-two scales) and tensors that overflow the engine's
   dtype when cast; FP8 weights TE's FP8 GEMM refuses (`fp8.spec.linear_dims_problem`) too (BF16
   on both sides). Partial 128-blocks are sent as they are (576 rows: a [5, K/128] scale).
3. Shape guard: each tensor's shape and dtype against the engine's parameter slice (all named).
4. Load through vLLM's own layerwise reload (``compat.reload_weights``): the model's
   ``load_weights`` routes each tensor, every layer's ``process_weights_after_loading`` runs again
   (what vLLM derives from a weight, such as the CPU build's packed GEMM copies, is rebuilt), and
   the result lands in the existing parameters (parameter identity is checked: a refit that
   replaced a parameter object is an error). FP8 bytes and scales are not requantized.
5. Parity (on by default): every tensor is read back through paths independent of the loader and
   compared with what the trainer sent: FP8 weights and scales byte for byte, other tensors
   byte for byte where the parameter holds them, and unquantized linear weights also *through the
   layer's GEMM* (identity rows in, ``W^T`` out), so a stale derived copy cannot pass, nor a
   stale MLA ``W_UK_T``/``W_UV`` (`parity_views`). Any differing tensor is named. Then the
   prefix cache is emptied (`refit_kv.drop_cached_prefixes`: no KV of the old weights reused).
6. Rollback (on by default): steps 4-5 (and the reset) run in ``rollback.engine_rollback``: each
   worker snapshots its model (one copy of the weights, never the KV cache) before the first
   tensor lands; if one fails, every worker is put back, verified bit for bit, and the error says so.

Tensors cross to the workers by ``LLM.collective_rpc`` (FP8 as uint8 bytes: small models, CPU
tests); large GPU models go through NeMo-RL's own transport to the same worker methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.fp8.staging import quantized_weight_problem
from nemo_jetrl.vllm_patch import compat, expert_shards, parity_views
from nemo_jetrl.vllm_patch.refit_kv import (
    ParityError,
    RefitError,
    check_kv_layers,
    drop_cached_prefixes,
    fresh_kv_layers,
    kv_scales,
    normalize_kv_scales,
    set_kv_scales,
)
from nemo_jetrl.vllm_patch.rollback import engine_rollback
from nemo_jetrl.vllm_patch.settings import (
    ATTN_PROJS,
    GDN_PROJS,
    MLA_PROJS,
    MLP_PROJS,
    WEIGHT_BLOCK,
    PatchSettings,
    settings_from_recipe,
)
from nemo_jetrl.vllm_patch.worker_ext import pack, unpack

# The KV-scale half and the errors live in `refit_kv`; callers import them from here too.
__all__ = [
    "ParityError",
    "QuantizedStateDict",
    "RefitError",
    "RefitReport",
    "check_kv_layers",
    "check_parity",
    "guard_shapes",
    "kv_scales",
    "load_hf_state_dict",
    "normalize_kv_scales",
    "pack",
    "quantize_state_dict",
    "refit",
    "refit_from_checkpoint",
    "set_kv_scales",
    "unpack",
]

FP8_PROJS = ATTN_PROJS + MLA_PROJS + MLP_PROJS + GDN_PROJS
SCALE_SUFFIX = "weight_scale_inv"
# How a refusal before the engine was touched starts.
REFUSED = "refit refused, nothing was loaded"


@dataclass(frozen=True)
class QuantizedStateDict:
    """What a refit sends: HF names -> tensors (FP8 weights + their ``weight_scale_inv``)."""

    tensors: dict[str, torch.Tensor]
    fp8_layers: tuple[str, ...]
    """HF module names whose weights are FP8 (e.g. ``model.layers.0.self_attn.q_proj``)."""
    other_names: tuple[str, ...]
    """Tensors sent in the model dtype (embeddings, norms, lm_head, BF16 layers, biases)."""

    def fp8_names(self) -> list[str]:
        return [f"{m}.{s}" for m in self.fp8_layers for s in ("weight", SCALE_SUFFIX)]


@dataclass(frozen=True)
class ParityReport:
    compared: int
    """Tensors compared (every tensor the refit sent)."""
    fp8: int
    """Of those, FP8 weights and their scales (compared byte for byte)."""
    through_kernel: int
    """Unquantized linear weights also read back through the layer's own GEMM."""
    differing: tuple[str, ...]
    """Names of tensors whose bits differ (empty when parity holds)."""
    not_local: int = 0
    """Routed-expert tensors sent that this expert-parallel rank does not hold (not compared)."""
    derived: int = 0
    """vLLM's MLA copies of a sent kv_b_proj (W_UK_T/W_UV, `parity_views`) compared."""


@dataclass(frozen=True)
class RefitReport:
    fp8_layers: int
    other_tensors: int
    bytes_sent: int
    seconds: float
    kv_layers: tuple[str, ...]
    parity: ParityReport | None


def is_fp8_weight(name: str, settings: PatchSettings) -> bool:
    """True if HF tensor ``name`` is a linear weight the recipe runs in FP8 in the rollout."""
    if not settings.fp8_weights or not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")]
    if any(kw in module for kw in settings.bf16_layer_kws):
        return False
    return module.rsplit(".", 1)[-1] in FP8_PROJS and module not in settings.modules_to_not_convert


def quantize_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    recipe: Any,
    *,
    dtype: torch.dtype = torch.bfloat16,
    refused: str = REFUSED,
) -> QuantizedStateDict:
    """Quantize a trainer state dict (HF names, BF16/FP32) for the rollout engine (guards 2);
    ``refused`` opens the error (a streamed refit says what the earlier batches did)."""
    settings = settings_from_recipe(recipe)
    errors: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    fp8_layers: list[str] = []
    others: list[str] = []
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            errors.append(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            continue
        if is_fp8_weight(name, settings):
            why = "not 2-D" if t.dim() != 2 else expert_shards.fp8_dims_problem(name, t.shape)
            if why is not None:  # partial 128-blocks are fine (ceil-sized scale grid)
                errors.append(
                    f"{name}: shape {tuple(t.shape)}: {why}. Keep this layer in BF16 on both "
                    "sides (add it to the recipe's BF16 layers)"
                )
                continue
            try:
                q = quantize_blockwise(
                    t.detach(),
                    WEIGHT_BLOCK,
                    fmt=settings.fmt,
                    pow2_scales=settings.pow2_weight_scales,
                    eps=settings.eps,
                    name=name,
                )
            except (ValueError, TypeError) as exc:
                errors.append(str(exc))
                continue
            if (why := quantized_weight_problem(q.data, q.scale_inv, dtype)) is not None:
                errors.append(f"{name}: {why}")
                continue
            module = name[: -len(".weight")]
            tensors[name] = q.data
            tensors[f"{module}.{SCALE_SUFFIX}"] = q.scale_inv
            fp8_layers.append(module)
        else:
            if t.is_floating_point():
                if not bool(torch.isfinite(t).all()):
                    bad = int((~torch.isfinite(t)).sum())
                    errors.append(f"{name}: {bad} non-finite value(s); refusing to refit")
                    continue
                t = t.detach().to(dtype)
                if not bool(torch.isfinite(t).all()):
                    errors.append(f"{name}: finite values overflow {dtype} (inf after the cast)")
                    continue
            tensors[name] = t
            others.append(name)
    if errors:
        raise RefitError(f"{refused}:\n  - " + "\n  - ".join(errors))
    return QuantizedStateDict(tensors, tuple(fp8_layers), tuple(others))


def guard_shapes(llm: Any, qsd: QuantizedStateDict) -> None:
    """Compare every tensor's shape/dtype with the engine slice it lands in; report all."""
    names = list(qsd.tensors)
    engine = llm.collective_rpc("jetrl_shapes", args=(names,))[0]
    errors = []
    for name in names:
        info = engine.get(name)
        t = qsd.tensors[name]
        if isinstance(info, str):
            errors.append(f"{name}: {info}")
            continue
        shape, dtype = info
        if tuple(shape) != tuple(t.shape):
            errors.append(f"{name}: trainer shape {tuple(t.shape)}, engine expects {tuple(shape)}")
        elif (t.element_size() == 1 or SCALE_SUFFIX in name or "float8" in dtype) and (
            str(t.dtype) != dtype
        ):  # FP8 bytes and scales land in identically typed parameters only (a copy converts:
            # BF16 into FP8 without scales); other BF16 tensors are cast by vLLM's loader.
            errors.append(
                f"{name}: trainer dtype {t.dtype}, engine holds {dtype} (is the engine running "
                "with the recipe's engine kwargs, quantization fp8 with 128x128 blocks?)"
            )
    if errors:
        raise RefitError(f"{REFUSED}:\n  - " + "\n  - ".join(errors))


# A reader: (HF names, through_kernel) -> (name or "name|kernel", host tensor), one at a time
# (``worker_ext.read_back`` in the worker, `rpc_read_back` from the driver).
ReadBack = Callable[[list[str], bool], Iterable[tuple[str, torch.Tensor]]]
# Bytes of tensors one read-back RPC carries (the blob and its unpacked copy, on each side).
READ_BACK_CHUNK_BYTES = 256 << 20


def rpc_read_back(llm: Any, sizes: Mapping[str, int]) -> ReadBack:
    """Read back through ``llm.collective_rpc("jetrl_read_back")`` in chunks of at most
    ``READ_BACK_CHUNK_BYTES`` (``sizes``: bytes per name) rather than all tensors at once."""

    def read(names: list[str], through_kernel: bool) -> Iterator[tuple[str, torch.Tensor]]:
        chunk: list[str] = []
        held = 0
        for i, name in enumerate(names):
            chunk.append(name)
            held += sizes.get(name, 0) * (2 if through_kernel else 1)
            if held >= READ_BACK_CHUNK_BYTES or i == len(names) - 1:
                blob = llm.collective_rpc("jetrl_read_back", args=(chunk, through_kernel))[0]
                yield from unpack(blob).items()
                chunk, held = [], 0

    return read


def check_parity(llm: Any, qsd: QuantizedStateDict, read: ReadBack | None = None) -> ParityReport:
    """Read every sent tensor back from the engine and compare it, one tensor at a time (raise
    ParityError naming the differing ones); ``read`` defaults to `rpc_read_back` on ``llm``."""
    if read is None:
        sizes = {n: t.numel() * t.element_size() for n, t in qsd.tensors.items()}
        read = rpc_read_back(llm, sizes)
    fp8_names = qsd.fp8_names()
    other = [n for n in qsd.tensors if n not in set(fp8_names)]
    differing, seen, derived = [], set(), 0
    for key, got in read(fp8_names, True):  # through_kernel: views of what vLLM derives
        name, _, view = key.partition("|")
        want = qsd.tensors[name]
        seen.add(name)
        if view:  # MLA's W_UK_T/W_UV from an FP8 kv_b_proj
            derived += 1
            scale = qsd.tensors[f"{name.rpartition('.')[0]}.{SCALE_SUFFIX}"]
            if (why := parity_views.view_problem(got, want, scale)) is not None:
                differing.append(f"{name} ({why})")
        elif got.dtype != want.dtype:
            differing.append(f"{name} (engine holds {got.dtype})")
        elif (why := parity_views.differ(got, want, bytewise=True)) is not None:
            differing.append(f"{name} ({why})")
    differing += [f"{n} (engine holds None)" for n in fp8_names if n not in seen]
    kernel_views = 0
    for key, got in read(other, True):
        name, _, view = key.partition("|")
        seen.add(name)
        kernel_views += view == "kernel"
        if view == parity_views.VIEW:  # MLA's W_UK_T/W_UV from a BF16 kv_b_proj
            derived, why = derived + 1, parity_views.view_problem(got, qsd.tensors[name], None)
        else:
            why = parity_views.differ(got, qsd.tensors[name], bytewise=view == "")
        if why is not None:
            label = "through the layer's GEMM: " if view == "kernel" else ""
            differing.append(f"{name} ({label}{why})")
    differing += [f"{n} (the engine has no readable copy of it)" for n in other if n not in seen]
    if differing:
        raise ParityError(
            "refit parity check failed: the engine computes with tensors that differ from what "
            "the trainer sent in:\n  - " + "\n  - ".join(differing)
        )
    return ParityReport(
        compared=len(qsd.tensors),
        fp8=len(fp8_names),
        through_kernel=kernel_views,
        differing=(),
        derived=derived,
    )


def refit(
    llm: Any,
    state_dict: Mapping[str, torch.Tensor],
    recipe: Any,
    *,
    kv_scales: Mapping[Any, Mapping[str, float]] | None = None,
    parity: bool = True,
    rollback: bool = True,
    dtype: torch.dtype | None = None,
    weights_version: int | None = None,
) -> RefitReport:
    """Quantize, guard, load into ``llm`` (a ``vllm.LLM`` started with our engine kwargs).

    ``dtype``: what non-FP8 tensors are sent as; default: the dtype the engine serves in.
    ``kv_scales``: ``{layer index or attention name: {q, k, v}}`` or a `KVScales`; a `KVScales`
    whose ``calibrated_for`` differs from ``weights_version`` (both given) is stale and refused.
    All-or-nothing: every input is checked before the first tensor is sent; with ``rollback``
    a failure after that (in the loader, the parity check) restores the engine (module doc).
    """
    t0 = time.perf_counter()
    settings = settings_from_recipe(recipe)
    scales = None
    if kv_scales is not None:
        if not settings.fp8_kv_cache:
            raise RefitError(
                f"KV scales given but the recipe's kv_cache_dtype is {settings.kv_cache_dtype!r}; "
                "vLLM ignores them for a BF16 KV cache. Set kv_cache_dtype fp8 or drop kv_scales"
            )
        scales = normalize_kv_scales(fresh_kv_layers(kv_scales, weights_version))
    qsd = quantize_state_dict(state_dict, settings, dtype=dtype or torch.float32)
    if dtype is None:  # validated first; now cast to what the engine serves in
        qsd = _cast_checked(qsd, compat.engine_model_dtype(llm))
    if scales is not None:
        check_kv_layers(llm, scales)
    guard_shapes(llm, qsd)
    with engine_rollback(llm, rollback):  # from here on the engine changes: undone on error
        results = llm.collective_rpc("jetrl_load_weights", args=(pack(qsd.tensors),))
        moved = sorted({m for r in results for m in r["moved"]})
        if moved:
            raise RefitError(f"refit replaced parameter objects instead of copying: {moved}")
        kv_layers: tuple[str, ...] = ()
        if scales is not None:
            kv_layers = set_kv_scales(llm, scales)
        report = check_parity(llm, qsd) if parity else None
        drop_cached_prefixes(llm)  # KV cached under the old weights; refused: rolled back
    return RefitReport(
        fp8_layers=len(qsd.fp8_layers),
        other_tensors=len(qsd.other_names),
        bytes_sent=sum(t.numel() * t.element_size() for t in qsd.tensors.values()),
        seconds=time.perf_counter() - t0,
        kv_layers=kv_layers,
        parity=report,
    )


def _cast_checked(qsd: QuantizedStateDict, dtype: torch.dtype) -> QuantizedStateDict:
    """``qsd`` with its other tensors cast to the engine's ``dtype``; RefitError when a tensor
    or a dequantized FP8 block is finite as sent but not in ``dtype`` (nothing loaded)."""
    tensors, errors = dict(qsd.tensors), []
    for n in qsd.other_names:
        if tensors[n].is_floating_point():
            tensors[n] = tensors[n].to(dtype)
            if not bool(torch.isfinite(tensors[n]).all()):
                errors.append(f"{n}: finite values overflow {dtype} (inf after the cast)")
    for m in qsd.fp8_layers:
        w, s = tensors[f"{m}.weight"], tensors[f"{m}.{SCALE_SUFFIX}"]
        if (why := quantized_weight_problem(w, s, dtype)) is not None:
            errors.append(f"{m}.weight: {why}")
    if errors:
        raise RefitError(f"{REFUSED}:\n  - " + "\n  - ".join(errors))
    return QuantizedStateDict(tensors, qsd.fp8_layers, qsd.other_names)


def load_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint directory (``*.safetensors``)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise RefitError(f"{model_dir}: no *.safetensors files to refit from")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def refit_from_checkpoint(llm: Any, model_dir: str | Path, recipe: Any, **kw: Any) -> RefitReport:
    """First load of an engine started with ``load_format='dummy'``: refit from a HF checkpoint."""
    return refit(llm, load_hf_state_dict(model_dir), recipe, **kw)
