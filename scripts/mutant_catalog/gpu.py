"""The GPU paths' mutants (issue 48 and after): literals of measured facts, the invariant
kernels, the split-K GEMM, the grouped GEMM's schedule, the sm_90 census and its cache."""

from __future__ import annotations

from mutation_check import Mutant

# ---- issue 48: measured facts stated as literals in their tests (point 7), and the invariant
# kernels' checks keep their power to fail under the interpreter (point 6)
T_INV = "tests/invariant/test_invariant_kernels.py::"
T_SERVE_BITS = "tests/vllm_patch/test_serving_bits.py::"
MUTANTS = [
    Mutant(
        "FP32-scale serving batches padded to 4 rows (cuBLASLt gave other bits below 32)",
        "nemo_jetrl/fp8/gemm_layouts.py",
        "FP32_SCALE_ROW_MULTIPLE = 32\n",
        "FP32_SCALE_ROW_MULTIPLE = 4\n",
        (
            T_SERVE_BITS + "test_a_tokens_row_is_the_same_at_every_batch_size_and_equals_the"
            "_trainers[scaled_mm-fp32_scales]",
        ),
    ),
    Mutant(
        "cuBLASLt's batches off its row multiple run on Triton again (another kernel's row bits)",
        "nemo_jetrl/fp8/gemm_backends.py",
        "if m % rows and shape_problem(",
        "if False and shape_problem(",
        (
            "tests/fp8/test_fp8_gemm_backends.py::test_cublaslt_gets_padded_rows_and_a_shape_it_refuses"
            "_runs_on_triton",
        ),
    ),
    Mutant(
        "vLLM's QuantFP8 scale floor emulated as 1 / (448 * 256)",
        "nemo_jetrl/fp8/vllm_native.py",
        "SCALE_FLOOR = 1.0 / (E4M3.fmax * 512.0)",
        "SCALE_FLOOR = 1.0 / (E4M3.fmax * 256.0)",
        ("tests/vllm_patch/test_fp8_vllm_native.py::test_group_native_floor_and_nd_input",),
    ),
    Mutant(
        "refit snapshot leaves 1 GiB free on the GPU instead of 2",
        "nemo_jetrl/vllm_patch/rollback.py",
        "RESERVE_BYTES = 2 << 30\n",
        "RESERVE_BYTES = 1 << 30\n",
        (
            "tests/vllm_patch/test_rollback_unit.py::"
            "test_snapshot_stays_on_the_gpu_only_when_it_leaves_the_reserve_free",
        ),
    ),
    Mutant(
        "Megatron export leaves down_proj BF16",
        "nemo_jetrl/megatron/export.py",
        '    "mlp.up_proj.weight",\n    "mlp.down_proj.weight",\n)',
        '    "mlp.up_proj.weight",\n)',
        (
            "tests/megatron/test_megatron_export.py::"
            "test_fp8_export_matches_quantizer_on_unfused_weights",
        ),
    ),
    Mutant(
        "FP8 GEMM bound loosened to 2**-4",
        "nemo_jetrl/fp8/dispatch.py",
        'GEMM_TOLERANCE = {"REL": 2.0**-7, "OUT": 2.0**-8}',
        'GEMM_TOLERANCE = {"REL": 2.0**-4, "OUT": 2.0**-8}',
        ("tests/fp8/test_fp8_dispatch.py::test_the_gemm_bound_is_the_stated_one",),
    ),
    Mutant(
        "invariant RMS rstd: fewer lanes for batches under 8 rows",
        "nemo_jetrl/invariant/kernels/rows.py",
        "launch(_jit().rms_rstd_kernel, (x2.shape[0],), args, _meta(block, x.dtype))",
        "launch(_jit().rms_rstd_kernel, (x2.shape[0],), args,\n"
        "               _meta(block if x2.shape[0] >= 8 else 64, x.dtype))",
        (T_INV + "test_rms_rstd_same_bits_at_every_batch_size_and_within_2ulp_of_float64",),
    ),
    Mutant(
        "invariant log-sum-exp: fewer lanes for batches under 8 rows",
        "nemo_jetrl/invariant/kernels/rows.py",
        "launch(_jit().logsumexp_kernel, (n,), args, _meta(block, x.dtype))",
        "launch(_jit().logsumexp_kernel, (n,), args, _meta(block if n >= 8 else 128, x.dtype))",
        (T_INV + "test_log_softmax_same_bits_at_every_batch_size_and_close_to_float64",),
    ),
    Mutant(
        "invariant matmul: shorter K steps for batches under 8 rows",
        "nemo_jetrl/invariant/kernels/matmul.py",
        "meta = _meta(block_m, block_n, block_k, ",
        "meta = _meta(block_m, block_n, block_k if m >= 8 else 32, ",
        (T_INV + "test_matmul_same_bits_at_every_batch_size_and_within_gamma_k_of_float64",),
    ),
    Mutant(
        "attention keeps 2 stages where they overflow Hopper's shared memory",
        "nemo_jetrl/invariant/kernels/attention.py",
        "    return ATTN_STAGES if fits else 1\n",
        "    return ATTN_STAGES\n",
        (
            T_INV
            + "test_attention_stages_fit_hoppers_shared_memory_and_decode_equals_prefill_at_them",
        ),
    ),
    Mutant(
        "attention stages sized for bf16 whatever the operand dtype",
        "nemo_jetrl/invariant/kernels/attention.py",
        "attention_stages(d, q.element_size())",
        "attention_stages(d, 2)",
        (T_INV + "test_attention_launches_with_the_rules_stages",),
    ),
    Mutant(
        "a decode step (one query) launches attention at 1 stage: another kernel than the prefill's",
        "nemo_jetrl/invariant/kernels/attention.py",
        "stages = attention_stages(d, q.element_size()) if num_stages is None else num_stages",
        "stages = (attention_stages(d, q.element_size()) if tq > 1 else 1) if num_stages is None else num_stages",
        (T_INV + "test_attention_launches_with_the_rules_stages",),
    ),
    Mutant(
        "attention launches with fp fusion (an fma where the loop's layout puts it, per stage)",
        "nemo_jetrl/invariant/kernels/attention.py",
        "num_warps=ATTN_WARPS, num_stages=stages, **NO_FTZ, **NO_FMA)",
        "num_warps=ATTN_WARPS, num_stages=stages, **NO_FTZ)",
        (T_INV + "test_attention_launches_with_the_rules_stages",),
    ),
]

