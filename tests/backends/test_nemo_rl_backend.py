"""The NeMo-RL backend on CPU: validation, off-policy refusal, translation, launch refusals. The
end-to-end run is the `nemo_rl` + `gpu` test (Docker image). What the policy workers' env
carries: test_nemo_rl_policy_env.py; the metrics wrapper: test_nemo_rl_metrics_wrapper.py."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
from pathlib import Path

import pytest

from nemo_jetrl.backends.nemo_rl import launch as nr
from nemo_jetrl.backends.nemo_rl import policy_env as pe
from nemo_jetrl.backends.nemo_rl import translate as nt
from nemo_jetrl.backends.nemo_rl.engine_check import ENTRY_POINTS
from nemo_jetrl.errors import UserError
from nemo_jetrl.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
QWEN = CONFIGS / "qwen3_8b_base"


def test_translate_jetrl_kv_config():
    p = nr.prepare(str(QWEN / "jetrl_kv.yaml"))
    plan = p.plan
    mc = plan.master_config
    assert mc["jetrl"] == {"recipe": "jetrl_kv"}  # only the run's identity reaches NeMo-RL
    assert mc["policy"]["megatron_cfg"]["fp8_cfg"] == {
        "enabled": True,
        "fp8": "e4m3",
        "fp8_recipe": "blockwise",
        "fp8_param": False,
    }
    env = mc["policy"]["megatron_cfg"]["env_vars"]
    assert env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "0"
    assert pe.recipe_from_json(env[nt.RECIPE_ENV]) == plan.recipe
    assert plan.recipe.onpolicy_kv and plan.recipe.kv_fp8
    vc = mc["policy"]["generation"]["vllm_cfg"]
    assert (vc["precision"], vc["kv_cache_dtype"]) == ("fp8", "fp8")
    # Our patch quantizes activations with the weights' rule; NeMo-RL's own activation patch
    # (v0.7.0: crashes vLLM start-up) stays off.
    assert vc["pow2_weight_scaling_factors"] and not vc["pow2_activation_scaling_factors"]
    from nemo_jetrl.vllm_patch.settings import PatchSettings

    ps = PatchSettings.from_json(vc["env_vars"][nt.VLLM_PATCH_ENV])
    assert ps.pow2_weight_scales and ps.pow2_activation_scales and ps.fp8_weights
    assert ps.kv_cache_dtype == "fp8"
    assert plan.workers.policy_worker_fqn == nt.POLICY_WORKER_FQN
    assert dict(plan.workers.policy_env) == {k: env[k] for k in plan.workers.policy_env}
    # the settings reach vLLM's compile-cache key (vllm_patch.engine_args.settings_cache_key)
    extra = mc["policy"]["generation"]["vllm_kwargs"]["additional_config"]
    assert extra == {"nemo_jetrl_kernel_settings": vc["env_vars"][nt.VLLM_PATCH_ENV]}


def test_translate_bf16_config_turns_fp8_off_and_sets_no_patch():
    plan = nr.prepare(str(QWEN / "bf16.yaml")).plan
    mc = plan.master_config
    assert mc["policy"]["megatron_cfg"]["fp8_cfg"]["enabled"] is False
    assert nt.VLLM_PATCH_ENV not in mc["policy"]["generation"]["vllm_cfg"].get("env_vars", {})
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES" not in plan.workers.policy_env


def test_translation_problems_are_collected_with_keys():
    recipe = Recipe.preset("jetrl_kv")
    recipe = recipe.with_(
        train=recipe.train.with_(bf16_first_layers=1),
        kv_calibration=dataclass_replace(recipe.kv_calibration, mask="response"),
    )
    gen = {"backend": "sglang", "vllm_kwargs": {"additional_config": "x"}}
    cfg = {"policy": {"megatron_cfg": {"enabled": False}, "generation": gen}}
    with pytest.raises(nt.TranslationError) as ei:
        nt.translate(cfg, recipe, num_layers=36)
    keys = [k for k, _ in ei.value.problems]
    assert keys == [
        "policy.megatron_cfg.enabled",
        "policy.generation.backend",
        "jetrl.train_num_first_layers_in_bf16",
        "jetrl.kv_calibration.mask",
        "policy.generation.vllm_kwargs.additional_config",  # must be a dict: ours is added
    ]
    assert cfg == {"policy": {"megatron_cfg": {"enabled": False}, "generation": gen}}


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_off_policy_refused_unless_allowed():
    with pytest.raises(UserError) as ei:
        nr.prepare(str(QWEN / "fp8_rollout.yaml"))
    msg = str(ei.value)
    assert "OFF-POLICY" in msg and "jetrl.allow_off_policy" in msg
    assert "policy.generation.vllm_cfg" in msg or "policy.megatron_cfg" in msg
    p = nr.prepare(str(QWEN / "fp8_rollout.yaml"), ["jetrl.allow_off_policy=true"])
    assert any("off-policy" in w for w in p.warnings)
    assert p.plan.master_config["policy"]["megatron_cfg"]["fp8_cfg"]["enabled"] is False


def test_fp32_weight_scales_warn_about_nemo_rl_refit_quantizer():
    # With our vLLM patch the refit hook quantizes weights (and checks parity): no warning.
    p = nr.prepare(str(CONFIGS / "nemo_rl_fp8_e2e.yaml"), ["jetrl.vllm_patch=true"])
    assert not any("pow2_weight_scaling_factors" in w for w in p.warnings)
    env = p.plan.master_config["policy"]["generation"]["vllm_cfg"]["env_vars"]
    on = {"parity": True, "rollback": True, "host_snapshot": True}  # colocated: copy on the host
    assert json.loads(env["NEMO_JETRL_NRL_REFIT"]) == on
    off = nr.prepare(
        str(CONFIGS / "nemo_rl_fp8_e2e.yaml"),
        ["jetrl.vllm_patch=true", "jetrl.refit_parity_check=false", "jetrl.refit_rollback=false"],
    )
    env = off.plan.master_config["policy"]["generation"]["vllm_cfg"]["env_vars"]
    flags = json.loads(env["NEMO_JETRL_NRL_REFIT"])
    assert flags == {"parity": False, "rollback": False, "host_snapshot": True}
    apart = nr.prepare(
        str(CONFIGS / "nemo_rl_fp8_e2e.yaml"),
        ["jetrl.vllm_patch=true", "policy.generation.colocated.enabled=false"],
    )
    env = apart.plan.master_config["policy"]["generation"]["vllm_cfg"]["env_vars"]
    assert json.loads(env["NEMO_JETRL_NRL_REFIT"]) == {**on, "host_snapshot": False}
    # Without it NeMo-RL's own quantizer runs: FP32 scales differ from TE's.
    p = nr.prepare(
        str(CONFIGS / "nemo_rl_fp8_e2e.yaml"),
        ["jetrl.vllm_patch=false", "jetrl.allow_off_policy=true"],
    )
    assert "NEMO_JETRL_NRL_REFIT" not in p.plan.master_config["policy"]["generation"][
        "vllm_cfg"
    ].get("env_vars", {})
    assert any("pow2_weight_scaling_factors=true" in w for w in p.warnings)
    assert not any(
        "pow2_weight_scaling_factors" in w for w in nr.prepare(str(QWEN / "jetrl.yaml")).warnings
    )


def test_invalid_config_is_a_user_error():
    with pytest.raises(UserError, match="invalid config"):
        nr.prepare(str(QWEN / "jetrl.yaml"), ["policy.generation.vllm_cfg.precision=fp9"])


def test_without_nemo_rl_exits_with_instructions(monkeypatch):
    # Block the imports (works the same with or without NeMo-RL installed).
    for mod in ("nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.grpo"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(UserError) as ei:
        nr.run_nemo_rl(str(QWEN / "jetrl.yaml"), [])
    msg = str(ei.value)
    assert "nemo_rl" in msg and "docker build -f docker/Dockerfile" in msg
    assert nt.NEMO_RL_IMAGE in msg


def test_missing_dependencies_names_each_module():
    present = {"ray"}
    missing = nr.missing_dependencies(lambda m: object() if m in present else None)
    assert [m.split(" ")[0] for m in missing] == ["nemo_rl", "nemo_rl.algorithms.grpo"]
    assert nr.missing_dependencies(lambda m: object()) == []


def test_policy_worker_registration_is_reverted():
    reg = {nt.STOCK_POLICY_WORKER: "uv run --locked --extra mcore --directory /opt/nemo-rl"}
    with nr.registered_policy_worker(reg) as exe:
        assert reg[nt.POLICY_WORKER_FQN] == exe == reg[nt.STOCK_POLICY_WORKER]
    assert nt.POLICY_WORKER_FQN not in reg
    with pytest.raises(RuntimeError, match="MegatronPolicyWorker"), nr.registered_policy_worker({}):
        pass


def test_vllm_preflight_refuses_unsupported_version():
    def fake_run(version):
        out = json.dumps({"vllm": version, "plugins": dict(ENTRY_POINTS)})
        return lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=out + "\n", stderr="")

    with pytest.raises(UserError, match=r"vLLM 0\.30\.0 is installed"):
        nr.preflight_vllm_patch("/opt/ray_venvs/x/bin/python", run=fake_run("0.30.0"))
    nr.preflight_vllm_patch("/x/python", run=fake_run("0.32.1"))
    nr.preflight_vllm_patch("/x/python", run=fake_run("0.20.0"))  # NeMo-RL v0.7.0's vLLM
    nr.preflight_vllm_patch("/x/python", run=fake_run("0.25.1"))  # NeMo-RL main's vLLM


def test_merge_onto_nemo_rl_defaults(tmp_path):
    (tmp_path / "grpo_math_1B.yaml").write_text(
        "policy:\n  model_name: x\n  tokenizer:\n    name: ${policy.model_name}\n"
        "cluster:\n  gpus_per_node: 8\ndata:\n  dataset_name: math\n"
    )
    base = tmp_path / "grpo_math_1B_megatron.yaml"
    base.write_text("defaults: grpo_math_1B.yaml\ncluster:\n  num_nodes: 1\n")
    out = nr.merge_nemo_rl_defaults({"policy": {"model_name": "Qwen/Qwen3-8B-Base"}}, base)
    assert out["policy"]["tokenizer"]["name"] == "Qwen/Qwen3-8B-Base"
    assert out["cluster"] == {"gpus_per_node": 8, "num_nodes": 1}
    assert out["data"] == {"dataset_name": "math"}
    with pytest.raises(UserError, match="NEMO_RL_DIR"):
        nr.merge_nemo_rl_defaults({}, tmp_path / "nope.yaml")


def test_slurm_launch_builds_ray_sub_submission():
    import subprocess

    env = {
        "PATH": "/usr/bin:/bin",
        "DRY_RUN": "1",
        "CONTAINER": "/images/nemo-jetrl.sqsh",
        "ACCOUNT": "acct",
        "PARTITION": "batch",
        "NODES": "2",  # python3 here cannot read the config: both are required (issue 46)
        "GPUS_PER_NODE": "8",
        "HF_HOME": "/hf",
    }
    cfg = "examples/configs/qwen3_8b_base/jetrl.yaml"
    proc = subprocess.run(
        ["bash", "slurm/launch.sh", cfg, "grpo.max_num_steps=3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for part in (
        "--nodes=2",
        "--account=acct",
        "--partition=batch",
        "--job-name=jetrl-qwen3_8b_base-jetrl",
        "./ray.sub",
    ):
        assert part in out, part
    assert "jetrl\\ train" in out or "jetrl train" in out
    assert "--backend\\ nemo-rl" in out or "--backend nemo-rl" in out
    assert "grpo.max_num_steps=3" in out and "HF_HOME=/hf" in out
    bad = subprocess.run(
        ["bash", "slurm/launch.sh", "nope.yaml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "config not found" in bad.stderr


def test_example_launcher_refuses_off_policy(capsys):
    import importlib.util as iu

    spec = iu.spec_from_file_location("run_grpo_jetrl", REPO / "examples" / "run_grpo_jetrl.py")
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--config", str(QWEN / "fp8_rollout.yaml")])
    assert rc == 2
    assert "OFF-POLICY" in capsys.readouterr().err


E2E_OVERRIDES = (
    "policy.model_name=Qwen/Qwen3-0.6B",
    "grpo.max_num_steps=2",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=16",
    "policy.max_total_sequence_length=1024",
    "cluster.gpus_per_node=1",
    # One GPU: the preset's TP*CP (2*2) must fit it.
    "policy.megatron_cfg.tensor_model_parallel_size=1",
    "policy.megatron_cfg.context_parallel_size=1",
)


@pytest.mark.nemo_rl
@pytest.mark.gpu
def test_end_to_end_two_grpo_steps_in_docker(tmp_path):
    """Two GRPO steps of Qwen3-0.6B with the jetrl recipe on one GPU through NeMo-RL.

    Runs in the Docker image (scripts/run_gpu_tests.sh). Asserts the run finished, our mismatch
    tags reached NeMo-RL's TensorBoard logs, and the on-policy recipe keeps the train/rollout
    logprob error small. jetrl_kv first: its FP8 KV cache is refused on CUDA vLLM before Ray
    starts (`kv_backends.CUDA_FP8_KV`; the image's venvs are built, so the preflight runs).
    """
    from nemo_jetrl.runs.logs import read_scalars

    log_dir = tmp_path / "logs"
    with pytest.raises(UserError, match=r"kv_cache_dtype=fp8 .* on cuda "):
        nr.run_nemo_rl(str(QWEN / "jetrl_kv.yaml"), [*E2E_OVERRIDES, f"logger.log_dir={log_dir}"])
    assert not log_dir.exists()
    rc = nr.run_nemo_rl(
        str(QWEN / "jetrl.yaml"),
        [
            *E2E_OVERRIDES,
            f"logger.log_dir={log_dir}",
            "logger.tensorboard_enabled=true",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            "checkpointing.enabled=false",
        ],
    )
    assert rc == 0
    scalars, _ = read_scalars(log_dir)
    assert "jetrl/mismatch/k1_kl" in scalars
    err = list(scalars["train/token_mult_prob_error"].values)
    assert len(err) == 2 and all(math.isfinite(e) for e in err) and max(err) < 1.05


@pytest.mark.parametrize(
    "key", ["linear_backend", "kernel_config.linear_backend"], ids=["top", "kernel_config"]
)
def test_a_non_auto_linear_backend_is_refused_before_start(key):
    """vLLM would drop our block-FP8 kernel for that backend's (guard.engine_arg_problems, the
    local engine's rule): refused in translate, naming the key, before any worker starts."""
    with pytest.raises(
        UserError, match=rf"policy\.generation\.vllm_kwargs\.{key}: you set 'cutlass'"
    ):
        nr.prepare(str(QWEN / "jetrl.yaml"), [f"+policy.generation.vllm_kwargs.{key}=cutlass"])
    nr.prepare(str(QWEN / "jetrl.yaml"), [f"+policy.generation.vllm_kwargs.{key}=auto"])
    nr.prepare(str(QWEN / "bf16.yaml"), [f"+policy.generation.vllm_kwargs.{key}=cutlass"])


def _translation_problems(generation: dict, flags: dict) -> dict[str, str]:
    """translate's problems, by key, for the jetrl preset with these generation keys and
    ``jetrl:`` flags (empty: it translates)."""
    gen = {"backend": "vllm", **generation}
    cfg = {"policy": {"megatron_cfg": {"enabled": True}, "generation": gen}, "jetrl": flags}
    try:
        nt.translate(cfg, Recipe.preset("jetrl"), num_layers=36)
    except nt.TranslationError as exc:
        return dict(exc.problems)
    return {}


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({}, "jetrl.refit_parity_check and jetrl.refit_rollback"),
        ({"refit_parity_check": False}, "set jetrl.refit_rollback to false"),
        ({"refit_parity_check": False, "refit_rollback": False}, None),
        ({"refit_hook": False}, None),
    ],
)
def test_vllm_pipeline_stages_are_refused_while_the_refit_is_checked(flags, named):
    """The refit's parity check and its rollback vote cover one pipeline stage
    (``vllm_patch.rank_vote``): vLLM pipeline_parallel_size > 1 is refused before launch,
    naming the key and the jetrl flags that would allow it."""
    key = "policy.generation.vllm_cfg.pipeline_parallel_size"
    for pp, refused in ((2, named is not None), (1, False)):
        problems = _translation_problems({"vllm_cfg": {"pipeline_parallel_size": pp}}, flags)
        assert (key in problems) is refused, (pp, problems)
        if refused:
            assert problems[key].startswith(f"{pp}: ") and named in problems[key], problems


