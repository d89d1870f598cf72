"""The NeMo-RL launch's worker venvs before Ray starts (issue 36): bare metal's venvs at NeMo-RL's
git root, the stock policy worker's venv run by path for our worker class, the overlay that puts
nemo_jetrl into venvs an earlier launch built and into those NRL_FORCE_REBUILD_VENVS rebuilds, the
preflight of vLLM's Python (its version, our entry points, the worker environment, an FP8 KV cache
on a CUDA build), and what stops after the run. Paths and the trainer kind:
test_nemo_rl_launch_prep.py, whose helpers these tests share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_nemo_rl_launch_prep import MCORE_UV, REPO, VLLM_FQN, _merged, _prep

from nemo_jetrl.backends.nemo_rl import driver, venvs
from nemo_jetrl.backends.nemo_rl.engine_check import ENTRY_POINTS
from nemo_jetrl.backends.nemo_rl.translate import POLICY_WORKER_FQN, STOCK_POLICY_WORKER
from nemo_jetrl.errors import UserError


def test_bare_metal_venvs_are_nemo_rl_git_root_venvs(tmp_path):
    assert venvs.venv_dir({}, git_root=tmp_path) == tmp_path / "venvs"
    assert venvs.venv_dir({"NEMO_RL_VENV_DIR": "/opt/ray_venvs/"}) == Path("/opt/ray_venvs")
    # Not built yet (bare metal before NeMo-RL made them): the vLLM check waits for engine start.
    merged = _merged(train={"dataset_name": "OpenMathInstruct-2"})
    environ = {"PYTHONPATH": "/site/a"}
    kind, entry, lines, calls = _prep(merged, tmp_path, environ)
    assert kind == driver.SYNC and entry == MCORE_UV and calls == []
    assert any(
        "vLLM version check (and the FP8 KV cache's platform) deferred" in line for line in lines
    )
    assert merged["logger"]["log_dir"].endswith("logs/x/exp_001")
    # NeMo-RL builds both venvs during this run, without nemo_jetrl: the overlay goes on the path.
    overlay = str(Path(merged["logger"]["log_dir"]) / venvs.OVERLAY_NAME)
    vllm_env = merged["policy"]["generation"]["vllm_cfg"]["env_vars"]
    assert vllm_env["PYTHONPATH"].split(os.pathsep)[0] == overlay
    assert any("during this run without nemo_jetrl" in line for line in lines)
    # and the driver's own, which init_ray copies into every actor's environment: v0.7.0's
    # IsolatedWorkerInitializer imports our worker class with no megatron_cfg.env_vars
    assert environ["PYTHONPATH"] == os.pathsep.join([overlay, "/site/a"])
    assert any("and on this driver's" in line for line in lines)


def _built_venvs(base: Path, with_nemo_jetrl: bool) -> None:
    for fqn in (STOCK_POLICY_WORKER, VLLM_FQN):
        (base / fqn / "bin").mkdir(parents=True)
        (base / fqn / "bin" / "python").write_text("")
        site = base / fqn / "lib" / "python3.12" / "site-packages"
        site.mkdir(parents=True)
        if with_nemo_jetrl:  # what pip install (plain or -e) leaves
            (site / "nemo_jetrl-0.1.0.dist-info").mkdir()


def test_policy_worker_runs_on_the_built_stock_venv_by_path(tmp_path):
    base = tmp_path / "venvs"
    _built_venvs(base, with_nemo_jetrl=True)
    merged = _merged(train={"dataset_name": "OpenMathInstruct-2"})
    environ = {"PYTHONPATH": "/site/a"}
    _, entry, _, calls = _prep(merged, tmp_path, environ)
    assert environ["PYTHONPATH"] == "/site/a"  # built venvs have nemo_jetrl: left alone
    assert entry == str(base / STOCK_POLICY_WORKER / "bin" / "python")
    assert calls == [str(base / VLLM_FQN / "bin" / "python")]  # the vLLM preflight ran
    assert not (base / POLICY_WORKER_FQN).exists()  # no venv named after our class
    assert "generation" not in merged.get("policy", {})  # built venvs have nemo_jetrl: no overlay


def test_venvs_an_earlier_launch_built_without_nemo_jetrl_get_the_overlay(tmp_path):
    """Bare metal, second launch: NeMo-RL built its venvs during the first (nemo_jetrl came
    only on PYTHONPATH); this one carries the overlay again and asks vLLM's Python with it."""
    base = tmp_path / "venvs"
    _built_venvs(base, with_nemo_jetrl=False)
    merged = _merged(train={"dataset_name": "OpenMathInstruct-2"})
    environ = {"PYTHONPATH": "/site/a"}
    _, entry, lines, calls = _prep(merged, tmp_path, environ)
    vllm_py = base / VLLM_FQN / "bin" / "python"
    assert calls == [(str(vllm_py), True)]  # the preflight saw nemo_jetrl on its path
    assert entry == str(base / STOCK_POLICY_WORKER / "bin" / "python")
    overlay = str(Path(merged["logger"]["log_dir"]) / venvs.OVERLAY_NAME)
    for env in (
        merged["policy"]["megatron_cfg"]["env_vars"],
        merged["policy"]["generation"]["vllm_cfg"]["env_vars"],
    ):
        assert env["PYTHONPATH"].split(os.pathsep)[0] == overlay
    assert environ["PYTHONPATH"] == os.pathsep.join([overlay, "/site/a"])
    assert any(f"{vllm_py}" in line and "were built without nemo_jetrl" in line for line in lines)


