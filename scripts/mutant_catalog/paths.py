"""The source and test paths the mutant lists share (`scripts/mutants.py`)."""

from __future__ import annotations

RL = "nemo_jetrl/rl/"
T_RL = "tests/rl/"
T_METRICS = (T_RL + "test_metrics.py", T_RL + "test_reference.py")
T_LOSS = (T_RL + "test_loss.py", T_RL + "test_loss_vs_nemo_rl.py", T_RL + "test_reference.py")
T_WEIGHTS = (
    T_RL + "test_correction.py",
    T_RL + "test_icepop_bounds.py",
    T_RL + "test_reference.py",
)
T_FP8 = ("tests/fp8/test_fp8_golden.py",)
T_EXPERTS = ("tests/fp8/test_fp8_experts.py",)
T_EXPERTS_TRITON = (
    "tests/fp8/test_fp8_experts_triton.py::test_grouped_gemms_give_the_reference_bits_in_tes_order",
)
T_KV = ("tests/kvcache/test_kvcache_calibration.py",)
T_KVQ = ("tests/kvcache/test_kvcache_quant.py",)
T_FLOW = ("tests/flow/test_flow.py",)
T_CKPT = ("tests/backends/test_local_checkpoint_integrity.py",)
T_STEP = ("tests/backends/test_local_kv_padding.py",)
T_SAMPLE = ("tests/backends/test_local_sampling.py",)
T_PARITY = ("tests/vllm_patch/test_parity_unit.py",)
T_ROLLBACK = ("tests/vllm_patch/test_rollback_unit.py",)
T_NRL_KV = ("tests/backends/test_nemo_rl_kv.py",)
T_NRL_GLUE = ("tests/backends/test_nemo_rl_worker_glue.py",)
# NeMo-RL's real transport into a real vLLM 0.20 CPU engine (one engine start for the three).
T_NRL_REFIT = "tests/backends/test_nemo_rl_refit_vllm.py::"
T_TE = ("tests/megatron/test_te_layout_from_te.py",)  # TE 2.20.2's own layout code
# A real vLLM engine's attention output under set KV scales (an FP8 KV cache runs on AVX-512 /
# AMX CPUs; elsewhere the test checks vLLM's refusal, so each mutant also lists a default test).
T_VLLM_KV = ("tests/vllm_patch/test_vllm_kv_cpu.py::test_jetrl_kv_engine_on_this_cpu",)
