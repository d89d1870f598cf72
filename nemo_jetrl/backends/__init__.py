"""Execution backends for a GRPO run described by a NeMo-RL-shaped config.

- ``local``: an embedded, in-process GRPO loop on CPU with a small HuggingFace model, used on a
  laptop or in CI so every component (refit, FP8 rollout, trainer scoring, metrics, corrected
  update, logs) runs for real.
- ``nemo_rl``: dispatch to NeMo-RL's GRPO on a GPU cluster (needs NeMo-RL; separate module).

Backends are imported lazily by ``jetrl train``; importing this package imports neither.
"""

from __future__ import annotations

BACKENDS: tuple[str, ...] = ("local", "nemo-rl")
