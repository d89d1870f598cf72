"""CPU sanity of benchmarks/gpu: every script imports, parses its defaults, refuses CPU clearly.

Catches syntax and API drift in scripts that only run on a GPU node; the refit/calibration
script also runs end to end on a tiny model on CPU (no timing claims).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
SCRIPTS = (
    "bench_quantizer_bandwidth",
    "bench_fp8_linear",
    "bench_vllm_generation",
    "bench_refit_calibration",
    "bench_moe_layer",
    "bench_serving_kernel",
    "bench_local_grpo",
    "bench_invariant_ops",
)


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))

    def load(name: str):
        return importlib.import_module(name)

    return load


def test_every_script_is_listed_and_documented():
    found = sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))
    assert found == sorted(SCRIPTS)
    readme = (BENCH_DIR / "README.md").read_text()
    for name in SCRIPTS:
        assert f"{name}.py" in readme, f"README.md does not describe {name}.py"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_parses_and_refuses_cpu(name, bench, capsys, monkeypatch):
    module = bench(name)
    assert module.__doc__ and callable(module.main)
    args = module.build_parser().parse_args([])
    assert vars(args)
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit) as exc:
        module.main([])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_fp8_linear_shapes_come_from_the_real_archs(bench):
    module = bench("bench_fp8_linear")
    llama = dict((n, (nn, k)) for n, nn, k in module.layer_shapes("meta-llama/Llama-3.1-8B"))
    assert llama == {
        "qkv_proj": (6144, 4096),
        "o_proj": (4096, 4096),
        "gate_up_proj": (28672, 4096),
        "down_proj": (4096, 14336),
    }
    qwen = dict((n, (nn, k)) for n, nn, k in module.layer_shapes("Qwen/Qwen3-8B-Base"))
    assert qwen["gate_up_proj"] == (24576, 4096) and qwen["down_proj"] == (4096, 12288)


def test_vllm_setups_build_engine_kwargs(bench):
    module = bench("bench_vllm_generation")
    from nemo_jetrl.vllm_patch import build_engine_kwargs

    expected = {
        "bf16": (False, "auto"),
        "bf16_kv": (False, "fp8"),
        "jetrl": (True, "auto"),
        "jetrl_kv": (True, "fp8"),
    }
    for setup in module.SETUPS:
        ek = build_engine_kwargs(module.recipe_for(setup), {"max_num_seqs": 128}, num_layers=36)
        assert (ek.settings.fp8_weights, ek.settings.kv_cache_dtype) == expected[setup], setup
        assert ek.kwargs["max_num_seqs"] == 128


def test_refit_calibration_runs_on_a_tiny_model_on_cpu(bench, tmp_path, capsys):
    module = bench("bench_refit_calibration")
    cfg = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["--device", "cpu", "--model", str(tmp_path), "--train-seqs", "4", "--prompt-len", "8",
            "--seq-len", "24", "--measure-micro-batches", "1", "--rollout-seconds", "10"]  # fmt: skip
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "14 FP8 linears" in out  # 2 layers x 7 linears, all 128-aligned
    assert "refit_quant" in out and "kv_calib" in out
    for row in ("refit_snapshot", "refit_load_parity", "refit_total"):
        assert row in out
    assert "rollback snapshot" in out


def test_fp8_linear_times_the_packages_own_layer(bench):
    """The timed FP8 dataflow is Fp8BlockLinear itself (same outputs and gradients as calling
    it directly), and the quantization-only variant puts the real GEMM back afterwards."""
    module = bench("bench_fp8_linear")
    import nemo_jetrl.fp8.linear as lin_mod
    from nemo_jetrl.fp8 import Fp8BlockLinear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, generator=g).bfloat16()
    w = (torch.randn(128, 256, generator=g) * 0.02).bfloat16()
    dy = torch.randn(128, 128, generator=g).bfloat16()
    layer = module.fp8_layer(w, True)
    assert isinstance(layer, Fp8BlockLinear)
    module.fwd_bwd(layer, x, dy)()
    got = layer.weight.grad.clone()
    ref = module.fp8_layer(w, True)
    xr = x.detach().requires_grad_(True)
    ref(xr).backward(dy)
    assert torch.equal(got, ref.weight.grad)
    real = lin_mod.linear_gemm
    module.quant_only(layer, x, dy)()
    assert lin_mod.linear_gemm is real


@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
def test_fp8_linear_times_the_two_pass_rowcol_layer(bench, monkeypatch):
    """``two_pass/fused``: a layer planned with JETRL_FP8_ROWCOL=two_pass (the variable set for
    its first call only), 'n/a' where the layer has no Triton rowcol kernel (the CPU path)."""
    import os

    import nemo_jetrl.fp8.linear as lin_mod
    from nemo_jetrl.fp8 import dispatch, finite_flags, triton_kernels

    module = bench("bench_fp8_linear")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(128, 256, generator=g).bfloat16(), torch.randn(128, 256, generator=g)
    dy = torch.randn(128, 128, generator=g).bfloat16()
    assert module.two_pass_step(w.bfloat16(), x, dy, True) is None  # the CPU path
    if not triton_kernels.interpreting():
        return
    monkeypatch.setattr(finite_flags, "sync_free", lambda t: True)  # the CUDA path, emulated
    monkeypatch.setattr(lin_mod, "_on_gpu", lambda t: True)
    monkeypatch.setattr(dispatch, "_fast", lambda x, backend: True)
    monkeypatch.setattr(lin_mod, "quant_backend", lambda x, backend=None: "triton")
    monkeypatch.setenv("JETRL_FP8_GEMM_BACKEND", "reference")
    run = module.two_pass_step(w.bfloat16(), x, dy, True)
    assert run is not None and "JETRL_FP8_ROWCOL" not in os.environ
    run()
    finite_flags._FLAGS.clear()


def test_timing_helper_flushes_l2_and_can_replay_a_graph(bench):
    common = bench("_common")
    import inspect

    params = inspect.signature(common.bench_ms).parameters
    assert params["flush_l2"].default is True and params["graph"].default is False
    assert common._L2_FLUSH_BYTES >= 2 * 60 * 2**20  # twice an H200's L2


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


def test_serving_kernel_prints_the_issue_targets(bench):
    """Issue 35's serving targets, MET / NOT MET per M (>= 1.5x at 1..64, >= 1.3x at 256, 8192)."""
    module = bench("bench_serving_kernel")
    assert module.TARGETS == {1: 1.5, 8: 1.5, 32: 1.5, 64: 1.5, 256: 1.3, 8192: 1.3}
    assert module.build_parser().parse_args([]).tokens == list(module.TARGETS)
    assert module.verdict(1, 1.5) == "MET" and module.verdict(256, 1.29).startswith("NOT MET")
    assert module.verdict(3, 9.0) == "-"


