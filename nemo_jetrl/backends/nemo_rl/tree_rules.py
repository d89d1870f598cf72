"""What the NeMo-RL tree a run imports does with two FP8 settings, read from its source first.

Two behaviours differ between the NeMo-RL trees we run on and show nowhere in the config, so
`translate` asks the tree's source (parsed, never imported: no Ray, no vLLM) before launch:

* **BF16 edge layers of the rollout** (``policy.generation.vllm_cfg.num_{first,last}_layers_in_bf16``).
  v0.7.0's ``init_fp8`` (``quantization/fp8.py``) collects each edge's modules with
  ``bf16_params.append(...)``: vLLM's ``ignored_layers`` then holds one *list* per edge, which
  vLLM's ``prefix in ignored_layers`` never matches, so those layers run FP8 where the config
  says BF16 (main extends the list). Our refit hook would refuse at the first refit, after Ray,
  the model load and vLLM's start; without the hook the rollout silently runs other layers in
  FP8. The same layers by name (``quantization_ignored_layer_kws``) work on both trees.
* **TE's own FP8 weights at refit** (``policy.megatron_cfg.fp8_cfg.fp8_param``: TE quantizes the
  fp32 master weights into FP8 parameters and the forward computes with those codes). main's
  Megatron worker exports the codes plus ``*_scale_inv`` (Megatron-Bridge's
  ``build_export_fp8_tasks``): the refit hook quantizes BF16 weights, so the first refit fails,
  and NeMo-RL's own loader quantizes the codes again as values, which with power-of-two scales
  doubles every block whose largest code is 224 (with FP32 scales that code is always 448,
  kept). v0.7.0's worker exports them dequantized to BF16 (``code x scale_inv``,
  Megatron-Bridge's mappings): with power-of-two scales that is exact and quantizing it again
  gives the same values (a block whose largest code is 224 comes back as codes x 2 with the
  scale / 2: the same products); with FP32 scales the BF16 rounding moves each block's amax, so
  the rollout's scales, and with them its weights, differ from training's
  (tests/backends/test_nemo_rl_tree_rules.py).

A tree whose files are absent or unreadable gives no facts and no problems here: the refit hook's
own layout check (`vllm_refit.detect_layout`) refuses an unknown tree inside the vLLM worker.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_jetrl.config import schema as S

FP8_PY = "models/generation/vllm/quantization/fp8.py"
MCORE_WORKER_PY = "models/policy/workers/megatron_policy_worker.py"


@dataclass(frozen=True)
class TreeFacts:
    """What one NeMo-RL tree's source says."""

    source: str
    """Which tree, as messages name it (``NeMo-RL at /opt/nemo-rl/nemo_rl``, ``NeMo-RL v0.7.0``)."""
    nested_bf16_edges: bool
    """``init_fp8`` appends each BF16 edge's module list to ``ignored_layers`` (v0.7.0)."""
    exports_te_fp8: bool
    """The Megatron worker's refit sends TE's FP8 weights when ``fp8_param`` is on (main)."""


KNOWN_TREES = {
    "v0.7.0": TreeFacts("NeMo-RL v0.7.0", nested_bf16_edges=True, exports_te_fp8=False),
    "main": TreeFacts("NeMo-RL main", nested_bf16_edges=False, exports_te_fp8=True),
}
"""The trees `jetrl check` answers for (``flow.backend.NEMO_RL_TREES``), as `read_tree` reads
their source (tests/backends/test_nemo_rl_tree_rules.py compares the two)."""


def nemo_rl_package(environ: Any = None) -> Path | None:
    """The ``nemo_rl`` package this Python would import (found, not imported), else
    ``$NEMO_RL_DIR/nemo_rl``; None when neither exists."""
    try:
        spec = importlib.util.find_spec("nemo_rl")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    root = (os.environ if environ is None else environ).get("NEMO_RL_DIR")
    pkg = Path(root) / "nemo_rl" if root else None
    return pkg if pkg is not None and pkg.is_dir() else None


