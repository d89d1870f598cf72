"""The mutants of `jetrl check` / `align` / `compare` and the CLI mended in session 37 (a helper
walking the README as a new user; docs/ci_times.md): verdicts of NeMo-RL main's single-controller
lag and of other programs' configs, pasteable fixes, compare's metrics and run dirs, a closed
stdout pipe; and session 38's: a file describing no GRPO run, align beside FP8 primary
weights, the allow-off-policy override that pastes."""

from __future__ import annotations

from mutation_check import Mutant

T_COMPARE = ("tests/commands/test_compare.py",)
MUTANTS = [
    Mutant(  # user walk: main's single-controller async configs were called ON-POLICY
        "the single-controller path's sampler window is not read",
        "nemo_jetrl/flow/limits.py",
        "    if lag.sampler is not None:\n        return _sampler_limits(lag.sampler)",
        "    if False:\n        return _sampler_limits(lag.sampler)",
        ("tests/flow/test_single_controller_lag.py",),
    ),
    Mutant(  # diff review: the lag advice did not paste where the window is NeMo-RL's default
        "the lag advice prints the window key without '+' where the config lacks it",
        "nemo_jetrl/flow/limits.py",
        "    given = sampler.window_given  # the override to paste: +key where the config lacks it",
        "    given = True",
        ("tests/flow/test_single_controller_lag.py",),
    ),
    Mutant(  # user walk: SFT/DPO/RM configs got ON-POLICY
        "another NeMo-RL program's config gets a GRPO verdict",
        "nemo_jetrl/config/run_keys.py",
        "    issues.extend(program_issues(cfg))",
        "    pass",
        ("tests/commands/test_check_not_grpo.py",),
    ),
    Mutant(  # user walk: `fix: jetrl.vllm_patch=true` exits 2 where the config has no jetrl:
        "a fix adding a key the config lacks is printed without '+'",
        "nemo_jetrl/config/load.py",
        "    return f\"{'' if has_key(key) else '+'}{key}={value}\"",
        '    return f"{key}={value}"',
        ("tests/commands/test_check_fix_overrides.py",),
    ),
    Mutant(  # review, session 41: grpo={max_num_steps: 2} dropped grpo's other keys
        "a mapping override replaces its section instead of merging",
        "nemo_jetrl/config/load.py",
        "        merge = isinstance(value, dict) and isinstance(node, DictConfig)",
        "        merge = False",
        ("tests/config/test_override_mappings.py",),
    ),
    Mutant(  # review, session 41: an unwritable warm-start cache crashed after training
        "a failed warm-start cache write raises",
        "nemo_jetrl/backends/local/warmstart.py",
        "            unwritable = (str(exc), False)",
        "            raise",
        ("tests/backends/test_local_warmstart_cache.py",),
    ),
    Mutant(  # user walk: check's Qwen3.5 list fix was refused by check itself
        "the list fix keeps part of Megatron's fused in_proj",
        "nemo_jetrl/config/layer_lists.py",
        "    return whole_in_proj_words(arch, recipe.bf16_layer_kws())",
        "    return recipe.bf16_layer_kws()",
        ("tests/commands/test_check_fix_overrides.py",),
    ),
    Mutant(  # user walk: --kv was silently ignored beside --recipe
        "align takes --kv and --recipe together",
        "nemo_jetrl/commands/align.py",
        "    if args.recipe and args.kv:",
        "    if False:",
        ("tests/commands/test_cli_check.py",),
    ),
    Mutant(  # user walk: a --metric no run has was a 'missing' row, exit 0
        "compare accepts a named metric no run has",
        "nemo_jetrl/commands/compare.py",
        "        if named and absent:",
        "        if False:",
        T_COMPARE,
    ),
    Mutant(  # user walk: the README's tmpe was no metric name
        "compare does not know tmpe",
        "nemo_jetrl/runs/report.py",
        '    "tmpe": "train/token_mult_prob_error",\n',
        "",
        T_COMPARE,
    ),
    Mutant(  # user walk: 15 warnings before the error for a directory that is no run
        "compare reads a directory that is no run",
        "nemo_jetrl/commands/compare.py",
        "    if any(p.is_file() for p in run_dir.rglob(EVENTS_GLOB)) or train_data_files(run_dir):",
        "    if True:",
        T_COMPARE,
    ),
    Mutant(  # user walk: `jetrl check ... | head -1`: a traceback and exit 1 (off-policy's code)
        "a closed stdout pipe raises out of the CLI",
        "nemo_jetrl/cli.py",
        "        return EXIT_BROKEN_PIPE",
        "        raise",
        ("tests/commands/test_cli_broken_pipe.py",),
    ),
    Mutant(  # session 38: NeMo-Gym's prefetch configs (only env:) were called ON-POLICY
        "a file with no grpo:, policy: or jetrl: gets a verdict",
        "nemo_jetrl/config/run_keys.py",
        '    if "policy" not in cfg and "jetrl" not in cfg and any(k in RUN_SECTIONS for k in cfg):',
        "    if False:",
        ("tests/commands/test_check_not_grpo.py",),
    ),
    Mutant(  # session 38: align wrote a training BF16 list beside fp8_param=true (refused)
        "align keeps FP8 primary weights beside the training BF16 list it writes",
        "nemo_jetrl/commands/align.py",
        "    if target.train.fp8_param and target.train.bf16_layer_kws:  # check_layer_lists' rule",
        "    if False:",
        ("tests/commands/test_align_mirrors_bf16_list.py",),
    ),
    Mutant(  # session 38: `set jetrl.allow_off_policy=true` exits 2 on a config without jetrl:
        "the allow-off-policy override is printed without '+' where the config lacks it",
        "nemo_jetrl/flow/pipeline.py",
        '    allow = setting_override(key_presence(checked.cfg), "jetrl.allow_off_policy", "true")',
        '    allow = "jetrl.allow_off_policy=true"',
        ("tests/flow/test_single_controller_lag.py",),
    ),
    Mutant(  # session 39 review: -o a shared parent overwrote it (with --as-child: a cycle)
        "align writes over a file of the input's defaults: chain",
        "nemo_jetrl/commands/align.py",
        "    if target in chain:",
        "    if False:",
        ("tests/commands/test_align_output.py",),
    ),
    Mutant(  # NeMo-RL resumed the earlier rehearsal's checkpoint and ran no step: "NOT ready"
        "rehearse runs in a workdir holding an earlier rehearsal's checkpoints",
        "nemo_jetrl/backends/nemo_rl/rehearsal/workdir.py",
        "    if steps:",
        "    if False:",
        ("tests/commands/test_rehearse_workdir.py",),
    ),
    Mutant(  # session 39 review: grpo.max_num_step=2 passed and the run took 16 steps
        "a typo of a NeMo-RL key we read passes without a word",
        "nemo_jetrl/config/typed.py",
        '        if near and model.model_config.get("extra") == "allow":',
        "        if False:",
        ("tests/config/test_key_typos.py",),
    ),
    Mutant(  # session 39 review: --study length deleted a user's checkpoints under OUT/runs
        "the demo replaces a run directory no demo made",
        "nemo_jetrl/commands/_demo_runs.py",
        "            if d.is_dir() and not (d / DEMO_MARK).exists() and any(d.iterdir()):",
        "            if False:",
        ("tests/commands/test_demo_guard.py::test_refuses_what_no_demo_made_where_a_run_goes",),
    ),
]
