"""Every vLLM-version-dependent access of the patch, one function per concern.

The patch touches a handful of vLLM internals. Between the two release lines we support they are
the same in shape but differ in a few details, which are handled here and nowhere else:

* **Supported versions** (``SUPPORTED_RANGES``). Each range up to 0.32 was run against a real
  vLLM CPU build with the whole ``vllm`` test tier (see docs/vllm_patch.md for the exact
  commands): vLLM 0.20.0 (the version NeMo-RL v0.7.0 ships), 0.25.1 (NeMo-RL main) and 0.32.x.
  vLLM 0.33.0 has no CPU build: its CUDA wheel's source was diffed against 0.32.0 where the patch
  touches it (kernel base classes, layerwise reload, plugins: identical; the block-FP8 registry,
  ``_resolve_backend_kernels`` and ``linear_backend``: identical in shape; ``Fp8LinearMethod``,
  ``Attention``, ``WorkerWrapperBase``: changes that do not touch what we use), and its kernel
  registry and selection code run in a test with a CUDA platform stand-in
  (tests/vllm_patch/test_vllm033_selection.py).
* **Linear backend** (vLLM >= 0.32: ``linear_backend``, ``kernel_config.linear_backend_per_quant``
  keyed by ``FP8_BLOCK_QUANT_KEY``): a value other than ``auto`` can filter our kernel out of the
  registry list (``guard.engine_arg_problems`` refuses it). vLLM 0.20 has no such option.
* **Block-FP8 kernel registry** (``vllm.model_executor.kernels.linear._POSSIBLE_FP8_BLOCK_KERNELS``,
  a dict platform -> kernel classes in priority order) exists in all of them, but 0.20 has no
  entry for the CPU platform at all (no CPU block-FP8 kernel; 0.25 and 0.32 have AMX-only ones).
  ``registry_insert_first`` creates the entry when it is missing and marks our class so that
  ``registry_remove_ours`` deletes the entry again on revert: the registry is then exactly what
  vLLM built.
* **Kernel base classes** (``Fp8BlockScaledMMLinearKernel`` and ``MMLinearKernel``) live at the
  same import paths in both lines; ``kernel_base_classes`` is the one place that imports them.
* **KV scales on attention layers.** Both lines keep ``_q/_k/_v_scale`` (device tensors) and
  ``_q/_k/_v_scale_float`` (host floats, what ``Attention.forward`` hands the backend). 0.32 also
  keeps ``_k/_v_scale_cpu`` tensors; 0.20 and 0.25 instead have ``calculate_kv_scales``, a flag
  that makes the first forward *overwrite* the scales from that batch's amax. ``set_attention_kv_scales``
  writes every copy the running version has and switches that flag off, so calibrated scales stay.
* **Weight reload.** vLLM derives state from a linear layer's parameters after loading
  (``process_weights_after_loading``). On its CPU build, unquantized (BF16/FP32) linears are
  repacked for oneDNN (x86 with AVX-512, and any x86 for FP32 weights), for the AMX "SGL" kernel
  or for zentorch: the layer's ``weight`` is replaced by an empty tensor and the GEMM reads a
  packed copy; ``lm_head`` keeps its parameter *and* a packed copy. Copying new values into the
  parameters would leave the packed copies stale. ``reload_weights`` goes through vLLM's own
  layerwise reload (``vllm.model_executor.model_loader.reload``, 0.20 and 0.32): parameters are
  restored to their checkpoint shapes, loaded, processed again (repacked), then copied back into
  the original storage, so parameter identity is kept and every derived copy is rebuilt.
* **KV cache** (``kv_cache_tensors``): each layer's ``kv_cache`` attribute (0.20/0.25: set by
  ``v1/worker/utils.py``; 0.32/0.33: ``AttentionLayerBase.bind_kv_cache``) and the model runner's
  ``kv_caches`` list (all lines). The refit rollback must never read them (sleep mode unmaps them).
* **What this CPU can run** (``cpu_fp8_kv_cache``, ``cpu_vllm_block_fp8_kernels``): the answers
  come from vLLM's own code (its CPU attention's ISA choice, its kernels' ``is_supported``).
* **KV cache dtype actually used.** vLLM 0.25/0.32's CPU backend refuses an FP8 KV cache it cannot
  run (an error at start); 0.20's CPU platform silently falls back to the model dtype. A rollout with
  a BF16 KV cache while the trainer models FP8 KV is off-policy, so ``engine_kv_cache_dtype``
  reads what the engine really uses and the rollout engine refuses a mismatch.

Everything else the patch uses (``Fp8LinearMethod`` calling ``init_fp8_linear_kernel`` for
block-FP8 layers, the ``weight``/``weight_scale_inv`` parameter names and ``logical_widths``,
``worker_extension_cls``, ``vllm.general_plugins`` entry points, ``collective_rpc``, the
``pass_config`` keys ``fuse_norm_quant``/``fuse_act_quant``/``fuse_attn_quant``) was read in each
release's source and is identical where we touch it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# Supported vLLM release ranges, [min, max) by (major, minor, patch). Widen only after the vllm
# test tier passed on a real build of the new version (docs/vllm_patch.md, "Supported versions").
SUPPORTED_RANGES: tuple[tuple[tuple[int, int, int], tuple[int, int, int]], ...] = (
    ((0, 20, 0), (0, 20, 1)),
    ((0, 25, 1), (0, 25, 2)),
    ((0, 32, 0), (0, 33, 1)),  # 0.32.x engine-tested on CPU; 0.33.0 see the docstring
)
# The quantization name vLLM >= 0.32 passes to ``_resolve_backend_kernels`` for block-FP8 linears
# (``init_fp8_linear_kernel``): the key of ``kernel_config.linear_backend_per_quant`` that
# overrides ``linear_backend`` for them.
FP8_BLOCK_QUANT_KEY = "fp8_block_w8a8"
# Marks a registry entry (platform key) that did not exist before we registered our kernel.
CREATED_KEY_MARKER = "_nemo_jetrl_created_registry_key"
KV_KEYS = ("q", "k", "v")


def release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string like '0.32.0', '0.20.0+cpu', '0.33.0.dev5'.

    Raises ValueError when no leading release number can be read.
    """
    head = version.split("+", 1)[0]
    nums: list[int] = []
    for part in head.split(".")[:3]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        nums.append(int(digits))
        if len(digits) != len(part):
            break
    if not nums:
        raise ValueError(f"cannot parse the vLLM version {version!r}")
    padded = nums + [0] * (3 - len(nums))
    return (padded[0], padded[1], padded[2])


