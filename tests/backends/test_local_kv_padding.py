"""The local backend's KV recalibration (`RunStep._recalibrate_kv`) counts only real tokens:
padding after ``<eos>`` holding outlier activations leaves the calibrated scales unchanged.

The padding token's embedding points along a direction no real token uses, which layer 0's
q/k/v projections amplify 1000x, so one counted padding position moves the scales by far more
than any rounding (checked: with every position counted the scales grow >10x).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import tiny_hf_config, tiny_hf_model

from nemo_jetrl.backends.local.step import RunStep
from nemo_jetrl.kvcache import CalibrationSettings
from nemo_jetrl.kvcache.hf import KVCacheController

OUTLIER, J, PROMPT, RESP = 3, 5, 4, 8
# response lengths (tokens up to and including <eos>); the rest of each row is padding
LENGTHS = (8, 5, 3, 1)


def _model() -> torch.nn.Module:
    cfg = tiny_hf_config("llama", num_hidden_layers=2)
    cfg._attn_implementation = "eager"
    model = tiny_hf_model(cfg, seed=0)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, J] = 0.0
        emb[OUTLIER] = 0.0
        emb[OUTLIER, J] = 1.0
        attn = model.model.layers[0].self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[:, J] *= 1000.0
    return model


def _batch(pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    real = torch.randint(10, 90, (len(LENGTHS), PROMPT + RESP), generator=g)
    mask = torch.zeros(len(LENGTHS), RESP, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = True
    ids = real.clone()
    ids[:, PROMPT:][~mask] = pad_id
    return ids, real[:, :PROMPT], mask


class _Step:  # the state `_recalibrate_kv` reads from a LocalRun
    def __init__(self, mode: str, model: torch.nn.Module) -> None:
        s = CalibrationSettings(reduction="max", micro_batch_size=2, mask=mode)
        self.kv = KVCacheController(s)
        self.kv.attach(model, role="train")
        self.trainer = type("T", (), {"model": model})()


def _scales(mode: str, pad_id: int) -> dict:
    model = _model()
    step = _Step(mode, model)
    ids, prompt_ids, mask = _batch(pad_id)
    refused = RunStep._recalibrate_kv(step, ids, prompt_ids, mask)
    assert refused == 0
    return {i: dict(per) for i, per in step.kv.scales.layers.items()}


@pytest.mark.parametrize("mode", ["prompt_and_response", "response"])
def test_outlier_padding_after_eos_leaves_the_kv_scales_unchanged(mode: str) -> None:
    plain = _scales(mode, pad_id=11)
    outlier = _scales(mode, pad_id=OUTLIER)
    assert plain == outlier


def test_the_outlier_would_move_the_scales_if_counted() -> None:
    plain = _scales("none", pad_id=11)
    outlier = _scales("none", pad_id=OUTLIER)
    for t in ("k", "v"):
        assert outlier[0][t] > 10 * plain[0][t], t


@pytest.mark.parametrize(("engine", "kernel"), [("vllm", "cpu"), ("hf", "cuda")])
def test_the_trainer_writes_kv_as_the_rollout_engine_does(engine, kernel):
    """`LocalRun._attach_kv_cache`: with the vLLM engine (vLLM's CPU build, whose cache writer
    truncates) the trainer's on-policy K/V and the rollout model's cache use the CPU writer;
    with our HF rollout both sides use the same rounding writer."""
    from types import SimpleNamespace

    from nemo_jetrl.backends.local.setup import LocalRun
    from nemo_jetrl.recipe import Recipe

    run = SimpleNamespace(
        recipe=Recipe.preset("jetrl_kv"),
        local=SimpleNamespace(rollout_engine=engine),
        rollout_model=_model(),
    )
    LocalRun._attach_kv_cache(run, _model())
    try:
        assert set(run.kv.handles) == {"rollout", "train"}
        assert {h.state.kernel for h in run.kv.handles.values()} == {kernel}
        assert run.kv.handles["train"].state.quantize  # on-policy KV: the trainer quantizes
    finally:
        run.kv.detach()
