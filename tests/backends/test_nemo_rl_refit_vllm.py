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
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
import threading
import uuid
from pathlib import Path

import pytest
import torch
from hf_models import char_tokenizer, tiny_llama_128
from nemo_rl_upstream import expected_refit_layout, nemo_rl_vllm_modules

from nemo_jetrl.vllm_patch.worker_ext import unpack

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]


BUFFER_BYTES = 1 << 20  # several packed batches for this model
ENGINE_KWARGS = dict(
    dtype="bfloat16", max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0
)


class _NoStream:
    """Stand-in for torch.cuda.current_stream() on CPU."""

    def synchronize(self) -> None:
        pass


STANDINS = Path(__file__).resolve().parent / "standins"


@pytest.fixture(scope="module")
def nrl_engine(tmp_path_factory):
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import settings_from_recipe

    d = tmp_path_factory.mktemp("nrl_llama")
    tiny_llama_128(0).save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    # FP32 weight and activation scales: where NeMo-RL's own quantizer differs from ours.
    settings = dataclasses.replace(
        settings_from_recipe(Recipe.preset("jetrl"), num_layers=2),
        pow2_weight_scales=False,
        pow2_activation_scales=False,
    )
    with nemo_rl_engine(d, tmp_path_factory.mktemp("ipc"), settings) as (llm, device_id):
        yield llm, settings, device_id