def is_supported(version: str) -> bool:
    rel = release(version)
    return any(lo <= rel < hi for lo, hi in SUPPORTED_RANGES)


def supported_range() -> str:
    """Human-readable supported ranges, e.g. '>=0.20.0,<0.20.1 or ... or >=0.32.0,<0.33.1'."""
    parts = []
    for lo, hi in SUPPORTED_RANGES:
        a, b = (".".join(map(str, v)) for v in (lo, hi))
        parts.append(f">={a},<{b}")
    return " or ".join(parts)


# -- block-FP8 kernel registry ---------------------------------------------------------------


def fp8_block_registry() -> dict:
    """vLLM's per-platform list of block-FP8 linear kernels (clear error if it moved)."""
    import vllm.model_executor.kernels.linear as kl

    reg = getattr(kl, "_POSSIBLE_FP8_BLOCK_KERNELS", None)
    if not isinstance(reg, dict):
        raise RuntimeError(
            "vLLM's block-FP8 kernel registry "
            "(vllm.model_executor.kernels.linear._POSSIBLE_FP8_BLOCK_KERNELS) was not found; "
            "this vLLM is outside the range nemo_jetrl.vllm_patch supports"
        )
    return reg


def current_platform_key() -> Any:
    """The registry key of the platform this process runs on (a ``PlatformEnum``)."""
    from vllm.platforms import current_platform

    return current_platform._enum


def registry_insert_first(cls: type, platform: Any = None) -> None:
    """Put ``cls`` first in ``platform``'s list, creating the list if this vLLM has none."""
    reg = fp8_block_registry()
    key = current_platform_key() if platform is None else platform
    if key not in reg:
        reg[key] = []
        setattr(cls, CREATED_KEY_MARKER, key)
    reg[key].insert(0, cls)


def registry_remove_ours(marker: str) -> int:
    """Remove every class carrying ``marker`` from every platform's list, and delete the lists
    that only existed because we created them. Returns how many classes were removed."""
    reg = fp8_block_registry()
    removed = 0
    for key in list(reg):
        kernels = reg[key]
        ours = [c for c in kernels if getattr(c, marker, False)]
        created = any(getattr(c, CREATED_KEY_MARKER, None) == key for c in ours)
        for cls in ours:
            kernels.remove(cls)
            removed += 1
        if created and not kernels:
            del reg[key]
    return removed


