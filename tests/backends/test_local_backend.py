"""Local backend: short real runs of every recipe, refit bits, resume, refused refits, config.

Everything here runs the real pieces (HF Llama built from the repo config, nemo_jetrl.fp8 FP8
linears, the FP8 KV cache, TensorBoard event files) at tiny sizes: 1-operation problems, 2x2
samples per step, a 3-step warm start cached once per session.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from local_configs import EXAMPLES, tiny_cfg

from nemo_jetrl.backends.local import checkpoint as ckpt
from nemo_jetrl.backends.local.config import LocalSettings, validate_local_config
from nemo_jetrl.backends.local.loop import Hooks, LocalRun, resolve_run, run_local
from nemo_jetrl.backends.local.refit import RefitRefused, export_weights, refit
from nemo_jetrl.backends.local.task import TaskConfig, make_problem, score
from nemo_jetrl.config import ConfigError
from nemo_jetrl.fp8 import Fp8BlockLinear, Fp8InferenceLinear, fp8_bits, quantize_blockwise

RECIPES = ("bf16", "fp8_rollout", "jetrl", "jetrl_kv")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jetrl_cache")


def _no_timing(h: dict) -> dict:
    return {k: v for k, v in h.items() if not k.startswith(("timing/", "jetrl/local/cpu_time/"))}


# ------------------------------------------------------------------------------------- task


def test_task_worked_example():
    cfg = TaskConfig(num_ops=3)
    # 3+4 = 7; 7-9 = -2 = 8 (mod 10); 8+5 = 13 = 3 (mod 10)
    p = make_problem([3, 4, 9, 5], ["+", "-", "+"], cfg)
    assert p.prompt == "3+4-9+5="
    assert p.target == "3+4=7;7-9=8;8+5=3;#3"
    assert p.answer == 3
    assert cfg.response_len() == len(p.target) + 1  # + <eos>
    assert score(p, "3+4=7;7-9=8;8+5=3;#3", True, cfg) == (1.0, True)
    assert score(p, "3+4=7;7-9=8;8+5=3;#3", False, cfg) == (0.0, False)  # truncated
    assert score(p, "3+4=7;7-9=8;8+5=4;#4", True, cfg) == (0.0, False)
    fmt = TaskConfig(num_ops=3, format_reward=0.1)
    assert score(p, "3+4=7;7-9=8;8+5=4;#4", True, fmt) == (0.1, False)


# ----------------------------------------------------------------------------------- config


def test_local_settings_collect_every_error():
    bad = {
        "dtype": "fp16",
        "task": {"num_ops": 0, "ops": "/", "colour": 1},
        "warmstart": {"steps": -1},
        "model_config": "/nonexistent/config.json",
    }
    issues = validate_local_config(bad, "jetrl.local")
    paths = {i.path for i in issues}
    assert {
        "jetrl.local.dtype",
        "jetrl.local.task.num_ops",
        "jetrl.local.task.ops",
        "jetrl.local.task.colour",
        "jetrl.local.warmstart.steps",
    } <= paths
    # a missing model config is the architecture check's to name, once, with where it was
    # looked for (tests/config/test_relative_paths.py); the door's measure names it too
    assert "jetrl.local.model_config" not in paths
    with pytest.raises(ConfigError) as exc:
        LocalSettings.from_cfg(bad)
    assert "jetrl.local.task.num_ops" in str(exc.value) and "jetrl.local.dtype" in str(exc.value)


def test_config_validator_calls_local_schema(tmp_path, cache_dir):
    from nemo_jetrl.config import validate
    from nemo_jetrl.flow.pipeline import BACKEND_SECTIONS

    cfg = tiny_cfg("jetrl", tmp_path, cache_dir, "jetrl.local.task.num_ops=0")
    errs = [i for i in validate(cfg, BACKEND_SECTIONS) if i.level == "error"]
    assert [i.path for i in errs] == ["jetrl.local.task.num_ops"]


def test_packaged_base_matches_example():
    from omegaconf import OmegaConf

    from nemo_jetrl.commands.demo import base_config_path

    a = OmegaConf.to_container(OmegaConf.load(base_config_path()))
    b = OmegaConf.to_container(OmegaConf.load(EXAMPLES / "base.yaml"))
    assert a == b


# ------------------------------------------------------------------------------ short runs


@pytest.mark.parametrize("recipe", RECIPES)
def test_short_run_logs_metrics_checkpoints(recipe, tmp_path, cache_dir):
    from nemo_jetrl.runs.logs import read_scalars, train_data_files

    res = run_local(
        resolve_run(tiny_cfg(recipe, tmp_path / "run", cache_dir)), progress=False, log=print
    )
    assert res.recipe == recipe and res.last_step == 2 and len(res.history) == 2
    for h in res.history:
        for key in (
            "train/token_mult_prob_error",
            "train/gen_kl_error",
            "train/reward",
            "train/loss",
            "validation/accuracy",
            "timing/train/generation",
            "timing/train/policy_training",
            "timing/train/prepare_for_generation",
        ):
            assert math.isfinite(h[key]), (recipe, key, h[key])
        assert h["train/token_mult_prob_error"] >= 1.0
        if recipe in ("jetrl", "jetrl_kv"):  # batch-invariant both sides: the same bits
            assert h["train/token_mult_prob_error"] == 1.0 and h["train/gen_kl_error"] == 0.0
        assert h["jetrl/local/refit_refused"] == 0.0
    scalars, warns = read_scalars(tmp_path / "run")
    assert not warns
    for tag in ("train/token_mult_prob_error", "train/reward", "validation/accuracy"):
        assert [int(s) for s in scalars[tag].steps][-2:] == [1, 2], tag
        assert all(math.isfinite(v) for v in scalars[tag].values)
    if recipe == "jetrl_kv":
        assert "timing/train/kv_calibration" in scalars
    files = train_data_files(tmp_path / "run")
    assert sorted(files) == [1, 2]
    rec = json.loads(files[2].read_text().splitlines()[0])
    assert len(rec["generation_logprobs"][0]) == len(rec["token_ids"][0])
    if recipe in ("jetrl", "jetrl_kv"):
        for line in files[2].read_text().splitlines():
            r = json.loads(line)
            for g, p, m in zip(
                r["generation_logprobs"], r["prev_logprobs"], r["token_loss_mask"], strict=True
            ):
                assert [a for a, k in zip(g, m, strict=True) if k] == [
                    b for b, k in zip(p, m, strict=True) if k
                ]
    cps = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [s for s, _ in cps] == [1, 2]
    master, state = ckpt.load_checkpoint(cps[-1][1])
    assert state["step"] == 2 and state["recipe"] == recipe
    assert all(bool(torch.isfinite(t).all()) for t in master.values())
    manifest = json.loads((cps[-1][1] / ckpt.MANIFEST_FILE).read_text())
    assert manifest["step"] == 2 and manifest["tensors"] == len(master)
    assert manifest["run_id"] == state["run_id"] and len(state["run_id"]) == 12
    for name in (ckpt.MODEL_FILE, ckpt.STATE_FILE):
        assert manifest["files"][name]["size"] == (cps[-1][1] / name).stat().st_size
    assert ckpt.verify_checkpoint(cps[-1][1]) == []
    assert not list((tmp_path / "run").rglob(".jetrl-run.lock"))  # released
    assert all(h["jetrl/local/update_refused"] == 0.0 for h in res.history)


def test_train_cli_runs_and_reports_config_errors(tmp_path, cache_dir, capsys):
    from nemo_jetrl.cli import main

    args = [
        "train",
        str(EXAMPLES / "bf16.yaml"),
        "grpo.max_num_steps=1",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=2",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "jetrl.local.task.num_ops=1",
        "jetrl.local.warmstart.steps=3",
        "jetrl.local.warmstart.batch_size=8",
        f"jetrl.local.cache_dir={cache_dir}",
        f"logger.log_dir={tmp_path / 'cli'}",
        "--backend",
        "local",
        "--no-progress",
    ]
    assert main(args) == 0
    assert "bf16: steps 0..1" in capsys.readouterr().out
    bad = [*args[:-4], "jetrl.local.task.num_ops=0", "policy.generation.temperature=-1", *args[-4:]]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert "jetrl.local.task.num_ops" in err and "policy.generation.temperature" in err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------ refit bits


def test_jetrl_rollout_weights_equal_trainer_quantization_bit_for_bit(
    tmp_path, cache_dir, monkeypatch
):
    import nemo_jetrl.fp8.linear as linear_mod
    from nemo_jetrl.fp8.weight_cache import invalidate_weight_caches

    run = LocalRun(resolve_run(tiny_cfg("jetrl", tmp_path, cache_dir)))
    rollout = {
        n: m for n, m in run.rollout_model.named_modules() if isinstance(m, Fp8InferenceLinear)
    }
    trainer = {n: m for n, m in run.trainer.model.named_modules() if isinstance(m, Fp8BlockLinear)}
    assert len(rollout) == len(trainer) == 14 and rollout.keys() == trainer.keys()

    # record what the trainer's own FP8 forward quantizes as weights
    seen: dict[str, object] = {}
    real = linear_mod.quantize_blockwise

    def spy(x, block, **kw):
        q = real(x, block, **kw)
        name = kw.get("name") or ""
        if name.endswith(".weight"):
            seen[name[: -len(".weight")]] = q
        return q

    monkeypatch.setattr(linear_mod, "quantize_blockwise", spy)
    for _ in range(2):  # before and after an update
        run.train_step(Hooks())  # refit, rollout, score (the spy sees the trainer's forward)
        refit(run.rollout_model, export_weights(run.trainer.model))  # ship the updated weights
        seen.clear()
        # the trainer caches its FP8 weights per weight version: drop them so this forward
        # quantizes again in front of the spy (a hit would give the same bits)
        invalidate_weight_caches(run.trainer.model)
        run.trainer.score(torch.randint(3, 19, (2, 12)), 6)
        assert set(seen) == set(trainer)
        for name, layer in rollout.items():
            q = seen[name]
            assert torch.equal(fp8_bits(layer.weight_fp8), fp8_bits(q.data)), name
            assert torch.equal(layer.weight_scale_inv, q.scale_inv), name
            # and the layers compute the same thing on the same input
            x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
            with torch.no_grad():
                assert torch.equal(layer(x), trainer[name](x)), name


def test_fp8_rollout_uses_vllm_native_quantizer(tmp_path, cache_dir):
    from nemo_jetrl.fp8.vllm_native import per_block_cast_native

    run = LocalRun(resolve_run(tiny_cfg("fp8_rollout", tmp_path, cache_dir)))
    assert not any(isinstance(m, Fp8BlockLinear) for m in run.trainer.model.modules())
    weights = export_weights(run.trainer.model)
    refit(run.rollout_model, weights)
    layers = [
        (n, m) for n, m in run.rollout_model.named_modules() if isinstance(m, Fp8InferenceLinear)
    ]
    assert len(layers) == 14
    for name, layer in layers:
        assert layer.quantizer == "vllm_native" and not layer.config.pow2_scales
        q = per_block_cast_native(weights[f"{name}.weight"], ue8m0=False)
        assert torch.equal(fp8_bits(layer.weight_fp8), fp8_bits(q.data))


# ---------------------------------------------------------------------------- refused refit


def _fp8_bits(model) -> dict[str, torch.Tensor]:
    return {
        n: fp8_bits(m.weight_fp8).clone()
        for n, m in model.named_modules()
        if isinstance(m, Fp8InferenceLinear)
    }


def test_refit_with_nan_is_refused_and_run_continues_on_last_good_weights(tmp_path, cache_dir):
    messages: list[str] = []
    run = LocalRun(resolve_run(tiny_cfg("jetrl", tmp_path, cache_dir)), log=messages.append)
    bad_layer = "model.layers.1.mlp.down_proj"

    def inject(step, weights):
        if step == 2:
            w = weights[f"{bad_layer}.weight"].clone()
            w[5, 7] = float("nan")
            weights[f"{bad_layer}.weight"] = w
        return weights

    hooks = Hooks(before_refit=inject)
    s1, _ = run.train_step(hooks)
    assert s1["jetrl/local/refit_refused"] == 0.0
    good = _fp8_bits(run.rollout_model)
    emb_before = run.rollout_model.model.embed_tokens.weight.detach().clone()
    s2, _ = run.train_step(hooks)
    assert s2["jetrl/local/refit_refused"] == 1.0
    assert any(bad_layer in m and "non-finite" in m for m in messages), messages
    # nothing was loaded, not even the healthy tensors: the rollout kept step 1's weights
    after = _fp8_bits(run.rollout_model)
    assert all(torch.equal(good[n], after[n]) for n in good)
    assert torch.equal(emb_before, run.rollout_model.model.embed_tokens.weight)
    assert all(math.isfinite(v) for k, v in s2.items() if k.startswith("train/"))
    # move the trainer's weights visibly (tiny-batch GRPO updates may be zero) ...
    master = run.trainer.master_state()
    master[f"{bad_layer}.weight"] *= 3  # not 2: pow2 scales would absorb a doubling
    run.trainer.load_master(master)
    s3, _ = run.train_step(hooks)
    assert s3["jetrl/local/refit_refused"] == 0.0
    assert s3["jetrl/local/refit_refused_total"] == 1.0
    # ... and step 3's refit delivered them: healthy weights flow again
    got = _fp8_bits(run.rollout_model)[bad_layer]
    assert not torch.equal(good[bad_layer], got)
    tripled = master[f"{bad_layer}.weight"].to(torch.bfloat16)
    assert torch.equal(got, fp8_bits(quantize_blockwise(tripled, (128, 128)).data))


def test_refit_refuses_misshaped_and_missing_tensors_naming_them(tmp_path, cache_dir):
    run = LocalRun(resolve_run(tiny_cfg("jetrl", tmp_path, cache_dir)))
    weights = export_weights(run.trainer.model)
    weights["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(128, 256)
    del weights["model.norm.weight"]
    before = _fp8_bits(run.rollout_model)
    with pytest.raises(RefitRefused) as exc:
        refit(run.rollout_model, weights)
    text = str(exc.value)
    assert "model.layers.0.self_attn.q_proj.weight: shape (128, 256)" in text
    assert "model.norm.weight: missing" in text
    assert len(exc.value.problems) == 2
    assert all(torch.equal(before[n], b) for n, b in _fp8_bits(run.rollout_model).items())


# ---------------------------------------------------------------------------------- resume


def test_resume_reproduces_uninterrupted_run_exactly(tmp_path, cache_dir):
    extra = ("grpo.max_num_steps=4", "grpo.val_period=2")
    full = run_local(
        resolve_run(tiny_cfg("jetrl_kv", tmp_path / "full", cache_dir, *extra)),
        progress=False,
        log=print,
    )
    part_cfg = tiny_cfg("jetrl_kv", tmp_path / "part", cache_dir, *extra)
    first = run_local(
        resolve_run(
            tiny_cfg(
                "jetrl_kv",
                tmp_path / "part",
                cache_dir,
                "grpo.max_num_steps=2",
                "grpo.val_period=2",
            )
        ),
        progress=False,
        log=print,
    )
    assert first.last_step == 2
    second = run_local(resolve_run(part_cfg), resume=True, progress=False, log=print)
    assert second.first_step == 2 and second.last_step == 4
    for a, b in zip(full.history[2:], second.history, strict=True):
        assert _no_timing(a) == _no_timing(b)
    for step in (3, 4):
        name = f"train_data_step{step}.jsonl"
        assert (tmp_path / "full" / name).read_text() == (tmp_path / "part" / name).read_text()
    from nemo_jetrl.runs.logs import read_scalars

    sf, _ = read_scalars(tmp_path / "full")
    sp, _ = read_scalars(tmp_path / "part")
    for tag in ("train/reward", "train/token_mult_prob_error", "validation/accuracy"):
        assert sf[tag].steps == sp[tag].steps and sf[tag].values == sp[tag].values, tag
    (_, fa), (_, pa) = (
        ckpt.list_checkpoints(tmp_path / d / "checkpoints")[-1] for d in ("full", "part")
    )
    ma, sa = ckpt.load_checkpoint(fa)
    mb, sb = ckpt.load_checkpoint(pa)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    assert sa["kv_scales"] == sb["kv_scales"] and sa["kv_scales"]
