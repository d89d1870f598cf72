"""NeMo-RL's real vLLM refit (v0.7.0, vLLM 0.20 CPU build) with our hook: weights are ours.

One tiny Llama (every linear a multiple of 128) is served by ``vllm.LLM`` the way NeMo-RL's
``VllmGenerationWorker`` starts it: NeMo-RL's own ``init_fp8`` (its vLLM patches and engine
kwargs), its ``VllmInternalWorkerExtension`` as the worker extension, engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), our vLLM patch applied. A refit then runs NeMo-RL's real
sender (``stream_weights_via_ipc_zmq_impl``) over a real ZMQ socket into its real receiver
(``update_weights_via_ipc_zmq`` -> ``_load_weights`` -> ``fp8.load_weights``).

Stand-ins, only for what needs a GPU: CUDA IPC handles (the sender writes each packed buffer to a
file, the receiver maps it back), ``torch.cuda.current_stream()`` (no-op synchronize), the GPU
UUID naming the ZMQ socket, and ``worker.device`` (vLLM's CPU worker has none); on the worker
side they come with ``standins/jetrl_nrl_worker_standin.py``, a test-only vLLM plugin that also
runs NeMo-RL's own ``apply_fp8_patches`` there (vLLM's CPU build spawns its worker). Our hook
reaches the worker through nemo_jetrl's own entry point (``vllm_refit.load_in_worker``).

FP32 weight scales, where NeMo-RL's own quantizer differs from TE's formula: with our hook every
FP8 weight and scale the engine holds equals ``nemo_jetrl.fp8`` bit for bit and our parity check
passes inside the transport; without it (the mutation) the same check names the differing tensors.

The engine start and NeMo-RL's refit call: nemo_rl_vllm_engine.py (shared with
test_nemo_rl_refit_vllm_moe.py, which starts its own engine with it).
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from hf_models import save_tiny_llama, tiny_llama_128
from nemo_rl_upstream import expected_refit_layout
from nemo_rl_vllm_engine import (
    _close_receiver_socket,
    _last_parity,
    _read_fp8,
    _refit_via_nemo_rl,
    nemo_rl_engine,
)

from nemo_jetrl.vllm_patch.worker_ext import unpack

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]


@pytest.fixture(scope="module")
def nrl_engine(tmp_path_factory):
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import settings_from_recipe

    d = tmp_path_factory.mktemp("nrl_llama")
    save_tiny_llama(d)
    # FP32 weight and activation scales: where NeMo-RL's own quantizer differs from ours.
    settings = dataclasses.replace(
        settings_from_recipe(Recipe.preset("jetrl"), num_layers=2),
        pow2_weight_scales=False,
        pow2_activation_scales=False,
    )
    with nemo_rl_engine(d, tmp_path_factory.mktemp("ipc"), settings) as (llm, device_id):
        yield llm, settings, device_id


def _reset_receiver_socket(self):
    """After a refit that failed mid-stream, v0.7.0's receiver (a REP socket) owes the sender a
    reply it will never send; a new socket lets the next refit start clean."""
    _close_receiver_socket(self)
    worker = getattr(self, "worker", self)  # vLLM's WorkerWrapperBase forwards attributes
    for attr in ("zmq_socket", "zmq_context"):
        worker.__dict__.pop(attr, None)
    return True


def _plugin_install(self, parity, rollback=True):
    from nemo_jetrl.backends.nemo_rl import vllm_refit

    os.environ.update(vllm_refit.refit_hook_env(parity, rollback))
    vllm_refit.load_in_worker()
    return vllm_refit._PLUGIN_HANDLE.active, vllm_refit._PLUGIN_HANDLE.layout


def _plugin_revert(self):
    from nemo_jetrl.backends.nemo_rl import vllm_refit

    vllm_refit._PLUGIN_HANDLE.revert()
    vllm_refit._PLUGIN_HANDLE.revert()  # idempotent
    return vllm_refit._PLUGIN_HANDLE.active


def _state_dict(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tiny_llama_128(seed).state_dict().items()}


def _engine_state(llm, settings) -> dict[str, torch.Tensor]:
    """Every tensor a refit writes, read back from the engine as raw bytes, and each attention
    layer's q/k/v scale parameters."""
    names = list(_ours(_state_dict(0), settings).tensors)
    back = unpack(llm.collective_rpc(_read_fp8, args=(names,))[0])
    state = {n: t.contiguous().reshape(-1).view(torch.uint8) for n, t in back.items()}
    for layer, per in llm.collective_rpc(_attention_scales)[0].items():
        for t, v in per.items():
            state[f"{layer}|{t}"] = torch.tensor([v], dtype=torch.float64).view(torch.uint8)
    return state