@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
def test_serving_kernel_times_each_backend_against_one_bf16_time(bench, monkeypatch):
    """``--backends auto,triton_splitk,triton_splitk:0:1,triton_splitk:a:1:4`` on CPU
    (interpreter; timing stubbed): one BF16 time per M, a row per backend with its ratio and the
    weight bytes per second (TB/s); the forced split-K modes are set for their row only."""
    from nemo_jetrl.fp8 import triton_kernels, triton_split

    if not triton_kernels.interpreting():
        pytest.skip("runs the split-K kernel on CPU tensors in Triton's interpreter")
    module = bench("bench_serving_kernel")
    import bench_fp8_linear

    monkeypatch.setattr(bench_fp8_linear, "layer_shapes", lambda model: [("o", 136, 1300)])
    outs, modes = [], []

    def timed(fn, **kw):
        outs.append(fn())
        modes.append((triton_split.SPLIT_MAX_M, triton_split.FUSE_MAX_M, triton_split.SPLIT_STAGES,
                      triton_split.SPLIT_TMA))  # fmt: skip
        return 2.0 if fn.__name__ == "bf16" else 1.0

    monkeypatch.setattr(module._common, "bench_ms", timed)
    backends = "auto,triton_splitk,triton_splitk:0:1,triton_splitk:a:1:4:tma"
    argv = ["--device", "cpu", "--tokens", "1", "3", "--backends", backends, "--no-pow2"]
    rows = module.run(module.build_parser().parse_args(argv))
    names = ["reference", "triton_splitk", "triton_splitk:0:1", "triton_splitk:a:1:4:tma"]
    assert [(r["M"], r["backend"]) for r in rows] == [(m, b) for m in (1, 3) for b in names]
    assert [tuple(o[0].shape) for o in outs] == [(1, 136)] * 5 + [(3, 136)] * 5
    default = (triton_split.SPLIT_MAX_M, triton_split.FUSE_MAX_M, triton_split.SPLIT_STAGES,
               triton_split.SPLIT_TMA)  # fmt: skip
    forced = [(0, 1 << 30, None, False), (64, 1 << 30, 4, True)]
    assert modes == [default, default, default, *forced] * 2 and default == (64, 16, None, False)
    for r in rows:
        assert r["speedup"] == 2.0 and r["fp8_TBps"] == 136 * 1300 / 1.0 / 1e9
        assert r["bf16_TBps"] == 2 * 136 * 1300 / 2.0 / 1e9 and r["target"] in ("MET", "-")
    bad_modes = ("scaled_mm:1:1", "triton_splitk:1:2", "triton_splitk:a:a:0", "triton_splitk:a:a:x",
                 "triton_splitk:a:a:3:tmx", "triton_splitk:a:a:3:tma:1")  # fmt: skip
    for bad in bad_modes:
        with pytest.raises(SystemExit, match="modes are triton_splitk:SPLIT:FUSED"):
            module.run(module.build_parser().parse_args([*argv[:5], "--backends", bad]))
    # the GPU call's sweep: every variant parses and sets its knobs for its block only
    for name in module.SPLIT_SWEEP:
        with module.splitk_modes(name) as plain:
            assert plain == "triton_splitk"
        after = (triton_split.SPLIT_MAX_M, triton_split.FUSE_MAX_M, triton_split.SPLIT_STAGES,
                 triton_split.SPLIT_TMA)  # fmt: skip
        assert after == default, name
    assert module.backend_names("auto,split-sweep") == ["auto", *module.SPLIT_SWEEP]


