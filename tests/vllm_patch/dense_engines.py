"""The dense-Llama engines of tests/vllm_patch/test_vllm_cpu_gemm.py, each started once (issue 40).

The CPU-GEMM refit checks and the rollback checks ran on the same kinds of engine (tiny Llama,
jetrl and BF16 recipes, with and without the labelled oneDNN stand-in), each module starting its
own: 8 engine starts. ``EnginePool`` holds at most one engine at a time (2 cores, 24 GiB) and hands
the open one to every test that asks for the same key: 5 starts. A test that needs the engine as
it was loaded asks with ``fresh=True`` (it comes first on its engine: no extra start).
Also the worker-side helpers of the rollback checks (fault injection, closure probes).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import pytest
import torch
from vllm_fixtures import onednn_standin, vllm_cpu_env


@dataclass(frozen=True)
class EngineKey:
    dtype_name: str  # the engine's dtype ("float32", "bfloat16")
    recipe_name: str  # "bf16" or "jetrl"
    standin: bool  # the labelled oneDNN stand-in loaded (vLLM's repacking branch on any CPU)

    @property
    def id(self) -> str:
        dtype = {"float32": "fp32", "bfloat16": "bf16"}[self.dtype_name]
        return f"{'standin-' if self.standin else ''}{dtype}-{self.recipe_name}"


KEYS = {
    k.id: k
    for k in (
        EngineKey("float32", "bf16", False),
        EngineKey("bfloat16", "bf16", False),
        EngineKey("bfloat16", "jetrl", False),
        EngineKey("bfloat16", "bf16", True),
        EngineKey("bfloat16", "jetrl", True),
    )
}


class EnginePool:
    """One engine at a time, by key. ``get`` returns the open engine when it is ``key``'s (and
    not ``fresh``), else closes it and starts ``key``'s from the seed-0 checkpoint with dummy
    weights (every real value arrives by the initial refit). The module's order makes each
    engine's ``fresh`` test the first on it, so ``fresh`` costs no extra start there."""

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self.key: EngineKey | None = None
        self.engine = None
        self.starts = 0
        self.gaps: dict[EngineKey, list[float]] = {}  # the BF16 engines' gaps: FP8 controls
        self._stack: contextlib.ExitStack | None = None

    def get(self, key: EngineKey, *, fresh: bool = False):
        if self.engine is not None and self.key == key and not fresh:
            return self.engine
        self.close()
        from hf_models import char_tokenizer, tiny_llama_128

        from nemo_jetrl.recipe import Recipe
        from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine

        d = self._tmp.mktemp(key.id)
        tiny_llama_128(0).to(getattr(torch, key.dtype_name)).save_pretrained(d)
        char_tokenizer().save_pretrained(d)
        kwargs = dict(
            dtype=key.dtype_name, max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0,
            load_format="dummy",
        )  # fmt: skip
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(vllm_cpu_env())
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            # Lets the rollback tests send their loader faults as functions (test-only).
            mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
            stack.enter_context(onednn_standin(key.standin, mp))
            self.engine = VllmRolloutEngine(d, Recipe.preset(key.recipe_name), engine_kwargs=kwargs)
        except BaseException:
            stack.close()
            raise
        self._stack, self.key = stack, key
        self.starts += 1
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            gc.collect()
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        self.key = None


def inject(llm, fault: str) -> None:
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


def remove_fault(llm) -> None:
    def remove(worker):
        cls = type(getattr(worker, "worker", worker))
        cls.jetrl_load_weights = cls.__dict__["_jetrl_test_orig"]
        del cls._jetrl_test_orig
        return True

    llm.collective_rpc(remove)


def gemm_closures(llm) -> dict[str, int]:
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


def has_snapshot(llm) -> bool:
    return llm.collective_rpc(lambda w: "_jetrl_snapshot" in vars(getattr(w, "worker", w)))[0]


def changed(before: dict, after: dict) -> list[str]:
    assert after.keys() == before.keys()
    return [n for n in before if not torch.equal(before[n], after[n])]
