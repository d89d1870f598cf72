"""Where TE's 128x128 weight blocks in Megatron's training forward are not the rollout's blocks.

The rollout quantizes each HuggingFace weight on its own (``q_proj``, ``k_proj``, ``gate_proj``
... in 128x128 blocks from row 0; `export.export_hf`), and vLLM slices those blocks over its
tensor-parallel ranks. Megatron-Core's TE linears quantize *their own* weight tensor, which is
neither: each tensor-parallel rank holds a local shard (``TEColumnParallelLinear``: rows split;
``TERowParallelLinear``: columns split), and fused linears interleave several HF weights:

- ``self_attention.linear_qkv``: per KV group ``[q heads | k | v]``, ``head_dim`` rows per head
  (with ``attention_output_gate``, Qwen3-Next / Qwen3.5: ``[q heads | gate heads | k | v]``, where
  HF's ``q_proj`` holds ``[q; gate]`` per head); the weight is cut in TP equal row ranges, so a
  rank holds ``num_query_groups / TP`` whole groups, or part of one group when there are fewer
  groups than ranks;
- ``mlp.linear_fc1`` (SwiGLU), shared experts and every grouped-GEMM expert: a rank holds
  ``[gate rows of the rank; up rows of the rank]``, ``ffn / TP`` rows each;
- the gated delta net's ``self_attention.in_proj`` (the layers ``linear_attention_freq`` marks):
  one GEMM of Qwen3.5's in_proj_qkv/z/b/a or Qwen3-Next's in_proj_qkvz/ba, laid out per rank as
  `blocks_hybrid` says (its ``conv1d`` is a torch convolution, BF16: not judged);
- row-parallel ``linear_proj`` / ``linear_fc2`` / the gated delta net's ``out_proj``: a rank
  holds ``K / TP`` input columns, and its activations are quantized 1x128 along those only.

TE (``Float8BlockQuantizer``, ``w_block_scaling_dim=2``) starts its 128-row blocks at row 0 of
the local tensor. Unless every HF-weight boundary and every shard edge is a multiple of 128, a
training block holds rows of two HF weights (K and V of a group when ``head_dim`` is 64), or
rows another block holds in the rollout: its amax, so its scale and FP8 codes, differ, and the
trained weights are not the sampled ones (FP32 scales: almost always; power-of-two scales:
whenever the two amaxes fall in different binades). The same holds for the 1x128 activation
blocks along a row-parallel shard that is not a multiple of 128 wide.

`block_layout_problems` lists those linears from a Megatron ``TransformerConfig`` (full model
dims and ``tensor_model_parallel_size``), leaving out linears the training side keeps BF16 by
name in every FP8 layer (``jetrl.train_bf16_layer_kws``; routed and shared experts cannot be).
Not judged from a TransformerConfig alone: which HF weights a gated delta net's in_proj is
(Qwen3.5's or Qwen3-Next's: no config field says). `flow.megatron_layout` passes that as
``hf_in_proj_split`` from the HF config, and the policy worker (its real config) from the
driver's (`with_hf_split`); without it in_proj is named only where both splits give training
blocks the rollout does not have, and left unjudged where they differ (at TP 1 Qwen3.5's b and
a rows share a block, Qwen3-Next's are all of in_proj_ba's one block).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_jetrl.arch.hybrid import IN_PROJ_WORD
from nemo_jetrl.fp8.spec import BLOCK
from nemo_jetrl.megatron.blocks_hybrid import GdnShape, hf_parts, in_proj_problem
from nemo_jetrl.recipe_parts import SideRecipe

FP8_PARAM_KEY = "policy.megatron_cfg.fp8_cfg.fp8_param"
TP_KEY = "tensor_model_parallel_size"
GDN_VARIANT = "gated_delta_net"  # TransformerConfig.experimental_attention_variant
HF_SPLIT_FIELD = "hf_in_proj_split"
"""Not a TransformerConfig field: True for Qwen3.5's in_proj_qkv/z/b/a, False for Qwen3-Next's
in_proj_qkvz/ba (`flow.megatron_layout` sets it; absent: unknown)."""
Problem = tuple[str, str, tuple[str, ...]]
"""(where, why, HF words keeping it BF16 by name)."""


def _int(config: Any, name: str, default: int = 0) -> int:
    value = getattr(config, name, None)
    return default if value is None else int(value)


def _mlp_problems(
    what: str, hf: str, ffn: int, tp: int, gated: bool, tp_key: str
) -> list[tuple[str, str]]:
    """fc1 ([gate; up] per rank) and fc2 (ffn / TP input columns) of one MLP kind."""
    if ffn <= 0 or ffn % tp:
        return []
    local = ffn // tp
    out = []
    if local % BLOCK and (gated or tp > 1):
        edge = "the gate/up boundary" if gated else "the shard edges"
        out.append(
            (
                f"{what}.linear_fc1 ({hf}.gate_proj/up_proj)",
                f"{ffn} rows per projection / {tp_key}={tp} = {local} rows per rank: "
                f"{edge} of each rank's [gate; up] weight fall inside TE's 128-row blocks",
            )
        )
    if local % BLOCK and tp > 1:
        out.append(
            (
                f"{what}.linear_fc2 ({hf}.down_proj)",
                f"{ffn} input columns / {tp_key}={tp} = {local} per rank: TE's 1x128 "
                "activation blocks and 128x128 weight blocks stop at each rank's edge",
            )
        )
    return out


def _sharded(block: str, name: str, hf: str, dim: str, size: int, tp: int) -> list[Problem]:
    """A linear whose ``size`` rows or input columns TP ranks split evenly (`hf`: its HF name
    under ``block``): named where a rank's part is not a multiple of 128."""
    local = size // tp
    if tp <= 1 or local % BLOCK == 0:
        return []
    return [
        (
            f"self_attention.{name} ({block}.{hf})",
            f"{size} {dim} / {TP_KEY}={tp} = {local} per rank: TE's blocks stop at each rank's "
            "edge, inside the rollout's 128-blocks",
            (f"{block}.{hf}",),
        )
    ]


