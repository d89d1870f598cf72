"""``jetrl train --backend nemo-rl``: `launch` (prepare and run), `translate` (our keys ->
NeMo-RL's), `worker` (the policy worker NeMo-RL runs), `metrics` (mismatch metrics in its logs)."""
