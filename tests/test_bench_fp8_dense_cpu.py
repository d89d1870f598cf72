"""CPU checks of the dense FP8 benchmarks in benchmarks/gpu: bench_fp8_linear (the real archs'
shapes, the package's own layer timed, the two-pass rowcol variant), bench_serving_kernel (issue
35's targets, each backend against one BF16 time, the split-K sweep's modes) and
bench_quantizer_bandwidth (the targets' verdicts, the tile sweep's bits and verdicts). Timing is
stubbed or absent: no speed is claimed on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_bench_fixtures import bench_fixture  # noqa: F401  (the `bench` fixture)


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
def test_fp8_linear_times_both_rowcol_modes(bench, monkeypatch):
    """``two_pass/fused``: a layer planned with JETRL_FP8_ROWCOL=two_pass over one planned with
    ``fused`` (the variable set for each first call only), 'n/a' where the layer has no Triton
    rowcol step (the CPU path)."""
    import os

    import nemo_jetrl.fp8.linear as lin_mod
    from nemo_jetrl.fp8 import dispatch, finite_flags, triton_kernels

    module = bench("_fp8_linear_layers")  # bench_fp8_linear's rowcol step and ratio
    assert bench("bench_fp8_linear").rowcol_step is module.rowcol_step
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(128, 256, generator=g).bfloat16(), torch.randn(128, 256, generator=g)
    dy = torch.randn(128, 128, generator=g).bfloat16()
    modes = {m: module.rowcol_step(w.bfloat16(), x, dy, True, m) for m in module.ROWCOL_MODES}
    assert modes == {"two_pass": None, "fused": None}  # the CPU path
    assert module.rowcol_ratio(modes, bench=None) == "n/a"
    if not triton_kernels.interpreting():
        return
    monkeypatch.setattr(finite_flags, "sync_free", lambda t: True)  # the CUDA path, emulated
    monkeypatch.setattr(lin_mod, "_on_gpu", lambda t: True)
    monkeypatch.setattr(dispatch, "_fast", lambda x, backend: True)
    monkeypatch.setattr(lin_mod, "quant_backend", lambda x, backend=None: "triton")
    monkeypatch.setenv("JETRL_FP8_GEMM_BACKEND", "reference")
    monkeypatch.delenv("JETRL_FP8_ROWCOL", raising=False)
    modes = {m: module.rowcol_step(w.bfloat16(), x, dy, True, m) for m in module.ROWCOL_MODES}
    assert None not in modes.values() and "JETRL_FP8_ROWCOL" not in os.environ
    assert module.default_rowcol() == "two_pass"
    timed = []

    def bench_fn(run):  # type: ignore[no-untyped-def]
        run()
        timed.append(run)
        return {"two_pass": 2.0, "fused": 4.0}[next(k for k, v in modes.items() if v is run)]

    assert module.rowcol_ratio(modes, bench_fn) == 0.5 and timed == list(modes.values())
    with module.rowcol_mode("fused"):
        assert module.default_rowcol() == "fused"
    assert "JETRL_FP8_ROWCOL" not in os.environ
    finite_flags._FLAGS.clear()


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
        if fn.__name__.endswith("_layer"):  # the layer timing: `test_serving_kernel_times_...`
            layer_modes.append((triton_split.SPLIT_MAX_M, triton_split.SPLIT_PREFETCH))
            return 2.0 if fn.__name__ == "bf16_layer" else 1.0
        outs.append(fn())
        modes.append(knobs())
        return 2.0 if fn.__name__ == "bf16" else 1.0

    layer_modes = []

    def knobs():
        return (triton_split.SPLIT_MAX_M, triton_split.FUSE_MAX_M, triton_split.SPLIT_STAGES,
                triton_split.SPLIT_TMA, triton_split.SPLIT_PREFETCH, triton_split.SPLIT_PDL,
                triton_split.DECODE_WARPGROUPS)  # fmt: skip

    monkeypatch.setattr(module._common, "bench_ms", timed)
    backends = ("auto,triton_splitk,triton_splitk:0:1,triton_splitk:a:1:4:tma,triton_splitk:a:0:2:pf,"
                "triton_splitk:a:a:3:pf+pdl,triton_splitk:a:a:3:wg2")  # fmt: skip
    argv = ["--device", "cpu", "--tokens", "1", "3", "--backends", backends, "--no-pow2"]
    rows = module.run(module.build_parser().parse_args(argv))
    names = ["reference", "triton_splitk", "triton_splitk:0:1", "triton_splitk:a:1:4:tma",
             "triton_splitk:a:0:2:pf", "triton_splitk:a:a:3:pf+pdl", "triton_splitk:a:a:3:wg2"]  # fmt: skip
    assert [(r["M"], r["backend"]) for r in rows] == [(m, b) for m in (1, 3) for b in names]
    assert [tuple(o[0].shape) for o in outs] == [(1, 136)] * 8 + [(3, 136)] * 8
    default = knobs()
    forced = [(0, 1 << 30, None, False, False, False, 1), (64, 1 << 30, 4, True, False, False, 1),
              (64, 0, 2, False, True, False, 1), (64, 16, 3, False, True, True, 1),
              (64, 16, 3, False, False, False, 2)]  # fmt: skip
    assert modes == [default, default, default, *forced] * 2
    assert default == (64, 16, None, False, False, False, 1)
    for r in rows:
        assert r["speedup"] == 2.0 and r["fp8_TBps"] == 136 * 1300 / 1.0 / 1e9
        assert r["bf16_TBps"] == 2 * 136 * 1300 / 2.0 / 1e9 and r["target"] in ("MET", "-")
        # no L2 size on CPU: the layer is timed but not graded (its weights may sit in L2)
        assert r["layer_speedup"] == 2.0 and r["layer_target"] == "-"
    # one BF16 layer per M, then each backend's layer inside its own modes
    assert layer_modes == [(64, False), (64, False), (64, False), (0, False), (64, False),
                           (64, True), (64, True), (64, False)] * 2  # fmt: skip
    bad_modes = ("scaled_mm:1:1", "triton_splitk:1:2", "triton_splitk:a:a:0", "triton_splitk:a:a:x",
                 "triton_splitk:a:a:3:tmx", "triton_splitk:a:a:3:tma:1", "triton_splitk:a:a:3:pf:1",
                 "triton_splitk:a:a:3:tma:pf", "triton_splitk:a:a:3:pdl+pf",
                 "triton_splitk:a:a:3:tma+pdl", "triton_splitk:a:a:pdl", "triton_splitk:a:a:3:wg3")  # fmt: skip
    for bad in bad_modes:
        with pytest.raises(SystemExit, match="modes are triton_splitk:SPLIT:FUSED"):
            module.run(module.build_parser().parse_args([*argv[:5], "--backends", bad]))
    # the GPU call's sweep: every variant parses and sets its knobs for its block only
    for name in module.SPLIT_SWEEP:
        with module.splitk_modes(name) as plain:
            assert plain == "triton_splitk"
        assert knobs() == default, name
    assert module.backend_names("auto,split-sweep") == ["auto", *module.SPLIT_SWEEP]


def test_serving_kernel_keeps_the_other_rows_when_one_variant_fails(bench, monkeypatch, capsys):
    """A variant that fails on the GPU (say a TMA descriptor the driver refuses) is a FAILED row
    naming the error; the BF16 time and every other variant are still measured and printed as
    each finishes (timing stubbed; no kernel runs)."""
    from nemo_jetrl.fp8 import triton_split

    module = bench("bench_serving_kernel")
    import bench_fp8_linear

    monkeypatch.setattr(bench_fp8_linear, "layer_shapes", lambda model: [("o", 128, 256)])
    monkeypatch.setattr(module, "serving_fns", lambda x, ws, pow2, plain=None: (
        lambda: None, lambda: None, "reference" if plain in (None, "auto") else plain))  # fmt: skip

    def timed(fn, **kw):
        if triton_split.SPLIT_TMA:
            raise RuntimeError("cuTensorMapEncodeTiled failed\nmore detail")
        return 1.0

    monkeypatch.setattr(module._common, "bench_ms", timed)
    argv = ["--device", "cpu", "--tokens", "1", "--backends", "auto,triton_splitk:a:a:3:tma,"
            "triton_splitk", "--no-pow2"]  # fmt: skip
    rows = module.run(module.build_parser().parse_args(argv))
    assert [r["backend"] for r in rows] == ["reference", "triton_splitk:a:a:3:tma", "triton_splitk"]
    assert rows[1]["target"] == "FAILED (RuntimeError: cuTensorMapEncodeTiled failed)"
    assert math.isnan(rows[1]["speedup"]) and rows[1]["bf16_ms"] == 1.0
    assert rows[0]["speedup"] == rows[2]["speedup"] == 1.0
    out = capsys.readouterr().out
    assert "# M=1 triton_splitk:a:a:3:tma: nanx BF16, FAILED (RuntimeError" in out
    assert out.count("# M=1 ") == 3
    with pytest.raises(SystemExit, match="modes are"):  # a bad argument still stops the run
        module.run(module.build_parser().parse_args([*argv[:4], "--backends", "triton_splitk:9"]))


def test_serving_kernel_times_the_linears_as_one_layer_where_their_weights_are_cold(
    bench, monkeypatch, capsys
):
    """The layer timing: every linear's FP8 (and BF16) call back to back in one CUDA graph with
    no L2 flush, graded only where the FP8 weights are at least 3x the GPU's L2 (each replay then
    reads them from HBM); ``--no-layer`` leaves it out (timing stubbed; no kernel runs)."""
    module = bench("bench_serving_kernel")
    import bench_fp8_linear

    shapes = [("qkv", 384, 256), ("o", 256, 128)]
    monkeypatch.setattr(bench_fp8_linear, "layer_shapes", lambda model: shapes)
    order = []

    def fns(x, ws, pow2, plain=None):
        (w,) = ws

        def bf16():
            order.append(("bf16", tuple(w.shape)))

        def fp8():
            order.append(("fp8", tuple(w.shape)))

        return bf16, fp8, "reference"

    calls = []

    def timed(fn, **kw):
        del order[:]
        fn()
        calls.append((fn.__name__, kw.get("graph", False), kw.get("flush_l2", True), list(order)))
        return {"bf16": 3.0, "fp8": 2.0, "bf16_layer": 5.0, "fp8_layer": 2.5}[fn.__name__]

    monkeypatch.setattr(module, "serving_fns", fns)
    monkeypatch.setattr(module._common, "bench_ms", timed)
    weight_bytes = 384 * 256 + 256 * 128
    argv = ["--device", "cpu", "--tokens", "1", "256", "--backends", "auto"]
    for l2, graded in ((weight_bytes // 3, True), (weight_bytes // 3 + 1, False), (None, False)):
        monkeypatch.setattr(module._common, "l2_bytes", lambda dev, l2=l2: l2)
        calls.clear()
        rows = module.run(module.build_parser().parse_args(argv))
        layers = [c for c in calls if c[0].endswith("_layer")]
        both = [("bf16", (384, 256)), ("bf16", (256, 128))]
        assert layers == [("bf16_layer", True, False, both),
                          ("fp8_layer", True, False, [("fp8", s) for _, s in both])] * 2  # fmt: skip
        assert all(c[1] and c[2] for c in calls if c not in layers)  # per linear: flushed graphs
        for r in rows:
            assert r["speedup"] == 6.0 / 4.0 and r["layer_speedup"] == 2.0
            assert r["layer_bf16_ms"] == 5.0 and r["layer_fp8_ms"] == 2.5
            assert r["layer_fp8_TBps"] == weight_bytes / 2.5 / 1e9
        want = ["MET", "MET"] if graded else ["-", "-"]
        assert [r["layer_target"] for r in rows] == want, l2
    out = capsys.readouterr().out
    assert "# M=1 reference: 1.500x BF16, MET; one layer: 2.000x, MET" in out
    calls.clear()
    rows = module.run(module.build_parser().parse_args([*argv, "--no-layer"]))
    assert not any(c[0].endswith("_layer") for c in calls) and "layer_speedup" not in rows[0]


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


def test_the_rowcol_pair_is_graded_on_the_training_linears_mode(bench, monkeypatch):
    """The rowwise+columnwise target grades what `Fp8BlockLinear` runs: two passes by default
    (run 8 measured them faster than the fused kernel), the fused kernel under
    JETRL_FP8_ROWCOL=fused; the other's share is kept beside it."""
    module = bench("bench_quantizer_bandwidth")
    m, k = 8192, 4096
    moved = 2 * m * k + 2 * m * k + (m * 32 + k * 64) * 4  # bf16 x once, two FP8 copies, scales
    monkeypatch.delenv("JETRL_FP8_ROWCOL", raising=False)
    args = (module.TARGET_SHAPE, "e4m3", True, m, k, 2)
    two = module._rowcol_row(*args, 0.1, 0.08, 0.04, 3000.0)  # fused 100 us, two passes 80 us
    assert two["rowcol_mode"] == "two_pass" and two["triton_us"] == pytest.approx(80.0)
    assert two["of_copy_bw"] == pytest.approx(moved / 0.08 / 1e6 / 3000.0)
    assert two["fused_of_copy_bw"] == pytest.approx(moved / 0.1 / 1e6 / 3000.0)
    assert two["two_passes/fused"] == pytest.approx(0.8)
    line = module.targets([two])[3]
    assert "two_pass (the training linear's mode)" in line and line.endswith("NOT MET")
    monkeypatch.setenv("JETRL_FP8_ROWCOL", "fused")
    fused = module._rowcol_row(*args, 0.1, 0.08, 0.04, 3000.0)
    assert fused["rowcol_mode"] == "fused" and fused["triton_us"] == pytest.approx(100.0)
    assert fused["of_copy_bw"] == pytest.approx(fused["fused_of_copy_bw"])


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
    # candidate) and the fused kernel's default launch (whole tiles at 8 warps: run 8's fastest)
    defaults = [(r["block"], r["tile"]) for r in rows if r["default"]]
    fused = "(warps 8, chunk 128, programs/SM 0, stages 1)"
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
