"""Ask TE 2.20.2's own Python code about its blockwise FP8 layout (run as a subprocess).

Usage: ``python te_blockwise_probe.py TE_DIR IN.pt OUT.pt``. ``TE_DIR`` holds the
``transformer_engine`` meta wheel's pure-Python files (``.venv-te-recipe``). IN.pt is a list of
requests; OUT.pt gets one answer per request:

* ``{"op": "scale_shape", "shape", "dim", "columnwise"}`` -> ``Float8BlockQuantizer(
  block_scaling_dim=dim).get_scale_shape(shape, columnwise)``;
* ``{"op": "columnwise_shape", "shape"}`` -> ``get_columnwise_shape(shape)``;
* ``{"op": "dequantize", "fmt", "is_2D_scaled", "rowwise_data", "rowwise_scale_inv",
  "columnwise_data", "columnwise_scale_inv"}`` -> ``Float8BlockwiseQTensorStorage(...)
  .dequantize(dtype=torch.float32)`` (TE reads rowwise data when given, else columnwise).

STAND-IN (labelled): TE's C extension ``transformer_engine_torch`` has no CPU build. The module
object below provides only the enums TE's imports evaluate (``DType`` with its member names, and
the FP8 tensor-slot enums ``constants.py`` reads); every function TE would call in it is absent,
so a code path that needs the extension raises instead of running something of ours. The
``transformer_engine.pytorch`` / ``.tensor`` / ``.tensor.storage`` packages are registered as bare
namespaces so their ``__init__`` (which loads the extension's kernels) does not run; the modules
this probe uses are TE's files, imported from ``TE_DIR``.
"""

from __future__ import annotations

import enum
import importlib
import os
import sys
import types
from pathlib import Path

import torch


def load_te(te_dir: Path) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    os.environ["NVTE_PROJECT_BUILDING"] = "1"  # TE skips loading its CUDA core library
    sys.path.insert(0, str(te_dir))
    tex = types.ModuleType("transformer_engine_torch")  # STAND-IN: enums only (see docstring)
    members = ["kByte", "kInt32", "kFloat32", "kFloat16", "kBFloat16"]
    members += ["kFloat8E4M3", "kFloat8E5M2", "kFloat4E2M1"]
    tex.DType = enum.IntEnum("DType", members, start=0)
    fwd = ["GEMM1_INPUT", "GEMM1_WEIGHT", "GEMM1_OUTPUT", "GEMM2_INPUT", "GEMM2_WEIGHT"]
    tex.FP8FwdTensors = enum.IntEnum("FP8FwdTensors", [*fwd, "GEMM2_OUTPUT", "GEMM3_OUTPUT"])
    bwd = ["GRAD_OUTPUT1", "GRAD_INPUT1", "GRAD_OUTPUT2", "GRAD_INPUT2", "GRAD_OUTPUT3"]
    tex.FP8BwdTensors = enum.IntEnum("FP8BwdTensors", [*bwd, "GRAD_INPUT3"])
    sys.modules["transformer_engine_torch"] = tex
    root = te_dir / "transformer_engine"
    for sub in ("pytorch", "pytorch/tensor", "pytorch/tensor/storage"):
        name = "transformer_engine." + sub.replace("/", ".")
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / sub)]
        sys.modules[name] = pkg
    bt = importlib.import_module("transformer_engine.pytorch.tensor.float8_blockwise_tensor")
    st = importlib.import_module(
        "transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage"
    )
    const = importlib.import_module("transformer_engine.pytorch.constants")
    for m in (bt, st, const):  # TE's files, not something else on the path
        assert Path(m.__file__).resolve().is_relative_to(te_dir.resolve()), m.__file__
    return bt, st, const


def answer(req: dict, bt, st, const) -> object:
    if req["op"] == "scale_shape":
        q = bt.Float8BlockQuantizer(
            const.DType.kFloat8E4M3,
            rowwise=True,
            columnwise=True,
            block_scaling_dim=req["dim"],
        )
        return tuple(q.get_scale_shape(req["shape"], req["columnwise"]))
    if req["op"] == "columnwise_shape":
        q = bt.Float8BlockQuantizer(const.DType.kFloat8E4M3, rowwise=True, columnwise=True)
        return tuple(q.get_columnwise_shape(req["shape"]))
    if req["op"] == "dequantize":
        dt = const.DType.kFloat8E4M3 if req["fmt"] == "e4m3" else const.DType.kFloat8E5M2
        quantizer = bt.Float8BlockQuantizer(
            dt,
            rowwise=req["rowwise_data"] is not None,
            columnwise=req["columnwise_data"] is not None,
            block_scaling_dim=2 if req["is_2D_scaled"] else 1,
        )
        t = st.Float8BlockwiseQTensorStorage(
            req["rowwise_data"],
            req["rowwise_scale_inv"],
            req["columnwise_data"],
            req["columnwise_scale_inv"],
            dt,
            quantizer,
            req["is_2D_scaled"],
        )
        return t.dequantize(dtype=torch.float32)
    raise ValueError(f"unknown request {req['op']!r}")


def main() -> None:
    te_dir, src, dst = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    bt, st, const = load_te(te_dir)
    reqs = torch.load(src, weights_only=True)
    torch.save([answer(r, bt, st, const) for r in reqs], dst)


if __name__ == "__main__":
    main()
