"""The golden files `jetrl selfcheck` reads, validated before any quantization.

Damaged data must not read as a verdict (exit 1 says "the quantizer is not bit-exact") nor as
a traceback from the quantizer: every problem found (a file that cannot be read, a JSON case
lacking or mistyping an entry, a tensor missing, of the wrong dtype, of a shape other than the
case's block layout implies, or holding non-finite values) is collected and raised as one
`UserError` (exit 2) naming the file, the tensor key and what is wrong.

What each case implies, from its JSON entry and its input ``[M, K]`` (see tests/data/golden):
TE ``block`` 1x128 / 128x128: ``q`` ``[M, K]``, ``scale_inv`` ``[ceil(M/bm), ceil(K/bk)]``;
TE 128x1 is stored transposed: ``q`` ``[K, M]``, ``scale_inv`` ``[K, ceil(M/128)]``; vLLM
``source`` QuantFP8 is 1x128, per_block_cast_to_fp8 128x128, ``q`` ``[M, K]``, ``scale`` the
block grid. ``q`` is FP8 E4M3 bits (uint8; float8_e4m3fn is viewed as uint8), scales are
positive finite float32, inputs finite bf16/fp16/fp32 matrices.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

TE_FILE, VLLM_FILE = "te_golden_seed0.safetensors", "vllm_golden_seed0.safetensors"
BLOCKS = ((1, 128), (128, 1), (128, 128))  # the blocks nemo_jetrl.fp8 quantizes
# vLLM's two quantizers, as the ``source`` entry names them, and the block each uses
VLLM_SOURCES = {"QuantFP8": (1, 128), "per_block_cast_to_fp8": (128, 128)}


def vllm_block(source: str) -> tuple[int, int] | None:
    """The block of the vLLM quantizer ``source`` names; None when it names neither."""
    found = [b for name, b in VLLM_SOURCES.items() if name in source]
    return found[0] if len(found) == 1 else None


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# each JSON entry a case needs: (is it valid, what it must be)
Rule = tuple[Callable[[Any], bool], str]
_NAME: Rule = (lambda v: isinstance(v, str) and bool(v), "the name of an input (a string)")
_BOOL: Rule = (lambda v: isinstance(v, bool), "true or false")
TE_META: dict[str, Rule] = {
    "input": _NAME,
    "block": (
        lambda v: isinstance(v, list) and tuple(v) in BLOCKS and all(_is_num(b) for b in v),
        "one of " + ", ".join(str(list(b)) for b in BLOCKS),
    ),
    "pow2": _BOOL,
    "eps": (lambda v: _is_num(v) and v >= 0, "a finite number >= 0"),
}
VLLM_META: dict[str, Rule] = {
    "input": _NAME,
    "ue8m0": _BOOL,
    "source": (
        lambda v: isinstance(v, str) and vllm_block(v) is not None,
        "a string naming one of vLLM's " + " or ".join(VLLM_SOURCES),
    ),
}


def _case_problems(case: str, meta: Any, rules: dict[str, Rule]) -> list[str]:
    lacks = [k for k in rules if not isinstance(meta, dict) or k not in meta]
    if lacks:
        return [f"case {case!r} lacks {', '.join(lacks)}"]
    return [
        f"case {case!r} has {key} {meta[key]!r}; it must be {what}"
        for key, (ok, what) in rules.items()
        if not ok(meta[key])
    ]


def _first_bad(t: Any, bad: Any, key: str, what: str) -> str:
    idx = tuple(bad.nonzero()[0].tolist())
    return (
        f"tensor {key!r} has {int(bad.sum())} {what} value(s) "
        f"(first: {t[idx].item()} at {list(idx)})"
    )


def _input_problems(t: Any, key: str) -> list[str]:
    import torch

    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return [
            f"tensor {key!r} has dtype {t.dtype}; an input must be bfloat16, float16 or float32"
        ]
    out = []
    if t.dim() != 2 or t.numel() == 0:
        out.append(f"tensor {key!r} has shape {tuple(t.shape)}; an input must be a non-empty "
                   "2-D [M, K] matrix")  # fmt: skip
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        out.append(_first_bad(t, bad, key, "non-finite") + "; an input must be finite")
    return out


def _output_problems(held: dict, key: str, scale: bool, shape: tuple | None, why: str) -> list[str]:
    """``held[key]`` as FP8 bits (``scale`` False) or scales; float8 bits are viewed as uint8."""
    import torch

    if key not in held:
        return [f"has no tensor {key!r}, which its JSON's cases name"]
    t, out = held[key], []
    if not scale and t.dtype == torch.float8_e4m3fn:  # the same bits stored as FP8: use bytes
        held[key] = t.view(torch.uint8)
    elif not scale and t.dtype != torch.uint8:
        out.append(f"tensor {key!r} has dtype {t.dtype}; FP8 E4M3 data must be uint8 bits")
    elif scale and t.dtype != torch.float32:
        out.append(f"tensor {key!r} has dtype {t.dtype}; scales must be float32")
    elif scale and bool((bad := ~(torch.isfinite(t) & (t > 0))).any()):
        why_bad = "non-finite or non-positive"
        out.append(_first_bad(t, bad, key, why_bad) + "; scales must be positive and finite")
    if shape is not None and tuple(t.shape) != shape:
        out.append(f"tensor {key!r} has shape {tuple(t.shape)}; {why} implies {shape}")
    return out


def _layout(block: tuple[int, int], m: int, k: int) -> tuple[tuple, tuple]:
    """The shapes of ``q`` and of the scales for ``block`` on an ``[m, k]`` input."""
    bm, bk = block
    if block == (128, 1):  # TE's columnwise output is stored transposed
        return (k, m), (k, -(-m // bm))
    return (m, k), (-(-m // bm), -(-k // bk))


def _tensor_problems(golden: Path, te: dict | None, vl: dict | None, te_cases: dict,
                     vl_cases: dict) -> list[tuple[Path, str]]:  # fmt: skip
    """Every tensor the checks read, against what its case implies (``*_cases`` hold only the
    cases whose metadata is valid)."""
    out: list[tuple[Path, str]] = []
    shapes: dict[str, tuple[int, int] | None] = {}  # input key -> its shape when it is usable
    if te is not None:
        for meta in [*te_cases.values(), *vl_cases.values()]:
            key = f"input.{meta['input']}"
            if key in shapes:
                continue
            if key in te:
                found = _input_problems(te[key], key)
            else:
                found = [f"has no tensor {key!r}, which its JSON's cases name"]
            shapes[key] = None if found else tuple(te[key].shape)
            out += [(golden / TE_FILE, p) for p in found]
    todo = [
        (TE_FILE, te, c, m, tuple(map(int, m["block"])), ".scale_inv") for c, m in te_cases.items()
    ]
    todo += [(VLLM_FILE, vl, c, m, vllm_block(m["source"]), ".scale") for c, m in vl_cases.items()]
    for name, held, case, meta, block, scale_suffix in todo:
        if held is None:  # the file itself could not be read: reported already
            continue
        key = f"input.{meta['input']}"
        shape = shapes.get(key)
        q_shape, s_shape = _layout(block, *shape) if shape else (None, None)
        how = f"block {block[0]}x{block[1]}{', stored transposed' if block == (128, 1) else ''}"
        why = f"case {case!r} ({how}, on {key!r} {list(shape or ())})"
        for suffix, scale, want in ((".q", False, q_shape), (scale_suffix, True, s_shape)):
            found = _output_problems(held, case + suffix, scale, want, why)
            out += [(golden / name, p) for p in found]
    return out


def read_golden(golden: Path) -> tuple[dict, dict, dict, dict]:
    """The golden tensors (TE's, vLLM's) and cases (TE's, vLLM's), validated; any damage is one
    UserError listing every problem (exit 2: not a bit-exactness verdict)."""
    from nemo_jetrl.errors import UserError

    problems: list[tuple[Path, str]] = []

    def tensors(name: str) -> dict | None:
        from safetensors.torch import load_file

        try:
            return load_file(str(golden / name))
        except Exception as exc:  # SafetensorError, OSError: truncated, not safetensors
            problems.append((golden / name, f"cannot be read as safetensors ({exc})"))
            return None

    def cases(name: str, rules: dict[str, Rule], inner: str | None) -> dict:
        """The cases whose metadata is valid (the others are reported)."""
        path = golden / name.replace(".safetensors", ".json")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:  # missing, unreadable, not JSON (or not UTF-8)
            problems.append((path, f"cannot be read as JSON ({exc})"))
            return {}
        if inner is not None:
            data = data.get(inner) if isinstance(data, dict) else None
        if not isinstance(data, dict) or not data:
            where = f"a non-empty {inner!r} mapping" if inner else "a non-empty mapping"
            problems.append((path, f"holds no cases (expected {where} of case -> metadata)"))
            return {}
        valid = {}
        for case, meta in data.items():
            found = _case_problems(case, meta, rules)
            problems.extend((path, p) for p in found)
            if not found:
                valid[case] = meta
        return valid

    te, vl = tensors(TE_FILE), tensors(VLLM_FILE)
    te_cases, vl_cases = cases(TE_FILE, TE_META, "cases"), cases(VLLM_FILE, VLLM_META, None)
    problems += _tensor_problems(golden, te, vl, te_cases, vl_cases)
    if len(problems) == 1:
        path, what = problems[0]
        raise UserError(f"golden file {path}: {what}; restore it (from shared/golden or git)")
    if problems:
        raise UserError(
            f"{len(problems)} problems in the golden files; restore them (from shared/golden "
            "or git):\n" + "\n".join(f"  - golden file {p}: {w}" for p, w in problems)
        )
    assert te is not None and vl is not None  # no problems: both files were read
    return te, vl, te_cases, vl_cases