# ---- issue 48 point 3: the grouped GEMM's device-made tile schedule
MUTANTS += [
    Mutant(
        "grouped rows GEMM: a tile at an expert's first tile index is given to the expert before",
        "nemo_jetrl/fp8/_triton_grouped_gemm_jit.py",
        "e = tl.sum((ends <= t).to(tl.int32), axis=0)",
        "e = tl.sum((ends < t).to(tl.int32), axis=0)",
        ("tests/fp8/test_fp8_experts_prefill.py::test_every_tile_shape_gives_the_reference_bits",),
    ),
]

# ---- the sm_90 census (scripts/sm90_census.py): a tile chosen from the batch size on a GPU path
MUTANTS += [
    Mutant(
        "invariant matmul takes 16-row tiles below 16 rows (another MMA, other bits, on a GPU)",
        "nemo_jetrl/invariant/kernels/matmul.py",
        "meta = _meta(block_m, block_n, block_k, ",
        "meta = _meta(16 if m < 16 else block_m, block_n, block_k, ",
        (
            "tests/test_sm90_census.py::test_every_kernel_compiles_for_sm90_with_no_problem[installed]",
        ),
    ),
    Mutant(
        "split-K prefill tile of 128 tokens (255 registers, spills: the census's register check)",
        "nemo_jetrl/fp8/triton_split.py",
        "PREFILL_TOKEN_TILE = 64\n",
        "PREFILL_TOKEN_TILE = 128\n",
        (
            "tests/test_sm90_census.py::test_every_kernel_compiles_for_sm90_with_no_problem[installed]",
        ),
    ),
    Mutant(
        "invariant matmul specialised on M again (M == 1, M % 16: decode and prefill on two binaries)",
        "nemo_jetrl/invariant/kernels/_jit_matmul.py",
        "@triton.jit(do_not_specialize=BATCH_ARGS)",
        "@triton.jit",
        (
            "tests/test_sm90_census.py::test_every_kernel_compiles_for_sm90_with_no_problem[installed]",
        ),
    ),
    Mutant(
        "MoE WGrad loses the 16-aligned token offsets (byte loads, 255 registers, spills)",
        "nemo_jetrl/fp8/_triton_grouped_jit.py",
        "t0 = tl.multiple_of(tl.load(off_ptr + e), ALIGN)",
        "t0 = tl.load(off_ptr + e)",
        (
            "tests/test_sm90_census.py::test_every_kernel_compiles_for_sm90_with_no_problem[installed]",
        ),
    ),
    Mutant(
        "MoE WGrad token quantizer loses its 16-aligned code column (codes stored a byte at a time)",
        "nemo_jetrl/fp8/_triton_grouped_jit.py",
        "t0 = tl.multiple_of(tl.load(poff_ptr + e), ALIGN) + ",
        "t0 = tl.load(poff_ptr + e) + ",
        (
            "tests/test_sm90_census.py::test_every_kernel_compiles_for_sm90_with_no_problem[installed]",
        ),
    ),
    Mutant(
        "invariant matmul multiplies fp32 rows on TF32 at M = 1 (the interpreter has no TF32)",
        "nemo_jetrl/invariant/kernels/matmul.py",
        "block_k, a2.dtype == torch.float32, interpreting()",
        "block_k, a2.dtype == torch.float32 and m > 1, interpreting()",
        (
            "tests/test_sm90_census.py::test_every_kernel_compiles_for_sm90_with_no_problem[installed]",
        ),
    ),
]

