"""The mutants of the NeMo-RL launch's own rules, judged in the default environment: what the
driver sets before Ray starts, what every worker checks, the KV calibration's merge across ranks
(each found by reading NeMo-RL's and Ray's sources, 2026-12-01)."""

from __future__ import annotations

from mutation_check import Mutant

T_DRIVER_CODE = ("tests/backends/test_nemo_rl_driver_code.py",)
# A real vLLM CPU engine at tensor_parallel_size=2 (two worker processes, one gloo TP group).
T_TP2 = ("tests/vllm_patch/test_vllm_dense_shards.py",)

MUTANTS = [
    Mutant(  # v0.7.0's worker initializer actor then cannot import our worker class
        "overlay put on the workers' env_vars but not on the driver's PYTHONPATH",
        "nemo_jetrl/backends/nemo_rl/driver.py",
        'environ["PYTHONPATH"] = venvs.with_pythonpath(here, overlay)["PYTHONPATH"]',
        "pass",
        ("tests/backends/test_nemo_rl_launch_prep.py",),
    ),
    Mutant(  # Python's max semantics: a rank's NaN amax replaced by the other ranks' value
        "KV calibration merge across ranks drops a NaN",
        "nemo_jetrl/backends/nemo_rl/calibration.py",
        "if old is None or math.isnan(v) or (not math.isnan(old) and v > old):",
        "if old is None or v > old:",
        ("tests/backends/test_nemo_rl_calibration_merge.py",),
    ),
    Mutant(  # vLLM's KV-cache wake-up leaves every FP8 KV scale at 1.0 for the rollout
        "the refit's KV scales are not put back after vLLM's wake-up reset",
        "nemo_jetrl/backends/nemo_rl/kv_wake.py",
        "        out = original(self, *args, **kwargs)\n        restore_kv_scales(self)\n",
        "        out = original(self, *args, **kwargs)\n",
        ("tests/backends/test_nemo_rl_kv_wake.py",),
    ),
    Mutant(  # Ray would hand the workers the checkout, the driver runs the install
        "a launch from a checkout with other nemo_jetrl sources is not refused",
        "nemo_jetrl/backends/nemo_rl/driver.py",
        "    if shadow:\n        raise _user_error(shadow)\n",
        "",
        T_DRIVER_CODE,
    ),
    Mutant(
        "our vLLM plugin starts in a process whose nemo_jetrl is not the driver's",
        "nemo_jetrl/vllm_patch/plugin.py",
        "    if problem:\n        raise RuntimeError(problem)\n",
        "",
        T_DRIVER_CODE,
    ),
    Mutant(
        "the digest of the sources leaves out their paths (a renamed module reads the same)",
        "nemo_jetrl/build_info.py",
        'h.update(p.relative_to(root).as_posix().encode() + b"\\0" + p.read_bytes() + b"\\0")',
        'h.update(p.read_bytes() + b"\\0")',
        T_DRIVER_CODE,
    ),
    Mutant(  # rank 0 keeps the new weights, rank 1 the old: a half-refit engine
        "each tensor-parallel rank rolls back alone (no vote across the engine's ranks)",
        "nemo_jetrl/vllm_patch/rank_vote.py",
        "    tp = tensor_parallel_size(worker)\n",
        "    tp = 1\n",
        T_TP2,
        env="vllm",
    ),
    Mutant(
        "a rank that loaded returns True though another rank's transport returned False",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        "ok = rank_vote.settle(name, self, snap, failure, ok)",
        "rank_vote.settle(name, self, snap, failure, ok)",
        T_TP2,
        env="vllm",
    ),
    Mutant(  # NeMo-RL streams every full tensor to every rank: TP x the model in host memory
        "the parity check's host copy is of the whole sent tensor on every rank",
        "nemo_jetrl/backends/nemo_rl/refit_batches.py",
        "mine = expert_shards.rank_expected(model, name, t)",
        "mine = t",
        ("tests/vllm_patch/test_expert_shards_unit.py",),
    ),
    Mutant(  # vLLM 0.20/0.25's MLA rebinds W_UK_T/W_UV: captured decode graphs read the old
        "NeMo-RL's refit leaves rebound tensors where the captured CUDA graphs do not read",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        "        graph_bindings.keep_in_place(model, bound)\n",
        "        pass\n",
        ("tests/vllm_patch/test_graph_bindings.py",),
    ),
    Mutant(
        "a moved tensor is bound back to its old storage without the new values",
        "nemo_jetrl/vllm_patch/graph_bindings.py",
        "            old.copy_(cur)\n",
        "",
        ("tests/vllm_patch/test_graph_bindings.py",),
    ),
    Mutant(
        "an engine in piecewise CUDA-graph mode is taken for one that replays no graphs",
        "nemo_jetrl/vllm_patch/graph_bindings.py",
        'return mode is not None and getattr(mode, "name", str(mode)) != "NONE"',
        'return mode is not None and "FULL" in getattr(mode, "name", str(mode))',
        ("tests/vllm_patch/test_graph_bindings.py",),
    ),
    Mutant(  # the rollback vote covers one stage's TP group: stage 0 back, stage 1 new
        "vLLM pipeline stages pass the launch with the refit's parity and rollback on",
        "nemo_jetrl/vllm_patch/rank_vote.py",
        "if not checked or not isinstance(pp, int) or pp <= 1:",
        "if not checked or not isinstance(pp, int) or pp <= 2:",
        ("tests/backends/test_nemo_rl_backend.py",),
    ),
    Mutant(  # found by review: every refit with an FP8 KV cache refused on a graphed engine
        "the KV scale parameters are widened to float32 inside the refit, after the graph record",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        "                float32_kv_scales(runner.model)  # before the snapshot and graph bindings see them\n",
        "",
        ("tests/vllm_patch/test_graph_bindings.py",),
    ),
    Mutant(  # a raised error's traceback keeps settle's frame: a model copy through the rollout
        "the rollback snapshot's copies stay alive while the refit's error lives",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        "                snap.modules.clear()\n",
        "                pass\n",
        ("tests/backends/test_nemo_rl_refit_transport.py",),
    ),
    Mutant(
        "a vote that cannot be held leaves this rank half refit",
        "nemo_jetrl/vllm_patch/rank_vote.py",
        "        if snap is not None:\n            restore_snapshot(worker.model_runner.model, snap)\n",
        "",
        ("tests/backends/test_nemo_rl_refit_transport.py",),
    ),
    Mutant(  # the wake-up would write a refused refit's KV scales into the engine
        "a rolled-back refit's KV scales are kept for the KV-cache wake-up",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        "            if ok:  # put back after vLLM's KV-cache wake-up resets them (kv_wake.py)\n",
        "            if True:\n",
        ("tests/backends/test_nemo_rl_refit_transport.py",),
    ),
    Mutant(  # a PP engine would refit stage by stage, each rolled back alone
        "the refit hook lets vLLM pipeline stages through with its checks on",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        "if why := rank_vote.stage_problem(pp, checked):",
        "if why := rank_vote.stage_problem(1, checked):",
        ("tests/backends/test_nemo_rl_refit_transport.py",),
    ),
    Mutant(  # the refusal would ask to turn off a check the user already turned off
        "the pipeline-stage refusal names every refit check, on or off",
        "nemo_jetrl/vllm_patch/rank_vote.py",
        "(parity, rollback), strict=True) if on]",
        "(parity, rollback), strict=True)]",
        ("tests/backends/test_nemo_rl_refit_transport.py",),
    ),
    Mutant(  # an operator chasing a snapshot OOM when the graph record failed
        "a failed CUDA-graph record is reported as a failed snapshot",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        '                    step = "the storage its CUDA graphs read could not be recorded"\n',
        "",
        ("tests/backends/test_nemo_rl_refit_transport.py",),
    ),
    Mutant(  # found by review (async): the snapshot copied weights NeMo-RL's streams had loaded
        "NeMo-RL's side-stream loads may overtake the GPU snapshot's copies",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        "            _sync_device(runner.model)\n            ok = original(self, *args, **kwargs)",
        "            ok = original(self, *args, **kwargs)",
        ("tests/backends/test_nemo_rl_refit_transport.py",),
    ),
    Mutant(  # found by review: async_grpo_train asserted it minutes into the job
        "async GRPO with colocated vLLM passes the driver's checks",
        "nemo_jetrl/backends/nemo_rl/driver.py",
        'if on_vllm and (generation.get("colocated") or {}).get("enabled", True) is not False:',
        'if on_vllm and (generation.get("colocated") or {}).get("enabled", True) is None:',
        ("tests/backends/test_nemo_rl_launch_prep.py",),
    ),
    Mutant(  # found by review: NCCL reshard's trainer waits for ever on the refused worker
        "a refit transport that bypasses fp8.load_weights passes the launch",
        "nemo_jetrl/backends/nemo_rl/refit_rules.py",
        "    if transport is not None:",
        "    if transport is None:",
        ("tests/backends/test_nemo_rl_backend.py",),
    ),
    Mutant(  # found by review: is_ratio_mean 5.27 where 1.02 was right
        "under force_on_policy_ratio the metrics compare the rollout with NeMo-RL's zeros",
        "nemo_jetrl/backends/nemo_rl/metrics.py",
        'if getattr(self.inner, "force_on_policy_ratio", False):',
        "if False:",
        ("tests/backends/test_nemo_rl_metrics_wrapper.py",),
    ),
    Mutant(  # found by review: means divided by tokens they left out
        "the logged token means count unusable tokens in their denominator",
        "nemo_jetrl/backends/nemo_rl/metrics.py",
        "            out[k] = float(out[k]) * scale\n",
        "            out[k] = float(out[k])\n",
        ("tests/backends/test_nemo_rl_metrics_wrapper.py",),
    ),
    Mutant(  # found by review: a bad bound crashed every worker's first loss call
        "the wrapper's ratio bounds are not checked on the driver",
        "nemo_jetrl/backends/nemo_rl/metrics.py",
        "        if not 0.0 <= lo <= hi:  # here on the driver",
        "        if False:  # here on the driver",
        ("tests/backends/test_nemo_rl_metrics_wrapper.py",),
    ),
    Mutant(  # found by review: a fraction silently ignored, scales unlike the local backend's
        "a KV calibration data_fraction below 1 passes the NeMo-RL launch",
        "nemo_jetrl/backends/nemo_rl/translate.py",
        "    if recipe.kv_calibration.data_fraction != 1.0:",
        "    if recipe.kv_calibration.data_fraction > 1.0:",
        ("tests/backends/test_nemo_rl_backend.py",),
    ),
    Mutant(  # found by review: graph replays keep the capture's on-policy KV scales
        "training CUDA graphs pass the launch with on-policy KV",
        "nemo_jetrl/backends/nemo_rl/translate.py",
        '    if recipe.onpolicy_kv and graphs not in (None, "none"):',
        "    if recipe.onpolicy_kv and graphs is None:",
        ("tests/backends/test_nemo_rl_backend.py",),
    ),
    Mutant(  # found by review: every launch logs at step 0, so no resumed run was joined
        "a resumed run's first step counts the setup metrics of step 0",
        "nemo_jetrl/runs/resume.py",
        "(pos := [st for st in s.steps if st > 0])",
        "(pos := [st for st in s.steps if st >= 0])",
        ("tests/commands/test_compare_recipes.py",),
    ),
]