@contextlib.contextmanager
def nemo_rl_engine(
    d: Path, ipc_dir: Path, settings, vllm_cfg: dict | None = None, keep_bf16: bool = False
):
    """(llm, device_id): ``vllm.LLM`` on model dir ``d`` started as NeMo-RL's worker starts it
    (module docstring; ``vllm_cfg``: more ``policy.generation.vllm_cfg`` keys for NeMo-RL's
    ``init_fp8``; ``keep_bf16``: BF16 linears keep their weight, see the stand-in plugin), our
    patch with ``settings``, our hook armed; all undone on exit."""
    from vllm_fixtures import vllm_cpu_env

    from nemo_jetrl.vllm_patch.shutdown import shutdown_engine

    vllm_backend, fp8, utils = nemo_rl_vllm_modules()
    from nemo_jetrl.backends.nemo_rl import vllm_refit
    from nemo_jetrl.vllm_patch import apply_patches

    mp = pytest.MonkeyPatch()
    with vllm_cpu_env():
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as NeMo-RL's VllmGenerationWorker
        counter = iter(range(1 << 30))

        def handle_from_tensor(t):  # sender side: stand-in for a CUDA IPC handle
            path = str(ipc_dir / f"buf{next(counter)}.bin")
            t.detach().cpu().numpy().tofile(path)
            return (path,)

        mp.setattr(utils, "get_handle_from_tensor", handle_from_tensor)
        mp.setattr(torch.cuda, "current_stream", lambda *a: _NoStream())
        device_id = f"jetrl-test-{uuid.uuid4().hex[:8]}"
        cfg = {"precision": "fp8", "kv_cache_dtype": "auto", "async_engine": False}
        nrl_kwargs = fp8.init_fp8(
            {**cfg, **(vllm_cfg or {})}, str(d), 1
        )  # NeMo-RL's own patches and kwargs
        # vLLM's CPU build spawns its worker: the stand-in plugin applies NeMo-RL's fp8 patches
        # there (its apply_fp8_patches) and the CUDA stand-ins; nemo_jetrl's refit entry point
        # installs our hook there, armed by the env the launcher writes.
        standin = {
            "fp8": dataclasses.asdict(fp8.global_fp8_config),
            "device_id": device_id,
            "keep_unquantized_weights": keep_bf16,
        }
        mp.setenv("JETRL_NRL_WORKER_STANDIN", json.dumps(standin))
        # The stand-in plugin also runs in this process (vLLM loads plugins here too, and 0.25's
        # CPU worker lives here): record what it replaces so that mp.undo() restores it.
        from vllm.model_executor.layers import utils as layer_utils
        from vllm.v1.worker.cpu_worker import CPUWorker

        for owner, name in (
            (layer_utils, "dispatch_cpu_unquantized_gemm"),
            (vllm_backend, "rebuild_cuda_tensor_from_ipc"),
            (vllm_backend.VllmInternalWorkerExtension, "report_device_id"),
            (CPUWorker, "init_device"),
        ):
            mp.setattr(owner, name, getattr(owner, name))
        # vLLM loads plugins once per process, and 0.25's CPU worker lives in this one: without
        # this, a second engine here (the next module's) would start without the stand-in and
        # our hook, which the first engine's exit undid.
        import vllm.plugins

        mp.setattr(vllm.plugins, "plugins_loaded", False)
        mp.setenv("PYTHONPATH", os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")]))
        mp.syspath_prepend(str(STANDINS))
        for k, v in vllm_refit.refit_hook_env(True).items():
            mp.setenv(k, v)
        patch = apply_patches(settings)  # NEMO_JETRL_VLLM_PATCH reaches the worker process
        from vllm import LLM

        llm = LLM(
            model=str(d),
            load_format="dummy",
            worker_extension_cls=f"{vllm_backend.__name__}.VllmInternalWorkerExtension",
            **{**ENGINE_KWARGS, **nrl_kwargs},
        )
        try:
            active, layout = llm.collective_rpc(_hook_status)[0]
            assert active and layout in expected_refit_layout()
            yield llm, device_id
        finally:
            if vllm_refit._PLUGIN_HANDLE is not None:  # vLLM ran the plugins here too
                vllm_refit._PLUGIN_HANDLE.revert()
            patch.revert()
            for p in fp8.fp8_state.vllm_patches:
                p.stop()
            fp8.fp8_state.vllm_patches.clear()
            fp8.fp8_patches_applied = False
            llm.collective_rpc(_close_receiver_socket)
            shutdown_engine(llm)
            del llm
            gc.collect()
            mp.undo()


def _close_receiver_socket(self):
    """NeMo-RL's receiver keeps its ZMQ socket open for the worker's life. Close it (and its
    context) here: otherwise garbage collection later runs the context's destructor, which waits
    for that socket forever, and a later test hangs (seen in the main-7ea279a tier)."""
    sock = getattr(self, "zmq_socket", None)  # set on the worker by NeMo-RL's maybe_init_zmq
    if sock is not None:
        sock.close(linger=0)
    ctx = getattr(self, "zmq_context", None)
    if ctx is not None:
        ctx.term()  # returns at once now; a later destructor finds it closed


def _reset_receiver_socket(self):
    """After a refit that failed mid-stream, v0.7.0's receiver (a REP socket) owes the sender a
    reply it will never send; a new socket lets the next refit start clean."""
    _close_receiver_socket(self)
    worker = getattr(self, "worker", self)  # vLLM's WorkerWrapperBase forwards attributes
    for attr in ("zmq_socket", "zmq_context"):
        worker.__dict__.pop(attr, None)
    return True


def _hook_status(self):
    from nemo_jetrl.backends.nemo_rl import vllm_refit

    h = vllm_refit._PLUGIN_HANDLE
    return (h.active, h.layout) if h is not None else None


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


def _refit_via_nemo_rl(
    llm,
    device_id: str,
    weights: dict[str, torch.Tensor],
    *,
    timeout_ms: int = 120000,
    info: dict | None = None,
) -> bool:
    """NeMo-RL's colocated refit: its sender in a thread, its receiver through collective_rpc.
    Returns the receiver's result; a sender error is raised unless the receiver failed too
    (v0.7.0's receiver then never acknowledges, and the sender times out after ``timeout_ms``)."""
    import zmq
    from nemo_rl.models.policy.utils import stream_weights_via_ipc_zmq_impl

    # NeMo-RL's metadata step (policy.prepare_refit_info -> the workers' prepare_refit_info).
    info = info or {k: (v.shape, v.dtype) for k, v in weights.items()}
    llm.collective_rpc("prepare_refit_info", args=(info,))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc:///tmp/{device_id}.sock")  # the address the vLLM side connects to
    errors: list[BaseException] = []

    def send() -> None:
        try:
            stream_weights_via_ipc_zmq_impl(iter(weights.items()), BUFFER_BYTES, sock, 0, "test")
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    try:
        results = llm.collective_rpc("update_weights_via_ipc_zmq")
    finally:
        t.join(timeout=timeout_ms / 1000 + 60)
        sock.close()
        ctx.term()
    if all(results):
        assert not errors, errors
    return all(results)


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


def _read_fp8(self, names):  # safetensors bytes: tensors do not cross vLLM's RPC as they are
    from nemo_jetrl.vllm_patch.worker_ext import pack, read_back

    return pack({k: t.clone() for k, t in read_back(self, names)})


def _last_parity(self):
    return self.model_runner._jetrl_last_parity


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
