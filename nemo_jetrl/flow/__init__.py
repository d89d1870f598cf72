"""Precision flow: config -> Recipe -> verdict.

- `graph`: the precision-flow graph of one side (typed edges: layer, group, role, precision);
- `check`: training forward vs rollout, edge by edge -> `FlowCheck` (mismatches with the keys
  that fix them);
- `table`: the rows `jetrl check` prints;
- `pipeline`: the one path from a YAML (or loaded config) to a checked verdict, used by
  `jetrl check`, `jetrl align`, `jetrl train` (every backend) and NeMo-RL preparation.
"""
