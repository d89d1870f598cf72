"""Refits that fail after tensors reached the real vLLM CPU engine are rolled back (issue 17).

`refit.refit` checks every input before sending; what can still fail is in the engine: the
loader raising half way, the parity check finding a difference. Both are injected in the worker
(closures sent by value, test-only ``VLLM_ALLOW_INSECURE_SERIALIZATION``) around the real
loader: after each failure the engine's read-back state (FP8 bytes, scales, other tensors, GEMM
views, KV scales) equals the state before the refit bit for bit, and greedy generation gives the
same tokens and logprobs. The mutation (``rollback=False``) leaves the engine changed.

Each case runs on three engines: the jetrl recipe as this CPU runs it, and, with the labelled
oneDNN stand-in (``tests/vllm_patch/standins``), the jetrl and BF16 recipes on vLLM's repacking
branch, on every CPU: there the GEMM reads a packed copy held by the closure ``cpu_linear``
(lm_head and the embedding; with BF16 every decoder linear too, whose ``weight`` is then
empty), a half-load makes vLLM build new closures, and the rollback must put the old ones back
(checked by identity, and by reading every weight back through its GEMM).
"""

from __future__ import annotations

import gc

import pytest
import torch
from hf_models import tiny_llama_128
from test_vllm_engine import USER_KWARGS, _engine_state, _generate, _token_logprobs
from vllm_fixtures import DECODER_LINEARS, onednn_standin, vllm_cpu_env

pytestmark = pytest.mark.vllm


@pytest.fixture(
    scope="module",
    params=[("jetrl", False), ("jetrl", True), ("bf16", True)],
    ids=["jetrl", "standin-jetrl", "standin-bf16"],
)
def rollout(request, tmp_path_factory):
    from hf_models import char_tokenizer

    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine

    d = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama_128(0).save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    recipe_name, standin = request.param
    with vllm_cpu_env(), pytest.MonkeyPatch.context() as mp, onednn_standin(standin, mp):
        # Lets the tests send their loader faults as functions (test-only).
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        eng = VllmRolloutEngine(d, Recipe.preset(recipe_name), engine_kwargs=USER_KWARGS)
        if standin:  # the premise: vLLM took a repacking branch (the stand-in's, or AMX's SGL)
            # lm_head and the embedding (vLLM dispatches it too, keeping its weight) always
            embeddings = {"lm_head", "model.embed_tokens"}
            packed = set(_gemm_closures(eng.llm))
            assert packed == embeddings | (DECODER_LINEARS if recipe_name == "bf16" else set())
            assert set(eng.llm.collective_rpc("jetrl_repacked")[0]) == packed - embeddings
        yield eng  # without the stand-in: whatever this CPU does (AVX-512 repacks lm_head too)
        eng.close()
        gc.collect()


def _inject(llm, fault: str) -> None:
    """Wrap the worker's ``jetrl_load_weights`` (the real loader underneath) with ``fault``:
    "half" loads the first half of the tensors then raises; "flip" loads all, then flips one
    byte of layer 1's down_proj weight (FP8 under jetrl; under BF16, where that weight is empty
    and its GEMM reads a packed copy, of the embedding): a corruption only parity can see."""

    def install(worker, fault):  # runs in the worker (a closure: sent by value)
        from nemo_jetrl.vllm_patch.worker_ext import _model, pack, unpack

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
            weight = _model(self).get_submodule("model.layers.1.mlp.down_proj").weight
            if weight.numel() == 0:  # repacked: the GEMM reads a packed copy
                weight = _model(self).get_submodule("model.embed_tokens").weight
            weight.data.view(torch.uint8)[0, 0] ^= 1
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


def _gemm_closures(llm) -> dict[str, int]:
    """id of each layer's GEMM closure (``cpu_linear``) that holds a packed weight copy, by layer
    name: whichever vLLM built (the stand-in's oneDNN handler; on AMX CPUs vLLM 0.32 packs small
    BF16 weights for its SGL kernel first; zentorch). Its plain ``F.linear`` lambdas capture
    nothing."""

    def probe(worker):  # runs in the worker (a closure: sent by value)
        from nemo_jetrl.vllm_patch.worker_ext import _model

        found = {}
        for name, m in _model(getattr(worker, "worker", worker)).named_modules():
            fn = getattr(m, "cpu_linear", None)
            if getattr(fn, "__closure__", None):
                found[name] = id(fn)
        return found

    return llm.collective_rpc(probe)[0]


def _has_snapshot(llm) -> bool:
    return llm.collective_rpc(lambda w: "_jetrl_snapshot" in vars(getattr(w, "worker", w)))[0]


def _changed(before: dict, after: dict) -> list[str]:
    assert after.keys() == before.keys()
    return [n for n in before if not torch.equal(before[n], after[n])]


@pytest.mark.parametrize(
    "fault, error, match",
    [
        ("half", "RefitError", r"refit failed in the engine \(.*injected loader failure after "),
        ("flip", "ParityError", r"(layers\.1\.mlp\.down_proj|embed_tokens)\.weight \(1 of "),
    ],
)
def test_a_refit_failing_inside_the_engine_leaves_it_bit_identical(rollout, fault, error, match):
    from nemo_jetrl.vllm_patch import refit as refit_mod

    llm, recipe = rollout.llm, rollout.recipe
    before, out_before = _engine_state(llm, recipe), _generate(llm, logprobs=1)
    closures = _gemm_closures(llm)
    _inject(llm, fault)
    try:
        with pytest.raises(getattr(refit_mod, error), match=match) as ei:
            rollout.refit(tiny_llama_128(7).state_dict())
    finally:
        _remove_fault(llm)
    assert "rolled back to its state before this refit" in str(ei.value)
    assert not _changed(before, _engine_state(llm, recipe))
    assert _gemm_closures(llm) == closures  # the same closure objects, not rebuilt copies
    out = _generate(llm, logprobs=1)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in out_before]
    assert _token_logprobs(out) == _token_logprobs(out_before)
    assert not _has_snapshot(llm)  # restored and freed


def test_without_rollback_the_same_failure_leaves_the_engine_changed(rollout):
    """The mutation: what the rollback undoes is real (half of another seed's weights load)."""
    llm, recipe = rollout.llm, rollout.recipe
    before, closures = _engine_state(llm, recipe), _gemm_closures(llm)
    _inject(llm, "half")
    try:
        with pytest.raises(Exception, match="injected loader failure") as ei:
            rollout.refit(tiny_llama_128(7).state_dict(), rollback=False)
    finally:
        _remove_fault(llm)
    assert "rolled back" not in str(ei.value)
    changed = _changed(before, _engine_state(llm, recipe))
    assert changed, "the injected half-load changed nothing: the rollback test would be vacuous"
    if closures:  # lm_head sorts into the loaded half: vLLM rebuilt its packed closure
        rebuilt = {n for n, i in _gemm_closures(llm).items() if closures.get(n) != i}
        assert "lm_head" in rebuilt, rebuilt
        assert "lm_head.weight" in changed, changed  # read back through the new closure
    # A good refit (with rollback: its snapshot is freed after) makes the engine whole again.
    rep = rollout.refit(tiny_llama_128(0).state_dict())
    assert rep.parity is not None and rep.parity.differing == ()
    assert not _changed(before, _engine_state(llm, recipe))
    assert not _has_snapshot(llm)