# ---- the census cache a GPU call carries (scripts/census_cache.py) and its test workers
MUTANTS += [
    Mutant(
        "re-keying keeps the packed folder names (Triton looks under the image's key: every miss)",
        "scripts/census_cache.py",
        'new = dir_name(key + made["tails"][folder])',
        "new = folder",
        (
            "tests/test_census_cache.py::test_another_build_of_libtriton_is_re_keyed_where_triton_looks",
        ),
    ),
    Mutant(
        "re-keying accepts a Triton whose Python sources differ (another compiler, same name)",
        "scripts/census_cache.py",
        'if key.replace(here_sha, made["libtriton_sha256"]) != made["triton_key"]:',
        'if key.replace(here_sha, made["libtriton_sha256"]) == "":',
        (
            "tests/test_census_cache.py::test_what_differs_is_named_and_nothing_is_unpacked[python-source]",
        ),
    ),
    Mutant(
        "gpu_check starts more xdist workers than modules (idle processes each holding a CUDA context)",
        "scripts/gpu_check.sh",
        "((workers <= ${#tests[@]})) || workers=${#tests[@]}",
        "true",
        (
            "tests/test_gpu_session_dry_run.py::test_gpu_check_spreads_the_modules_over_xdist_workers[at-most-one-a-module]",
        ),
    ),
]

# ---- the fused rowcol quantizer's launches (row chunks, persistent grids): every tile's bits
T_ROWCOL = (
    "tests/fp8/test_quantizer_rowcol.py::test_every_rowcol_launch_gives_every_tile_the_same_bits"
)
MUTANTS += [
    Mutant(
        "rowcol in row chunks: the column amax is the last chunk's, not the max over chunks",
        "nemo_jetrl/fp8/_triton_jit.py",
        "amax = tl.maximum(amax, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0))",
        "amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)",
        (T_ROWCOL,),
    ),
    Mutant(
        "persistent rowcol: a program steps one tile at a time (tiles past the grid are rerun, "
        "some never reached)",
        "nemo_jetrl/fp8/_triton_jit.py",
        "for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):",
        "for t in tl.range(tl.program_id(0), tl.num_programs(0)):",
        (T_ROWCOL,),
    ),
]

