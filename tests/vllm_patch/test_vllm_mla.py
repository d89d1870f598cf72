"""A tiny MLA model (DeepSeek-V3 architecture) on the real vLLM 0.32 CPU engine under jetrl.

One decoder layer, dense MLP (``first_k_dense_replace`` = the layer count: no MoE), hidden 256,
2 heads, ``q_lora_rank`` 128, ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64: HF's
``kv_a_proj_with_mqa`` has 576 rows, a 64-row partial 128-block (Moonlight's and DeepSeek-V3's
shape). vLLM fuses ``q_a_proj`` (128 rows) and ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``
(704 rows, ``weight_scale_inv`` 1 + 5 block rows). Every linear but lm_head runs block FP8 with
our kernel: fused_qkv_a_proj, q_b_proj, kv_b_proj, o_proj, gate_up_proj, down_proj.

vLLM's MLA derives BF16 tensors from kv_b_proj at load (``MLAAttention.
process_weights_after_loading``: ``W_UK_T`` and ``W_UV``, the dequantized weight split per head,
which its decode path multiplies with in BF16); the refit's parity check compares them bit for
bit with what the trainer's FP8 bytes and scales dequantize to (`mla_derived`), and one test
shows a stale pair is named. The engine picks the ``CPU_MLA`` attention backend
(`engine.mla_cpu_backend`): on AMX CPUs vLLM would pick ``AMX_MLA``, which requantizes kv_b_proj
per tensor and empties its weight.
"""

from __future__ import annotations

import math

import pytest
import torch
from hf_models import char_tokenizer, tiny_hf_config, tiny_hf_model
from vllm_fixtures import served_checkpoint, vllm_cpu_env

pytestmark = pytest.mark.vllm

LAYERS = 1
# No attention backend given: VllmRolloutEngine picks CPU_MLA (`engine.mla_cpu_backend`).
USER_KWARGS = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0)
ATTN = "model.layers.0.self_attn"


def tiny_mla(seed: int = 0) -> torch.nn.Module:
    cfg = tiny_hf_config(
        "deepseek_v3", vocab_size=128, hidden_size=256, intermediate_size=512,
        num_hidden_layers=LAYERS, first_k_dense_replace=LAYERS, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, n_group=1, topk_group=1, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.08,
        rope_scaling=None,
    )  # fmt: skip
    return tiny_hf_model(cfg, seed=seed, dtype=torch.bfloat16)


FP8_LAYERS = {f"{ATTN}.{m}" for m in ("fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj")} | {
    f"model.layers.0.mlp.{m}" for m in ("gate_up_proj", "down_proj")
}


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env(), pytest.MonkeyPatch.context() as mp:
        # Lets the stale-copy test send its worker-side plant as a function (test-only).
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


@pytest.fixture(scope="module")
def recipe():
    from nemo_jetrl.recipe import Recipe

    return Recipe.preset("jetrl")


@pytest.fixture(scope="module")
def rollout(tmp_path_factory, recipe):
    d = tmp_path_factory.mktemp("tiny_mla")
    with served_checkpoint(tiny_mla(0), d, recipe, USER_KWARGS) as eng:
        yield eng


def test_mla_weights_are_quantized_with_a_576_row_tail_block(recipe):
    """No engine: every MLA linear of both forms (Moonlight's q_proj, DeepSeek-V3's q_a/q_b) is
    FP8 in the refit, kv_a_proj_with_mqa with a 64-row partial block."""
    from nemo_jetrl.fp8 import fp8_bits, quantize_blockwise
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict

    for q_lora, q_names in ((128, ("q_a_proj", "q_b_proj")), (None, ("q_proj",))):
        cfg = tiny_mla(0).config
        cfg.q_lora_rank = q_lora
        sd = tiny_hf_model(cfg, seed=1, dtype=torch.bfloat16).state_dict()
        qsd = quantize_state_dict(sd, recipe)
        mla = (*q_names, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
        assert set(qsd.fp8_layers) == {f"{ATTN}.{m}" for m in mla} | {
            f"model.layers.0.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")
        }
        kv_a = f"{ATTN}.kv_a_proj_with_mqa"
        assert qsd.tensors[f"{kv_a}.weight_scale_inv"].shape == (5, 2)  # 4 blocks + 64 rows
        want = quantize_blockwise(sd[f"{kv_a}.weight"], (128, 128), pow2_scales=True)
        assert torch.equal(fp8_bits(qsd.tensors[f"{kv_a}.weight"]), fp8_bits(want.data))
        assert torch.equal(qsd.tensors[f"{kv_a}.weight_scale_inv"], want.scale_inv)


