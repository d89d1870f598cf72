"""Mutants of the ``triton_splitk`` GEMM (`triton_split`, `_triton_split_jit`): its fixed order,
fused quantizer, MMA instruction, one-launch fold and launch variants (TMA, L2 prefetch,
programmatic dependent launch)."""

from __future__ import annotations

from mutation_check import Mutant

# ---- issue 48 point 2: the split-K GEMM's fixed order, fused quantizer and MMA instruction
T_SPLIT = "tests/fp8/test_split_gemm.py::"
T_SPLIT_SM90 = "tests/fp8/test_split_gemm_sm90.py::"
MUTANTS = [
    Mutant(
        "split-K fold in registers skips the second chunk",
        "nemo_jetrl/fp8/_triton_split_jit.py",
        "        for c in range(1, S):\n            total +=",
        "        for c in range(2, S):\n            total +=",
        (T_SPLIT + "test_both_modes_give_the_references_bits_and_each_row_is_batch_invariant",),
    ),
    Mutant(
        "split-K tile step scales once by sa * sb (not TE's p * sa, then sb)",
        "nemo_jetrl/fp8/_triton_split_jit.py",
        "acc = tl.fma(p * sa[None, :], sb[:, None], acc)",
        "acc = tl.fma(p, sa[None, :] * sb[:, None], acc)",
        (T_SPLIT + "test_both_modes_give_the_references_bits_and_each_row_is_batch_invariant",),
    ),
    Mutant(
        "split-K fused quantizer always rounds scales to powers of two",
        "nemo_jetrl/fp8/triton_split.py",
        '("POW2", bool(pow2))',
        '("POW2", True)',
        (T_SPLIT + "test_fused_quantization_gives_the_quantizers_codes",),
    ),
    Mutant(
        "split-K weight tiles of 16 rows (mma.sync, which rounds unlike wgmma on Hopper)",
        "nemo_jetrl/fp8/triton_split.py",
        "WEIGHT_ROWS = 64\n",
        "WEIGHT_ROWS = 16\n",
        (
            T_SPLIT_SM90
            + "test_every_mode_compiles_for_sm90_to_one_wgmma_family_with_pipelined_loads",
        ),
    ),
    Mutant(
        "split-K weight passed as uint8 codes on the tensor-core path (A operand via registers)",
        "nemo_jetrl/fp8/triton_split.py",
        "qb, sb = (b.data if native else b.data.view(torch.uint8)), b.scale_inv",
        "qb, sb = b.data.view(torch.uint8), b.scale_inv",
        (
            T_SPLIT_SM90
            + "test_every_mode_compiles_for_sm90_to_one_wgmma_family_with_pipelined_loads",
        ),
    ),
    Mutant(
        "FP8 GEMMs on tensor cores run one pipeline stage (no cp.async: every load waited on)",
        "nemo_jetrl/fp8/triton_gemm.py",
        "return 3 if native else 1",
        "return 1",
        (
            T_SPLIT_SM90
            + "test_every_mode_compiles_for_sm90_to_one_wgmma_family_with_pipelined_loads",
        ),
    ),
]

# ---- the split-K GEMM's one-launch fold (nemo_jetrl/fp8/_triton_split_jit.py: _fold_last). Which
# program folds is not judged here: the interpreter runs a tile's programs in chunk order, so a
# fold by the first to arrive (then reset) still ends on all partials; the GPU tests judge it.
MUTANTS += [
    Mutant(
        "split-K: the folding program leaves its counter at S (the next call never folds)",
        "nemo_jetrl/fp8/_triton_split_jit.py",
        'tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")',
        'tl.atomic_xchg(cnt_ptr + tile, S, sem="relaxed", scope="gpu")',
        (
            "tests/fp8/test_split_gemm.py::test_split_mode_is_one_launch_whose_last_program_folds_and_rezeroes_its_counter",
        ),
    ),
]

# ---- the split-K kernel's TMA weight loads (`triton_split.SPLIT_TMA`)
MUTANTS += [
    Mutant(
        "split-K TMA weight block read at 64-row steps whatever the program's rows (prefill: 128)",
        "nemo_jetrl/fp8/_triton_split_jit.py",
        "w = b_ptr.load([tl.program_id(0) * BW, t * 128])",
        "w = b_ptr.load([tl.program_id(0) * 64, t * 128])",
        ("tests/fp8/test_split_gemm.py::test_weight_through_a_tma_descriptor_gives_the_same_bits",),
    ),
]

# ---- the split-K kernel's L2 prefetch variant (`triton_split.SPLIT_PREFETCH`), compiled for sm_90
MUTANTS += [
    Mutant(
        "split-K L2 prefetch also in the fold-in-registers mode (prefill; a decode variant)",
        "nemo_jetrl/fp8/triton_split.py",
        "prefetch = SPLIT_PREFETCH and plan.split and native",
        "prefetch = SPLIT_PREFETCH and native",
        (
            T_SPLIT_SM90
            + "test_every_mode_compiles_for_sm90_to_one_wgmma_family_with_pipelined_loads",
        ),
    ),
    Mutant(
        "split-K L2 prefetch never reaches the kernel (the variant a no-op)",
        "nemo_jetrl/fp8/triton_split.py",
        "TMA_W=tma, PREFETCH=prefetch,",
        "TMA_W=tma, PREFETCH=False,",
        (
            T_SPLIT_SM90
            + "test_every_mode_compiles_for_sm90_to_one_wgmma_family_with_pipelined_loads",
        ),
    ),
    Mutant(
        # (a mutant of _triton_split_jit itself is killed only by the subprocess compile test,
        # which the harness cannot attribute: the host's flag stands in for the kernel's wait)
        "split-K launched as a dependent launch by a kernel without its wait (reads outputs early)",
        "nemo_jetrl/fp8/triton_split.py",
        "PREFETCH=prefetch, PDL=pdl,",
        "PREFETCH=prefetch, PDL=False,",
        (
            T_SPLIT_SM90
            + "test_every_mode_compiles_for_sm90_to_one_wgmma_family_with_pipelined_loads",
        ),
    ),
    Mutant(
        "split-K dependent-launch variant never launched as one (the variant a no-op)",
        "nemo_jetrl/fp8/triton_split.py",
        '**({"launch_pdl": True} if pdl else {}),',
        "",
        (
            T_SPLIT_SM90
            + "test_every_mode_compiles_for_sm90_to_one_wgmma_family_with_pipelined_loads",
        ),
    ),
    Mutant(
        "split-K dependent launch taken on a GPU before sm_90 (griddepcontrol cannot run)",
        "nemo_jetrl/fp8/triton_split.py",
        "    if not _pdl_capable(device) or _kernel().gdc_wait is None:",
        "    if _kernel().gdc_wait is None:",
        (T_SPLIT + "test_dependent_launches_are_refused_where_they_cannot_run",),
    ),
    Mutant(
        "split-K decode programs keep one warpgroup whatever DECODE_WARPGROUPS says",
        "nemo_jetrl/fp8/triton_split.py",
        "warpgroups = DECODE_WARPGROUPS if m <= SPLIT_MAX_M else PREFILL_WARPGROUPS",
        "warpgroups = 1 if m <= SPLIT_MAX_M else PREFILL_WARPGROUPS",
        (T_SPLIT + "test_two_warpgroups_at_the_decode_sizes_give_the_same_bits",),
    ),
]
