"""The mutants of `scripts/mutants.py`, one module per area (each a ``MUTANTS`` list)."""