def test_kv_b_proj_on_the_bf16_list_is_served_and_refit_bf16(recipe):
    """No engine: what `jetrl align` writes for an MLA model (kv_b_proj BF16 on both sides,
    because vLLM's MLA decode takes its product in BF16): vLLM's Fp8Config gets kv_b_proj in
    modules_to_not_convert (its ignored_layers), the refit sends it BF16, and the 576-row
    kv_a_proj_with_mqa stays FP8 in both."""
    from nemo_jetrl.vllm_patch.engine_args import build_engine_kwargs
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict

    kept = recipe.with_bf16_layer_kws(("kv_b_proj",))
    ek = build_engine_kwargs(kept, USER_KWARGS, num_layers=LAYERS)
    skip = ek.kwargs["hf_overrides"]["quantization_config"]["modules_to_not_convert"]
    assert f"{ATTN}.kv_b_proj" in skip
    assert not any("kv_a_proj" in m or "q_a_proj" in m or "mlp" in m for m in skip), skip
    sd = tiny_mla(1).state_dict()
    qsd = quantize_state_dict(sd, ek.settings)
    assert f"{ATTN}.kv_b_proj" not in qsd.fp8_layers
    assert f"{ATTN}.kv_a_proj_with_mqa" in qsd.fp8_layers and f"{ATTN}.q_b_proj" in qsd.fp8_layers
    assert qsd.tensors[f"{ATTN}.kv_b_proj.weight"].dtype == torch.bfloat16
    assert f"{ATTN}.kv_b_proj.weight_scale_inv" not in qsd.tensors
    assert torch.equal(qsd.tensors[f"{ATTN}.kv_b_proj.weight"], sd[f"{ATTN}.kv_b_proj.weight"])


def test_every_mla_linear_runs_our_kernel_and_parity_holds(rollout, recipe):
    from nemo_jetrl.vllm_patch.refit import refit

    llm = rollout.llm
    assert rollout.engine_kwargs.kwargs["attention_backend"] == "CPU_MLA"  # on every CPU kind
    kernels = llm.collective_rpc("jetrl_kernels")[0]
    fp8 = {n: k for n, k in kernels.items() if n.startswith("model.layers.")}
    assert set(fp8) == FP8_LAYERS and set(fp8.values()) == {"JetRLFp8BlockLinearKernel"}
    # q_a_proj (128 rows) + kv_a_proj_with_mqa (576): 704 rows, 1 + 5 scale rows in vLLM
    shapes = llm.collective_rpc(
        "jetrl_shapes", args=([f"{ATTN}.kv_a_proj_with_mqa.weight_scale_inv"],)
    )
    shape, dtype = shapes[0][f"{ATTN}.kv_a_proj_with_mqa.weight_scale_inv"]
    assert (tuple(shape), dtype) == ((5, 2), "torch.float32")
    first = rollout.last_refit
    assert first is not None and first.parity.differing == () and first.parity.derived == 1
    report = refit(llm, tiny_mla(1).state_dict(), recipe)  # the second refit
    assert report.fp8_layers == 8 and report.parity is not None
    assert report.parity.fp8 == 2 * 8
    assert report.parity.compared == 2 * 8 + 7  # + embed, 4 norms, final norm, lm_head
    assert report.parity.derived == 1  # W_UK_T/W_UV of the one kv_b_proj, bit for bit
    assert report.parity.differing == ()


def test_a_bf16_weight_for_an_fp8_mla_layer_is_refused_before_loading(rollout, recipe):
    """A trainer that keeps kv_a_proj_with_mqa BF16 while the engine runs it FP8 (a BF16 list
    given to one side only): vLLM's loader would cast the BF16 values into the FP8 weight and
    keep the old scales, and a bytewise read-back of the cast would match. Refused by name."""
    import dataclasses

    from nemo_jetrl.vllm_patch.refit import RefitError, guard_shapes, quantize_state_dict
    from nemo_jetrl.vllm_patch.settings import settings_from_recipe

    one_side = dataclasses.replace(
        settings_from_recipe(recipe), bf16_layer_kws=("kv_a_proj_with_mqa",)
    )
    qsd = quantize_state_dict(tiny_mla(1).state_dict(), one_side)
    with pytest.raises(RefitError) as ei:
        guard_shapes(rollout.llm, qsd)
    msg = str(ei.value)
    assert msg.count("\n  - ") == 1, msg
    assert f"{ATTN}.kv_a_proj_with_mqa.weight: trainer dtype torch.bfloat16, engine holds " in msg


