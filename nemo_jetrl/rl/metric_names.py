"""The names of the mismatch metrics, torch-free: the one home of the prefixes and of the tags
`nemo_jetrl.rl.metrics.mismatch_metrics` returns (its module docstring defines them).

`jetrl compare` (`nemo_jetrl.runs.report`, `nemo_jetrl.runs.logs`) resolves metric names with
them and runs where torch is not installed (a login node's light venv, docs/cluster.md), so this
module imports nothing; tests/commands/test_compare_without_torch.py checks that `METRIC_NAMES`
is what `mismatch_metrics` returns, in its order.
"""

from __future__ import annotations

#: prefix of every metric NeMo-RL also logs (grpo.py logs the loss metrics under ``train``).
NEMO_RL_PREFIX = "train/"
#: the one prefix of every metric NeMo-RL does not have.
JETRL_PREFIX = "jetrl/mismatch/"

_NEMO_RL = (
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "min_seq_mult_prob_error",
    "mean_seq_mult_prob_error",
    "max_seq_mult_prob_error",
)
_RATIO_STATS = ("mean", "std", "min", "max", "ess")
_OURS = (
    "k1_kl",
    "train_log_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
    *(f"is_ratio_{k}" for k in _RATIO_STATS),
    "is_ratio_frac_above",
    "is_ratio_frac_below",
    *(f"is_ratio_trunc_{k}" for k in _RATIO_STATS),
    "num_valid_tokens",
    "num_valid_seqs",
    "nonfinite_tokens",
)

#: every tag `mismatch_metrics` returns, in its order.
METRIC_NAMES = (
    *(NEMO_RL_PREFIX + k for k in _NEMO_RL),
    *(JETRL_PREFIX + k for k in _OURS),
)


def metric_names() -> list[str]:
    """Every tag `mismatch_metrics` returns, in its order (for docs, tests and `jetrl compare`)."""
    return list(METRIC_NAMES)
