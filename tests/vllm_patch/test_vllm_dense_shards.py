"""Refit parity on dense tensors split over two vLLM ranks: a real vLLM CPU engine at
``tensor_parallel_size=2`` (multiprocessing executor, two workers) serving a tiny block-FP8
Qwen3 with GQA (4 query heads, 2 KV heads of 128; hidden 256, MLP 512: every per-rank shard a
multiple of 128) and a vocab of 160 (padded to 192: rank 1 holds 64 real rows + 32 padding).

vLLM's own loaders write each rank's shards (q/k/v and gate/up into fused column-parallel
parameters, o/down row-parallel, embedding/lm_head vocab-parallel); each rank then compares its
parameters with its part of what was sent, cut by ``dense_shards``: parity over every tensor on
each rank passes, a flipped byte in one rank's shard is named there only, and NeMo-RL's hooked
transport (``vllm_refit``) rolls every rank back to the previous weights when one rank's parity
fails or its transport returns False (``rank_vote``: all-or-nothing over the engine).
One engine start for the module.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from hf_models import char_tokenizer, tiny_hf_config, tiny_hf_model
from vllm_fixtures import vllm_cpu_env

# vllm_in_nemo_rl: the NeMo-RL main tier runs it on its vLLM 0.25.1 (NeMo-RL refit path)
pytestmark = [pytest.mark.vllm, pytest.mark.vllm_in_nemo_rl]

LAYERS = 2
USER = dict(
    dtype="bfloat16", max_model_len=128, max_num_seqs=2, enforce_eager=True, seed=0,
    tensor_parallel_size=2, distributed_executor_backend="mp", load_format="auto",
)  # fmt: skip


def tiny_qwen3(seed: int) -> torch.nn.Module:
    cfg = tiny_hf_config(
        "qwen3", vocab_size=160, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.08,
    )  # fmt: skip
    return tiny_hf_model(cfg, seed=seed, dtype=torch.bfloat16)


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_qwen3(seed).state_dict().items()}


@pytest.fixture(scope="module", autouse=True)
def _env():
    import os

    from nemo_jetrl.vllm_patch.compat import cpu_omp_threads_bind

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test functions sent to workers
        if cpu_omp_threads_bind() != "nobind" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cpus = sorted(os.sched_getaffinity(0))  # vLLM 0.20: one CPU list per rank
            half = max(1, len(cpus) // 2)
            lists = [cpus[:half], cpus[half:] or cpus[:half]]
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, c)) for c in lists))
        with vllm_cpu_env():
            yield


@pytest.fixture(scope="module")
def settings():
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import settings_from_recipe

    return settings_from_recipe(Recipe.preset("jetrl"))


@pytest.fixture(scope="module")
def llm(tmp_path_factory, settings):
    from safetensors.torch import save_file
    from vllm import LLM

    from nemo_jetrl.vllm_patch import apply_patches, build_engine_kwargs, verify_engine_kernels
    from nemo_jetrl.vllm_patch.engine_args import quantization_config
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict
    from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

    d = tmp_path_factory.mktemp("dense_tp2")
    model = tiny_qwen3(0)
    sd = quantize_state_dict(model.state_dict(), settings, dtype=torch.bfloat16).tensors
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    cfg = dict(model.config.to_dict(), architectures=["Qwen3ForCausalLM"])
    cfg["quantization_config"] = quantization_config(settings)
    (d / "config.json").write_text(json.dumps(cfg))
    char_tokenizer().save_pretrained(d)
    patch = apply_patches(settings)
    engine = LLM(model=str(d), **build_engine_kwargs(settings, USER).kwargs)
    try:
        verify_engine_kernels(engine, settings)
        yield engine
    finally:
        shutdown_engine(engine)
        patch.revert()
        gc.collect()


def _refit(self, blob: bytes, settings_json: str, load: bool = True) -> dict:
    """In each worker: the hooked fp8.load_weights' batch path (as NeMo-RL streams it), then
    parity over everything sent (``load=False``: parity only, against what the engine holds)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from nemo_jetrl.backends.nemo_rl.refit_batches import (
        SentTensors,
        check_refit_parity,
        quantize_batch,
    )
    from nemo_jetrl.vllm_patch import compat
    from nemo_jetrl.vllm_patch.refit import ParityError
    from nemo_jetrl.vllm_patch.settings import PatchSettings
    from nemo_jetrl.vllm_patch.worker_ext import unpack

    model, sent = self.model_runner.model, SentTensors()
    batch = quantize_batch(
        list(unpack(blob).items()), model, PatchSettings.from_json(settings_json), sent
    )
    if load:
        compat.reload_weights(model, self.vllm_config.model_config, iter(batch))
    out = {"rank": get_tensor_model_parallel_rank(), "sent": len(sent.fp8) + len(sent.other)}
    kept = {**sent.fp8, **sent.other}
    out["kept"] = {  # host copies of this rank's part only
        k: tuple(kept[k].shape)
        for k in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                  "model.embed_tokens.weight")
        if k in kept
    }  # fmt: skip
    try:
        r = check_refit_parity(self, sent)
    except ParityError as exc:
        return {**out, "error": str(exc)}
    return {**out, "compared": r.compared, "fp8": r.fp8, "kernel": r.through_kernel}


