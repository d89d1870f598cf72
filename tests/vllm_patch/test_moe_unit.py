"""Our experts kernel and the guard's MoE rules without vLLM (vllm_patch/experts.py, guard.py).

The engine half (a real tiny Qwen3-MoE served by vLLM under the patch) is test_vllm_moe.py.
"""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.fp8.gemm_backends import run_gemm
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.vllm_patch import settings_from_recipe
from nemo_jetrl.vllm_patch.experts import experts_forward
from nemo_jetrl.vllm_patch.guard import kernel_problems
from nemo_jetrl.vllm_patch.kernel import ensure_ops

E, H, INTER, TOPK, M = 4, 256, 128, 2, 9


def _weights(seed: int, pow2: bool = True):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.05
    w2 = torch.randn(E, H, INTER, generator=g) * 0.05
    q13 = [quantize_blockwise(w13[e], (128, 128), pow2_scales=pow2) for e in range(E)]
    q2 = [quantize_blockwise(w2[e], (128, 128), pow2_scales=pow2) for e in range(E)]
    return q13, q2


def _dense(x: torch.Tensor, qw) -> torch.Tensor:
    """One expert projection as the dense linear kernel computes it (kernel.py)."""
    qx = quantize_blockwise(x, (1, 128), pow2_scales=True, check_finite=False)
    return run_gemm("reference", qx, qw, x.dtype)


@pytest.mark.parametrize("w_pow2", [True, False], ids=["grouped", "mixed-scales-loop"])
def test_experts_bit_exact_to_the_dense_path_per_expert(w_pow2):
    """Every token's output is the dense kernel's gate/up and down GEMMs on its experts, summed
    with its routing weights; expert 3 gets no token (skipped), token order scrambled. Same
    scale modes run nemo_jetrl.fp8.experts; FP32 weight scales with pow2 activations the loop."""
    q13, q2 = _weights(0, w_pow2)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(M, H, generator=g) * 2).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [2, 1], [1, 0], [0, 1], [2, 0], [1, 2]])
    wts = torch.rand(M, TOPK, generator=g)
    w13 = torch.stack([q.data for q in q13])
    s13 = torch.stack([q.scale_inv for q in q13])
    w2 = torch.stack([q.data for q in q2])
    s2 = torch.stack([q.scale_inv for q in q2])
    got = experts_forward(
        ensure_ops(), x, w13, s13, w2, s2, wts, ids,
        pow2=True, w_pow2=w_pow2, eps=0.0, backend="reference",
    )  # fmt: skip
    want = torch.zeros(M, H, dtype=torch.float32)
    for t in range(M):
        for j in range(TOPK):
            e = int(ids[t, j])
            gate, up = _dense(x[t : t + 1], q13[e]).split(INTER, dim=-1)
            y = _dense(torch.nn.functional.silu(gate) * up, q2[e])
            want[t] += y[0].float() * wts[t, j]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.to(torch.bfloat16))
    # The weights matter: another expert's weights change the output.
    bad = experts_forward(
        ensure_ops(), x, w13.flip(0), s13.flip(0), w2, s2, wts, ids,
        pow2=True, w_pow2=w_pow2, eps=0.0, backend="reference",
    )  # fmt: skip
    assert not torch.equal(bad, got)


def _report(layers: dict) -> dict:
    return {"layers": layers, "registered": True, "env": {}}


def test_guard_refuses_vllm_expert_kernels_and_fp8_routers():
    settings = settings_from_recipe(Recipe.preset("jetrl"))
    ours = {"kernel": "JetRLFp8MoEMethod", "ours": True, "settings": settings.to_json()}
    dense = {"kernel": "JetRLFp8BlockLinearKernel", "ours": True, "settings": settings.to_json()}
    good = {"model.layers.1.mlp.experts": ours, "model.layers.0.mlp.down_proj": dense}
    assert kernel_problems([_report(good)], settings, "K") == []
    vllm_own = dict(good)
    vllm_own["model.layers.1.mlp.experts"] = {
        "kernel": "Fp8MoEMethod with CPUExpertsFp8",
        "ours": False,
        "settings": None,
    }
    (problem,) = kernel_problems([_report(vllm_own)], settings, "K")
    assert "Fp8MoEMethod with CPUExpertsFp8" in problem and "mlp.experts" in problem
    router = dict(good)
    router["model.layers.1.mlp.gate"] = dense  # ours, but a router must not be FP8
    (problem,) = kernel_problems([_report(router)], settings, "K")
    assert "router must stay BF16" in problem and "model.layers.1.mlp.gate" in problem


@pytest.mark.parametrize("name", ["model.layers.1.mlp.gate.weight", "lm_head.weight"])
def test_refit_keeps_routers_bf16(name):
    from nemo_jetrl.vllm_patch.refit import is_fp8_weight

    settings = settings_from_recipe(Recipe.preset("jetrl"))
    assert not is_fp8_weight(name, settings)
    assert is_fp8_weight("model.layers.1.mlp.experts.7.down_proj.weight", settings)


