"""A tiny Qwen2-MoE with a shared expert and its gate, served by a real vLLM CPU engine under the
Jet-RL patch (issue 28: shared experts end to end).

The model (transformers' Qwen2MoeForCausalLM: hidden 256, 2 layers, both MoE with 4 experts of
width 128, top-2, a shared expert of width 256 and ``shared_expert_gate`` [1, 256], q/k/v
biases N(0, 0.1), head_dim 128) is written block-FP8 by our trainer-side quantizer
(``refit.quantize_state_dict``: routers, ``shared_expert_gate`` and ``lm_head`` stay BF16). Under
``apply_patches(jetrl)`` the routed experts run our experts kernel, the shared expert's
``gate_up_proj`` / ``down_proj`` our dense kernel, and vLLM's MoE runner runs the shared expert
and adds it (``vllm_patch/shared_experts.py``). One FP8 engine and one BF16 control engine.
Runs on vLLM 0.32 (.venv-vllm) and 0.20 (.venv-vllm020) alike.
"""

from __future__ import annotations

import copy

import moe_engine_setup
import pytest
import torch
from hf_models import tiny_hf_config, tiny_hf_model
from moe_engine_setup import (  # the MoE engine set-up of the Qwen3-MoE module
    bf16_control_gap,
    moe_settings,
    per_expert_state_dict,  # fused 3-D experts -> experts.{e}.*_proj
    served_fp8,
)
from vllm_fixtures import (
    fp8_rounding_gap,
    generate_each,
    logprob_gap,
    moe_fp8_gap_bound,
    vllm_cpu_env,
)

pytestmark = pytest.mark.vllm

E, INTER, SHARED, LAYERS = 4, 128, 256, 2
MOE_LAYERS = (0, 1)
MAX_TOKENS = 8
PROMPTS = ["Hello wor", "The cat s", "0123456"]
ROUTERS = tuple(f"model.layers.{i}.mlp.gate" for i in MOE_LAYERS)
SHARED_PROJS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    # VLLM_ALLOW_INSECURE_SERIALIZATION: the hook test sends its worker function by value
    with vllm_cpu_env(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


def tiny_qwen2_moe(seed: int) -> torch.nn.Module:
    cfg = tiny_hf_config(
        "qwen2_moe",
        vocab_size=128,
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=SHARED,
        num_experts=E,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        qkv_bias=True,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.08,
    )
    model = tiny_hf_model(cfg, seed=seed, dtype=torch.bfloat16)
    # Non-zero q/k/v biases: the serving kernel must add them in fp32 before one cast, as the
    # trainer does (adding them to the BF16 GEMM output measured 0.49 nats here).
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def fp8_reference(model: torch.nn.Module) -> torch.nn.Module:
    """The trainer's FP8 forward in torch with nemo_jetrl.fp8: attention and shared-expert
    linears as Fp8BlockLinear (the dense training path), each routed expert's projections
    128x128 / 1x128 block FP8; routers, shared_expert_gate and lm_head BF16. HF's block then
    adds routed + sigmoid(gate(x)) * shared in BF16."""
    keep = ("lm_head", "shared_expert_gate")
    ref = moe_engine_setup.fp8_reference(model, keep, moe_layers=MOE_LAYERS)
    for i in MOE_LAYERS:
        mlp = ref.model.layers[i].mlp
        assert type(mlp.shared_expert_gate) is torch.nn.Linear  # BF16, not converted
        assert type(mlp.shared_expert.gate_proj) is not torch.nn.Linear  # FP8
    return ref


def _generate(llm):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    return generate_each(llm, PROMPTS, sp)  # same batches every call


def _lps(o) -> list[float]:
    c = o.outputs[0]
    return [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)]


def experts_layer(i: int) -> str:
    import vllm

    from nemo_jetrl.vllm_patch.compat import release

    nested = release(vllm.__version__) >= (0, 25, 0)  # MoERunner -> RoutedExperts
    return f"model.layers.{i}.mlp.experts" + (".routed_experts" if nested else "")


def shared_names(kind: str = "weight") -> list[str]:
    return [
        f"model.layers.{i}.mlp.shared_expert.{p}.{kind}" for i in MOE_LAYERS for p in SHARED_PROJS
    ]


@pytest.fixture(scope="module")
def settings():
    return moe_settings(ROUTERS)


@pytest.fixture(scope="module")
def trainer():
    return tiny_qwen2_moe(0)


# Its own engine (issue 40): vLLM unpatched, BF16 experts (the control).
@pytest.fixture(scope="module")
def bf16_control(tmp_path_factory, trainer):
    """Control: the BF16 checkpoint on vLLM (no patch) vs the BF16 HF forward."""
    return bf16_control_gap(trainer, tmp_path_factory.mktemp("moe_shared_bf16"), _generate)


