"""Issue 41's audit: MoE, refit and production-size code (expert sharding, non-finite flags,
refit rollback, verdict keys, the local MoE backend, staging, support, correction)."""

from __future__ import annotations

from mutation_check import Mutant

from mutant_catalog.paths import RL

# ---- issue 41: audit of the MoE, refit and production-size code (expert sharding, non-finite
# flags, refit rollback, verdict keys, local MoE backend, staging, support, correction). Each is
# judged by the one test that kills it (existing where one does; the new edge tests where none
# did), .venv only, so the 33 add ~6 s each (pytest start-up dominates).
VP = "nemo_jetrl/vllm_patch/"
T_SHARD_EDGES = "tests/vllm_patch/test_expert_shards_edges.py::"
T_SHARD_UNIT = "tests/vllm_patch/test_expert_shards_unit.py::"
T_FLAG_EDGES = "tests/fp8/test_finite_flags_edges.py::"
T_SNAP = "tests/vllm_patch/test_rollback_snapshot.py::"
T_KEYS = "tests/flow/test_verdict_keys.py::"
T_SPLIT = "tests/flow/test_moe_vllm_split.py::"
T_CORR_EDGES = "tests/rl/test_correction_edges.py::"
T_LMOE = "tests/backends/test_local_moe.py::"
T_ROUTE_EDGES = "tests/backends/test_routing_metric_edges.py::"
T_FAULTS = "tests/test_faults_refit.py::"

