"""The rehearsal's substitutes keep the contract of what they replace (NeMo-RL tier, both trees):
each replacement in the vLLM worker takes the real function's parameters, and the CPU policy
implements every abstract method of NeMo-RL's ``ColocatablePolicyInterface`` with parameters
that accept every keyword the real signature names. A NeMo-RL or vLLM release that changes one
of them fails here, before a rehearsal runs a drifted stand-in."""

from __future__ import annotations

import inspect

import pytest

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]


def _params(fn):
    return [
        (p.name, p.kind)
        for p in inspect.signature(fn).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _accepts(ours, real) -> list[str]:
    """Keywords of ``real`` that ``ours`` cannot take."""
    sig = inspect.signature(ours)
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return []
    return [n for n, _ in _params(real) if n not in sig.parameters]


def test_vllm_worker_substitutes_take_the_real_parameters():
    from nemo_rl.models.generation.vllm import vllm_backend
    from vllm.model_executor.layers import utils as layer_utils

    from nemo_jetrl.backends.nemo_rl.rehearsal import cpu_worker

    ext = vllm_backend.VllmInternalWorkerExtension
    assert _params(ext.bind_numa) == [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    assert _params(ext.report_device_id) == [("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    real = vllm_backend.rebuild_cuda_tensor_from_ipc
    assert [n for n, _ in _params(real)] == ["cuda_ipc_handle", "device_id"]
    assert len(_params(cpu_worker.buffer_from_handle)) == 2  # called positionally by NeMo-RL
    gemm = layer_utils.dispatch_cpu_unquantized_gemm
    assert [n for n, _ in _params(cpu_worker._keep_bf16_weight)] == [n for n, _ in _params(gemm)]


def test_cpu_policy_implements_nemo_rls_interface():
    from nemo_rl.models.policy.interfaces import ColocatablePolicyInterface

    from nemo_jetrl.backends.nemo_rl.rehearsal.policy import make_cpu_policy_class

    cls = make_cpu_policy_class()
    assert issubclass(cls, ColocatablePolicyInterface)
    assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__
    for name in sorted(ColocatablePolicyInterface.__abstractmethods__):
        real = getattr(ColocatablePolicyInterface, name)
        missing = _accepts(getattr(cls, name), real)
        assert not missing, f"CpuPolicy.{name} does not take {missing} (NeMo-RL's signature)"
    # what grpo.setup passes its policy_factory (keywords), as NeMo-RL's Policy takes them
    from nemo_rl.models.policy.lm_policy import Policy

    setup_keys = ("cluster", "config", "tokenizer", "processor", "weights_path",
                  "optimizer_path", "init_optimizer", "init_reference_model")  # fmt: skip
    for key in setup_keys:
        assert key in inspect.signature(Policy.__init__).parameters, key
        assert key in inspect.signature(cls.__init__).parameters, key


def test_the_uni_executor_substitute_wraps_the_platforms_own_check():
    """``uni_executor`` replaces this vLLM's ``CpuPlatform.check_and_update_config`` with one
    of the same parameters that calls it, and reverting puts the platform's own back."""
    from vllm.platforms.cpu import CpuPlatform

    from nemo_jetrl.vllm_patch.uni_executor import keep_uni_executor

    own = CpuPlatform.__dict__["check_and_update_config"]
    assert isinstance(own, classmethod)
    ours = keep_uni_executor(CpuPlatform, lambda: None)
    assert (
        _params(ours.__func__)
        == _params(own.__func__)
        == [
            ("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            ("vllm_config", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ]
    )