def _changed(before: dict, after: dict) -> list[str]:
    assert after.keys() == before.keys()
    return [n for n in before if not torch.equal(before[n], after[n])]


def _greedy(llm) -> list[int]:
    return list(llm.generate(["Hello wor"], _sampling())[0].outputs[0].token_ids)


def _parity_vs_ours(self, blob, layers):
    """Our parity check against our quantization of the same weights (message or report)."""
    from nemo_jetrl.backends.nemo_rl.refit_batches import SentTensors, check_refit_parity
    from nemo_jetrl.vllm_patch.refit import ParityError
    from nemo_jetrl.vllm_patch.worker_ext import unpack

    try:
        return check_refit_parity(self, SentTensors(fp8=unpack(blob), fp8_layers=list(layers)))
    except ParityError as exc:
        return str(exc)


def _ours(weights, settings):
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict

    return quantize_state_dict(weights, settings)


def test_refit_through_nemo_rl_lands_our_fp8_bytes_and_passes_parity(nrl_engine):
    llm, settings, device_id = nrl_engine
    weights = _state_dict(1)
    assert _refit_via_nemo_rl(llm, device_id, weights)
    rep = llm.collective_rpc(_last_parity)[0]
    qsd = _ours(weights, settings)
    assert rep.fp8 == 2 * len(qsd.fp8_layers) == 2 * 14 and rep.differing == ()
    assert rep.compared > rep.fp8  # BF16 tensors (norms, embeddings, lm_head) compared too
    back = unpack(llm.collective_rpc(_read_fp8, args=(qsd.fp8_names(),))[0])
    for name in qsd.fp8_names():  # independent of the hook's own check: bytes equal ours
        want, got = qsd.tensors[name], back[name]
        assert got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    out = llm.generate(["Hello wor"], _sampling())[0]
    assert len(out.outputs[0].token_ids) == 4


def _sampling():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)


def test_without_the_hook_nemo_rls_quantizer_fails_our_parity_check(nrl_engine):
    """The mutation: NeMo-RL's own fp8.load_weights (hook reverted) with FP32 scales."""
    from nemo_jetrl.vllm_patch.worker_ext import pack

    llm, settings, device_id = nrl_engine
    weights = _state_dict(2)
    qsd = _ours(weights, settings)
    blob = pack({n: qsd.tensors[n] for n in qsd.fp8_names()})
    assert llm.collective_rpc(_plugin_revert)[0] is False
    try:
        assert _refit_via_nemo_rl(llm, device_id, weights)  # NeMo-RL's own quantizer
        msg = llm.collective_rpc(_parity_vs_ours, args=(blob, qsd.fp8_layers))[0]
        back = unpack(llm.collective_rpc(_read_fp8, args=(qsd.fp8_names(),))[0])
    finally:
        again = llm.collective_rpc(_plugin_install, args=(True,))[0]
    assert isinstance(msg, str) and "refit parity check failed" in msg, msg
    differing = re.findall(r"- (\S+) \((\d+) of (\d+) bytes differ\)", msg)
    assert differing, msg
    w_bytes = sum(int(n) for name, n, _ in differing if name.endswith(".weight"))
    s_diff = [name for name, _, _ in differing if name.endswith("weight_scale_inv")]
    total = sum(qsd.tensors[n].numel() for n in qsd.fp8_names() if n.endswith(".weight"))
    assert s_diff  # NeMo-RL's reciprocal scales differ from TE's
    n_scales = sum(
        int((back[n].view(torch.int32) != qsd.tensors[n].view(torch.int32)).sum())
        for n in qsd.fp8_names()
        if n.endswith("weight_scale_inv")
    )
    print(f"\nwithout hook (FP32 scales): {w_bytes} of {total} FP8 weight bytes differ, "
          f"{len(s_diff)} of {len(qsd.fp8_layers)} scale_inv tensors ({n_scales} scales) differ")  # fmt: skip
    assert n_scales > 0
    # and with the hook back, the same weights pass again
    assert again[0] and again[1] in expected_refit_layout()
    assert _refit_via_nemo_rl(llm, device_id, weights)
    assert llm.collective_rpc(_last_parity)[0].differing == ()


