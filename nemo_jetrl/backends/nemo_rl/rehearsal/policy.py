"""The rehearsal's policy: NeMo-RL's ``ColocatablePolicyInterface`` on this machine's CPU, in the
driver process, in place of NeMo-RL's Megatron policy workers (CUDA, NCCL).

It is what ``grpo.setup`` builds through its ``policy_factory`` (the same keywords it gives
NeMo-RL's ``Policy``) and what ``grpo_train`` drives for a whole step: log-probabilities as
NeMo-RL's ``get_next_token_logprobs_from_logits`` computes them without tensor parallelism (its
own code moves token ids to CUDA), a train step with the loss function ``grpo.setup`` built
(wrapped by our mismatch metrics), a checkpoint, and the refit into the vLLM engines over
NeMo-RL's own ZMQ protocol. With an FP8 KV cache recipe (jetrl_kv) the training model carries our
KV machinery, and the policy calibrates the q/k/v scales and ships them in the refit (`kv.py`).

The model is the tiny model of the config's family (`model.py`) with the recipe's FP8 training
linears (`Fp8BlockLinear`, TE's blockwise recipe), master weights in float32, streamed in
vLLM's dtype. The one transport difference: CUDA IPC handles cannot exist here, so each packed
buffer travels as a file in shared memory (``handle = (path,)``), which the rehearsal's vLLM
plugin maps back (`cpu_worker`); the socket, the messages, the packing and the end marker are
NeMo-RL's (``nemo_rl.models.policy.utils``: ``IPCProtocol``, ``calculate_aligned_size``).
"""

from __future__ import annotations

import copy
import itertools
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from nemo_jetrl.backends.nemo_rl.rehearsal.cpu_worker import device_id
from nemo_jetrl.backends.nemo_rl.rehearsal.kv import (
    CpuKV,
    fp8_kv_cache,
    kv_refit_tensors,
    scale_names,
)

ZMQ_TIMEOUT_MS = 120_000  # NeMo-RL's policy worker's


def _interface() -> type:
    from nemo_rl.models.policy.interfaces import ColocatablePolicyInterface

    return ColocatablePolicyInterface


def make_cpu_policy_class() -> type:
    """`CpuPolicy`, subclassing the ``ColocatablePolicyInterface`` of the NeMo-RL imported."""
    base = _interface()
    return type("CpuPolicy", (_CpuPolicyBody, base), {"__module__": __name__})


def _trainer_model(model: torch.nn.Module, recipe: Any) -> Any:
    """The recipe's training side on ``model`` (the local backend's `make_trainer_model`); a
    Qwen3.5 model first gets its shared-expert MoE blocks (`hybrid`) and is converted through
    its decoder's config."""
    from nemo_jetrl.backends.local.precision import make_trainer_model, side_fp8_config
    from nemo_jetrl.backends.nemo_rl.rehearsal import hybrid

    if not hasattr(model.config, "text_config"):
        return make_trainer_model(model, recipe)
    side = recipe.train
    layers = int(hybrid.text_config(model.config).num_hidden_layers)
    fp8 = side_fp8_config(side) if side.fp8_linears else None
    hybrid.convert_shared_expert_moe(model, side, fp8, layers)
    # the GDN's in_proj_* are not "*_proj" names, so they stay BF16: as `jetrl check` requires
    # of a Megatron config (one in_proj GEMM there; vLLM's in_proj_ba has 2-row shards)
    return make_trainer_model(hybrid.DecoderView(model), recipe)


