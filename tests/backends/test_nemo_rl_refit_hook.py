"""The NeMo-RL refit hook without an engine: NeMo-RL's own quantizer vs ours (why the hook exists),
install/revert/idempotence/refusals on the real NeMo-RL modules, and the layout of main 7ea279a
read from its source (its vLLM modules need vLLM 0.25 to import)."""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest
import torch
from nemo_rl_upstream import expected_refit_layout, nemo_rl_vllm_modules

from nemo_jetrl.vllm_patch.settings import PatchSettings

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]


FP32 = PatchSettings(pow2_weight_scales=False, pow2_activation_scales=False)
POW2 = PatchSettings()


@pytest.mark.parametrize("settings", [POW2, FP32], ids=["pow2", "fp32"])
def test_nemo_rls_own_quantizer_vs_ours(settings, monkeypatch):
    """pow2: NeMo-RL's cast_tensor_to_fp8_blockwise gives our bytes; FP32: it does not."""
    from nemo_jetrl.fp8 import quantize_blockwise

    _, fp8, _ = nemo_rl_vllm_modules()
    monkeypatch.setattr(
        fp8, "global_fp8_config", fp8.FP8Config(use_weight_pow2_scale=settings.pow2_weight_scales)
    )
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 1024, generator=g) * 0.05).to(torch.bfloat16)
    data, scale = fp8.cast_tensor_to_fp8_blockwise(w.to(torch.float), weight_block_size=[128, 128])
    scale = torch.squeeze(scale, dim=-1)
    q = quantize_blockwise(w, (128, 128), pow2_scales=settings.pow2_weight_scales)
    n_bytes = int((data.view(torch.uint8) != q.data.view(torch.uint8)).sum())
    n_scales = int((scale.view(torch.int32) != q.scale_inv.view(torch.int32)).sum())
    print(
        f"\n{'pow2' if settings.pow2_weight_scales else 'FP32'} scales, 1024x1024 BF16: "
        f"{n_bytes} of {w.numel()} FP8 bytes and {n_scales} of {scale.numel()} scale_inv differ"
    )
    if settings.pow2_weight_scales:
        assert n_bytes == 0 and n_scales == 0
    else:
        assert n_scales > 0 and n_bytes > 0


def test_install_is_explicit_verified_idempotent_and_reverts():
    from nemo_jetrl.backends.nemo_rl import vllm_refit as vr

    backend, fp8, _ = nemo_rl_vllm_modules()
    ext = backend.VllmInternalWorkerExtension
    originals = {n: ext.__dict__[n] for n in vr.TRANSPORTS}
    loader = fp8.load_weights
    assert getattr(loader, vr.MARK, None) is None  # importing our module patched nothing
    # vLLM's model runner resets FP8 KV scales on the KV cache's wake-up (kv_wake.py): 0.20,
    # 0.25 and 0.32 all have the method (the CPU runner inherits it)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wake = GPUModelRunner.__dict__["init_fp8_kv_scales"]
    h = vr.install_refit_hook(FP32, parity=True)
    try:
        assert GPUModelRunner.__dict__["init_fp8_kv_scales"].__wrapped__ is wake
        assert h.active and h.layout in expected_refit_layout()
        assert fp8.load_weights is not loader
        assert all(ext.__dict__[n] is not originals[n] for n in vr.TRANSPORTS)
        assert vr.install_refit_hook(FP32, parity=True) is h  # idempotent
        others = ({"parity": True, "rollback": False}, {"parity": False})
        for other in (*others, {"parity": True, "host_snapshot": True}):
            with pytest.raises(RuntimeError, match="already installed with other settings"):
                vr.install_refit_hook(FP32, **other)
        with pytest.raises(RuntimeError, match="already installed with other settings"):
            vr.install_refit_hook(POW2, parity=True)
    finally:
        h.revert()
        h.revert()
    assert not h.active and fp8.load_weights is loader
    assert all(ext.__dict__[n] is originals[n] for n in vr.TRANSPORTS)
    assert GPUModelRunner.__dict__["init_fp8_kv_scales"] is wake


