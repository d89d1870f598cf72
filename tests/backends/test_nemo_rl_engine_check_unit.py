"""``engine_check``'s verdicts on worker reports (no vLLM; the real-engine test is
tests/backends/test_nemo_rl_engine_check.py, NeMo-RL tier): what each missing piece is called,
and what the driver logs. The reports have the shape ``worker_status`` returns there."""

from __future__ import annotations

import pytest
from worker_group_shape import POSITIONAL_REFUSED, CallShapeWorkerGroup, get_raising, ray_call

from nemo_jetrl.backends.nemo_rl import engine_check as ec
from nemo_jetrl.backends.nemo_rl import kv_backends as kvb
from nemo_jetrl.backends.nemo_rl.translate import _vllm_env, _vllm_patch_json
from nemo_jetrl.backends.nemo_rl.worker_env import worker_env_problems
from nemo_jetrl.recipe import Recipe
from nemo_jetrl.vllm_patch.settings import PatchSettings

ENV = _vllm_env({}, _vllm_patch_json(Recipe.preset("jetrl"), 2))
PATCH = ENV["NEMO_JETRL_VLLM_PATCH"]
LAYERS = [f"model.layers.{i}.{p}" for i in range(2) for p in ("qkv_proj", "o_proj")]


def report(ours=True, hook=True, entry_points=tuple(ec.ENTRY_POINTS), plugins=None) -> dict:
    want = PatchSettings.from_json(PATCH).to_json()
    kernel = "JetRLFp8BlockLinearKernel" if ours else "CutlassFp8BlockScaledMMKernel"
    return {
        "layers": {n: {"kernel": kernel, "ours": ours, "settings": want} for n in LAYERS},
        "registered": ours,
        "env": {
            "VLLM_PLUGINS": plugins,
            "VLLM_DISABLED_KERNELS": None,
            "NEMO_JETRL_VLLM_PATCH": PATCH,
            "NEMO_JETRL_NRL_REFIT": ENV["NEMO_JETRL_NRL_REFIT"],
        },
        "refit_hook": {"active": True, "layout": "v0.7.0"} if hook else None,
        "entry_points": {n: ec.ENTRY_POINTS[n] for n in entry_points},
        "python": "/opt/nemo_rl_venv/bin/python",
    }


def test_all_present_gives_the_line():
    res = ec.judge([report(), report()], PATCH, True)
    assert res["line"] == (
        "nemo_jetrl: plugin loaded in 2 vLLM worker(s); kernel serves 8/8 FP8 linears, "
        "refit hook installed (v0.7.0)"
    )


def test_a_rebuilt_venv_without_our_entry_points_is_named():
    rep = report(ours=False, hook=False, entry_points=())
    with pytest.raises(ec.EngineNotProven) as ei:
        ec.judge([rep], PATCH, True)
    msg = str(ei.value)
    for name in ec.ENTRY_POINTS:
        assert f"entry point {name!r} is not installed in this worker's Python " in msg
    assert "NRL_FORCE_REBUILD_VENVS" in msg
    assert "worker 0: our refit hook is not installed" in msg
    assert "worker 0: 4 of 4 block-FP8 linears run CutlassFp8BlockScaledMMKernel" in msg


def test_refit_hook_off_by_config_is_not_required():
    res = ec.judge([report(hook=False)], PATCH, False)
    assert res["line"].endswith("kernel serves 4/4 FP8 linears, refit hook off")


class _Logger:
    def __init__(self):
        self.logged = []

    def log_metrics(self, metrics, step, prefix=""):
        self.logged.append((metrics, step, prefix))


