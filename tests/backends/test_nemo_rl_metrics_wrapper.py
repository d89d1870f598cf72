"""The mismatch metrics our loss wrapper adds inside NeMo-RL's GRPO step, against the offline
reference (`nemo_jetrl.rl.metrics.mismatch_metrics`, float64) on the same tokens: with
``loss_fn.force_on_policy_ratio`` (NeMo-RL zeroes ``prev_logprobs``), with a token whose
log-ratio is unusable, and with the ratio bounds every backend shares. The last test runs
NeMo-RL's real ClippedPGLossFn inside the wrapper (marker ``nemo_rl``). Also: the wrapper's
micro-batch sums give the step's token means, and the logger proxy moves our tags out of
NeMo-RL's ``train/`` prefix."""

from __future__ import annotations

import math
import pickle
import types

import pytest
import torch

from nemo_jetrl.backends.nemo_rl import metrics as nm
from nemo_jetrl.rl.metrics import DEFAULT_RATIO_BOUNDS, mismatch_metrics


class PgStandin:
    """NeMo-RL's ClippedPGLossFn as the wrapper sees it: its call and the one flag read."""

    def __init__(self, force_on_policy_ratio: bool = False) -> None:
        self.force_on_policy_ratio = force_on_policy_ratio

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        return next_token_logprobs.sum() * 0, {"loss": 0.0}


def batch(seed: int, b: int = 4, t: int = 10) -> tuple[dict, torch.Tensor]:
    """A micro-batch as grpo_train hands it over, and the trainer's current logprobs."""
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    curr = gen + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    mask = (torch.rand(b, t, generator=g) > 0.2).double()
    mask[:, 0] = 0
    data = {
        "generation_logprobs": gen,
        "prev_logprobs": curr.clone(),
        "token_mask": mask,
        "sample_mask": torch.ones(b, dtype=torch.float64),
    }
    return data, curr


def step(loss, parts: list[tuple[dict, torch.Tensor]], proxy: bool = True) -> dict[str, float]:
    """Every micro-batch through ``loss``, summed as NeMo-RL sums a step's loss metrics (one
    global batch), then what our logger proxy hands NeMo-RL's logger."""
    gvt = sum((d["token_mask"][:, 1:] * d["sample_mask"][:, None]).sum() for d, _ in parts)
    summed: dict[str, float] = {}
    for data, curr in parts:
        _, m = loss(
            next_token_logprobs=curr[:, 1:],
            data=data,
            global_valid_seqs=torch.tensor(8.0),
            global_valid_toks=gvt,
        )
        for k in nm.ADDITIVE_MEANS + nm.TOKEN_COUNTS:
            summed[k] = summed.get(k, 0.0) + float(m[k])
    return nm.usable_token_means(summed) if proxy else summed


def offline(parts: list[tuple[dict, torch.Tensor]], prev_key: str | None) -> dict[str, float]:
    whole = {k: torch.cat([d[k] for d, _ in parts]) for k in parts[0][0]}
    prev = whole[prev_key] if prev_key else torch.cat([c for _, c in parts])
    return mismatch_metrics(
        whole["generation_logprobs"][:, 1:],
        prev[:, 1:],
        whole["token_mask"][:, 1:],
        whole["sample_mask"],
        ratio_bounds=DEFAULT_RATIO_BOUNDS,
    )


def close(got: dict[str, float], ref: dict[str, float]) -> None:
    for k in nm.ADDITIVE_MEANS + nm.TOKEN_COUNTS:
        assert got[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-12), k


def test_force_on_policy_ratio_compares_the_rollout_with_the_current_logprobs():
    """grpo_train zeroes ``prev_logprobs`` under ``force_on_policy_ratio`` (v0.7.0 grpo.py
    :2636) and the loss uses its current logprobs (loss_functions.py :337): before, our
    metrics compared the rollout's with zeros (is_ratio_mean 5.27 where 1.02 was right)."""
    parts = [batch(1), batch(2)]
    for data, _ in parts:
        data["prev_logprobs"] = torch.zeros_like(data["prev_logprobs"])
    got = step(nm.MismatchMetricsLoss(PgStandin(force_on_policy_ratio=True)), parts)
    close(got, offline(parts, None))
    zeros = step(nm.MismatchMetricsLoss(PgStandin()), parts)  # the control: what it read before
    assert abs(zeros["jetrl/mismatch/is_ratio_mean"] - got["jetrl/mismatch/is_ratio_mean"]) > 1