def test_an_unknown_nemo_rl_layout_is_refused():
    from nemo_jetrl.backends.nemo_rl.vllm_refit import UnsupportedNemoRl, detect_layout

    backend, fp8, _ = nemo_rl_vllm_modules()

    class Other:  # a refit extension that never calls fp8.load_weights
        def _load_weights(self, weights):
            self.model_runner.model.load_weights(weights)

        update_weights_via_ipc_zmq = update_weights_from_collective = _load_weights

    with pytest.raises(UnsupportedNemoRl, match=r"NeMo-RL v0\.7\.0 .* and main 7ea279a"):
        detect_layout(Other, fp8)
    assert detect_layout(backend.VllmInternalWorkerExtension, fp8) in expected_refit_layout()


def test_plugin_needs_the_patch_settings(monkeypatch):
    from nemo_jetrl.backends.nemo_rl import vllm_refit as vr
    from nemo_jetrl.vllm_patch.settings import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(vr.ENV_VAR, raising=False)
    vr.load_in_worker()  # unset: nothing happens
    monkeypatch.setenv(vr.ENV_VAR, vr.refit_hook_env(True)[vr.ENV_VAR])
    with pytest.raises(RuntimeError, match=f"{ENV_VAR} is not"):
        vr.load_in_worker()
    for bad in ("yes", '{"parity": true}', '{"parity": true, "rollback": true}'):  # all three
        monkeypatch.setenv(vr.ENV_VAR, bad)
        with pytest.raises(ValueError, match=re.escape('"rollback": true|false, "host_snapshot"')):
            vr.load_in_worker()


def test_quantize_batch_refuses_a_recipe_engine_mismatch():
    """An engine FP8 layer the recipe keeps in BF16 is named (and nothing is loaded)."""
    from nemo_jetrl.backends.nemo_rl.refit_batches import quantize_batch
    from nemo_jetrl.vllm_patch.refit import RefitError

    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(128, 128, dtype=torch.float8_e4m3fn))

    model = torch.nn.Module()
    model.add_module("q_proj", Proj())
    settings = dataclasses.replace(FP32, modules_to_not_convert=("lm_head", "q_proj"))
    w = [("q_proj.weight", torch.randn(128, 128, dtype=torch.bfloat16))]
    with pytest.raises(RefitError, match=r"q_proj\.weight: the recipe runs it in BF16"):
        quantize_batch(w, model, settings, None)
    out = quantize_batch(w, model, FP32, None)
    assert [k for k, _ in out] == ["q_proj.weight", "q_proj.weight_scale_inv"]
    assert out[0][1].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("tree", ["v0.7.0", "main-7ea279a"])
def test_both_trees_route_refit_weights_through_fp8_load_weights(tree):
    """What `detect_layout` relies on, read from each tree's source (no import)."""
    from conftest import NEMO_RL_UPSTREAM

    from nemo_jetrl.backends.nemo_rl.vllm_refit import BYPASSING, LOADERS, TRANSPORTS

    root = NEMO_RL_UPSTREAM / tree / "nemo_rl/models/generation/vllm"
    if not root.is_dir():
        pytest.skip(f"no NeMo-RL source at {root}")
    src = (root / "vllm_backend.py").read_text()
    cls = next(
        n
        for n in ast.parse(src).body
        if isinstance(n, ast.ClassDef) and n.name == "VllmInternalWorkerExtension"
    )
    methods = {
        f.name: ast.get_source_segment(src, f) for f in cls.body if isinstance(f, ast.FunctionDef)
    }
    assert set(TRANSPORTS) <= set(methods)
    loader = next(n for n in LOADERS if n in methods and "fp8.load_weights(" in methods[n])
    assert LOADERS[loader] == tree
    fp8 = ast.parse((root / "quantization/fp8.py").read_text())
    lw = next(f for f in fp8.body if isinstance(f, ast.FunctionDef) and f.name == "load_weights")
    assert [a.arg for a in lw.args.args] == ["weights", "model_runner"]
    # every other transport main has is one the hook refuses
    other = {m for m in methods if m.startswith(("update_weights", "nccl_reshard_refit"))}
    assert other - set(TRANSPORTS) <= set(BYPASSING)