def _qkv_problems(config: Any, heads: int, hd: int, tp: int) -> list[Problem]:
    """The fused ``linear_qkv`` (with the output gate's rows when ``attention_output_gate``)."""
    groups = _int(config, "num_query_groups") or heads
    gate = bool(getattr(config, "attention_output_gate", False))
    where = "self_attention.linear_qkv (self_attn.q_proj/k_proj/v_proj)"
    words = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    if hd % BLOCK:
        layout, q = "[q heads | k | v]", "q_proj"
        if gate:
            layout, q = "[q heads | gate heads | k | v]", "q_proj ([q; gate] per head)"
        why = (
            f"head_dim={hd}: the fused weight interleaves {layout} per KV group, so TE's "
            f"128-row blocks mix K and V (and Q{' and gate' if gate else ''}) rows, where the "
            f"rollout quantizes {q}, k_proj and v_proj each on its own"
        )
        return [(where, why, words)]
    rows = (heads * (2 if gate else 1) + 2 * groups) * hd
    local = rows // tp
    if tp <= 1 or rows % tp or local % BLOCK == 0:
        return []  # whole groups a rank (or a split Megatron refuses itself)
    why = (
        f"{rows} rows / {TP_KEY}={tp} = {local} per rank with num_query_groups={groups}: a rank "
        "holds part of a KV group, and its edges fall inside the rollout's blocks of q_proj"
        f"{' ([q; gate] per head)' if gate else ''}, k_proj or v_proj"
    )
    return [(where, why, words)]


def _attention_problems(config: Any, tp: int) -> list[Problem]:
    heads = _int(config, "num_attention_heads")
    if heads <= 0 or heads % tp:
        return []
    if getattr(config, "multi_latent_attention", False):
        q_head = _int(config, "qk_head_dim") + _int(config, "qk_pos_emb_head_dim")
        v_head = _int(config, "v_head_dim")
        q_name = "linear_q_up_proj" if getattr(config, "q_lora_rank", None) else "linear_q_proj"
        q_hf = "q_b_proj" if q_name == "linear_q_up_proj" else "q_proj"
        kv_rows = heads * (_int(config, "qk_head_dim") + v_head)
        return (
            _sharded("self_attn", q_name, q_hf, "rows", heads * q_head, tp)
            + _sharded("self_attn", "linear_kv_up_proj", "kv_b_proj", "rows", kv_rows, tp)
            + _sharded("self_attn", "linear_proj", "o_proj", "input columns", heads * v_head, tp)
        )
    hd = _int(config, "kv_channels") or _int(config, "hidden_size") // heads
    return _qkv_problems(config, heads, hd, tp) + _sharded(
        "self_attn", "linear_proj", "o_proj", "input columns", heads * hd, tp
    )


