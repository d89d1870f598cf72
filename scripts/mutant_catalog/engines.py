"""The mutants judged with real engines: TE's layout code, vLLM's CPU attention under KV
scales, the vLLM patch's refit parity and rollback, NeMo-RL's calibration glue and refit hook."""

from __future__ import annotations

from mutation_check import Mutant

from mutant_catalog.paths import (
    T_NRL_GLUE,
    T_NRL_KV,
    T_NRL_REFIT,
    T_PARITY,
    T_ROLLBACK,
    T_TE,
    T_VLLM_KV,
)

MUTANTS = [
    # ---- TE blockwise layout (fp8/layouts.py), judged by TE's own shape and dequantize code
    Mutant(
        "TE 1x128 rowwise scales not transposed",
        "nemo_jetrl/fp8/layouts.py",
        "s = rowwise.scale_inv if two_d else rowwise.scale_inv.t()",
        "s = rowwise.scale_inv",
        T_TE,
    ),
    Mutant(
        "TE 128x128 columnwise scales not transposed",
        "nemo_jetrl/fp8/layouts.py",
        "s = columnwise.scale_inv.t() if two_d else columnwise.scale_inv",
        "s = columnwise.scale_inv",
        T_TE,
    ),
    Mutant(
        "TE 128x1 columnwise scales transposed",
        "nemo_jetrl/fp8/layouts.py",
        "s = columnwise.scale_inv.t() if two_d else columnwise.scale_inv",
        "s = columnwise.scale_inv.t()",
        T_TE,
    ),
    Mutant(
        "TE scale padding on the first dim",
        "nemo_jetrl/fp8/layouts.py",
        "return F.pad(t, (0, _align(t.shape[-1], mult) - t.shape[-1]))",
        "return F.pad(t, (0, 0, 0, _align(t.shape[0], mult) - t.shape[0]))",
        T_TE,
    ),
    Mutant(
        "TE 128x128 rowwise scales read as if transposed",
        "nemo_jetrl/fp8/layouts.py",
        "s, block = t.rowwise_scale_inv[: _cdiv(m, 128), : _cdiv(k, 128)], (128, 128)",
        "s, block = t.rowwise_scale_inv[: _cdiv(k, 128), : _cdiv(m, 128)].t(), (128, 128)",
        T_TE,
    ),
    # ---- what a set KV scale does in vLLM's CPU attention
    Mutant(
        "KV CPU cache model rounds to nearest (vLLM's CPU kernel truncates)",
        "nemo_jetrl/kvcache/quant.py",
        'if kernel == "cuda":',
        "if kernel in KERNELS:",
        (
            "tests/vllm_patch/test_vllm_kv_cpu_ops.py",  # kills it alone (12 s), as does T_VLLM_KV
            *T_VLLM_KV,
            "tests/kvcache/test_kvcache_quant.py",
        ),
        env="vllm",
    ),
    Mutant(
        "KV scale's host float not updated (vLLM's CPU attention reads it)",
        "nemo_jetrl/vllm_patch/compat.py",
        'setattr(module, f"_{k}_scale_float", val)',
        "pass",
        (  # the unit test first (fast on any CPU); T_VLLM_KV alone kills it too (158 s)
            "tests/vllm_patch/test_vllm_patch_engine_setup.py"
            "::test_set_attention_kv_scales_writes_every_copy_each_vllm_line_keeps",
            *T_VLLM_KV,
        ),
        env="vllm",
    ),
    # ---- engine shutdown: an in-process engine core's queue sockets (vLLM 0.20 hung in term)
    Mutant(
        "engine shutdown leaves the executor's queue sockets open (gc then waits in term)",
        "nemo_jetrl/vllm_patch/shutdown.py",
        "        sock.close(linger=0)\n",
        "        pass\n",
        ("tests/vllm_patch/test_vllm_shutdown_unit.py",),
        env="vllm",
    ),
    # ---- a failed engine start (vLLM 0.20's loader leaves its dtype and groups behind)
    Mutant(
        "a failed engine start leaves BF16 as the process's default dtype",
        "nemo_jetrl/vllm_patch/shutdown.py",
        "        torch.set_default_dtype(dtype)\n",
        "        pass\n",
        ("tests/vllm_patch/test_vllm_failed_start.py",),
        env="nemo_rl",  # vLLM 0.20 (0.32 restores the dtype itself)
    ),
    Mutant(
        "a failed engine start leaves vLLM's model-parallel groups built",
        "nemo_jetrl/vllm_patch/shutdown.py",
        "if not groups_before and _groups_initialised():",
        "if False:",
        ("tests/vllm_patch/test_vllm_failed_start.py",),
        env="nemo_rl",
    ),
    # ---- vLLM patch: refit parity and rollback
    Mutant(
        "parity compares values, not bytes",
        "nemo_jetrl/vllm_patch/parity_views.py",
        "if torch.equal(gb, wb):",
        "if torch.equal(got, want):",
        T_PARITY,
    ),
    Mutant(
        "parity ignores tensors the engine did not return",
        "nemo_jetrl/vllm_patch/refit.py",
        'differing += [f"{n} (engine holds None)" for n in fp8_names if n not in seen]',
        "pass",
        T_PARITY,
    ),
    Mutant(
        "rollback copy condition flipped",
        "nemo_jetrl/vllm_patch/rollback.py",
        "            if not saved.obj.is_meta:\n                saved.data.copy_(saved.copy)",
        "            if saved.obj.is_meta:\n                saved.data.copy_(saved.copy)",
        T_ROLLBACK,
    ),
    Mutant(
        "rollback verification skipped",
        "nemo_jetrl/vllm_patch/rollback.py",
        "elif not _same_bytes(cur, saved.copy):",
        "elif False:",
        T_ROLLBACK,
    ),
    # ---- NeMo-RL backend: calibration glue and refit hook (NeMo-RL v0.7.0's real source)
    Mutant(
        "worker calibration ignores input_lengths (padding counted)",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        "yield functools.partial(run, part, size), (lengths if by_lengths else None)",
        "yield functools.partial(run, part, size), None",
        T_NRL_GLUE,
        env="nemo_rl",
    ),
    Mutant(
        "worker passes the lengths of other rows",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        'lengths = part["input_lengths"].reshape(-1).to(torch.long).cpu()',
        'lengths = part["input_lengths"].reshape(-1).to(torch.long).cpu().flip(0)',
        T_NRL_GLUE,
        env="nemo_rl",
    ),
    Mutant(
        "worker never masks by lengths",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        'by_lengths = settings.mask != "none" and not packed and not dynamic',
        "by_lengths = False",
        T_NRL_GLUE,
        env="nemo_rl",
    ),
    Mutant(
        "worker's refit-iterator override not installed",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        "        def _iter_params_with_optional_kv_scales(\n",
        "        def _iter_params_with_optional_kv_scales_unused(\n",
        T_NRL_GLUE,
        env="nemo_rl",
    ),
    Mutant(
        "worker forgets its calibration for the refit",
        "nemo_jetrl/backends/nemo_rl/worker.py",
        'self._jetrl_vllm_scales = dict(out["layers"])',
        "self._jetrl_vllm_scales = None",
        T_NRL_GLUE,
        env="nemo_rl",
    ),
    Mutant(
        "refit hook: a refusal inside NeMo-RL's transport is not re-raised",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        "            if sent.error is not None:\n                raise sent.error\n",
        "            if False:\n                raise sent.error\n",
        (T_NRL_REFIT + "test_a_batch_refused_mid_stream_leaves_the_engine_bit_identical",),
        env="nemo_rl",
    ),
    Mutant(
        "refit hook: parity never checked after the transport",
        "nemo_jetrl/backends/nemo_rl/vllm_refit.py",
        "if ok and state.parity:",
        "if ok and False:",
        (T_NRL_REFIT + "test_a_corrupted_load_is_named_by_the_parity_check_inside_the_transport",),
        env="nemo_rl",
    ),
    Mutant(
        "refit hook: a failed NeMo-RL transport is not rolled back",
        "nemo_jetrl/vllm_patch/rank_vote.py",
        "    if not bad:\n        return True\n",
        "    if not bad or failure is None:\n        return ok\n",
        (T_NRL_REFIT + "test_a_failure_inside_nemo_rls_own_transport_is_rolled_back_too",),
        env="nemo_rl",
    ),
    Mutant(
        "engine check passes its function to NeMo-RL's worker group positionally",
        "nemo_jetrl/backends/nemo_rl/engine_check.py",
        "            fn=check_in_generation_worker,\n            patch_json=patch_json,\n"
        "            hook_expected=hook,\n",
        "            check_in_generation_worker,\n            patch_json,\n            hook,\n",
        ("tests/backends/test_nemo_rl_engine_check_unit.py",),
    ),
    Mutant(
        "refit ships the caller's scales over our calibration",
        "nemo_jetrl/backends/nemo_rl/calibration.py",
        "return None if calibrated is None else dict(calibrated)",
        "return None",
        T_NRL_KV,
        env="nemo_rl",
    ),
]
