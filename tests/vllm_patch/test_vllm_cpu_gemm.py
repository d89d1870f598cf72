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

import pytest
import torch
from vllm_fixtures import (
    DECODER_LINEARS,
    bf16_gap_bound,
    bf16_rounding_gap,
    fp8_gap_bound,
    logprob_gap,
    onednn_standin,
    vllm_cpu_env,
    vllm_repacks,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


def test_with_the_standin_vllm_repacks_on_this_cpu():
    """The premise of the ``standin`` engines: vLLM's dispatch then takes its oneDNN branch."""
    with onednn_standin(True):
        assert vllm_repacks(torch.bfloat16) and vllm_repacks(torch.float32)


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


# vLLM's fp8 quantization serves bfloat16/float16 only, so jetrl runs in bfloat16; the FP32
# engine (BF16 recipe) is the one that repacks on every CPU, lm_head included. Each test runs its
# recipes in order on the same CPU: the BF16 recipe's engine-vs-trainer gaps, each bounded by the
# trainer's own BF16-vs-FP32 gap on the same tokens (vllm_fixtures.bf16_gap_bound), are then the
# controls of the jetrl engine's gaps for the same weights (vllm_fixtures.fp8_gap_bound). Fixed
# bounds before: 0.05 (FP32), 0.25 (BF16) and 0.25 (jetrl) nats; stale packed copies (the dummy
# weights) gave 1.5-3.3 nats on AVX-512 CPUs.
@pytest.mark.parametrize(
    ("dtype_name", "recipes", "standin"),
    [
        ("float32", ("bf16",), False),
        ("bfloat16", ("bf16", "jetrl"), False),
        ("bfloat16", ("bf16", "jetrl"), True),
    ],
    ids=["fp32-bf16", "bf16-bf16+jetrl", "standin-bf16-bf16+jetrl"],
)
def test_refit_rebuilds_what_vllm_derives_from_the_weights(
    tmp_path, monkeypatch, dtype_name, recipes, standin
):
    controls = None
    with onednn_standin(standin, monkeypatch):
        for recipe_name in recipes:
            controls = _check_refits(
                tmp_path / recipe_name, dtype_name, recipe_name, standin, controls
            )


def _check_refits(tmp_path, dtype_name, recipe_name, standin, controls):
    """One engine of ``recipe_name``, loaded and refitted; returns its logprob gap to the
    trainer for seeds 0 and 1 (the controls of an FP8 engine that follows)."""
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

        gaps = []
        for seed in (0, 1):
            if seed:  # a second refit changes what the engine computes; it tracks the new trainer
                eng.refit(tiny_llama_128(seed).to(dtype).state_dict())
            out = _generate(llm, logprobs=0)
            trainer = _trainer(seed, dtype, recipe_name)
            gap = logprob_gap(out, trainer)
            if recipe_name == "bf16":
                control, what = bf16_rounding_gap(out, trainer), "the trainer's BF16-vs-FP32 gap"
                bound = bf16_gap_bound(control)
            else:
                control, what = controls[seed], "the BF16 recipe's engine-vs-trainer gap"
                bound = fp8_gap_bound(control)
            print(f"{dtype_name} {recipe_name} seed {seed}: gap {gap:.4f}, control {control:.4f}")
            assert gap < bound, (
                f"{dtype_name} engine, {recipe_name} recipe, weights of seed {seed}: logprobs "
                f"{gap:.4f} nats from the trainer's, bound {bound:.4f} from {what} {control:.4f}"
            )
            gaps.append(gap)

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
    return gaps
