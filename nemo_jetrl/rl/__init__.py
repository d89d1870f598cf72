"""The RL maths shared by both backends: `loss` (GRPO), `correction` (importance-sampling
corrections; owns the ``loss_fn`` rules), `metrics` (rollout/training mismatch metrics)."""
