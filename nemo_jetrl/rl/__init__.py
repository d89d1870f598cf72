"""The RL maths shared by both backends: `loss` (GRPO), `loss_config` (its settings and their
rules), `correction` (importance-sampling corrections; owns the ``loss_fn`` rules), `metrics`
(rollout/training mismatch metrics)."""
