"""Methods added to vLLM's worker (``worker_extension_cls``), called through ``collective_rpc``.

vLLM mixes this class into its worker class in each worker process, so ``self`` is the worker
and ``self.model_runner.model`` the model. Names start with ``jetrl_`` to avoid clashes.

* ``jetrl_load_weights``: hands (HF name, tensor) pairs to vLLM's own layerwise reload
  (``compat.reload_weights``): the model's ``load_weights`` routes q/k/v and gate/up into the
  fused parameters, each layer's ``process_weights_after_loading`` runs again (so what vLLM
  derives from a weight, e.g. the CPU build's packed GEMM copies, is rebuilt), and the results
  land in the original parameter storage. FP8 tensors arrive already quantized (``weight`` FP8 +
  ``weight_scale_inv`` fp32), so nothing is requantized; parameter identity is checked.
* ``jetrl_read_back``: what the engine computes with, for given HF names, through two
  independent paths from the loader: the parameter bytes (sliced out of fused parameters with the
  model's ``packed_modules_mapping`` and each layer's ``logical_widths``), and, for unquantized
  linear layers, the weight *as the layer's GEMM sees it*: the layer's own ``quant_method.apply``
  on identity rows, ``I @ W^T = W^T`` (every output is one product ``1 * w`` plus zeros, exact in
  any kernel that accumulates in at least the weight's precision). A packed copy left stale by a
  load shows up there even though the parameter looks right.
* ``jetrl_snapshot`` / ``jetrl_restore`` / ``jetrl_drop_snapshot``: the model's state saved
  before a refit writes into it (everything weight loading can write; never the KV cache), and put back (verified bit for bit) if the refit fails
  (``rollback``; the client side is ``rollback.engine_rollback``).
* ``jetrl_set_kv_scales`` / ``jetrl_kv_scales``: per-layer q/k/v scales on the attention layers
  (vLLM convention: the dequantization multiplier, k_fp8 = k / k_scale), all-or-nothing.
* ``jetrl_capture`` / ``jetrl_captured``: record what enters our FP8 GEMM (eager mode).
* ``jetrl_routing_capture`` / ``jetrl_routing_take``: record the experts vLLM's routers pick,
  per request and position (``routing_capture``).
* ``jetrl_kernels``: which kernel class each linear layer runs; ``jetrl_kernel_report``: the
  guard's per-layer report (is it ours, with which settings and GEMM backend) for
  ``guard.verify_engine_kernels``; ``jetrl_repacked``: which unquantized linears vLLM repacked
  (their ``weight`` parameter is empty).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from typing import Any

import torch

from nemo_jetrl.vllm_patch import compat, graph_bindings, parity_views, rollback
from nemo_jetrl.vllm_patch.cpu_moe_repack import plain_rows, repack_reloaded_experts
from nemo_jetrl.vllm_patch.dense_shards import engine_rows
from nemo_jetrl.vllm_patch.engine_names import engine_path, stacked_outputs
from nemo_jetrl.vllm_patch.moe_names import resolve_expert_tensor
from nemo_jetrl.vllm_patch.settings import WEIGHT_BLOCK


def pack(tensors: dict[str, torch.Tensor]) -> bytes:
    """Tensors -> one safetensors blob (keeps float8 dtypes; vLLM's RPC path carries bytes).

    Tensors cannot go through ``collective_rpc`` as they are: with the engine core in its own
    process, vLLM decodes them as zero-copy views that its worker broadcast then fails to pickle
    ("cannot pickle memoryview objects"). Bytes survive both hops.
    """
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def unpack(blob: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(bytes(blob))


def model_of(worker: Any) -> torch.nn.Module:
    """The model a vLLM worker serves (any worker extension, ours or NeMo-RL's)."""
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


_model = model_of


def _attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if compat.is_attention_layer(m)}


def resolve_hf_name(model: torch.nn.Module, hf_name: str) -> tuple[str, torch.Tensor, int, int]:
    """(vLLM param name, param, row start, row count) holding the HF tensor ``hf_name``.

    A repacked weight (empty parameter, see ``compat.weight_was_repacked``) still gets its
    checkpoint row range; ``checkpoint_shape`` gives its full shape."""
    if (expert := resolve_expert_tensor(model, hf_name)) is not None:  # routed experts
        return plain_rows(model, hf_name, expert)  # CPU BF16 experts: the rows before packing
    hf_name = engine_path(model, hf_name)
    module_path, _, leaf = hf_name.rpartition(".")
    parent, _, proj = module_path.rpartition(".")
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    modules = dict(model.named_modules())
    for fused, shards in packed.items():
        if proj in shards:
            fused_path = f"{parent}.{fused}"
            layer = modules.get(fused_path)
            if layer is None:
                continue
            param = getattr(layer, leaf)
            # FP8 layers record logical_widths; unquantized (BF16) ones only their partition sizes
            widths = list(getattr(layer, "logical_widths", None) or layer.output_partition_sizes)
            i = shards.index(proj)
            outs = stacked_outputs(model, proj, fused, i, len(widths))
            start, rows = sum(widths[: outs[0]]), sum(widths[o] for o in outs)
            if leaf == "weight_scale_inv":
                if start % WEIGHT_BLOCK[0]:  # a partial block before it: scales shared
                    raise ValueError(
                        f"{hf_name}: starts at row {start} of {fused_path}, off a "
                        f"{WEIGHT_BLOCK[0]}-row block edge: its scales would share a block with "
                        f"{shards[i - 1]}; keep {'/'.join(shards)} BF16 on both sides"
                    )
                start, rows = start // WEIGHT_BLOCK[0], -(-rows // WEIGHT_BLOCK[0])
            elif leaf == "bias" or leaf == "weight":
                pass
            else:
                raise KeyError(f"{hf_name}: no fused slice rule for parameter {leaf!r}")
            return f"{fused_path}.{leaf}", param, start, rows
    params = dict(model.named_parameters(remove_duplicate=False))
    if hf_name in params:
        p = params[hf_name]
        # vLLM pads the vocab dim of the embedding / lm_head (to a multiple of 64, per TP rank);
        # only this rank's org_vocab rows, first in the parameter, hold real tokens.
        layer = modules.get(module_path)
        if leaf == "weight" and getattr(layer, "shard_indices", None) is not None and p.dim():
            return hf_name, p, 0, engine_rows(layer, leaf, p.shape[0])
        if compat.weight_was_repacked(modules.get(module_path)) and leaf == "weight":
            return hf_name, p, 0, checkpoint_shape(modules[module_path])[0]
        return hf_name, p, 0, p.shape[0] if p.dim() else 0
    layer = modules.get(module_path)
    if layer is not None and isinstance(getattr(layer, leaf, None), torch.Tensor):
        p = getattr(layer, leaf)
        return hf_name, p, 0, p.shape[0] if p.dim() else 0
    raise KeyError(f"{hf_name}: no such parameter in the vLLM model")


def checkpoint_shape(layer: torch.nn.Module) -> tuple[int, int]:
    """(rows, cols) of an unquantized linear's weight as loaded, whether or not vLLM repacked it."""
    rows = getattr(layer, "output_size_per_partition", None)
    cols = getattr(layer, "input_size_per_partition", None)
    if rows is None:  # vocab-parallel embedding / lm_head
        rows = getattr(layer, "num_embeddings_per_partition", None)
        cols = getattr(layer, "embedding_dim", None)
    if rows is None and (_replicated(layer) or getattr(layer, "tp_size", 1) == 1):
        # a replicated linear (an MoE router: vLLM 0.32's GateLinear) holds its whole weight on
        # every rank, whatever the tensor-parallel size it records
        rows, cols = getattr(layer, "output_size", None), getattr(layer, "input_size", None)
    if rows is None or cols is None:
        raise KeyError(f"{type(layer).__name__}: unknown weight shape")
    return int(rows), int(cols)


def _replicated(layer: torch.nn.Module) -> bool:
    """A vLLM ``ReplicatedLinear`` (or subclass), named by class so no vLLM import is needed."""
    return any(c.__name__ == "ReplicatedLinear" for c in type(layer).__mro__)


def _weight_param_shape(layer: torch.nn.Module, p: torch.Tensor) -> tuple[int, ...]:
    if compat.weight_was_repacked(layer):
        return checkpoint_shape(layer)
    return tuple(p.shape)


# Identity rows per probe call: bounds the probe's memory to PROBE_ROWS x out_features.
PROBE_ROWS = 256


def weight_through_kernel(
    layer: torch.nn.Module, start: int, rows: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``start:start+rows`` of an unquantized layer's weight, as its GEMM computes with it:
    ``quant_method.apply(layer, I)`` gives ``W^T`` exactly (see the module docstring)."""
    qm = layer.quant_method
    _, cols = checkpoint_shape(layer)
    device = next((t.device for t in layer.parameters() if t.numel()), torch.device("cpu"))
    out = torch.empty(rows, cols, dtype=dtype)
    for c0 in range(0, cols, PROBE_ROWS):
        c1 = min(cols, c0 + PROBE_ROWS)
        eye = torch.zeros(c1 - c0, cols, dtype=dtype, device=device)
        eye[:, c0:c1] = torch.eye(c1 - c0, dtype=dtype, device=device)
        y = qm.apply(layer, eye)  # [c1 - c0, out_features] = W[:, c0:c1]^T
        out[:, c0:c1] = y[:, start : start + rows].t().to("cpu")
    return out


def _is_unquantized_linear(layer: torch.nn.Module | None) -> bool:
    qm = getattr(layer, "quant_method", None)
    return (
        qm is not None
        and hasattr(qm, "apply")
        and not hasattr(layer, "weight_scale_inv")  # block-FP8 layers: bytes are read directly
        and isinstance(getattr(layer, "weight", None), torch.Tensor)
    )


def read_back(
    worker: Any, hf_names: list[str], through_kernel: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's tensors for ``hf_names``, one at a time on the host: ``name`` -> parameter
    bytes (absent where vLLM repacked the weight; a view, not a copy, when the model is on the
    CPU), and with ``through_kernel`` also ``name|kernel`` -> the weight as an unquantized
    linear's GEMM sees it, and ``name|mla`` -> the W_UK_T/W_UV an MLA attention derived from a
    kv_b_proj weight (`parity_views`). One tensor at a time: a parity check holds one, not all."""
    model = _model(worker)
    mla = parity_views.attention_by_kv_b(model) if through_kernel else {}
    # Each TP rank reads its own shard (routed experts: expert_shards; dense: the fused shard's
    # rows on this rank; the caller narrows what it expects with dense_shards). Pipeline stages
    # hold other layers: not covered.
    pp = int(getattr(worker.vllm_config.parallel_config, "pipeline_parallel_size", 1))
    if pp != 1:
        raise NotImplementedError(
            f"jetrl_read_back at pipeline_parallel_size={pp}: each stage holds other layers; "
            "parity read-back supports pipeline_parallel_size=1"
        )
    for name in hf_names:
        vname, p, start, rows = resolve_hf_name(model, name)
        layer = model.get_submodule(vname.rpartition(".")[0])
        leaf = vname.rpartition(".")[2]
        if not (leaf == "weight" and compat.weight_was_repacked(layer)):  # else: kernel view only
            t = p.data if p.dim() == 0 else p.data[start : start + rows]
            yield name, t.detach().to("cpu")
        # not a 3-D weight: Qwen3.5's conv1d is a ColumnParallelLinear holding a conv weight
        # its layer never multiplies as a GEMM (the read-back above checks it); a repacked
        # weight's emptied parameter (1-D) still gets its kernel view
        if through_kernel and leaf == "weight" and _is_unquantized_linear(layer) and p.dim() < 3:
            dtype = p.dtype if p.numel() else worker.vllm_config.model_config.dtype
            yield f"{name}|kernel", weight_through_kernel(layer, start, rows, dtype)
        if leaf == "weight" and id(layer) in mla:
            yield f"{name}|{parity_views.VIEW}", parity_views.derived_view(mla[id(layer)])


class JetRLWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; see the module docstring."""

    def jetrl_tp_size(self) -> int:
        return int(self.vllm_config.parallel_config.tensor_parallel_size)  # type: ignore[attr-defined]

    def jetrl_shapes(self, hf_names: list[str]) -> dict[str, Any]:
        """Engine-side shape and dtype for each HF name (or an error string)."""
        model = _model(self)
        out: dict[str, Any] = {}
        for name in hf_names:
            try:
                vname, p, _, rows = resolve_hf_name(model, name)
                layer = model.get_submodule(vname.rpartition(".")[0])
                full = _weight_param_shape(layer, p) if vname.endswith(".weight") else p.shape
                shape = (rows, *full[1:]) if len(full) else ()
                out[name] = (tuple(shape), str(p.dtype))
            except (KeyError, AttributeError) as exc:
                out[name] = str(exc)
        return out

    def jetrl_load_weights(self, blob: bytes) -> dict[str, Any]:
        """Load a ``pack``ed {HF name: tensor} blob in place; report names and identity."""
        model = _model(self)
        before = {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()}
        cfg = self.vllm_config  # type: ignore[attr-defined]
        graphs = graph_bindings.captures_cuda_graphs(cfg, rollback.model_device(model))
        bound = graph_bindings.record(model, self.model_runner) if graphs else None  # type: ignore[attr-defined]
        tensors = unpack(blob)
        loaded = compat.reload_weights(model, cfg.model_config, iter(tensors.items()))
        repacked = repack_reloaded_experts(model, tensors)  # the reload leaves them unpacked
        if bound is not None:  # attributes the reload rebinds (0.25's MLA W_UK_T / W_UV)
            graph_bindings.keep_in_place(model, bound)
        after = {n: (id(p), p.data_ptr()) for n, p in model.named_parameters()}
        moved = sorted(n for n in before if after.get(n) != before[n])
        return {"loaded": sorted(loaded or []), "moved": moved, "repacked": repacked}

    def jetrl_snapshot(self) -> dict[str, Any]:
        """Save the model's whole state for `jetrl_restore` (``rollback``); one per worker."""
        snap = rollback.take_snapshot(_model(self), self.model_runner)  # type: ignore[attr-defined]
        self._jetrl_snapshot = snap
        return {"bytes": snap.nbytes, "device": str(snap.device), "kv_cache_bytes": snap.kv.nbytes}

    def jetrl_restore(self) -> dict[str, Any]:
        """Put the model back to the last `jetrl_snapshot` and verify it (RollbackError if not)."""
        snap = self.__dict__.pop("_jetrl_snapshot", None)
        if snap is None:
            raise rollback.RollbackError("jetrl_restore: no snapshot was taken in this worker")
        rep = rollback.restore_snapshot(_model(self), snap)
        return {"tensors": rep.tensors, "values": rep.values, "removed": list(rep.removed)}

    def jetrl_drop_snapshot(self) -> bool:
        """Free the snapshot after a refit that went through."""
        return self.__dict__.pop("_jetrl_snapshot", None) is not None

    def jetrl_read_back(self, hf_names: list[str], through_kernel: bool = False) -> bytes:
        """The engine's tensors for ``hf_names`` as a ``pack``ed blob (`read_back`)."""
        return pack({k: t.clone() for k, t in read_back(self, hf_names, through_kernel)})

    def jetrl_kv_scales(self) -> dict[str, dict[str, float]]:
        """The q/k/v scales each attention layer currently uses (host floats and tensors)."""
        return {
            name: compat.read_attention_kv_scales(m)
            for name, m in _attention_layers(_model(self)).items()
        }

    def jetrl_set_kv_scales(self, scales: dict[str, dict[str, float]]) -> list[str]:
        """Set q/k/v scales per attention layer; refuses the whole set if any entry is bad."""
        layers = _attention_layers(_model(self))
        errors = []
        unknown = sorted(set(scales) - set(layers))
        if unknown:
            errors.append(f"unknown attention layers {unknown} (known: {sorted(layers)[:4]}...)")
        for name, s in scales.items():
            for key in ("q", "k", "v"):
                v = s.get(key)
                if v is None or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    errors.append(f"{name}.{key}_scale={v!r}: must be a finite number > 0")
        if errors:
            raise ValueError("KV scales refused, previous scales kept: " + "; ".join(errors))
        for name, s in scales.items():
            compat.set_attention_kv_scales(layers[name], s)
        return sorted(scales)

    def jetrl_capture(self, max_calls: int) -> int:
        """Start (max_calls > 0) or stop (0) recording GEMM inputs of our FP8 linear layers."""
        n = 0
        for _, m in _model(self).named_modules():
            if hasattr(m, "weight_scale_inv") or hasattr(m, "w13_weight_scale_inv"):
                m._jetrl_capture = collections.deque(maxlen=max_calls) if max_calls > 0 else None
                n += 1
        return n

    def jetrl_captured(self) -> bytes:
        """Recorded GEMM inputs as a ``pack``ed blob: ``{layer}|{i}|{x,q,s}`` -> bf16 input,
        FP8 data, fp32 scale_inv, for call ``i`` of each linear layer; for routed-experts layers
        ``{layer}|{i}|{x,ids,w,out}`` (input, top-k experts and weights, output)."""
        out = {}
        for name, m in _model(self).named_modules():
            cap = getattr(m, "_jetrl_capture", None)
            for i, call in enumerate(cap or ()):
                items = call.items() if isinstance(call, dict) else zip("xqs", call, strict=True)
                out.update({f"{name}|{i}|{k}": t for k, t in items})
        return pack(out)

    def jetrl_routing_capture(self, on: bool) -> list[int]:
        """Start (the decoder layers hooked) or stop recording the experts vLLM's routers pick
        (``routing_capture.RoutingRecorder``: per request and position)."""
        from nemo_jetrl.vllm_patch.routing_capture import RoutingRecorder

        rec = getattr(self, "_jetrl_routing", None)
        if rec is not None:
            rec.uninstall()
            self._jetrl_routing = None
        if not on:
            return []
        self._jetrl_routing = RoutingRecorder(_model(self), self.model_runner)
        self._jetrl_routing.install()
        return self._jetrl_routing.layers

    def jetrl_routing_take(self) -> bytes:
        """What the routing recorder holds (``pack``ed, ``RoutingRecorder.take``), cleared."""
        rec = getattr(self, "_jetrl_routing", None)
        return pack(rec.take() if rec is not None else {})

    def jetrl_kernels(self) -> dict[str, str]:
        """Linear layer name -> kernel class (FP8 layers) or quant method class (others)."""
        out = {}
        for name, m in _model(self).named_modules():
            qm = getattr(m, "quant_method", None)
            if qm is None or not hasattr(m, "weight"):
                continue
            kernel = getattr(qm, "fp8_linear", None)
            out[name] = type(kernel).__name__ if kernel is not None else type(qm).__name__
        return out

    def jetrl_kernel_report(self) -> dict[str, Any]:
        """Kernel, settings and GEMM backend of every block-FP8 linear, and the variables that
        decide them in this worker (``guard.layer_kernel_report``; checked by the driver)."""
        from nemo_jetrl.vllm_patch.guard import layer_kernel_report

        return layer_kernel_report(_model(self))

    def jetrl_repacked(self) -> list[str]:
        """Unquantized linear layers whose weight vLLM replaced by a packed copy (CPU build)."""
        return sorted(
            name
            for name, m in _model(self).named_modules()
            if _is_unquantized_linear(m) and compat.weight_was_repacked(m)
        )
