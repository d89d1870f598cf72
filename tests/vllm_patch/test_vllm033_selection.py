"""vLLM 0.33.0's own kernel registry and selection code with our patch, on a CUDA stand-in.

vLLM 0.33.0 has no CPU build, so no engine of it can run here. Its CUDA wheel's Python code
(scripts/fetch_vllm_src.sh: downloaded once, pinned sha256, cached) is imported in a subprocess
by ``standins/vllm_cuda_selection_probe.py``, which installs a clearly labelled CUDA platform
stand-in (see its docstring) and reports what 0.33's code does: our kernel first in the CUDA
block-FP8 list and chosen by ``choose_scaled_mm_linear_kernel``; ``_resolve_backend_kernels``
dropping it for ``linear_backend='cutlass'`` or the ``fp8_block_w8a8`` per-quant override (what
``build_engine_kwargs`` refuses); ``VLLM_DISABLED_KERNELS`` refused by ``apply_patches``; the
registry restored on revert and after a refusal.

Runs in the vLLM 0.32 tier (.venv-vllm: its torch 2.13 and transformers 5.19 are the closest to
0.33.0's pins, and 0.33's code runs there); other tiers skip it with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_jetrl.vllm_patch import EngineArgsConflict, build_engine_kwargs

pytestmark = [
    pytest.mark.vllm,
    # 0.33.0's own source, whatever vLLM is installed: run once, beside the closest pins (0.32)
    pytest.mark.vllm_versions("0.32", why="vLLM 0.33.0's source, not the installed vLLM"),
]

REPO = Path(__file__).resolve().parents[2]
SRC = Path(os.environ.get("JETRL_VLLM033_SRC", REPO / ".cache" / "vllm-src" / "0.33.0"))
PROBE = Path(__file__).parent / "standins" / "vllm_cuda_selection_probe.py"
OURS = "JetRLFp8BlockLinearKernel"


@pytest.fixture(scope="module")
def probe() -> dict:
    import vllm

    from nemo_jetrl.vllm_patch.compat import release

    if release(vllm.__version__)[:2] != (0, 32):
        pytest.skip("runs in the vLLM 0.32 tier (.venv-vllm), the closest to 0.33.0's pins")
    if not (SRC / ".complete").is_file():
        pytest.skip(f"no vLLM 0.33.0 source at {SRC}: run bash scripts/fetch_vllm_src.sh")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("VLLM_DISABLED_KERNELS", None)
    env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(SRC)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE-RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("PROBE-RESULT "))


def test_probe_runs_vllm_033_code(probe):
    assert probe["vllm_version"] == "0.33.0"
    assert probe["vllm_file"].startswith(str(SRC))  # not the installed 0.32 build


def test_our_kernel_is_first_and_chosen_on_cuda(probe):
    assert OURS not in probe["cuda_before"]
    assert probe["cuda_patched"] == [OURS, *probe["cuda_before"]]
    assert probe["ours_supported"] == [True, ""]
    assert probe["chosen_auto"] == OURS


def test_linear_backend_drops_our_kernel_in_033_and_the_guard_refuses_it(probe):
    # What vLLM 0.33 does with a non-auto backend on CUDA: only that backend's kernels remain.
    assert probe["resolved_cutlass"] == ["CutlassFp8BlockScaledMMKernel"]
    assert probe["resolved_per_quant_cutlass"] == ["CutlassFp8BlockScaledMMKernel"]
    assert probe["resolved_per_quant_other_scheme"][0] == OURS  # other schemes: not ours to veto
    # ... and the names the guard reads are 0.33's engine-argument names.
    assert probe["engine_args_fields"] == ["kernel_config", "linear_backend"]
    assert probe["kernel_config_fields"] == ["linear_backend", "linear_backend_per_quant"]
    for user in (
        {"linear_backend": "cutlass"},
        {"kernel_config": {"linear_backend_per_quant": {"fp8_block_w8a8": "cutlass"}}},
    ):
        with pytest.raises(EngineArgsConflict, match="the recipe requires 'auto'"):
            build_engine_kwargs(_jetrl(), user)


def test_disabled_kernel_in_033_refused_and_registry_restored(probe):
    ok, why = probe["ours_supported_disabled"]
    assert not ok and f"{OURS} is disabled by environment variable" in why
    assert probe["disabled_refusal"] is not None
    assert f"names {OURS}" in probe["disabled_refusal"]
    assert probe["cuda_reverted"] == probe["cuda_before"]
    assert probe["cuda_after_refusal"] == probe["cuda_before"]


def _jetrl():
    from nemo_jetrl.recipe import Recipe

    return Recipe.preset("jetrl")
