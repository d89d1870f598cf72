"""The local loop's rollout on a real, patched vLLM engine (``jetrl.local.rollout_engine: vllm``).

Instead of the HF rollout model, sampling runs in ``vllm.LLM`` (the CPU build) started under the
nemo_jetrl patch through `nemo_jetrl.vllm_patch.engine.VllmRolloutEngine`. What the engine serves:

* **the model directory**: the run's HF config (with its ``architectures`` entry, which vLLM needs
  to pick the model class) and tokenizer, written to ``<log_dir>/vllm_model``. No weights: the
  engine starts with ``load_format="dummy"`` placeholders and every weight arrives by refit.
* **the weights**: every step the trainer's HF-named tensors first pass the local backend's guarded
  refit (`nemo_jetrl.backends.local.refit.refit`, which refuses missing / mis-shaped / non-finite
  tensors before anything is loaded), then the vLLM refit (quantize 128x128 with
  `nemo_jetrl.fp8`, its own finite/shape/dtype guards against the engine's parameters, load in
  place), then the parity check: the engine's FP8 weights and scales are read back and compared
  bit for bit with the trainer's quantization. A parity failure is an error, never a silent
  warning; the engine is rolled back to the weights it held before (``vllm_patch.rollback``), so
  it never keeps weights the trainer did not produce.
* **the logprobs**: vLLM returns, for every sampled token, ``log softmax(logits / T)`` at that token
  (``logprobs_mode="processed_logprobs"``: after temperature, the quantity the trainer recomputes);
  they become ``generation_logprobs``. vLLM's attention and GEMM kernels are not HF's, so they
  match the trainer to a tolerance, not bit for bit (docs/local_backend.md has the measured
  ``token_mult_prob_error``).
* **sampling**: each request gets its own seed drawn from the run's sampling generator, so the
  G samples of one prompt differ and a rerun with the same seed draws the same seeds.

* **the KV scales** (``jetrl_kv``): the trainer's calibrated q/k/v scales go to the engine's
  attention layers at the first calibration and with every refit, and are read back.
* **an MoE policy** (Qwen3-MoE): the trainer's fused experts are sent under the checkpoint's
  per-expert names (`vllm_moe.engine_weights`; parity covers every expert tensor), prefix
  caching is off, and the engine's routing of every generation is recorded in the engine
  (`nemo_jetrl.vllm_patch.routing_capture`) and laid out as the HF rollout's record
  (`last_routing`, `vllm_moe.routing_tensors`); where it cannot be recorded,
  ``routing_unavailable`` says why.

Checked by `vllm_recipe_issues` before anything starts: an FP8 KV cache runs only where the
installed vLLM's CPU attention runs one (vLLM >= 0.25 on x86 with AVX-512 or AMX; never 0.20),
asked of vLLM itself; FP8 linears with vLLM's own quantizer (``fp8_rollout``) are refused on
every CPU (this engine serves FP8 linears through the nemo_jetrl kernel only).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_jetrl.backends.local.rollout import RolloutBatch
from nemo_jetrl.config.load import ConfigIssue
from nemo_jetrl.recipe import Recipe

KEY = "jetrl.local.rollout_engine"
MODEL_DIR_NAME = "vllm_model"


def vllm_recipe_issues(recipe: Recipe, dtype: str) -> list[ConfigIssue]:
    """Why ``recipe`` (and the compute ``dtype``) cannot run with the vLLM engine here (or []).

    What depends on the CPU is asked of the installed vLLM (``compat.cpu_fp8_kv_cache``), never
    assumed; without an importable vLLM only the CPU-independent rules are checked.
    """
    issues = []
    if recipe.kv_fp8 and not vllm_importable():
        from nemo_jetrl.vllm_patch import compat

        ok, why = compat.cpu_fp8_kv_cache()
        if not ok:
            issues.append(
                ConfigIssue(
                    KEY,
                    f"recipe {recipe.name!r} uses an FP8 KV cache (kv_cache_dtype="
                    f"{recipe.kv_cache_dtype!r}), which vLLM's CPU backend cannot run here ({why}): "
                    "set jetrl.local.rollout_engine=hf for this recipe, or use a recipe without "
                    "FP8 KV cache (jetrl, bf16)",
                )
            )
    if recipe.rollout.fp8_linears and recipe.rollout.quantizer != "jetrl":
        issues.append(
            ConfigIssue(
                KEY,
                f"recipe {recipe.name!r} runs FP8 rollout linears with vLLM's own quantizer "
                f"(rollout quantizer {recipe.rollout.quantizer!r}); the local backend's vLLM "
                "engine serves FP8 linears only through the nemo_jetrl kernel (and vLLM's own "
                "block-FP8 CPU kernels exist only for AMX CPUs): set "
                "jetrl.local.rollout_engine=hf for this recipe, or use jetrl / bf16",
            )
        )
    if dtype != "bfloat16":
        issues.append(
            ConfigIssue(
                KEY,
                f"the vLLM engine serves the policy in bfloat16, but jetrl.local.dtype is "
                f"{dtype!r}: set jetrl.local.dtype=bfloat16 (or rollout_engine=hf)",
            )
        )
    return issues


def _no_vllm_message(why: str) -> str:
    return (
        f"rollout_engine=vllm needs vLLM, which this Python environment cannot import ({why}). "
        "Run in the vLLM environment: bash scripts/setup_vllm_env.sh once, then use "
        ".venv-vllm/bin/python (or .venv-vllm/bin/jetrl); or set jetrl.local.rollout_engine=hf"
    )


def vllm_importable() -> list[ConfigIssue]:
    """[] when vLLM can be imported here, else the issue saying which environment to use."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return [ConfigIssue(KEY, _no_vllm_message(str(exc)))]
    return []


