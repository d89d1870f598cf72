"""The mutants of the NeMo-RL launch's later rules, judged where each runs: the launch's venvs
and overlays, the policy worker's checks of the model NeMo-RL built, the refit of MoE and hybrid
models, NeMo-RL's loss and logger glue, and the login node's submission (`slurm/launch.sh`). The
first part of the list: `cluster.py`."""

from __future__ import annotations

from mutation_check import Mutant

MUTANTS = [
    Mutant(  # found by review: bare metal's second launch found venvs without nemo_jetrl
        "venvs an earlier launch built without nemo_jetrl get no overlay",
        "nemo_jetrl/backends/nemo_rl/driver.py",
        "    if rebuild or unbuilt or lacking:",
        "    if rebuild or unbuilt:",
        (
            "tests/backends/test_nemo_rl_launch_prep.py",
            "tests/backends/test_nemo_rl_launch_venvs.py",
        ),
    ),
    Mutant(
        "the vLLM preflight of a venv without nemo_jetrl runs without the overlay",
        "nemo_jetrl/backends/nemo_rl/launch.py",
        "    env = None if overlay is None else {**os.environ, **with_pythonpath({}, overlay)}",
        "    env = None",
        (
            "tests/backends/test_nemo_rl_launch_prep.py",
            "tests/backends/test_nemo_rl_launch_venvs.py",
        ),
    ),
    Mutant(  # found by review: Nemotron-H's provider keeps the edge layers BF16 in training
        "the worker lets a model built with other BF16 edge layers train",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        "            elif why:\n                raise RuntimeError(",
        "            elif False:\n                raise RuntimeError(",
        ("tests/backends/test_nemo_rl_worker_checks.py",),
        env="nemo_rl",
    ),
    Mutant(
        "a built model's BF16 edge flag is read without its counts",
        "nemo_jetrl/megatron/config.py",
        "    if built == (train.bf16_first_layers, train.bf16_last_layers):",
        "    if not on:",
        ("tests/megatron/test_megatron_config.py",),
    ),
    Mutant(  # found by review: DeepSeek/Moonlight FP8 experts failed at vLLM's profile run
        "our experts kernel accepts a routing it cannot compute when the layer is built",
        "nemo_jetrl/vllm_patch/experts.py",
        "    if own_routing and (odd := routing_problems(layer)):",
        "    if False and (odd := routing_problems(layer)):",
        ("tests/vllm_patch/test_moe_unit.py",),
    ),
    Mutant(  # found by review: jetrl check called Moonlight's FP8 experts on-policy on NeMo-RL
        "the verdict ignores a routing our experts kernel cannot compute",
        "nemo_jetrl/flow/backend.py",
        "        if routing and own_routing(vllm):",
        "        if False:",
        ("tests/flow/test_partial_block_rule.py",),
    ),
    Mutant(  # found by review: a hybrid model's FP8-KV refit failed on its linear-attention layers
        "KV scales of linear-attention layers are loaded and kept",
        "nemo_jetrl/backends/nemo_rl/refit_batches.py",
        "    weights = [(k, v) for k, v in weights if not _scale_of_no_attention(model, k)]",
        "    weights = list(weights)",
        ("tests/backends/test_nemo_rl_refit_transport.py",),
    ),
    Mutant(  # found by review: vLLM's CUDA attention quantizes queries with an FP8 KV cache
        "the engine check lets an FP8 KV cache with FP8 queries run",
        "nemo_jetrl/backends/nemo_rl/kv_backends.py",
        '    if queries := report.get("fp8_kv_query_quant", []):',
        "    if queries := []:",
        ("tests/backends/test_nemo_rl_engine_check_unit.py",),
    ),
    Mutant(  # found by review: BF16 slabs on a TP/EP engine failed parity at every refit
        "a BF16 expert slab is kept whole on an engine whose experts are split",
        "nemo_jetrl/backends/nemo_rl/refit_batches.py",
        "            slab = refit_experts.grouped_param(model, name) is not None  # a BF16 slab, whole",
        "            slab = False",
        ("tests/backends/test_nemo_rl_refit_experts.py",),
    ),
    Mutant(  # found by review: jetrl_kv passed the launch on a CUDA vLLM, refused at engine start
        "the launch lets an FP8 KV recipe start on a CUDA build of vLLM",
        "nemo_jetrl/backends/nemo_rl/launch.py",
        '    if fp8_kv and found.get("device") != "cpu":',
        "    if False:",
        (
            "tests/backends/test_nemo_rl_launch_prep.py",
            "tests/backends/test_nemo_rl_launch_venvs.py",
        ),
    ),
    Mutant(
        "the launch preflight is not told the recipe's KV cache is FP8",
        "nemo_jetrl/backends/nemo_rl/launch.py",
        "        preflight_vllm_patch, pinned=nemo_rl_pinned_vllm(nemo_rl_dir), fp8_kv=plan.recipe.kv_fp8",
        "        preflight_vllm_patch, pinned=nemo_rl_pinned_vllm(nemo_rl_dir), fp8_kv=False",
        (
            "tests/backends/test_nemo_rl_launch_prep.py",
            "tests/backends/test_nemo_rl_launch_venvs.py",
        ),
    ),
    Mutant(  # the nemo-rl line said on-policy above a launch refusal
        "jetrl check's nemo-rl line hides that the launch refuses the config",
        "nemo_jetrl/commands/check.py",
        "    return b.runs and b.on_policy and bool(refusals.get(tree))",
        "    return False",
        ("tests/backends/test_nemo_rl_tree_rules.py",),
    ),
    Mutant(
        "jetrl check drops the trainer's refusals when translate refuses too",
        "nemo_jetrl/backends/nemo_rl/launch.py",
        "        return [*exc.problems, *trainer_problems(cfg)]",
        "        return list(exc.problems)",
        ("tests/backends/test_nemo_rl_tree_rules.py",),
    ),
    Mutant(  # found by review: a hybrid model's stage of linear attention only died at init
        "a pipeline stage without full attention refuses the KV hooks",
        "nemo_jetrl/megatron/attention.py",
        "        if not mods and not allow_empty:",
        "        if not mods:",
        ("tests/megatron/test_megatron_bf16_names_gdn.py",),
    ),
    Mutant(  # found by review: Moonlight's `mlp.down_proj` refused by its MoE-only stages
        "a BF16 word is judged on this pipeline stage alone",
        "nemo_jetrl/megatron/bf16_names.py",
        "    parts = gather((sorted(used), sorted(layers), problem)) if gather else [(used, layers, problem)]",
        "    parts = [(used, layers, problem)]",
        ("tests/megatron/test_megatron_bf16_names_gdn.py",),
    ),
    Mutant(
        "the worker judges BF16 words on its own pipeline stage",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        "                gather=_all_ranks,",
        "                gather=None,",
        ("tests/backends/test_nemo_rl_worker_glue.py",),
        env="nemo_rl",
    ),
    Mutant(  # session 33's reread: the trainer waited on a refusal raised before its stream
        "the pipeline-parallel refusal raises before NeMo-RL's stream is received",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        '            drain_refused(self, original, (args, kwargs), f"vLLM pipeline_parallel_size={why}")',
        '            raise RefitError(f"vLLM pipeline_parallel_size={why}")',
        ("tests/backends/test_nemo_rl_refit_transport.py",),
    ),
    Mutant(  # review: an interpolated async key read as text listed refusals that do not apply
        "launch_problems reads the trainer's keys unresolved",
        "nemo_jetrl/backends/nemo_rl/launch.py",
        "        cfg = OmegaConf.to_container(checked.cfg, resolve=True)",
        "        cfg = OmegaConf.to_container(checked.cfg)",
        ("tests/backends/test_nemo_rl_tree_rules.py",),
    ),
    Mutant(
        "the worker never lets a pipeline stage hold no attention",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        "                    allow_empty=_pipeline_stages(self.cfg) > 1,",
        "                    allow_empty=False,",
        ("tests/backends/test_nemo_rl_worker_glue.py",),
        env="nemo_rl",
    ),
    Mutant(  # review: the other ranks waited in the BF16 words' gather
        "a rank whose KV hooks fail raises alone",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        '                refuse_with_ranks(f"{type(exc).__name__}: {exc}", _all_ranks)',
        "                raise",
        ("tests/backends/test_nemo_rl_worker_glue.py",),
        env="nemo_rl",
    ),
    Mutant(  # review: a typo'd layer index ran that layer in FP8 on every rank
        "with every stage asked, a word naming a missing layer passes",
        "nemo_jetrl/megatron/bf16_names.py",
        "_should_match(kw, None if gather else layers)",
        "_should_match(kw, layers)",
        ("tests/megatron/test_megatron_bf16_names_gdn.py",),
    ),
    Mutant(  # review: several global batches a step logged neither mean
        "a micro-batch returns its token means, not its sums",
        "nemo_jetrl/rl/metrics.py",
        "    sums = [torch.where(ok, t, 0.0).sum() for t in _token_terms(d, lo, hi).values()]",
        "    sums = [torch.where(ok, t, 0.0).mean() for t in _token_terms(d, lo, hi).values()]",
        ("tests/backends/test_nemo_rl_metrics_wrapper.py",),
    ),
    Mutant(  # the micro-batch sums count every masked-out position as non-finite
        "non-finite count over all positions, not the valid ones",
        "nemo_jetrl/rl/metrics.py",
        "    counts = [ok.sum(), (mask & ~ok).sum()]",
        "    counts = [ok.sum(), (~ok).sum()]",
        ("tests/rl/test_metric_sums.py",),
    ),
    Mutant(  # review: NeMo-RL swaps the reference's weights into the hooked model
        "the reference policy's logprobs get the policy's on-policy KV",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        "            with self._jetrl_kv.bf16(), super().use_reference_model():",
        "            with super().use_reference_model():",
        ("tests/backends/test_nemo_rl_worker_glue.py",),
        env="nemo_rl",
    ),
    Mutant(
        "the KV stays BF16 after the reference block when it raised",
        "nemo_jetrl/megatron/attention.py",
        "        try:\n            yield\n        finally:\n            self.state.quantize = saved",
        "        yield\n        self.state.quantize = saved",
        ("tests/backends/test_nemo_rl_worker_glue.py",),
        env="nemo_rl",
    ),
    Mutant(  # review: main's run_grpo.py prints it; raised, it masked the run's own error
        "vLLM failing to shut down is raised over the run's error",
        "nemo_jetrl/backends/nemo_rl/driver.py",
        '        except Exception as exc:\n            print(\n                f"jetrl: vLLM generation',
        '        except ZeroDivisionError as exc:\n            print(\n                f"jetrl: vLLM generation',
        (
            "tests/backends/test_nemo_rl_launch_prep.py",
            "tests/backends/test_nemo_rl_launch_venvs.py",
        ),
    ),
    Mutant(  # review: NeMo-RL's colocated trainer sizes its refit buffers from free GPU memory
        "the refit's rollback copy ignores where the launch asked for it",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        "                host = state.host_snapshot\n",
        "                host = False\n",
        ("tests/backends/test_nemo_rl_refit_transport.py",),
    ),
    Mutant(
        "the launch asks for a host rollback copy whether or not vLLM is colocated",
        "nemo_jetrl/backends/nemo_rl/translate.py",
        '            host = _get(config, "policy.generation.colocated.enabled", True) is not False',
        "            host = True",
        ("tests/backends/test_nemo_rl_backend.py",),
    ),
    Mutant(  # review: docs' async example gave training 4 GPUs for TP x PP x CP = 8
        "training's GPUs are not checked against Megatron's model-parallel size",
        "nemo_jetrl/backends/nemo_rl/resources.py",
        "        if split.train % need:",
        "        if False:",
        ("tests/backends/test_nemo_rl_resources.py",),
    ),
    Mutant(
        "a rehearsal's rewritten cluster is judged instead of the user's",
        "nemo_jetrl/backends/nemo_rl/driver.py",
        "    problems = resource_problems(cfg if gpus_of is None else gpus_of)",
        "    problems = resource_problems(cfg)",
        ("tests/backends/test_nemo_rl_resources.py",),
    ),
    Mutant(  # review: a typo'd override was submitted, then refused at the job's start
        "launch.sh submits a config jetrl train refuses",
        "slurm/launch.sh",
        "if ((py_rc == 2)); then",
        "if ((py_rc == 99)); then",
        (
            "tests/backends/test_slurm_submission.py::"
            "test_what_jetrl_train_would_refuse_at_the_jobs_start_is_never_submitted",
        ),
    ),
    Mutant(
        "a launch rule both NeMo-RL trees refuse is only a note at submission",
        "nemo_jetrl/backends/nemo_rl/submission.py",
        "    common = [p for p in first if all(p in o for o in others)]",
        "    common = []",
        (
            "tests/backends/test_slurm_submission.py::"
            "test_submission_refuses_what_both_trees_refuse_and_notes_the_rest",
        ),
    ),
    Mutant(  # review: async_engine starts VllmAsyncGenerationWorker, in a venv of its own
        "the sync vLLM worker's venv is checked whatever the engine",
        "nemo_jetrl/backends/nemo_rl/venvs.py",
        '    return VLLM_ASYNC_WORKER if vllm_cfg.get("async_engine") else VLLM_WORKER',
        "    return VLLM_WORKER",
        (
            "tests/backends/test_nemo_rl_launch_prep.py",
            "tests/backends/test_nemo_rl_launch_venvs.py",
        ),
    ),
    Mutant(  # review: bare metal builds the venv under our class's name, never the stock one
        "the venv NeMo-RL built for our worker class is not reused",
        "nemo_jetrl/backends/nemo_rl/venvs.py",
        "    if ours.is_file() and not (base / our_fqn).is_symlink() and not rebuild:",
        "    if False:",
        (
            "tests/backends/test_nemo_rl_launch_prep.py",
            "tests/backends/test_nemo_rl_launch_venvs.py",
        ),
    ),
    Mutant(  # review: a defaults file inside the image was refused on the login node
        "a config only the job's machine can read is refused at submission",
        "nemo_jetrl/backends/nemo_rl/submission.py",
        "        if _job_machine_only(exc):\n            raise",
        "        if False:\n            raise",
        (
            "tests/backends/test_slurm_submission.py::"
            "test_submission_refuses_what_both_trees_refuse_and_notes_the_rest",
        ),
    ),
    Mutant(  # review: NeMo-RL's own mopd-* recipes were refused
        "teachers on their own nodes are counted as training's",
        "nemo_jetrl/backends/nemo_rl/resources.py",
        '    if opd.get("enabled"):',
        "    if False:",
        ("tests/backends/test_nemo_rl_resources.py",),
    ),
    Mutant(  # review: NeMo-Gym's GPU nodes come on top of cluster.num_nodes
        "NeMo-Gym's GPU nodes are not asked of SLURM",
        "slurm/launch.sh",
        "  gym_nodes=$cfg_gym\n",
        "  gym_nodes=0\n",
        (
            "tests/backends/test_slurm_submission.py::"
            "test_nemo_gym_gpu_nodes_are_asked_of_slurm_on_top_of_the_runs",
        ),
    ),
    Mutant(  # review: a non-numeric NODES died in bash arithmetic
        "launch.sh lets a node count that is not a whole number through",
        "slurm/launch.sh",
        '  if ! [[ "${!v}" =~ ^[1-9][0-9]*$ ]]; then',
        "  if false; then",
        (
            "tests/backends/test_slurm_submission.py::"
            "test_a_node_or_gpu_count_that_is_not_a_whole_number_is_refused_naming_it",
        ),
    ),
    Mutant(  # session 38: a spaced plugin name passed the check, then vLLM skipped the plugin
        "the check before Ray strips spaces vLLM keeps in VLLM_PLUGINS",
        "nemo_jetrl/backends/nemo_rl/worker_env.py",
        '    return None if value is None else value.split(",")',
        '    return None if value is None else [p.strip() for p in value.split(",")]',
        ("tests/backends/test_nemo_rl_worker_env.py",),
    ),
    Mutant(  # session 38: VLLM_USE_DEEP_GEMM_E8M0=false raised inside the engine
        "a DeepGEMM E8M0 value vLLM cannot read passes the check before Ray",
        "nemo_jetrl/backends/nemo_rl/worker_env.py",
        "    except ValueError:\n        return None",
        "    except ValueError:\n        return False",
        ("tests/backends/test_nemo_rl_engine_check_unit.py",),
    ),
    Mutant(  # session 38: ray.sub exits 1 at the job's start on another GRES count
        "launch.sh submits a GPUS_PER_NODE the partition's nodes do not have",
        "slurm/launch.sh",
        '  if [[ "$raysub_gpus" =~ ^[0-9]+$ ]] && ((raysub_gpus != GPUS_PER_NODE)); then',
        "  if false; then",
        (
            "tests/backends/test_slurm_submission.py::"
            "test_gpus_per_node_other_than_the_partitions_is_refused_before_the_queue",
        ),
    ),
    Mutant(  # session 39: the check's gate let the run start, the worker then stopped it
        "the policy worker stops a run launched with jetrl.allow_off_policy",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        "            if why and off_policy_allowed(os.environ):",
        "            if why and False:",
        (
            "tests/backends/test_nemo_rl_worker_checks.py::"
            "test_a_run_that_allows_off_policy_builds_the_model_with_a_warning",
        ),
        env="nemo_rl",
    ),
    Mutant(
        "jetrl.allow_off_policy never reaches the policy workers",
        "nemo_jetrl/backends/nemo_rl/translate.py",
        '    if _get(config, "jetrl.allow_off_policy", False) is True:',
        "    if False:",
        (
            "tests/backends/test_nemo_rl_policy_env.py::"
            "test_allow_off_policy_reaches_the_policy_workers_env",
        ),
    ),
    Mutant(  # session 39 review: Qwen3-8B's checkpoint resumed under Qwen3-4B's config
        "NeMo-RL's resume guard compares the recipe only, not the model",
        "nemo_jetrl/backends/nemo_rl/resume_guard.py",
        "    other = _other_model(saved, merged)\n",
        "    other = None\n",
        (
            "tests/backends/test_nemo_rl_resume_guard.py::"
            "test_a_checkpoint_of_another_model_is_refused_naming_both",
        ),
    ),
]
