"""`jetrl check`'s fix lines paste as they are (`nemo_jetrl.flow.fixes`).

A user copies a ``fix:`` (or ``or:``) line after ``jetrl check CONFIG``. NeMo-RL's own configs
have no ``jetrl:`` section and often no ``pow2_*_scaling_factors`` keys, so a plain
``jetrl.vllm_patch=true`` was refused (exit 2: "key not in config; use +jetrl.vllm_patch=...");
and the Qwen3.5 list fix named ``linear_attn.in_proj_a/b``, which the check itself refuses in
the training list (Megatron runs the whole in_proj as one GEMM). On real upstream configs with
fixable mismatches: every alternative of every fix, pasted, gives exit 0 or 1 (never 2) and that
mismatch is gone; so do all fixes pasted together; ``--json`` carries the same overrides.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
from conftest import NEMO_RL_UPSTREAM
from omegaconf import OmegaConf

from nemo_jetrl.cli import main
from nemo_jetrl.config import load_config
from nemo_jetrl.config.overrides import key_presence, parse_override
from nemo_jetrl.flow.fixes import fix_options, pasteable_fixes, shell_line

LLM = "examples/configs/recipes/llm"
CONFIGS = [
    # training BF16, rollout FP8; its second alternative turns the rollout BF16
    ("v0.7.0", f"{LLM}/grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3.yaml"),
    ("main-7ea279a", f"{LLM}/grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3.yaml"),
    # Qwen3.5: jetrl.vllm_patch and the per-name lists, both absent from the file
    ("main-7ea279a", f"{LLM}/grpo-qwen3.5-9b-1n8g-megatron-fp8.yaml"),
    ("main-7ea279a", f"{LLM}/grpo-qwen3.5-35ba3b-2n8g-megatron-ep16tp2-fp8.yaml"),
    ("v0.7.0", f"{LLM}/grpo-llama3.1-8b-instruct-2n8g-megatron-fp8-e2e.yaml"),
    ("v0.7.0", f"{LLM}/grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml"),
    ("v0.7.0", f"{LLM}/grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml"),
    ("main-7ea279a", f"{LLM}/grpo-minimax-m27-dapo-8n8g-automodel.yaml"),
    ("main-7ea279a", f"{LLM}/performance/grpo-qwen3-32b-4n4g-mxfp8-rollout.yaml"),
    # policy lag too: the precision mismatches are listed below the lag
    ("v0.7.0", f"{LLM}/performance/grpo-deepseek-v3-64n8g-fp8-async-1off.yaml"),
    # a model without a built-in description (generic layers)
    ("v0.7.0", "examples/configs/grpo_math_70B_megatron_fp8.yaml"),
]


@pytest.fixture(autouse=True)
def _clean_te_scale_env(monkeypatch):
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)


def _check(capsys, path, *args: str) -> tuple[int, str]:
    code = main(["check", str(path), *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out + err


def _mismatches(out: str) -> list[tuple[str, list[list[str]]]]:
    """(why, alternatives as argument lists) of each numbered mismatch of a report."""
    found = []
    for block in re.split(r"\n(?=\d+\. )", out.split("\nverdict: ", 1)[1])[1:]:
        why = re.search(r"^   why:  (.*)$", block, re.M).group(1)
        lines = re.findall(r"^   (?:fix:|or: ) {2}(.*)$", block, re.M)
        found.append((why, [shlex.split(line) for line in lines]))
    return found


def _has(cfg, key: str) -> bool:
    absent = object()
    return (
        OmegaConf.select(cfg, key, default=absent, throw_on_resolution_failure=False) is not absent
    )


def _upstream(tree: str, rel: str):
    path = NEMO_RL_UPSTREAM / tree / rel
    if not path.is_file():
        pytest.skip(f"NeMo-RL's shipped config not found: {path} (set JETRL_NEMO_RL_UPSTREAM)")
    return path


@pytest.mark.parametrize(
    ("tree", "rel"), CONFIGS, ids=[f"{t}:{r.rsplit('/', 1)[1]}" for t, r in CONFIGS]
)
def test_pasted_fixes_are_accepted_and_remove_their_mismatch(capsys, tree, rel):
    path = _upstream(tree, rel)
    code, out = _check(capsys, path)
    assert code == 1, out
    mismatches = _mismatches(out)
    assert mismatches and all(options for _, options in mismatches), out
    cfg = load_config(path)
    for why, options in mismatches:
        for option in options:
            for override in option:  # the loader's rule: + exactly when the key is absent
                op, key, _ = parse_override(override)
                assert op == ("set" if _has(cfg, key) else "add"), override
            code, after = _check(capsys, path, *option)
            assert code in (0, 1), f"{shell_line(option)}\n{after}"
            assert why not in after, f"{shell_line(option)} left: {why}"
    # all of them at once (the first alternative of each, each override once)
    every = list(dict.fromkeys(o for _, options in mismatches for o in options[0]))
    code, after = _check(capsys, path, *every)
    assert code in (0, 1), f"{shell_line(every)}\n{after}"
    assert not [why for why, _ in mismatches if why in after], after


@pytest.mark.parametrize(
    "rel",
    [
        f"{LLM}/grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3.yaml",
        f"{LLM}/grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml",
    ],
)
def test_following_the_fixes_round_by_round_ends_on_policy(capsys, rel):
    """Pasting each round's fix lines after the last round's: training FP8 on, then pow2 scales
    on the rollout, then our vLLM patch (with pow2_activation_scaling_factors back off, which
    validation refuses beside the patch); never exit 2 on the way."""
    path = _upstream("v0.7.0", rel)
    args: list[str] = []
    for _ in range(4):
        code, out = _check(capsys, path, *args)
        assert code in (0, 1), f"{shell_line(args)}\n{out}"
        if code == 0:
            break
        args += dict.fromkeys(o for _, options in _mismatches(out) for o in options[0])
    assert code == 0, f"{shell_line(args)}\n{out}"
    assert "+jetrl.vllm_patch=true" in args


@pytest.mark.parametrize(
    "rel",
    [
        f"{LLM}/grpo-qwen3.5-9b-1n8g-megatron-fp8.yaml",
        f"{LLM}/grpo-qwen3.5-35ba3b-2n8g-megatron-ep16tp2-fp8.yaml",
    ],
)
def test_qwen35_list_fix_is_what_align_writes(capsys, tmp_path, rel):
    """The check's list fix names the whole in_proj, as `jetrl align` does, and the fixes
    together make the config on-policy."""
    path = _upstream("main-7ea279a", rel)
    code, out = _check(capsys, path)
    assert code == 1
    mismatches = _mismatches(out)
    (option,) = next(o for why, o in mismatches if "per-name BF16 list" in why)
    lists = dict(parse_override(o)[1:] for o in option)
    whole = ["linear_attn.conv1d", "linear_attn.in_proj", "visual"]
    assert lists == {
        "jetrl.train_bf16_layer_kws": whole,
        "policy.generation.vllm_cfg.quantization_ignored_layer_kws": whole,
    }
    every = list(dict.fromkeys(o for _, options in mismatches for o in options[0]))
    code, out = _check(capsys, path, *every)
    assert code == 0, out
    assert main(["align", str(path), "-o", str(tmp_path / "a.yaml")]) in (0, 1)
    capsys.readouterr()
    aligned = load_config(tmp_path / "a.yaml")
    assert list(aligned.jetrl.train_bf16_layer_kws) == whole
    assert list(aligned.policy.generation.vllm_cfg.quantization_ignored_layer_kws) == whole


def test_json_fixes_carry_the_same_overrides(capsys):
    path = _upstream("v0.7.0", CONFIGS[0][1])
    code, out = _check(capsys, path)
    text = [options for _, options in _mismatches(out)]
    code, out = _check(capsys, path, "--json")
    assert code == 1
    data = json.loads(out)
    assert [m["fix_options"] for m in data["mismatches"]] == text
    (m,) = data["mismatches"]
    assert m["fixes"] == [
        "policy.megatron_cfg.fp8_cfg.enabled=true",
        "or policy.generation.vllm_cfg.precision=bfloat16",
    ]


def test_fix_options_follow_the_loaded_config():
    cfg = load_config(
        "examples/configs/nemo_rl_fp8_e2e.yaml", ["~policy.generation.vllm_cfg.kv_cache_dtype"]
    )
    fixes = (
        "jetrl.train_bf16_layer_kws=['a', 'b.c']",
        "and policy.generation.vllm_cfg.quantization_ignored_layer_kws=['a', 'b.c']",
        "jetrl.vllm_patch=true",
        "or policy.generation.vllm_cfg.kv_cache_dtype=auto",
    )
    assert fix_options(key_presence(cfg), fixes) == [
        [
            "+jetrl.train_bf16_layer_kws=[a,b.c]",
            "+policy.generation.vllm_cfg.quantization_ignored_layer_kws=[a,b.c]",
            "jetrl.vllm_patch=true",  # the example has a jetrl: section
        ],
        ["+policy.generation.vllm_cfg.kv_cache_dtype=auto"],  # deleted above
    ]
    assert pasteable_fixes(key_presence(cfg), fixes)[1].startswith("and +policy.generation")
    assert (
        pasteable_fixes(key_presence(cfg), fixes)[3]
        == "or +policy.generation.vllm_cfg.kv_cache_dtype=auto"
    )
    assert shell_line(["+a.b=[x,y]", "c=1"]) == "'+a.b=[x,y]' c=1"


def test_align_keeps_the_vision_tower_bf16_in_an_fp8_rollout(capsys, tmp_path):
    """Qwen3.5 with a rollout list that does not name 'visual': vLLM would quantize the tower
    (training keeps it BF16). Align's output was off-policy on it (found by the check-fix
    review); it now names the tower on both lists and checks ON-POLICY."""
    path = _upstream("main-7ea279a", f"{LLM}/grpo-qwen3.5-9b-1n8g-megatron-fp8.yaml")
    ours = "policy.generation.vllm_cfg.quantization_ignored_layer_kws=[linear_attn.conv1d,linear_attn.in_proj]"
    code, out = _check(capsys, path, ours)
    assert code == 1 and "vision tower" in out
    out_yaml = tmp_path / "a.yaml"
    assert main(["align", str(path), ours, "-o", str(out_yaml)]) == 0
    capsys.readouterr()
    aligned = load_config(out_yaml)
    want = ["linear_attn.conv1d", "linear_attn.in_proj", "visual"]
    assert list(aligned.policy.generation.vllm_cfg.quantization_ignored_layer_kws) == want
    assert list(aligned.jetrl.train_bf16_layer_kws) == want


def test_align_of_a_model_without_a_description_still_aligns(capsys, tmp_path):
    """A model nemo_jetrl has no description of (main's 70B FP8 recipe: no built-in arch, no
    config.json): align has no arch to ask about a vision tower (the first version of that rule
    raised AttributeError there, found by the NeMo-RL tier's sweep)."""
    path = _upstream("main-7ea279a", "examples/configs/grpo_math_70B_megatron_fp8.yaml")
    out_yaml = tmp_path / "a.yaml"
    code = main(["align", str(path), "-o", str(out_yaml)])
    err = capsys.readouterr().err
    assert code in (0, 1) and "Traceback" not in err and out_yaml.is_file(), err
