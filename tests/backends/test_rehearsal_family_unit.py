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


QWEN3_NEXT = {  # Qwen3-Next: hybrid, no stand-in (its fused in_proj_qkvz checkpoint)
    "model_type": "qwen3_next", "hidden_size": 2048, "intermediate_size": 5120,
    "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "full_attention_interval": 4, "vocab_size": 1000,
}  # fmt: skip


def test_the_stand_in_builder_still_refuses_these_families_by_name():
    from nemo_jetrl.arch.model import ModelArch

    for arch, kind in (
        (resolve_arch(MOONLIGHT), "MLA"),
        (ModelArch.from_hf_config(QWEN3_NEXT), "hybrid attention"),
    ):
        with pytest.raises(tiny.UnsupportedFamily, match=f"no stand-in for {kind}"):
            tiny.tiny_config(arch, 128)


def test_qwen35_is_rehearsed_where_vllm_serves_it_and_refused_where_not():
    for name in ("Qwen/Qwen3.5-9B-Base", "Qwen/Qwen3.5-35B-A3B-Base"):
        arch = resolve_arch(name)
        assert fam.family_refusal(arch, "q.yaml", serving=fam.Serving(True, "ok")) is None
        no = fam.family_refusal(arch, "q.yaml", serving=fam.Serving(False, "no CPU forward"))
        assert "cannot serve hybrid attention: no CPU forward" in no
    # Qwen3-Next: vLLM may serve it, the rehearsal has no stand-in: still refused, saying so
    nxt = _arch_from(QWEN3_NEXT)
    msg = fam.family_refusal(nxt, "n.yaml", serving=fam.Serving(True, "ok"), version="0.25.1")
    assert "can serve hybrid attention here (ok), but jetrl rehearse has no" in msg


def _arch_from(raw: dict):
    from nemo_jetrl.arch.model import ModelArch

    return ModelArch.from_hf_config(raw)


@pytest.mark.parametrize(
    ("name", "cls", "moe"),
    [
        ("Qwen/Qwen3.5-9B-Base", "Qwen3_5ForConditionalGeneration", False),
        ("Qwen/Qwen3.5-35B-A3B-Base", "Qwen3_5MoeForConditionalGeneration", True),
    ],
)
def test_the_qwen35_stand_in_is_the_multimodal_class_vllm_serves(name, cls, moe):
    from nemo_jetrl.backends.nemo_rl.rehearsal import hybrid

    arch = resolve_arch(name)
    cfg = tiny.tiny_config(arch, 128)
    assert cfg.architectures == [cls]  # vLLM refuses the text class (Qwen3_5TextConfig)
    text = cfg.text_config
    # the real kinds, shrunk: a gated-DeltaNet layer, then the full-attention layer
    assert text.layer_types == ["linear_attention", "full_attention"]
    assert text.head_dim == 256 and text.num_attention_heads == 2 and text.num_key_value_heads == 1
    h = arch.hybrid  # value heads per key head kept (32/16), every in_proj part whole blocks
    assert (
        text.linear_num_value_heads // text.linear_num_key_heads == h.num_v_heads // h.num_k_heads
    )
    assert text.linear_key_head_dim == text.linear_value_head_dim == 128
    assert cfg.vision_config.depth == 1 and cfg.vision_config.out_hidden_size == text.hidden_size
    if moe:
        assert (text.num_experts, text.num_experts_per_tok) == (tiny.EXPERTS, tiny.TOP_K)
        assert text.moe_intermediate_size == text.shared_expert_intermediate_size == 128
    assert hybrid.text_config(cfg) is text and hybrid.text_config(text) is text
    keys = hybrid.vllm_keys()
    assert keys["policy.generation.vllm_kwargs.mamba_ssm_cache_dtype"] == "float32"
    assert keys["policy.generation.vllm_kwargs.limit_mm_per_prompt"] == {"image": 0, "video": 0}


