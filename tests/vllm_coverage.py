"""Which vLLM tiers run each test of the vLLM tier, and why (issue 40: one home per fact).

CI runs the vLLM tier (scripts/test_vllm.sh) once per release line in ``JETRL_VLLM_VERSIONS``
(default 0.32 and 0.20, scripts/test.sh). Our code branches by vLLM version in a few places only:
``vllm_patch/compat.py`` (kernel registry entry created on 0.20, ``linear_backend`` >= 0.32, KV
scale copies and 0.20's ``calculate_kv_scales``, the KV cache attribute, FP8 KV cache support,
``cpu_omp_threads_bind``), ``moe_versions.py`` (0.20's ``FusedMoE`` vs the ``MoERunner``, own
routing below 0.32, the router capture), ``expert_shards`` / ``moe_names`` (``routed_experts``),
``shared_experts`` (who runs the shared expert), ``cpu_moe_repack`` (0.20 packs BF16 experts on
reload), ``engine.py`` / ``vllm_rollout.py`` (0.20 falls back from an FP8 KV cache), and vLLM's
own CPU dispatch differs by version (docs/testing.md, "What depends on the CPU"). A test that reaches one
of those runs on every line. A test whose path is the same on every line, and whose vLLM contact
point another test reaches on 0.20, runs on 0.32 only: each entry below names that other test.

`decide` is the one rule; tests/conftest.py deselects by it (never skips) and counts it in the
summary; tests/test_vllm_coverage.py checks every entry against the real collection.
Unlisted tests run on every line (the default when unsure). ``vllm_versions`` markers in a test
module take precedence over this map. ``JETRL_VLLM_ALL_VERSIONS=1`` runs everything everywhere.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# The release lines of the vLLM tiers this map decides for (scripts/test.sh's default
# JETRL_VLLM_VERSIONS; the test checks they agree). On any other line (0.25.1, run by the NeMo-RL
# main tier through the marker vllm_in_nemo_rl) the map deselects nothing.
TIER_LINES = ("0.32", "0.20")
# What scripts/test_vllm.sh collects (the test checks they agree).
TIER_PATHS = (
    "tests/vllm_patch",
    "tests/backends/test_local_vllm.py",
    "tests/backends/test_local_vllm_moe.py",
    "tests/backends/test_local_vllm_seq_len.py",
    "tests/runs/test_faults_stale_rollout_vllm.py",
)


@dataclass(frozen=True)
class Coverage:
    module: str  # path from the repository root
    pattern: str | None  # re.search on the node id after "module::"; None: every test in it
    lines: tuple[str, ...]  # the release lines whose tier runs it
    why: str


# Tests in TIER_PATHS without the `vllm` marker need no vLLM at all: the default suite runs them
# (in .venv, where vLLM is absent) and so does the 0.32 tier; with vLLM 0.20 installed they run
# the same pure-torch / config code.
NO_VLLM_LINES = ("0.32",)
NO_VLLM_WHY = "not marked vllm: needs no vLLM (the default suite runs it without one)"

_JETRL_ENGINES = r"[\[-](standin-)?jetrl[\]-]"  # the engine ids jetrl / standin-jetrl / *-jetrl
_ON_020_DENSE = (
    "on 0.20 the same refit/rollback code and contact point (compat.reload_weights, vLLM's "
    "layerwise reload) run in test_vllm_engine.py (this jetrl engine: two refits with parity, "
    "parameter identity, refused refits bit-identical), test_vllm_moe.py (a parity failure "
    "rolled back over FP8 dense and expert tensors) and this module's standin-bf16 engine "
    "(0.20's repacking branch and its GEMM closures, every decoder linear + lm_head, any CPU)"
)

COVERAGE: tuple[Coverage, ...] = (
    Coverage("tests/vllm_patch/test_vllm_cpu_gemm.py", _JETRL_ENGINES, ("0.32",), _ON_020_DENSE),
    Coverage(
        "tests/vllm_patch/test_vllm_cpu_gemm.py",
        r"^test_refit_rebuilds_what_vllm_derives_from_the_weights\[bf16-bf16\]$",
        ("0.32",),
        "the real BF16 engine takes 0.20's oneDNN branch on AVX-512 (SGL is off by default in "
        "0.20), which the standin-bf16-bf16 engine runs on every CPU, and the in-place branch "
        "on AVX2 (0.20's AVX2 library has no oneDNN), which the fp32-bf16 engine takes there",
    ),
    Coverage(
        "tests/vllm_patch/test_vllm_dense_shards.py",
        None,
        ("0.32",),
        "dense_shards.py has no version branch and vLLM's TP loaders were read identical in "
        "0.20.0/0.25.1/0.32.0; on 0.20 a TP=2 engine (executor, 0.20's explicit OMP bind list "
        "per worker) and per-rank refit parity over the TP-sharded attention run in "
        "test_vllm_moe_shards.py; on 0.25.1 this module runs in the NeMo-RL main tier",
    ),
    Coverage(
        "tests/vllm_patch/test_vllm_dense_shards_kv_replicated.py",
        None,
        ("0.32",),
        "same as test_vllm_dense_shards.py (its KV-replica rule is dense_shards.py's, no "
        "version branch); runs on 0.25.1 in the NeMo-RL main tier too",
    ),
    Coverage(
        "tests/vllm_patch/test_vllm_moe_shared.py",
        r"^test_checkpoint_keeps_the_shared_gate_bf16_and_quantizes_the_shared_expert$",
        ("0.32",),
        "reads the checkpoint our quantizer wrote: no vLLM code",
    ),
    Coverage(
        "tests/vllm_patch/test_vllm_moe_shared.py",
        r"^test_parity_names_a_corrupted_shared_expert_tensor\[",
        ("0.32",),
        "our parity check naming a tensor over what the engine loaded; on 0.20 the shared "
        "expert's load and parity run in test_refit_parity_over_every_expert_and_shared_expert_"
        "tensor",
    ),
    Coverage(
        "tests/vllm_patch/test_vllm_moe_shared.py",
        r"^test_nemo_rl_refit_hook_quantizes_shared_experts_with_parity\[grouped\]$",
        ("0.32",),
        "grouped expert slabs are NeMo-RL main's layout, whose vLLM is 0.25.1; NeMo-RL v0.7.0 "
        "(vLLM 0.20) sends per-expert names: [per_expert] runs on 0.20",
    ),
    Coverage(
        "tests/vllm_patch/test_nemo_rl_hook_moe_engine.py",
        r"\[grouped\]$",
        ("0.32",),
        "grouped slabs are NeMo-RL main's layout (vLLM 0.25.1: the NeMo-RL main tier runs this "
        "module); [per_expert], NeMo-RL v0.7.0's layout, runs on 0.20",
    ),
    Coverage(
        "tests/backends/test_local_vllm_seq_len.py",
        None,
        ("0.32",),
        "the engine's max_model_len is our own sizing (backends/local/seq_len.py), passed to "
        "LLM() alike on every line; no version branch on this path",
    ),
    Coverage(
        "tests/backends/test_local_vllm_moe.py",
        r"^test_jetrl_moe_on_the_vllm_engine_with_its_routing_recorded_and_replayed$",
        ("0.32",),
        "the local loop (vllm_rollout.py) has no version branch here; on 0.20 the routing "
        "capture (own routing, layer.router) runs in test_vllm_moe.py::test_routed_experts_"
        "returned_for_routing_replay and the FP8 MoE refit in test_vllm_moe.py; the BF16 "
        "control run (cpu_moe_repack's 0.20 branch) stays on 0.20",
    ),
    Coverage(
        "tests/vllm_patch/test_vllm_mla.py",
        None,
        ("0.32",),
        "MLA cannot run on 0.20 (nor 0.25.1): their CPU platform's get_attn_backend_cls raises "
        "'MLA is not supported on CPU.'; 0.32 has CPU_MLA. The refit/parity path it takes on "
        "0.32 (compat.reload_weights, fused shards, parity) runs on 0.20 in test_vllm_engine.py",
    ),
)


def decide(
    nodeid: str, markers: set[str], marker_lines: tuple[str, ...] | None
) -> tuple[tuple[str, ...], str, str] | None:
    """(lines that run ``nodeid``, why, where that is said) for a test of the vLLM tier; None:
    every line. ``markers``: its marker names; ``marker_lines``: its vllm_versions arguments."""
    if marker_lines is not None:
        return marker_lines, "vllm_versions marker", "the test module's vllm_versions marker"
    if "nemo_rl" in markers or not nodeid.startswith(TIER_PATHS):
        return None  # the NeMo-RL tiers' tests, and anything outside the vLLM tier
    module, _, rest = nodeid.partition("::")
    for c in COVERAGE:
        if c.module == module and (c.pattern is None or re.search(c.pattern, rest)):
            return c.lines, c.why, "tests/vllm_coverage.py"
    if "vllm" not in markers:
        return NO_VLLM_LINES, NO_VLLM_WHY, "tests/vllm_coverage.py"
    return None


def matches(entry: Coverage, nodeid: str) -> bool:
    module, _, rest = nodeid.partition("::")
    return module == entry.module and (
        entry.pattern is None or bool(re.search(entry.pattern, rest))
    )


KNOWN_LINES = ("0.32", "0.25", "0.20")  # the lines nemo_jetrl supports (compat.SUPPORTED_RANGES)


def check_map(
    records: list[dict], ci_lines: tuple[str, ...], tier_paths: tuple[str, ...], repo: Path
) -> list[str]:
    """What is wrong with this map for the collected vLLM tier ``records`` (each ``nodeid``,
    ``markers``, ``vllm_versions``: the marker's lines or None); empty when nothing is."""
    out = []
    if set(TIER_LINES) != set(ci_lines):
        out.append(f"TIER_LINES {TIER_LINES} are not scripts/test.sh's default {ci_lines}")
    if tuple(tier_paths) != TIER_PATHS:
        out.append(f"TIER_PATHS {TIER_PATHS} are not what scripts/test_vllm.sh runs {tier_paths}")
    ids = [r["nodeid"] for r in records]
    for c in COVERAGE:
        name = f"{c.module}::{c.pattern or '*'}"
        if not (repo / c.module).is_file():
            out.append(f"{name}: no such module")
        if not c.why.strip():
            out.append(f"{name}: no why")
        if not set(c.lines) <= set(KNOWN_LINES) or not c.lines:
            out.append(f"{name}: lines {c.lines} are not among {KNOWN_LINES}")
        if not set(c.lines) & set(ci_lines):
            out.append(f"{name}: runs on {c.lines}, none of which CI runs ({ci_lines})")
        if c.pattern is not None:
            try:
                re.compile(c.pattern)
            except re.error as exc:
                out.append(f"{name}: bad pattern ({exc})")
                continue
        if not any(matches(c, i) for i in ids):
            out.append(f"{name}: matches no collected test (renamed or removed? update the map)")
    for r in records:
        hits = {c.lines for c in COVERAGE if matches(c, r["nodeid"])}
        if len(hits) > 1:
            out.append(f"{r['nodeid']}: entries disagree on its lines {sorted(hits)}")
        lines = r["vllm_versions"]
        if hits and lines:
            out.append(f"{r['nodeid']}: has a vllm_versions marker and a map entry (keep one)")
        found = decide(r["nodeid"], set(r["markers"]), tuple(lines) if lines else None)
        if found is not None and not set(found[0]) & set(ci_lines):
            out.append(f"{r['nodeid']}: deselected on every line CI runs ({found[2]})")
    return out


# Marks under which a vllm-marked test runs outside the vLLM tier: the NeMo-RL tiers
# (scripts/test_nemo_rl.sh collects all of tests/ by these) and the GPU image (gpu).
RUN_ELSEWHERE = {"nemo_rl", "vllm_in_nemo_rl", "gpu"}


def _mark_names(node: ast.expr) -> set[str]:
    """Names of the pytest marks in a decorator or a ``pytestmark`` value."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return set().union(*(_mark_names(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "pytest.mark":
        return {node.attr}
    return set()


def _untiered(body: list[ast.stmt], marks: set[str], prefix: str) -> Iterator[str]:
    """Names of the tests in ``body`` marked vllm with no mark of RUN_ELSEWHERE."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own = marks.union(*(_mark_names(d) for d in node.decorator_list))
            if isinstance(node, ast.ClassDef):
                yield from _untiered(node.body, own, f"{prefix}{node.name}::")
            elif node.name.startswith("test") and "vllm" in own and not own & RUN_ELSEWHERE:
                yield f"{prefix}{node.name}"


def untiered_vllm_tests(repo: Path, tier_paths: tuple[str, ...]) -> list[str]:
    """Tests marked ``vllm`` that no tier collects: outside ``tier_paths`` and without a mark
    another tier runs (a module that only the default suite sees skips them for want of vLLM,
    and CI never runs them)."""
    out = []
    for path in sorted((repo / "tests").rglob("test_*.py")):
        rel = path.relative_to(repo).as_posix()
        if rel.startswith(tier_paths):
            continue
        tree = ast.parse(path.read_text(), filename=rel)
        module_marks: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            ):
                module_marks |= _mark_names(node.value)

        out += [f"{rel}::{name}" for name in _untiered(tree.body, module_marks, "")]
    return out