def _shapes(self) -> dict:
    m = self.model_runner.model
    return {
        "qkv": tuple(m.model.layers[0].self_attn.qkv_proj.weight.shape),
        "qkv_s": tuple(m.model.layers[0].self_attn.qkv_proj.weight_scale_inv.shape),
        "o": tuple(m.model.layers[0].self_attn.o_proj.weight.shape),
        "o_s": tuple(m.model.layers[0].self_attn.o_proj.weight_scale_inv.shape),
        "embed": tuple(m.model.embed_tokens.weight.shape),
    }


def _flip(self) -> int:
    """Rank 0: one byte of layer 0's k rows in qkv_proj (column-parallel, fused; the k shard
    starts after the rank's 256 q rows); rank 1: one byte of layer 1's o_proj (row-parallel)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    rank, m = get_tensor_model_parallel_rank(), self.model_runner.model
    if rank == 0:
        m.model.layers[0].self_attn.qkv_proj.weight.data.view(torch.uint8)[256 + 5, 7] ^= 1
    else:
        m.model.layers[1].self_attn.o_proj.weight.data.view(torch.uint8)[3, 200] ^= 1
    return rank


FP8_TENSORS = LAYERS * 7 * 2  # q k v o gate up down, weight + scale_inv


def test_each_rank_holds_its_shards(llm):
    for got in llm.collective_rpc(_shapes):
        assert got == {
            "qkv": (512, 256), "qkv_s": (4, 2), "o": (256, 256), "o_s": (2, 2), "embed": (96, 256),
        }, got  # fmt: skip


def test_refit_parity_over_every_tensor_on_each_rank(llm, settings):
    from nemo_jetrl.vllm_patch.worker_ext import pack

    new = weights(1)
    res = llm.collective_rpc(_refit, args=(pack(new), settings.to_json()))
    print(f"parity per rank: {res}")
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert "error" not in r, r
        assert r["compared"] == r["sent"] == len(new) + FP8_TENSORS // 2, r  # + one scale each
        assert r["fp8"] == FP8_TENSORS and r["kernel"] >= 1, r  # lm_head through its GEMM
        assert r["kept"] == {
            "model.layers.0.self_attn.k_proj.weight": (128, 256),  # 1 of 2 KV heads
            "model.layers.0.self_attn.o_proj.weight": (256, 256),  # half of 512 input columns
            "model.embed_tokens.weight": (96 if r["rank"] == 0 else 64, 256),  # of vocab 160
        }, r
    # the served (seed 0) weights are not what either rank holds now: parity can fail
    old = llm.collective_rpc(_refit, args=(pack(weights(0)), settings.to_json(), False))
    assert all("error" in r for r in old), old


def test_flipped_byte_named_on_its_rank_only(llm, settings):
    from nemo_jetrl.vllm_patch.worker_ext import pack

    blob = pack(weights(1))
    assert all(
        "error" not in r for r in llm.collective_rpc(_refit, args=(blob, settings.to_json()))
    )
    assert llm.collective_rpc(_flip) == [0, 1]
    r0, r1 = llm.collective_rpc(_refit, args=(blob, settings.to_json(), False))
    assert "model.layers.0.self_attn.k_proj.weight (1 of 32768 bytes differ)" in r0["error"], r0
    assert "model.layers.1.self_attn.o_proj.weight (1 of 65536 bytes differ)" in r1["error"], r1
    for r in (r0, r1):
        assert r["error"].count("\n  - ") == 1, r  # that tensor only
    res = llm.collective_rpc(_refit, args=(blob, settings.to_json()))  # a refit rewrites them
    assert all("error" not in r for r in res), res


def _transport(self, blob: bytes, settings_json: str, fail: str) -> dict:
    """NeMo-RL's hooked transport (parity and rollback on) around a stand-in for NeMo-RL's own
    transport that loads ``blob`` through the hooked batch path; on rank 1 it then either
    corrupts one byte of layer 0's down_proj (``fail="byte"``: the parity check must catch it)
    or returns False (``fail="false"``: NeMo-RL's transport caught an error of its own); or
    rank 1 cannot take its rollback snapshot (``fail="snapshot"``)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from nemo_jetrl.backends.nemo_rl.refit_batches import quantize_batch
    from nemo_jetrl.backends.nemo_rl.vllm_refit import HookState, _make_transport
    from nemo_jetrl.vllm_patch import compat
    from nemo_jetrl.vllm_patch.refit import ParityError, RefitError
    from nemo_jetrl.vllm_patch.settings import PatchSettings
    from nemo_jetrl.vllm_patch.worker_ext import unpack

    s = PatchSettings.from_json(settings_json)
    rank = get_tensor_model_parallel_rank()

    def nemo_rl_transport(worker) -> bool:
        model = worker.model_runner.model
        if worker.model_runner._jetrl_sent.error is not None:
            return True  # the hooked fp8.load_weights loads nothing once the refit is refused
        batch = quantize_batch(
            list(unpack(blob).items()), model, s, worker.model_runner._jetrl_sent
        )
        compat.reload_weights(model, worker.vllm_config.model_config, iter(batch))
        if rank == 1 and fail == "byte":
            model.model.layers[0].mlp.down_proj.weight.data.view(torch.uint8)[9, 17] ^= 4
        return not (rank == 1 and fail == "false")

    from nemo_jetrl.backends.nemo_rl import vllm_refit

    hooked = _make_transport(
        "update_weights_via_ipc_zmq", nemo_rl_transport, HookState(s, True, True, "test")
    )
    take = vllm_refit.take_snapshot
    if rank == 1 and fail == "snapshot":  # out of memory on this rank alone

        def no_room(*args, **kwargs):
            raise torch.OutOfMemoryError("stand-in: no room for the snapshot on rank 1")

        vllm_refit.take_snapshot = no_room
    try:
        return {"rank": rank, "ok": hooked(self)}
    except (ParityError, RefitError) as exc:
        return {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        vllm_refit.take_snapshot = take


def test_hooked_transport_rolls_every_rank_back_when_one_ranks_parity_fails(llm, settings):
    """All-or-nothing over the engine (``vllm_patch.rank_vote``): rank 1's parity check fails,
    rank 0's passes, and both ranks are restored, so the engine is never half refit."""
    from nemo_jetrl.vllm_patch.worker_ext import pack

    before, after = pack(weights(1)), pack(weights(2))
    assert all(
        "error" not in r for r in llm.collective_rpc(_refit, args=(before, settings.to_json()))
    )
    r0, r1 = llm.collective_rpc(_transport, args=(after, settings.to_json(), "byte"))
    assert r1["error"].startswith("ParityError:"), r1
    assert "model.layers.0.mlp.down_proj.weight (1 of " in r1["error"], r1
    assert r1["error"].count("\n  - ") == 1, r1
    assert r0["error"].startswith("RefitError: refit refused on tensor-parallel rank(s) [1] "), r0
    for r in (r0, r1):
        assert "rolled back" in r["error"], r
        assert "the refit failed on tensor-parallel rank(s) [1] of 2" in r["error"], r
    # both ranks hold the previous weights, bit for bit
    res = llm.collective_rpc(_refit, args=(before, settings.to_json(), False))
    assert all("error" not in r for r in res), res


def test_a_rank_whose_transport_returns_false_rolls_the_engine_back(llm, settings):
    """NeMo-RL's transport catches its own errors and returns False: every rank returns False
    and holds the previous weights."""
    from nemo_jetrl.vllm_patch.worker_ext import pack

    before, after = pack(weights(1)), pack(weights(3))
    assert all(
        "error" not in r for r in llm.collective_rpc(_refit, args=(before, settings.to_json()))
    )
    res = llm.collective_rpc(_transport, args=(after, settings.to_json(), "false"))
    assert res == [{"rank": 0, "ok": False}, {"rank": 1, "ok": False}], res
    res = llm.collective_rpc(_refit, args=(before, settings.to_json(), False))
    assert all("error" not in r for r in res), res
    # and a refit that loads on every rank is kept on every rank
    res = llm.collective_rpc(_transport, args=(after, settings.to_json(), "none"))
    assert res == [{"rank": 0, "ok": True}, {"rank": 1, "ok": True}], res
    res = llm.collective_rpc(_refit, args=(after, settings.to_json(), False))
    assert all("error" not in r for r in res), res


def test_a_rank_without_room_for_its_snapshot_still_votes_and_the_engine_rolls_back(llm, settings):
    """Rank 1 cannot take its rollback snapshot: it drains its stream loading nothing and votes
    (a rank that raised before the vote would leave rank 0 waiting in it), rank 0 rolls back."""
    from nemo_jetrl.vllm_patch.worker_ext import pack

    before, after = pack(weights(1)), pack(weights(4))
    assert all(
        "error" not in r for r in llm.collective_rpc(_refit, args=(before, settings.to_json()))
    )
    r0, r1 = llm.collective_rpc(_transport, args=(after, settings.to_json(), "snapshot"))
    assert "its rollback snapshot could not be taken (OutOfMemoryError" in r1["error"], r1
    assert "none of its weights loaded" in r1["error"], r1
    assert "refit refused on tensor-parallel rank(s) [1]" in r0["error"], r0
    assert "rolled back" in r0["error"], r0
    res = llm.collective_rpc(_refit, args=(before, settings.to_json(), False))
    assert all("error" not in r for r in res), [(r["rank"], r.get("error", "")[:400]) for r in res]


def test_closing_the_engine_leaves_no_queue_socket_open(llm):
    """Last in the module: the TP=2 engine's core runs in this process and its two workers are
    spawned (``mp``) behind message queues. vLLM 0.20's shutdown left their ZMQ sockets open
    with an infinite linger (a module's teardown then hung in zmq's ``Context.term``);
    `shutdown_engine` closes every one of them, on every vLLM line (the fixture's own close
    after this one finds the executor shut down and does nothing more)."""
    from nemo_jetrl.vllm_patch.shutdown import _executor_queues, queue_sockets, shutdown_engine

    queues = _executor_queues(llm.llm_engine.engine_core)
    assert len(queues) >= 2, queues  # the broadcast queue and each worker's response queue
    sockets = [s for q in queues for s in queue_sockets(q)]
    assert sockets and all(not s.closed for s in sockets)
    shutdown_engine(llm)
    assert all(s.closed for s in sockets)
