"""The rehearsal's FP8 KV pieces that need neither NeMo-RL nor vLLM (rehearsal/kv.py): the KV
scale tensors a refit appends after the weights (names, float32, values from ``kv_scales``, else
the last calibration, else 1.0), the calibration on a stand-in model (NeMo-RL's result shape,
padding excluded, scales installed), the refusal's message, and the per-step engine comparison.
The whole rehearsal of jetrl_kv: tests/backends/test_nemo_rl_rehearse_kv.py."""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.backends.nemo_rl.rehearsal import kv
from nemo_jetrl.kvcache import names

LAYERS = 2


def _names_of(layer: int) -> dict[str, str]:
    # NeMo-RL's get_vllm_qkv_scale_names, spelled by our own module (the NeMo-RL tier test
    # asserts they agree)
    return {f"{t}_scale": names.vllm_scale_name(layer, t) for t in names.TENSORS}


NAMES = kv.scale_names(LAYERS, _names_of)


def test_refit_kv_tensors_are_float32_from_kv_scales_else_calibration_else_one():
    assert NAMES[:3] == [
        "model.layers.0.self_attn.attn.q_scale",
        "model.layers.0.self_attn.k_scale",
        "model.layers.0.self_attn.v_scale",
    ]
    assert len(NAMES) == 3 * LAYERS
    calibrated = {n: 0.01 * (i + 1) for i, n in enumerate(NAMES) if not n.endswith("q_scale")}
    # nothing known: 1.0, as NeMo-RL
    out = kv.kv_refit_tensors(NAMES, None, None)
    assert [n for n, _ in out] == NAMES
    assert all(t.dtype == torch.float32 and t.shape == (1,) and float(t) == 1.0 for _, t in out)
    # the last calibration (v0.7.0's colocated refit passes no kv_scales); q not calibrated: 1.0
    out = dict(kv.kv_refit_tensors(NAMES, None, calibrated))
    for n in NAMES:
        want = torch.tensor(calibrated.get(n, 1.0), dtype=torch.float32)
        assert out[n].dtype == torch.float32 and torch.equal(out[n], want.reshape(1))
    # the caller's scales (main passes grpo's cache: our own calibration's numbers)
    given = {n: v for n, v in calibrated.items()}
    given[NAMES[0]] = 0.5  # a name our calibration left out may come from the caller
    out = dict(kv.kv_refit_tensors(NAMES, given, calibrated))
    assert float(out[NAMES[0]]) == 0.5 and float(out[NAMES[1]]) == pytest.approx(0.01 * 2)
    # scales contradicting the trainer's calibration are refused (its on-policy KV uses its own)
    wrong = {**calibrated, NAMES[1]: 0.25}
    with pytest.raises(ValueError, match=r"differ from the trainer's calibration"):
        kv.kv_refit_tensors(NAMES, wrong, calibrated)


def test_fp8_kv_cache_is_nemo_rls_test():
    assert kv.fp8_kv_cache({"backend": "vllm", "vllm_cfg": {"kv_cache_dtype": "fp8"}})
    assert kv.fp8_kv_cache({"vllm_cfg": {"kv_cache_dtype": "fp8_e4m3"}})
    assert not kv.fp8_kv_cache({"backend": "vllm", "vllm_cfg": {"kv_cache_dtype": "auto"}})
    assert not kv.fp8_kv_cache({"backend": "megatron", "vllm_cfg": {"kv_cache_dtype": "fp8"}})


@pytest.fixture(scope="module")
def stand_in():
    from transformers import AutoModelForCausalLM

    from nemo_jetrl.arch.builtins import resolve_arch
    from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny

    torch.manual_seed(0)
    cfg = tiny.tiny_config(resolve_arch("Qwen/Qwen3-8B-Base"), 128)
    return AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()


def _recipe(**cal):
    import dataclasses

    from nemo_jetrl.recipe import Recipe

    r = Recipe.preset("jetrl_kv")
    return dataclasses.replace(r, kv_calibration=dataclasses.replace(r.kv_calibration, **cal))


