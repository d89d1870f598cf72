"""`nemo_jetrl.vllm_patch.uni_executor` (the rehearsal's ``uni_executor`` substitute, and the vLLM
tier's in-process engines: tests/vllm_fixtures.vllm_cpu_env) on a labelled stand-in platform whose
check does what vLLM 0.20's CPU platform does to a one-worker engine (``uni`` -> ``mp``, whatever
``VLLM_ENABLE_V1_MULTIPROCESSING`` says). The real platform's parameters are compared in
test_nemo_rl_rehearsal_contract.py; a rehearsal on vLLM 0.20 reads the substitute back from the
engine (tests/backends/rehearsals.assert_ready), and the vLLM tier's engines run ``uni``
(tests/vllm_patch/test_vllm_cpu_gemm.py's last test)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nemo_jetrl.vllm_patch import uni_executor


class StandInCpuPlatform:  # stand-in: vLLM 0.20's rule, nothing else
    checked = 0

    @classmethod
    def check_and_update_config(cls, vllm_config):
        cls.checked += 1
        if vllm_config.parallel_config.distributed_executor_backend == "uni":
            vllm_config.parallel_config.distributed_executor_backend = "mp"


def _config(backend: str):
    return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend))


@pytest.mark.parametrize(
    ("before", "multiprocessing", "after", "kept"),
    [
        ("uni", "0", "uni", 1),  # NeMo-RL's one-worker engine: in the actor, as on a GPU
        ("uni", "1", "mp", 0),  # vLLM's default (multiprocessing on): the platform's choice
        ("uni", None, "mp", 0),
        ("mp", "0", "mp", 0),  # asked for mp: left alone
        ("ray", "0", "ray", 0),  # NeMo-RL's TP > 1 engine
    ],
)
def test_uni_is_kept_only_for_a_one_worker_engine_with_multiprocessing_off(
    monkeypatch, before, multiprocessing, after, kept
):
    if multiprocessing is None:
        monkeypatch.delenv(uni_executor.MULTIPROCESSING, raising=False)
    else:
        monkeypatch.setenv(uni_executor.MULTIPROCESSING, multiprocessing)
    calls = []
    check = uni_executor.keep_uni_executor(StandInCpuPlatform, lambda: calls.append(1))
    monkeypatch.setattr(StandInCpuPlatform, "check_and_update_config", check)
    cfg = _config(before)
    checked = StandInCpuPlatform.checked
    StandInCpuPlatform().check_and_update_config(cfg)  # vLLM calls it on the platform instance
    assert StandInCpuPlatform.checked == checked + 1  # the platform's own check always ran
    assert cfg.parallel_config.distributed_executor_backend == after
    assert len(calls) == kept
