"""TEST STAND-IN for a vLLM engine's MoE model, where a real one cannot start here: vLLM's CPU
builds have no block-FP8 MoE kernel on this CPU ("Unsupported FP8 MoE backend: NONE", issue 28)
until nemo_jetrl's experts kernel lands.

What it stands in for, and how closely:
* the fused expert parameters of vLLM's ``FusedMoE`` (0.20) / ``RoutedExperts`` (0.25+):
  ``w13_weight`` [E, 2I, H] (gate rows then up rows), ``w2_weight`` [E, H, I] and, when FP8, their
  ``*_weight_scale_inv`` [E, rows/128, cols/128]; a BF16 router ``mlp.gate`` and the rest dense;
* the model's ``load_weights``: names routed with vLLM's own
  ``FusedMoE.make_expert_params_mapping`` when vLLM is importable (else the same table written
  out), shards copied into their rows as ``FusedMoE.weight_loader`` does for a TP=1 engine;
  grouped BF16 slabs (``experts.gate_up_proj`` / ``experts.down_proj``) copied whole.
* the vLLM worker: ``model_runner.model`` and the configs the hook reads (TP 1, KV "auto").
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


class Experts(torch.nn.Module):
    def __init__(self, e: int, hidden: int, inter: int, fp8: bool) -> None:
        super().__init__()
        dt = torch.float8_e4m3fn if fp8 else torch.bfloat16

        def p(*shape: int, dtype: torch.dtype = dt) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.w13_weight = p(e, 2 * inter, hidden)
        self.w2_weight = p(e, hidden, inter)
        if fp8:
            self.w13_weight_scale_inv = p(e, 2 * inter // 128, hidden // 128, dtype=torch.float32)
            self.w2_weight_scale_inv = p(e, hidden // 128, inter // 128, dtype=torch.float32)
        self.num_experts = e


class Mlp(torch.nn.Module):
    def __init__(self, e: int, hidden: int, inter: int, fp8: bool) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(hidden, e, bias=False, dtype=torch.bfloat16)
        self.experts = Experts(e, hidden, inter, fp8)


class Layer(torch.nn.Module):
    def __init__(self, e: int, hidden: int, inter: int, fp8: bool) -> None:
        super().__init__()
        self.mlp = Mlp(e, hidden, inter, fp8)


def _mapping(model: torch.nn.Module, e: int) -> list[tuple[str, str, int, str]]:
    try:
        from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    except ImportError:
        FusedMoE = None
    # vLLM 0.25 made FusedMoE a factory function (the mapping moved to RoutedExperts, with other
    # parameter prefixes): this stand-in keeps 0.20/0.32's names and writes their table out.
    if not hasattr(FusedMoE, "make_expert_params_mapping"):
        # the same table vLLM builds (param prefix, ckpt prefix, expert, shard)
        return [
            ("experts.w13_" if w != "down_proj" else "experts.w2_", f"experts.{i}.{w}.", i, s)
            for i in range(e)
            for s, w in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))
        ]
    return FusedMoE.make_expert_params_mapping(model, "gate_proj", "down_proj", "up_proj", e)


class MoeModel(torch.nn.Module):
    """``model.layers.{i}.mlp.{gate,experts}`` plus an embedding, like vLLM's Qwen3-MoE tree."""

    def __init__(self, layers: int = 2, e: int = 4, hidden: int = 256, inter: int = 128,
                 fp8: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(64, hidden, dtype=torch.bfloat16)
        self.model.layers = torch.nn.ModuleList(Layer(e, hidden, inter, fp8) for _ in range(layers))
        self.e = e
        self.packed_modules_mapping: dict = {}
        self.loaded: list[list[str]] = []

    def load_weights(self, weights) -> set[str]:
        weights = list(weights)
        self.loaded.append([k for k, _ in weights])
        params = dict(self.named_parameters())
        mapping = _mapping(self, self.e)
        done = set()
        with torch.no_grad():
            for name, t in weights:
                for param_prefix, ckpt_prefix, expert, shard in mapping:
                    if ckpt_prefix not in name:
                        continue
                    target = params[name.replace(ckpt_prefix, param_prefix)]
                    rows = target.shape[1] // 2 if shard != "w2" else target.shape[1]
                    start = rows if shard == "w3" else 0
                    target[expert, start : start + rows].copy_(t)
                    break
                else:
                    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                        w = "w13_weight" if name.endswith("gate_up_proj") else "w2_weight"
                        params[f"{name.rpartition('.')[0]}.{w}"].copy_(t)
                    else:
                        params[name].copy_(t)
                done.add(name)
        return done


def worker(model: torch.nn.Module) -> SimpleNamespace:
    """The pieces of a vLLM worker (TP 1) the NeMo-RL refit hook reads."""
    return SimpleNamespace(
        model_runner=SimpleNamespace(model=model),
        vllm_config=SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            cache_config=SimpleNamespace(cache_dtype="auto"),
        ),
    )


def trainer_weights(model: MoeModel, seed: int, grouped: bool = False) -> dict[str, torch.Tensor]:
    """BF16 HF weights for ``model`` (per-expert names, or main's grouped slabs)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(64, 256, generator=g).to(torch.bfloat16)
    }
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        e, two_i, h = ex.w13_weight.shape
        pre = f"model.layers.{i}.mlp"
        out[f"{pre}.gate.weight"] = torch.randn(e, h, generator=g).to(torch.bfloat16)
        gu = (torch.randn(e, two_i, h, generator=g) * 0.05).to(torch.bfloat16)
        down = (torch.randn(e, h, two_i // 2, generator=g) * 0.05).to(torch.bfloat16)
        if grouped:
            out[f"{pre}.experts.gate_up_proj"], out[f"{pre}.experts.down_proj"] = gu, down
            continue
        for x in range(e):
            out[f"{pre}.experts.{x}.gate_proj.weight"] = gu[x, : two_i // 2].clone()
            out[f"{pre}.experts.{x}.up_proj.weight"] = gu[x, two_i // 2 :].clone()
            out[f"{pre}.experts.{x}.down_proj.weight"] = down[x].clone()
    return out