# ---- the 128x1 quantizer in row chunks (`_triton_jit._quantize_cols`)
MUTANTS += [
    Mutant(
        "128x1 in row chunks: the column amax is the last chunk's, not the max over chunks",
        "nemo_jetrl/fp8/_triton_jit.py",
        "amax = tl.maximum(amax, tl.max(abits, axis=0))",
        "amax = tl.max(abits, axis=0)",
        ("tests/fp8/test_triton_kernels.py::test_128x1_tiles_give_the_same_bits",),
    ),
]

# ---- the training linear's rowcol mode (two passes measured faster, `linear_plan.ROWCOL_DEFAULT`)
# and the MN-major scale buffer a quantizer pass fills whole at M % 4 == 0 (no fill kernel)
MUTANTS += [
    Mutant(
        "the training linear's rowcol default back to the fused kernel (measured slower on GPUs)",
        "nemo_jetrl/fp8/linear_plan.py",
        'ROWCOL_DEFAULT = "two_pass"\n',
        'ROWCOL_DEFAULT = "fused"\n',
        (
            "tests/fp8/test_fp8_linear_plan.py::test_two_pass_rowcol_gives_the_fused_kernels_step"
            "_bits[compact]",
        ),
    ),
    Mutant(
        "MN-major scale buffers zero-filled at M % 4 == 0 too (a fill kernel per quantization)",
        "nemo_jetrl/fp8/triton_kernels.py",
        "alloc = torch.empty if kernel_pads or pad == mb else torch.zeros",
        "alloc = torch.empty if kernel_pads else torch.zeros",
        (
            "tests/fp8/test_linear_host_budget.py::test_one_forward_and_backward_stay_within_the"
            "_host_budget[two_pass]",
        ),
    ),
    Mutant(
        "MN-major scale buffers never zero-filled (the padding rows hold garbage at M % 4 != 0)",
        "nemo_jetrl/fp8/triton_kernels.py",
        "alloc = torch.empty if kernel_pads or pad == mb else torch.zeros",
        "alloc = torch.empty",
        ("tests/fp8/test_fp8_golden_tails.py::test_triton_kernel_bit_exact",),
    ),
]

# ---- the census's ptxas answers kept by whole files from its thread pool
MUTANTS += [
    Mutant(
        "ptxas answers written through one temporary name per process (threads collide)",
        "scripts/sm90_ptx.py",
        'tmp = kept.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")',
        'tmp = kept.with_suffix(f".{os.getpid()}.tmp")',
        ("tests/test_sm90_ptx.py::test_ptxas_usage_of_one_text_on_many_threads_at_once",),
    ),
    Mutant(
        "128x1 column tiles (whole and packed): rows past M load as a huge value (the amax)",
        "nemo_jetrl/fp8/_triton_jit.py",
        "mask=mask, other=0.0)\n    q, sinv = quantize_blocks(to_fp32(x, IN_BF16), COLS",
        "mask=mask, other=32512)\n    q, sinv = quantize_blocks(to_fp32(x, IN_BF16), COLS",
        ("tests/fp8/test_triton_kernels.py::test_128x1_tiles_give_the_same_bits",),
    ),
    Mutant(
        "128x1 packed words: the four tokens' bytes in reverse order",
        "nemo_jetrl/fp8/_triton_jit.py",
        "words = tl.sum(q4 << (tl.arange(0, 4) * 8)[None, :, None, None], axis=1)",
        "words = tl.sum(q4 << ((3 - tl.arange(0, 4)) * 8)[None, :, None, None], axis=1)",
        ("tests/fp8/test_triton_kernels.py::test_128x1_tiles_give_the_same_bits",),
    ),
    Mutant(
        "128x1 packed words: tile row i read as token i (the words hold tokens 16 apart)",
        "nemo_jetrl/fp8/_triton_jit.py",
        "rows = pid_m.to(tl.int64) * TM + 4 * (i % 16) + (i // 16) % 4 + 64 * (i // 64)",
        "rows = pid_m.to(tl.int64) * TM + i",
        ("tests/fp8/test_triton_kernels.py::test_128x1_tiles_give_the_same_bits",),
    ),
]
