"""NeMo-RL's real vLLM refit of a block-FP8 MoE model with our hook (issue 28), in each NeMo-RL
tier (v0.7.0 on vLLM 0.20, main on vLLM 0.25.1, both served by our experts kernel): the
tree's sender (``stream_weights_via_ipc_zmq_impl``) over a real ZMQ socket into its real receiver
(``update_weights_via_ipc_zmq`` -> ``fp8.load_weights``, hooked) of a ``vllm.LLM`` started as
NeMo-RL starts it (`nemo_rl_vllm_engine.nemo_rl_engine`: the same GPU stand-ins), serving a
tiny Qwen3-MoE (2 layers of 4 experts of width 128, top-2) whose experts run our experts kernel
(``vllm_patch.experts``). The experts are streamed per expert, as NeMo-RL's Megatron export
streams Qwen3-MoE. FP32 scales, where NeMo-RL's own quantizer differs from ours.

The router: vLLM builds Qwen3-MoE's ``mlp.gate`` with the model's quant_config, and NeMo-RL's
``init_fp8`` lists no router in ``ignored_layers``, so without a per-name list the rollout's
router is FP8 while training's is not. Our hook refuses that engine at its first refit, naming
``mlp.gate.weight`` (seen with this engine started without the list). The per-name list
``[mlp.gate]`` on both sides keeps the routers BF16 (this model has no dense MLP layer whose
``gate_proj`` the word would also match). The BF16 routers keep their weight in place as on a
GPU (the stand-in plugin's ``keep_unquantized_weights``: vLLM's CPU build would otherwise pack
them into a oneDNN copy that NeMo-RL's plain ``model.load_weights`` cannot write).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_models import char_tokenizer, per_expert_state_dict, qwen3_moe_128
from nemo_rl_vllm_engine import _last_parity, _read_fp8, _refit_via_nemo_rl, nemo_rl_engine

from nemo_jetrl.vllm_patch.worker_ext import unpack

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]
E, INTER = 4, 128
ROUTERS = ["mlp.gate"]


def tiny_moe(seed: int) -> torch.nn.Module:
    return qwen3_moe_128(seed, experts=E, inter=INTER, layers=2, mlp_only_layers=[])


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import settings_from_recipe

    d = tmp_path_factory.mktemp("nrl_qwen3_moe")
    tiny_moe(0).save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    base = settings_from_recipe(Recipe.preset("jetrl"), num_layers=2)
    settings = dataclasses.replace(
        base, pow2_weight_scales=False, pow2_activation_scales=False, bf16_layer_kws=tuple(ROUTERS)
    )
    kws = {"quantization_ignored_layer_kws": ROUTERS}
    ipc = tmp_path_factory.mktemp("ipc")
    with nemo_rl_engine(d, ipc, settings, kws, keep_bf16=True) as (llm, device_id):
        yield llm, settings, device_id


def test_nemo_rls_refit_lands_our_expert_bits_with_parity(moe_engine):
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict

    llm, settings, device_id = moe_engine
    weights = per_expert_state_dict(tiny_moe(1))
    assert _refit_via_nemo_rl(llm, device_id, weights)
    rep = llm.collective_rpc(_last_parity)[0]
    qsd = quantize_state_dict(weights, settings)
    experts = [n for n in qsd.fp8_names() if ".experts." in n]
    assert len(experts) == 2 * E * 3 * 2 and rep.fp8 == len(qsd.fp8_names()) and rep.differing == ()
    back = unpack(llm.collective_rpc(_read_fp8, args=(qsd.fp8_names(),))[0])
    for name in qsd.fp8_names():  # independent of the hook's own check: the bits are ours
        assert torch.equal(back[name].view(torch.uint8), qsd.tensors[name].view(torch.uint8)), name
    print(f"\nNeMo-RL refit of a block-FP8 MoE: parity over {rep.compared} tensors "
          f"({rep.fp8} FP8, {len(experts)} of them experts)")  # fmt: skip
    # A second refit to other weights lands them too (the hook stays armed across refits).
    weights2 = per_expert_state_dict(tiny_moe(2))
    assert _refit_via_nemo_rl(llm, device_id, weights2)
    assert llm.collective_rpc(_last_parity)[0].differing == ()
    qsd2 = quantize_state_dict(weights2, settings)
    again = unpack(llm.collective_rpc(_read_fp8, args=(experts,))[0])
    assert all(
        torch.equal(again[n].view(torch.uint8), qsd2.tensors[n].view(torch.uint8)) for n in experts
    )
    assert not all(torch.equal(again[n], back[n]) for n in experts)
