"""Refit into both of vLLM's CPU GEMM paths for unquantized linears, on any x86 CPU.

After loading, vLLM's CPU build hands each unquantized linear to
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, which decides from the CPU
(``torch.cpu._is_amx_tile_supported``, ``_supports_onednn`` of the loaded ``_C`` library, whether
oneDNN can build a primitive for the dtype, ``current_platform.is_zen_cpu``):

* **repacked**: the GEMM reads a packed copy (oneDNN / AMX "SGL" / zentorch) and ``weight`` is
  replaced by an empty tensor (``lm_head`` keeps its parameter *and* a packed copy). oneDNN
  builds a BF16 primitive only on AVX-512 CPUs, but an FP32 one on every x86 CPU;
* **in place**: ``F.linear`` on the parameter (BF16 on CPUs without AVX-512).

So serving in float32 takes the repacked path on every x86 CPU and bfloat16 takes whichever
path this CPU gets: together the two dtypes run both branches here, whatever the CPU. Which
branch each engine took is asked of vLLM's own dispatch function, never assumed. A refit that
only copied into parameters would fail the shape guard (repacked weights) or leave the packed
copies stale; both are caught here by the parity read-back through the layer's own GEMM and by
logprobs against the trainer.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from vllm_fixtures import vllm_cpu_env

pytestmark = pytest.mark.vllm

DECODER_LINEARS = {
    f"model.layers.{i}.{m}"
    for i in range(2)
    for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
}


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


def vllm_repacks(dtype: torch.dtype) -> bool:
    """Ask vLLM's own CPU dispatch (in this process) whether it repacks a [256, 256] weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the _C library vLLM loads for this CPU
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(256, 256, dtype=dtype), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return layer.weight.numel() == 0


def test_float32_weights_take_the_repacked_path_on_this_cpu():
    """The premise of this module: FP32 is how the repacked branch runs on every x86 CPU."""
    assert vllm_repacks(torch.float32), (
        "vLLM did not repack an FP32 linear on this CPU: the repacked-weights refit path is not "
        "exercised by this tier here"
    )


def _logprob_gap(out, trainer) -> float:
    from test_vllm_engine import _hf_logprobs

    worst = 0.0
    for o in out:
        c = o.outputs[0]
        lps = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
        assert all(math.isfinite(v) for v in lps.tolist())
        worst = max(worst, float((lps - _hf_logprobs(trainer, o)).abs().max()))
    return worst


def _trainer(seed: int, dtype: torch.dtype, recipe_name: str):
    from test_vllm_engine import _hf_model

    from nemo_jetrl.fp8.config import Fp8LinearConfig
    from nemo_jetrl.fp8.convert import convert_to_fp8_training

    model = _hf_model(seed).to(dtype)
    if recipe_name == "jetrl":
        convert_to_fp8_training(
            model, Fp8LinearConfig(pow2_scales=True), module_filter_fn=lambda m, n: n != "lm_head"
        )
    return model


# Engine vs trainer logprob gap (nats; attention and GEMM kernels differ from HF's). Measured on
# an AVX2 CPU: FP32 BF16-recipe 0.007, BF16 0.027, jetrl 0.125. Stale packed copies (the dummy
# weights) gave 1.5-3.3 nats on AVX-512 CPUs.
BOUND = {("float32", "bf16"): 0.05, ("bfloat16", "bf16"): 0.25, ("bfloat16", "jetrl"): 0.25}


# vLLM's fp8 quantization serves bfloat16/float16 only, so jetrl runs in bfloat16; the FP32
# engine (BF16 recipe) is the one that repacks on every CPU, lm_head included.
@pytest.mark.parametrize(
    ("dtype_name", "recipe_name"),
    [("float32", "bf16"), ("bfloat16", "bf16"), ("bfloat16", "jetrl")],
)
def test_refit_rebuilds_what_vllm_derives_from_the_weights(tmp_path, dtype_name, recipe_name):
    from test_vllm_engine import PROMPTS, _generate, _hf_model, _tokenizer

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine
    from nemo_jetrl.vllm_patch.refit import ParityError, check_parity, quantize_state_dict

    dtype = getattr(torch, dtype_name)
    repacks = vllm_repacks(dtype)
    _hf_model(0).to(dtype).save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    recipe = Recipe.preset(recipe_name)
    kwargs = dict(
        dtype=dtype_name, max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0,
        load_format="dummy",  # random placeholders: every real value must arrive by refit
    )  # fmt: skip
    eng = VllmRolloutEngine(tmp_path, recipe, engine_kwargs=kwargs)
    try:
        llm = eng.llm
        repacked = set(llm.collective_rpc("jetrl_repacked")[0])
        bf16_linears = DECODER_LINEARS if recipe_name == "bf16" else set()
        assert repacked == (bf16_linears if repacks else set()), (repacks, sorted(repacked))
        rep = eng.last_refit.parity
        assert rep is not None and rep.differing == ()
        # embed_tokens and lm_head, plus every decoder linear the recipe keeps unquantized
        assert rep.through_kernel == 2 + (14 if recipe_name == "bf16" else 0)  # HF tensors
        assert rep.compared == len(_hf_model(0).state_dict()) + rep.fp8 // 2

        gap0 = _logprob_gap(_generate(llm, logprobs=0), _trainer(0, dtype, recipe_name))
        assert gap0 < BOUND[(dtype_name, recipe_name)], gap0

        # A second refit changes what the engine computes, and it tracks the new trainer.
        eng.refit(_hf_model(1).to(dtype).state_dict())
        gap1 = _logprob_gap(_generate(llm, logprobs=0), _trainer(1, dtype, recipe_name))
        assert gap1 < BOUND[(dtype_name, recipe_name)], gap1

        # The read-back is not vacuous: against other weights it names the unquantized linears
        # through their GEMM (the only copy a repacked layer has).
        other = quantize_state_dict(_hf_model(2).to(dtype).state_dict(), recipe, dtype=dtype)
        with pytest.raises(ParityError) as ei:
            check_parity(llm, other)
        msg = str(ei.value)
        assert "lm_head.weight (through the layer's GEMM:" in msg
        for layer in bf16_linears:
            name = layer.replace("qkv_proj", "q_proj").replace("gate_up_proj", "up_proj")
            assert f"{name}.weight (through the layer's GEMM:" in msg, name
        assert len(PROMPTS) == 2
    finally:
        eng.close()
        gc.collect()