def test_calibration_returns_nemo_rls_shape_installs_scales_and_skips_padding(stand_in):
    recipe = _recipe()
    assert recipe.kv_fp8 and recipe.onpolicy_kv and recipe.kv_calibration.mask != "none"
    cpu = kv.CpuKV(stand_in, recipe)
    try:
        ids = torch.randint(0, 128, (3, 12))
        lengths = torch.tensor([12, 7, 4])
        out = cpu.calibrate(stand_in, ids, lengths, micro_batch_size=2, include_q=True)
        assert set(out) >= {"format", "percentile", "margin", "layers"}
        assert out["format"] == "fp8" and out["margin"] == recipe.kv_calibration.margin
        assert sorted(out["layers"]) == sorted(NAMES)  # NeMo-RL's include_q=True honoured
        assert all(isinstance(v, float) and v > 0 for v in out["layers"].values())
        assert cpu.vllm_scales == out["layers"]  # remembered for the refit
        assert cpu.controller.scales.to_vllm() == out["layers"]  # installed on the model
        assert out["jetrl"]["micro_batches"] == 2  # the recipe's micro-batch size is unset
        # include_q=False from NeMo-RL and none in the recipe: k and v only
        kv_only = cpu.calibrate(stand_in, ids, lengths, micro_batch_size=4, include_q=False)
        assert sorted(kv_only["layers"]) == sorted(n for n in NAMES if not n.endswith("q_scale"))
    finally:
        cpu.controller.detach()
    # padding (past input_lengths) does not count: other pad tokens, same scales (a fresh
    # attachment: the scales in effect change deeper layers' inputs under on-policy KV)
    padded = ids.clone()
    padded[1, 7:] = 127
    padded[2, 4:] = 5
    cpu = kv.CpuKV(stand_in, recipe)
    try:
        again = cpu.calibrate(stand_in, padded, lengths, micro_batch_size=2, include_q=True)
        assert again["layers"] == out["layers"]
    finally:
        cpu.controller.detach()


def test_the_recipes_micro_batch_size_wins(stand_in):
    cpu = kv.CpuKV(stand_in, _recipe(micro_batch_size=1))
    try:
        ids = torch.randint(0, 128, (3, 6))
        out = cpu.calibrate(stand_in, ids, torch.tensor([6, 6, 6]), micro_batch_size=8,
                            include_q=True)  # fmt: skip
        assert out["jetrl"]["micro_batches"] == 3
    finally:
        cpu.controller.detach()


def test_the_refusal_names_the_key_the_reason_and_what_to_do():
    assert kv.cpu_fp8_kv_refusal({"kv_cache_dtype": "auto"}, "jetrl", 128) is None
    msg = kv.cpu_fp8_kv_refusal({"kv_cache_dtype": "fp8"}, "jetrl_kv", 128, version="0.20.0")
    assert msg is not None
    assert "policy.generation.vllm_cfg.kv_cache_dtype='fp8'" in msg
    assert "vLLM 0.20.0's CPU platform has no FP8 KV cache" in msg
    assert (
        "vLLM >= 0.25" in msg
        and "AVX-512 or AMX" in msg
        and "here, rehearse the jetrl recipe" in msg
    )