def test_the_preflight_runs_vllms_python_with_the_overlay_first(tmp_path):
    import types

    from nemo_jetrl.backends.nemo_rl import launch as nr

    seen = {}

    def run(cmd, **kw):
        seen.update(kw)
        out = json.dumps({"vllm": "0.20.0", "plugins": dict(ENTRY_POINTS)})
        return types.SimpleNamespace(returncode=0, stdout=out, stderr="")

    nr.preflight_vllm_patch("/v/bin/python", tmp_path / "ov", run=run, pinned="0.20.0")
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "ov")
    nr.preflight_vllm_patch("/v/bin/python", run=run, pinned="0.20.0")
    assert seen["env"] is None  # its own environment


def test_force_rebuild_keeps_nemo_jetrl_in_rebuilt_venvs(tmp_path):
    import shutil

    base = tmp_path / "venvs"
    (base / STOCK_POLICY_WORKER / "bin").mkdir(parents=True)
    (base / STOCK_POLICY_WORKER / "bin" / "python").write_text("")
    # An older image's link at our class's venv name: NeMo-RL's forced rebuild rmtree's it.
    (base / POLICY_WORKER_FQN).symlink_to(base / STOCK_POLICY_WORKER)
    with pytest.raises(OSError):
        shutil.rmtree(base / POLICY_WORKER_FQN)  # what venvs.create_local_venv would do
    merged = _merged(train={"dataset_name": "OpenMathInstruct-2"})
    merged["policy"] = {"megatron_cfg": {"env_vars": {"A": "1"}}}
    _, entry, lines, calls = _prep(merged, tmp_path, {venvs.FORCE_REBUILD_ENV: "true"})
    assert entry == MCORE_UV and calls == []  # NeMo-RL builds it; the version check waits
    assert not (base / POLICY_WORKER_FQN).is_symlink()
    text = "\n".join(lines)
    assert "removed" in text and "NRL_FORCE_REBUILD_VENVS=true" in text
    overlay = Path(merged["logger"]["log_dir"]) / venvs.OVERLAY_NAME
    for env in (
        merged["policy"]["megatron_cfg"]["env_vars"],
        merged["policy"]["generation"]["vllm_cfg"]["env_vars"],
    ):
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(overlay)
    assert merged["policy"]["megatron_cfg"]["env_vars"]["A"] == "1"
    # A fresh interpreter without site-packages (a rebuilt venv) imports nemo_jetrl from the
    # overlay and finds our vLLM plugin entry points there.
    probe = (
        "import importlib.metadata as m, nemo_jetrl, sys;"
        "eps = sorted(e.value for e in m.entry_points(group='vllm.general_plugins'));"
        "print(nemo_jetrl.__file__); print(eps)"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        env={"PYTHONPATH": str(overlay), "PATH": os.environ.get("PATH", "")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    first, eps = out.stdout.splitlines()
    assert first.startswith(str(overlay / "nemo_jetrl"))
    assert "nemo_jetrl.vllm_patch.plugin:load_in_worker" in eps
    # Idempotent: a second launch rewrites the same overlay.
    assert venvs.write_overlay(overlay) == overlay


def test_vllm_replaced_in_nemo_rl_worker_venv_is_refused(tmp_path):
    """`pip install nemo-jetrl[vllm]` into NeMo-RL's vLLM venv puts vLLM 0.32 (in the patch's
    range) where NeMo-RL v0.7.0 pins 0.20.0: refused, naming both."""
    import types

    from nemo_jetrl.backends.nemo_rl import launch as nr

    (tmp_path / "pyproject.toml").write_text(
        "[project.optional-dependencies]\nvllm = [\n"
        '  "vllm @ https://github.com/vllm-project/vllm/releases/download/v0.20.0/'
        "vllm-0.20.0-cp38-abi3-manylinux_2_35_x86_64.whl ; sys_platform == 'linux'\",\n"
        "  \"vllm==0.20.0 ; sys_platform != 'linux'\",\n]\n"
    )
    pinned = nr.nemo_rl_pinned_vllm(tmp_path)
    assert pinned == "0.20.0" and nr.nemo_rl_pinned_vllm(tmp_path / "none") is None

    def run(version):
        out = json.dumps({"vllm": version, "plugins": dict(ENTRY_POINTS)})
        return lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=out, stderr="")

    nr.preflight_vllm_patch("/v/bin/python", run=run("0.20.0"), pinned=pinned)
    nr.preflight_vllm_patch("/v/bin/python", run=run("0.20.0+cu130"), pinned=pinned)
    with pytest.raises(UserError, match=r"has vLLM 0\.32\.1, but this NeMo-RL pins vLLM 0\.20\.0"):
        nr.preflight_vllm_patch("/v/bin/python", run=run("0.32.1"), pinned=pinned)


def test_preflight_names_our_entry_points_missing_from_the_vllm_workers_python():
    """A vLLM worker venv without nemo_jetrl's entry points (rebuilt, or a stale install):
    named before Ray, where on fd6dbfb the engine check found it minutes in."""
    import types

    from nemo_jetrl.backends.nemo_rl import launch as nr

    plugins = {k: v for k, v in ENTRY_POINTS.items() if k != "nemo_jetrl"}
    out = json.dumps({"vllm": "0.20.0", "plugins": plugins})
    run = lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=out, stderr="")  # noqa: E731
    with pytest.raises(UserError) as ei:
        nr.preflight_vllm_patch("/v/bin/python", run=run, pinned="0.20.0")
    msg = str(ei.value)
    assert (
        "entry point 'nemo_jetrl' is not installed in this worker's Python (/v/bin/python)" in msg
    )
    assert "NRL_FORCE_REBUILD_VENVS" in msg and "worker 0" not in msg


