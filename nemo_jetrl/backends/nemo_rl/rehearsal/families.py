"""Model families the rehearsal has no stand-in for (MLA, hybrid attention): whether this env's
vLLM CPU engine could serve them, asked of vLLM's own code without starting an engine, and the
refusal `jetrl rehearse` gives before anything starts (exit 2).

* MLA (DeepSeek-V2/V3, Moonlight): vLLM's MLA layer asks its platform for an attention backend
  with ``use_mla=True``; `mla_serving` asks vLLM's ``CpuPlatform.get_attn_backend_cls`` the
  same. vLLM 0.20 and 0.25.1 raise 'MLA is not supported on CPU.' (``vllm/platforms/cpu.py:84``);
  vLLM 0.32 selects ``CPU_MLA``, so the refusal names the next missing piece there by itself.
* Hybrid attention (Qwen3-Next, Qwen3.5): `hybrid_serving` reads vLLM's model module for the
  family (its source, not imported) for the gated-DeltaNet class it builds, and that class for a
  CPU forward. vLLM 0.20's has none (``forward_xpu`` or ``forward_cuda``, Triton kernels; its
  engine dies loading the layer); 0.25.1's runs ``forward_cpu`` on its CPU ops. Where it has
  one, the model module is imported as the engine imports it (Qwen3.5's imports Qwen3-VL's,
  which needs torchvision).

docs/rehearsal.md ("Families that do not rehearse") has the measured engine errors.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_jetrl.backends.nemo_rl.rehearsal.hybrid import multimodal_type

MLA, HYBRID = "MLA", "hybrid attention"
# vLLM's model module (vllm/model_executor/models/<module>.py) for each hybrid family; the
# "_text" decoder configs of Qwen3.5 are served by the multimodal checkpoint's module
HYBRID_MODULES = {"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5"}
# what covers each family's FP8 refit where the rehearsal cannot run it
COVERAGE = {
    MLA: "tests/vllm_patch/test_vllm_mla.py serves a tiny MLA model on vLLM 0.32's CPU engine "
    "(CPU_MLA) under jetrl: every MLA linear on our kernel, refit parity including vLLM's "
    "derived W_UK/W_UV, the 576-row kv_a_proj tail block",
    HYBRID: "tests/megatron/test_megatron_bf16_names_gdn.py pins the trainer side of the gated "
    "DeltaNet (Megatron's one in_proj GEMM and the BF16 words valid for it)",
}
# a family with a stand-in, per kind of MLP, to rehearse the same recipe with
STAND_INS = {True: "Qwen/Qwen3-30B-A3B", False: "Qwen/Qwen3-8B-Base"}
IGNORED_KEY = "policy.generation.vllm_cfg.quantization_ignored_layer_kws"


@dataclass(frozen=True)
class Serving:
    """vLLM's answer for a family: can its CPU engine serve it here, and what in vLLM says so."""

    can: bool
    why: str
    asked: bool = True
    """False: there was no vLLM here to ask (``why`` says what failed)."""


def family_kind(arch: Any) -> str | None:
    """`MLA`, `HYBRID`, or None for a family whose attention the rehearsal's stand-ins have."""
    if arch.mla is not None:
        return MLA
    if arch.hybrid is not None:
        return HYBRID
    return None


def _vllm_root() -> Path | None:
    try:
        spec = importlib.util.find_spec("vllm")  # the top-level package: nothing is imported
    except ValueError:  # a module without a spec in sys.modules
        return None
    return Path(spec.submodule_search_locations[0]) if spec and spec.origin else None


def _rel(path: str | Path, root: Path | None) -> str:
    """``path`` as its package's (``vllm/...``, ``transformers/...``): from the nearest folder
    holding it among vLLM's and the ``sys.path`` entries."""
    p = Path(path)
    bases = ([root.parent] if root is not None else []) + [Path(x) for x in sys.path if x]
    held = [str(p.relative_to(b)) for b in bases if b.is_absolute() and p.is_relative_to(b)]
    return min(held, key=len) if held else str(p)  # the nearest folder: the package's own


def _where(path: str | Path, line: int, root: Path | None) -> str:
    return f"{_rel(path, root)}:{line}"


