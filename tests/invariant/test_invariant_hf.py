"""make_batch_invariant on the local backend's real HF Llama: a token's logprob has the same
bits in an incremental decode step (any batch size) and in the full-sequence training forward,
under jetrl and jetrl_kv; the swap is reversible and stays as accurate as HF's eager BF16
forward (against a float64 copy of the same model)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from nemo_jetrl.backends.local.model import build_model, load_model_config
from nemo_jetrl.backends.local.precision import make_rollout_model, make_trainer_model
from nemo_jetrl.backends.local.rollout import generate
from nemo_jetrl.backends.local.trainer import sequence_logprobs
from nemo_jetrl.invariant import is_batch_invariant, make_batch_invariant
from nemo_jetrl.invariant.hf import InvariantLinear, InvariantRMSNorm, RotaryTable
from nemo_jetrl.recipe import PRESETS


def _pair(recipe: str, invariant: bool = True):
    cfg = load_model_config()
    train = build_model(cfg, dtype=torch.bfloat16, seed=3)
    make_trainer_model(train, PRESETS[recipe], exact_gemm=invariant)
    roll = build_model(cfg, dtype=torch.bfloat16, seed=3)
    roll.load_state_dict(train.state_dict())
    make_rollout_model(roll, PRESETS[recipe], exact_gemm=invariant)
    if invariant:
        make_batch_invariant(train)
        make_batch_invariant(roll)
    return train.eval(), roll.eval()


def _kv(train, roll):
    from nemo_jetrl.kvcache import CalibrationSettings
    from nemo_jetrl.kvcache.hf import KVCacheController

    kv = KVCacheController(CalibrationSettings.from_recipe(PRESETS["jetrl_kv"].kv_calibration))
    kv.attach(roll, role="rollout")
    kv.attach(train, role="train", onpolicy=True)
    prompts = torch.randint(3, 17, (8, 12), generator=torch.Generator().manual_seed(0))
    kv.calibrate(train, prompts)  # real scales, installed on both sides
    assert kv.scales is not None
    return kv


@pytest.mark.parametrize("recipe", ["jetrl", "jetrl_kv"])
@pytest.mark.parametrize(("batch", "prompt_len"), [(1, 4), (5, 9), (64, 6)])
def test_decode_logprobs_equal_training_forward_bit_for_bit(recipe, batch, prompt_len):
    train, roll = _pair(recipe)
    cache_factory = _kv(train, roll).rollout_cache if recipe == "jetrl_kv" else None
    gen = torch.Generator().manual_seed(batch * 100 + prompt_len)
    prompts = torch.randint(3, 17, (batch, prompt_len), generator=gen)
    out = generate(
        roll,
        prompts,
        max_new_tokens=20,
        temperature=1.0,
        eos_id=2,
        pad_id=0,
        generator=gen,
        cache_factory=cache_factory,
    )
    ids = torch.cat([prompts, out.response_ids], dim=1)
    with torch.no_grad():
        lp = sequence_logprobs(train, ids, prompt_len, 1.0)
    m = out.response_mask
    assert int(m.sum()) > batch  # several tokens per row were sampled
    diff = int((lp[m] != out.generation_logprobs[m]).sum())
    assert diff == 0, f"{diff} of {int(m.sum())} token logprobs differ"


def test_rows_do_not_depend_on_their_batch_neighbours():
    train, _ = _pair("jetrl")
    ids = torch.randint(3, 17, (48, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = sequence_logprobs(train, ids, 6, 1.0)
        alone = torch.cat([sequence_logprobs(train, ids[i : i + 1], 6, 1.0) for i in (0, 31)])
    assert torch.equal(alone, full[[0, 31]])


def test_swap_shares_parameters_and_restore_puts_everything_back():
    cfg = load_model_config()
    model = build_model(cfg, dtype=torch.bfloat16, seed=1)
    make_trainer_model(model, PRESETS["jetrl"])
    ids = torch.randint(3, 17, (4, 12), generator=torch.Generator().manual_seed(1))
    keys, params = list(model.state_dict()), {id(p) for p in model.parameters()}
    with torch.no_grad():
        before = model(input_ids=ids).logits
    original_impl = model.config._attn_implementation
    handle = make_batch_invariant(model)
    assert make_batch_invariant(model) is handle and is_batch_invariant(model)  # idempotent
    assert list(model.state_dict()) == keys and {id(p) for p in model.parameters()} == params
    kinds = {type(m) for m in model.modules()}
    assert {InvariantRMSNorm, InvariantLinear, RotaryTable} <= kinds
    assert "lm_head" in handle.swapped and not any(".mlp.up_proj" in s for s in handle.swapped)
    with torch.no_grad():
        during = model(input_ids=ids).logits
    assert not torch.equal(during, before)  # it did change how the logits are computed
    handle.restore()
    handle.restore()  # idempotent
    assert not is_batch_invariant(model) and model.config._attn_implementation == original_impl
    assert not (
        {InvariantRMSNorm, InvariantLinear, RotaryTable} & {type(m) for m in model.modules()}
    )
    from transformers import modeling_utils

    assert handle.name not in modeling_utils.AttentionInterface._global_mapping
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_accuracy_matches_hf_eager_against_a_float64_reference():
    """The invariant BF16 forward is no less accurate than HF's eager BF16 forward (the control,
    same weights, same CPU): max |logit - float64 logit| within 1.5x the control's + 1e-3."""
    cfg = load_model_config()
    ref = build_model(cfg, dtype=torch.float64, seed=5)
    eager = build_model(cfg, dtype=torch.bfloat16, seed=5)
    inv = build_model(cfg, dtype=torch.bfloat16, seed=5)
    make_batch_invariant(inv)
    ids = torch.randint(3, 17, (16, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        r = ref(input_ids=ids).logits
        e_ctl = (eager(input_ids=ids).logits.double() - r).abs().max().item()
        e_inv = (inv(input_ids=ids).logits.double() - r).abs().max().item()
    assert e_inv <= 1.5 * e_ctl + 1e-3, (e_inv, e_ctl)


def test_unsupported_models_are_refused_by_name():
    cfg = load_model_config()
    cfg.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        make_batch_invariant(build_model(cfg, seed=0))