def test_worker_environment_that_keeps_our_kernel_or_hook_out_is_refused_by_name(tmp_path):
    env_vars = {"NEMO_JETRL_NRL_REFIT": "{}", "VLLM_PLUGINS": "nemo_jetrl"}
    merged = _merged()
    merged["policy"] = {"generation": {"vllm_cfg": {"env_vars": env_vars}}}
    environ = {"VLLM_DISABLED_KERNELS": "JetRLFp8BlockLinearKernel"}
    with pytest.raises(UserError) as ei:
        _prep(merged, tmp_path, environ=environ)
    msg = str(ei.value)
    assert "nothing started" in msg
    assert "names JetRLFp8BlockLinearKernel" in msg
    assert "(set by VLLM_DISABLED_KERNELS in the launch environment)" in msg
    assert "does not list 'nemo_jetrl_nemo_rl_refit'" in msg
    assert "(set by policy.generation.vllm_cfg.env_vars.VLLM_PLUGINS)" in msg
    merged["policy"]["generation"]["vllm_cfg"]["env_vars"] = {"NEMO_JETRL_NRL_REFIT": "{}"}
    _prep(merged, tmp_path)  # the same worker env without them: no refusal


def test_an_fp8_kv_recipe_on_a_cuda_build_of_vllm_is_refused_before_ray(tmp_path):
    """vLLM's CUDA attention cannot serve an on-policy FP8 KV cache (`kv_backends`): the engine
    check refused it only at engine start, after Ray and the model load. The preflight runs the
    vLLM workers' Python before Ray and reads vLLM's platform: CUDA is refused, naming
    the key and the recipe to use; vLLM's CPU platform (the rehearsal) and a BF16 cache pass.
    The real script, with vLLM 0.20/0.25's CPU builds, runs in every NeMo-RL-tier rehearsal."""
    import types

    from nemo_jetrl.backends.nemo_rl import launch as nr

    def run(device):
        out = json.dumps({"vllm": "0.20.0", "plugins": dict(ENTRY_POINTS), "device": device})
        return lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=out, stderr="")

    with pytest.raises(UserError) as ei:
        nr.preflight_vllm_patch("/v/bin/python", run=run("cuda"), pinned="0.20.0", fp8_kv=True)
    msg = str(ei.value)
    assert msg.startswith("policy.generation.vllm_cfg.kv_cache_dtype=fp8 ") and " on cuda " in msg
    assert "FlexAttention has no FP8 cache" in msg and "Use recipe jetrl (BF16 KV cache" in msg
    nr.preflight_vllm_patch("/v/bin/python", run=run("cuda"), pinned="0.20.0")  # BF16 cache
    # vLLM's CPU platform (the rehearsal; its 0.20/0.25 wheels bring a CUDA torch build)
    nr.preflight_vllm_patch("/v/bin/python", run=run("cpu"), pinned="0.20.0", fp8_kv=True)
    # a GPU build on a head node without GPUs: vLLM finds no platform (UnspecifiedPlatform, "")
    with pytest.raises(UserError, match=r"on a GPU build \(no GPU on this node\)"):
        nr.preflight_vllm_patch("/v/bin/python", run=run(""), pinned="0.20.0", fp8_kv=True)


