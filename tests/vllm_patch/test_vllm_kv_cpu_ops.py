"""KV scales in vLLM's CPU attention kernels, per ISA vLLM picks for an FP8 KV cache.

The engine test (test_vllm_kv_cpu.py) runs the ISA vLLM picks on this CPU. Here vLLM's own cache
writer and attention ops (``vllm._custom_ops.cpu_attn_reshape_and_cache`` /
``cpu_attention_with_kv_cache``, the calls its CPU backend makes) run for every ISA vLLM's
``_get_attn_isa`` picks for an FP8 KV cache on this CPU and, where this CPU has AVX-512, for the
one it picks with AMX reported absent (STAND-IN: ``torch.cpu._is_amx_tile_supported`` patched to
False while vLLM chooses; the kernel then runs on this hardware, as on an AVX-512 CPU without
AMX). Each setting's output must be the float64 attention on K/V through the FP8 cache that the
scales predict (kv_effect.py). Where vLLM has no FP8 KV cache on CPU, the test asserts vLLM's
own refusal (0.32 on AVX2: ``_get_attn_isa`` raises; 0.20: its CPU attention's constructor).

Measured on an AMX Xeon (vLLM 0.32): both ISAs within 0.003 of the prediction; the VEC cache
bytes equal ``kvcache.quant.quantize_kv(kernel="cpu")`` even for E4M3 subnormals, while the AMX
path gives zeros there (0.05 off at x256 scales; those scales are left out of the settings).
"""

from __future__ import annotations

import inspect

import kv_effect
import pytest
import torch

pytestmark = pytest.mark.vllm

D, HQ, HKV, T, BLOCK = 128, 2, 1, 21, 32  # block size 32: vLLM's AMX path needs a multiple


def _qkv() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(T, HQ * D, generator=g).bfloat16(),
        "k": (torch.randn(T, HKV * D, generator=g) * 2).bfloat16(),
        "v": torch.randn(T, HKV * D, generator=g).bfloat16(),
    }


def _attend(call: dict[str, torch.Tensor], isa: str, ks: float, vs: float):
    """vLLM's CPU backend calls: write K/V into an FP8 cache, then attend from it."""
    import vllm._custom_ops as ops

    cache = torch.zeros(4, HKV, BLOCK, 2 * D, dtype=torch.uint8)
    kc, vc = cache.view(4, HKV, BLOCK * 2, D).chunk(2, dim=2)
    k, v = call["k"].view(T, HKV, D), call["v"].view(T, HKV, D)
    ops.cpu_attn_reshape_and_cache(
        k, v, kc, vc, torch.arange(T), isa, k_scale=ks, v_scale=vs, kv_cache_dtype="fp8"
    )
    qsl, lens = torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32)
    # vLLM 0.32's scheduler takes the cache dtype, 0.25's does not.
    extra = {"kv_cache_dtype": "fp8"}
    if "kv_cache_dtype" not in inspect.signature(ops.cpu_attn_get_scheduler_metadata).parameters:
        extra = {}
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        seq_lens=lens,
        dtype=torch.bfloat16,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
        **extra,
    )
    out = torch.empty(T, HQ, D, dtype=torch.bfloat16)
    ops.cpu_attention_with_kv_cache(
        query=call["q"].view(T, HQ, D),
        key_cache=kc,
        value_cache=vc,
        output=out,
        query_start_loc=qsl,
        seq_lens=lens,
        scale=D**-0.5,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=torch.arange(4, dtype=torch.int32).view(1, 4),
        softcap=0.0,
        scheduler_metadata=meta,
        s_aux=None,
        k_scale=ks,
        v_scale=vs,
        kv_cache_dtype="fp8",
    )
    return out.reshape(T, -1), vc.reshape(-1, D)[:T]


def _isas(monkeypatch) -> set[str]:
    """The ISAs vLLM picks for an FP8 KV cache here (and with AMX reported absent)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isas = {_get_attn_isa(torch.bfloat16, BLOCK, D, "fp8")}
    if torch.cpu._is_avx512_supported():
        with monkeypatch.context() as mp:  # STAND-IN: the CPU's AMX report (see docstring)
            mp.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
            isas.add(_get_attn_isa(torch.bfloat16, BLOCK, D, "fp8"))
    return isas


def test_kv_scales_in_vllms_cpu_attention_kernels(monkeypatch):
    import vllm

    from nemo_jetrl.kvcache.quant import quantize_kv
    from nemo_jetrl.vllm_patch.compat import cpu_fp8_kv_cache, release

    ok, why = cpu_fp8_kv_cache(head_size=D)
    if release(vllm.__version__) < (0, 21, 0):  # vLLM 0.20: its CPU attention refuses FP8 KV
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        with pytest.raises(NotImplementedError, match="FP8 KV cache is unsupported in CPU_ATTN"):
            CPUAttentionBackendImpl(HQ, D, D**-0.5, HKV, None, None, "fp8")
        assert not ok
        return
    if not ok:  # e.g. AVX2 only: vLLM's own ISA choice refuses
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        with pytest.raises(NotImplementedError, match="requires x86 with AVX-512 or AMX"):
            _get_attn_isa(torch.bfloat16, BLOCK, D, "fp8")
        return
    call = _qkv()
    base_k = float(call["k"].float().abs().max()) * 1.5 / 448
    base_v = float(call["v"].float().abs().max()) * 1.5 / 448
    isas = _isas(monkeypatch)
    assert isas, why
    if "amx" in isas:  # AMX tiles need the OS's permission (the engine gets it via oneDNN)
        assert torch.cpu._init_amx()
    for isa in sorted(isas):
        outs = {}
        for f in kv_effect.FACTORS:
            ks, vs = base_k * f, base_v * f
            out, v_bytes = _attend(call, isa, ks, vs)
            outs[f] = (out.double(), kv_effect.predicted(call, ks, vs, D))
        report = kv_effect.report_of(outs)
        assert kv_effect.problems(report) == [], (isa, report)
        if isa == "vec":  # plain cache layout: the bytes are our CPU cache model's, subnormals too
            for f in (1.0, 3.0, 256.0):
                _, v_bytes = _attend(call, isa, base_k * f, base_v * f)
                want = quantize_kv(call["v"], base_v * f, kernel="cpu").view(torch.uint8)
                assert torch.equal(v_bytes, want), (isa, f)
