"""Routed experts split over two vLLM ranks (issue 28): a real vLLM CPU engine at
``tensor_parallel_size=2`` (multiprocessing executor, two workers), once with the experts
tensor-parallel and once with ``enable_expert_parallel``, serving a tiny block-FP8 Qwen3-MoE
under the patch (8 experts of width 256: 128 per TP rank, i.e. 128-aligned shards).

On each rank: our experts kernel serves the layer (kernel report), what it computed during
generate is recomputed from the checkpoint's FP8 tensors (this rank's shard of each, or its
experts) through the dense path bit for bit, the logprobs agree with the FP8 reference forward,
and NeMo-RL's refit batch path lands every tensor with parity over each rank's part (a
flipped byte on rank 1 is named there, rank 0 stays clean): its experts' shards and its shards of
the TP-sharded dense layers (``dense_shards``; attention stays TP-sharded under expert parallel).
"""

from __future__ import annotations

import dataclasses
import gc
import json

import pytest
import torch
from hf_models import char_tokenizer, per_expert_state_dict, qwen3_moe_128
from moe_engine_setup import _experts_kernel_here
from vllm_fixtures import (
    EP_FP8_GAP_PER_FP8_ROUNDING_GAP,
    FP8_GAP_PER_FP8_ROUNDING_GAP,
    bf16_rounding_gap,
    fp8_rounding_gap,
    logprob_gap,
    moe_fp8_gap_bound,
    vllm_cpu_env,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not _experts_kernel_here(), reason="nemo_jetrl's experts kernel does not serve this vLLM"
    ),
]

E, INTER, MOE_LAYERS = 8, 256, (1, 2)
PROMPTS = ["Hello wor", "The cat s"]
MAX_TOKENS = 6
USER = dict(
    dtype="bfloat16", max_model_len=128, max_num_seqs=2, enforce_eager=True, seed=0,
    tensor_parallel_size=2, distributed_executor_backend="mp",
)  # fmt: skip


def tiny_moe(seed: int, inter: int = INTER) -> torch.nn.Module:
    return qwen3_moe_128(
        seed, experts=E, inter=inter, layers=3, mlp_only_layers=[0], num_key_value_heads=2,
        initializer_range=0.08,
    )  # fmt: skip


def write_fp8_checkpoint(model, d, settings) -> dict[str, torch.Tensor]:
    """``model`` as a block-FP8 HF checkpoint in ``d``, quantized by our trainer-side quantizer."""
    from safetensors.torch import save_file

    from nemo_jetrl.vllm_patch.engine_args import quantization_config
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict

    sd = quantize_state_dict(per_expert_state_dict(model), settings, dtype=torch.bfloat16).tensors
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    cfg = dict(model.config.to_dict(), architectures=["Qwen3MoeForCausalLM"])
    cfg["quantization_config"] = quantization_config(settings)
    (d / "config.json").write_text(json.dumps(cfg))
    char_tokenizer().save_pretrained(d)
    return sd


@pytest.fixture(scope="module", autouse=True)
def _env():
    import os

    from nemo_jetrl.vllm_patch.compat import cpu_omp_threads_bind

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test functions sent to workers
        if cpu_omp_threads_bind() != "nobind" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM 0.20 wants one CPU list per rank ("0|1"); it crashes on nobind
            cpus = sorted(os.sched_getaffinity(0))
            half = max(1, len(cpus) // 2)
            lists = [cpus[:half], cpus[half:] or cpus[:half]]
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, c)) for c in lists))
        with vllm_cpu_env():
            yield


@pytest.fixture(scope="module")
def settings():
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import settings_from_recipe

    base = settings_from_recipe(Recipe.preset("jetrl"))
    routers = tuple(f"model.layers.{i}.mlp.gate" for i in MOE_LAYERS)
    return dataclasses.replace(
        base, modules_to_not_convert=(*base.modules_to_not_convert, *routers)
    )


@pytest.fixture(scope="module", params=["tp", "ep"])
def served(request, tmp_path_factory, settings):
    """(mode, llm, checkpoint tensors): one engine at a time (module scope, per mode)."""
    import time

    from vllm import LLM

    from nemo_jetrl.vllm_patch import apply_patches, build_engine_kwargs, verify_engine_kernels
    from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

    d = tmp_path_factory.mktemp(f"moe_{request.param}")
    sd = write_fp8_checkpoint(tiny_moe(0), d, settings)
    user = dict(USER, load_format="auto", enable_expert_parallel=request.param == "ep")
    patch = apply_patches(settings)
    t0 = time.perf_counter()
    llm = LLM(model=str(d), **build_engine_kwargs(settings, user).kwargs)
    print(f"{request.param}: engine started in {time.perf_counter() - t0:.0f} s")
    try:
        verify_engine_kernels(llm, settings)
        yield request.param, llm, sd
    finally:
        shutdown_engine(llm)
        patch.revert()
        gc.collect()