MUTANTS = [
    Mutant(
        "EP capture branch: routes held elsewhere keep their router weight",
        VP + "expert_shards.py",
        "return flat.clamp(min=0), token, weight * here",
        "return flat.clamp(min=0), token, weight",
        (T_SHARD_EDGES + "test_capture_branch_keeps_every_route_on_local_expert_0_with_weight_0",),
    ),
    Mutant(
        "EP capture branch: routes held elsewhere keep expert id -1",
        VP + "expert_shards.py",
        "return flat.clamp(min=0), token, weight * here",
        "return flat, token, weight * here",
        (T_SHARD_EDGES + "test_capture_branch_keeps_every_route_on_local_expert_0_with_weight_0",),
    ),
    Mutant(
        "EP: local expert 0 taken for a route held elsewhere",
        VP + "expert_shards.py",
        "    here = flat >= 0\n",
        "    here = flat > 0\n",
        (T_SHARD_UNIT + "test_local_routes_drop_experts_held_elsewhere",),
    ),
    Mutant(
        "EP: local expert id 0 read as held by another rank",
        VP + "expert_shards.py",
        "return local if local >= 0 else None",
        "return local if local > 0 else None",
        (T_SHARD_UNIT + "test_ep_rank_maps_global_ids_and_leaves_out_experts_held_elsewhere",),
    ),
    Mutant(
        "TP shard check reads vLLM's padded intermediate size",
        VP + "expert_shards.py",
        'unpadded = getattr(moe, "intermediate_size_per_partition_unpadded", None) or i_part',
        "unpadded = i_part",
        (T_SHARD_EDGES + "test_padded_intermediate_size_per_rank_is_refused_by_its_unpadded_size",),
    ),
    Mutant(
        "TP shard check also refuses unsplit experts (tp=1)",
        VP + "expert_shards.py",
        "if par.tp_size > 1 and (i_part % WEIGHT_BLOCK[0] or unpadded != i_part):",
        "if par.tp_size >= 1 and (i_part % WEIGHT_BLOCK[0] or unpadded != i_part):",
        (T_SHARD_EDGES + "test_padded_intermediate_size_per_rank_is_refused_by_its_unpadded_size",),
    ),
    Mutant(
        "fused_dtype: expert id E accepted",
        VP + "expert_shards.py",
        "if parts[1] >= (len(m) if m is not None else layer.w13_weight.shape[0]):",
        "if parts[1] > (len(m) if m is not None else layer.w13_weight.shape[0]):",
        (T_SHARD_EDGES + "test_fused_dtype_covers_every_expert_id_and_none_beyond",),
    ),
    Mutant(
        "TP slice of an expert tensor: gate/up split by columns, down by rows",
        VP + "expert_shards.py",
        'dim = 1 if EXPERT_SHARDS[proj][0] == "w2" else 0',
        'dim = 1 if EXPERT_SHARDS[proj][0] == "w13" else 0',
        (T_SHARD_UNIT + "test_tp_rank_resolves_and_expects_its_shard_of_each_expert_tensor",),
    ),
    Mutant(
        "expert tensor name: up_proj rows read at the gate's offset",
        VP + "moe_names.py",
        'return f"{path}.{prefix}_{leaf}", param.data[local], shard * rows, rows',
        'return f"{path}.{prefix}_{leaf}", param.data[local], 0, rows',
        (T_SHARD_EDGES + "test_local_expert_0_is_held_here",),
    ),
    Mutant(
        "vLLM experts kernel: one offset short (last local expert's rows lost)",
        VP + "experts.py",
        "grid = torch.arange(e + 1, device=x.device)",
        "grid = torch.arange(e, device=x.device)",
        (T_SHARD_EDGES + "test_every_serving_branch_gives_the_rank_the_same_bits[0-grouped]",),
    ),
    Mutant(
        "vLLM experts mixed-scale loop stops at the first expert without tokens",
        VP + "experts.py",
        "        if n == 0:\n            continue\n",
        "        if n == 0:\n            break\n",
        (
            T_SHARD_EDGES
            + "test_every_serving_branch_gives_the_rank_the_same_bits[0-mixed-scales-loop]",
        ),
    ),
    Mutant(
        "vLLM experts mixed-scale loop: row start never advances",
        VP + "experts.py",
        "        start += n\n",
        "        start = n\n",
        (
            T_SHARD_EDGES
            + "test_every_serving_branch_gives_the_rank_the_same_bits[0-mixed-scales-loop]",
        ),
    ),
    # ---- non-finite flags
    Mutant(
        "non-finite note overwrites the flag (a later finite record clears it)",
        "nemo_jetrl/fp8/finite_flags.py",
        "flag_t.logical_or_(torch.isnan(scale_inv).any())",
        "flag_t.copy_(torch.isnan(scale_inv).any())",
        (T_FLAG_EDGES + "test_a_later_finite_record_under_the_same_name_keeps_the_flag",),
    ),
    Mutant(
        "non-finite flags not cleared after the read (next step raises again)",
        "nemo_jetrl/fp8/finite_flags.py",
        "torch._foreach_zero_([f for _, f in reuse])",
        "pass",
        (T_FLAG_EDGES + "test_flags_are_cleared_by_the_read_and_reused",),
    ),
    Mutant(
        "per-group flags overwritten instead of accumulated",
        "nemo_jetrl/fp8/finite_flags.py",
        "flag[: bad.numel()].logical_or_(bad)",
        "flag[: bad.numel()].copy_(bad)",
        (T_FLAG_EDGES + "test_group_flags_recorded_twice_accumulate",),
    ),
    Mutant(
        "per-group flag names numbered from 1",
        "nemo_jetrl/fp8/finite_flags.py",
        "bad += [name.format(j) for j, v in enumerate(vals) if v]",
        "bad += [name.format(j) for j, v in enumerate(vals, 1) if v]",
        (T_FLAG_EDGES + "test_names_are_matched_to_their_own_flags_in_one_read",),
    ),
    Mutant(
        "row flags blame the previous expert at an expert's first row",
        "nemo_jetrl/fp8/grouped_tensors.py",
        "return torch.searchsorted(offsets[1:].contiguous(), rows, right=True)",
        "return torch.searchsorted(offsets[1:].contiguous(), rows, right=False)",
        (T_FLAG_EDGES + "test_deferred_input_flag_blames_the_expert_owning_the_row[129-2]",),
    ),
    Mutant(
        "WGrad token-block flags blame the previous expert at a block edge",
        "nemo_jetrl/fp8/experts.py",
        "owner = torch.searchsorted(q.block_offsets[1:].contiguous(), cols, right=True)",
        "owner = torch.searchsorted(q.block_offsets[1:].contiguous(), cols)",
        (T_FLAG_EDGES + "test_deferred_grad_flag_blames_the_expert_owning_the_token_block[129-2]",),
    ),
    # ---- refit rollback
    Mutant(
        "snapshot takes empty tensors (no storage) for the KV cache",
        VP + "rollback.py",
        "        storages.pop(0, None)  # empty tensors have no storage: never match them\n",
        "",
        (
            T_SNAP
            + "test_empty_tensors_listed_beside_the_cache_do_not_hide_the_models_empty_tensors",
        ),
    ),
    Mutant(
        "snapshot recognises the cache by object only, not by storage",
        VP + "rollback.py",
        "return not t.is_meta and t.untyped_storage().data_ptr() in self.storages",
        "return False",
        (
            T_SNAP
            + "test_empty_tensors_listed_beside_the_cache_do_not_hide_the_models_empty_tensors",
        ),
    ),
    # ---- verdict keys
    Mutant(
        "policy-lag verdict drops max_trajectory_age_steps from its keys",
        "nemo_jetrl/flow/limits.py",
        "keys = [ASYNC_KEY, AGE_KEY]",
        "keys = [ASYNC_KEY]",
        (T_KEYS + "test_each_limit_carries_its_keys",),
    ),
    Mutant(
        "an empty quant_cfg counts as ModelOpt quantization",
        "nemo_jetrl/flow/limits.py",
        'return value not in (None, "", False) and not (hasattr(value, "__len__") and len(value) == 0)',
        'return value not in (None, "", False)',
        (T_KEYS + "test_each_limit_carries_its_keys",),
    ),
    Mutant(
        "FP8-rollout-vs-BF16-training mismatch names one key",
        "nemo_jetrl/flow/check.py",
        "            (S.FP8_ENABLED, S.VLLM_PRECISION),\n",
        "            (S.FP8_ENABLED,),\n",
        (T_KEYS + "test_each_mismatch_carries_its_keys",),
    ),
    # ---- flow support (MoE splits), loss_fn correction checks
    Mutant(
        "expert_parallel_size == tensor_parallel_size refused as vLLM data parallel",
        "nemo_jetrl/flow/support.py",
        "    if ep > tp:\n",
        "    if ep >= tp:\n",
        (T_SPLIT + "test_aligned_tp_and_expert_parallel_are_on_policy",),
    ),
    Mutant(
        "TP split of the experts checked without the TP size",
        "nemo_jetrl/flow/support.py",
        "if ep > 1 or tp == 1 or width % (128 * tp) == 0:",
        "if ep > 1 or tp == 1 or width % 128 == 0:",
        (T_SPLIT + "test_unaligned_tp_and_vllm_data_parallel_refused_by_key",),
    ),
    Mutant(
        "Megatron expert parallel size 1 taken as MoE evidence",
        "nemo_jetrl/flow/support.py",
        "        if isinstance(v, int) and not isinstance(v, bool) and v > 1:\n",
        "        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:\n",
        (T_KEYS + "test_megatron_moe_keys_at_their_dense_defaults_are_no_moe_evidence",),
    ),
    Mutant(
        "truncated IS: ratio_min equal to the ratio refused",
        RL + "correction.py",
        "if ratio_min is not None and ratio is not None and ratio_min > ratio:",
        "if ratio_min is not None and ratio is not None and ratio_min >= ratio:",
        (T_CORR_EDGES + "test_a_lower_bound_equal_to_the_ratio_is_valid_and_one_above_is_not",),
    ),
    Mutant(
        "seq-mask-tis without ratio_min accepted",
        RL + "correction.py",
        'if tis_type in ("icepop", "seq-mask-tis") and ratio_min is None:',
        'if tis_type in ("icepop",) and ratio_min is None:',
        (T_CORR_EDGES + "test_masking_types_need_a_lower_bound_and_plain_tis_does_not",),
    ),
    # ---- local backend MoE, refit staging
    Mutant(
        "local MoE block reads each routed row's token from the slot index",
        "nemo_jetrl/backends/local/moe.py",
        "ys = self.experts(x, order // self.top_k, offsets)",
        "ys = self.experts(x, order % self.top_k, offsets)",
        (T_LMOE + "test_block_computes_hf_forward_and_swap_is_reversible",),
    ),
    Mutant(
        "routing mismatch counts only the last MoE layer",
        "nemo_jetrl/backends/local/routing.py",
        "            differ += int((~found & sel.unsqueeze(-1)).sum())\n",
        "            differ = int((~found & sel.unsqueeze(-1)).sum())\n",
        (T_ROUTE_EDGES + "test_mismatch_is_the_fraction_over_every_layer",),
    ),
    Mutant(
        "routing mismatch: compared slots counted for the last layer only",
        "nemo_jetrl/backends/local/routing.py",
        "            total += int(sel.sum()) * a.shape[-1]\n",
        "            total = int(sel.sum()) * a.shape[-1]\n",
        (T_ROUTE_EDGES + "test_mismatch_is_the_fraction_over_every_layer",),
    ),
    Mutant(
        "routing mismatch compares the rollout one position late",
        "nemo_jetrl/backends/local/routing.py",
        "a = roll[:, prompt_len - 1 : prompt_len - 1 + r].long()",
        "a = roll[:, prompt_len : prompt_len + r].long()",
        (T_LMOE + "test_routing_mismatch_counts_slots_of_real_response_tokens_only",),
    ),
    Mutant(
        "staged weight accepts zero scales",
        "nemo_jetrl/fp8/staging.py",
        "bad_s = ~(torch.isfinite(s) & (s > 0))",
        "bad_s = ~(torch.isfinite(s) & (s >= 0))",
        (T_FAULTS + "test_load_quantized_refuses_bad_scales",),
    ),
    Mutant(
        "local backend's BF16 CPU linear hands BF16 operands to torch's GEMM (the scalar fallback)",
        "nemo_jetrl/backends/local/bf16_gemm.py",
        "return float32_sums(x, weight, bias).to(x.dtype)",
        "return nn.functional.linear(x, weight, bias)",
        ("tests/backends/test_local_bf16_gemm.py",),
    ),
    Mutant(
        "validation decodes each distinct prompt once with a BF16 CPU linear left (batch-variant)",
        "nemo_jetrl/backends/local/step.py",
        "and not any(is_bf16_gemm(m) for m in self.rollout_model.modules())",
        "and not any(type(m) is torch.nn.Linear for m in self.rollout_model.modules())",
        (
            "tests/backends/test_local_validation.py::test_batch_variant_or_sampled_validation_decodes_every_row",
        ),
    ),
    Mutant(
        "local backend's BF16 CPU linear sums in float32 (the BLAS's order follows the row count)",
        "nemo_jetrl/backends/local/bf16_gemm.py",
        "return nn.functional.linear(x.double(), weight.double(), b).float()",
        "return nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())",
        (
            "tests/backends/test_local_bf16_gemm.py::test_the_sums_are_float64_ones_rounded_once_to_float32",
            "tests/backends/test_local_bf16_gemm.py::test_a_rows_bits_do_not_depend_on_the_rows_computed_with_it",
        ),
    ),
]