def test_driver_logs_the_fraction_and_names_a_missing_nemo_jetrl(capsys):
    one = {"workers": 1, "fp8_linears": 4, "on_our_kernel": 4, "line": ""}
    gen = type("G", (), {"worker_group": CallShapeWorkerGroup(results=[one, one])})()
    log = _Logger()
    res = ec.prove_generation_engines(gen, ENV, log, get=lambda f: f)
    assert res["engines"] == 2 and res[ec.FRACTION_METRIC] == 1.0
    assert log.logged == [({ec.FRACTION_METRIC: 1.0, ec.HOOK_METRIC: 1.0}, 0, "")]
    assert "plugin loaded in 2 vLLM worker(s) of 2 engine(s); kernel serves 8/8" in (
        capsys.readouterr().out
    )

    def missing(_):  # Ray's error when the actor's venv cannot import nemo_jetrl
        err = RuntimeError("RayTaskError")
        err.cause = ModuleNotFoundError("No module named 'nemo_jetrl'", name="nemo_jetrl")
        raise err

    with pytest.raises(ec.EngineNotProven, match="nemo_jetrl is not importable in NeMo-RL's vLLM"):
        ec.prove_generation_engines(gen, ENV, log, get=missing)
    async_gen = type("G", (), {"worker_group": CallShapeWorkerGroup(results=[{"async": True}])})()
    assert ec.prove_generation_engines(async_gen, ENV, log, get=lambda f: f) == {"async": True}
    assert "engine check NOT run" in capsys.readouterr().out


class _AsyncLLM:
    """Stand-in for vLLM's AsyncLLM: ``collective_rpc`` is a coroutine answered on its loop."""

    def __init__(self, reports):
        self.reports = reports
        self.calls = 0

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        import asyncio

        assert method is ec.worker_status
        self.calls += 1
        await asyncio.sleep(0.3)  # the driver polls meanwhile
        return self.reports


class _AsyncActorGroup(CallShapeWorkerGroup):
    """STAND-IN for a Ray that runs a sync method of an async actor (``__ray_call__``) on the
    actor's event loop (``ray._private.async_compat.sync_to_async``), here a loop in a thread:
    `_async_step`'s polling branch. Ray 2.60 runs it in a thread of its own instead, the branch
    tests/backends/test_nemo_rl_engine_check_ray.py runs through real Ray."""

    def __init__(self, actor):
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        super().__init__([actor], call=self._on_loop)

    @property
    def polls(self) -> int:
        return len(self.calls)

    def _on_loop(self, actor, method_name, kwargs):
        import asyncio

        async def on_loop():
            return ray_call(actor, method_name, kwargs)

        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.mark.parametrize("hook", [True, False], ids=["all_present", "hook_missing"])
def test_async_engine_is_checked_on_the_actors_loop(hook, capsys):
    import types

    llm = _AsyncLLM([report(hook=hook), report(hook=hook)])
    group = _AsyncActorGroup(types.SimpleNamespace(llm=llm))
    gen = type("G", (), {"worker_group": group})()
    log = _Logger()
    try:
        if hook:
            res = ec.prove_generation_engines(gen, ENV, log, get=lambda f: f)
            assert (res["fp8_linears"], res["on_our_kernel"]) == (8, 8)
            assert log.logged == [({ec.FRACTION_METRIC: 1.0, ec.HOOK_METRIC: 1.0}, 0, "")]
            assert "kernel serves 8/8 FP8 linears, refit hook installed" in capsys.readouterr().out
        else:
            with pytest.raises(ec.EngineNotProven, match="worker 1: our refit hook is not"):
                ec.prove_generation_engines(gen, ENV, log, get=get_raising)
            assert log.logged == []
    finally:
        group.close()
    assert llm.calls == 1 and group.polls > 1  # one RPC, polled until it finished