def test_token_means_leave_unusable_tokens_out_as_the_offline_reference_does():
    parts = [batch(3), batch(4)]
    parts[1][0]["prev_logprobs"][0, 3] = parts[1][0]["generation_logprobs"][0, 3] - 400.0
    parts[1][0]["token_mask"][0, 3] = 1
    got = step(nm.MismatchMetricsLoss(PgStandin()), parts)
    ref = offline(parts, "prev_logprobs")
    assert ref["jetrl/mismatch/nonfinite_tokens"] == 1
    close(got, ref)
    raw = step(nm.MismatchMetricsLoss(PgStandin()), parts, proxy=False)  # the control
    assert abs(raw["jetrl/mismatch/is_ratio_mean"] - ref["jetrl/mismatch/is_ratio_mean"]) > 1e-3


def test_a_step_without_a_usable_token_logs_nan_not_zero():
    parts = [batch(7)]
    data = parts[0][0]
    data["prev_logprobs"] = data["generation_logprobs"] - 400.0  # every token unusable
    got = step(nm.MismatchMetricsLoss(PgStandin()), parts)
    assert got["jetrl/mismatch/num_valid_tokens"] == 0 < got["jetrl/mismatch/nonfinite_tokens"]
    assert all(math.isnan(got[k]) for k in nm.ADDITIVE_MEANS)


def test_a_step_of_several_global_batches_logs_the_token_mean_of_all_of_them():
    """NeMo-RL sums the loss metrics over each global batch's micro-batches and the global
    batches, then divides by their number (megatron_policy_worker.py, both trees). Normalised by
    each global batch's ``global_valid_toks`` (as before), a step of a 40-token and a 4-token
    global batch (2 unusable) logged neither the token mean nor the mean of the two means."""
    big, small = [batch(11, b=4, t=11)], [batch(12, b=1, t=11)]
    small[0][0]["token_mask"][:] = 0
    small[0][0]["token_mask"][0, 1:5] = 1  # 4 tokens, 2 of them unusable
    small[0][0]["prev_logprobs"][0, 1:3] = small[0][0]["generation_logprobs"][0, 1:3] - 400.0
    loss = nm.MismatchMetricsLoss(PgStandin())
    per_batch = [step(loss, parts, proxy=False) for parts in (big, small)]
    summed = {k: (per_batch[0][k] + per_batch[1][k]) / 2 for k in per_batch[0]}  # / G
    got = nm.usable_token_means(summed)
    ref = offline(big + small, "prev_logprobs")
    assert ref["jetrl/mismatch/nonfinite_tokens"] == 2
    for k in nm.ADDITIVE_MEANS:
        assert got[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-12), k
    assert got["jetrl/mismatch/num_valid_tokens"] == ref["jetrl/mismatch/num_valid_tokens"] / 2


def test_a_step_whose_samples_are_all_masked_logs_nan_not_zero():
    """NeMo-RL zeroes ``sample_mask`` for truncated responses (overlong filtering): a step with
    no valid token logged 0.0 for every token mean (its non-finite count was 0 too)."""
    parts = [batch(13)]
    parts[0][0]["sample_mask"] = torch.zeros(4, dtype=torch.float64)
    got = step(nm.MismatchMetricsLoss(PgStandin()), parts)
    assert got["jetrl/mismatch/num_valid_tokens"] == 0 == got["jetrl/mismatch/nonfinite_tokens"]
    assert all(math.isnan(got[k]) for k in nm.ADDITIVE_MEANS)


