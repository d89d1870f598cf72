"""Our NeMo-RL Megatron worker's calibration glue (``backends/nemo_rl/worker.py``) on CPU.

What runs for real: our worker class as ``make_worker_class`` builds it (Ray's real
``ray.remote`` wrapping; the test instantiates the class Ray wraps), a real megatron-core
GPTModel on CPU, NeMo-RL's real ``BatchedDataDict`` and ``get_runtime_env_for_policy_worker``.

STAND-IN (labelled): NeMo-RL v0.7.0's ``MegatronPolicyWorkerImpl``, the base class we subclass.
Its module does not import here: it needs ``megatron.bridge`` (not in the overlay) and a newer
megatron-core than the overlay's 0.16.1 (v0.7.0: ``megatron.core.inference.config``,
``dynamic_engine.EngineState``; main 7ea279a: ``dist_checkpointing.strategies.torch.
get_async_strategy``). The stand-in base keeps only what our subclass calls:
``__init__`` (``self.cfg``, ``self.model``), ``get_logprobs`` (one forward per micro-batch on
the right-padded rows, as the real one documents) and ``_iter_params_with_optional_kv_scales``
(records the ``kv_scales`` it is given instead of exporting weights through megatron.bridge).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from nemo_jetrl.backends.nemo_rl import translate as nt
from nemo_jetrl.kvcache import CalibrationSettings
from nemo_jetrl.megatron.attention import calibrate_megatron
from nemo_jetrl.recipe import Recipe

pytestmark = pytest.mark.nemo_rl

MPW = "nemo_rl.models.policy.workers.megatron_policy_worker"
LENGTHS = [5, 12, 3, 9]
WIDTH = 16
PAD = 7  # the padding token (its V in layer 0 made an outlier, see model())


def _standin_module() -> types.ModuleType:
    from nemo_rl.models.policy.utils import get_runtime_env_for_policy_worker

    class MegatronPolicyWorkerImpl:  # STAND-IN for NeMo-RL's (see module docstring)
        def __init__(self, cfg: dict, model: torch.nn.Module) -> None:
            self.cfg = cfg
            self.model = model
            self.exported: list = []

        def get_logprobs(self, *, data, micro_batch_size=None, require_router_replay=True):
            from megatron_shims import forward

            ids = data["input_ids"]
            size = micro_batch_size or self.cfg["logprob_batch_size"]
            for i in range(0, ids.shape[0], size):
                forward(self.model, ids[i : i + size])

        def _iter_params_with_optional_kv_scales(self, kv_scales=None):
            self.exported.append(kv_scales)
            yield "model.embed_tokens.weight", torch.zeros(1)

    mod = types.ModuleType(MPW)
    mod.MegatronPolicyWorkerImpl = MegatronPolicyWorkerImpl
    mod.get_runtime_env_for_policy_worker = get_runtime_env_for_policy_worker
    return mod


@pytest.fixture
def worker_cls(monkeypatch):
    from nemo_jetrl.backends.nemo_rl import worker

    recipe = Recipe.preset("jetrl_kv")
    monkeypatch.setenv(nt.RECIPE_ENV, nt.recipe_to_json(recipe))
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0")
    monkeypatch.setitem(sys.modules, MPW, _standin_module())
    worker.make_worker_class.cache_clear()
    yield worker.make_worker_class().__ray_actor_class__, recipe
    worker.make_worker_class.cache_clear()


@pytest.fixture
def model():
    from megatron_shims import build_gpt, megatron_cpu

    with megatron_cpu():
        m = build_gpt()
        with torch.no_grad():
            # Channel 3 carries only the padding token, and layer 0's QKV weights amplify it:
            # padded V are outliers, real tokens' are unchanged.
            emb = m.embedding.word_embeddings.weight
            emb[:, 3] = 0.0
            emb[PAD] = 0.0
            emb[PAD, 3] = 1.0
            m.decoder.layers[0].self_attention.linear_qkv.weight[:, 3] *= 100.0
        yield m.eval()


def _data():
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(0)
    ids = torch.full((len(LENGTHS), WIDTH), PAD, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = torch.randint(10, 500, (n,), generator=g)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths}), ids, lengths


def _reference(model, recipe, ids, lengths, by_lengths: bool) -> dict:
    from megatron_shims import forward

    settings = CalibrationSettings.from_recipe(recipe.kv_calibration, include_q=False)
    batches = [
        (
            lambda i=i: forward(model, ids[i : i + 2]),
            lengths[i : i + 2].long() if by_lengths else None,
        )
        for i in range(0, len(LENGTHS), 2)
    ]
    return calibrate_megatron(model, batches, settings=settings).to_nemo_rl(settings)["layers"]


def test_calibration_masks_padding_by_lengths_and_refit_ships_it(worker_cls, model):
    cls, recipe = worker_cls
    cfg = {"logprob_batch_size": 2, "sequence_packing": {"enabled": False}}
    data, ids, lengths = _data()
    w = cls(cfg, model)  # hooks on-policy KV (scale 1.0, as vLLM before any calibration)
    # References through the same hooks, before the worker's calibration changes the scales.
    want = _reference(model, recipe, ids, lengths, by_lengths=True)
    every_token = _reference(model, recipe, ids, lengths, by_lengths=False)
    out = w.calibrate_qkv_fp8_scales(data=data)
    got = out["layers"]
    assert out["jetrl"]["micro_batches"] == 2 and out["jetrl"]["refused"] == {}
    # Padding masked by input_lengths: the scales of a direct calibration on the real tokens.
    assert got == want
    # The padding outliers would move them (so the check above can fail).
    moved = [k for k in got if every_token[k] > 1.5 * got[k]]
    assert moved, (every_token, got)
    # Refit: a caller passing no scales (v0.7.0's colocated refit) ships our calibration.
    names = [n for n, _ in w._iter_params_with_optional_kv_scales()]
    assert names == ["model.embed_tokens.weight"] and w.exported[-1] == got
    # Scales a caller passes that contradict the trainer's calibration are refused.
    caller = {k: 2 * v for k, v in got.items()}
    with pytest.raises(ValueError, match="differ from the trainer's calibration"):
        list(w._iter_params_with_optional_kv_scales(kv_scales=caller))