def test_own_routing_softmax_topk_and_refusals():
    """vLLM 0.20's monolithic path routes with route_softmax_topk: softmax in fp32, top-k,
    renormalized; routings it does not implement are refused by name."""
    from types import SimpleNamespace

    from nemo_jetrl.vllm_patch.experts import route_softmax_topk

    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]], dtype=torch.bfloat16)
    layer = SimpleNamespace(top_k=2, renormalize=True)
    w, ids = route_softmax_topk(layer, logits)
    assert ids.dtype == torch.int32 and ids.tolist() == [[1, 2], [0, 3]]
    p = torch.softmax(logits.float(), -1)
    assert torch.equal(w[0], p[0, [1, 2]] / p[0, [1, 2]].sum())
    layer.renormalize = False
    assert torch.equal(route_softmax_topk(layer, logits)[0][1], p[1, [0, 3]])
    grouped = SimpleNamespace(top_k=2, renormalize=True, use_grouped_topk=True)
    with pytest.raises(NotImplementedError, match="use_grouped_topk=True"):
        route_softmax_topk(grouped, logits)
    sigmoid = SimpleNamespace(top_k=2, renormalize=True, scoring_func="sigmoid")
    with pytest.raises(NotImplementedError, match="scoring_func='sigmoid'"):
        route_softmax_topk(sigmoid, logits)


def test_router_modules_from_config(tmp_path):
    import json

    from nemo_jetrl.vllm_patch.moe_names import router_modules

    cfg = dict(
        model_type="qwen3_moe", vocab_size=128, hidden_size=256, intermediate_size=256,
        moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
        decoder_sparse_step=1, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert router_modules(tmp_path) == ("model.layers.1.mlp.gate", "model.layers.2.mlp.gate")
    dense = {k: v for k, v in cfg.items() if "expert" not in k and k != "model_type"}
    (tmp_path / "config.json").write_text(json.dumps(dict(dense, model_type="llama")))
    assert router_modules(tmp_path) == ()


def test_experts_match_the_grouped_expert_linear_bit_for_bit():
    """nemo_jetrl.fp8.experts (the trainer's grouped expert linear, inference twin) gives the
    serving kernel's bits on the same routed rows: the kernel can switch to it without moving
    a bit (CPU; pow2 scales)."""
    from nemo_jetrl.fp8.config import Fp8LinearConfig
    from nemo_jetrl.fp8.experts import grouped_fp8_linear_inference
    from nemo_jetrl.fp8.grouped_tensors import GroupedQuantizedWeights

    q13, q2 = _weights(2)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(M, H, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, E, (M, TOPK), generator=g)
    ids[:, 1] = (ids[:, 0] + 1) % E
    wts = torch.rand(M, TOPK, generator=g)
    w13 = torch.stack([q.data for q in q13])
    s13 = torch.stack([q.scale_inv for q in q13])
    w2 = torch.stack([q.data for q in q2])
    s2 = torch.stack([q.scale_inv for q in q2])
    got = experts_forward(
        ensure_ops(), x, w13, s13, w2, s2, wts, ids,
        pow2=True, w_pow2=True, eps=0.0, backend="reference",
    )  # fmt: skip
    cfg = Fp8LinearConfig(pow2_scales=True)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = torch.arange(M).repeat_interleave(TOPK)[order]
    offsets = torch.zeros(E + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=E), 0)
    g13 = GroupedQuantizedWeights(w13, s13, "e4m3", True)
    g2 = GroupedQuantizedWeights(w2, s2, "e4m3", True)
    gate, up = grouped_fp8_linear_inference(x[token], g13, offsets, cfg, "w13").split(INTER, -1)
    y = grouped_fp8_linear_inference(torch.nn.functional.silu(gate) * up, g2, offsets, cfg, "w2")
    want = torch.zeros(M, H, dtype=torch.float32)
    want.index_add_(0, token, y.float() * wts.reshape(-1)[order, None])
    assert torch.equal(got, want.to(torch.bfloat16))


def test_a_routing_our_kernel_cannot_compute_is_refused_when_vllm_builds_the_layer():
    """vLLM < 0.32 (NeMo-RL's 0.20 / 0.25): our method routes tokens itself; DeepSeek's
    routing (grouped top-k, sigmoid scores, bias, scaling) is refused when the layer is built,
    naming it, not at the engine's first forward. vLLM's own router (0.32) takes any."""
    from types import SimpleNamespace

    from nemo_jetrl.vllm_patch.experts import _unsupported

    moe = SimpleNamespace(intermediate_size_per_partition=128, has_bias=False, activation="silu")
    qc = SimpleNamespace(weight_block_size=[128, 128], activation_scheme="dynamic")
    deepseek = SimpleNamespace(
        moe_config=moe, use_grouped_topk=True, scoring_func="sigmoid", routed_scaling_factor=2.5
    )
    (why,) = _unsupported(qc, deepseek, own_routing=True)
    assert why.startswith("routing with use_grouped_topk=True, scoring_func='sigmoid', ")
    assert "routed_scaling_factor=2.5" in why
    assert _unsupported(qc, deepseek, own_routing=False) == []
    qwen = SimpleNamespace(moe_config=moe, scoring_func="softmax")  # the control
    assert _unsupported(qc, qwen, own_routing=True) == []
