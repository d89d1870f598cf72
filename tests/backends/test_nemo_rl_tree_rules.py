"""What the NeMo-RL tree a run imports does with BF16 edge layers and TE's FP8 weights, read from
its source before launch (`tree_rules`): the facts of both real trees, the refusals by key, and
`jetrl train`'s door (`launch.prepare`) refusing before any work. The facts against the trees'
real behaviour (NeMo-RL's `init_fp8` and vLLM's `ignored_layers` match): the `nemo_rl` test in
tests/backends/test_nemo_rl_tree_rules_real.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import NEMO_RL_UPSTREAM

from nemo_jetrl.backends.nemo_rl import launch as nr
from nemo_jetrl.backends.nemo_rl import tree_rules as tr
from nemo_jetrl.errors import UserError
from nemo_jetrl.recipe import Recipe

QWEN = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_8b_base"
TREES = {"v0.7.0": "v0.7.0", "main-7ea279a": "main"}  # upstream folder -> jetrl check's name
needs_trees = pytest.mark.skipif(
    not NEMO_RL_UPSTREAM.is_dir(), reason=f"NeMo-RL's source ({NEMO_RL_UPSTREAM}) absent"
)


def _facts(nested: bool, exports: bool) -> tr.TreeFacts:
    return tr.TreeFacts("NeMo-RL at /opt/nemo-rl/nemo_rl", nested, exports)


@needs_trees
@pytest.mark.parametrize("tree", sorted(TREES))
def test_each_trees_source_gives_its_facts(tree):
    facts = tr.read_tree(NEMO_RL_UPSTREAM / tree / "nemo_rl")
    assert facts is not None and facts.source == f"NeMo-RL at {NEMO_RL_UPSTREAM / tree / 'nemo_rl'}"
    known = tr.KNOWN_TREES[TREES[tree]]  # what `jetrl check` answers for that tree
    assert (facts.nested_bf16_edges, facts.exports_te_fp8) == (
        known.nested_bf16_edges,
        known.exports_te_fp8,
    )
    assert (known.nested_bf16_edges, known.exports_te_fp8) == (tree == "v0.7.0", tree != "v0.7.0")


def test_a_tree_without_the_files_gives_no_facts_and_no_problems(tmp_path):
    (tmp_path / "nemo_rl").mkdir()
    assert tr.read_tree(tmp_path / "nemo_rl") is None
    assert tr.tree_problems(None, Recipe.preset("jetrl"), num_layers=4, hooked=True) == []


def test_bf16_edge_layers_on_a_nested_list_tree_are_refused_with_the_names_that_work():
    r = Recipe.preset("jetrl")
    r = r.with_(rollout=r.rollout.with_(bf16_first_layers=2, bf16_last_layers=1))
    problems = dict(tr.tree_problems(_facts(True, False), r, num_layers=6, hooked=False))
    assert set(problems) == {
        "policy.generation.vllm_cfg.num_first_layers_in_bf16",
        "policy.generation.vllm_cfg.num_last_layers_in_bf16",
    }
    why = problems["policy.generation.vllm_cfg.num_first_layers_in_bf16"]
    assert why.startswith("2: NeMo-RL at /opt/nemo-rl/nemo_rl")
    assert "quantization_ignored_layer_kws=['layers.0.', 'layers.1.', 'layers.5.']" in why
    # a tree that extends the list, or a BF16 rollout, has nothing to refuse
    assert tr.tree_problems(_facts(False, True), r, num_layers=6, hooked=False) == []
    bf16 = r.with_(rollout=r.rollout.with_(fp8_linears=False))
    assert tr.tree_problems(_facts(True, False), bf16, num_layers=6, hooked=False) == []


def test_fp8_primary_weights_are_refused_where_the_trees_refit_would_change_them():
    r = Recipe.preset("jetrl")
    r = r.with_(train=r.train.with_(fp8_param=True))
    key = "policy.megatron_cfg.fp8_cfg.fp8_param"
    for hooked, says in ((True, "the refit hook loads BF16 weights only"), (False, "as if")):
        problems = tr.tree_problems(_facts(False, True), r, num_layers=4, hooked=hooked)
        assert [k for k, _ in problems] == [key] and says in problems[0][1]
        assert "set it to false" in problems[0][1]
    # v0.7.0 refits them dequantized to BF16: exact with power-of-two scales only
    assert tr.tree_problems(_facts(True, False), r, num_layers=4, hooked=True) == []
    fp32 = r.with_(train=r.train.with_(pow2_weight_scales=False, pow2_activation_scales=False))
    # main without the hook and with FP32 scales: NeMo-RL's loader keeps TE's codes
    assert tr.tree_problems(_facts(False, True), fp32, num_layers=4, hooked=False) == []
    problems = tr.tree_problems(_facts(True, False), fp32, num_layers=4, hooked=True)
    assert [k for k, _ in problems] == [key] and "FP32 weight scales" in problems[0][1]
    # fp8_param off, or a BF16 rollout: nothing to refuse
    assert (
        tr.tree_problems(_facts(False, True), Recipe.preset("jetrl"), num_layers=4, hooked=True)
        == []
    )
    bf16 = r.with_(rollout=r.rollout.with_(fp8_linears=False))
    assert tr.tree_problems(_facts(False, True), bf16, num_layers=4, hooked=False) == []


@needs_trees
def test_jetrl_train_refuses_both_before_any_work_and_together(monkeypatch):
    """The door users run: ``launch.prepare`` reads the tree the run imports."""
    advice = ""
    for tree, overrides in (
        ("v0.7.0", ["policy.generation.vllm_cfg.num_first_layers_in_bf16=1"]),
        ("main-7ea279a", ["policy.megatron_cfg.fp8_cfg.fp8_param=true"]),
    ):
        monkeypatch.setattr(nr, "nemo_rl_package", lambda t=tree: NEMO_RL_UPSTREAM / t / "nemo_rl")
        with pytest.raises(UserError, match=rf"NeMo-RL at {NEMO_RL_UPSTREAM / tree}") as ei:
            nr.prepare(str(QWEN / "jetrl.yaml"), [*overrides, "jetrl.allow_off_policy=true"])
        advice = advice if tree != "v0.7.0" else str(ei.value)
        assert overrides[0].split("=")[0] in str(ei.value)
    # the advice works on v0.7.0: those layers by name, both sides, on-policy
    words = re.search(r"quantization_ignored_layer_kws=\[([^]]*)\]", advice).group(1)
    monkeypatch.setattr(nr, "nemo_rl_package", lambda: NEMO_RL_UPSTREAM / "v0.7.0" / "nemo_rl")
    kws = words.replace("'", "").replace(" ", "")
    p = nr.prepare(
        str(QWEN / "jetrl.yaml"),
        [f"+policy.generation.vllm_cfg.quantization_ignored_layer_kws=[{kws}]",
         f"+jetrl.train_bf16_layer_kws=[{kws}]"],
    )  # fmt: skip
    assert (
        p.plan.recipe.rollout.bf16_layer_kws == p.plan.recipe.train.bf16_layer_kws == ("layers.0.",)
    )
    # the same configs on the other tree run (and without a tree nothing is asked)
    monkeypatch.setattr(
        nr, "nemo_rl_package", lambda: NEMO_RL_UPSTREAM / "main-7ea279a" / "nemo_rl"
    )
    p = nr.prepare(
        str(QWEN / "jetrl.yaml"),
        ["policy.generation.vllm_cfg.num_first_layers_in_bf16=1", "jetrl.allow_off_policy=true"],
    )
    assert p.plan.master_config["policy"]["generation"]["vllm_cfg"]["num_first_layers_in_bf16"] == 1
    monkeypatch.setattr(nr, "nemo_rl_package", lambda: None)
    p = nr.prepare(str(QWEN / "jetrl.yaml"), ["policy.megatron_cfg.fp8_cfg.fp8_param=true"])
    assert p.plan.recipe.train.fp8_param


def test_the_package_found_is_the_one_python_would_import(tmp_path, monkeypatch):
    (tmp_path / "nemo_rl").mkdir()
    (tmp_path / "nemo_rl" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "nemo_rl", raising=False)
    assert tr.nemo_rl_package() == tmp_path / "nemo_rl"


def test_without_an_importable_nemo_rl_the_env_checkout_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(tr.importlib.util, "find_spec", lambda name: None)
    assert tr.nemo_rl_package({"NEMO_RL_DIR": str(tmp_path)}) is None
    (tmp_path / "nemo_rl").mkdir()
    assert tr.nemo_rl_package({"NEMO_RL_DIR": str(tmp_path)}) == tmp_path / "nemo_rl"
    assert tr.nemo_rl_package({}) is None


def _round_trip(pow2: bool):
    """TE's FP8 primary weights from an fp32 master, exported as v0.7.0 does (dequantized to
    BF16) and quantized again by the refit: (TE's, the rollout's)."""
    from nemo_jetrl.fp8 import quantize_blockwise

    g = torch.Generator().manual_seed(0)
    master = torch.randn(256, 384, generator=g) * 0.004  # every |value| below 0.02
    master[5, 7] = 228 / 4096  # block (0, 0): amax x 2^12 = 228 -> its largest code is 224
    te = quantize_blockwise(master, (128, 128), pow2_scales=pow2)
    exported = te.dequantize(torch.bfloat16)  # code.to(fp32) * scale_inv, then .to(bf16)
    return te, quantize_blockwise(exported, (128, 128), pow2_scales=pow2)


def test_fp8_param_weights_refit_in_bf16_keep_their_values_only_with_pow2_scales():
    """Why v0.7.0 + fp8_param is refused with FP32 weight scales and runs with power-of-two
    ones (`tree_rules` docstring), on TE's formula (our quantizer is bit-exact to it)."""
    from nemo_jetrl.fp8 import blockwise_matmul, quantize_blockwise

    te, rollout = _round_trip(pow2=True)
    assert torch.equal(te.dequantize(), rollout.dequantize())  # the same weights
    # bytes differ exactly in the blocks whose largest code is 224: codes x 2, scale / 2
    max_code = te.data.float().abs().reshape(2, 128, 3, 128).amax(dim=(1, 3))
    moved = (te.scale_inv != rollout.scale_inv).nonzero().tolist()
    assert moved == (max_code == 224).nonzero().tolist() and [0, 0] in moved
    assert torch.equal(rollout.scale_inv[0, 0] * 2, te.scale_inv[0, 0])
    g = torch.Generator().manual_seed(1)
    x = quantize_blockwise(torch.randn(16, 384, generator=g), (1, 128), pow2_scales=True)
    out_te = blockwise_matmul(x, te, exact=True, out_dtype=torch.float32)
    assert torch.equal(out_te, blockwise_matmul(x, rollout, exact=True, out_dtype=torch.float32))
    # control: FP32 scales, same master: the BF16 rounding moves the scales (codes stay)
    te, rollout = _round_trip(pow2=False)
    assert (te.scale_inv != rollout.scale_inv).sum().item() >= 3
    assert (te.dequantize() != rollout.dequantize()).sum().item() > 1000


