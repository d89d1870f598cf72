"""The tiny Qwen3-MoE engine set-up of the vLLM MoE tests (issue 28): the model, its block-FP8
checkpoint by our trainer-side quantizer, the trainer's FP8 forward in torch, the engines
(``served_fp8``: FP8 under the patch; ``bf16_control_gap``: BF16 unpatched) and the module
fixtures of test_vllm_moe.py, which test_nemo_rl_hook_moe_engine.py imports too.

The fixtures are module-scoped and registered under their own names (``name=``): a test module
that imports ``served_fixture`` gets one FP8 engine of its own, shared by its tests (import it
with ``# noqa: F401``). test_vllm_moe_shared.py and test_vllm_moe_shards.py take plain helpers
only. vLLM is imported inside the functions (the default suite imports this module without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json

import pytest
import torch
from hf_models import char_tokenizer, per_expert_state_dict, qwen3_moe_128
from vllm_fixtures import logprob_gap, vllm_cpu_env

E, INTER, LAYERS, MOE_LAYERS = 8, 128, 3, (1, 2)
USER_KWARGS = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0)
ROUTERS = tuple(f"model.layers.{i}.mlp.gate" for i in MOE_LAYERS)


@pytest.fixture(scope="module", autouse=True, name="_vllm_cpu_env")
def vllm_cpu_env_fixture():
    # the module's engine in its own processes: tests below start and shut down another engine
    # in this process while it lives (vllm_fixtures.IN_PROCESS)
    with vllm_cpu_env(in_process=False):
        yield


def _experts_kernel_here() -> bool:
    """Our experts kernel serves the installed vLLM (0.20.0, 0.25.1, 0.32.x); True without vLLM
    (the marker skips then). Not a skip here: every vLLM with a CPU build is covered."""
    try:
        import vllm
    except ImportError:
        return True
    from nemo_jetrl.vllm_patch.moe_versions import moe_supported

    return moe_supported(vllm.__version__)


def routed_experts_supported() -> bool:
    """vLLM 0.20's and 0.25.1's CPU builds return routed experts (their V1 model runner records
    them); 0.32's needs Model Runner V2, which needs Triton (none on CPU builds)."""
    import vllm

    from nemo_jetrl.vllm_patch.compat import release

    return release(vllm.__version__) < (0, 32, 0)


def tiny_qwen3_moe(seed: int) -> torch.nn.Module:
    return qwen3_moe_128(
        seed, experts=E, inter=INTER, layers=LAYERS, mlp_only_layers=[0], initializer_range=0.08
    )


def write_checkpoint(model, directory, settings=None) -> dict[str, torch.Tensor]:
    """A HF checkpoint of ``model``: block FP8 by our quantizer under ``settings``, else BF16."""
    from safetensors.torch import save_file

    from nemo_jetrl.vllm_patch.engine_args import quantization_config
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict

    sd = per_expert_state_dict(model)
    if settings is not None:
        sd = quantize_state_dict(sd, settings, dtype=torch.bfloat16).tensors
    save_file({k: v.contiguous() for k, v in sd.items()}, str(directory / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    if settings is not None:
        cfg["quantization_config"] = quantization_config(settings)
    (directory / "config.json").write_text(json.dumps(cfg))
    char_tokenizer().save_pretrained(directory)
    return sd


def fp8_reference(
    model: torch.nn.Module,
    keep: tuple[str, ...] = ("lm_head",),
    moe_layers: tuple[int, ...] = MOE_LAYERS,
) -> torch.nn.Module:
    """The trainer's FP8 forward of ``model`` in torch with nemo_jetrl.fp8: attention and dense
    MLP linears as Fp8BlockLinear, each expert's projections 128x128 / 1x128 block FP8 (the
    same quantizer and scale mode), routers and the linears whose names end with ``keep``
    (lm_head) BF16; ``moe_layers``: the layers whose experts are replaced."""
    import copy

    from nemo_jetrl.fp8 import quantize_blockwise
    from nemo_jetrl.fp8.config import Fp8LinearConfig
    from nemo_jetrl.fp8.convert import convert_to_fp8_training
    from nemo_jetrl.fp8.linear import fp8_linear_forward

    ref = copy.deepcopy(model)
    convert_to_fp8_training(
        ref, Fp8LinearConfig(pow2_scales=True), module_filter_fn=lambda m, n: not n.endswith(keep)
    )

    def linear(x, w):
        qx = quantize_blockwise(x, (1, 128), pow2_scales=True)
        qw = quantize_blockwise(w, (128, 128), pow2_scales=True)
        return fp8_linear_forward(qx, qw, None, x.dtype)

    def make_forward(ex):
        def forward(hidden, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden)
            for e in range(ex.num_experts):
                pos, tok = torch.where(top_k_index.t() == e)
                if tok.numel() == 0:
                    continue
                gate, up = linear(hidden[tok], ex.gate_up_proj[e]).chunk(2, dim=-1)
                y = linear(ex.act_fn(gate) * up, ex.down_proj[e])
                out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
            return out

        return forward

    for i in moe_layers:
        ex = ref.model.layers[i].mlp.experts
        ex.forward = make_forward(ex)
    return ref


def moe_settings(routers):
    """The jetrl recipe's patch settings with the MoE ``routers`` kept BF16."""
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import settings_from_recipe

    base = settings_from_recipe(Recipe.preset("jetrl"))
    return dataclasses.replace(
        base, modules_to_not_convert=(*base.modules_to_not_convert, *routers)
    )


def bf16_control_gap(trainer, directory, generate) -> float:
    """Control: ``trainer``'s BF16 checkpoint on vLLM unpatched vs the BF16 HF forward."""
    from vllm import LLM

    from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

    write_checkpoint(trainer, directory)
    llm = LLM(model=str(directory), **USER_KWARGS)
    try:
        outs = generate(llm)
    finally:
        shutdown_engine(llm)
        gc.collect()
    return logprob_gap(outs, trainer)


@contextlib.contextmanager
def served_fp8(trainer, directory, settings, **user):
    """(llm, patch, checkpoint tensors): ``trainer``'s FP8 checkpoint through vLLM's loader under
    the patch, every block-FP8 linear checked to run our kernel."""
    from vllm import LLM

    from nemo_jetrl.vllm_patch import apply_patches, build_engine_kwargs, verify_engine_kernels
    from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

    sd = write_checkpoint(trainer, directory, settings)
    patch = apply_patches(settings)
    kwargs = build_engine_kwargs(settings, dict(USER_KWARGS, load_format="auto", **user)).kwargs
    llm = LLM(model=str(directory), **kwargs)
    try:
        verify_engine_kernels(llm, settings)
        yield llm, patch, sd
    finally:
        shutdown_engine(llm)
        patch.revert()
        gc.collect()


@pytest.fixture(scope="module", name="settings")
def settings_fixture():
    return moe_settings(ROUTERS)


@pytest.fixture(scope="module", name="trainer")
def trainer_fixture():
    return tiny_qwen3_moe(0)


# Its own engine: the FP8 checkpoint through vLLM's loader, shared by every test of the module.
@pytest.fixture(scope="module", name="served")
def served_fixture(tmp_path_factory, trainer, settings):
    """(llm, patch, checkpoint tensors) of the FP8 checkpoint under the patch."""
    user = {"enable_return_routed_experts": True} if routed_experts_supported() else {}
    with served_fp8(trainer, tmp_path_factory.mktemp("moe_fp8"), settings, **user) as served:
        yield served