def test_the_step_line_compares_what_was_sent_with_each_engine():
    calibrated = {n: 0.02 for n in NAMES}
    sent = dict(calibrated)
    engine = {
        f"model.layers.{i}.self_attn.attn": {
            **{t: 0.019999999552965164 for t in "qkv"},
            **{f"{t}_tensor": 0.019999999552965164 for t in "qkv"},
        }
        for i in range(LAYERS)
    }
    line, differ = kv.kv_report(sent, calibrated, [engine])
    assert line == "KV scales: 2 layers calibrated (q,k,v), identical in the engine" and not differ
    engine["model.layers.1.self_attn.attn"]["k_tensor"] = 1.0
    line, differ = kv.kv_report(sent, calibrated, [engine])
    assert "DIFFERENT in the engine" in line
    assert differ == [
        "model.layers.1.self_attn.k_scale: sent 0.019999999552965164, vLLM worker 0 uses "
        "(0.019999999552965164, 1.0)"
    ]
    # q left at NeMo-RL's 1.0 (not calibrated): k,v counted as calibrated
    sent = {n: (1.0 if n.endswith("q_scale") else 0.02) for n in NAMES}
    kv_only = {n: v for n, v in sent.items() if not n.endswith("q_scale")}
    for per in engine.values():
        per.update(q=1.0, q_tensor=1.0, k_tensor=0.019999999552965164)
    assert kv.kv_report(sent, kv_only, [engine])[0].startswith(
        "KV scales: 2 layers calibrated (k,v)"
    )


def test_the_refit_hook_lands_kv_scales_in_float32_parameters():
    """vLLM creates the attention's scale parameters in the model's dtype (BF16): the hook makes
    them float32 before the loader copies the trainer's fp32 scales in (found by the jetrl_kv
    rehearsal: the engine held 0.009033203125 for a sent 0.009031994268298149)."""
    from nemo_jetrl.backends.nemo_rl.refit_batches import quantize_batch
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    model = torch.nn.Module()  # model.layers.{i}.self_attn.attn.{q,k,v}_scale, as vLLM's
    layers = torch.nn.ModuleList()
    for _ in range(LAYERS):
        layer, self_attn, attention = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
        for t in "qkv":
            scale = torch.nn.Parameter(torch.tensor(-1.0, dtype=torch.bfloat16), False)
            setattr(attention, f"{t}_scale", scale)
        self_attn.attn = attention
        layer.self_attn = self_attn
        layers.append(layer)
    inner = torch.nn.Module()
    inner.layers = layers
    model.model = inner
    sent = {n: torch.tensor([0.009031994268298149], dtype=torch.float32) for n in NAMES}
    out = quantize_batch(list(sent.items()), model, PatchSettings(), None)
    # q's NeMo-RL name loses its ".attn" hop (the k/v form is the one vLLM's loader remaps)
    assert [n for n, _ in out][:3] == [f"model.layers.0.self_attn.{t}_scale" for t in "qkv"]
    for i in range(LAYERS):
        module = model.get_submodule(f"model.layers.{i}.self_attn.attn")
        for t in "qkv":
            param = getattr(module, f"{t}_scale")
            assert isinstance(param, torch.nn.Parameter) and param.dtype == torch.float32
            param.data.copy_(sent[names.vllm_scale_name(i, t)].reshape(()))  # vLLM's loader
            assert float(param) == float(sent[names.vllm_scale_name(i, t)])


def test_the_trainer_writes_kv_as_vllms_cpu_cache_does(stand_in):
    """The rehearsal's rollout is vLLM's CPU engine, whose cache writer truncates
    (tests/vllm_patch/test_vllm_kv_cpu_ops.py: its bytes are quantize_kv(kernel="cpu")); the
    trainer's on-policy K/V must be those bytes, not the CUDA writer's rounding."""
    cpu = kv.CpuKV(stand_in, _recipe())
    try:
        ids = torch.randint(0, 128, (2, 8))
        cpu.calibrate(stand_in, ids, torch.tensor([8, 8]), micro_batch_size=2, include_q=False)
        (handle,) = cpu.controller.handles.values()
        assert handle.state.kernel == "cpu" and handle.state.quantize
        # the two writers differ on this input (1.97 with scale 1: CPU 1.875, CUDA 2.0)
        from nemo_jetrl.kvcache import fake_quantize_kv

        x = torch.tensor([1.97])
        assert float(fake_quantize_kv(x, 1.0, kernel=handle.state.kernel)) == 1.875
    finally:
        cpu.controller.detach()
