"""The precision-flow graph of a model under a recipe, and the on-policy (subgraph) check.

Jet-RL's rule: rollout is on-policy only if its quantization graph is a *subgraph of the training
forward graph*. Concretely, every tensor entering a GEMM or the KV cache must carry, in rollout,
exactly the numbers it carries in the training forward: same precision (BF16/FP8), same format,
same block shape, same scale rule, and code that computes the same bits for them.

The graph here has one node per weight and per op (a linear's GEMM, the KV cache write) and one
edge per tensor flowing into an op; each edge carries a `Precision` (dtype, format, block, scale
mode, implementation). `build_flow` builds it for three phases:

- ``rollout``: the inference engine's forward;
- ``train_fwd``: the training forward (what the policy being optimised computes);
- ``train_bwd``: the training backward (DGrad: dY 1x128 x W 128x128 reused; WGrad: dY and x
  128x1), shown for completeness: backward precision does not decide on-policyness.

`check_on_policy` compares every rollout edge with its training-forward edge and returns the
differences grouped, each with a plain-words reason and the YAML keys that fix it.

Identical implementations matter: TE (and nemo_jetrl.fp8) compute ``q = x * RN(448/amax)``,
vLLM's own kernels ``q = x / RN(amax/448)``. With power-of-two scales both are exact and agree
(except groups whose amax is tiny, where vLLM floors its scale); with FP32 scales they round
differently (measured: 28% of dequantized activations, 23% of weights differ). So FP32 scales
are on-policy only when our vLLM patch supplies TE's formula to vLLM.

Edges come from *builders* (``(arch, recipe, phase) -> list[Edge]``; the KV cache edges are
one), so other parts can pass extra ones (a Q edge for FP8 attention) without editing this
module. The graph types and builders live in `nemo_jetrl.flow.graph`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nemo_jetrl.arch import ModelArch
from nemo_jetrl.config import schema as S
from nemo_jetrl.config.layer_lists import per_name_mismatch
from nemo_jetrl.flow.fixes import list_fix_words, patch_fix, scale_fix
from nemo_jetrl.flow.graph import (
    BF16,
    DEFAULT_BUILDERS,
    PHASES,
    BLOCK_1x128,
    BLOCK_128x1,
    BLOCK_128x128,
    Edge,
    EdgeBuilder,
    Precision,
    PrecisionFlow,
    bf16_edges,
    build_flow,
    formula,
    kv_edges,
    linear_edges,
    same_numbers,
)
from nemo_jetrl.flow.mxfp8 import is_mx, mx_fp8_mismatch, mx_rollout_vs_bf16
from nemo_jetrl.flow.vllm_bf16 import vllm_bf16_mismatch
from nemo_jetrl.recipe import Recipe

__all__ = [
    "BF16",
    "DEFAULT_BUILDERS",
    "PHASES",
    "BLOCK_1x128",
    "BLOCK_128x1",
    "BLOCK_128x128",
    "Edge",
    "EdgeBuilder",
    "FlowCheck",
    "Mismatch",
    "Precision",
    "PrecisionFlow",
    "bf16_edges",
    "build_flow",
    "check_on_policy",
    "formula",
    "kv_edges",
    "linear_edges",
    "same_numbers",
]

# ---------------------------------------------------------------------------------------------
# the check


@dataclass(frozen=True)
class Mismatch:
    """Rollout edges whose numbers differ from the training forward's, for one reason."""

    reason: str
    """Plain-words reason."""

    keys: tuple[str, ...]
    """YAML keys that control this difference."""

    fixes: tuple[str, ...]
    """Suggested settings (key=value) that make the edges identical."""

    train: Precision
    """Training-forward precision on the first of these edges."""

    rollout: Precision
    """Rollout precision on the first of these edges."""

    edges: tuple[str, ...] = field(repr=False)
    """The edges ("op:role"), in model order."""

    layers: tuple[int, ...] = ()
    """Decoder layers involved."""

    operands: tuple[str, ...] = ()
    """Operands involved ("attn input", "mlp weight", "kv k_cache", ...)."""

    severity: str = "always"
    """How often: "always" (numbers differ systematically) or "rare" (only on blocks with tiny
    amax)."""

    pairs: tuple[tuple[str, Precision, Precision], ...] = ()
    """Every distinct (operand role, training precision, rollout precision) among the edges."""

    def summary(self) -> str:
        """One line: what, where."""
        where = f"layers {format_ranges(self.layers)}" if self.layers else "all layers"
        return f"{', '.join(self.operands)} ({where}, {len(self.edges)} edges)"

    def details(self) -> list[str]:
        """One line per distinct precision pair: "input: training X vs rollout Y"."""
        return [f"{role}: training {t.short()} vs rollout {r.short()}" for role, t, r in self.pairs]


