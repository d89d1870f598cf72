"""Refits that fail after tensors reached the real vLLM CPU engine are rolled back (issue 17).

`refit.refit` checks every input before sending; what can still fail is in the engine: the
loader raising half way, the parity check finding a difference. Both are injected in the worker
(closures sent by value, test-only ``VLLM_ALLOW_INSECURE_SERIALIZATION``) around the real
loader: after each failure the engine's read-back state (FP8 bytes, scales, other tensors, GEMM
views, KV scales) equals the state before the refit bit for bit, and greedy generation gives the
same tokens and logprobs. The mutation (``rollback=False``) leaves the engine changed.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hf_models import tiny_llama_128
from test_vllm_engine import USER_KWARGS, _engine_state, _generate, _token_logprobs
from vllm_fixtures import vllm_cpu_env

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from hf_models import char_tokenizer

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine

    d = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama_128(0).save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    with vllm_cpu_env(), pytest.MonkeyPatch.context() as mp:
        # Lets the tests send their loader faults as functions (test-only).
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        eng = VllmRolloutEngine(d, Recipe.preset("jetrl"), engine_kwargs=USER_KWARGS)
        yield eng
        eng.close()
        gc.collect()


def _inject(llm, fault: str) -> None:
    """Wrap the worker's ``jetrl_load_weights`` (the real loader underneath) with ``fault``:
    "half" loads the first half of the tensors then raises; "flip" loads all, then flips one FP8
    byte of layer 1's down_proj (a corruption only the parity check can see)."""

    def install(worker, fault):  # runs in the worker (a closure: sent by value)
        from nemo_jetrl.vllm_patch.worker_ext import pack, unpack

        cls = type(getattr(worker, "worker", worker))  # under vLLM's WorkerWrapperBase
        orig = cls.__dict__.get("_jetrl_test_orig") or cls.jetrl_load_weights
        cls._jetrl_test_orig = orig

        def faulty(self, blob):
            if fault == "half":
                tensors = unpack(blob)
                names = sorted(tensors)[: len(tensors) // 2]
                orig(self, pack({n: tensors[n] for n in names}))
                raise RuntimeError(f"injected loader failure after {len(names)} tensors")
            out = orig(self, blob)
            runner = self.model_runner
            model = runner.get_model() if hasattr(runner, "get_model") else runner.model
            model.get_submodule("model.layers.1.mlp.down_proj").weight.data.view(torch.uint8)[
                0, 0
            ] ^= 1
            return out

        cls.jetrl_load_weights = faulty
        return True

    llm.collective_rpc(install, args=(fault,))


def _remove_fault(llm) -> None:
    def remove(worker):
        cls = type(getattr(worker, "worker", worker))
        cls.jetrl_load_weights = cls.__dict__["_jetrl_test_orig"]
        del cls._jetrl_test_orig
        return True

    llm.collective_rpc(remove)


def _has_snapshot(llm) -> bool:
    return llm.collective_rpc(lambda w: "_jetrl_snapshot" in vars(getattr(w, "worker", w)))[0]


def _changed(before: dict, after: dict) -> list[str]:
    assert after.keys() == before.keys()
    return [n for n in before if not torch.equal(before[n], after[n])]


@pytest.mark.parametrize(
    "fault, error, match",
    [
        ("half", "RefitError", r"refit failed in the engine \(.*injected loader failure after "),
        ("flip", "ParityError", r"model\.layers\.1\.mlp\.down_proj\.weight \(1 of "),
    ],
)
def test_a_refit_failing_inside_the_engine_leaves_it_bit_identical(rollout, fault, error, match):
    from nemo_jetrl.vllm_patch import refit as refit_mod

    llm, recipe = rollout.llm, rollout.recipe
    before, out_before = _engine_state(llm, recipe), _generate(llm, logprobs=1)
    _inject(llm, fault)
    try:
        with pytest.raises(getattr(refit_mod, error), match=match) as ei:
            rollout.refit(tiny_llama_128(7).state_dict())
    finally:
        _remove_fault(llm)
    assert "rolled back to its state before this refit" in str(ei.value)
    assert not _changed(before, _engine_state(llm, recipe))
    out = _generate(llm, logprobs=1)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in out_before]
    assert _token_logprobs(out) == _token_logprobs(out_before)
    assert not _has_snapshot(llm)  # restored and freed


def test_without_rollback_the_same_failure_leaves_the_engine_changed(rollout):
    """The mutation: what the rollback undoes is real (half of another seed's weights load)."""
    llm, recipe = rollout.llm, rollout.recipe
    before = _engine_state(llm, recipe)
    _inject(llm, "half")
    try:
        with pytest.raises(Exception, match="injected loader failure") as ei:
            rollout.refit(tiny_llama_128(7).state_dict(), rollback=False)
    finally:
        _remove_fault(llm)
    assert "rolled back" not in str(ei.value)
    changed = _changed(before, _engine_state(llm, recipe))
    assert changed, "the injected half-load changed nothing: the rollback test would be vacuous"
    # A good refit (with rollback: its snapshot is freed after) makes the engine whole again.
    rep = rollout.refit(tiny_llama_128(0).state_dict())
    assert rep.parity is not None and rep.parity.differing == ()
    assert not _changed(before, _engine_state(llm, recipe))
    assert not _has_snapshot(llm)