def test_the_ratio_bounds_are_every_backends_and_checked_on_the_driver():
    """The local backend and the offline recompute use DEFAULT_RATIO_BOUNDS; the NeMo-RL
    wrapper had (0, 2) or loss_fn's TIS keys, so is_ratio_frac_below was always 0 there and a
    ratio_min above the ratio (ignored by NeMo-RL without a TIS type) crashed every worker's
    first loss call."""
    assert nm.MismatchMetricsLoss(PgStandin()).ratio_bounds == (0.5, 2.0)  # literal: the docs'
    with pytest.raises(ValueError, match=r"0 <= min <= max"):
        nm.MismatchMetricsLoss(PgStandin(), (2.5, 2.0))
    with pytest.raises(ValueError, match=r"0 <= min <= max"):
        nm.MismatchMetricsLoss(PgStandin(), (-0.5, 2.0))


@pytest.mark.nemo_rl
def test_nemo_rls_own_loss_with_force_on_policy_ratio():
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True)
    parts = []
    for seed in (5, 6):
        data, curr = batch(seed)
        data["prev_logprobs"] = torch.zeros_like(curr)  # grpo_train's, under the flag
        data["advantages"] = torch.ones_like(curr)
        parts.append((BatchedDataDict(data), curr))
    got = step(nm.MismatchMetricsLoss(ClippedPGLossFn(cfg)), parts)
    close(got, offline(parts, None))


def _batch(seed, b=3, t=9):
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    prev = gen + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.2
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    return {
        "generation_logprobs": gen,
        "prev_logprobs": prev,
        "token_mask": mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0][:b]),
    }


class _FakePG:
    """Stands in for NeMo-RL's ClippedPGLossFn (its attributes and call signature)."""

    input_type = "LOGPROB"
    loss_type = "TOKEN_LEVEL"

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        return next_token_logprobs.sum() * 0 + 1.5, {"loss": 1.5, "token_mult_prob_error": 1.0}


def test_loss_wrapper_sums_to_step_token_means():
    parts = [_batch(1), _batch(2)]
    ratio_bounds = (0.5, 1.5)
    whole = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    vm = (whole["token_mask"][:, 1:] * whole["sample_mask"][:, None]).sum()
    wrapped = pickle.loads(pickle.dumps(nm.MismatchMetricsLoss(_FakePG(), ratio_bounds)))
    assert wrapped.input_type == "LOGPROB" and wrapped.loss_type == "TOKEN_LEVEL"
    summed: dict[str, float] = {}
    for p in parts:
        loss, m = wrapped(
            next_token_logprobs=torch.zeros(3, 8),
            data=p,
            global_valid_seqs=torch.tensor(4.0),
            global_valid_toks=vm,
        )
        assert loss.item() == 1.5 and m["loss"] == 1.5
        for k in nm.ADDITIVE_MEANS + nm.TOKEN_COUNTS:
            summed[k] = summed.get(k, 0.0) + m[k]
    ref = mismatch_metrics(
        whole["generation_logprobs"][:, 1:],
        whole["prev_logprobs"][:, 1:],
        whole["token_mask"][:, 1:],
        whole["sample_mask"],
        ratio_bounds=ratio_bounds,
    )
    logged = nm.usable_token_means(summed)  # what the logger proxy hands NeMo-RL's logger
    for k in nm.ADDITIVE_MEANS + nm.TOKEN_COUNTS:
        assert logged[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-12), k
    assert logged["jetrl/mismatch/num_valid_tokens"] == float(vm)


def test_logger_proxy_moves_our_tags_out_of_train_prefix():
    calls = []
    inner = types.SimpleNamespace(
        log_metrics=lambda m, step, prefix="", *a, **k: calls.append((dict(m), step, prefix)),
        log_dir="/x",
    )
    proxy = nm.JetrlLoggerProxy(inner)
    proxy.log_metrics({"loss": 1.0, "jetrl/mismatch/k1_kl": 0.1}, 3, prefix="train")
    assert calls == [({"loss": 1.0}, 3, "train"), ({"jetrl/mismatch/k1_kl": 0.1}, 3, "")]
    assert proxy.log_dir == "/x"


# The GPU end-to-end run's settings (one GPU): the NeMo-RL tier drives grpo.setup with them too.