@dataclass(frozen=True)
class FlowCheck:
    """Result of `check_on_policy`."""

    model: str
    """Name of the model checked."""

    recipe: Recipe
    """The recipe checked."""

    rollout: PrecisionFlow
    """The rollout's flow."""

    train_fwd: PrecisionFlow
    """The training forward's flow (what rollout edges are compared with)."""

    train_bwd: PrecisionFlow
    """The training backward's flow (shown, not compared)."""

    mismatches: tuple[Mismatch, ...]
    """Every difference, grouped by reason."""

    @property
    def on_policy(self) -> bool:
        """True when every rollout edge equals its training-forward edge."""
        return not self.mismatches

    @property
    def keys(self) -> list[str]:
        """Every YAML key named by some mismatch (deduplicated, in order)."""
        return list(dict.fromkeys(k for m in self.mismatches for k in m.keys))


def _compare(
    edge: Edge, train: Precision, roll: Precision, recipe: Recipe, words=()
) -> tuple | None:
    """(reason, keys, fixes, severity) when rollout `roll` differs from training `train`."""
    if edge.group == "kv":
        return _compare_kv(train, roll, recipe)
    if roll.why is not None:
        return vllm_bf16_mismatch(edge.kind, roll, recipe, words)
    if train.is_fp8 != roll.is_fp8:
        return _compare_fp8_vs_bf16(edge, roll, recipe, words)
    if not roll.is_fp8:
        return None
    if is_mx(train) or is_mx(roll):
        return mx_fp8_mismatch(train, roll)
    if (train.fmt, train.block) != (roll.fmt, roll.block):
        return (
            f"different FP8 scaling granularity (training {train.short()}, rollout "
            f"{roll.short()}): blocks or formats differ, so the quantized values differ",
            (S.FP8_RECIPE, S.VLLM_IS_MX),
            (f"{S.FP8_RECIPE}=blockwise", f"{S.VLLM_IS_MX}=false"),
            "always",
        )
    is_weight = edge.role == "weight"
    if train.scale != roll.scale:
        vkey = S.VLLM_POW2_W if is_weight else S.VLLM_POW2_A
        what = "weight" if is_weight else "activation"
        return (
            f"{what} scales differ: training rounds them to {train.scale}, rollout uses "
            f"{roll.scale}; the same block gets a different scale, hence different FP8 values",
            (vkey, S.FP32_SCALES_KEY),
            scale_fix(is_weight, recipe, train.scale == "pow2"),
            "always",
        )
    if formula(train) == formula(roll):
        return None
    return _compare_formulas(train, roll, is_weight, recipe)


