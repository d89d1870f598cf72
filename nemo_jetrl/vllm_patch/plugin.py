"""The ``vllm.general_plugins`` entry point: applies the patch in vLLM's own processes.

vLLM calls every general plugin in each process it starts (engine core, workers) and in the
main process. This one does nothing unless ``apply_patches`` set ``NEMO_JETRL_VLLM_PATCH`` in the
environment the process inherited; then it registers our kernel with those settings. With
``NEMO_JETRL_VLLM_CPU_FIXES=1`` (our CPU engine environments) it first fixes what vLLM's CPU
build needs (`cpu_fixes`). Under a NeMo-RL launch it first checks that this process imports the
driver's nemo_jetrl sources (`build_info.driver_code_problem`). It never
fails silently: a malformed variable or an unsupported vLLM raises, which stops the engine with
the reason.
"""

from __future__ import annotations

import os

from nemo_jetrl.vllm_patch.settings import ENV_VAR, PatchSettings


def load_in_worker() -> None:
    """Entry point named in pyproject.toml; safe to call many times."""
    from nemo_jetrl.build_info import driver_code_problem
    from nemo_jetrl.vllm_patch import cpu_fixes

    problem = driver_code_problem("a vLLM process of the rollout")  # set by the NeMo-RL launch
    if problem:
        raise RuntimeError(problem)

    if os.environ.get(cpu_fixes.ENV) == "1":  # set by our CPU engine environments
        cpu_fixes.apply()
    text = os.environ.get(ENV_VAR)
    if not text:
        return
    from nemo_jetrl.vllm_patch.patch import apply_in_process

    apply_in_process(PatchSettings.from_json(text))
