"""The mutants of the local backend's run lifecycle and device path mended in session 37 (helper
reviews of resume and of `--device cuda`; docs/ci_times.md): resume, validation, the guard's
device flags, checkpoints written on a GPU, BF16 linears on CUDA, `jetrl train`'s backend."""

from __future__ import annotations

from mutation_check import Mutant

LOCAL = "nemo_jetrl/backends/local/"
T_RUN_DIRS = "tests/runs/test_faults_run_dirs.py::"
T_RESUME = "tests/runs/test_faults_resume.py::"
MUTANTS = [
    Mutant(  # review: NeMo-RL's GPU monitor logs ray/* against seconds since the launch
        "compare reads ray/* GPU-monitor seconds as a resumed directory's first step",
        "nemo_jetrl/runs/tensorboard.py",
        "    return not tag.startswith(OFF_STEP_AXIS)",
        "    return True",
        ("tests/commands/test_compare_recipes.py",),
    ),
    Mutant(  # review: a --resume that found no checkpoint mixed a second run into the log dir
        "--resume without a checkpoint starts a second run beside the first one's logs",
        LOCAL + "loop.py",
        "                run_id, purge = _restart_of(rs, lock.run_id, write)",
        "                pass",
        (T_RESUME + "test_resume_without_a_checkpoint_restarts_the_run_it_finds",),
    ),
    Mutant(  # the killed run's train data of purged steps were recomputed by readers
        "a resumed run leaves the killed run's train data of the purged steps in place",
        "nemo_jetrl/runs/writer.py",
        "    stale = [p for step, p in train_data_files(run_dir).items() if step >= first]",
        "    stale = []",
        (
            T_RESUME + "test_resume_without_a_checkpoint_restarts_the_run_it_finds",
            T_RUN_DIRS + "test_kill_during_save_then_resume_matches_uninterrupted_run",
        ),
    ),
    Mutant(  # review: two recipes named "custom" resumed each other's checkpoints
        "a local resume compares the recipe's name only",
        LOCAL + "resume.py",
        '    spec = state.get("recipe_spec")\n',
        "    spec = None\n",
        ("tests/backends/test_local_resume_rules.py",),
    ),
    Mutant(  # review: torch restores the checkpoint's lr over the resubmitted config's
        "a resumed run trains at the checkpoint's learning rate",
        LOCAL + "resume.py",
        "            group[key] = want",
        "            pass",
        (
            "tests/backends/test_local_resume_rules.py",
            T_RESUME + "test_resume_takes_the_configs_learning_rate_and_refuses_another_recipe",
        ),
    ),
    Mutant(  # review: validation measured the policy of one update earlier
        "validation runs on the rollout of the step's start",
        LOCAL + "step.py",
        "        if self._updated_since_refit:\n",
        "        if False:\n",
        ("tests/backends/test_local_validation.py",),
    ),
    Mutant(  # review: on CUDA a refused update left device flags that killed the next step
        "the guard's probe leaves the quantizers' device flags pending",
        LOCAL + "guard.py",
        "        check_non_finite()\n",
        "        pass\n",
        (
            "tests/runs/test_faults_updates_paths.py::test_the_probe_reads_the_flags_a_cuda_forward_leaves",
        ),
    ),
    Mutant(  # review: a GPU run's checkpoint "did not load" on a CPU machine
        "checkpoints load with their saved device locations",
        LOCAL + "checkpoint.py",
        ', weights_only=True, map_location="cpu")',
        ", weights_only=True)",
        ("tests/backends/test_local_checkpoint_integrity.py",),
    ),
    Mutant(  # review: cuBLAS picks its kernel by the row count on CUDA
        "a batch-invariant CUDA run leaves its BF16 decoder linears on torch's GEMM",
        LOCAL + "bf16_gemm.py",
        "        return lambda _name, _module: True",
        "        return lm_head_only",
        ("tests/backends/test_local_bf16_gemm.py",),
    ),
    Mutant(  # review: Triton launches on the current device, not the tensors'
        "a run on cuda:N leaves GPU 0 current",
        LOCAL + "setup.py",
        "        make_current(self.device)\n",
        "",
        ("tests/backends/test_local_device.py::test_a_run_makes_its_gpu_the_current_device",),
    ),
    Mutant(  # diff review: a finished run, or one whose checkpoints moved, was wiped
        "--resume without a checkpoint restarts a run that finished or saved elsewhere",
        LOCAL + "loop.py",
        "    if len(ids) == 1 and (why := _not_restartable(rs)):",
        "    if False and (why := _not_restartable(rs)):",
        (T_RESUME + "test_resume_without_a_checkpoint_restarts_the_run_it_finds",),
    ),
    Mutant(  # diff review: a refused validation refit was counted twice across a resume
        "validation's refused refit is counted when it is made",
        LOCAL + "step.py",
        "self.do_refit(hooks or Hooks(), count=False)",
        "self.do_refit(hooks or Hooks(), count=True)",
        (T_RESUME + "test_a_refused_validation_refit_counts_once_across_a_resume",),
    ),
    Mutant(  # diff review: torch.cuda.set_device refuses a device without an index
        "plain 'cuda' is handed to set_device",
        LOCAL + "device.py",
        '    if device.type == "cuda" and device.index is not None:',
        '    if device.type == "cuda":',
        ("tests/backends/test_local_device.py::test_a_run_makes_its_gpu_the_current_device",),
    ),
    Mutant(  # user walk: a cluster config trained the local toy model for hours
        "jetrl train --backend auto runs a cluster config on the local backend",
        "nemo_jetrl/commands/train.py",
        '        if not_local and args.backend == "auto":',
        "        if False:",
        ("tests/commands/test_train_backend_choice.py",),
    ),
    Mutant(  # session 38: a host read of "every row finished" after every decode step
        "the rollout reads the device's done flags at every decode step",
        "nemo_jetrl/backends/local/rollout.py",
        "            if used % every == 0 or used == max_new_tokens:",
        "            if True:",
        ("tests/backends/test_local_host_syncs.py",),
    ),
    Mutant(  # session 38: steps run past the stop must leave the generator as the stop did
        "draws of decode steps past the stop are kept",
        "nemo_jetrl/backends/local/rollout.py",
        "                        marks.undo_after(steps - 1)",
        "                        pass",
        ("tests/backends/test_local_host_syncs.py",),
    ),
    Mutant(  # session 38: a smaller train_global_batch_size trained differently without a word
        "a global batch the local backend does not honour goes unsaid",
        "nemo_jetrl/backends/local/config.py",
        "        if gbs is None or gbs == n:",
        "        if True:",
        ("tests/backends/test_local_global_batch.py",),
    ),
    Mutant(  # session 39: the HF rollout failed mid-run, the vLLM engine cut responses short
        "a local run past the model's positions is not refused before any work",
        "nemo_jetrl/backends/local/seq_len.py",
        "    elif need > top:",
        "    elif False:",
        ("tests/backends/test_local_seq_len.py",),
    ),
    Mutant(  # the rollout never feeds its last token; the trainer scores every position
        "the sequence bound lets one position past the model's table through",
        "nemo_jetrl/backends/local/seq_len.py",
        "    elif need > top:",
        "    elif need > top + 1:",
        ("tests/backends/test_local_seq_len.py::test_the_bound_is_the_trainers_whole_sequence",),
    ),
    Mutant(
        "the training prompts are not measured (the first validation prompt sizes the run)",
        "nemo_jetrl/backends/local/seq_len.py",
        "        train_prompt=longest_prompt(train, tok),",
        "        train_prompt=0,",
        ("tests/backends/test_local_seq_len.py",),
    ),
    Mutant(  # session 39 review: a same-shape model resumed silently, another crashed later
        "a local resume under another model, seed or numerics is not compared",
        "nemo_jetrl/backends/local/run_identity.py",
        "        elif key in REFUSED:",
        "        elif False:",
        ("tests/backends/test_local_resume_identity.py",),
    ),
    Mutant(  # base.yaml's 64 did nothing: NeMo-RL's length limit silently ignored
        "the local backend ignores policy.max_total_sequence_length",
        "nemo_jetrl/backends/local/seq_len.py",
        "        max_total=run.max_total_sequence_length,",
        "        max_total=None,",
        ("tests/backends/test_local_max_total.py",),
    ),
    Mutant(  # jetrl check said ON-POLICY (exit 0) where jetrl train exits 2
        "jetrl check skips the local backend's checks of the section with the run keys",
        "nemo_jetrl/config/validate.py",
        "    if section.validate_with_run is not None:",
        "    if False:",
        ("tests/backends/test_local_seq_len_check.py",),
    ),
    Mutant(  # session 39 found: resumed on the warm start's weights (tmpe 1.33 -> 1.92)
        "a resume while refits are refused rolls out from the warm start's weights",
        "nemo_jetrl/backends/local/resume.py",
        "        self._restore_rollout(state.get(ROLLOUT_KEY), path)\n",
        "",
        ("tests/runs/test_faults_stale_rollout.py",),
    ),
    Mutant(  # the copy is what keeps them: the trainer's update overwrites its weights in place
        "the rollout's last good weights alias the trainer's",
        "nemo_jetrl/backends/local/step.py",
        "            self.rollout_source = {k: v.detach().clone() for k, v in weights.items()}",
        "            self.rollout_source = dict(weights)",
        ("tests/runs/test_faults_stale_rollout.py",),
    ),
    Mutant(  # session 39 found: `jetrl train ... logger.log_dir=.` refused left ./checkpoints
        "a run refused at its directories leaves the ones it made",
        "nemo_jetrl/runs/lock.py",
        "                d.rmdir()",
        "                pass",
        ("tests/runs/test_run_dir_refusals.py",),
    ),
]