def _generate(llm):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    return llm.generate(PROMPTS, sp, use_tqdm=False)


def _layout(self) -> dict:
    """In each worker: its ranks and the fused expert parameters' shapes, per MoE layer."""
    from nemo_jetrl.vllm_patch.expert_shards import expert_map, experts_layer, parallel

    out = {}
    for i in MOE_LAYERS:
        layer = experts_layer(self.model_runner.model, f"model.layers.{i}.mlp.experts")
        par, m = parallel(layer), expert_map(layer)
        out[i] = {
            "tp": (par.tp_size, par.tp_rank), "ep": (par.ep_size, par.ep_rank),
            "w13": tuple(layer.w13_weight.shape), "w2": tuple(layer.w2_weight.shape),
            "s13": tuple(layer.w13_weight_scale_inv.shape),
            "map": None if m is None else m.tolist(),
        }  # fmt: skip
    return out


def test_each_rank_holds_its_part_and_runs_our_kernel(served):
    mode, llm, _ = served
    _generate(llm)
    reports = llm.collective_rpc("jetrl_kernel_report")
    assert len(reports) == 2
    for rep in reports:
        moe = [v for v in rep["layers"].values() if v.get("moe")]
        assert len(moe) == 2 and all(v["ours"] and v["calls"] > 0 for v in moe), moe
    layouts = llm.collective_rpc(_layout)
    for rank, lay in enumerate(layouts):
        got = lay[MOE_LAYERS[0]]
        if mode == "tp":  # every expert, half of the intermediate dim
            assert got["tp"] == (2, rank) and got["ep"][0] == 1 and got["map"] is None
            assert (got["w13"], got["w2"], got["s13"]) == (
                (E, INTER, 256),
                (E, 256, 128),
                (E, 2, 2),
            )
        else:  # half of the experts, whole
            assert got["tp"][0] == 1 and got["ep"] == (2, rank)
            assert got["map"] == [j - 4 * rank if j // 4 == rank else -1 for j in range(E)]
            assert (got["w13"], got["w2"]) == ((4, 2 * INTER, 256), (4, 256, INTER))


def _rank_weights(sd, mode: str, rank: int, layer: int, e: int):
    """Expert ``e``'s FP8 weights as rank ``rank`` must hold them: the HF checkpoint's tensors,
    TP: rows (gate/up) / columns (down) ``rank*128 ..`` of weight and scale alike."""
    from nemo_jetrl.fp8.quantize import BlockQuantized

    base = f"model.layers.{layer}.mlp.experts.{e}"
    half = slice(rank * INTER // 2, (rank + 1) * INTER // 2) if mode == "tp" else slice(None)
    sblk = slice(half.start // 128, half.stop // 128) if mode == "tp" else slice(None)

    def q(projs, rows: bool):
        w = [sd[f"{base}.{p}.weight"] for p in projs]
        s = [sd[f"{base}.{p}.weight_scale_inv"] for p in projs]
        w = [t[half] if rows else t[:, half] for t in w]
        s = [t[sblk] if rows else t[:, sblk] for t in s]
        return BlockQuantized(torch.cat(w), torch.cat(s), (128, 128), "e4m3", True)

    return q(("gate_proj", "up_proj"), True), q(("down_proj",), False)


def test_each_rank_computes_its_part_with_trainings_bits(served, settings, trainer_ref):
    """Every MoE call on each rank, recomputed from its captured input with the rank's part of
    the checkpoint's FP8 experts through the dense path (nemo_jetrl.fp8's 1x128 quantizer on
    the rank's slice of the down input, the same GEMM), is bit for bit the rank's output (the
    partial sum vLLM's MoE layer then all-reduces); the generated logprobs agree with the FP8
    reference forward within the BF16 rounding control's bound."""
    from nemo_jetrl.fp8 import quantize_blockwise
    from nemo_jetrl.fp8.gemm_backends import run_gemm
    from nemo_jetrl.vllm_patch.worker_ext import unpack

    mode, llm, sd = served
    llm.collective_rpc("jetrl_capture", args=(64,))
    try:
        outs = _generate(llm)
        blobs = [unpack(b) for b in llm.collective_rpc("jetrl_captured")]
    finally:
        llm.collective_rpc("jetrl_capture", args=(0,))
    reports = llm.collective_rpc("jetrl_kernel_report")

    def dense(x, qw, backend):
        qx = quantize_blockwise(x, (1, 128), pow2_scales=settings.pow2_activation_scales)
        return run_gemm(backend, qx, qw, x.dtype)

    calls = 0
    for rank, blob in enumerate(blobs):
        for i in MOE_LAYERS:
            layers = reports[rank]["layers"]
            name = next(n for n in layers if n.startswith(f"model.layers.{i}.mlp.experts"))
            backend = layers[name]["gemm_backend"]
            n_calls = len({k.split("|")[1] for k in blob if k.startswith(name + "|")})
            for c in range(n_calls):
                x, ids, w, out = (blob[f"{name}|{c}|{k}"] for k in ("x", "ids", "w", "out"))
                want = torch.zeros(out.shape, dtype=torch.float32)
                mine = range(E) if mode == "tp" else range(4 * rank, 4 * rank + 4)
                for e in mine:
                    tok, pos = torch.where(ids == e)
                    if tok.numel():
                        q13, q2 = _rank_weights(sd, mode, rank, i, e)
                        gate, up = dense(x[tok], q13, backend).chunk(2, dim=-1)
                        y = dense(torch.nn.functional.silu(gate) * up, q2, backend)
                        want.index_add_(0, tok, y.float() * w[tok, pos, None].float())
                assert torch.equal(out, want.to(out.dtype)), (mode, rank, name, c)
                calls += 1
    assert calls >= 2 * 2 * MAX_TOKENS  # both ranks, both MoE layers, prefill + decode steps
    ref, trainer = trainer_ref
    gap, control = logprob_gap(outs, ref), bf16_rounding_gap(outs, trainer)
    rounding = fp8_rounding_gap(outs, ref)
    print(f"{mode}: {calls} calls bit-exact; fp8 gap {gap:.4f}, controls: bf16 {control:.4f}, "
          f"fp8 ref bf16 vs fp32 {rounding:.4f}")  # fmt: skip
    per = EP_FP8_GAP_PER_FP8_ROUNDING_GAP if mode == "ep" else FP8_GAP_PER_FP8_ROUNDING_GAP
    assert gap <= moe_fp8_gap_bound(control, rounding, per), (gap, control, rounding)


@pytest.fixture(scope="module")
def trainer_ref():
    from moe_engine_setup import fp8_reference  # the trainer's FP8 MoE forward in torch

    trainer = tiny_moe(0)
    return fp8_reference(trainer), trainer


def _nrl_refit_experts(self, blob: bytes, settings_json: str, load: bool = True) -> dict:
    """In each worker: the hooked fp8.load_weights' batch path (as NeMo-RL streams it), then
    the parity check over everything sent (this rank's part of it)."""
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
    s = PatchSettings.from_json(settings_json)
    batch = quantize_batch(list(unpack(blob).items()), model, s, sent)
    if load:  # else: parity only, against what the engine holds
        compat.reload_weights(model, self.vllm_config.model_config, iter(batch))
    n = len(sent.fp8) + len(sent.other) + sent.elsewhere  # kept here + other ranks'
    try:
        r = check_refit_parity(self, sent)
    except ParityError as exc:
        return {"error": str(exc)}
    return {"fp8": r.fp8, "compared": r.compared, "not_local": r.not_local, "sent": n}


def _flip_on_rank1(self) -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    from nemo_jetrl.vllm_patch.expert_shards import experts_layer, local_expert

    rank = get_tensor_model_parallel_rank()
    if rank == 1:
        layer = experts_layer(self.model_runner.model, "model.layers.2.mlp.experts")
        layer.w2_weight.data.view(torch.uint8)[local_expert(layer, 5), 0, 3] ^= 1
    return rank


def test_refit_lands_every_expert_with_parity_on_each_rank(served, settings):
    from nemo_jetrl.vllm_patch.worker_ext import pack

    mode, llm, _ = served
    new = per_expert_state_dict(tiny_moe(1))
    res = llm.collective_rpc(_nrl_refit_experts, args=(pack(new), settings.to_json()))
    all_experts = len(MOE_LAYERS) * E * 3 * 2  # layers x experts x (gate, up, down) x (w, scale)
    dense_fp8 = (3 * 4 + 3) * 2  # q k v o in 3 layers, gate up down of layer 0; w + scale
    for r in res:  # TP: every expert's shard; EP: the 4 local experts of 8; all dense shards
        want = all_experts if mode == "tp" else all_experts // 2
        assert (r["fp8"], r["not_local"]) == (want + dense_fp8, all_experts - want), r
        assert r["compared"] == r["sent"] - r["not_local"], r
    print(f"{mode}: parity per rank {res}")
    assert llm.collective_rpc(_flip_on_rank1) == [0, 1]
    r0, r1 = llm.collective_rpc(_nrl_refit_experts, args=(pack(new), settings.to_json(), False))
    assert "error" not in r0, r0
    assert "model.layers.2.mlp.experts.5.down_proj.weight (1 of " in r1["error"], r1
    assert r1["error"].count(".mlp.experts.") == 1 and r1["error"].count("\n  - ") == 1, r1
    # a refit rewrites the byte; back to the served weights, clean on both ranks
    back = pack(per_expert_state_dict(tiny_moe(0)))
    res = llm.collective_rpc(_nrl_refit_experts, args=(back, settings.to_json()))
    assert all("error" not in r for r in res), res
