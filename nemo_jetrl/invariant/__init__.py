"""Batch-invariant forward passes: the same bits for a token whatever batch it is computed in.

An RL step computes each sampled token's probability twice: in the rollout, one token at a time
with a KV cache (a decode step sees ``B`` rows and ``t`` keys), and in the trainer, over whole
sequences (``B*T`` rows, ``T`` keys with a causal mask). With one quantizer on both sides the FP8
inputs of every GEMM are equal, yet the probabilities still differ in the last bits when the
other ops round differently at different shapes: a GEMM kernel chosen by shape, a reduction
split by size, a transcendental evaluated by SIMD for most of a tensor and by libm for its tail.
That is batch variance; GPUs have it too.

This package removes it by construction. Every value is produced by elementwise IEEE operations
(each correctly rounded, so an element's bits depend only on its own inputs) and reductions are
fixed binary trees that do not change when masked or absent positions (zeros) are appended
(`ops.tree_sum`). `ops.exp` and `ops.log` are built from those operations. The FP8 GEMMs are
already order-free in `nemo_jetrl.fp8.gemm.blockwise_matmul(exact=True)`: each 128-wide tile's
dot product of E4M3 values is exact in float64. `hf.make_batch_invariant` puts these ops into a
HuggingFace Llama/Qwen2 model (reversibly); the local backend does so on both sides
(``jetrl.local.batch_invariant``), which makes ``jetrl`` and ``jetrl_kv`` bitwise on-policy.

On CUDA tensors `ops` runs RMSNorm's and log-softmax's row reductions, the linear and attention
in Triton kernels (`kernels`) whose reduction order is fixed per feature dimension instead, so
the same holds there at a GPU's speed; `dispatch` holds the choice (``JETRL_INVARIANT_KERNELS``).

`ops` depends on torch (triton lazily, through `kernels`); `hf` imports transformers lazily.
"""

from nemo_jetrl.invariant.hf import InvariantHandle, is_batch_invariant, make_batch_invariant

__all__ = ["InvariantHandle", "is_batch_invariant", "make_batch_invariant"]
