"""Our NeMo-RL Megatron worker's calibration glue (``backends/nemo_rl/worker.py``) on CPU, through
NeMo-RL's REAL ``MegatronPolicyWorkerImpl`` (the tree under test, v0.7.0 or main 7ea279a).

What runs for real: our worker class as ``make_worker_class`` builds it, subclassing NeMo-RL's
real ``MegatronPolicyWorkerImpl`` (Ray's real ``ray.remote`` wrapping; the test instantiates the
class Ray wraps); our ``__init__`` glue (KV hooks, BF16 linears); our
``calibrate_qkv_fp8_scales``, which drives NeMo-RL's real ``get_logprobs`` (its micro-batch
iterator, ``process_microbatch``, ``megatron_forward_backward`` -> megatron-core's
``forward_backward_no_pipelining``, ``LogprobsPostProcessor``) over a real megatron-core GPTModel
on CPU; our ``_iter_params_with_optional_kv_scales`` override, which streams NeMo-RL's real
iterator: megatron-bridge 0.3.1's real ``AutoBridge.export_hf_weights`` (from a tiny HF Qwen3
checkpoint written to tmp) then the FP8 KV scale tensors under vLLM's names.

STAND-INS (each labelled where it is defined, in tests/backends/nemo_rl_real_worker.py):
- GPU: the base class's ``__init__`` (Megatron/NCCL setup, checkpoint load, moving to CUDA):
  `_base_init` sets the attributes the methods above read, with NeMo-RL's own helpers where it
  has them; CUDA devices (``data.to("cuda")`` in NeMo-RL's micro-batch iterator, the scale
  tensors' ``device="cuda"``) land on the CPU (`_CudaOnCpu`), plus tests/megatron_shims.py's two
  shims; Transformer Engine for the two megatron-bridge modules that import it unconditionally
  (`_TE_IMPORTERS`: TE's torch extension loads CUDA libraries).
- Version gaps, at import only: megatron-core symbols the worker module (or a module it imports)
  names at import time that megatron-core 0.16.1 (the newest for Python 3.11) lacks, and on main
  two megatron-bridge symbols newer than 0.3.1 (the newest for megatron-core < 0.17): `GAPS`.
  None is executed by get_logprobs or the refit iterator; each raises if called.
- ``megatron.training.utils.get_ltor_masks_and_position_ids`` (`_ltor_masks`): Megatron-LM's
  training package ships in no megatron-core wheel; NeMo-RL imports it at call time in
  ``process_microbatch``. The one stand-in the path executes: the causal mask and positions.

Asserted: the calibrated scales equal a direct calibration on the real tokens (the lengths passed
on mask the padding; counting the padding would move them >1.5x), and the real refit iterator,
called with no scales, ships the bridge's exported weights followed by exactly those scales
(contradicting caller scales refused). Each of these worker.py slips fails the test on both trees
(scripts/mutants.py, "worker ..."): no lengths passed, lengths of other rows, ``by_lengths``
off (``got == want``); the iterator override not installed, the calibration not kept for the
refit (the shipped-scales assertion). If the real class does not import, the test errors; it
never skips. The worker's checks of the built model use these fixtures too:
test_nemo_rl_worker_checks.py.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from nemo_rl_real_worker import (
    GAPS,
    _base_init,
    _CudaOnCpu,
    _ltor_masks,
    _real_worker_module,
    _tree,
)

from nemo_jetrl.backends.nemo_rl import translate as nt
from nemo_jetrl.kvcache import CalibrationSettings
from nemo_jetrl.megatron.attention import calibrate_megatron
from nemo_jetrl.recipe import Recipe

pytestmark = pytest.mark.nemo_rl

LENGTHS = [5, 12, 3, 9]
WIDTH = 16
PAD = 7  # the padding token (its V in layer 0 made an outlier, see model())
# head_dim 128: Megatron's fused linear_qkv then has the rollout's FP8 blocks (with the shims'
# default 64 the worker refuses the model: megatron/blocks.py)
DIMS_FIELDS = {"kv_channels": 128}


def _cfg() -> dict[str, Any]:
    """The policy-config keys the real methods read (NeMo-RL's PolicyConfig names)."""
    return {
        "logprob_batch_size": 2,
        "sequence_packing": {"enabled": False},
        "dynamic_batching": {"enabled": False},
        "megatron_cfg": {"defer_fp32_logits": None},
        "generation": {"backend": "vllm", "vllm_cfg": {"kv_cache_dtype": "fp8"}},
    }


@pytest.fixture(scope="module")
def real_mpw() -> Iterator[types.ModuleType]:
    with _real_worker_module() as (mod, used):
        tree = _tree()
        stale = [g for g in GAPS if tree in g.trees and g not in used]
        assert not stale, f"megatron-core/-bridge now has these: drop their stand-ins: {stale}"
        yield mod


@pytest.fixture
def worker_cls(monkeypatch, real_mpw):
    from nemo_jetrl.backends.nemo_rl import worker

    recipe = Recipe.preset("jetrl_kv")
    monkeypatch.setenv(nt.RECIPE_ENV, nt.recipe_to_json(recipe))
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0")
    monkeypatch.setattr(real_mpw.MegatronPolicyWorkerImpl, "__init__", _base_init)
    training = types.ModuleType("megatron.training")
    utils = types.ModuleType("megatron.training.utils")
    utils.get_ltor_masks_and_position_ids = _ltor_masks
    training.utils = utils
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.utils", utils)
    worker.make_worker_class.cache_clear()
    cls = worker.make_worker_class().__ray_actor_class__
    assert real_mpw.MegatronPolicyWorkerImpl in cls.__mro__  # NeMo-RL's real class, not a copy
    yield cls, recipe
    worker.make_worker_class.cache_clear()


@pytest.fixture
def model():
    from megatron_shims import TinyGpt, build_gpt, megatron_cpu

    with megatron_cpu():
        m = build_gpt(TinyGpt(**DIMS_FIELDS))
        with torch.no_grad():
            # Channel 3 carries only the padding token, and layer 0's QKV weights amplify it:
            # padded V are outliers, real tokens' are unchanged.
            emb = m.embedding.word_embeddings.weight
            emb[:, 3] = 0.0
            emb[PAD] = 0.0
            emb[PAD, 3] = 1.0
            m.decoder.layers[0].self_attention.linear_qkv.weight[:, 3] *= 100.0
        yield m.eval()


def _bridge(tmp: Path) -> Any:
    """megatron-bridge's real AutoBridge for the test GPT's architecture, from a tiny HF Qwen3
    checkpoint (random weights; the bridge reads its config and weight order)."""
    from megatron.bridge import AutoBridge
    from megatron_shims import TinyGpt
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = TinyGpt(**DIMS_FIELDS)
    hf = Qwen3Config(
        vocab_size=d.vocab_size,
        hidden_size=d.hidden_size,
        intermediate_size=d.ffn_hidden_size,
        num_hidden_layers=d.num_layers,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_query_groups,
        head_dim=d.kv_channels,
        max_position_embeddings=d.max_seq,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )
    Qwen3ForCausalLM(hf).save_pretrained(tmp)
    return AutoBridge.from_hf_pretrained(str(tmp))


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


def test_calibration_masks_padding_by_lengths_and_refit_ships_it(worker_cls, model, tmp_path):
    cls, recipe = worker_cls
    data, ids, lengths = _data()
    bridge = _bridge(tmp_path)
    with _CudaOnCpu():
        w = cls(_cfg(), model=model, bridge=bridge)  # our hooks: on-policy KV at scale 1.0
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
        # Refit: a caller passing no scales (v0.7.0's colocated refit) ships our calibration,
        # after the weights megatron-bridge exports (NeMo-RL's real iterator: weights, then
        # q/k/v scales under vLLM's names, 1.0 where none is given).
        refit = dict(w._iter_params_with_optional_kv_scales())
        exported = dict(bridge.export_hf_weights([model], show_progress=False))
        assert "model.layers.1.self_attn.k_proj.weight" in exported
        for name, t in exported.items():
            assert torch.equal(refit.pop(name), t), name
        shipped = {n: float(t) for n, t in refit.items()}
        assert len(shipped) == 3 * len(model.decoder.layers), shipped
        assert {n: shipped.get(n) for n in got} == got, shipped  # every k/v scale, exactly
        assert all(v == 1.0 for n, v in shipped.items() if n not in got)  # q: not calibrated
        # Scales a caller passes that contradict the trainer's calibration are refused.
        caller = {k: 2 * v for k, v in got.items()}
        with pytest.raises(ValueError, match="differ from the trainer's calibration"):
            list(w._iter_params_with_optional_kv_scales(kv_scales=caller))


def test_the_worker_judges_bf16_words_over_every_rank(worker_cls, model, tmp_path, monkeypatch):
    """Under pipeline parallelism a stage may lack what a BF16 word names (Moonlight's dense
    layer 0 lives on stage 0 only): every other stage refused it at init. The worker hands
    `keep_bf16_by_name` its all-gather over every rank (`_all_ranks`; stood in here by another
    stage's findings, as no process group runs on CPU): the word passes when a stage matched it,
    and is refused on every rank when none did."""
    import dataclasses

    from nemo_jetrl.backends.nemo_rl import worker

    cls, recipe = worker_cls
    kws = ("self_attn.kv_b_proj",)  # no such linear in this stage's model (no latent attention)
    train = dataclasses.replace(recipe.train, bf16_layer_kws=kws)
    monkeypatch.setenv(nt.RECIPE_ENV, nt.recipe_to_json(dataclasses.replace(recipe, train=train)))
    bridge = _bridge(tmp_path)
    other = {"stage": (list(kws), [7], None)}
    monkeypatch.setattr(worker, "_all_ranks", lambda mine: [mine, other["stage"]])
    with _CudaOnCpu():
        w = cls(_cfg(), model=model, bridge=bridge)
    w._jetrl_bf16.restore()
    w._jetrl_kv.restore()
    other["stage"] = ([], [7], None)  # no stage has it
    with _CudaOnCpu(), pytest.raises(ValueError, match=r"kv_b_proj'\] match no Megatron linear"):
        cls(_cfg(), model=model, bridge=bridge)


def test_the_worker_lets_a_pipeline_stage_hold_no_attention_and_refuses_together(
    worker_cls, model, tmp_path, monkeypatch
):
    """The KV hooks accept a stage without full attention only under pipeline parallelism
    (`allow_empty`: a hybrid model's stage of linear-attention layers); a rank whose hooks fail
    enters the gather the other ranks' BF16-word check waits in, then raises."""
    from nemo_jetrl.backends.nemo_rl import worker
    from nemo_jetrl.megatron import attention

    real = attention.attach_megatron_kv
    seen, gathered = [], []

    def attach(*args, **kwargs):
        seen.append(kwargs["allow_empty"])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "attach_megatron_kv", attach)
    monkeypatch.setattr(worker, "_all_ranks", lambda mine: gathered.append(mine) or [mine])
    worker.make_worker_class.cache_clear()
    cls = worker.make_worker_class().__ray_actor_class__  # imports the stand-in above
    bridge = _bridge(tmp_path)
    for pp in (1, 2):
        cfg = _cfg()
        cfg["megatron_cfg"]["pipeline_model_parallel_size"] = pp
        with _CudaOnCpu():
            w = cls(cfg, model=model, bridge=bridge)
        w._jetrl_bf16.restore()
        w._jetrl_kv.restore()
    assert seen == [False, True] and len(gathered) == 2

    def broken(*args, **kwargs):
        raise ValueError("decoder layer 3 has two core attentions")

    monkeypatch.setattr(attention, "attach_megatron_kv", broken)
    worker.make_worker_class.cache_clear()
    cls = worker.make_worker_class().__ray_actor_class__
    gathered.clear()
    with _CudaOnCpu(), pytest.raises(ValueError, match="two core attentions"):
        cls(_cfg(), model=model, bridge=bridge)
    assert gathered == [([], [], "ValueError: decoder layer 3 has two core attentions")]