class _CpuPolicyBody:
    """The methods; `make_cpu_policy_class` puts NeMo-RL's interface under them."""

    def __init__(
        self,
        cluster: Any,
        config: dict,
        tokenizer: Any,
        processor: Any = None,
        weights_path: Any = None,
        optimizer_path: Any = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        *,
        recipe: Any = None,
        **_unused: Any,
    ) -> None:
        from transformers import AutoConfig

        from nemo_jetrl.backends.local.precision import freeze
        from nemo_jetrl.backends.nemo_rl.rehearsal import hybrid

        self.cfg = config
        self.tokenizer = tokenizer
        source = str(weights_path) if weights_path else config["model_name"]
        auto = hybrid.model_class(AutoConfig.from_pretrained(source))  # Qwen3.5: multimodal
        model = auto.from_pretrained(source, dtype=torch.float32)
        self.reference = freeze(copy.deepcopy(model)) if init_reference_model else None
        self.plan = _trainer_model(model, recipe) if recipe is not None else None
        self.model = model
        # our on-policy FP8 KV on the training model (the local backend's `_attach_kv_cache`)
        self.kv = CpuKV(model, recipe) if recipe is not None and recipe.kv_fp8 else None
        lr = float(((config.get("megatron_cfg") or {}).get("optimizer") or {}).get("lr") or 1e-5)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr) if init_optimizer else None
        if optimizer_path and self.optimizer is not None:
            self.optimizer.load_state_dict(torch.load(Path(optimizer_path) / "optim.pt"))
        gen = config["generation"]
        self.temperature = float(gen.get("temperature") or 1.0)
        # vLLM's model dtype: BF16 for an FP8 or BF16 rollout (what the refit announces and sends)
        float32 = gen["vllm_cfg"].get("precision") == "float32"
        self.vllm_dtype = torch.float32 if float32 else torch.bfloat16
        # the refit appends the KV scales after the weights when vLLM's cache is FP8 (NeMo-RL's
        # Megatron worker: every layer of the model, NeMo-RL's names)
        layers = int(hybrid.text_config(model.config).num_hidden_layers)
        self.kv_names = scale_names(layers) if fp8_kv_cache(gen) else []
        self.kv_sent: dict[str, float] = {}  # the last refit's KV scales
        self.refit_buffer_size_gb = config.get("refit_buffer_size_gb")
        self.debug_payload_metrics = None
        self._sender: threading.Thread | None = None
        self._sender_error: BaseException | None = None
        self._socket: Any = None
        self.refits = 0
        self.refit_bytes = 0
        self.after_refit: Any = None  # the rehearsal's per-refit report

    # -- log-probabilities ------------------------------------------------------------------

    def _sampling(self) -> Any:
        from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams

        gen = self.cfg["generation"]
        return TrainingSamplingParams(
            top_k=gen.get("top_k"), top_p=gen.get("top_p", 1.0), temperature=self.temperature
        )

    def _logits(self, model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids).logits.float() / self.temperature  # NeMo-RL's scaling

    def _next_token_logprobs(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """NeMo-RL's ``get_next_token_logprobs_from_logits`` without TP and filtering (its
        branch moves the token ids to CUDA: ``input_ids[:, 1:].cuda()``): [B, S-1]."""
        from nemo_rl.algorithms.logits_sampling_utils import need_top_k_or_top_p_filtering

        if need_top_k_or_top_p_filtering(self._sampling()):
            raise NotImplementedError(
                "the rehearsal's CPU policy computes log-probabilities without top-k/top-p "
                "filtering: rehearse with policy.generation.top_k=null top_p=1.0"
            )
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        return lp.gather(dim=-1, index=ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    def _logprobs(self, model: torch.nn.Module, data: Any) -> torch.Tensor:
        ids, lengths = data["input_ids"], data["input_lengths"]
        with torch.no_grad():
            lp = self._next_token_logprobs(ids, self._logits(model, ids))
        out = torch.zeros(ids.shape, dtype=torch.float32)
        out[:, 1:] = lp.float()
        keep = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        return out * keep

    def get_logprobs(self, data: Any, timer: Any = None) -> Any:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        self.model.eval()
        return BatchedDataDict({"logprobs": self._logprobs(self.model, data)})

    def get_reference_policy_logprobs(
        self, data: Any, micro_batch_size: int | None = None, timer: Any = None
    ) -> Any:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        model = self.reference if self.reference is not None else self.model
        return BatchedDataDict({"reference_logprobs": self._logprobs(model, data)})

    def get_topk_logits(self, data: Any, k: int, micro_batch_size: Any = None, timer: Any = None):
        raise NotImplementedError("the rehearsal's CPU policy runs GRPO, not distillation")

    # -- training ---------------------------------------------------------------------------

    def train(
        self, data: Any, loss_fn: Any, eval_mode: bool = False, *, gbs: Any = None,
        mbs: Any = None, timer: Any = None,
    ) -> dict[str, Any]:  # fmt: skip
        from nemo_rl.algorithms.loss.interfaces import LossInputType

        if loss_fn.input_type != LossInputType.LOGPROB:
            raise NotImplementedError(
                f"the rehearsal's CPU policy trains on log-probabilities; {loss_fn.input_type}"
            )
        rows = data.size
        gbs = int(gbs or self.cfg["train_global_batch_size"])
        mbs = int(mbs or self.cfg["train_micro_batch_size"])
        batches = max(1, rows // gbs)
        self.model.train(not eval_mode)
        losses, norms, mb_metrics = [], [], {}
        for b in range(batches):
            gb = data.slice(b * gbs, min(rows, (b + 1) * gbs))
            seqs = gb["sample_mask"].sum()
            toks = (gb["token_mask"][:, 1:] * gb["sample_mask"][:, None]).sum()
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for start in range(0, gb.size, mbs):
                mb = gb.slice(start, min(gb.size, start + mbs))
                logits = self._logits(self.model, mb["input_ids"])
                # what NeMo-RL's prepare_loss_input hands a LOGPROB loss (no filtering)
                lp = self._next_token_logprobs(mb["input_ids"], logits)
                loss, metrics = loss_fn(
                    data=mb, global_valid_seqs=seqs, global_valid_toks=toks,
                    next_token_logprobs=lp,
                )  # fmt: skip
                if not eval_mode:
                    loss.backward()
                total = total + loss.detach()
                lr = self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0
                metrics = {
                    **metrics,
                    "global_valid_seqs": float(seqs),
                    "global_valid_toks": float(toks),
                    "lr": lr,
                }
                for key, value in metrics.items():
                    v = float(value) / (batches if not key.endswith(("_min", "_max")) else 1)
                    mb_metrics.setdefault(key, []).append(v)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            if not eval_mode and self.optimizer is not None:
                self.optimizer.step()
            losses.append(total)
            norms.append(norm.detach().float())
        return {"loss": torch.stack(losses), "grad_norm": torch.stack(norms).max().reshape(1),
                "all_mb_metrics": mb_metrics}  # fmt: skip

    def calibrate_qkv_fp8_scales(self, data: Any, micro_batch_size: Any = None, percentile=99.9,
                                 margin=1.05, include_q=False) -> dict:  # fmt: skip
        """Our calibration (the recipe's jetrl.kv_calibration, as the Megatron worker: NeMo-RL's
        percentile and margin are not used) on the CPU model, installed for on-policy KV."""
        if self.kv is None:
            raise RuntimeError(
                "NeMo-RL asked for FP8 KV scales but the recipe has no FP8 KV cache: set "
                "policy.generation.vllm_cfg.kv_cache_dtype=auto or use the jetrl_kv recipe"
            )
        self.model.eval()
        mbs = int(micro_batch_size or self.cfg["logprob_batch_size"])
        return self.kv.calibrate(
            self.model, data["input_ids"], data["input_lengths"],
            micro_batch_size=mbs, include_q=include_q,
        )  # fmt: skip

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self.model.train()

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        self.model.eval()

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        pass

    # -- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None,
        tokenizer_path: str | None = None, checkpointing_cfg: Any = None, **_: Any,
    ) -> None:  # fmt: skip
        self.model.save_pretrained(weights_path)
        if optimizer_path and self.optimizer is not None:
            Path(optimizer_path).mkdir(parents=True, exist_ok=True)
            torch.save(self.optimizer.state_dict(), Path(optimizer_path) / "optim.pt")
        if tokenizer_path:
            self.tokenizer.save_pretrained(tokenizer_path)

    def finalize_async_save(self) -> None:  # main's checkpoint wait_fn; saves are synchronous
        pass

    # -- refit (NeMo-RL's ZMQ protocol; files instead of CUDA IPC handles) -------------------

    def _weights(self) -> dict[str, torch.Tensor]:
        """The weights under the names NeMo-RL's Megatron bridge exports and vLLM loads: an MoE
        block's fused experts (transformers 5: ``mlp.experts.gate_up_proj`` [E, 2I, H]) split
        per expert, ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (views; the local backend's
        rule, `engine_weights`); the router ``mlp.gate.weight`` and the rest as named."""
        from nemo_jetrl.backends.local.vllm_moe import engine_weights

        weights = {n: p.detach() for n, p in self.model.named_parameters()}
        if hasattr(self.model.config, "text_config"):  # Qwen3.5: main's Megatron worker sends
            return weights  # grouped expert slabs (refit_experts.py), HF's multimodal names
        return engine_weights(weights)

    def _kv_tensors(self, kv_scales: Any) -> list[tuple[str, torch.Tensor]]:
        """The KV scales a refit sends (float32, never cast to vLLM's dtype), as NeMo-RL."""
        calibrated = self.kv.vllm_scales if self.kv is not None else None
        return kv_refit_tensors(self.kv_names, kv_scales, calibrated)

    def prepare_refit_info(self) -> dict[str, Any]:
        info = {n: (t.shape, self.vllm_dtype) for n, t in self._weights().items()}
        return {**info, **{n: (t.shape, t.dtype) for n, t in self._kv_tensors(None)}}

    def get_free_memory_bytes(self) -> int:
        return 1 << 30  # host memory: NeMo-RL takes 30% of it for the refit buffer

    def offload_before_refit(self) -> None:
        pass

    def stream_weights_via_ipc_zmq(self, buffer_size_bytes: int = 0, kv_scales: Any = None):
        """Starts the sender and returns at once (NeMo-RL starts the receivers after this
        call); `offload_after_refit` waits for it."""
        self._sender_error = None
        kv = self._kv_tensors(kv_scales)  # refuses scales contradicting our calibration, here
        self.kv_sent = {n: float(t) for n, t in kv}
        self._sender = threading.Thread(
            target=self._send, args=(max(int(buffer_size_bytes) // 2, 1 << 20), kv), daemon=True
        )
        self._sender.start()
        return []

    def _send(self, capacity: int, kv: list[tuple[str, torch.Tensor]]) -> None:
        try:
            self._send_groups(capacity, kv)
        except BaseException as exc:  # handed to the driver in offload_after_refit
            self._sender_error = exc
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None

    def _send_groups(self, capacity: int, kv: list[tuple[str, torch.Tensor]]) -> None:
        import zmq
        from nemo_rl.models.policy.utils import IPCProtocol, calculate_aligned_size

        if self._socket is None:
            self._socket = zmq.Context.instance().socket(zmq.REQ)
            for opt in (zmq.SNDTIMEO, zmq.RCVTIMEO):
                self._socket.setsockopt(opt, ZMQ_TIMEOUT_MS)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(f"ipc:///tmp/{device_id()}.sock")
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        group: list[tuple[str, torch.Tensor]] = []
        used = 0

        def flush() -> None:
            nonlocal group, used
            fd, path = tempfile.mkstemp(prefix="jetrl-refit-", dir=shm)
            os.close(fd)
            buf = torch.from_file(path, shared=True, size=used, dtype=torch.uint8)
            offset = 0
            for _, t in group:
                raw = t.contiguous().view(-1).view(torch.uint8)
                buf[offset : offset + raw.numel()] = raw
                offset += calculate_aligned_size(raw.numel())
            self._socket.send_pyobj(((path,), [n for n, _ in group], used))
            self._socket.recv()  # the receiver's ACK: it loaded (and our hook checked) the group
            os.unlink(path)
            self.refit_bytes += used
            group, used = [], 0

        weights = ((n, t.to(self.vllm_dtype)) for n, t in self._weights().items())
        for name, t in itertools.chain(weights, kv):  # one cast weight at a time
            size = calculate_aligned_size(t.numel() * t.element_size())
            if group and used + size > capacity:
                flush()
            group.append((name, t))
            used += size
        if group:
            flush()
        self._socket.send_pyobj(IPCProtocol.COMPLETE)
        self._socket.recv()
        self.refits += 1

    def offload_after_refit(self) -> None:
        if self._sender is not None:
            self._sender.join(timeout=ZMQ_TIMEOUT_MS / 1000 + 30)
            alive, self._sender = self._sender.is_alive(), None
            if alive:
                raise RuntimeError("the rehearsal's refit sender did not finish")
        if self._sender_error is not None:
            err, self._sender_error = self._sender_error, None
            raise RuntimeError(f"the rehearsal's refit sender failed: {err!r}") from err
        if self.after_refit is not None:
            self.after_refit()

    def broadcast_weights_for_collective(self, kv_scales: Any = None, **_: Any) -> list:
        raise NotImplementedError("the rehearsal runs colocated generation (refit over ZMQ) only")

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int,
                        **_: Any) -> list:  # fmt: skip
        raise NotImplementedError("the rehearsal runs colocated generation (no NCCL group)")

    # -- the rest of what grpo.setup / grpo_train call ----------------------------------------

    def print_node_ip_and_gpu_id(self) -> list:
        print(f"jetrl rehearse: CPU policy in the driver (pid {os.getpid()})", flush=True)
        return []

    def shutdown(self) -> bool:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        return True