# Its own engine: the FP8 checkpoint under the patch, shared by every test below.
@pytest.fixture(scope="module")
def served(tmp_path_factory, trainer, settings, bf16_control):
    """(llm, checkpoint tensors) of the FP8 checkpoint under the patch (after the control: one
    engine at a time)."""
    with served_fp8(trainer, tmp_path_factory.mktemp("moe_shared_fp8"), settings) as served:
        llm, _patch, sd = served
        yield llm, sd


def test_checkpoint_keeps_the_shared_gate_bf16_and_quantizes_the_shared_expert(served):
    _, sd = served
    for name in shared_names():
        assert sd[name].dtype == torch.float8_e4m3fn, name
        assert sd[name.replace(".weight", ".weight_scale_inv")].dtype == torch.float32
    for i in MOE_LAYERS:
        gate = sd[f"model.layers.{i}.mlp.shared_expert_gate.weight"]
        assert gate.dtype == torch.bfloat16 and tuple(gate.shape) == (1, 256)


def test_guard_shows_our_kernels_only_shared_expert_on_the_dense_kernel(served, settings):
    """The guard's report: routed experts on our experts method, the shared expert's fused
    gate_up_proj and down_proj on our dense kernel (they ran), nothing of vLLM's FP8 kernels;
    the routers and shared_expert_gate are not FP8 layers at all."""
    from nemo_jetrl.vllm_patch.guard import kernel_problems

    llm, _ = served
    _generate(llm)
    report = llm.collective_rpc("jetrl_kernel_report")[0]
    layers = report["layers"]
    moe = {n: v for n, v in layers.items() if v.get("moe")}
    assert sorted(moe) == [experts_layer(i) for i in MOE_LAYERS]
    assert all(
        v["kernel"] == "JetRLFp8MoEMethod" and v["ours"] and v["calls"] > 0 for v in moe.values()
    )
    shared = {
        f"model.layers.{i}.mlp.shared_expert.{p}"
        for i in MOE_LAYERS
        for p in ("gate_up_proj", "down_proj")
    }
    assert shared <= set(layers), sorted(layers)
    assert {layers[n]["kernel"] for n in shared} == {"JetRLFp8BlockLinearKernel"}
    assert all(layers[n]["ours"] for n in shared)
    dense = {n for n, v in layers.items() if not v.get("moe")}
    assert dense == shared | {
        f"model.layers.{i}.self_attn.{p}" for i in range(LAYERS) for p in ("qkv_proj", "o_proj")
    }
    assert not any(n.endswith((".mlp.gate", "shared_expert_gate")) for n in layers)
    assert kernel_problems([report], settings, "JetRLFp8BlockLinearKernel") == []


def test_logprobs_match_the_fp8_reference_forward(served, trainer, bf16_control):
    """Engine vs our trainer-side FP8 forward (shared expert included) within the bound the BF16
    control sets on this CPU; and the shared expert matters: dropping it from the reference
    moves it far outside that bound."""
    llm, _ = served
    outs = _generate(llm)
    ref = fp8_reference(trainer)
    gap = logprob_gap(outs, ref)
    no_shared = copy.deepcopy(ref)
    for i in MOE_LAYERS:
        no_shared.model.layers[i].mlp.shared_expert_gate.weight.data.fill_(-1e4)  # sigmoid -> 0
    gap_without = logprob_gap(outs, no_shared)
    rounding = fp8_rounding_gap(outs, ref)
    bound = moe_fp8_gap_bound(bf16_control, rounding)
    print(
        f"moe+shared logprob gap: fp8 engine vs fp8 ref {gap:.4f} (bound {bound:.4f}, controls "
        f"{bf16_control:.4f}, fp8 ref bf16 vs fp32 {rounding:.4f}); vs the reference without "
        f"its shared expert {gap_without:.4f}"
    )
    assert gap <= bound, (gap, bf16_control, rounding)
    assert gap_without > bound, gap_without
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)


