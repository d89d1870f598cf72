"""NeMo-RL's REAL vLLM generation on this machine's CPU, as ``jetrl rehearse`` runs it: NeMo-RL's
``RayVirtualCluster`` on a local Ray with logical GPUs, its ``VllmGeneration`` building its
``RayWorkerGroup`` of ``VllmGenerationWorker`` Ray actors, each starting vLLM's CPU engine with
NeMo-RL's own arguments (colocated: sleep mode on, its ``init_fp8`` kwargs, its worker
extension). Our code reaches the engine only through the entry points, armed by the env
``translate`` writes; the driver's engine check then goes through NeMo-RL's real worker group
(keywords only) and ``generate`` through NeMo-RL's own sharding. The only substitutes are the
rehearsal's (``nemo_jetrl/backends/nemo_rl/rehearsal/cpu_worker.py``: sleep mode, NUMA binding,
GPU UUID, NeMo-RL's FP8 patches in vLLM's spawned worker, ``worker.device``), each named in the
worker's log line this test reads.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
from hf_models import char_tokenizer, tiny_llama_128

from nemo_jetrl.backends.nemo_rl import engine_check as ec

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]

NUM_LAYERS = 2


def _generation_config(model_dir, tokenizer, env):
    from nemo_rl.models.generation import configure_generation_config
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from nemo_rl_upstream import tree_dir
    from omegaconf import OmegaConf

    from nemo_jetrl.backends.nemo_rl.rehearsal.engines import cpu_generation_overrides

    register_omegaconf_resolvers()
    base = load_config(str(tree_dir() / "examples/configs/grpo_math_1B_megatron.yaml"))
    gen = OmegaConf.to_container(base, resolve=True)["policy"]["generation"]
    gen.update(model_name=str(model_dir), max_new_tokens=8)
    gen["vllm_cfg"].update(
        precision="fp8", max_model_len=128, enforce_eager=True, load_format="dummy",
        env_vars=dict(env),
    )  # fmt: skip
    gen["colocated"]["enabled"] = True
    cpu_generation_overrides(gen, str(model_dir), model_parallel=1)
    return configure_generation_config(gen, tokenizer)


def _vllm_env():
    from nemo_jetrl.backends.nemo_rl.translate import _vllm_env, _vllm_patch_json
    from nemo_jetrl.recipe import Recipe

    return _vllm_env({}, _vllm_patch_json(Recipe.preset("jetrl"), NUM_LAYERS))


def test_nemo_rls_vllm_generation_serves_our_kernel_on_cpu(tmp_path, capfd):
    from nemo_rl.distributed import ray_actor_environment_registry as reg
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.models.generation.vllm import VllmGeneration

    from nemo_jetrl.backends.nemo_rl.rehearsal.engines import local_ray, system_python_workers

    model_dir = tmp_path / "model"
    tiny_llama_128(0).save_pretrained(model_dir)
    tok = char_tokenizer()
    tok.save_pretrained(model_dir)
    env = _vllm_env()
    gen_cfg = _generation_config(model_dir, tok, env)
    with local_ray(gpus=1), system_python_workers(reg.ACTOR_ENVIRONMENT_REGISTRY, sys.executable):
        cluster = RayVirtualCluster(
            [1], use_gpus=True, num_gpus_per_node=1, max_colocated_worker_groups=2,
            name="jetrl-rehearsal-test",
        )  # fmt: skip
        generation = VllmGeneration(cluster, gen_cfg)
        try:
            res = ec.prove_generation_engines(generation, env, None)
            prompts = ["12+3=", "7*6="]
            ids = [tok(p)["input_ids"] for p in prompts]
            width = max(map(len, ids))
            pad = gen_cfg["_pad_token_id"]
            batch = BatchedDataDict(
                {
                    "input_ids": torch.tensor([i + [pad] * (width - len(i)) for i in ids]),
                    "input_lengths": torch.tensor([len(i) for i in ids]),
                }
            )
            out = generation.generate(batch, greedy=True)
        finally:
            generation.shutdown()
            cluster.shutdown()
    n = 4 * NUM_LAYERS
    assert (res["engines"], res["fp8_linears"], res["on_our_kernel"]) == (1, n, n)
    text = capfd.readouterr().out
    assert f"of 1 engine(s); kernel serves {n}/{n} FP8 linears, refit hook installed" in text
    # the substitutes, named by the plugin in each vLLM process it ran in
    assert re.search(r"nemo_jetrl rehearsal: CPU substitutes in vLLM process \d+: sleep_mode, "
                     r"device, bind_numa, report_device_id, ipc_buffer, bf16_weights, "
                     r"fp8_patches", text), text  # fmt: skip
    assert out["output_ids"].shape[0] == 2
    assert (out["generation_lengths"] > 0).all()
    assert torch.isfinite(out["logprobs"]).all()
