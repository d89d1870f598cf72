"""The serving GEMM plan follows vLLM's own rules (issue 29 point 5): DeepGEMM is never planned
when the engine runs with VLLM_USE_DEEP_GEMM=0 or for weights vLLM would not give DeepGEMM
(N % 64, K % 128); the next backend is chosen, or a forced DeepGEMM is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.fp8.gemm_backends import DeviceCaps, GemmBackendError, decide
from nemo_jetrl.vllm_patch import compat, kernel

H100 = DeviceCaps(cuda=True, sm=(9, 0), deep_gemm=True, scaled_mm=True, triton=True)
CUDA = torch.device("cuda", 0)


def _plan(excluded, forced="auto"):
    return decide(H100, out_dtype=torch.bfloat16, pow2_scales=True, forced=forced,
                  excluded=excluded)  # fmt: skip


@pytest.fixture
def deep_gemm_env(monkeypatch):
    state = {"VLLM_USE_DEEP_GEMM": True}
    monkeypatch.setattr(compat, "vllm_env", lambda name: state[name])
    return state


def test_deep_gemm_is_planned_for_aligned_weights_when_enabled(deep_gemm_env):
    assert kernel.serving_exclusions((4096, 4096), CUDA) == ()
    assert _plan(kernel.serving_exclusions((4096, 4096), CUDA)).backend == "deep_gemm"


def test_vllm_use_deep_gemm_0_moves_the_plan_to_the_next_backend(deep_gemm_env):
    deep_gemm_env["VLLM_USE_DEEP_GEMM"] = False
    ex = kernel.serving_exclusions((4096, 4096), CUDA)
    assert ex and ex[0][0] == "deep_gemm" and "VLLM_USE_DEEP_GEMM=0" in ex[0][1]
    assert _plan(ex).backend == "scaled_mm"
    with pytest.raises(GemmBackendError, match="VLLM_USE_DEEP_GEMM=0"):
        _plan(ex, forced="deep_gemm")


@pytest.mark.parametrize("shape", [(4160 + 32, 4096), (4096, 4096 + 64)])
def test_shapes_vllm_keeps_off_deep_gemm_are_kept_off(deep_gemm_env, shape):
    ex = kernel.serving_exclusions(shape, CUDA)
    assert ex and "N % 64 == 0 and K % 128 == 0" in ex[0][1]
    assert _plan(ex).backend == "scaled_mm"


def test_cpu_serving_excludes_nothing_and_never_asks_vllm(monkeypatch):
    def boom(name):
        raise AssertionError("vLLM's env read on CPU")

    monkeypatch.setattr(compat, "vllm_env", boom)
    assert kernel.serving_exclusions((100, 100), torch.device("cpu")) == ()


def test_warm_up_runs_the_layers_gemm_for_each_token_count(monkeypatch):
    """The warm-up calls the serving GEMM once per M that vLLM's DeepGEMM warm-up covers (here
    on CPU through the reference backend; on a GPU the same calls JIT-compile DeepGEMM)."""
    from nemo_jetrl.fp8 import quantize_blockwise

    calls = []
    real = kernel._gemm_impl

    def spy(a, *rest):
        calls.append(a.shape[0])
        return real(a, *rest)

    monkeypatch.setattr(compat, "deep_gemm_warmup_m_values", lambda w: [1, 3, 8])
    monkeypatch.setattr(kernel, "_gemm_impl", spy)
    qw = quantize_blockwise(torch.randn(256, 384), (128, 128))
    n = kernel.warm_up_gemm(qw.data, qw.scale_inv, torch.bfloat16, True, True, "reference")
    assert n == 3 and calls == [1, 3, 8]
    monkeypatch.setattr(compat, "deep_gemm_warmup_m_values", lambda w: [])
    assert kernel.warm_up_gemm(qw.data, qw.scale_inv, torch.bfloat16, True, True, "x") == 0


@pytest.mark.vllm
@pytest.mark.parametrize(("mode", "expect"), [("skip", []), ("full", list(range(1, 65)))])
def test_warm_up_token_counts_come_from_vllms_own_rules(monkeypatch, mode, expect):
    vllm_config = pytest.importorskip("vllm.config")
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", mode)
    cfg = vllm_config.VllmConfig()
    cfg.scheduler_config.max_num_batched_tokens = 64
    with vllm_config.set_current_vllm_config(cfg):
        assert compat.deep_gemm_warmup_m_values(torch.empty(256, 128)) == expect


@pytest.mark.parametrize("m", [1, 5, 8, 130])
def test_activation_scales_for_deep_gemm_are_written_mn_major(m):
    """Layers on DeepGEMM get scale_inv as the MN-major view DeepGEMM reads (strides
    (1, pad4(M))), same bytes and scale values as the compact layout; the custom op's fake
    (what vLLM's torch.compile traces) has the real op's strides. Triton interpreter on CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nemo_jetrl.fp8 import triton_kernels

    if not triton_kernels.can_run(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("needs triton (interpreter on CPU)")
    x = (torch.randn(m, 384, generator=torch.Generator().manual_seed(m)) * 3).bfloat16()
    q, s = kernel._quantize_act_impl(x, True, 0.0, False)
    qm, sm = kernel._quantize_act_impl(x, True, 0.0, True)
    assert sm.stride() == (1, -(-m // 4) * 4) and s.is_contiguous()
    assert torch.equal(qm.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sm, s)
    ops = kernel.ensure_ops()
    real = ops.quantize_act_1x128(x, True, 0.0, True)
    with FakeTensorMode() as mode:
        fake = ops.quantize_act_1x128(mode.from_tensor(x), True, 0.0, True)
    for r, f in zip(real, fake, strict=True):
        assert (tuple(r.shape), r.stride(), r.dtype) == (tuple(f.shape), f.stride(), f.dtype)
