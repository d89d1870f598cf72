"""GRPO loss over micro-batches against NeMo-RL itself (marker `nemo_rl`): NeMo-RL's
ClippedPGLossFn normalises every micro-batch by the global batch's valid tokens / sequences and
its workers sum the micro-batches; ours, given the same ``global_valid_tokens`` /
``global_valid_seqs``, must give the same summed loss and gradient for every configuration of
`test_loss_vs_nemo_rl` (float64 inputs; NeMo-RL adds 1e-8 to each denominator: rel 1e-6).
"""

from __future__ import annotations

import pytest
import torch
from test_loss_vs_nemo_rl import NEMO_RL_CASES, _random_batch

from nemo_jetrl.rl.loss import GRPOLossConfig, grpo_loss

SPLITS = (slice(0, 3), slice(3, 8))


def _pad(x: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's data tensors are input-aligned and sliced [:, 1:] inside: prepend a column."""
    return torch.cat([torch.zeros(x.shape[0], 1, dtype=x.dtype), x], dim=1)


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", sorted(NEMO_RL_CASES))
def test_micro_batched_loss_matches_nemo_rl(name):
    import nemo_rl.algorithms.loss.loss_functions as lf
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    cfg_dict = {"reference_policy_kl_penalty": 0.0, **NEMO_RL_CASES[name]}
    curr, prev, gen, ref, adv, tm, sm = _random_batch(len(name) + 7, b=8, t=11)
    gtok, gseq = (tm * sm.unsqueeze(-1)).sum(), sm.sum()
    fn = lf.ClippedPGLossFn(lf.ClippedPGLossConfig(**cfg_dict))
    cfg = GRPOLossConfig.from_loss_fn_cfg(cfg_dict)
    theirs_c, ours_c = curr.clone().requires_grad_(), curr.clone().requires_grad_()
    theirs, ours = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for s in SPLITS:
        per_tok_adv = adv[s].unsqueeze(-1).expand_as(prev[s]).contiguous()
        data = BatchedDataDict(
            {
                "advantages": _pad(per_tok_adv),
                "prev_logprobs": _pad(prev[s]),
                "generation_logprobs": _pad(gen[s]),
                "reference_policy_logprobs": _pad(ref[s]),
                "token_mask": _pad(tm[s]),
                "sample_mask": sm[s],
            }
        )
        t_loss, _ = fn(theirs_c[s], data, global_valid_seqs=gseq, global_valid_toks=gtok)
        theirs = theirs + t_loss
        o_loss, _ = grpo_loss(
            ours_c[s], prev[s], gen[s], adv[s], tm[s], sm[s],
            reference_logprobs=ref[s], config=cfg,
            global_valid_tokens=float(gtok), global_valid_seqs=float(gseq),
        )  # fmt: skip
        ours = ours + o_loss
    theirs.backward()
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-9), name
    torch.testing.assert_close(ours_c.grad, theirs_c.grad, rtol=1e-6, atol=1e-9)