def _gdn_shape(config: Any) -> GdnShape | None:
    """The gated delta net's sizes, or None where Megatron builds none."""
    if getattr(config, "experimental_attention_variant", None) != GDN_VARIANT:
        return None
    fields = ("linear_num_key_heads", "linear_key_head_dim")
    fields += ("linear_num_value_heads", "linear_value_head_dim")
    shape = GdnShape(*(_int(config, f) for f in fields))
    if min(shape.num_k_heads, shape.k_head_dim, shape.num_v_heads, shape.v_head_dim) <= 0:
        return None
    return None if shape.num_v_heads % shape.num_k_heads else shape


def _gdn_problems(config: Any, tp: int) -> list[Problem]:
    """The gated delta net's in_proj (`blocks_hybrid`) and row-parallel out_proj."""
    shape = _gdn_shape(config)
    if shape is None or shape.num_k_heads % tp or shape.num_v_heads % tp:
        return []  # Megatron refuses such a split itself
    split = getattr(config, HF_SPLIT_FIELD, None)
    out: list[Problem] = []
    why = in_proj_problem(shape, tp, split, TP_KEY)
    if why is not None:
        names = "linear_attn." + ("in_proj_*" if split is None else "/".join(hf_parts(split)))
        out.append((f"self_attention.in_proj ({names})", why, (IN_PROJ_WORD,)))
    return out + _sharded("linear_attn", "out_proj", "out_proj", "input columns", shape.vd, tp)


def _linear_attention_layers(config: Any, num_layers: int) -> set[int]:
    """The layers Megatron builds with a gated delta net (``linear_attention_freq``: a 0/1 list
    per layer, 1 = linear attention, or an int N: all but every N-th layer); none without
    ``experimental_attention_variant="gated_delta_net"``."""
    if getattr(config, "experimental_attention_variant", None) != GDN_VARIANT:
        return set()
    freq = getattr(config, "linear_attention_freq", None)
    if isinstance(freq, (list, tuple)):
        return {i for i, f in enumerate(freq) if f}
    if freq is None:
        return set()
    return {i for i in range(num_layers) if (i + 1) % max(int(freq), 1)}


def _moe_layers(config: Any, num_layers: int) -> set[int]:
    """The layers Megatron builds with routed experts (``moe_layer_freq``: a 0/1 list per layer,
    or an int: every ``freq``-th layer from 0); none without ``num_moe_experts``."""
    if not getattr(config, "num_moe_experts", None):
        return set()
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, (list, tuple)):
        return {i for i, f in enumerate(freq) if f}
    return {i for i in range(num_layers) if i % max(int(freq), 1) == 0}


Found = tuple[str, str, tuple[str, ...], str | None]
"""(where, why, HF words keeping it BF16 by name (): experts, which cannot be), the parallel
size whose shards cut blocks (None: a fused boundary, whatever the parallel size))."""


