"""The planted controls, and the mutants of the core: rl/, the FP8 quantizer and grouped linear,
kvcache/, the flow's verdict, the local backend's checkpoint and step."""

from __future__ import annotations

from mutation_check import Mutant

from mutant_catalog.paths import (
    RL,
    T_CKPT,
    T_EXPERTS,
    T_EXPERTS_TRITON,
    T_FLOW,
    T_FP8,
    T_KV,
    T_KVQ,
    T_LOSS,
    T_METRICS,
    T_SAMPLE,
    T_STEP,
    T_WEIGHTS,
)

CONTROLS = [
    Mutant(
        "planted no-op: k1_kl parenthesised",
        RL + "metrics.py",
        '_ours("k1_kl"): -d,',
        '_ours("k1_kl"): -(d),',
        T_METRICS,
        planted=True,
    ),
    Mutant(  # changes the AST, not the numbers: the harness must report it SURVIVED
        "planted behaviour no-op: k1_kl times 1",
        RL + "metrics.py",
        '_ours("k1_kl"): -d,',
        '_ours("k1_kl"): -d * 1,',
        T_METRICS,
        planted=True,
    ),
]

MUTANTS = [
    # ---- rl/: metrics, loss, IS weights
    Mutant(
        "k1_kl sign flipped",
        RL + "metrics.py",
        '_ours("k1_kl"): -d,',
        '_ours("k1_kl"): d,',
        T_METRICS,
    ),
    Mutant(
        "k2 missing its 1/2",
        RL + "metrics.py",
        "return 0.5 * log_ratio * log_ratio",
        "return log_ratio * log_ratio",
        T_METRICS,
    ),
    Mutant(
        "token_mult_prob_error without abs",
        RL + "metrics.py",
        'out[_name("token_mult_prob_error")] = _mean(torch.exp(dv.abs()))',
        'out[_name("token_mult_prob_error")] = _mean(torch.exp(dv))',
        T_METRICS,
    ),
    Mutant(
        "chi2_seq clamp removed",
        RL + "metrics.py",
        ".clamp(-SEQ_LOG_RATIO_CLAMP, SEQ_LOG_RATIO_CLAMP)",
        "",
        T_METRICS,
    ),
    Mutant(
        "ratio clip min/max swapped",
        RL + "loss.py",
        "ratios.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)",
        "ratios.clamp(1.0 - cfg.ratio_clip_max, 1.0 + cfg.ratio_clip_min)",
        T_LOSS,
    ),
    Mutant(
        "PPO max -> min",
        RL + "loss.py",
        "clip_loss = torch.maximum(-adv * ratios, -adv * ratios_clamped)",
        "clip_loss = torch.minimum(-adv * ratios, -adv * ratios_clamped)",
        T_LOSS,
    ),
    Mutant(
        "IS weights not applied",
        RL + "loss.py",
        "actor_loss = aggregate(w * clip_loss)",
        "actor_loss = aggregate(clip_loss)",
        T_LOSS,
    ),
    Mutant(
        "KL input-clamp detach removed",
        RL + "loss.py",
        "kl_w = torch.where(x == xc, kl_w, kl_w.detach())",
        "pass",
        T_LOSS,
    ),
    Mutant(
        "on-policy KL ignored",
        RL + "loss.py",
        "if cfg.use_on_policy_kl_approximation",
        "if False",
        T_LOSS,
    ),
    Mutant(
        "KL output clamp skipped",
        RL + "loss.py",
        "kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)",
        "kl = kl",
        T_LOSS,
    ),
    Mutant(
        "global_valid_seqs ignored",
        RL + "loss.py",
        "seq_den = float(global_valid_seqs) if global_valid_seqs is not None else",
        "seq_den =",
        T_LOSS,
    ),
    Mutant(
        "approx_entropy sign",
        RL + "loss.py",
        "float(-(torch.exp(c64 - g64) * c64)",
        "float((torch.exp(c64 - g64) * c64)",
        T_LOSS,
    ),
    Mutant(
        "seq-mask-tis arithmetic mean",
        RL + "weights.py",
        "geo = torch.exp(log_r.sum(-1) / cnt.clamp(min=1))",
        "geo = torch.where(mask, torch.exp(log_r), torch.zeros_like(log_r)).sum(-1)"
        " / cnt.clamp(min=1)",
        T_WEIGHTS,
    ),
    Mutant(
        "tis ratio_min ignored",
        RL + "weights.py",
        "lo_t = 0.0 if lo is None else lo",
        "lo_t = 0.0",
        T_WEIGHTS,
    ),
    Mutant(
        "icepop lower bound >= -> >",
        RL + "weights.py",
        "keep = (w >= lo) & (w <= hi)",
        "keep = (w > lo) & (w <= hi)",
        T_WEIGHTS,
    ),
    Mutant(
        "icepop upper bound <= -> <",
        RL + "weights.py",
        "keep = (w >= lo) & (w <= hi)",
        "keep = (w >= lo) & (w < hi)",
        T_WEIGHTS,
    ),
    # ---- fp8/: TE's quantizer
    Mutant(
        "scale rule swapped to vLLM's 1/(amax/fmax)",
        "nemo_jetrl/fp8/quantize.py",
        "scale = torch.full_like(amax, fmt.fmax) / amax",
        "scale = 1.0 / (amax / fmt.fmax)",
        T_FP8,
    ),
    Mutant(
        "pow2 scale rounding skipped",
        "nemo_jetrl/fp8/quantize.py",
        "    if pow2_scales:\n        scale = (scale.view",
        "    if False:\n        scale = (scale.view",
        T_FP8,
    ),
    Mutant(
        "ragged block padded with ones",
        "nemo_jetrl/fp8/quantize.py",
        "x2 = F.pad(x2, (0, kb * bk - k, 0, mb * bm - m))",
        "x2 = F.pad(x2, (0, kb * bk - k, 0, mb * bm - m), value=1.0)",
        T_FP8,
    ),
    # ---- fp8/: grouped expert linear (MoE)
    Mutant(
        "grouped WGrad quantizes dy in the forward format (hybrid loses E5M2)",
        "nemo_jetrl/fp8/experts.py",
        'qdyc = _quantize_tokens(ops, dy2, offsets, gfmt, config, name, "grad_output")',
        'qdyc = _quantize_tokens(ops, dy2, offsets, config.forward_format, config, name, "grad_output")',
        T_EXPERTS,
    ),
    Mutant(
        "grouped reference: token blocks of every expert written to the same columns",
        "nemo_jetrl/fp8/experts_reference.py",
        "        b0 += nb\n",
        "        b0 += 0\n",
        T_EXPERTS,
    ),
    Mutant(
        "grouped Triton WGrad reads scales from column t, not the expert's block_offsets + t",
        "nemo_jetrl/fp8/_triton_grouped_jit.py",
        "sa = tl.load(sa_ptr + rm * ssam + (b0 + t) * ssat, mask=rm < N, other=0.0)",
        "sa = tl.load(sa_ptr + rm * ssam + t * ssat, mask=rm < N, other=0.0)",
        T_EXPERTS_TRITON,
    ),
    # ---- kvcache/: calibration and the KV quantizer
    Mutant(
        "response mask ignores padding",
        "nemo_jetrl/kvcache/calibration.py",
        "return resp if real is None else resp & real",
        "return resp",
        T_KV,
    ),
    Mutant(
        "percentile rank off by one",
        "nemo_jetrl/kvcache/calibration.py",
        "rank = round(percentile / 100.0 * (len(vals) - 1))",
        "rank = round(percentile / 100.0 * len(vals))",
        T_KV,
    ),
    Mutant(
        "KV margin dropped",
        "nemo_jetrl/kvcache/calibration.py",
        "exact = amax * margin / fmax",
        "exact = amax / fmax",
        T_KV,
    ),
    Mutant(
        "zero KV scale accepted",
        "nemo_jetrl/kvcache/calibration.py",
        "if not (0.0 < s < math.inf)}",
        "if not (0.0 <= s < math.inf)}",
        (*T_KV, "tests/kvcache/test_kvcache_hf.py::test_all_masked_layers_refused_end_to_end"),
    ),
    Mutant(
        "KV quantizer multiplies by the reciprocal (CPU rule on the GPU path)",
        "nemo_jetrl/kvcache/quant.py",
        "v = torch.clamp(torch.div(x32, s), -f.fmax, f.fmax)",
        "v = torch.clamp(x32 * torch.reciprocal(s), -f.fmax, f.fmax)",
        T_KVQ,
    ),
    Mutant(
        "trainer KV rounds as CUDA under vLLM's CPU engine (the cache writer it serves ignored)",
        "nemo_jetrl/kvcache/quant.py",
        'return "cpu" if engine == "vllm" and platform == "cpu" else "cuda"',
        'return "cuda"',
        (
            *T_KVQ,
            "tests/backends/test_local_kv_padding.py",
            "tests/backends/test_rehearsal_kv_unit.py",
        ),
    ),
    # ---- flow/: the on-policy verdict
    Mutant(
        "flow KV scale source comparison flipped",
        "nemo_jetrl/flow/check.py",
        "if roll.is_fp8 and train.scale != roll.scale:",
        "if roll.is_fp8 and train.scale == roll.scale:",
        T_FLOW,
    ),
    Mutant(
        "flow ignores block shape",
        "nemo_jetrl/flow/check.py",
        "if (train.fmt, train.block) != (roll.fmt, roll.block):",
        "if train.fmt != roll.fmt:",
        T_FLOW,
    ),
    # ---- local backend: checkpoint and step
    Mutant(
        "checkpoint sha256 check skipped",
        "nemo_jetrl/backends/local/checkpoint.py",
        'elif _sha256(p) != want.get("sha256"):',
        "elif False:",
        T_CKPT,
    ),
    Mutant(
        "resume takes the oldest checkpoint",
        "nemo_jetrl/backends/local/checkpoint.py",
        "for _step, d in reversed(list_checkpoints(ckpt_dir)):",
        "for _step, d in list_checkpoints(ckpt_dir):",
        T_CKPT,
    ),
    Mutant(  # the device generator's last state, not the host's draw: a resume draws otherwise
        "device sampling not seeded from the host generator",
        "nemo_jetrl/backends/local/rollout.py",
        "    device_generator.manual_seed(seed)\n",
        "",
        T_SAMPLE,
    ),
    Mutant(  # a seed per run, not per step: every decode step draws with the same noise
        "device sampling seeded once (the same seed every step)",
        "nemo_jetrl/backends/local/rollout.py",
        "seed = int(torch.randint(SEED_HIGH, (1,), generator=host))",
        "seed = int(torch.randint(SEED_HIGH, (1,), generator=torch.Generator().manual_seed(0)))",
        T_SAMPLE,
    ),
    Mutant(
        "local KV recalibration counts padding after <eos>",
        "nemo_jetrl/backends/local/step.py",
        "full_mask = torch.cat([torch.ones_like(prompt_ids, dtype=torch.bool), mask], dim=1)",
        "full_mask = torch.cat([torch.ones_like(prompt_ids, dtype=torch.bool),"
        " torch.ones_like(mask)], dim=1)",
        T_STEP,
    ),
    Mutant(
        "local KV recalibration mask one token too long",
        "nemo_jetrl/backends/local/step.py",
        "full_mask = torch.cat([torch.ones_like(prompt_ids, dtype=torch.bool), mask], dim=1)",
        "full_mask = torch.cat([torch.ones_like(prompt_ids, dtype=torch.bool),"
        " mask | torch.nn.functional.pad(mask[:, :-1], (1, 0))], dim=1)",
        T_STEP,
    ),
    Mutant(
        "local KV response mask counts padding",
        "nemo_jetrl/backends/local/step.py",
        "resp_mask = torch.cat([torch.zeros_like(prompt_ids, dtype=torch.bool), mask], dim=1)",
        "resp_mask = torch.cat([torch.zeros_like(prompt_ids, dtype=torch.bool),"
        " torch.ones_like(mask)], dim=1)",
        T_STEP,
        equivalent="calibrate() intersects the response mask with the attention mask "
        "(kvcache.calibration.token_mask: resp & real), which still excludes the padding",
    ),
    Mutant(
        "uni executor kept with multiprocessing on (the caller runs the worker where vLLM meant "
        "to spawn it)",
        "nemo_jetrl/vllm_patch/uni_executor.py",
        'and os.environ.get(MULTIPROCESSING) == "0"',
        "and True",
        ("tests/vllm_patch/test_uni_executor_unit.py",),
    ),
    Mutant(
        "engine shutdown replaces torch.accelerator.synchronize where an accelerator is there",
        "nemo_jetrl/vllm_patch/shutdown.py",
        "if acc is None or acc.is_available():",
        "if acc is None:",
        (
            "tests/vllm_patch/test_vllm_patch_engine_setup.py::test_shutdown_syncs_no_accelerator_only_while_there_is_none",
        ),
    ),
    Mutant(
        "config merge on plain containers lets a missing value (???) replace a parent's value",
        "nemo_jetrl/config/merge.py",
        'if val == "???" and old is not _MISSING:',
        "if False:",
        ("tests/config/test_config_merge.py",),
    ),
    Mutant(
        "the FP8 weight cache is used while a CUDA graph is captured (replays keep a stale weight)",
        "nemo_jetrl/fp8/linear.py",
        "cached = plan.cache_weight and not _capturing(w)",
        "cached = plan.cache_weight",
        (
            "tests/fp8/test_fp8_graphed.py::test_the_weight_cache_is_skipped_while_a_graph_is_captured",
        ),
    ),
    Mutant(
        "a CUDA graph's device flags are not pending again after a replay",
        "nemo_jetrl/fp8/finite_flags.py",
        "            _FLAGS[key] = buf\n        elif",
        "            pass\n        elif",
        ("tests/fp8/test_fp8_graphed.py::test_a_graphs_flags_are_pending_again_after_each_replay",),
    ),
    Mutant(
        "rollout FP8 linear built from a CUDA linear keeps its buffers on the CPU (run 8's crash)",
        "nemo_jetrl/fp8/inference_linear.py",
        "name=name, device=linear.weight.device,",
        "name=name, device=None,",
        ("tests/fp8/test_fp8_linear.py::test_inference_linear_is_built_on_its_linears_device",),
    ),
    Mutant(
        "rollout FP8 linear runs an input on another device than its weight (no error naming it)",
        "nemo_jetrl/fp8/inference_linear.py",
        "        if x.device != self.weight_fp8.device:",
        "        if False:",
        ("tests/fp8/test_fp8_linear.py::test_inference_linear_is_built_on_its_linears_device",),
    ),
    Mutant(
        "rollout FP8 linear's quantizer not handed its device flag (a NaN input never reported)",
        "nemo_jetrl/fp8/inference_linear.py",
        "check_finite=not deferred, nonfinite_flag=flag,",
        "check_finite=not deferred, nonfinite_flag=None,",
        (
            "tests/fp8/test_fp8_linear_sync_free.py::test_rollout_linear_flags_non_finite_input_in_the_quantizer_launch",
        ),
    ),
    Mutant(
        "MoE routes sorted by expert: a sorted row's token is its flat index (not index // k)",
        "nemo_jetrl/fp8/experts_layer.py",
        "return by_expert, order, order // topk_ids.shape[1]",
        "return by_expert, order, order",
        (
            "tests/vllm_patch/test_expert_shards_unit.py::test_sorted_routes_are_the_local_routes_sorted_by_expert",
        ),
    ),
    Mutant(
        "census reads a kept ptxas answer for another PTX text",
        "scripts/sm90_ptx.py",
        "hashlib.sha256((ident + ptx).encode())",
        "hashlib.sha256(ident.encode())",
        ("tests/test_sm90_ptx.py::test_ptxas_usage_is_kept_per_ptx_text_and_read_back",),
    ),
]