def test_refit_parity_over_every_expert_and_shared_expert_tensor(served, settings):
    """A refit to another model lands every routed-expert and shared-expert tensor as the
    trainer quantized it (parity bit for bit, the BF16 shared_expert_gate included); a refit back
    gives the first logprobs exactly."""
    from nemo_jetrl.vllm_patch.refit import check_parity, quantize_state_dict, refit

    llm, _ = served
    before = _generate(llm)
    new = per_expert_state_dict(tiny_qwen2_moe(1))
    report = refit(llm, new, settings)
    assert report.parity is not None and report.parity.differing == ()
    qsd = quantize_state_dict(new, settings, dtype=torch.bfloat16)
    fp8 = set(qsd.fp8_names())
    experts = {n for n in fp8 if ".mlp.experts." in n}
    assert len(experts) == len(MOE_LAYERS) * E * 3 * 2
    scales = shared_names("weight_scale_inv")
    assert set(shared_names()) | set(scales) <= fp8
    assert not any("shared_expert_gate" in n for n in fp8)
    assert report.parity.fp8 == len(fp8) and report.parity.compared == len(qsd.tensors)
    assert check_parity(llm, qsd).differing == ()
    after = _generate(llm)
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before]
    refit(llm, per_expert_state_dict(tiny_qwen2_moe(0)), settings)
    again = _generate(llm)
    for a, b in zip(again, before, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and _lps(a) == _lps(b)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.shared_expert.up_proj.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
    ],
)
def test_parity_names_a_corrupted_shared_expert_tensor(served, settings, name):
    """One flipped byte in a shared-expert FP8 weight (or the BF16 gate) is named by parity;
    the worker's snapshot/restore puts it back bit for bit."""
    from nemo_jetrl.vllm_patch.refit import ParityError, check_parity, quantize_state_dict
    from nemo_jetrl.vllm_patch.worker_ext import pack

    llm, _ = served
    qsd = quantize_state_dict(per_expert_state_dict(tiny_qwen2_moe(0)), settings)
    llm.collective_rpc("jetrl_snapshot")
    t = qsd.tensors[name].clone()
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)
    raw[0, 7] ^= 0x01
    llm.collective_rpc("jetrl_load_weights", args=(pack({name: t}),))
    with pytest.raises(ParityError, match=name.replace(".", r"\.")):
        check_parity(llm, qsd)
    llm.collective_rpc("jetrl_restore")
    assert check_parity(llm, qsd).differing == ()


def _nrl_refit(self, blob: bytes, settings_json: str) -> dict:
    """In the worker: NeMo-RL's streamed batch through our refit hook's batch path
    (``refit_batches.quantize_batch``, then vLLM's layerwise reload: the CPU build repacks BF16
    weights, which only it can write) and the parity check the hook runs after."""
    from nemo_jetrl.backends.nemo_rl.refit_batches import (
        SentTensors,
        check_refit_parity,
        quantize_batch,
    )
    from nemo_jetrl.vllm_patch import compat
    from nemo_jetrl.vllm_patch.settings import PatchSettings
    from nemo_jetrl.vllm_patch.worker_ext import unpack

    model, sent = self.model_runner.model, SentTensors()
    batch = quantize_batch(
        list(unpack(blob).items()), model, PatchSettings.from_json(settings_json), sent
    )
    compat.reload_weights(model, self.vllm_config.model_config, iter(batch))
    r = check_refit_parity(self, sent)
    return {"fp8": r.fp8, "compared": r.compared, "names": sorted(sent.fp8)}


def _flip_shared_byte(self) -> None:
    w = self.model_runner.model.model.layers[1].mlp.shared_expert.down_proj.weight
    w.data.view(torch.uint8)[3, 5] ^= 1


@pytest.mark.parametrize("grouped", [False, True], ids=["per_expert", "grouped"])
def test_nemo_rl_refit_hook_quantizes_shared_experts_with_parity(served, settings, grouped):
    """NeMo-RL's refit through our hook (per-expert names, and main's grouped expert slabs):
    the shared expert's projections go through the dense quantizer (FP8 with scales, the BF16
    shared_expert_gate untouched), parity covers them, and a flipped shared-expert byte is
    named."""
    from nemo_jetrl.vllm_patch.refit import ParityError, check_parity, quantize_state_dict
    from nemo_jetrl.vllm_patch.worker_ext import pack

    llm, _ = served
    new = tiny_qwen2_moe(3 if grouped else 2)
    sd = {k: v.clone() for k, v in new.state_dict().items()} if grouped else None
    sd = sd or per_expert_state_dict(new)
    assert any(k.endswith("experts.gate_up_proj") for k in sd) == grouped
    got = llm.collective_rpc(_nrl_refit, args=(pack(sd), settings.to_json()))[0]
    names = set(got["names"])
    assert set(shared_names()) | set(shared_names("weight_scale_inv")) <= names
    assert not any("shared_expert_gate" in n for n in names)
    assert len([n for n in names if ".mlp.experts." in n]) == len(MOE_LAYERS) * E * 3 * 2
    assert got["fp8"] == len(names)
    want = quantize_state_dict(per_expert_state_dict(new), settings)
    assert check_parity(llm, want).differing == ()
    llm.collective_rpc(_flip_shared_byte)
    with pytest.raises(ParityError, match=r"layers\.1\.mlp\.shared_expert\.down_proj\.weight"):
        check_parity(llm, want)
    llm.collective_rpc(
        _nrl_refit, args=(pack(per_expert_state_dict(tiny_qwen2_moe(0))), settings.to_json())
    )
