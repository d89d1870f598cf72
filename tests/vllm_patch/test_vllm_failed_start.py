"""A rollout engine whose start fails inside vLLM's loader leaves this process as it found it
(real vLLM CPU engine, 0.32 and 0.20; `shutdown.undo_failed_start`).

vLLM 0.20's loader builds the model under ``set_default_torch_dtype(bfloat16)`` and restores the
old default only when construction returns. Before the undo, a start that raised left the
process's default dtype at BF16: a float32 model built after it got other weights (found through
an intermittent CI failure: the MoE shared-expert control measured 0.606 nats instead of 0.040
whenever the guard's refused engine had run earlier in the same pytest worker). Here a
checkpoint with one tensor of the wrong shape makes the load raise, on every CPU; then the same
process starts the good checkpoint and generates.
"""

from __future__ import annotations

import pytest
import torch
from test_vllm_engine import USER_KWARGS  # the dense engine tests' settings
from vllm_fixtures import vllm_cpu_env

pytestmark = pytest.mark.vllm

BROKEN = "model.layers.0.mlp.down_proj.weight"  # [256, 512] in the checkpoint: written [256, 256]


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_env():
    with vllm_cpu_env():
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(good, broken): the tiny Llama as saved, and the same with ``BROKEN`` cut to half its
    columns."""
    from hf_models import save_tiny_llama
    from safetensors.torch import load_file, save_file

    good = tmp_path_factory.mktemp("good")
    save_tiny_llama(good)
    broken = tmp_path_factory.mktemp("broken")
    for f in good.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    sd = load_file(good / "model.safetensors")
    assert tuple(sd[BROKEN].shape) == (256, 512)
    sd[BROKEN] = sd[BROKEN][:, :256].contiguous()
    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    return good, broken


def test_a_start_that_fails_in_the_loader_leaves_the_dtype_and_a_retry_generates(checkpoints):
    from vllm.distributed import parallel_state

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import VllmRolloutEngine
    from nemo_jetrl.vllm_patch.kernel import registered_kernel

    good, broken = checkpoints
    recipe = Recipe.preset("bf16")  # vLLM reads the checkpoint itself (no dummy load, no refit)
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(Exception) as ei:
        VllmRolloutEngine(broken, recipe, engine_kwargs=USER_KWARGS)
    text = repr(ei.value)
    assert "256" in text and "512" in text, text  # the loader's shape error, not another failure
    assert torch.get_default_dtype() == torch.float32  # BF16 here on vLLM 0.20 without the undo
    assert not parallel_state.model_parallel_is_initialized()
    assert registered_kernel() is None  # the patch reverted too

    eng = VllmRolloutEngine(good, recipe, engine_kwargs=USER_KWARGS)
    try:
        (gen,) = eng.generate([[1, 40, 41, 42]], max_tokens=4, temperature=0.0)
        assert len(gen.token_ids) == 4 and all(torch.isfinite(torch.tensor(gen.logprobs)))
    finally:
        eng.close()
    assert torch.get_default_dtype() == torch.float32
