"""The RL maths shared by both backends: `loss` (GRPO), `loss_config` (its settings and their
rules), `correction` (importance-sampling settings; the one home of the ``loss_fn`` IS rules,
torch-free), `weights` (the importance-sampling weights), `metrics` (rollout/training mismatch
metrics)."""