def test_the_check_passes_keywords_only_as_nemo_rls_worker_group_requires():
    """NeMo-RL's ``run_all_workers_single_data`` asserts ``len(args) == 0``: on fd6dbfb the
    driver passed its function positionally and every FP8 run died after setup."""
    one = {"workers": 1, "fp8_linears": 4, "on_our_kernel": 4, "line": ""}
    group = CallShapeWorkerGroup(results=[one])
    gen = type("G", (), {"worker_group": group})()
    ec.prove_generation_engines(gen, ENV, None, get=lambda f: f)
    (call,) = group.calls
    assert call["method"] == "__ray_call__"
    assert call["axes"] == ["tensor_parallel", "pipeline_parallel"]
    assert call["kwargs"] == {
        "fn": ec.check_in_generation_worker,
        "patch_json": PATCH,
        "hook_expected": True,
    }
    with pytest.raises(AssertionError, match=POSITIONAL_REFUSED):
        group.run_all_workers_single_data("__ray_call__", ec.check_in_generation_worker)


def test_deepgemm_ue8m0_requantization_is_off_for_our_rollouts():
    """NeMo-RL's FP8 weight loading (``precision: fp8``, both trees) ends in DeepGEMM's
    post-processing on Hopper and Blackwell, which with vLLM's default
    ``VLLM_USE_DEEP_GEMM_E8M0=1`` re-quantizes every FP8 weight in place to UE8M0 scales (found
    by reading NeMo-RL's ``fp8.py`` and vLLM's ``fp8_utils``, 2026-12-01; the CPU builds have no
    DeepGEMM, so no CPU run could show it). The launch turns it off with our patch; a config that
    turns it on is refused before Ray, naming the key; without our patch nothing is set."""
    assert ENV["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    assert "VLLM_USE_DEEP_GEMM_E8M0" not in _vllm_env({}, None)  # no patch: NeMo-RL's as it is
    assert worker_env_problems({"VLLM_USE_DEEP_GEMM_E8M0": "1"}, ENV, True) == []  # ours win
    user = {"policy": {"generation": {"vllm_cfg": {"env_vars": {"VLLM_USE_DEEP_GEMM_E8M0": "1"}}}}}
    env = {**_vllm_env(user, PATCH), "VLLM_USE_DEEP_GEMM_E8M0": "1"}  # the config's, merged
    assert "VLLM_USE_DEEP_GEMM_E8M0" not in _vllm_env(user, PATCH)  # the config's value is kept
    (problem,) = worker_env_problems({}, env, True)
    assert problem.startswith("VLLM_USE_DEEP_GEMM_E8M0=1 (set by policy.generation.vllm_cfg")
    assert "re-quantizes every FP8 weight" in problem
    ok = {**env, "VLLM_USE_DEEP_GEMM_E8M0": "0"}
    assert worker_env_problems({}, ok, True) == []


@pytest.mark.parametrize("value", ["false", "", "true", "off"])
def test_a_deepgemm_ue8m0_value_vllm_cannot_read_is_refused_before_ray(value):
    """vLLM reads ``VLLM_USE_DEEP_GEMM_E8M0`` as ``bool(int(value))`` (``envs.py``, 0.20 and
    0.25): "false" or "" raise inside the engine at its first read, after Ray, the model load
    and the engine start. The check before Ray read them as off (found by reading, session 38);
    it names the variable and what to write."""
    env = {**ENV, "VLLM_USE_DEEP_GEMM_E8M0": value}
    (problem,) = worker_env_problems({}, env, True)
    assert problem.startswith(f"VLLM_USE_DEEP_GEMM_E8M0={value!r} (set by policy.generation")
    assert "reads it as an integer" in problem and "write 0 or remove it" in problem
    assert worker_env_problems({}, {**ENV, "VLLM_USE_DEEP_GEMM_E8M0": " 0"}, True) == []


def test_an_fp8_kv_cache_on_flashinfer_is_refused_naming_the_backend_knob():
    """FlashInfer folds the K/V scales it first sees into its own bmm1/bmm2 scales (and its CUDA
    graphs hold them), so the scales a refit sends are never used (found by reading vLLM
    0.20/0.25/0.32's FlashInfer backend, 2026-12-01). The worker reports the attention
    implementation of every layer with an FP8 KV cache; FlashAttention reads the scale tensors
    at every call."""
    flash = {**report(), "fp8_kv_attention": ["FlashInferImpl"]}
    with pytest.raises(ec.EngineNotProven) as ei:
        ec.judge([report(), flash], PATCH, True)
    msg = str(ei.value)
    assert "worker 1: FP8 KV cache on FlashInfer attention (FlashInferImpl)" in msg
    assert "keep the KV cache BF16 (recipe jetrl)" in msg and "worker 0" not in msg
    ok = {**report(), "fp8_kv_attention": ["FlashAttentionImpl"]}
    assert ec.judge([ok], PATCH, True)["workers"] == 1


def test_an_fp8_kv_cache_with_fp8_queries_is_refused():
    """vLLM 0.20-0.32 build ``query_quant`` on an FP8-KV layer whose backend takes FP8 queries
    (FlashAttention 3, Triton attention on CUDA): every query is quantized with q_scale and the
    probabilities multiply V in FP8, which the trainer's on-policy KV does not model (found by
    reading vLLM's attention layer and backends, 2026-12-01)."""
    q8 = {**report(), "fp8_kv_attention": ["FlashAttentionImpl"],
          "fp8_kv_query_quant": ["FlashAttentionImpl"]}  # fmt: skip
    with pytest.raises(ec.EngineNotProven) as ei:
        ec.judge([q8], PATCH, True)
    msg = str(ei.value)
    assert "worker 0: FP8 KV cache on FlashAttentionImpl with FP8 queries" in msg
    assert "Keep the KV cache BF16 (recipe jetrl)" in msg


def test_the_fp8_kv_attention_report_reads_each_layers_cache_dtype():
    from torch import nn

    class FlashInferImpl:
        pass

    class FlashAttentionImpl:
        pass

    def attn(dtype: str, impl: type) -> nn.Module:
        m = nn.Module()
        m.kv_cache_dtype, m.impl = dtype, impl()
        return m

    model = nn.ModuleList([attn("fp8_e4m3", FlashAttentionImpl), attn("auto", FlashInferImpl),
                           attn("fp8", FlashAttentionImpl), nn.Linear(2, 2)])  # fmt: skip
    assert kvb.fp8_kv_attention_impls(model) == ["FlashAttentionImpl"]
    model.append(attn("fp8", FlashInferImpl))
    assert kvb.fp8_kv_attention_impls(model) == ["FlashAttentionImpl", "FlashInferImpl"]
    # the layers that quantize queries too (vLLM's query_quant), FP8 KV ones only
    assert kvb.fp8_kv_attention_impls(model, fp8_queries=True) == []
    model[2].query_quant = object()
    model[1].query_quant = object()  # a BF16 cache: not asked
    assert kvb.fp8_kv_attention_impls(model, fp8_queries=True) == ["FlashAttentionImpl"]


def test_the_engine_loop_is_found_where_vllm_keeps_its_output_task():
    """Without an ``output_handler``, AsyncLLM's loop is its client's output task's, which
    vLLM 0.20-0.32 keep in ``engine_core.resources`` (0.32 ``v1/engine/core_client.py``:
    ``BackgroundResources.output_queue_task``), not on the client itself."""
    import asyncio
    import types

    loop = asyncio.new_event_loop()
    try:
        task = types.SimpleNamespace(get_loop=lambda: loop)
        core = types.SimpleNamespace(resources=types.SimpleNamespace(output_queue_task=task))
        assert ec._engine_loop(types.SimpleNamespace(engine_core=core)) is loop
        flat = types.SimpleNamespace(engine_core=types.SimpleNamespace(output_queue_task=task))
        assert ec._engine_loop(flat) is None  # no vLLM keeps it there
    finally:
        loop.close()
    assert ec._engine_loop(types.SimpleNamespace(engine_core=core)) is None  # closed loop
