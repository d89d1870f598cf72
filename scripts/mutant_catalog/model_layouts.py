"""The mutants of where Megatron's training blocks are not the rollout's (a review of the
training side against megatron-core 0.16.1 and TE, session 38): the rule (`megatron/blocks.py`)
and the NeMo-RL verdict that reads it before launch (`flow/megatron_layout.py`)."""

from __future__ import annotations

from mutation_check import Mutant

MUTANTS = [
    Mutant(  # head_dim 64: a 128-row block of the fused linear_qkv holds a group's K and V
        "the fused linear_qkv's head dim is not checked against the block size",
        "nemo_jetrl/megatron/blocks.py",
        "        if hd % BLOCK:",
        "        if False:",
        ("tests/megatron/test_megatron_blocks.py", "tests/flow/test_megatron_layout.py"),
    ),
    Mutant(  # Llama-3.2-1B and Qwen3-4B at TP 8 were ON-POLICY on NeMo-RL
        "the NeMo-RL verdict ignores Megatron's block grid",
        "nemo_jetrl/flow/backend.py",
        "    blocks = megatron_block_problem(arch, settings, recipe)",
        "    blocks = None",
        ("tests/flow/test_megatron_layout.py",),
    ),
    Mutant(  # the verdict read TP 1 whatever the config said
        "the NeMo-RL verdict reads no tensor-parallel size",
        "nemo_jetrl/flow/megatron_layout.py",
        "    fields = transformer_fields(arch, settings.megatron_tp, settings.megatron_etp)",
        "    fields = transformer_fields(arch)",
        ("tests/flow/test_megatron_layout.py",),
    ),
    Mutant(  # align wrote an FP8 qkv for a head_dim 64 model: off-policy on NeMo-RL
        "align adds no word for linears whose training blocks are not the rollout's",
        "nemo_jetrl/commands/align.py",
        "    if layout_words:  # Megatron's training blocks of these are not the rollout's",
        "    if False:",
        ("tests/flow/test_megatron_layout.py",),
    ),
]
