"""The NeMo-RL refit hook's MoE path on a real vLLM CPU engine (0.32, 0.25.1 and 0.20 tiers)
serving block-FP8 experts under our patch (issue 28): what the hooked ``fp8.load_weights`` does
with each streamed batch (``refit_batches.quantize_batch`` -> the model's own ``load_weights``, as
NeMo-RL calls it) and the parity check its transport runs after, executed inside vLLM's worker.

NeMo-RL itself is not imported here (NeMo-RL v0.7.0's real transport into a vLLM 0.20 / 0.25.1
engine is tests/backends/test_nemo_rl_refit_vllm_moe.py). Both of NeMo-RL's layouts are sent: per
expert names, and main's grouped slabs (``experts.gate_up_proj`` [E, 2I, H]), which is exactly
how transformers 5 stores the trainer model's experts. vLLM 0.25.1 (NeMo-RL main's) has no vLLM
tier: the NeMo-RL main tier runs this module (marker ``vllm_in_nemo_rl``, scripts/test_nemo_rl.sh).
"""

from __future__ import annotations

import pytest
import torch
from moe_engine_setup import (  # noqa: F401  (module fixtures: one engine for this module)
    per_expert_state_dict,
    served_fixture,
    settings_fixture,
    tiny_qwen3_moe,
    trainer_fixture,
    vllm_cpu_env_fixture,
)

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_in_nemo_rl]


@pytest.fixture(scope="module", autouse=True)
def _worker_functions():
    """Lets this test send its worker functions by value (test-only), set before the engine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


def _nrl_refit(self, blob: bytes, settings_json: str, batches: int):
    """In the worker: NeMo-RL's streamed batches through our hook's batch path, then parity."""
    from nemo_jetrl.backends.nemo_rl.refit_batches import (
        SentTensors,
        check_refit_parity,
        quantize_batch,
    )
    from nemo_jetrl.vllm_patch import compat
    from nemo_jetrl.vllm_patch.settings import PatchSettings
    from nemo_jetrl.vllm_patch.worker_ext import unpack

    model = self.model_runner.model
    items = list(unpack(blob).items())
    sent = SentTensors()
    s = PatchSettings.from_json(settings_json)
    for b in range(batches):
        batch = quantize_batch(items[b::batches], model, s, sent)
        # NeMo-RL calls model.load_weights(batch); vLLM's CPU build has repacked the BF16 router
        # (an empty weight), which only its layerwise reload can write: used here instead. That
        # reload rebuilds a layer from what one call gives it, so the test sends one batch.
        compat.reload_weights(model, self.vllm_config.model_config, iter(batch))
    r = check_refit_parity(self, sent)
    return {"fp8": r.fp8, "compared": r.compared, "names": sorted(sent.fp8)}


def _flip_expert_byte(self):
    p = self.model_runner.model.model.layers[2].mlp.experts
    p = getattr(p, "routed_experts", p).w2_weight
    p.data.view(torch.uint8)[5, 0, 0] ^= 1


@pytest.mark.parametrize("grouped", [False, True], ids=["per_expert", "grouped"])
def test_hook_batches_land_every_expert_with_parity_on_a_real_engine(served, settings, grouped):
    from nemo_jetrl.vllm_patch.refit import ParityError, check_parity, quantize_state_dict
    from nemo_jetrl.vllm_patch.worker_ext import pack

    llm, _, _ = served
    new = tiny_qwen3_moe(3 if grouped else 2)
    sd = {k: v.clone() for k, v in new.state_dict().items()} if grouped else None
    sd = sd or per_expert_state_dict(new)
    assert any(k.endswith("experts.gate_up_proj") for k in sd) == grouped
    got = llm.collective_rpc(_nrl_refit, args=(pack(sd), settings.to_json(), 1))[0]
    # 2 MoE layers x 8 experts x (gate, up, down) x (weight, scale), plus the dense FP8 linears
    experts = [n for n in got["names"] if ".experts." in n]
    assert len(experts) == 2 * 8 * 3 * 2 and got["fp8"] == len(got["names"])
    # Independently of the hook: the engine holds quantize_state_dict's bits for every expert.
    want = quantize_state_dict(per_expert_state_dict(new), settings)
    check_parity(llm, want)
    llm.collective_rpc(_flip_expert_byte)
    with pytest.raises(ParityError, match=r"layers\.2\.mlp\.experts\.5\.down_proj\.weight"):
        check_parity(llm, want)
    # back to the served model (the module's other tests share the engine)
    llm.collective_rpc(_nrl_refit, args=(pack(per_expert_state_dict(tiny_qwen3_moe(0))),
                                         settings.to_json(), 1))  # fmt: skip
