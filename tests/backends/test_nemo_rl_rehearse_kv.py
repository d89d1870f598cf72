"""``jetrl rehearse`` of the jetrl_kv recipe (FP8 KV cache, trainer-calibrated q/k/v scales,
on-policy KV in the trainer) on NeMo-RL's own FP8 KV cache config
(``grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml``) after ``jetrl align --recipe jetrl_kv``, as
its user does, in the NeMo-RL tier: where this Python's vLLM CPU build can run an
FP8 KV cache (vLLM >= 0.25 on an x86 CPU with AVX-512 or AMX) the rehearsal runs NeMo-RL's
``grpo_train`` with our calibration and the scales in every refit; elsewhere (NeMo-RL v0.7.0's
vLLM 0.20 always) it is refused before Ray, naming why, and on main the jetrl recipe is rehearsed
instead (each tree keeps one full rehearsal of our path: this one on main). The test asks the same predicate the
rehearsal asks (``compat.cpu_fp8_kv_cache``) and never assumes this machine's CPU.

Also, without Ray: the CPU policy's refit info and KV tensors against NeMo-RL's own names, and
its calibration through NeMo-RL's ``BatchedDataDict``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from rehearsals import QWEN, TREE, assert_ready, rehearse

pytestmark = [pytest.mark.nemo_rl, pytest.mark.vllm]

SHIPPED_KV = "examples/configs/recipes/llm/grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml"


def test_nemo_rls_fp8_kv_config_aligned_to_jetrl_kv_rehearses_where_vllm_runs_fp8_kv_else_refused(
    tmp_path,
):
    from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny
    from nemo_jetrl.cli import main
    from nemo_jetrl.vllm_patch.compat import cpu_fp8_kv_cache

    shipped = Path(os.environ["JETRL_NEMO_RL_TREE_DIR"]) / SHIPPED_KV  # in both trees
    aligned = tmp_path / "qwen3_8b_fp8_kv_jetrl_kv.yaml"
    assert main(["align", str(shipped), "--recipe", "jetrl_kv", "-o", str(aligned)]) == 0
    runs, why = cpu_fp8_kv_cache(head_size=tiny.BLOCK)  # the stand-in's head size
    work = tmp_path / "w"
    proc = rehearse(aligned, workdir=work)
    out, err = proc.stdout, proc.stderr
    if not runs:  # NeMo-RL v0.7.0 (vLLM 0.20), or a CPU without AVX-512/AMX on vLLM >= 0.25
        assert proc.returncode == 2, out[-3000:] + err[-3000:]
        assert why in err, err
        assert "policy.generation.vllm_cfg.kv_cache_dtype='fp8'" in err
        assert "here, rehearse the jetrl recipe" in err  # what to do
        assert "Started a local Ray instance" not in out + err and not work.exists()
        if TREE != "v0.7.0":  # main's one full rehearsal is then the jetrl recipe's
            # (v0.7.0 rehearses NeMo-RL's shipped FP8 config as jetrl: test_nemo_rl_rehearse.py)
            assert_ready(rehearse(QWEN / "jetrl.yaml", workdir=tmp_path / "j"), tmp_path / "j")
        return
    # every check of a jetrl rehearsal, the KV scales on top (this config sets
    # data.default.prompt_file: null: no prompt to resolve)
    assert_ready(proc, work, prompt_file=False)
    for step in (1, 2):
        held = re.search(rf"step {step}: refit parity held, (\d+) tensors \((\d+) FP8\)", out)
        assert held, out[-5000:]
        # the count includes the 3 KV scales of each layer (checked by value in the engine)
        assert int(held[1]) - int(held[2]) >= 3 * tiny.LAYERS
        kv_line = (f"step {step}: KV scales: {tiny.LAYERS} layers calibrated (q,k,v), "
                   "identical in the engine")  # fmt: skip
        assert kv_line in out, out[-5000:]
    # ready for the CPU path, and it says a GPU launch refuses the FP8 KV cache (jetrl there)
    assert "a GPU launch refuses it before Ray (docs/kvcache.md): submit recipe jetrl" in out
    # token_mult_prob_error close to 1 (assert_ready): the CPU policy is float32 with its KV
    # fake-quantized as vLLM's CPU cache writer stores it (truncating, kvcache/quant.py), the
    # engine block-FP8 with vLLM's own attention


# -- the CPU policy's KV duties, without Ray -------------------------------------------------


@pytest.fixture(scope="module")
def stand_in_dir(tmp_path_factory):
    from nemo_jetrl.arch.builtins import resolve_arch
    from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny

    return tiny.write_model(resolve_arch("Qwen/Qwen3-8B-Base"), tmp_path_factory.mktemp("m"))


def _policy(model_dir: Path, kv_cache_dtype: str):
    from nemo_jetrl.backends.nemo_rl.rehearsal.policy import make_cpu_policy_class
    from nemo_jetrl.recipe import Recipe

    recipe = Recipe.preset("jetrl_kv" if kv_cache_dtype == "fp8" else "jetrl")
    config = {
        "model_name": str(model_dir),
        "logprob_batch_size": 2,
        "generation": {
            "backend": "vllm",
            "temperature": 1.0,
            "vllm_cfg": {"precision": "fp8", "kv_cache_dtype": kv_cache_dtype},
        },
    }
    return make_cpu_policy_class()(cluster=None, config=config, tokenizer=None, recipe=recipe,
                                   init_reference_model=False)  # fmt: skip


def test_refit_info_and_kv_tensors_follow_nemo_rls_megatron_worker(stand_in_dir):
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.generation.vllm.quantization.fp8_train_utils import (
        get_vllm_qkv_scale_names,
    )

    from nemo_jetrl.backends.nemo_rl.rehearsal import kv
    from nemo_jetrl.backends.nemo_rl.rehearsal import model as tiny
    from nemo_jetrl.kvcache import names

    ours = kv.scale_names(tiny.LAYERS, lambda i: {t: names.vllm_scale_name(i, t) for t in "qkv"})
    want = [n for i in range(tiny.LAYERS) for n in get_vllm_qkv_scale_names(i).values()]
    assert ours == want  # the default-suite unit test's spelling is NeMo-RL's
    policy = _policy(stand_in_dir, "fp8")
    info = policy.prepare_refit_info()
    assert list(info)[-len(want) :] == want  # after the weights, as NeMo-RL
    assert all(info[n] == (torch.Size([1]), torch.float32) for n in want)
    assert info["model.embed_tokens.weight"][1] == torch.bfloat16
    assert all(float(t) == 1.0 for _, t in policy._kv_tensors(None))  # nothing calibrated yet
    ids = torch.randint(0, 100, (4, 16))
    data = BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([16, 9, 12, 5])})
    res = policy.calibrate_qkv_fp8_scales(data, include_q=True)
    assert sorted(res["layers"]) == sorted(want)
    for source in (None, res["layers"]):  # v0.7.0 passes none; main passes grpo's cache
        sent = dict(policy._kv_tensors(source))
        assert all(sent[n].dtype == torch.float32 for n in want)
        assert {n: float(sent[n]) for n in want} == res["layers"]
    with pytest.raises(ValueError, match="differ from the trainer's calibration"):
        policy._kv_tensors({n: 2.0 * v for n, v in res["layers"].items()})
    # no FP8 KV cache in vLLM: no scales in the refit (NeMo-RL's test is kv_cache_dtype)
    plain = _policy(stand_in_dir, "auto")
    assert not any(n in plain.prepare_refit_info() for n in want) and plain.kv is None
