"""Triton kernels for the batch-invariant ops on CUDA, each with a reduction order fixed per
feature dimension (never per batch or sequence length): `rows` (RMSNorm's rstd, log-softmax's
max and log-sum-exp), `matmul` (``x @ w.T``), `attention` (the same bits for a query in a decode
step and in a prefill). `nemo_jetrl.invariant.ops` dispatches to them (`dispatch`); each module
has a float64 torch reference beside its kernel. Triton is imported lazily (the `_jit_*` modules
import it at their top and are loaded on first launch); on CPU they run under
``TRITON_INTERPRET=1``.
"""