@pytest.mark.parametrize(("recipe", "refused"), [("jetrl_kv", True), ("jetrl", False)])
def test_the_launch_preflight_knows_the_recipes_kv_cache(tmp_path, recipe, refused):
    """`vllm_preflight` (the launch's and the rehearsal's) is built from the plan: jetrl_kv's FP8
    cache on a CUDA vLLM is refused, jetrl's BF16 cache is not."""
    import types

    from nemo_jetrl.backends.nemo_rl import launch as nr

    (tmp_path / "pyproject.toml").write_text('dependencies = ["vllm==0.25.1"]\n')
    plan = nr.prepare(str(REPO / "examples/configs/qwen3_8b_base" / f"{recipe}.yaml")).plan
    preflight = nr.vllm_preflight(plan, tmp_path)
    out = json.dumps({"vllm": "0.25.1", "plugins": dict(ENTRY_POINTS), "device": "cuda"})
    run = lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=out, stderr="")  # noqa: E731
    if refused:
        with pytest.raises(UserError, match=r"kv_cache_dtype=fp8 .* vLLM 0\.25\.1 on cuda"):
            preflight("/v/bin/python", run=run)
    else:
        preflight("/v/bin/python", run=run)
    with pytest.raises(UserError, match=r"has vLLM 0\.20\.0, but this NeMo-RL pins vLLM 0\.25\.1"):
        preflight("/v/bin/python", run=lambda *a, **k: types.SimpleNamespace(
            returncode=0, stdout=out.replace("0.25.1", "0.20.0"), stderr=""))  # fmt: skip


def test_after_the_run_environments_stop_before_vllm_and_each_stops_whatever_the_other_raised(
    capsys,
):
    """NeMo-RL main stops the environment actors "before generation stops" and a failure to stop
    vLLM does not mask the run's error; v0.7.0's grpo has no shutdown_environments."""
    import types

    calls = []

    class Generation:
        def __init__(self, fails: bool = False) -> None:
            self.fails = fails

        def shutdown(self) -> None:
            calls.append("generation")
            if self.fails:
                raise RuntimeError("vLLM engine is dead")

    def stop_envs(train, val, fails=False):
        calls.append(("environments", train, val))
        if fails:
            raise RuntimeError("environment actor died")

    main = types.SimpleNamespace(shutdown_environments=stop_envs)
    driver.shut_down(main, Generation(), {"math": 1}, {"math": 1})
    assert calls == [("environments", {"math": 1}, {"math": 1}), "generation"]
    calls.clear()
    driver.shut_down(main, Generation(fails=True), {}, None)  # printed, not raised
    assert calls == [("environments", {}, None), "generation"]
    assert "vLLM generation did not shut down cleanly (RuntimeError: vLLM engine is dead)" in (
        capsys.readouterr().err
    )
    calls.clear()
    broken = types.SimpleNamespace(shutdown_environments=lambda t, v: stop_envs(t, v, True))
    with pytest.raises(RuntimeError, match="environment actor died"):
        driver.shut_down(broken, Generation(), {}, None)
    assert calls[-1] == "generation"  # vLLM stopped all the same
    calls.clear()
    driver.shut_down(types.SimpleNamespace(), Generation(), {}, None)  # v0.7.0
    assert calls == ["generation"]