def test_quantizer_targets_say_met_or_not_met(bench):
    """Issue 35's quantizer bars from synthetic rows (the real figures need a GPU)."""
    module = bench("bench_quantizer_bandwidth")
    shape = module.TARGET_SHAPE
    rows = [{"shape": shape, "block": b, "of_copy_bw": 0.85} for b in ("1x128", "128x128")]
    rows += [{"shape": shape, "block": "128x1", "of_copy_bw": bw} for bw in (0.9, 0.79)]
    rows.append({"shape": module.DECODE_SHAPE, "block": "1x128", "graph/copy_graph": 1.4})
    lines = module.targets(rows)
    assert len(lines) == 5
    assert lines[0].endswith(": MET") and lines[1].endswith(": MET")
    assert "79%" in lines[2] and lines[2].endswith("NOT MET")  # the worst mode decides
    assert "rowwise+columnwise: n/a" in lines[3]
    assert "1.40x" in lines[4] and lines[4].endswith(": MET")
    rows[-1]["graph/copy_graph"] = 1.6
    assert module.targets(rows)[4].endswith("NOT MET")


@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
def test_quantizer_tile_sweep_checks_bits(bench, monkeypatch):
    """--sweep-tiles on a small input in Triton's interpreter (timing stubbed: no GPU): every
    candidate tile runs and gives the default tile's bits, and the defaults are restored."""
    from nemo_jetrl.fp8 import rowcol_quantize, triton_kernels

    if not triton_kernels.interpreting():
        pytest.skip("runs the sweep on CPU tensors in Triton's interpreter")
    module = bench("bench_quantizer_bandwidth")
    monkeypatch.setattr(module._common, "cuda_time_ms", lambda fn, iters: (fn(), 1.0)[1])
    default_tile, default_rowcol = triton_kernels._tile, rowcol_quantize.ROWCOL_TILE
    args = module.build_parser().parse_args(["--sweep-tiles", "--iters", "1"])
    rows = module.sweep_tiles(args, shape=(130, 256), device="cpu")
    want = sum(map(len, module.TILE_CANDIDATES.values())) + len(module.ROWCOL_TILES)
    assert len(rows) == want and all(r["bits_equal"] is True for r in rows)
    blocks = ["1x128", "128x128", "128x1", "128x1 transposed", "rowwise+columnwise"]
    assert list(dict.fromkeys(r["block"] for r in rows)) == blocks
    # the interpreter's tiles (64 and 128 rows: fewer Python programs; only 128x128's is a GPU
    # candidate) and the fused kernel's default launch (32-row chunks, pipelined)
    defaults = [(r["block"], r["tile"]) for r in rows if r["default"]]
    fused = "(warps 8, chunk 32, programs/SM 0, stages 2)"
    assert defaults == [("128x128", "(128, 128, 4)"), ("rowwise+columnwise", fused)]
    assert triton_kernels._tile is default_tile
    assert rowcol_quantize.ROWCOL_TILE is default_rowcol
    assert len(module.sweep_verdicts(rows)) == 5