def require_vllm() -> None:
    """Clear error when vLLM is not importable in this environment."""
    issues = vllm_importable()
    if issues:
        raise ImportError(f"{KEY}: {issues[0].message}")


def write_model_dir(model: torch.nn.Module, tokenizer: Any, dest: Path) -> Path:
    """Config (with ``architectures``) and tokenizer of ``model`` in ``dest``; no weights."""
    dest.mkdir(parents=True, exist_ok=True)
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.architectures = [type(model).__name__]
    config.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def cpu_engine_env() -> dict[str, str]:
    """Environment for vLLM's CPU engine on a shared machine (only keys the user did not set).

    ``VLLM_CPU_KVCACHE_SPACE`` is the KV cache in GiB of host memory (1 is plenty for this model);
    ``VLLM_CPU_OMP_THREADS_BIND`` is set to a value that pins no cores (vLLM's default reserves
    and pins cores, starving everything else on a small machine); ``NEMO_JETRL_VLLM_CPU_FIXES``
    has our plugin fix what vLLM's CPU build needs in its processes (`vllm_patch.cpu_fixes`).
    """
    from nemo_jetrl.vllm_patch import cpu_fixes
    from nemo_jetrl.vllm_patch.compat import cpu_omp_threads_bind

    wanted = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpu_omp_threads_bind(),
              cpu_fixes.ENV: "1"}  # fmt: skip
    return {k: v for k, v in wanted.items() if k not in os.environ}


@dataclass(frozen=True)
class EngineRefit:
    """What one step's refit into the engine did."""

    fp8_layers: int
    parity_compared: int
    """Tensors read back from the engine and found identical to what the trainer sent (FP8
    weights and scales byte for byte; other tensors from their parameter and, for linears,
    through their GEMM)."""
    seconds: float
    kv_layers: int = 0
    """Attention layers whose calibrated KV scales were set (and read back) with this refit."""


# {decoder layer index: {"q", "k", "v": scale}} in vLLM's convention (dequantization multiplier).
KvScaleMap = dict[int, dict[str, float]]