def kernel_base_classes() -> tuple[type, type]:
    """(Fp8BlockScaledMMLinearKernel, MMLinearKernel) of the installed vLLM."""
    from vllm.model_executor.kernels.linear.base import MMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )

    return Fp8BlockScaledMMLinearKernel, MMLinearKernel


# -- where the KV cache lives (never part of a refit's state) ------------------------------------

# The attribute each attention (and mamba) layer's cache is bound to: 0.20/0.25
# ``v1/worker/utils.py`` ``bind_kv_cache`` sets it on the layer; 0.32/0.33 through
# ``AttentionLayerBase.bind_kv_cache`` (a tensor; mamba layers a tuple of views of one buffer).
KV_CACHE_ATTR = "kv_cache"
# The model runner's list of every layer's cache (``GPUModelRunner.kv_caches``, which the CPU
# runner inherits; filled by ``bind_kv_cache`` in all supported lines).
RUNNER_KV_CACHES_ATTR = "kv_caches"


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def kv_cache_tensors(model: torch.nn.Module, runner: Any = None) -> list[torch.Tensor]:
    """The tensor objects that hold the KV cache: every module's ``kv_cache`` and the runner's
    ``kv_caches``. Only collected, never read: with vLLM's sleep mode their memory may be
    unmapped while a colocated refit runs."""
    found = [t for m in model.modules() for t in _tensors_in(m.__dict__.get(KV_CACHE_ATTR))]
    if runner is not None:
        found += _tensors_in(getattr(runner, RUNNER_KV_CACHES_ATTR, None))
    return found


# -- attention KV scales ----------------------------------------------------------------------


def is_attention_layer(module: torch.nn.Module) -> bool:
    """A vLLM attention layer that carries per-tensor q/k/v scales."""
    return hasattr(module, "_k_scale_float") and isinstance(
        getattr(module, "_k_scale", None), torch.Tensor
    )


def read_attention_kv_scales(module: torch.nn.Module) -> dict[str, float]:
    """Host floats (what the backend receives) and device tensors of the q/k/v scales."""
    out = {}
    for k in KV_KEYS:
        out[k] = float(getattr(module, f"_{k}_scale_float"))
        out[f"{k}_tensor"] = float(getattr(module, f"_{k}_scale").item())
    return out


def set_attention_kv_scales(module: torch.nn.Module, scales: dict[str, float]) -> None:
    """Write q/k/v scales into every copy the running vLLM keeps, and stop vLLM (0.20) from
    recomputing them from the next batch."""
    for k in KV_KEYS:
        val = float(scales[k])
        getattr(module, f"_{k}_scale").fill_(val)
        setattr(module, f"_{k}_scale_float", val)
        cpu = getattr(module, f"_{k}_scale_cpu", None)  # 0.32
        if isinstance(cpu, torch.Tensor):
            cpu.fill_(val)
    if getattr(module, "calculate_kv_scales", False):  # 0.20: would overwrite ours
        module.calculate_kv_scales = False


# -- engine introspection ---------------------------------------------------------------------


def vllm_env(name: str) -> Any:
    """An environment variable as vLLM parses it, read now (``vllm.envs`` may cache values once
    an engine started; its per-variable parser does not)."""
    import vllm.envs as envs

    parsers = getattr(envs, "environment_variables", None)
    if not isinstance(parsers, dict) or name not in parsers:
        raise RuntimeError(
            f"vLLM's parser for {name} (vllm.envs.environment_variables) was not found; "
            f"nemo_jetrl supports vLLM {supported_range()}"
        )
    return parsers[name]()