def test_quantizer_sweep_verdicts(bench):
    """The sweep's lines from synthetic rows: the best tile decides MET, the default's share is
    named, and a tile whose bits differ fails its block whatever its speed."""
    module = bench("bench_quantizer_bandwidth")
    rows = [
        {"block": "128x1", "tile": "(128, 32, 4)", "default": True, "of_copy_bw": 0.62, "bits_equal": True},
        {"block": "128x1", "tile": "(128, 64, 8)", "default": False, "of_copy_bw": 0.84, "bits_equal": True},
        {"block": "rowwise+columnwise", "tile": "(128, 128, 8)", "default": True, "of_copy_bw": 0.49, "bits_equal": True},
        {"block": "rowwise+columnwise", "tile": "(128, 128, 16)", "default": False, "of_copy_bw": 0.7, "bits_equal": True},
    ]  # fmt: skip
    col, rowcol = module.sweep_verdicts(rows)
    assert col == (
        "quantizer tile sweep 8192x4096 128x1: best (128, 64, 8) 84% of a bf16 copy's bandwidth "
        "(default (128, 32, 4): 62%; target >= 80%): MET"
    )
    assert "best (128, 128, 16) 70%" in rowcol and "default (128, 128, 8): 49%" in rowcol
    assert rowcol.endswith("NOT MET")
    rows[1]["bits_equal"] = False
    assert module.sweep_verdicts(rows)[0].endswith(
        "62%; bits differ under ['(128, 64, 8)']; target >= 80%): NOT MET"
    )


def test_local_grpo_runs_every_recipe_on_cpu(bench, tmp_path, capsys):
    """``--device cpu --steps 1 --tiny``: the same code path as on cuda, every recipe; jetrl and
    jetrl_kv exactly on-policy (MET), fp8_rollout off-policy (mismatch > 0)."""
    module = bench("bench_local_grpo")
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--steps", "1", "--tiny", "--models", "qwen3-0.6b-shaped",
            "--json", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    text = capsys.readouterr().out
    rows = {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(module.RECIPES)
    # jetrl in both scale modes and on the split-K GEMM (CUDA operands only: here the reference)
    for r in ("jetrl", "jetrl@fp32", "jetrl_kv", "jetrl@splitk"):
        assert rows[r]["exactly_on_policy"] == "MET" and rows[r]["tmpe_max"] == 1.0
        assert rows[r]["gen_kl_max"] == 0.0
    assert rows["fp8_rollout"]["mismatch"] > 0 and rows["fp8_rollout"]["exactly_on_policy"] == "-"
    for name, row in rows.items():
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0
        # the step's phases under NeMo-RL's names, within the step's wall time, and its CPU time
        phases = row["phases_s"]
        assert {"generation", "policy_training", "prepare_for_generation"} <= set(phases), name
        assert 0 < sum(phases.values()) <= row["step_s"] and row["cpu_s"] > 0, (name, phases)
        if name == "jetrl@fast":  # batch_invariant=false: none of the invariant ops ran
            assert row["invariant_ops_share"] == 0 and row["exactly_on_policy"] == "-"
        else:
            assert 0 < row["invariant_ops_share"] < 1  # every other recipe runs them
    assert text.count("exactly on-policy: MET") == 4
    assert text.count("phases (s): ") == len(module.RECIPES) and "host CPU " in text
    assert "cost of exactness (qwen3-0.6b-shaped): jetrl step " in text
    with pytest.raises(ValueError, match="the suffixes are @fp32, @splitk, @fast"):
        module.run_recipe("jetrl@e8m0", None, module.build_parser().parse_args([]), tmp_path)


def test_local_grpo_reports_a_failed_or_off_policy_run_and_runs_the_rest(
    bench, tmp_path, monkeypatch
):
    """The verdict and error paths (runs stubbed: the real ones are the test above): a run that
    raises is a row with its error, a jetrl that is not exactly 1 is NOT MET, exit 1 either way,
    and the JSON holds every row."""
    module = bench("bench_local_grpo")
    done = []

    def fake(recipe, model, args, work):
        done.append(recipe)
        if recipe == "bf16":
            raise RuntimeError("CUDA out of memory (planted)")
        tmpe = 1.0 + 1e-6 if recipe == "jetrl" else 1.0
        return {"recipe": recipe, "tmpe_max": tmpe, "gen_kl_max": 0.0, "mismatch": tmpe - 1,
                "exact_every_step": tmpe == 1.0, "step_s": 1.0, "tokens_per_s": 1.0,
                "invariant_ops_share": 0.5, "steps": 1, "phases_s": {"generation": 0.5},
                "cpu_s": 0.9}  # fmt: skip

    monkeypatch.setattr(module, "run_recipe", fake)
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--models", "demo", "--recipes", "bf16,jetrl,jetrl_kv",
            "--json", str(out)]  # fmt: skip
    assert module.main(argv) == 1
    assert done == ["bf16", "jetrl", "jetrl_kv"]
    rows = {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}
    assert "planted" in rows["bf16"]["error"]
    assert rows["jetrl"]["exactly_on_policy"] == "NOT MET"
    assert rows["jetrl_kv"]["exactly_on_policy"] == "MET"
