"""nemo_jetrl: truly on-policy FP8 RL for NeMo-RL.

The rollout engine (vLLM) and the training forward (Megatron-Core + Transformer Engine blockwise
FP8) share one quantizer, `nemo_jetrl.fp8`, so every tensor that is FP8 in rollout carries the
same bits in training. Importing this package patches nothing and imports no heavy dependency.
"""

__version__ = "0.1.0"