class VllmRollout:
    """The rollout side of a local run on `VllmRolloutEngine` (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        recipe: Recipe,
        model_dir: Path,
        *,
        max_model_len: int,
        max_num_seqs: int,
        seed: int,
        moe_layers: Sequence[int] = (),
        top_k: int = 0,
    ) -> None:
        """``moe_layers`` / ``top_k``: an MoE policy's MoE decoder layers and experts per token;
        the engine's routing is then recorded in every generation (`last_routing`)."""
        require_vllm()
        from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine

        self._env_set = cpu_engine_env()
        os.environ.update(self._env_set)  # read by vLLM's engine processes; removed on close
        self.model_dir = write_model_dir(model, tokenizer, model_dir)
        self.max_model_len = max_model_len
        kwargs = dict(
            dtype="bfloat16",
            load_format="dummy",  # weights come by refit only
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=True,  # no torch.compile warm-up: minutes on 2 cores
            seed=seed,
            logprobs_mode="processed_logprobs",  # log softmax(logits / T), as the trainer
        )
        self.moe_layers, self.top_k = list(moe_layers), top_k
        self.last_routing: tuple[list[torch.Tensor], torch.Tensor] | None = None
        self.routing_unavailable: str | None = None
        if self.moe_layers:
            # every position of every request computed by this rollout (a cached prefix would
            # carry another request's routing); the prompts here are a few tokens
            kwargs["enable_prefix_caching"] = False
        self.refits = 0
        self.engine: VllmRolloutEngine | None = None
        try:
            self.engine = VllmRolloutEngine(
                self.model_dir,
                recipe,
                engine_kwargs=kwargs,
                num_layers=model.config.num_hidden_layers,
                initial_refit=False,
            )
            if self.moe_layers:
                self._start_routing_capture()
        except BaseException:
            self.close()
            raise

    def _start_routing_capture(self) -> None:
        """Hook the engine's routers (`routing_capture`), or say why its routing is unknown."""
        from nemo_jetrl.vllm_patch import routing_capture

        self.routing_unavailable = routing_capture.capture_problem()
        if self.routing_unavailable is not None:
            return
        hooked = routing_capture.start(self._live().llm)
        if hooked != self.moe_layers:
            routing_capture.stop(self._live().llm)
            self.routing_unavailable = (
                f"the engine's hookable routers are in decoder layers {hooked}, the policy's MoE "
                f"layers are {self.moe_layers}; an experts kernel that routes inside itself, "
                "e.g. vLLM 0.20's CPU BF16 experts, calls no router hook"
            )

    @property
    def closed(self) -> bool:
        return self.engine is None

    def _live(self):
        if self.engine is None:
            raise RuntimeError("the vLLM rollout engine was closed")
        return self.engine

    def refit(
        self, weights: dict[str, torch.Tensor], kv_scales: KvScaleMap | None = None
    ) -> EngineRefit:
        """Load the trainer's (already guarded) weights and, for an FP8 KV cache, its calibrated
        q/k/v scales; vLLM's guards, then the parity check (weights and KV scales read back).

        Raises ``RefitError`` or ``ParityError`` (bits differ); either way the engine holds the
        weights it had before (refused before sending, or rolled back).
        """
        from nemo_jetrl.backends.local.vllm_moe import engine_weights

        rep = self._live().refit(engine_weights(weights), kv_scales=kv_scales, parity=True)
        self.refits += 1
        return EngineRefit(
            fp8_layers=rep.fp8_layers,
            parity_compared=rep.parity.compared if rep.parity is not None else 0,
            seconds=rep.seconds,
            kv_layers=len(rep.kv_layers),
        )

    def set_kv_scales(self, kv_scales: KvScaleMap) -> int:
        """Send calibrated q/k/v scales without a weight refit (read back); layers set."""
        from nemo_jetrl.vllm_patch.refit import set_kv_scales

        return len(set_kv_scales(self._live().llm, kv_scales))

    def generate(
        self,
        prompt_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float,
        eos_id: int,
        pad_id: int,
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> RolloutBatch:
        """Sample (or decode greedily) up to ``max_new_tokens`` per row; same batch as HF rollout."""
        bsz, prompt_len = prompt_ids.shape
        if prompt_len + max_new_tokens > self.max_model_len:  # vLLM would cut it short, silently
            raise ValueError(
                f"a prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} is past the "
                f"engine's max_model_len {self.max_model_len} (sized from the run's longest "
                "prompt, `seq_len.SequenceLengths`): vLLM would refuse the prompt or cut its "
                "responses short"
            )
        seeds = torch.randint(0, 2**31 - 1, (bsz,), generator=generator).tolist()
        gens = self._live().generate(
            prompt_ids.tolist(),
            max_tokens=max_new_tokens,
            temperature=0.0 if greedy else temperature,
            seed=seeds,
            stop_token_ids=[eos_id],
        )
        width = max(1, max(len(g.token_ids) for g in gens))
        ids = torch.full((bsz, width), pad_id, dtype=torch.long)
        lps = torch.zeros(bsz, width, dtype=torch.float32)
        mask = torch.zeros(bsz, width, dtype=torch.bool)
        done = torch.zeros(bsz, dtype=torch.bool)
        for i, g in enumerate(gens):
            n = len(g.token_ids)
            if n:
                ids[i, :n] = torch.tensor(g.token_ids, dtype=torch.long)
                lps[i, :n] = torch.tensor(g.logprobs, dtype=torch.float32)
                mask[i, :n] = True
                done[i] = g.token_ids[-1] == eos_id
        if self.moe_layers and self.routing_unavailable is None:
            self.last_routing = self._take_routing(gens, prompt_ids.shape[1], width)
        return RolloutBatch(ids, lps, mask, done)

    def _take_routing(self, gens: list, prompt_len: int, width: int):
        """The experts the engine routed this generation to (`vllm_moe.routing_tensors`)."""
        from nemo_jetrl.backends.local.vllm_moe import routing_tensors
        from nemo_jetrl.vllm_patch import routing_capture

        return routing_tensors(
            routing_capture.take(self._live().llm),
            [g.request_id for g in gens],
            [len(g.token_ids) for g in gens],
            prompt_len=prompt_len,
            width=width,
            layers=len(self.moe_layers),
            top_k=self.top_k,
        )

    def close(self) -> None:
        """Shut the engine down and revert the patch (idempotent)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        for k, v in self._env_set.items():
            if os.environ.get(k) == v:
                del os.environ[k]
        self._env_set = {}
