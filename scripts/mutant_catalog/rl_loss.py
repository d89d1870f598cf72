"""The mutants of the GRPO loss's denominators (a review of the RL numerics against NeMo-RL's
ClippedPGLossFn, session 38): a global count of 0, a global count that cannot be right, zero-length
responses under a sample mask."""

from __future__ import annotations

from mutation_check import Mutant

T_DEN = ("tests/rl/test_loss_denominators.py",)
MUTANTS = [
    Mutant(  # NeMo-RL hands a zero count when every sample_mask of a global batch is 0
        "a global count of 0 divides by 0 (NaN loss)",
        "nemo_jetrl/rl/loss.py",
        "    return den if den > 0 else 1.0",
        "    return den",
        T_DEN,
    ),
    Mutant(  # a count below the call's own scaled the loss and gradient silently
        "a global count below the call's own count is used as given",
        "nemo_jetrl/rl/loss.py",
        "    if not local <= den < math.inf:",
        "    if False:",
        T_DEN,
    ),
    Mutant(  # [B, 0] responses: column 0 of an empty mask
        "kept samples read column 0 of the token mask",
        "nemo_jetrl/rl/metrics.py",
        "    ones = torch.ones((batch, 1), dtype=torch.bool, device=device)",
        "    ones = torch.ones((batch, 0), dtype=torch.bool, device=device)",
        T_DEN,
    ),
    Mutant(  # session 40 review: with token_level_loss false, None left empty responses out
        "no sample mask drops the empty responses from the sequence mean",
        "nemo_jetrl/rl/loss.py",
        "        seq_ok = torch.ones(len(mask), dtype=torch.bool, device=mask.device)",
        "        seq_ok = mask.any(-1)",
        ("tests/rl/test_loss_denominators.py",),
    ),
]
