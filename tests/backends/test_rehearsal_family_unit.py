"""`rehearsal/families.py` without vLLM: how the refusal of an MLA or hybrid-attention family is
derived from vLLM's own code (a CPU platform that raises, a gated-DeltaNet layer without a CPU
forward, a model module that cannot be imported) and what it tells the user. The real vLLM 0.20
and 0.25.1 answers are asserted in the NeMo-RL tier (test_nemo_rl_rehearse_mla.py)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from nemo_jetrl.arch.builtins import resolve_arch
from nemo_jetrl.backends.nemo_rl.rehearsal import families as fam
from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny

MOONLIGHT = "moonshotai/Moonlight-16B-A3B-Instruct"
CAUSE = "vllm/platforms/cpu.py:84 (get_attn_backend_cls) raises NotImplementedError('MLA ...')"

# vLLM 0.20's shape (gdn_linear_attn.py) and 0.25.1's (gdn/qwen_gdn_linear_attn.py), cut down
GDN_020 = """class GatedDeltaNetAttention(PluggableLayer):
    def __init__(self):
        self.gqa = False
        self._forward_method = (
            self.forward_xpu if current_platform.is_xpu() else self.forward_cuda
        )
"""
GDN_025 = """class QwenGatedDeltaNetAttention(Base):
    def __init__(self):
        if current_platform.is_xpu():
            self._forward_method = self.forward_xpu
        elif current_platform.is_cpu():
            self._forward_method = self.forward_cpu

    def forward_cpu(self, hidden_states, output):
        pass
"""


def _vllm_tree(root: Path, layer_module: str, cls: str, source: str) -> Path:
    """A vLLM package at ``root/vllm`` whose qwen3_5 model module builds ``cls``."""
    vllm = root / "vllm"
    models = vllm / "model_executor" / "models"
    models.mkdir(parents=True)
    (models / "qwen3_5.py").write_text(
        f"import torch\nfrom {layer_module} import (\n    {cls},\n)\n"
    )
    layer = vllm.joinpath(*layer_module.split(".")[1:]).with_suffix(".py")
    layer.parent.mkdir(parents=True, exist_ok=True)
    layer.write_text(source)
    return vllm


def test_families_with_a_stand_in_are_not_refused():
    for name in ("Qwen/Qwen3-8B-Base", "Qwen/Qwen3-30B-A3B"):
        assert fam.family_kind(resolve_arch(name)) is None
        assert fam.family_refusal(resolve_arch(name), "c.yaml") is None


def test_a_vllm_without_a_cpu_gated_deltanet_is_named_at_the_line_picking_its_forward(tmp_path):
    layer = "vllm.model_executor.layers.mamba.gdn_linear_attn"
    root = _vllm_tree(tmp_path, layer, "GatedDeltaNetAttention", GDN_020)
    got = fam.gdn_cpu_path("qwen3_5", root)
    assert not got.can
    # line 5: the forward `self._forward_method = (...)` picks in the class above
    assert got.why.startswith("vllm/model_executor/layers/mamba/gdn_linear_attn.py:5: ")
    assert "(GatedDeltaNetAttention) has no CPU forward" in got.why


def test_a_vllm_with_a_cpu_gated_deltanet_says_where(tmp_path):
    layer = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
    root = _vllm_tree(tmp_path, layer, "QwenGatedDeltaNetAttention", GDN_025)
    got = fam.gdn_cpu_path("qwen3_5", root)
    assert got.can
    assert got.why == (
        "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:5: "
        "QwenGatedDeltaNetAttention runs forward_cpu"
    )
    assert not fam.gdn_cpu_path("qwen3_next", root).can  # no such model module: named
    assert "no model module vllm/model_executor/models/qwen3_next.py" in (
        fam.gdn_cpu_path("qwen3_next", root).why
    )


def test_a_model_module_that_cannot_import_names_the_missing_module_and_the_chain(
    tmp_path, monkeypatch
):
    pkg = tmp_path / "fakevllm_models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "qwen3_5.py").write_text("import os\nfrom . import qwen3_vl\n")
    (pkg / "qwen3_vl.py").write_text("X = 1\nimport no_such_module_xyz  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = pkg  # the chain starts in it; paths from its parent, tmp_path
    got = fam.import_model_module("qwen3_5", root, lambda _: __import__("fakevllm_models.qwen3_5"))
    assert not got.can
    assert "No module named 'no_such_module_xyz'" in got.why
    assert "(fakevllm_models/qwen3_5.py:2 -> fakevllm_models/qwen3_vl.py:2)" in got.why
    ok = fam.import_model_module("qwen3_5", root, lambda _: None)
    assert ok.can


def _fake_vllm(monkeypatch, get_attn_backend_cls) -> None:
    """vLLM's CPU platform and selector modules, with ``get_attn_backend_cls`` as given."""
    cpu = types.ModuleType("vllm.platforms.cpu")
    cpu.CpuPlatform = type("CpuPlatform", (), {"get_attn_backend_cls": get_attn_backend_cls})
    selector = types.ModuleType("vllm.v1.attention.selector")
    selector.AttentionSelectorConfig = lambda **kw: types.SimpleNamespace(**kw)
    for name in ("vllm", "vllm.platforms", "vllm.v1", "vllm.v1.attention"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.platforms.cpu", cpu)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.selector", selector)


