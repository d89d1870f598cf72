"""CPU checks of benchmarks/gpu/bench_moe_layer.py (issue 48 point 3): the catalog's MoE shapes,
the bitwise rollout-equals-training check and its routed layer against a float64 reference, and
run_row's rows, JSON record and bar with timing stubbed. Its issue-48 tiles and prefill target:
test_bench_moe_prefill_cpu.py; its issue-35 target line: test_bench_moe_target_cpu.py.
"""

from __future__ import annotations

import json

import torch
from gpu_bench_fixtures import bench_fixture  # noqa: F401  (the `bench` fixture)

MOE_TINY = dict(hidden=256, inter=128, experts=8, top_k=2)


def test_moe_layer_shapes_come_from_the_catalog(bench):
    module = bench("bench_moe_layer")
    got = {m: module.moe_shape(m) for m in module.MODELS}
    assert [(s.hidden, s.inter, s.experts, s.top_k) for s in got.values()] == [
        (2048, 768, 128, 8),  # Qwen3-30B-A3B
        (2048, 1408, 64, 6),  # Moonlight-16B-A3B
        (7168, 2048, 256, 8),  # DeepSeek-V3
    ]
    args = module.build_parser().parse_args([])
    assert args.models == list(module.MODELS) and args.tokens == [64, 256, 2048, 8192]
    assert module.BAR_MODEL == "Qwen/Qwen3-30B-A3B" and module.BAR_SPEEDUP == 1.30


def test_moe_layer_rollout_equals_training_forward_on_cpu(bench, monkeypatch):
    """The script's bitwise check passes on the torch reference, fails on one flipped weight
    byte, and its routed layer (sort, gate_up, SiLU-mul, down, combine) is the MoE layer."""
    monkeypatch.delenv("JETRL_FP8_GROUPED_BACKEND", raising=False)
    module = bench("bench_moe_layer")
    shape = module.MoeShape("tiny", **MOE_TINY)
    layer = module.make_layer(shape, "cpu", 0, True)
    x = torch.randn(24, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    w, ids = module.route(x, layer["router"], shape.top_k)
    assert module.bitwise_check(x, layer, w, ids)["bitwise_equal"]
    data, e0 = layer["q13"].data, int(ids[0, 0])
    saved = data[e0].clone()
    data[e0] = data[(e0 + 1) % shape.experts]  # the first token's rollout expert is not trained
    check = module.bitwise_check(x, layer, w, ids)
    assert not check["bitwise_equal"] and check["differing"] > 0
    data[e0] = saved
    # float64 per-token MoE on the BF16 masters vs the script's BF16 grouped reference.
    w13, w2 = layer["w13"].double(), layer["w2"].double()
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(shape.top_k):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t].double()).chunk(2)
            ref[t] += float(w[t, j]) * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    bf16, impl = module.bf16_torch_fn(x, layer, w, ids)
    assert impl == "torch._grouped_mm" and module.rel_err(bf16(), ref) < 0.02
    with monkeypatch.context() as mp:
        mp.delattr(torch, "_grouped_mm")
        loop, impl = module.bf16_torch_fn(x, layer, w, ids)
        assert impl.startswith(module.LOOP) and module.rel_err(loop(), ref) < 0.02
    assert module.rel_err(module.ours_fn(x, layer, w, ids)(), ref) < 0.15  # FP8, two GEMMs


def test_moe_layer_rows_and_record_format(bench, monkeypatch):
    """run_row's plumbing with bench_ms stubbed (each fn run once, a fixed 1.0 returned: no
    timing is claimed), vLLM rows skipped with the reason, the JSON record, the bar logic."""
    monkeypatch.delenv("JETRL_FP8_GROUPED_BACKEND", raising=False)
    module = bench("bench_moe_layer")

    def stub(fn, **_kw):
        fn()
        return 1.0

    monkeypatch.setattr(module._common, "bench_ms", stub)
    monkeypatch.setattr(module, "vllm_fn", lambda *a: (None, "no vLLM in this test"))
    shape = module.MoeShape(module.BAR_MODEL, **MOE_TINY)
    layer = module.make_layer(shape, "cpu", 0, True)
    args = module.build_parser().parse_args(["--tokens", "8", "--json", "r.json"])
    skipped: list[str] = []
    row = module.run_row(shape, layer, 8, args, skipped)
    assert set(module.COLUMNS) <= set(row) and row["bitwise_equal"] and row["mode"] == "graph"
    assert row["vllm_fp8_ms"] is None and row["bf16_vllm_ms"] is None and len(skipped) == 2
    assert row["speedup"] == 1.0 and row["bar"] == "NOT MET" and row["routed_rows"] == 16
    rec = json.loads(json.dumps(module.record([row], "cpu", args, skipped)))
    assert rec["rows"][0]["model"] == "Qwen3-30B-A3B" and rec["args"]["json"] == "r.json"
    assert "NOT MET (8 tokens 1.00x)" in rec["bar"]["summary"]
    times = {"ours_ms": 1.0, "vllm_fp8_ms": 1.2, "bf16_vllm_ms": 1.5, "bf16_torch_ms": 9.0}
    met = module.make_row(shape, 64, times, {}, {"bitwise_equal": True}, "graph", "x")
    assert met["speedup"] == 1.5 and met["bar"] == "MET" and met["ours_vs_vllm_fp8"] == 1.2
    assert module.bar_summary([met]).endswith("MET on every row")
    other = module.make_row(module.MoeShape("m/other", **MOE_TINY), 64, times, {}, {}, "", "")
    assert other["bar"] == "-" and "NOT MEASURED" in module.bar_summary([other])
