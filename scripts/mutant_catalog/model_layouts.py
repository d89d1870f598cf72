"""The mutants of where Megatron's training blocks are not the rollout's (a review of the
training side against megatron-core 0.16.1 and TE, session 38): the rule (`megatron/blocks.py`)
and the NeMo-RL verdict that reads it before launch (`flow/megatron_layout.py`)."""

from __future__ import annotations

from mutation_check import Mutant

MUTANTS = [
    Mutant(  # head_dim 64: a 128-row block of the fused linear_qkv holds a group's K and V
        "the fused linear_qkv's head dim is not checked against the block size",
        "nemo_jetrl/megatron/blocks.py",
        "    if hd % BLOCK:\n        layout",
        "    if False:\n        layout",
        ("tests/megatron/test_megatron_blocks.py", "tests/flow/test_megatron_layout.py"),
    ),
    Mutant(  # Llama-3.2-1B and Qwen3-4B at TP 8 were ON-POLICY on NeMo-RL
        "the NeMo-RL verdict ignores Megatron's block grid",
        "nemo_jetrl/flow/backend.py",
        "    blocks = megatron_block_problem(shape, settings, recipe) or vllm_block_problem(",
        "    blocks = vllm_block_problem(",
        ("tests/flow/test_megatron_layout.py",),
    ),
    Mutant(  # the verdict read TP 1 whatever the config said
        "the NeMo-RL verdict reads no tensor-parallel size",
        "nemo_jetrl/flow/megatron_layout.py",
        "    return transformer_fields(arch, settings.megatron_tp, settings.megatron_etp)",
        "    return transformer_fields(arch)",
        ("tests/flow/test_megatron_layout.py",),
    ),
    Mutant(  # align wrote an FP8 qkv for a head_dim 64 model: off-policy on NeMo-RL
        "align adds no word for linears whose training blocks are not the rollout's",
        "nemo_jetrl/commands/align.py",
        "    if layout_words:  # Megatron's training blocks of these are not the rollout's",
        "    if False:",
        ("tests/flow/test_megatron_layout.py",),
    ),
    Mutant(  # diff review: a dense MLP kept BF16 in its only (dense) layers was still called off
        "the dense MLP is judged over MoE layers too",
        "nemo_jetrl/megatron/blocks.py",
        "    dense_layers = [i for i in layers if i not in moe]",
        "    dense_layers = layers",
        ("tests/megatron/test_megatron_blocks.py",),
    ),
    Mutant(  # the README's local config was called OFF-POLICY by the cluster layout rules
        "the local backend's own model is judged by the cluster layouts",
        "nemo_jetrl/flow/backend.py",
        "    shape = None if _local_model(settings) else arch",
        "    shape = arch",
        ("tests/flow/test_megatron_layout.py",),
    ),
    Mutant(  # vLLM TP 8 on Qwen3-4B was ON-POLICY (vLLM refuses the engine)
        "the NeMo-RL verdict ignores vLLM's tensor-parallel split",
        "nemo_jetrl/flow/vllm_layout.py",
        "    if all(p % BLOCK == 0 for p in parts):",
        "    if True:",
        ("tests/flow/test_vllm_layout.py", "tests/flow/test_megatron_layout.py"),
    ),
    Mutant(  # session 39: Qwen3.5's FP8 in_proj was ON-POLICY on NeMo-RL (b and a share a block)
        "jetrl check does not say which HF split a hybrid model's in_proj is",
        "nemo_jetrl/flow/megatron_layout.py",
        "        f[HF_SPLIT_FIELD] = hybrid.split_proj",
        "        f[HF_SPLIT_FIELD] = None",
        ("tests/flow/test_megatron_layout_hybrid.py",),
    ),
    Mutant(
        "an in_proj judged under a split the config does not name",
        "nemo_jetrl/megatron/blocks_hybrid.py",
        "    if any(c is None for c in cuts.values()):",
        "    if all(c is None for c in cuts.values()):",
        ("tests/megatron/test_megatron_blocks_hybrid.py",),
    ),
    Mutant(
        "a training block of one HF weight's rows counts as the rollout's wherever it starts",
        "nemo_jetrl/megatron/blocks_hybrid.py",
        "            if idx == block:",
        "            if set(idx) <= set(range(lo, lo + BLOCK)):",
        ("tests/megatron/test_megatron_blocks_hybrid.py",),
    ),
    Mutant(  # session 46: the policy worker judged in_proj only where both HF splits agree
        "the launch does not tell the policy workers the model's HF in_proj split",
        "nemo_jetrl/backends/nemo_rl/launch.py",
        "    split = None if hybrid is None else hybrid.split_proj",
        "    split = None",
        ("tests/backends/test_nemo_rl_policy_env.py",),
    ),
    Mutant(
        "the policy worker judges its built model without the HF split it was told",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        "                why = block_layout_problem(with_hf_split(config, split), recipe.train)",
        "                why = block_layout_problem(config, recipe.train)",
        ("tests/backends/test_nemo_rl_worker_checks.py",),
        env="nemo_rl",
    ),
    Mutant(  # session 47: a Nemotron-H config.json was read as attention + MoE in every layer
        "a config.json with state-space layers is read as a transformer",
        "nemo_jetrl/arch/model.py",
        "        refuse_state_space(config, label)  # one mixer per layer: no transformer reading fits",
        "        pass",
        ("tests/arch/test_arch_state_space.py",),
    ),
    Mutant(  # session 47: an FP8 Nemotron Nano v2 got a generic ON-POLICY verdict before launch
        "FP8 on a model with state-space layers is not refused",
        "nemo_jetrl/flow/support.py",
        "    ssm = state_space_model(settings, arch)\n",
        "    ssm = None\n",
        ("tests/arch/test_arch_state_space.py",),
    ),
    Mutant(  # session 47: from_json re-raised StateSpaceArch as a plain ArchError (an error in BF16)
        "from_json loses the state-space kind of an error",
        "nemo_jetrl/arch/model.py",
        "            kind = type(exc) if isinstance(exc, ArchError) else ArchError",
        "            kind = ArchError",
        ("tests/arch/test_arch_state_space.py",),
    ),
    Mutant(  # session 47: the refusal came with a note asking for the config.json that cannot help
        "a state-space name is noted as an unknown model to describe",
        "nemo_jetrl/config/validate.py",
        "        if read or name_is_state_space(name):",
        "        if read:",
        ("tests/arch/test_arch_state_space.py",),
    ),
    Mutant(  # session 47: a checkpoint directory as policy.model_name was not read for Mamba keys
        "a model directory's config.json is no state-space evidence",
        "nemo_jetrl/flow/support.py",
        "        if path is None or not Path(path).is_file():",
        "        if True:",
        ("tests/arch/test_arch_state_space.py",),
    ),
    Mutant(  # session 47: phi3/starcoder2 config.json files were read as Llama, silently
        "an FP8 check of a model type never compared with transformers says nothing",
        "nemo_jetrl/flow/pipeline.py",
        "    if unread and (recipe.train.fp8_linears or recipe.rollout.fp8_linears or recipe.kv_fp8):",
        "    if False:",
        ("tests/arch/test_arch_compared_types.py",),
    ),
    Mutant(  # session 47: the list of compared types is itself compared
        "a model type whose layers read wrong is listed as compared",
        "nemo_jetrl/arch/model.py",
        '        *("granite", "qwen2_moe",',
        '        *("granite", "phi3", "qwen2_moe",',
        ("tests/arch/test_arch_compared_types.py",),
    ),
    Mutant(  # session 47: a BF16 Nemotron rehearsal asked for the config.json arch refuses
        "the rehearsal sends a Mamba model for a config.json",
        "nemo_jetrl/backends/nemo_rl/rehearsal/families.py",
        "    if state_space:  # a config.json would not help: `arch` refuses to read it",
        "    if False:",
        ("tests/backends/test_rehearsal_unit.py",),
    ),
    Mutant(  # session 47: a qwen3_moe config.json with the key got shared experts it has not
        "Qwen3-MoE reads a shared expert transformers does not build",
        "nemo_jetrl/arch/moe.py",
        '        if model_type != "qwen3_moe":  # transformers\' Qwen3-MoE builds none, whatever the key',
        "        if True:",
        ("tests/arch/test_arch_compared_types.py",),
    ),
]