def test_the_cpu_mla_default_yields_to_a_user_choice_and_skips_other_models(tmp_path):
    from nemo_jetrl.vllm_patch.engine import mla_cpu_backend

    tiny_mla(0).config.to_json_file(tmp_path / "config.json")
    assert mla_cpu_backend(tmp_path, {}) == {"attention_backend": "CPU_MLA"}
    assert mla_cpu_backend(tmp_path, {"attention_backend": "AMX_MLA"}) == {}
    assert mla_cpu_backend(tmp_path, {"attention_config": {"backend": "AMX_MLA"}}) == {}
    tiny_hf_config("llama").to_json_file(tmp_path / "config.json")
    assert mla_cpu_backend(tmp_path, {}) == {}


@pytest.mark.parametrize("pow2", [True, False])
def test_expected_w_uk_w_uv_are_vllms_own_dequantization(pow2):
    """`parity_views.expected_view` is vLLM's `scaled_dequantize` (what split_kv_b_proj calls)
    bit for bit, in both scale modes (the engine test runs pow2 only)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        scaled_dequantize,
    )

    from nemo_jetrl.fp8 import quantize_blockwise
    from nemo_jetrl.vllm_patch.parity_views import expected_view

    w = torch.randn(512, 384, generator=torch.Generator().manual_seed(0)) * 0.05
    q = quantize_blockwise(w, (128, 128), pow2_scales=pow2)
    vllm = scaled_dequantize(q.data, q.scale_inv, GroupShape(128, 128), out_dtype=torch.bfloat16)
    ours = expected_view(q.data, q.scale_inv, torch.bfloat16)
    assert torch.equal(ours.view(torch.int16), vllm.view(torch.int16))


def _stale_mla(worker, on: bool) -> bool:
    """Plant (test-only): vLLM's MLA attention stops re-deriving W_UK_T/W_UV after a load."""
    from nemo_jetrl.vllm_patch.parity_views import attention_by_kv_b
    from nemo_jetrl.vllm_patch.worker_ext import model_of

    model = model_of(getattr(worker, "worker", worker))
    cls = type(next(iter(attention_by_kv_b(model).values())))
    if on:
        cls._jetrl_test_orig = cls.process_weights_after_loading
        cls.process_weights_after_loading = lambda self, act_dtype: None
    else:
        cls.process_weights_after_loading = cls.__dict__["_jetrl_test_orig"]
        del cls._jetrl_test_orig
    return True


def test_stale_w_uk_w_uv_are_named_by_parity_and_rolled_back(rollout, recipe):
    from nemo_jetrl.vllm_patch.refit import ParityError, check_parity, quantize_state_dict, refit

    llm = rollout.llm
    before = quantize_state_dict(tiny_mla(1).state_dict(), recipe)
    assert check_parity(llm, before).derived == 1
    llm.collective_rpc(_stale_mla, args=(True,))
    try:
        with pytest.raises(ParityError) as ei:
            refit(llm, tiny_mla(4).state_dict(), recipe)
    finally:
        llm.collective_rpc(_stale_mla, args=(False,))
    msg = str(ei.value)
    assert f"{ATTN}.kv_b_proj.weight (vLLM's W_UK_T/W_UV derived from it:" in msg
    assert msg.count("\n  - ") == 1, msg  # only the derived copies: every sent tensor landed
    back = check_parity(llm, before)  # rolled back: the seed-1 weights and their W_UK_T/W_UV
    assert back.differing == () and back.derived == 1


def test_generation_runs_and_a_refit_changes_it(rollout, recipe):
    from nemo_jetrl.vllm_patch.refit import refit

    tok = char_tokenizer()
    prompts = [tok.encode(p) for p in ("Hello wor", "The cat s")]
    outs = []
    for seed in (2, 3):
        refit(rollout.llm, tiny_mla(seed).state_dict(), recipe)
        gens = rollout.generate(prompts, max_tokens=6, temperature=0.0, ignore_eos=True)
        for g in gens:
            assert len(g.token_ids) == len(g.logprobs) == 6
            assert all(math.isfinite(v) and v <= 0.0 for v in g.logprobs)
        outs.append([g.logprobs for g in gens])
    assert outs[0] != outs[1]