def test_the_reference_policy_logprobs_keep_the_kv_bf16(worker_cls, model, tmp_path):
    """NeMo-RL's real ``get_reference_policy_logprobs`` swaps the reference's weights into the
    policy's model (its real ``use_reference_model``): our KV hooks stay on that model, so without
    the worker's override the reference logprobs were fake-quantized with the policy's KV scales.
    With it they are the BF16-KV forward's, bit for bit (the local backend's reference), and
    on-policy KV is back on after the block, also after an error inside it."""
    cls, _ = worker_cls
    data, _, _ = _data()
    cfg = _cfg()
    cfg["megatron_cfg"]["empty_unused_memory_level"] = 0
    with _CudaOnCpu():
        w = cls(cfg, model=model, bridge=_bridge(tmp_path))  # jetrl_kv: on-policy KV at 1.0
        w.should_disable_forward_pre_hook = False
        # the reference: the policy's weights with layer 1's QKV moved (what swapping shows)
        w.reference_state_dict = {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in model.state_dict().items()
        }
        qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
        w.reference_state_dict[qkv] = w.reference_state_dict[qkv] * 1.5
        policy_qkv = model.state_dict()[qkv].clone()
        kv = w._jetrl_kv
        assert kv.state.quantize
        ref = w.get_reference_policy_logprobs(data=data)["reference_logprobs"]
        assert kv.state.quantize  # back on for the policy's own forwards
        assert torch.equal(model.state_dict()[qkv], policy_qkv)  # NeMo-RL swapped them back
        w._apply_state_dict_to_model(w.reference_state_dict)
        fp8_kv = w.get_logprobs(data=data)["logprobs"]
        kv.set_mode(quantize=False)
        bf16_kv = w.get_logprobs(data=data)["logprobs"]
        kv.set_mode(quantize=True)
        assert torch.equal(ref, bf16_kv)
        assert not torch.equal(ref, fp8_kv)  # FP8 KV moves them: the check above can fail
        with pytest.raises(RuntimeError, match="inside"), w.use_reference_model():
            assert not kv.state.quantize
            raise RuntimeError("inside")
        assert kv.state.quantize
    kv.restore()
    w._jetrl_bf16.restore()
