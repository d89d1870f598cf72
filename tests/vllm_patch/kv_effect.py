"""What a KV scale set in a running vLLM engine does to its attention output (helper of
test_vllm_kv_cpu.py, which runs it on every CPU where vLLM runs an FP8 KV cache).

A forward hook on layer 0's vLLM ``Attention`` module records its q, k, v inputs and its output
for one prefill. The prediction is attention computed in float64 on K and V as they come back
from an FP8 cache written by vLLM's CPU kernel under the set scales
(``nemo_jetrl.kvcache.quant``, ``kernel="cpu"``: ``x * (1/scale)`` clamped to +-448, mantissa
truncated, read as ``byte * scale``), causal, softmax scale ``head_dim ** -0.5``. Layer 0's q, k, v
do not depend on the KV cache, so each setting's output is compared with its own prediction and
its change from the base setting with the predicted change.

Settings (factors on base scales that put the largest |k|, |v| at 448 / 1.5): 1, 3 (every value
re-rounded), 0.25 (the largest values clamp at 448) and 2, which is predicted to change almost
nothing: ``q(x / 2s) * 2s == q(x / s) * s`` while ``x / 2s`` stays in FP8's normal range.
Scales that push many values below 2**-6 (FP8 subnormals) are not used: there vLLM's CPU cache
gave zeros on an AMX Xeon (vLLM 0.32) where the model keeps subnormals (reported in issue 30).
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_jetrl.kvcache.quant import dequantize_kv, quantize_kv
from nemo_jetrl.vllm_patch.refit_kv import kv_scales, set_kv_scales
from nemo_jetrl.vllm_patch.worker_ext import pack, unpack

ATTN = "model.layers.0.self_attn.attn"
PROMPT = [1, *range(40, 60)]  # 21 tokens: one prefill
FACTORS = (1.0, 3.0, 0.25, 2.0)


def _hook(llm: Any, on: bool) -> None:
    def install(worker):  # runs in the worker (a closure: sent by value)
        from nemo_jetrl.vllm_patch.worker_ext import _model

        w = getattr(worker, "worker", worker)
        attn = _model(w).get_submodule(ATTN)
        if not on:
            w.__dict__.pop("_jetrl_test_attn_hook").remove()
            return True
        w._jetrl_test_attn_calls = []

        def record(mod, args, out):
            q, k, v = args[:3]
            w._jetrl_test_attn_calls.append([t.detach().clone() for t in (q, k, v, out)])

        w._jetrl_test_attn_hook = attn.register_forward_hook(record)
        return True

    llm.collective_rpc(install)


def _prefill_call(llm: Any) -> dict[str, torch.Tensor]:
    def fetch(worker):
        w = getattr(worker, "worker", worker)
        calls = w.__dict__.pop("_jetrl_test_attn_calls")
        w._jetrl_test_attn_calls = []
        return pack(
            {f"{i}|{n}": t for i, c in enumerate(calls) for n, t in zip("qkvo", c, strict=True)}
        )

    got = unpack(llm.collective_rpc(fetch)[0])
    calls = sorted({int(k.split("|")[0]) for k in got})
    full = [i for i in calls if got[f"{i}|q"].shape[0] >= len(PROMPT)]
    assert full, f"no prefill of {len(PROMPT)} tokens recorded ({len(calls)} calls)"
    i = full[0]
    return {n: got[f"{i}|{n}"][: len(PROMPT)] for n in "qkvo"}


def predicted(call: dict[str, torch.Tensor], ks: float, vs: float, d: int) -> torch.Tensor:
    """float64 causal attention on K, V dequantized from the FP8 cache."""

    def through_fp8(x: torch.Tensor, s: float) -> torch.Tensor:
        return dequantize_kv(quantize_kv(x, s, kernel="cpu"), s, torch.float64)

    t = call["q"].shape[0]
    q = call["q"].double().view(t, -1, d)  # [T, Hq, D]
    k = through_fp8(call["k"], ks).view(t, -1, d)  # [T, Hkv, D]
    v = through_fp8(call["v"], vs).view(t, -1, d)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    logits = torch.einsum("thd,shd->hts", q, k) * d**-0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", p, v).reshape(t, -1)


def run(eng: Any, generate_one: Any, head_dim: int) -> dict[str, float]:
    """Each KV scale setting on layer 0: its output and its prediction (errors and effects as
    fractions of the largest |predicted output| of the base setting)."""
    llm = eng.llm
    _hook(llm, True)
    try:
        generate_one()
        first = _prefill_call(llm)
        # Base scales: the largest |k|, |v| lands at 448 / 1.5 (no setting overflows FP8).
        base_k = float(first["k"].float().abs().max()) * 1.5 / 448
        base_v = float(first["v"].float().abs().max()) * 1.5 / 448
        held = kv_scales(llm)
        q0, other = held[ATTN]["q"], held["model.layers.1.self_attn.attn"]
        outs = {}
        for f in FACTORS:
            scales = {ATTN: {"q": q0, "k": base_k * f, "v": base_v * f}}
            scales["model.layers.1.self_attn.attn"] = {t: other[t] for t in "qkv"}
            set_kv_scales(llm, scales)
            held = kv_scales(llm)[ATTN]
            assert (held["k"], held["v"]) == (base_k * f, base_v * f)
            generate_one()
            call = _prefill_call(llm)
            for n in "qkv":  # same inputs: only the scales changed
                assert torch.equal(call[n], first[n]), n
            outs[f] = (call["o"].double(), predicted(call, base_k * f, base_v * f, head_dim))
    finally:
        _hook(llm, False)
    return report_of(outs)


def report_of(outs: dict[float, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Errors and effects of ``{factor: (output, prediction)}`` as fractions of the largest
    |prediction| of factor 1."""
    o1, p1 = outs[1.0]
    amp = float(p1.abs().max())
    report = {"amp": amp}
    for f, (o, p) in outs.items():
        report[f"err_{f:g}"] = float((o - p).abs().max()) / amp
        if f != 1.0:
            report[f"effect_{f:g}"] = float((p - p1).abs().max()) / amp
            report[f"change_err_{f:g}"] = float(((o - o1) - (p - p1)).abs().max()) / amp
    return report


# Output error allowed, as a fraction of the largest |predicted output|: vLLM's CPU attention
# rounds P to bf16 for P.V and its output to bf16 (measured 0.0023-0.0024 on an AMX Xeon).
TOL = 0.01


def problems(report: dict[str, float]) -> list[str]:
    """What in ``run``'s report contradicts the prediction (empty: vLLM behaves as predicted)."""
    out = [f"{k}={v:.4g} > {TOL}" for k, v in report.items() if "err_" in k and v > TOL]
    for f in ("3", "0.25"):  # the test can see a wrong scale: the predicted change is large
        if report[f"effect_{f}"] < 3 * TOL:
            out.append(f"effect_{f}={report[f'effect_{f}']:.4g}: too small to test the scale")
    if report["effect_2"] > TOL / 2:  # doubling: predicted to change (almost) nothing
        out.append(f"effect_2={report['effect_2']:.4g}: doubling predicted to change the output")
    return out