def _compare_fp8_vs_bf16(edge: Edge, roll: Precision, recipe: Recipe, words=()) -> tuple:
    """One side FP8, the other BF16: FP8 switched on for one side only, or BF16 edge layers."""
    t, r = recipe.train, recipe.rollout
    if r.fp8_linears and not t.fp8_linears:
        kv = (f"and {S.VLLM_KV_DTYPE}=auto",) if recipe.kv_fp8 else ()  # FP8 KV needs FP8 weights
        if r.scaling == "mxfp8":
            return mx_rollout_vs_bf16(kv)
        return (
            "rollout runs these linears in FP8 but training keeps them in BF16: the sampler "
            "is a different (quantized) policy than the one being optimised",
            (S.FP8_ENABLED, S.VLLM_PRECISION),
            (f"{S.FP8_ENABLED}=true", f"or {S.VLLM_PRECISION}=bfloat16", *kv),
            "always",
        )
    if t.fp8_linears and not r.fp8_linears:
        return (
            "training runs these linears in FP8 but rollout keeps them in BF16: the sampler "
            "never sees the quantization the optimised policy has",
            (S.VLLM_PRECISION, S.FP8_ENABLED),
            (f"{S.VLLM_PRECISION}=fp8", f"or {S.FP8_ENABLED}=false"),
            "always",
        )
    named = per_name_mismatch(edge.op, t, r, words or None)
    if named is not None:
        return named
    n_first = (S.VLLM_FIRST_BF16, "jetrl.train_num_first_layers_in_bf16")
    n_last = (S.VLLM_LAST_BF16, "jetrl.train_num_last_layers_in_bf16")
    side = "rollout" if roll.is_fp8 else "training"
    at_start = edge.layer is not None and edge.layer < max(t.bf16_first_layers, r.bf16_first_layers)
    keys, tval = (n_first, t.bf16_first_layers) if at_start else (n_last, t.bf16_last_layers)
    where = "leading" if at_start else "trailing"
    return (
        f"the sides keep different {where} decoder layers in BF16; these layers are FP8 "
        f"only in {side}",
        keys,
        (f"{keys[0]}={tval}",),
        "always",
    )


def _compare_formulas(train: Precision, roll: Precision, is_weight: bool, recipe: Recipe) -> tuple:
    """Same FP8 format, block and scale rule but different quantizer formulas."""
    if train.scale == "fp32":
        share = "23% of weight values" if is_weight else "28% of activation values"
        return (
            "FP32 scales with vLLM's own quantizer are not TE's numbers: TE computes "
            "x * RN(448/amax), vLLM x / RN(amax/448), which round differently (measured: "
            f"{share} dequantize differently). Our vLLM patch makes vLLM use TE's formula",
            ("jetrl.vllm_patch",),
            patch_fix(recipe),
            "always",
        )
    if train.scale == "pow2":
        tiny = (
            "128x128 weight blocks with amax < 1e-4 (vLLM floors the amax)"
            if is_weight
            else "1x128 activation groups with amax < 1/512 (vLLM floors the scale at 1/(448*512))"
        )
        return (
            "power-of-two scales make TE's and vLLM's own formulas agree except on "
            f"{tiny}; there vLLM's numbers differ. Our vLLM patch removes the difference",
            ("jetrl.vllm_patch",),
            patch_fix(recipe),
            "rare",
        )
    return (
        f"different quantizer implementations ({train.impl} vs {roll.impl}) for "
        f"{train.scale} scales are not known to produce the same bits",
        ("jetrl.vllm_patch",),
        patch_fix(recipe),
        "always",
    )


def _compare_kv(train: Precision, roll: Precision, recipe: Recipe) -> tuple | None:
    if roll.is_fp8 and not train.is_fp8 and train.why:  # on-policy KV cannot apply (MLA)
        return (f"the rollout's KV cache is FP8 but {train.why}", (S.VLLM_KV_DTYPE,),
                (f"{S.VLLM_KV_DTYPE}=auto",), "always")  # fmt: skip
    if roll.is_fp8 and not train.is_fp8:
        return (
            "the rollout's KV cache is FP8 but the trainer's attention uses BF16 K/V: attention "
            "in rollout sees quantized keys/values the optimised policy never sees",
            ("jetrl.onpolicy_kv", S.VLLM_KV_DTYPE),
            ("jetrl.onpolicy_kv=true", f"or {S.VLLM_KV_DTYPE}=auto"),
            "always",
        )
    if train.is_fp8 and not roll.is_fp8:  # cannot happen from a valid Recipe; kept for builders
        return (
            "the trainer quantizes K/V but the rollout's KV cache is BF16",
            ("jetrl.onpolicy_kv", S.VLLM_KV_DTYPE),
            ("jetrl.onpolicy_kv=false",),
            "always",
        )
    if roll.is_fp8 and train.scale != roll.scale:
        return (
            f"the rollout's KV scales come from {roll.scale!r}, which the trainer does not use; "
            "trainer and rollout must share the trainer-calibrated scales",
            ("jetrl.kv_scale_source", "jetrl.kv_calibration.enabled"),
            ("jetrl.kv_scale_source=trainer_calibrated", "jetrl.kv_calibration.enabled=true"),
            "always",
        )
    del recipe
    return None


