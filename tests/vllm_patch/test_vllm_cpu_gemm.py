"""Refit into both of vLLM's CPU GEMM paths for unquantized linears, on any x86 CPU.

After loading, vLLM's CPU build hands each unquantized linear to
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, which decides from the CPU
(``torch.cpu._is_amx_tile_supported``, ``_supports_onednn`` of the loaded ``_C`` library, whether
oneDNN can build a primitive for the dtype, ``current_platform.is_zen_cpu``):

* **repacked**: the GEMM reads a packed copy (oneDNN / AMX "SGL" / zentorch) and ``weight`` is
  replaced by an empty tensor (``lm_head`` keeps its parameter *and* a packed copy). oneDNN
  builds a BF16 primitive only on AVX-512 CPUs, but an FP32 one on every x86 CPU;
* **in place**: ``F.linear`` on the parameter (BF16 on CPUs without AVX-512).

Which branch each engine takes is asked of vLLM's own dispatch function, never assumed. The
oneDNN branch does not exist everywhere (vLLM 0.20's AVX2 library has no oneDNN; 0.32's builds
FP32 primitives on any x86 CPU but BF16 ones only with AVX-512), so the engines marked
``standin`` load ``tests/vllm_patch/standins/jetrl_onednn_standin.py`` (through
``vllm_fixtures.onednn_standin``), a labelled pure-torch stand-in for the three oneDNN calls
(its packed weight is a private copy, as oneDNN's is): vLLM's own
dispatch, repacking and reload code then runs its oneDNN branch on every CPU and version, and the
unmarked engines run whatever this CPU really does. A refit that
only copied into parameters would fail the shape guard (repacked weights) or leave the packed
copies stale; both are caught here by the parity read-back through the layer's own GEMM and by
logprobs against the trainer.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from vllm_fixtures import DECODER_LINEARS, onednn_standin, vllm_cpu_env, vllm_repacks

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


def test_with_the_standin_vllm_repacks_on_this_cpu():
    """The premise of the ``standin`` engines: vLLM's dispatch then takes its oneDNN branch."""
    with onednn_standin(True):
        assert vllm_repacks(torch.bfloat16) and vllm_repacks(torch.float32)


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
    from hf_models import tiny_llama_128

    from nemo_jetrl.fp8.config import Fp8LinearConfig
    from nemo_jetrl.fp8.convert import convert_to_fp8_training

    model = tiny_llama_128(seed).to(dtype)
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
    ("dtype_name", "recipe_name", "standin"),
    [
        ("float32", "bf16", False),
        ("bfloat16", "bf16", False),
        ("bfloat16", "jetrl", False),
        ("bfloat16", "bf16", True),
        ("bfloat16", "jetrl", True),
    ],
    ids=["fp32-bf16", "bf16-bf16", "bf16-jetrl", "standin-bf16-bf16", "standin-bf16-jetrl"],
)
def test_refit_rebuilds_what_vllm_derives_from_the_weights(
    tmp_path, monkeypatch, dtype_name, recipe_name, standin
):
    with onednn_standin(standin, monkeypatch):
        _check_refits(tmp_path, dtype_name, recipe_name, standin)


def _check_refits(tmp_path, dtype_name, recipe_name, standin):
    from hf_models import char_tokenizer, tiny_llama_128
    from test_vllm_engine import PROMPTS, _generate

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine
    from nemo_jetrl.vllm_patch.refit import ParityError, check_parity, quantize_state_dict

    dtype = getattr(torch, dtype_name)
    repacks = vllm_repacks(dtype)
    assert repacks or not standin
    tiny_llama_128(0).to(dtype).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
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
        assert rep.compared == len(tiny_llama_128(0).state_dict()) + rep.fp8 // 2

        gap0 = _logprob_gap(_generate(llm, logprobs=0), _trainer(0, dtype, recipe_name))
        assert gap0 < BOUND[(dtype_name, recipe_name)], gap0

        # A second refit changes what the engine computes, and it tracks the new trainer.
        eng.refit(tiny_llama_128(1).to(dtype).state_dict())
        gap1 = _logprob_gap(_generate(llm, logprobs=0), _trainer(1, dtype, recipe_name))
        assert gap1 < BOUND[(dtype_name, recipe_name)], gap1

        # The read-back is not vacuous: against other weights it names the unquantized linears
        # through their GEMM (the only copy a repacked layer has).
        other = quantize_state_dict(tiny_llama_128(2).to(dtype).state_dict(), recipe, dtype=dtype)
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