def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _appends_edge_lists(mod: ast.Module) -> bool:
    """``bf16_params.append(_get_params_in_layers(...))`` anywhere in the module."""
    for node in ast.walk(mod):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f, args = node.func, node.args
        if (
            f.attr == "append"
            and isinstance(f.value, ast.Name)
            and f.value.id == "bf16_params"
            and len(args) == 1
            and isinstance(args[0], ast.Call)
            and getattr(args[0].func, "id", None) == "_get_params_in_layers"
        ):
            return True
    return False


def _uses_attribute(mod: ast.Module, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(mod))


def read_tree(package: Path) -> TreeFacts | None:
    """The facts of the ``nemo_rl`` package at ``package``; None when its files are missing."""
    fp8, worker = _tree(package / FP8_PY), _tree(package / MCORE_WORKER_PY)
    if fp8 is None or worker is None:
        return None
    return TreeFacts(
        source=f"NeMo-RL at {package}",
        nested_bf16_edges=_appends_edge_lists(fp8),
        exports_te_fp8=_uses_attribute(worker, "build_export_fp8_tasks"),
    )


def _layer_words(first: int, last: int, num_layers: int) -> list[str]:
    ids = [*range(first), *range(max(num_layers - last, first), num_layers)]
    return [f"layers.{i}." for i in ids]


def tree_problems(
    facts: TreeFacts | None, recipe: Any, *, num_layers: int, hooked: bool
) -> list[tuple[str, str]]:
    """(key, why) for each setting ``facts``' tree would not run as the recipe says.
    ``hooked``: our refit hook quantizes the rollout's weights (``jetrl.refit_hook``)."""
    if facts is None:
        return []
    problems: list[tuple[str, str]] = []
    ro, t = recipe.rollout, recipe.train
    first, last = ro.bf16_first_layers, ro.bf16_last_layers
    if facts.nested_bf16_edges and ro.fp8_linears and (first or last):
        words = _layer_words(first, last, num_layers) + list(ro.bf16_layer_kws)
        for key, n in ((S.VLLM_FIRST_BF16, first), (S.VLLM_LAST_BF16, last)):
            if n:
                problems.append(
                    (
                        key,
                        f"{n}: {facts.source} ({FP8_PY}, init_fp8) passes these "
                        "layers to vLLM as a nested list that vLLM's ignored_layers never "
                        "matches, so they would run FP8. Set it to 0 and name the layers instead: "
                        f"{S.VLLM_IGNORED_KWS}={words} (and jetrl.train_bf16_layer_kws the same "
                        "for on-policy training)",
                    )
                )
    if t.fp8_linears and t.fp8_param and ro.fp8_linears:
        problems += _fp8_param_problems(facts, t, hooked)
    return problems


def _fp8_param_problems(facts: TreeFacts, train: Any, hooked: bool) -> list[tuple[str, str]]:
    """TE's FP8 primary weights (``fp8_param``) against what the tree's refit sends."""
    fix = (
        "set it to false (training stays FP8: TE then quantizes the BF16 weights in every "
        "forward, as the rollout does)"
    )
    if facts.exports_te_fp8 and (hooked or train.pow2_weight_scales):
        loader = (
            "the refit hook loads BF16 weights only"
            if hooked
            else "NeMo-RL's own loader (fp8.py load_weights) quantizes those codes again as if "
            "they were values, which doubles every block whose largest code is 224"
        )
        return [
            (
                S.FP8_PARAM,
                f"true: {facts.source} ({MCORE_WORKER_PY}) refits TE's own FP8 codes "
                f"and *_scale_inv tensors, and {loader}: {fix}",
            )
        ]
    if facts.exports_te_fp8:  # FP32 scales: every block's largest code is 448, which it keeps
        return []
    if not train.pow2_weight_scales:
        return [
            (
                S.FP8_PARAM,
                f"true with FP32 weight scales: {facts.source} refits TE's FP8 "
                "weights dequantized to BF16 (code x FP32 scale, rounded), and quantizing those "
                f"again gives other scales than training computes with: {fix}, or use "
                "power-of-two scales",
            )
        ]
    return []