def _found(config: Any, train: SideRecipe) -> list[Found]:
    """Every linear `block_layout_problems` names, judged over the layers where it runs FP8."""
    if not train.fp8_linears or train.scaling != "blockwise":
        return []
    n = _int(config, "num_layers")
    layers = train.fp8_layers(n)
    moe, linear = _moe_layers(config, n), _linear_attention_layers(config, n)
    dense_layers = [i for i in layers if i not in moe]
    tp = max(_int(config, TP_KEY, 1), 1)
    tp_key = TP_KEY

    def fp8_somewhere(hf: Sequence[str], among: Sequence[int]) -> bool:
        return any(not train.keeps_bf16(f"model.layers.{i}.{h}") for i in among for h in hf)

    def knob(why: str, key: str) -> str | None:
        return key if f"{key}=" in why else None

    # each token mixer in its own layers: full attention, the gated delta net (hybrid models)
    mixers = (
        (_attention_problems(config, tp), [i for i in layers if i not in linear]),
        (_gdn_problems(config, tp), [i for i in layers if i in linear]),
    )
    found: list[Found] = [
        (w, why, hf, knob(why, tp_key))
        for problems, among in mixers
        for w, why, hf in problems
        if fp8_somewhere(hf, among)
    ]
    gated = bool(getattr(config, "gated_linear_unit", False))
    dense = tuple(f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    if fp8_somewhere(dense, dense_layers):  # a dense MLP in some FP8 layer
        mlp = _mlp_problems("mlp", "mlp", _int(config, "ffn_hidden_size"), tp, gated, tp_key)
        found += [(w, why, dense, knob(why, tp_key)) for w, why in mlp]
    if moe and any(i in moe for i in layers):
        etp = max(_int(config, "expert_tensor_parallel_size", tp), 1)
        etp_key = "expert_tensor_parallel_size"
        moe_ffn = _int(config, "moe_ffn_hidden_size")
        experts = _mlp_problems("mlp.experts", "mlp.experts.<e>", moe_ffn, etp, gated, etp_key)
        found += [(w, why, (), knob(why, etp_key)) for w, why in experts]
        shared = _int(config, "moe_shared_expert_intermediate_size")
        shared_p = _mlp_problems(
            "mlp.shared_experts", "mlp.shared_expert(s)", shared, tp, gated, tp_key
        )
        found += [(w, why, (), knob(why, tp_key)) for w, why in shared_p]
    return found


def _fix(found: list[Found], train: SideRecipe) -> str:
    """The ways out of ``found``, each naming what to set."""
    words = tuple(dict.fromkeys(w for _, _, hf, _ in found for w in hf))
    knobs = tuple(dict.fromkeys(k for *_, k in found if k))
    ways = []
    if words:
        also = f" with {FP8_PARAM_KEY}=false" if train.fp8_param else ""
        ways.append(
            f"keep {list(words)} BF16 on both sides by name (jetrl.train_bf16_layer_kws and "
            f"policy.generation.vllm_cfg.quantization_ignored_layer_kws{also}; `jetrl align` "
            "writes them)"
        )
    if knobs:
        keys = " / ".join(f"policy.megatron_cfg.{k}" for k in knobs)
        ways.append(f"set {keys} so each rank's rows and columns are multiples of 128")
    ways.append("train this model in BF16")
    return ", or ".join(ways)


class _WithHfSplit:
    """``config`` as `block_layout_problems` reads it, with `HF_SPLIT_FIELD` added (the live
    model's TransformerConfig is read, never written)."""

    def __init__(self, config: Any, split: bool) -> None:
        self._config, self._split = config, split

    def __getattr__(self, name: str) -> Any:
        return self._split if name == HF_SPLIT_FIELD else getattr(self._config, name)


def with_hf_split(config: Any, split: bool | None) -> Any:
    """``config`` told which HF weights a gated delta net's in_proj is (`HF_SPLIT_FIELD`; the
    policy worker has it from the driver, `policy_env.hf_in_proj_split`); None: as it is."""
    return config if split is None else _WithHfSplit(config, split)


def block_layout_problems(config: Any, train: SideRecipe) -> list[str]:
    """Megatron linears whose TE blockwise FP8 blocks in training are not the HF weights'
    128x128 blocks the rollout uses (module docstring); [] when training is not blockwise FP8.
    ``config``: a Megatron ``TransformerConfig`` (or anything with its fields)."""
    return [f"{where}: {why}" for where, why, _, _ in _found(config, train)]


def block_layout_words(config: Any, train: SideRecipe) -> tuple[tuple[str, ...], bool]:
    """(the per-name BF16 words that keep every named dense linear BF16 on both sides, whether
    they settle all: routed and shared experts cannot be kept BF16 by name)."""
    found = _found(config, train)
    words = tuple(dict.fromkeys(w for _, _, hf, _ in found for w in hf))
    return words, all(hf for _, _, hf, _ in found)


def block_layout_problem(config: Any, train: SideRecipe) -> str | None:
    """`block_layout_problems` as one message naming the fix (None: training's blocks are the
    rollout's)."""
    found = _found(config, train)
    if not found:
        return None
    return (
        "TE's blockwise FP8 training blocks are not the rollout's for "
        + "; ".join(f"{where}: {why}" for where, why, _, _ in found)
        + f": the trained weights would not be the sampled ones; {_fix(found, train)}"
    )
