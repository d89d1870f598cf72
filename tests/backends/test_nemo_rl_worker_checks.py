"""Our NeMo-RL policy worker's checks of the model NeMo-RL built (``backends/nemo_rl/worker.py``),
through NeMo-RL's REAL ``MegatronPolicyWorkerImpl`` on CPU, with the stand-ins and fixtures of
test_nemo_rl_worker_glue.py (its docstring lists them): the worker stops, before any step, a
model whose training forward would not be the rollout's (BF16 edge layers a provider set, TE
blocks that are not the rollout's, a gated delta net's in_proj judged with the HF split the
driver read), naming the linear and the fix, unless the run was launched with
``jetrl.allow_off_policy`` (then it warns and builds).
"""

from __future__ import annotations

import pytest
from nemo_rl_real_worker import _CudaOnCpu
from test_nemo_rl_worker_glue import _bridge, _cfg, model, real_mpw, worker_cls

pytestmark = pytest.mark.nemo_rl
__all__ = ["model", "real_mpw", "worker_cls"]  # the fixtures these tests take


def test_a_model_built_with_other_bf16_edge_layers_is_refused_by_the_worker(
    worker_cls, model, tmp_path
):
    """Megatron-Bridge's Nemotron-H provider sets first_last_layers_bf16 itself (NeMo-RL's
    fp8_cfg never resets it): the worker refuses the model NeMo-RL built, before any step."""
    cls, _ = worker_cls
    bridge = _bridge(tmp_path)
    cfg = model.config
    saved = {k: getattr(cfg, k) for k in ("fp8", "first_last_layers_bf16")}
    try:
        cfg.fp8, cfg.first_last_layers_bf16 = "e4m3", True  # as the provider leaves them
        with _CudaOnCpu(), pytest.raises(RuntimeError, match=r"built with 1 first and 1 last"):
            cls(_cfg(), model=model, bridge=bridge)
        cfg.first_last_layers_bf16 = False  # the control: what the recipe trains
        with _CudaOnCpu():
            cls(_cfg(), model=model, bridge=bridge)
    finally:
        for k, v in saved.items():
            setattr(cfg, k, v)


def test_the_worker_judges_in_proj_with_the_hf_split_the_driver_read(
    worker_cls, model, tmp_path, monkeypatch
):
    """A gated delta net's in_proj at TP 1: Qwen3.5's b and a rows share one of TE's blocks,
    Qwen3-Next's do not, and the built TransformerConfig does not say which the checkpoint is.
    The driver does (`NEMO_JETRL_HF_IN_PROJ_SPLIT`, test_nemo_rl_policy_env.py): told "1" the
    worker refuses the model, told "0" it builds it, not told it builds it (unjudged,
    tests/megatron/test_megatron_blocks_hybrid.py). The gated delta net's fields are set on the
    real model's config (its layers are the GPT's: only the judgement reads them)."""
    from nemo_jetrl.backends.nemo_rl.policy_env import HF_IN_PROJ_SPLIT_ENV

    cls, _ = worker_cls
    bridge = _bridge(tmp_path)
    cfg = model.config
    gdn = {
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [1] + [0] * (cfg.num_layers - 1),
        "linear_num_key_heads": 2, "linear_key_head_dim": 128,
        "linear_num_value_heads": 4, "linear_value_head_dim": 128,
    }  # fmt: skip
    saved = {k: getattr(cfg, k, None) for k in gdn}
    try:
        for k, v in gdn.items():
            setattr(cfg, k, v)
        monkeypatch.setenv(HF_IN_PROJ_SPLIT_ENV, "1")
        with _CudaOnCpu(), pytest.raises(RuntimeError, match="training blocks are not") as ei:
            cls(_cfg(), model=model, bridge=bridge)
        msg = str(ei.value)
        assert (
            "self_attention.in_proj (linear_attn.in_proj_qkv/in_proj_z/in_proj_b/in_proj_a)" in msg
        )
        assert "in_proj_b rows 0-3 + in_proj_a rows 0-3" in msg, msg
        for told in ("0", None):  # Qwen3-Next's split fits at TP 1; unknown: not judged
            if told is None:
                monkeypatch.delenv(HF_IN_PROJ_SPLIT_ENV)
            else:
                monkeypatch.setenv(HF_IN_PROJ_SPLIT_ENV, told)
            with _CudaOnCpu():
                w = cls(_cfg(), model=model, bridge=bridge)
            w._jetrl_kv.restore()
            w._jetrl_bf16.restore()
    finally:
        for k, v in saved.items():
            setattr(cfg, k, v)


def test_the_worker_refuses_a_model_whose_training_blocks_are_not_the_rollouts(worker_cls):
    """Megatron's fused linear_qkv at head_dim 64 (the shims' default): TE's 128-row blocks hold
    a group's K and V rows, the rollout quantizes k_proj and v_proj apart. NeMo-RL's real worker
    class, built with our subclass, stops before any step, naming the linear and the fix
    (megatron/blocks.py; `jetrl check` says it before launch: tests/flow/test_megatron_layout.py)."""
    from megatron_shims import build_gpt, megatron_cpu

    cls, _ = worker_cls
    with megatron_cpu(), _CudaOnCpu():
        model = build_gpt().eval()
        with pytest.raises(RuntimeError, match="training blocks are not the rollout's") as ei:
            cls(_cfg(), model=model, bridge=None)
    assert "self_attention.linear_qkv" in str(ei.value) and "head_dim=64" in str(ei.value)
    assert "jetrl.allow_off_policy=true" in str(ei.value)  # how to run it knowingly


def test_a_run_that_allows_off_policy_builds_the_model_with_a_warning(
    worker_cls, monkeypatch, capfd
):
    """The same model, launched with jetrl.allow_off_policy (the translation sets the worker's
    env: test_nemo_rl_policy_env.py): `jetrl check`'s gate let the run start, so the worker does
    not stop it; it says why the run is off-policy, and its KV hooks are attached."""
    from megatron_shims import build_gpt, megatron_cpu

    from nemo_jetrl.backends.nemo_rl.policy_env import ALLOW_OFF_POLICY_ENV

    cls, _ = worker_cls
    monkeypatch.setenv(ALLOW_OFF_POLICY_ENV, "1")
    with megatron_cpu(), _CudaOnCpu():
        w = cls(_cfg(), model=build_gpt().eval(), bridge=None)
    err = capfd.readouterr().err
    assert "warning: running OFF-POLICY (jetrl.allow_off_policy)" in err
    assert "self_attention.linear_qkv" in err
    assert w._jetrl_kv.layers  # the build went on past the check
    w._jetrl_kv.restore()
    w._jetrl_bf16.restore()