def test_a_corrupted_load_is_named_by_the_parity_check_inside_the_transport(nrl_engine):
    """Our check runs at the end of NeMo-RL's transport and stops it with the tensor's name."""
    from nemo_rl.models.generation.vllm.quantization import fp8

    llm, settings, device_id = nrl_engine
    weights = _state_dict(3)

    def corrupt(self):  # in the worker: after our loader, one FP8 byte of down_proj flips
        fp8._jetrl_test_saved = ours = fp8.load_weights

        def flipped(batch, model_runner):
            ours(batch, model_runner)
            if any(k.endswith("layers.1.mlp.down_proj.weight") for k, _ in batch):
                p = model_runner.model.model.layers[1].mlp.down_proj.weight
                p.data.view(torch.uint8)[0, 0] ^= 1

        fp8.load_weights = flipped
        return True

    def restore(self):
        fp8.load_weights = fp8._jetrl_test_saved
        return True

    before = _engine_state(llm, settings)
    llm.collective_rpc(corrupt)
    try:
        with pytest.raises(Exception, match=r"model\.layers\.1\.mlp\.down_proj\.weight") as ei:
            _refit_via_nemo_rl(llm, device_id, weights)
    finally:
        llm.collective_rpc(restore)
    # rolled back: the engine holds the weights it had before this refit, bit for bit
    assert "rolled back to its state before this refit" in str(ei.value)
    assert not _changed(before, _engine_state(llm, settings))
    assert _refit_via_nemo_rl(llm, device_id, weights)


LATE = "model.layers.1.mlp.down_proj.weight"  # streamed in a later batch than layer 0's


@pytest.mark.parametrize("rollback", [True, False], ids=["rollback", "mutation-no-rollback"])
def test_a_batch_refused_mid_stream_leaves_the_engine_bit_identical(nrl_engine, rollback):
    """Issue 17: our quantizer refuses a non-finite weight in a later batch, after NeMo-RL's
    receiver loaded the earlier ones. With the rollback the engine is as before the refit, bit
    for bit, and generates the same tokens; without it (the mutation) the earlier batches stay
    loaded, which is what the rollback undoes."""
    llm, settings, device_id = nrl_engine
    assert _refit_via_nemo_rl(llm, device_id, _state_dict(6))  # a known, good state
    before, tokens = _engine_state(llm, settings), _greedy(llm)
    weights = _state_dict(7)
    weights[LATE][3, 5] = float("inf")
    if not rollback:
        llm.collective_rpc(_plugin_revert)
        llm.collective_rpc(_plugin_install, args=(True, False))
    try:
        match = rf"{re.escape(LATE)}'\): non-finite value inf at \[3, 5\]"
        with pytest.raises(Exception, match=match) as ei:
            _refit_via_nemo_rl(llm, device_id, weights, timeout_ms=3000)
    finally:
        llm.collective_rpc(_reset_receiver_socket)
        if not rollback:
            llm.collective_rpc(_plugin_revert)
            llm.collective_rpc(_plugin_install, args=(True, True))
    changed = _changed(before, _engine_state(llm, settings))
    if rollback:
        assert "rolled back to its state before this refit" in str(ei.value)
        assert not changed, changed
        assert _greedy(llm) == tokens
    else:
        assert "rolled back" not in str(ei.value) and "nothing was loaded" not in str(ei.value)
        assert "the batches before it stay loaded" in str(ei.value)
        assert "model.layers.0.mlp.down_proj.weight" in changed, changed  # an earlier batch
    assert _refit_via_nemo_rl(llm, device_id, _state_dict(6))  # the next refit goes through


