"""keep_bf16_by_name on a real megatron-core GPTModel (CPU): exactly the Megatron linears whose
fused HF linears are all on the list run inside the FP8-off context (a recording stand-in here;
TE's own autocast in the GPU image), per pipeline-stage offset; restore puts the forwards back;
a list splitting a fused GEMM is refused."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from nemo_jetrl.megatron.bf16_names import hf_linear_names, keep_bf16_by_name

pytest.importorskip("megatron.core")


def test_megatron_names_map_to_the_hf_linears_they_fuse():
    assert hf_linear_names("module.decoder.layers.1.self_attention.linear_qkv", 4) == [
        "model.layers.5.self_attn.q_proj",
        "model.layers.5.self_attn.k_proj",
        "model.layers.5.self_attn.v_proj",
    ]
    assert hf_linear_names("decoder.layers.0.mlp.linear_fc2") == ["model.layers.0.mlp.down_proj"]
    assert hf_linear_names("decoder.layers.0.self_attention.core_attention") == []


def _run_recording(model, kws, offset=0):
    """Forward once; return (handle, names of the modules whose weight was used by a torch op
    while the FP8-off context was entered, output)."""
    from torch.overrides import TorchFunctionMode

    depth = {"n": 0}
    owner = {
        id(p): name.rsplit(".", 1)[0]
        for name, p in model.named_parameters()
        if hf_linear_names(name.rsplit(".", 1)[0])
    }
    inside: set[str] = set()

    @contextmanager
    def fp8_off():
        depth["n"] += 1
        try:
            yield
        finally:
            depth["n"] -= 1

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if depth["n"]:
                for a in (*args, *(kwargs or {}).values()):
                    if isinstance(a, torch.Tensor) and id(a) in owner:
                        inside.add(owner[id(a)])
            return func(*args, **(kwargs or {}))

    handle = keep_bf16_by_name(model, kws, layer_offset=offset, fp8_disabled=fp8_off)
    from megatron_shims import forward

    with torch.no_grad(), Spy():
        out = forward(model, torch.randint(0, 100, (2, 8)))
    return handle, sorted(inside), out


def test_listed_linears_run_inside_the_fp8_off_context_and_only_they(gpt):
    from megatron_shims import forward

    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = forward(gpt, ids)
    handle, inside, _ = _run_recording(gpt, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert inside == sorted(handle.names)
    assert all(n.endswith(("linear_qkv", "linear_proj")) for n in inside) and len(inside) == 4
    handle.restore()
    handle.restore()  # idempotent
    assert not any("forward" in m.__dict__ for _, m in gpt.named_modules())
    with torch.no_grad():
        assert torch.equal(forward(gpt, ids), before)


def test_layer_words_follow_the_pipeline_offset(gpt):
    handle, inside, _ = _run_recording(gpt, ["model.layers.3."], offset=2)  # local layer 1
    assert inside == sorted(handle.names) and all(".layers.1." in n for n in inside)
    assert len(inside) == 4  # qkv, proj, fc1, fc2 of that layer
    handle.restore()


def test_a_list_splitting_a_fused_gemm_is_refused(gpt):
    with pytest.raises(ValueError, match="one GEMM"):
        keep_bf16_by_name(gpt, ["q_proj"], fp8_disabled=contextmanager(lambda: (yield)))
    assert not any("forward" in m.__dict__ for _, m in gpt.named_modules())
