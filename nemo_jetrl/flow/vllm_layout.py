"""Whether vLLM's tensor parallelism keeps the rollout's FP8 blocks those of the HF weights, from
the model's shape and ``policy.generation.vllm_cfg.tensor_parallel_size``, before anything runs.

The refit quantizes each *full* HF weight in 128x128 blocks and vLLM's loaders cut the codes and
the ``weight_scale_inv`` for each rank (`vllm_patch.dense_shards`). A rank's blocks are the HF
weight's only where its part starts and ends on 128-block edges; a row-parallel rank also
quantizes its slice of the activations from its own column 0, so there the input split must be a
multiple of 128 too, or the rank forms 1x128 blocks training never forms. What vLLM does with a
part off a block edge (read in 0.20.0, 0.25.1 and 0.32.0 ``linear.py`` / ``fp8_utils.py``):

- row-parallel (o_proj, down_proj, out_proj) and plain column-parallel (MLA's q_b_proj,
  kv_b_proj, q_proj; Qwen3-Next's in_proj_qkvz): ``validate_fp8_block_shape`` refuses the engine;
- fused column-parallel layers (q/k/v, gate/up, Qwen3.5's in_proj_qkv/in_proj_z): accepted
  silently (``_maybe_allow_fp8_block_shape_mismatch``), the scales then cut in ceil-sized blocks
  (``adjust_block_scale_shard``): our refit refuses the tensor by name while parity is on; with
  parity off vLLM's loader fails or loads another block's scales.

k/v with fewer KV heads than ranks are replicated (each rank holds one head: ``head_dim`` rows),
so head_dim 64 models (Llama-3.2-1B at TP 8) have a 64-row k/v part. Routed experts are judged in
`flow.support` (`_split_gaps`); linears vLLM replicates (MLA's q_a_proj, kv_a_proj_with_mqa), the
ones the rollout keeps BF16 by name, and those no recipe runs FP8 are not split-sensitive.
"""

from __future__ import annotations

from nemo_jetrl.arch import ModelArch
from nemo_jetrl.arch.linear import VLLM_REPLICATED, VLLM_ROW_PARALLEL, Linear
from nemo_jetrl.config import Settings
from nemo_jetrl.config.schema import VLLM_TP
from nemo_jetrl.fp8.spec import BLOCK
from nemo_jetrl.recipe import Recipe

# Column-parallel layers vLLM fuses from several HF tensors (it accepts their shards off a block).
VLLM_FUSED_COLUMN = frozenset(
    {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z"}
)


def rank_parts(arch: ModelArch, lin: Linear, tp: int) -> list[int] | None:
    """The widths of the parts of ``lin`` one of ``tp`` vLLM ranks holds along its split dim
    (input columns of a row-parallel linear, output rows otherwise); None: vLLM cannot split it
    evenly (a dim, or the KV heads, not divisible by ``tp``: vLLM refuses the engine itself)."""
    hybrid = arch.hybrid
    if lin.kind in ("k_proj", "v_proj") and arch.mla is None:
        kv = arch.num_kv_heads
        if kv >= tp and kv % tp:
            return None
        return [max(kv // tp, 1) * (lin.out_features // kv)]  # replicated below one head a rank
    if lin.kind == "in_proj_qkv" and hybrid is not None:  # three outputs, each cut per rank
        kd = hybrid.num_k_heads * hybrid.k_head_dim
        vd = hybrid.num_v_heads * hybrid.v_head_dim
        sizes = [kd, kd, vd]
    else:
        sizes = [lin.in_features if lin.kind in VLLM_ROW_PARALLEL else lin.out_features]
    if any(s % tp for s in sizes):
        return None
    return [s // tp for s in sizes]


def split_problem(arch: ModelArch, lin: Linear, tp: int) -> str | None:
    """Why vLLM's ``tensor_parallel_size=tp`` gives ``lin`` (run FP8 in the rollout) blocks that
    are not the HF weight's (None: every rank's part is on 128-block edges)."""
    if tp <= 1 or lin.kind in VLLM_REPLICATED or lin.group == "experts":
        return None
    parts = rank_parts(arch, lin, tp)
    row = lin.kind in VLLM_ROW_PARALLEL
    what = "input columns" if row else "output rows"
    if parts is None:
        return f"{lin.name}: does not split evenly over {tp} ranks (vLLM refuses the engine)"
    if all(p % BLOCK == 0 for p in parts):
        return None
    shown = " + ".join(str(p) for p in parts)
    if row:
        then = (
            "vLLM refuses the engine (input_size_per_partition not a multiple of block_k), "
            "and a rank would quantize activation blocks training never forms"
        )
    elif lin.kind in VLLM_FUSED_COLUMN and not (arch.mla is not None and lin.kind == "q_proj"):
        then = (
            "vLLM accepts the fused layer and cuts its scales in ceil-sized blocks: the refit "
            "refuses it (parity on), or vLLM's loader fails or loads other blocks' scales"
        )
    else:
        then = "vLLM refuses the engine (output_partition_size not a multiple of block_n)"
    return f"{lin.name}: {shown} {what} a rank, not a multiple of {BLOCK}: {then}"


def _fitting(arch: ModelArch, lins: list[Linear], tp: int) -> list[int]:
    """Smaller tensor-parallel sizes dividing ``tp`` under which none of ``lins`` is split off
    a block edge."""
    return [
        t
        for t in range(tp - 1, 0, -1)
        if tp % t == 0 and not any(split_problem(arch, x, t) for x in lins)
    ]


def vllm_split_problems(arch: ModelArch | None, recipe: Recipe, tp: int) -> list[str]:
    """`split_problem` of every distinct decoder linear the rollout runs FP8 (empty: none)."""
    if arch is None or tp <= 1 or not recipe.rollout.fp8_linears:
        return []
    out = []
    for lin in arch.distinct_linears():
        if lin.bf16_why is not None or recipe.rollout.keeps_bf16(lin.name):
            continue
        if (why := split_problem(arch, lin, tp)) is not None:
            out.append(why)
    return out


def vllm_block_problem(arch: ModelArch | None, settings: Settings, recipe: Recipe) -> str | None:
    """Why the FP8 rollout's blocks at the config's vLLM ``tensor_parallel_size`` are not the
    HF weights' (None: they are, the rollout is BF16, or no model shape is known); the reason
    names the key and what to set."""
    tp = settings.moe.vllm_tp
    problems = vllm_split_problems(arch, recipe, tp)
    if not problems or arch is None:
        return None
    bad = [x for x in arch.distinct_linears() if any(p.startswith(f"{x.name}:") for p in problems)]
    fits = _fitting(arch, bad, tp)
    fix = f"set {VLLM_TP}={fits[0]}" if fits else f"lower {VLLM_TP}"
    return (
        f"{VLLM_TP}={tp} splits FP8 linears of {arch.name} off 128-block edges, so the "
        f"rollout's FP8 blocks are not the HF weights' (training's): "
        + "; ".join(problems)
        + f". Fix: {fix}, or keep these linears BF16 on both sides by name"
    )