def test_a_failure_inside_nemo_rls_own_transport_is_rolled_back_too(nrl_engine):
    """NeMo-RL's receiver itself fails after earlier batches loaded: its metadata gives layer 1's
    down_proj transposed, so vLLM's loader rejects the shape. Its transport logs that and returns
    False (v0.7.0 at once; main after the stream, at COMPLETE); the hook has restored the engine
    by the time it returns."""
    llm, settings, device_id = nrl_engine
    assert _refit_via_nemo_rl(llm, device_id, _state_dict(6))
    before, tokens = _engine_state(llm, settings), _greedy(llm)
    weights = _state_dict(8)
    info = {k: (v.shape, v.dtype) for k, v in weights.items()}
    info[LATE] = (torch.Size(reversed(weights[LATE].shape)), weights[LATE].dtype)
    try:
        ok = _refit_via_nemo_rl(llm, device_id, weights, timeout_ms=3000, info=info)
    finally:
        llm.collective_rpc(_reset_receiver_socket)
    assert ok is False
    assert not _changed(before, _engine_state(llm, settings))
    assert _greedy(llm) == tokens
    assert _refit_via_nemo_rl(llm, device_id, _state_dict(6))


def _attention_scales(self):
    """Each attention layer's q/k/v scale parameters, as the refit loaded them."""
    out = {}
    for name, m in self.model_runner.model.named_modules():
        if name.endswith("self_attn.attn"):
            out[name] = {t: float(getattr(m, f"{t}_scale").reshape(-1)[0]) for t in "qkv"}
    return out


def test_calibrated_kv_scales_ride_nemo_rls_refit_into_the_attention_layers(nrl_engine):
    """What our policy worker ships (`refit_kv_scales` -> NeMo-RL's refit iterator names) goes
    through NeMo-RL's real sender/receiver and vLLM's loader into every attention layer; our
    parity check compares them. (vLLM 0.20's CPU build has no FP8 KV cache, so the values
    attention would use with one are not reached here.) The scales are calibrated-looking fp32
    values no BF16 holds: vLLM creates the scale parameters in the model's dtype, and our hook
    makes them float32 before loading (a BF16 parameter would round them)."""
    from nemo_jetrl.backends.nemo_rl.calibration import refit_kv_scales
    from nemo_jetrl.kvcache import KVScales

    def f32(x: float) -> float:
        return float(torch.tensor(x, dtype=torch.float32))

    llm, _, device_id = nrl_engine
    ours = KVScales(
        {
            i: {
                "q": f32(0.0123 + i / 1000),
                "k": f32(0.00937 * (i + 1)),
                "v": f32(0.0035 / (i + 1)),
            }
            for i in range(2)
        }
    )
    assert all(f32(float(torch.tensor(v, dtype=torch.bfloat16))) != v
               for per in ours.layers.values() for v in per.values())  # fmt: skip
    shipped = refit_kv_scales(None, ours.to_vllm(include_q=True))  # v0.7.0 colocated: none given
    weights = _state_dict(4)
    weights.update({k: torch.tensor([v], dtype=torch.float32) for k, v in shipped.items()})
    assert _refit_via_nemo_rl(llm, device_id, weights)
    rep = llm.collective_rpc(_last_parity)[0]
    assert rep.differing == () and rep.compared >= rep.fp8 + len(shipped)
    held = llm.collective_rpc(_attention_scales)[0]
    assert held == {
        f"model.layers.{i}.self_attn.attn": {t: ours.layers[i][t] for t in "qkv"} for i in range(2)
    }