def deep_gemm_warmup_m_values(weight: torch.Tensor) -> list[int]:
    """The token counts vLLM's own DeepGEMM warm-up runs for a linear of this weight (its
    ``VLLM_DEEP_GEMM_WARMUP`` mode: ``skip`` none, ``relax`` a covering subset, ``full`` every M
    up to ``max_num_batched_tokens``), so our layers are compiled before serving, not during it.
    Read from vLLM 0.20-0.33's ``model_executor.warmup.deep_gemm_warmup`` and current config."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.warmup import deep_gemm_warmup as dgw

    if vllm_env("VLLM_DEEP_GEMM_WARMUP") == "skip":
        return []
    config = get_current_vllm_config_or_none()
    if config is None:
        raise RuntimeError("no current vLLM config: DeepGEMM warm-up runs during model loading")
    max_tokens = int(config.scheduler_config.max_num_batched_tokens)
    return [int(m) for m in dgw._get_fp8_gemm_nt_m_values(weight, max_tokens)]


def engine_model_dtype(llm: Any) -> torch.dtype:
    """The dtype the engine serves the model in (after resolving ``dtype='auto'``)."""
    return llm.llm_engine.vllm_config.model_config.dtype


def engine_kv_cache_dtype(llm: Any) -> str:
    """The KV cache dtype the engine really uses (after platform fallbacks), e.g. 'auto'/'fp8'."""
    return str(llm.llm_engine.vllm_config.cache_config.cache_dtype)


# -- weight reload ----------------------------------------------------------------------------


def reload_weights(model: torch.nn.Module, model_config: Any, weights: Any) -> set[str]:
    """Load ``(name, tensor)`` pairs through vLLM's layerwise reload; returns the loaded names.

    Every layer that receives weights is rebuilt as at first load (checkpoint-shaped parameters,
    the model's ``load_weights`` routing, ``process_weights_after_loading``), then its processed
    tensors are copied into the original parameters and buffers (same objects and storage).
    Layers that receive nothing keep their tensors. See the module docstring for why.
    """
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    with torch.no_grad():
        initialize_layerwise_reload(model)
        try:
            loaded = model.load_weights(weights)
        finally:
            finalize_layerwise_reload(model, model_config)
    return set(loaded or ())


def weight_was_repacked(layer: torch.nn.Module) -> bool:
    """True if vLLM replaced a loaded linear's ``weight`` by an empty tensor because its GEMM
    reads a packed copy (CPU oneDNN / AMX / zentorch dispatch with ``remove_weight=True``)."""
    w = getattr(layer, "weight", None)
    return isinstance(w, torch.Tensor) and w.numel() == 0


# -- what this CPU can run --------------------------------------------------------------------


def cpu_fp8_kv_cache(head_size: int | None = None, version: str | None = None) -> tuple[bool, str]:
    """(can vLLM's CPU backend run an FP8 KV cache here, why), asked of vLLM's own code.

    vLLM 0.20's CPU platform has none (it falls back to the model dtype). From 0.25 on, its CPU
    attention (``cpu_attn._get_attn_isa``) runs one on x86 with AVX-512 or AMX, and refuses
    head sizes that are multiples of 16 but not of 32.
    """
    if version is None:
        import vllm

        version = vllm.__version__
    if release(version) < (0, 21, 0):
        return False, (
            f"vLLM {version}'s CPU platform has no FP8 KV cache (it falls back to the model "
            "dtype); vLLM >= 0.25 runs one on x86 CPUs with AVX-512 or AMX"
        )
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(torch.bfloat16, 32, head_size, "fp8")
    except NotImplementedError as exc:
        return False, f"vLLM {version}'s CPU attention: {exc}"
    except (ImportError, TypeError) as exc:
        raise RuntimeError(
            f"cannot ask vLLM {version}'s CPU attention whether it runs an FP8 KV cache "
            f"({exc}); nemo_jetrl supports vLLM {supported_range()}"
        ) from exc
    return True, f"vLLM {version}'s CPU attention runs an FP8 KV cache here (ISA {isa!r})"


def cpu_vllm_block_fp8_kernels(marker: str) -> tuple[bool, str]:
    """(does vLLM have a block-FP8 linear kernel of its own for this CPU, why).

    Asks each kernel class in vLLM's registry for this platform (ours, carrying ``marker``,
    excluded) through its own ``is_supported()``.
    """
    reasons = []
    for cls in fp8_block_registry().get(current_platform_key(), []):
        if getattr(cls, marker, False):
            continue
        ok, why = cls.is_supported()
        if ok:
            return True, f"vLLM's {cls.__name__} runs here"
        reasons.append(f"{cls.__name__}: {why}")
    return False, "vLLM has no block-FP8 CPU kernel for this CPU (" + (
        "; ".join(reasons) or "none registered"
    ) + ")"


# -- CPU build environment --------------------------------------------------------------------


def cpu_omp_threads_bind(version: str | None = None) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value that does not restrict the CPU engine's threads.

    ``nobind`` (0.32) leaves OpenMP alone; the default ``auto`` pins and reserves cores, which
    starves everything else on a small shared machine. vLLM 0.20.0's CPU executor crashes on
    ``nobind`` (``IndexError`` in ``OMPProcessManager._parse_omp_threads_bind_env``: it indexes an
    empty core list), so there the value is the explicit list of every CPU this process may use,
    which binds the worker to all of them.
    """
    if version is None:
        import vllm

        version = vllm.__version__
    if release(version) < (0, 21, 0):
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return "nobind"