def check_on_policy(
    arch: ModelArch, recipe: Recipe, builders: Sequence[EdgeBuilder] = DEFAULT_BUILDERS
) -> FlowCheck:
    """Compare every rollout edge with its training-forward edge; group the differences."""
    roll = build_flow(arch, recipe, "rollout", builders)
    fwd = build_flow(arch, recipe, "train_fwd", builders)
    bwd = build_flow(arch, recipe, "train_bwd", builders)
    train_by_key = fwd.by_key()
    groups: dict[tuple, dict] = {}
    words = list_fix_words(arch, recipe, roll.edges)
    for e in roll.edges:
        t = train_by_key.get(e.key)
        res = _edge_difference(e, t, recipe, words)
        if res is not None:
            _add_to_group(groups, res, e, BF16 if t is None else t.precision)
    mismatches = tuple(_group_mismatch(g) for g in groups.values())
    return FlowCheck(arch.name, recipe, roll, fwd, bwd, mismatches)


def _edge_difference(e: Edge, t: Edge | None, recipe: Recipe, words=()) -> tuple | None:
    """(reason, keys, fixes, severity) for rollout edge `e` against training edge `t` (None:
    the training forward lacks it); None when both carry the same numbers. List fixes name
    ``words`` (`flow.fixes.list_fix_words`)."""
    if t is None:
        why = f"the rollout has {e.op}:{e.role} but the training forward has no such edge"
        return (why, (), (), "always")
    tp = t.precision
    if same_numbers(tp, e.precision):
        return None
    res = _compare(e, tp, e.precision, recipe, words)
    if res is None:
        res = (
            f"precision differs (training {tp.short()}, rollout {e.precision.short()})",
            (),
            (),
            "always",
        )
    return res


def _add_to_group(groups: dict[tuple, dict], res: tuple, e: Edge, tp: Precision) -> None:
    """Add edge `e` to the group of its (reason, keys), created on first use."""
    g = groups.setdefault(
        (res[0], res[1]),
        {"res": res, "edges": [], "layers": {}, "ops": {}, "pairs": {}, "tr": (tp, e.precision)},
    )
    g["pairs"][(e.role, tp, e.precision)] = None
    g["edges"].append(f"{e.op}:{e.role}")
    if e.layer is not None:
        g["layers"][e.layer] = None
    g["ops"][f"{e.group} {e.role}"] = None


def _group_mismatch(g: dict) -> Mismatch:
    """The `Mismatch` of one group of edges."""
    return Mismatch(
        reason=g["res"][0],
        keys=tuple(g["res"][1]),
        fixes=tuple(g["res"][2]),
        train=g["tr"][0],
        rollout=g["tr"][1],
        edges=tuple(g["edges"]),
        layers=tuple(sorted(g["layers"])),
        operands=tuple(g["ops"]),
        severity=g["res"][3],
        pairs=tuple(g["pairs"]),
    )


def format_ranges(xs: Sequence[int]) -> str:
    """[0,1,2,5,7,8] -> "0-2, 5, 7-8"."""
    xs = sorted(xs)
    if not xs:
        return "-"
    parts, start, prev = [], xs[0], xs[0]
    for x in [*xs[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(parts)


def generic_layers_for(recipe: Recipe) -> int:
    """Enough generic layers to show every side's BF16 first/last layers and one more."""
    return max(
        2,
        recipe.train.bf16_first_layers + recipe.train.bf16_last_layers + 1,
        recipe.rollout.bf16_first_layers + recipe.rollout.bf16_last_layers + 1,
    )