def mla_serving(head_size: int, root: Path | None = None) -> Serving:
    """Ask vLLM's CPU platform for an MLA attention backend, as vLLM's MLA layer does."""
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    root = root or _vllm_root()
    config = AttentionSelectorConfig(
        head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=None,
        use_mla=True,
    )  # fmt: skip
    try:
        backend = CpuPlatform.get_attn_backend_cls(None, config)
    except NotImplementedError as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return Serving(False, f"{_where(frame.filename, frame.lineno, root)} "
                              f"({frame.name}) raises NotImplementedError({str(exc)!r})")  # fmt: skip
    return Serving(True, f"its CPU platform selects {backend} for MLA")


def _imports_of(tree: ast.Module, word: str) -> tuple[str, str, int] | None:
    """(module, name, line) of the first ``from module import name`` whose name has ``word``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if word in alias.name:
                    return node.module, alias.name, node.lineno
    return None


def _cpu_branch(cls: ast.ClassDef) -> int | None:
    """The line where the class picks a CPU forward (an ``is_cpu()`` test), else the line of its
    ``forward_cpu`` method; None when it has neither."""
    nodes = list(ast.walk(cls))
    tested = [n.lineno for n in nodes if isinstance(n, ast.Attribute) and n.attr == "is_cpu"]
    defined = [
        n.lineno for n in nodes if isinstance(n, ast.FunctionDef) and n.name == "forward_cpu"
    ]
    return min(tested or defined or [0]) or None


def _forward_choice(cls: ast.ClassDef) -> int:
    """The line of the forward the class picks (``self._forward_method = <this>``)."""
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "_forward_method" for t in node.targets
        ):
            return node.value.lineno  # the chosen forward (inside parentheses: its own line)
    return cls.lineno


def gdn_cpu_path(module: str, root: Path) -> Serving:
    """Does the gated-DeltaNet layer vLLM's ``models/<module>.py`` builds have a CPU forward?
    Read from vLLM's source files under ``root`` (the ``vllm`` package), nothing imported."""
    model_file = root / "model_executor" / "models" / f"{module}.py"
    if not model_file.is_file():
        return Serving(False, f"this vLLM has no model module {_rel(model_file, root)}")
    found = _imports_of(ast.parse(model_file.read_text()), "GatedDeltaNet")
    if found is None:
        return Serving(False, f"{_rel(model_file, root)} builds no gated-DeltaNet layer")
    layer_module, name, _line = found
    layer_file = root.joinpath(*layer_module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(layer_file.read_text())
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        return Serving(False, f"{name} is not defined in {_rel(layer_file, root)}")
    line = _cpu_branch(cls)
    if line is None:
        return Serving(False, f"{_where(layer_file, _forward_choice(cls), root)}: its gated "
                              f"DeltaNet layer ({name}) has no CPU forward (it picks "
                              "forward_xpu or forward_cuda, Triton kernels)")  # fmt: skip
    return Serving(True, f"{_where(layer_file, line, root)}: {name} runs forward_cpu")


def import_model_module(module: str, root: Path, load: Callable[[str], Any]) -> Serving:
    """Import vLLM's ``models/<module>.py`` (``load``: ``importlib.import_module``) as its engine
    would; a missing module is named with the chain of imports from the first file under
    ``root`` (vLLM's package) to the one that needed it and, when vLLM's distribution requires
    it, said to be a dependency this env lacks."""
    try:
        load(f"vllm.model_executor.models.{module}")
    except Exception as exc:  # whatever stops the import stops the engine
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename[:1] != "<"]
        start = next((i for i, f in enumerate(frames) if Path(f.filename).is_relative_to(root)), 0)
        chain = [_where(f.filename, f.lineno, root) for f in frames[start:]]
        missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
        declared = _declared_dependency(missing) if missing else None
        return Serving(False, f"importing vLLM's model module fails: {exc} ("
                              + " -> ".join(chain[-4:]) + ")"
                              + (f"; {declared}" if declared else ""))  # fmt: skip
    return Serving(True, f"vllm.model_executor.models.{module} imports")


def _declared_dependency(name: str) -> str | None:
    from importlib import metadata

    for dist in metadata.packages_distributions().get("vllm", []):
        for req in metadata.requires(dist) or []:
            req_name = re.match(r"[A-Za-z0-9_.-]*", req).group(0)
            if req_name.lower() == name.lower():
                return f"{dist} {metadata.version(dist)} requires {name}, not installed in this env"
    return None