def test_jetrl_check_lists_what_the_launch_would_refuse_per_tree(capsys):
    """`jetrl check` answers for both trees (`KNOWN_TREES`) what `jetrl train` refuses."""
    import json

    from nemo_jetrl.cli import main as jetrl

    cfg, fp8_param = str(QWEN / "jetrl.yaml"), "policy.megatron_cfg.fp8_cfg.fp8_param=true"
    assert jetrl(["check", cfg, fp8_param]) == 0  # the verdict's exit code: on-policy recipe
    out = capsys.readouterr().out
    refusal = out[
        out.index("jetrl train --backend nemo-rl would refuse it") : out.index("verdict:")
    ]
    assert (
        "on NeMo-RL main:\n    - policy.megatron_cfg.fp8_cfg.fp8_param: true: NeMo-RL main"
        in refusal
    )
    assert "v0.7.0" not in refusal
    assert jetrl(["check", cfg, fp8_param, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    got = summary["nemo_rl_launch_refusals"]
    assert got["v0.7.0"] == [] and [p["key"] for p in got["main"]] == [fp8_param.split("=")[0]]
    # each backend entry carries the text report's "(but jetrl train refuses ...)" marker
    marked = {b["backend"]: b["launch_refused"] for b in summary["backends"]}
    assert marked["nemo-rl main"] is True and marked["nemo-rl v0.7.0"] is False
    assert not any(v for k, v in marked.items() if not k.startswith("nemo-rl"))
    # the same refusal on both trees is printed once; the trainer's keys are named
    assert jetrl(["check", cfg, "+grpo.async_grpo.enabled=true"]) == 1  # policy lag
    out = capsys.readouterr().out
    assert (
        "  on NeMo-RL v0.7.0 and main:\n    - policy.generation.vllm_cfg.async_engine: false: "
        "NeMo-RL's async GRPO needs vLLM's async engine" in out
    )
    assert "    - policy.generation.colocated.enabled: true: " in out
    # the nemo-rl lines above it say so (the precision verdict alone read as "it runs")
    assert "nemo-rl main: on-policy (but jetrl train refuses this config there: see below):" in out
    # translate's refusal and the trainer's are listed together (main refuses fp8_param too)
    assert jetrl(["check", cfg, fp8_param, "+grpo.async_grpo.enabled=true", "--json"]) == 1
    got = json.loads(capsys.readouterr().out)["nemo_rl_launch_refusals"]
    assert [p["key"] for p in got["main"]] == [
        "policy.megatron_cfg.fp8_cfg.fp8_param",
        "policy.generation.vllm_cfg.async_engine",
        "policy.generation.colocated.enabled",
    ]
    # the trainer's keys are read resolved, as translate reads them (an interpolation is text)
    off = "grpo.async_grpo.enabled=${oc.decode:'false'}"
    assert jetrl(["check", cfg, fp8_param, "+" + off, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["nemo_rl_launch_refusals"]
    assert [p["key"] for p in got["main"]] == ["policy.megatron_cfg.fp8_cfg.fp8_param"]
    fp8_param_out = jetrl(["check", cfg, fp8_param]) == 0 and capsys.readouterr().out
    assert "nemo-rl v0.7.0: on-policy: refit" in fp8_param_out
    assert "nemo-rl main: on-policy (but jetrl train refuses" in fp8_param_out
    # nothing to refuse: no section
    assert jetrl(["check", cfg]) == 0
    assert "would refuse" not in capsys.readouterr().out