def _venv(base: Path, fqn: str, with_nemo_jetrl: bool) -> Path:
    py = base / fqn / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("")
    site = base / fqn / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    if with_nemo_jetrl:
        (site / "nemo_jetrl-0.1.0.dist-info").mkdir()
    return py


def test_bare_metal_runs_on_the_venv_nemo_rl_built_for_our_worker_class(tmp_path):
    """NeMo-RL names a venv after the class it starts: on bare metal our first launch has it
    build one for our worker class, never the stock one (found by review: every later launch
    then said "NeMo-RL builds <the stock venv> during this run"). Later launches run on it by
    path, and carry the overlay while it lacks nemo_jetrl."""
    base = tmp_path / "venvs"
    merged = _merged(train={"dataset_name": "OpenMathInstruct-2"})
    _, entry, lines, _ = _prep(merged, tmp_path, {})
    ours = base / POLICY_WORKER_FQN / "bin" / "python"
    assert entry == MCORE_UV  # first launch: NeMo-RL builds it
    assert any(f"as {base / POLICY_WORKER_FQN}" in line for line in lines), lines
    assert any(str(ours) in line and "during this run" in line for line in lines), lines
    _venv(base, POLICY_WORKER_FQN, with_nemo_jetrl=False)  # what that launch left
    _venv(base, VLLM_FQN, with_nemo_jetrl=True)
    merged = _merged(train={"dataset_name": "OpenMathInstruct-2"})
    _, entry, lines, _ = _prep(merged, tmp_path, {})
    assert entry == str(ours)
    assert any("built by NeMo-RL for our worker class earlier" in line for line in lines)
    assert any(str(ours) in line and "were built without nemo_jetrl" in line for line in lines)
    assert merged["policy"]["megatron_cfg"]["env_vars"]["PYTHONPATH"]  # the overlay
    # installed into it (docs/cluster.md 1c): nothing to carry
    (ours.parent.parent / "lib/python3.12/site-packages/nemo_jetrl-0.1.0.dist-info").mkdir()
    merged = _merged(train={"dataset_name": "OpenMathInstruct-2"})
    _, entry, lines, _ = _prep(merged, tmp_path, {})
    assert entry == str(ours) and "policy" not in merged


def test_the_async_engine_s_vllm_venv_is_the_one_checked(tmp_path):
    """vllm_cfg.async_engine=true starts NeMo-RL's VllmAsyncGenerationWorker, in a venv of its
    own: nemo_jetrl in the sync worker's venv does not reach it (found by review)."""
    base = tmp_path / "venvs"
    _venv(base, STOCK_POLICY_WORKER, with_nemo_jetrl=True)
    _venv(base, VLLM_FQN, with_nemo_jetrl=True)
    async_py = _venv(base, venvs.VLLM_ASYNC_WORKER, with_nemo_jetrl=False)
    merged = _merged(train={"dataset_name": "OpenMathInstruct-2"})
    merged["policy"] = {"generation": {"vllm_cfg": {"async_engine": True}}}
    assert venvs.vllm_worker_fqn(merged) == venvs.VLLM_ASYNC_WORKER
    _, _, lines, calls = _prep(merged, tmp_path, {})
    assert calls == [(str(async_py), True)]  # asked with the overlay this launch gives it
    assert any(str(async_py) in line and "were built without nemo_jetrl" in line for line in lines)
    env = merged["policy"]["generation"]["vllm_cfg"]["env_vars"]
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith(venvs.OVERLAY_NAME)
    merged = _merged(train={"dataset_name": "OpenMathInstruct-2"})  # sync: its venv has it
    _, _, _, calls = _prep(merged, tmp_path, {})
    assert calls == [str(base / VLLM_FQN / "bin" / "python")] and "policy" not in merged