@pytest.mark.parametrize("transport", ["nccl_reshard", "nixl", "vllm_zmq_sparse", "vllm_s3_sparse"])
def test_a_refit_transport_that_bypasses_the_hook_is_refused_before_launch(transport):
    """NeMo-RL main's other transports (``policy.generation.refit_transport``, its
    ``VllmRefitSelector``) load without fp8.load_weights; the hook refuses them in the vLLM
    worker, where NCCL reshard's trainer is already sending and would wait for ever
    (megatron_policy_worker.py synchronises after the sends). So: before launch, by key."""
    key = "policy.generation.refit_transport"
    for flags, refused in (({}, True), ({"refit_hook": False}, False)):
        problems = _translation_problems({"refit_transport": transport}, flags)
        assert (key in problems) is refused, (flags, problems)
        if refused:
            assert (
                problems[key].startswith(f"{transport!r}: ") and "set it to null" in problems[key]
            )
    assert _translation_problems({"refit_transport": None}, {}) == {}  # NeMo-RL's default


def test_kv_settings_nemo_rls_step_cannot_honour_are_refused_by_key():
    """Helper review (2026-12-01): NeMo-RL hands the calibration every sequence, so a
    data_fraction below 1 was silently ignored; training CUDA graphs replay the on-policy KV
    hook's scales of their capture."""
    base = {"policy": {"megatron_cfg": {"enabled": True}, "generation": {"backend": "vllm"}}}
    kv = Recipe.preset("jetrl_kv")
    assert kv.onpolicy_kv
    half = dataclasses.replace(
        kv, kv_calibration=dataclasses.replace(kv.kv_calibration, data_fraction=0.5)
    )
    graphed = {**base, "policy": {**base["policy"], "megatron_cfg": {"enabled": True}}}
    graphed["policy"]["megatron_cfg"]["cuda_graph_impl"] = "local"
    cases = [
        (half, base, "jetrl.kv_calibration.data_fraction"),
        (kv, graphed, "policy.megatron_cfg.cuda_graph_impl"),
    ]
    for recipe, cfg, key in cases:
        with pytest.raises(nt.TranslationError) as info:
            nt.translate(cfg, recipe, num_layers=36)
        assert list(dict(info.value.problems)) == [key]
    nt.translate(base, kv, num_layers=36)  # the control: the defaults pass
    # NeMo-RL main's scoped capture: attention left eager keeps the hook running
    graphed["policy"]["megatron_cfg"]["cuda_graph_modules"] = ["mlp", "moe_router"]
    nt.translate(graphed, kv, num_layers=36)
    graphed["policy"]["megatron_cfg"]["cuda_graph_modules"] = ["attn"]
    with pytest.raises(nt.TranslationError):
        nt.translate(graphed, kv, num_layers=36)
    graphed["policy"]["megatron_cfg"]["cuda_graph_modules"] = []
    no_kv = dataclasses.replace(kv, onpolicy_kv=False)
    nt.translate(graphed, no_kv, num_layers=36)  # graphs without on-policy KV: nothing frozen