def test_mla_is_asked_of_the_cpu_platform_and_the_refusal_goes_when_it_selects_a_backend(
    monkeypatch,
):
    asked = {}

    def refuses(cls, _backend, config, num_heads=None):
        asked.update(vars(config))
        raise NotImplementedError("MLA is not supported on CPU.")

    _fake_vllm(monkeypatch, classmethod(refuses))
    got = fam.mla_serving(576, root=Path(__file__).parent / "vllm")  # paths from tests/backends
    assert asked["use_mla"] is True and asked["head_size"] == 576
    line = refuses.__code__.co_firstlineno + 2  # the raise above
    assert got == fam.Serving(
        False,
        f"{Path(__file__).name}:{line} (refuses) raises "
        "NotImplementedError('MLA is not supported on CPU.')",
    )
    # a vLLM whose CPU platform has MLA (0.32: CPU_MLA): vLLM's part of the refusal is gone
    _fake_vllm(monkeypatch, classmethod(lambda cls, b, c, n=None: "cpu_mla.CPUMLABackend"))
    assert fam.mla_serving(576).can
    msg = fam.family_refusal(resolve_arch(MOONLIGHT), "c.yaml", version="0.32.0")
    assert "vLLM 0.32.0's CPU engine can serve MLA here" in msg
    assert "jetrl rehearse has no MLA stand-in yet" in msg


def test_the_refusal_names_the_key_family_version_cause_and_what_to_do_instead():
    serving = fam.Serving(False, CAUSE)
    msg = fam.family_refusal(
        resolve_arch(MOONLIGHT), "m.yaml", ["a_proj", "b_proj"], serving=serving, version="0.25.1"
    )
    assert msg.startswith(
        f"policy.model_name='{MOONLIGHT}' is a deepseek_v3 (MLA, mixture of experts) model; "
        f"vLLM 0.25.1's CPU engine cannot serve MLA: {CAUSE}. Nothing was started."
    )
    assert "`jetrl check m.yaml` gives its on-policy verdict" in msg
    assert "tests/vllm_patch/test_vllm_mla.py" in msg and "vLLM 0.32" in msg
    # MoE -> the MoE stand-in; its BF16 words name layers Qwen3-MoE lacks, so they go
    swap = (
        "`jetrl align m.yaml policy.model_name=Qwen/Qwen3-30B-A3B "
        "policy.generation.vllm_cfg.quantization_ignored_layer_kws=[] -o OUT.yaml` then "
        "`jetrl rehearse OUT.yaml`"
    )
    assert swap in msg and "['a_proj', 'b_proj'] names layers the swapped-in model lacks" in msg
    # a dense hybrid model -> the dense stand-in; no words, no override
    dense = fam.family_refusal(
        resolve_arch("Qwen/Qwen3.5-9B-Base"), "q.yaml", serving=serving, version="0.25.1"
    )
    assert "is a qwen3_5_text (hybrid attention) model" in dense
    assert "`jetrl align q.yaml policy.model_name=Qwen/Qwen3-8B-Base -o OUT.yaml`" in dense
    assert "tests/megatron/test_megatron_bf16_names_gdn.py" in dense


def test_without_a_vllm_to_ask_the_refusal_says_so(monkeypatch):
    def no_vllm(_arch):
        raise ModuleNotFoundError("No module named 'vllm'")

    monkeypatch.setattr(fam, "cpu_serving", no_vllm)
    msg = fam.family_refusal(resolve_arch(MOONLIGHT), "c.yaml", version="(none)")
    assert "this env's vLLM could not be asked whether its CPU engine serves MLA" in msg
    assert "(ModuleNotFoundError: No module named 'vllm')" in msg
    assert "jetrl rehearse has no MLA stand-in" in msg


def test_the_stand_in_builder_still_refuses_these_families_by_name():
    for name, kind in ((MOONLIGHT, "MLA"), ("Qwen/Qwen3.5-9B-Base", "hybrid attention")):
        with pytest.raises(tiny.UnsupportedFamily, match=f"no stand-in for {kind}"):
            tiny.tiny_config(resolve_arch(name), 128)