def test_the_cpu_policy_runs_qwen35_moe_with_fp8_linears_and_sends_main_s_names(tmp_path):
    """The 35B-A3B stand-in in `CpuPolicy`: experts and shared expert FP8 (Qwen3.5's block:
    routed + sigmoid-gated shared expert), the aligned recipe's BF16 in_proj/conv1d/vision kept,
    the forward equal to HF's own block before training, and the refit sending the checkpoint's
    names (model.language_model.*, grouped expert slabs, as main's Megatron worker) and values."""
    import torch
    from safetensors import safe_open

    from nemo_jetrl.backends.local.vllm_moe import engine_weights
    from nemo_jetrl.backends.nemo_rl.rehearsal.policy import _CpuPolicyBody
    from nemo_jetrl.fp8 import Fp8BlockLinear
    from nemo_jetrl.recipe import Recipe

    model_dir = tiny.write_model(resolve_arch("Qwen/Qwen3.5-35B-A3B-Base"), tmp_path / "m")
    gen = {"vllm_cfg": {"precision": "fp8", "kv_cache_dtype": "auto"}, "temperature": 1.0}
    # what `jetrl align` makes of NeMo-RL's config: the whole GDN in_proj BF16 (one Megatron GEMM)
    recipe = Recipe.preset("jetrl").with_bf16_layer_kws(
        ("linear_attn.conv1d", "linear_attn.in_proj", "visual")
    )
    policy = _CpuPolicyBody(
        None, {"model_name": str(model_dir), "generation": gen}, None,
        init_optimizer=False, init_reference_model=True, recipe=recipe,
    )  # fmt: skip
    mods = dict(policy.model.named_modules())
    lm = "model.language_model.layers"
    fp8 = {n for n, m in mods.items() if isinstance(m, Fp8BlockLinear)}
    assert f"{lm}.0.linear_attn.out_proj" in fp8 and f"{lm}.1.self_attn.q_proj" in fp8
    assert {
        f"{lm}.{i}.mlp.shared_expert.{p}" for i in (0, 1) for p in ("gate_proj", "down_proj")
    } <= fp8
    assert not any("in_proj" in n or "visual" in n or n.endswith("gate") for n in fp8)
    experts = mods[f"{lm}.0.mlp.experts"]
    assert set(experts.fp8) == {"gate_up_proj", "down_proj"}  # the routed experts FP8 too
    ids = torch.randint(3, 98, (2, 9))
    with torch.no_grad():
        ours, ref = policy.model(input_ids=ids).logits, policy.reference(input_ids=ids).logits
    assert 0 < (ours - ref).abs().mean() < 0.1 * ref.abs().mean()  # FP8 vs HF's float32
    # without FP8 the swapped block is HF's own Qwen3.5-MoE block (routing, renormalised top-k,
    # the sigmoid-gated shared expert), so the logits agree to float32 rounding
    plain = _CpuPolicyBody(
        None, {"model_name": str(model_dir), "generation": gen}, None,
        init_optimizer=False, init_reference_model=True, recipe=Recipe.preset("bf16"),
    )  # fmt: skip
    assert type(dict(plain.model.named_modules())[f"{lm}.1.mlp"]).__name__ == "_SharedExpertMoe"
    with torch.no_grad():
        got, want = plain.model(input_ids=ids).logits, plain.reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    sent = policy._weights()
    # grouped slabs (main's Megatron worker for Qwen3.5-MoE; our hook expands them per expert)
    assert sent[f"{lm}.0.mlp.experts.gate_up_proj"].shape == (tiny.EXPERTS, 256, 256)
    per_expert = engine_weights(sent)  # the checkpoint's per-expert names (transformers saves)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as ckpt:
        assert set(per_expert) == set(ckpt.keys())
        for name in sorted(per_expert):
            assert torch.equal(per_expert[name], ckpt.get_tensor(name)), name
    assert policy.kv_names == [] and set(policy.prepare_refit_info()) == set(sent)


def test_hf_names_map_to_the_engines_modules_and_fused_outputs():
    """`vllm_patch.engine_names` on a model shaped as vLLM's Qwen3.5 (prefix mapper, in_proj_qkv
    filling 3 of in_proj_qkvz's 4 outputs) and as one without a mapper (names unchanged)."""
    import torch

    from nemo_jetrl.vllm_patch.engine_names import engine_path, stacked_outputs

    mapper = types.SimpleNamespace(
        orig_to_new_prefix={"model.language_model.": "language_model.model."},
        orig_to_new_stacked={
            ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)),
            ".in_proj_z": (".in_proj_qkvz", 3),
            ".q_proj": (".qkv_proj", "q"),  # vLLM's string shard ids: one output each
        },
    )
    inner = type("Inner", (torch.nn.Module,), {"hf_to_vllm_mapper": mapper})

    class Engine(torch.nn.Module):
        hf_to_vllm_mapper = mapper

        def __init__(self) -> None:
            super().__init__()
            self.language_model = inner()
            self.packed_modules_mapping = {
                "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
                "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            }

    m = Engine()
    name = "model.language_model.layers.0.linear_attn.in_proj_z.weight"
    assert engine_path(m, name) == "language_model.model.layers.0.linear_attn.in_proj_z.weight"
    assert engine_path(m, "language_model.x") == "language_model.x"  # already the engine's
    assert engine_path(torch.nn.Linear(2, 2), "model.layers.0.x") == "model.layers.0.x"
    assert stacked_outputs(m, "in_proj_qkv", "in_proj_qkvz", 0, 4) == [0, 1, 2]
    assert stacked_outputs(m, "in_proj_z", "in_proj_qkvz", 1, 4) == [3]
    assert stacked_outputs(m, "k_proj", "qkv_proj", 1, 3) == [1]  # one output per HF shard
    with pytest.raises(KeyError, match="in_proj_b: in_proj_ba has 4 outputs for 0 HF shards"):
        stacked_outputs(m, "in_proj_b", "in_proj_ba", 0, 4)