def hybrid_serving(
    model_type: str, root: Path | None = None, load: Callable[[str], Any] | None = None
) -> Serving:
    """Can vLLM's CPU engine serve a hybrid-attention family here: its gated DeltaNet's CPU path
    (source), then its model module (imported)."""
    root = root or _vllm_root()
    family = model_type.removesuffix("_text")
    module = HYBRID_MODULES.get(family)
    if root is None or module is None:
        return Serving(False, f"no vLLM model module is known for {model_type}")
    path = gdn_cpu_path(module, root)
    if not path.can:
        return path
    imported = import_model_module(module, root, load or importlib.import_module)
    if not imported.can:
        return imported
    return Serving(True, f"{path.why}; {imported.why}")


def cpu_serving(arch: Any) -> Serving:
    """This env's vLLM's answer for ``arch``'s family (MLA or hybrid attention)."""
    if family_kind(arch) == MLA:
        return mla_serving(arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim)
    return hybrid_serving(arch.model_type)


def vllm_version() -> str:
    from importlib import metadata

    dists = metadata.packages_distributions().get("vllm", [])
    return metadata.version(dists[0]) if dists else "(none)"


def family_refusal(
    arch: Any,
    config: str,
    ignored_kws: Sequence[str] = (),
    serving: Serving | None = None,
    version: str | None = None,
) -> str | None:
    """Why ``jetrl rehearse CONFIG`` cannot run ``arch``'s family here and what to do instead;
    None for a family with a stand-in (Qwen3.5 where this vLLM's CPU engine serves it).
    ``serving``/``version``: this env's vLLM's (None: ask)."""
    kind = family_kind(arch)
    if kind is None:
        return None
    if serving is None:
        try:
            serving = cpu_serving(arch)
        except (ImportError, TypeError, AttributeError, OSError, SyntaxError) as exc:
            serving = Serving(False, f"{type(exc).__name__}: {exc}", asked=False)
    if serving.can and kind == HYBRID and multimodal_type(arch.model_type) is not None:
        return None  # Qwen3.5: vLLM's CPU engine serves it and `hybrid.py` has its stand-in
    version = version or vllm_version()
    moe = arch.moe is not None
    family = f"{arch.model_type} ({kind}{', mixture of experts' if moe else ''})"
    if not serving.asked:
        head = (f"this env's vLLM could not be asked whether its CPU engine serves {kind} "
                f"({serving.why}), and jetrl rehearse has no {kind} stand-in")  # fmt: skip
    elif serving.can:
        head = (f"vLLM {version}'s CPU engine can serve {kind} here ({serving.why}), but jetrl "
                f"rehearse has no {kind} stand-in yet")  # fmt: skip
    else:
        head = f"vLLM {version}'s CPU engine cannot serve {kind}: {serving.why}"
    swap, why_swap = f"policy.model_name={STAND_INS[moe]}", ""
    if ignored_kws:
        swap += f" {IGNORED_KEY}=[]"
        why_swap = f" ({IGNORED_KEY} {list(ignored_kws)} names layers the swapped-in model lacks)"
    return (
        f"policy.model_name={arch.name!r} is a {family} model; {head}. Nothing was started. "
        f"Instead: `jetrl check {config}` gives its on-policy verdict for the cluster; "
        f"{COVERAGE[kind]}; to rehearse the same recipe end to end with a family that has a "
        f"stand-in: `jetrl align {config} {swap} -o OUT.yaml` then `jetrl rehearse OUT.yaml`"
        f"{why_swap}"
    )


def undescribed(name: Any, state_space: str | None) -> str:
    """Why ``jetrl rehearse`` has no stand-in for a model nemo_jetrl does not describe
    (``state_space``: the evidence of Mamba layers, `launch.Prepared.state_space`)."""
    if state_space:  # a config.json would not help: no stand-in serves Mamba layers here
        return (
            f"the model ({state_space}) has state-space (Mamba) layers, so the rehearsal cannot build a "
            "stand-in of its family (vLLM's CPU build has no Mamba-2 scan; docs/configs.md, "
            '"Models with state-space layers"). Nothing was started. Rehearse a config of the '
            "same recipe with a dense or Qwen3-MoE model"
        )
    return (
        f"policy.model_name={name!r} is not a model nemo_jetrl knows, so the rehearsal cannot "
        "build a stand-in of its family: pass ++jetrl.model_config=PATH to the model's HF "
        "config.json"
    )
