"""Importance-sampling correction: worked weights per mode, NaN/Inf handling, NeMo-RL validation."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from nemo_jetrl.rl.correction import (
    CorrectionConfig,
    CorrectionConfigError,
    validate_loss_fn_cfg,
)
from nemo_jetrl.rl.weights import importance_weights

NAN = float("nan")
J = "jetrl/mismatch/"


def batch():
    """Two rows of 3 positions; ratios rho = exp(prev - gen) on valid tokens:
    row 0: rho = 0.5, 2    (position 2 is padding holding NaN)
    row 1: rho = 2, 4, 1
    gen = 0 everywhere valid, prev = ln(rho).
    """
    ln = math.log
    prev = torch.tensor([[ln(0.5), ln(2.0), NAN], [ln(2.0), ln(4.0), 0.0]], dtype=torch.float64)
    gen = torch.tensor([[0.0, 0.0, 5.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    tm = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return gen, prev, tm


def run(cfg, sm=None):
    gen, prev, tm = batch()
    return importance_weights(gen, prev, tm, sm, config=cfg)


def close(t, rows):
    torch.testing.assert_close(t, torch.tensor(rows, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_none_weights_are_one_but_ratio_is_reported():
    r = run(CorrectionConfig())
    close(r.weights, [[1, 1, 0], [1, 1, 1]])
    # NeMo-RL reports the raw mean ratio even with the correction off: (.5+2+2+4+1)/5 = 1.9
    assert r.stats["train/sampling_importance_ratio"] == pytest.approx(1.9)
    assert "train/is_oob_ratio" not in r.stats


def test_token_is_raw_ratios():
    r = run(CorrectionConfig.for_mode("token"))
    close(r.weights, [[0.5, 2, 0], [2, 4, 1]])
    # ess = (9.5)^2 / (5 * (.25+4+4+16+1)) = 90.25 / 126.25
    assert r.stats[J + "is_weight_ess"] == pytest.approx(90.25 / 126.25)


def test_tis_clamps_and_min_defaults_to_zero():
    r = run(CorrectionConfig.for_mode("tis", ratio_max=2.0))
    close(r.weights, [[0.5, 2, 0], [2, 2, 1]])
    assert r.stats["train/is_oob_ratio"] == pytest.approx(1 / 5)  # only 4 > 2
    assert r.stats["train/sampling_importance_ratio"] == pytest.approx(7.5 / 5)
    r = run(CorrectionConfig.for_mode("tis", ratio_max=2.0, ratio_min=0.8))
    close(r.weights, [[0.8, 2, 0], [2, 2, 1]])
    assert r.stats["train/is_oob_ratio"] == pytest.approx(2 / 5)  # 0.5 and 4


def test_icepop_zeroes_outside():
    r = run(CorrectionConfig.for_mode("icepop", ratio_max=2.0, ratio_min=0.8))
    close(r.weights, [[0, 2, 0], [2, 0, 1]])
    assert r.stats["train/is_oob_ratio"] == pytest.approx(2 / 5)
    assert r.stats[J + "is_zeroed_frac"] == pytest.approx(2 / 5)


def test_seq_mask_tis_drops_whole_sequences_keeps_raw_weights():
    # geometric means: row0 sqrt(.5 * 2) = 1 (kept), row1 (2*4*1)^(1/3) = 2 (dropped by max 1.5)
    r = run(CorrectionConfig.for_mode("seq-mask-tis", ratio_max=1.5, ratio_min=0.9))
    close(r.weights, [[0.5, 2, 0], [0, 0, 0]])
    assert r.stats["train/is_oob_ratio"] == pytest.approx(1 / 2)  # sequences
    # bounds [0.5, 2.5]: both kept, raw (not truncated) weights
    r = run(CorrectionConfig.for_mode("seq-mask-tis", ratio_max=2.5, ratio_min=0.5))
    close(r.weights, [[0.5, 2, 0], [2, 4, 1]])


def test_sequence_level_is():
    # w_s = prod rho: row0 .5*2 = 1, row1 2*4*1 = 8
    r = run(CorrectionConfig.for_mode("sequence"))
    close(r.weights, [[1, 1, 0], [8, 8, 8]])
    assert r.stats["train/sampling_importance_ratio"] == pytest.approx(4.5)  # (1 + 8) / 2
    r = run(CorrectionConfig.for_mode("sequence", ratio_max=5.0))  # tis on w_s
    close(r.weights, [[1, 1, 0], [5, 5, 5]])
    assert r.stats["train/sampling_importance_ratio"] == pytest.approx(3.0)
    # is_oob_ratio is token-weighted like NeMo-RL's (the 3 tokens of row 1 are out): 3/5
    assert r.stats["train/is_oob_ratio"] == pytest.approx(3 / 5)


def test_sample_mask_drops_rows():
    r = run(CorrectionConfig.for_mode("token"), sm=torch.tensor([0, 1]))
    close(r.weights, [[0, 0, 0], [2, 4, 1]])
    assert r.stats["train/sampling_importance_ratio"] == pytest.approx(7 / 3)


def test_nan_and_inf_ratios_become_zero_and_are_counted():
    # valid tokens: NaN gen (unusable); d = 100 overflows float32 (e^100 > 3.4e38);
    # prev = -inf (unusable: a logprob must be finite); d = 0 -> 1
    gen = torch.tensor([[NAN, -100.0, 0.0, -1.0]], dtype=torch.float32)
    prev = torch.tensor([[-1.0, 0.0, -math.inf, -1.0]], dtype=torch.float32)
    r = importance_weights(gen, prev, torch.ones(1, 4), config=CorrectionConfig.for_mode("token"))
    assert r.weights.dtype == torch.float32
    assert r.weights.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    assert r.stats[J + "is_nonfinite_weights"] == 3.0
    assert all(math.isfinite(v) for v in r.stats.values())
    # same inputs in float64: e^100 fits, only the NaN and the -inf are counted
    r64 = importance_weights(
        gen.double(), prev.double(), torch.ones(1, 4), config=CorrectionConfig.for_mode("token")
    )
    assert r64.stats[J + "is_nonfinite_weights"] == 2.0
    assert r64.weights[0, 1] == pytest.approx(math.exp(100.0))


def test_unusable_tokens_get_zero_in_every_mode_even_under_tis_ratio_min():
    # d = NaN (gen NaN), d = -800 and d = +800 (beyond LOG_RATIO_LIMIT, both directions), d = ln 3
    gen = torch.tensor([[NAN, -100.0, -900.0, 0.0]], dtype=torch.float64)
    prev = torch.tensor([[-1.0, -900.0, -100.0, math.log(3.0)]], dtype=torch.float64)
    tm = torch.ones(1, 4)
    for mode in ("token", "tis", "icepop"):
        cfg = CorrectionConfig.for_mode(mode, ratio_max=2.0, ratio_min=0.5)
        r = importance_weights(gen, prev, tm, config=cfg)
        last = {"token": 3.0, "tis": 2.0, "icepop": 0.0}[mode]
        assert r.weights.tolist() == [[0.0, 0.0, 0.0, pytest.approx(last)]], mode
        assert r.stats[J + "is_nonfinite_weights"] == 3.0, mode
    # seq-mask-tis: unusable tokens count as ratio 1 in the geometric mean (NeMo-RL's rule):
    # geo = exp(ln 3 / 4) = 1.316 is inside [0.5, 2], the sequence is kept, its token keeps 3
    r = importance_weights(
        gen, prev, tm, config=CorrectionConfig.for_mode("seq-mask-tis", ratio_max=2, ratio_min=0.5)
    )
    assert r.weights.tolist() == [[0.0, 0.0, 0.0, pytest.approx(3.0)]]
    # sequence IS: one unusable token zeroes the whole sequence (its product is unmeasurable)
    r = importance_weights(gen, prev, tm, config=CorrectionConfig.for_mode("sequence"))
    assert r.weights.tolist() == [[0.0] * 4]
    assert r.stats[J + "is_nonfinite_weights"] == 1.0


def test_weights_carry_no_gradient():
    gen, prev, tm = batch()
    prev = prev.clone().requires_grad_(True)
    r = importance_weights(gen, prev, tm, config=CorrectionConfig.for_mode("token"))
    assert not r.weights.requires_grad


NEMO_RL_DEFAULTS = {  # examples/configs/grpo_math_1B.yaml loss_fn
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "ratio_clip_c": None,
    "use_on_policy_kl_approximation": False,
    "use_importance_sampling_correction": False,
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_ratio_min": None,
    "sequence_level_importance_ratios": False,
    "token_level_loss": True,
    "force_on_policy_ratio": False,
    "use_kl_in_reward": False,
}


def test_from_loss_fn_cfg_nemo_rl_defaults_and_omegaconf():
    c = CorrectionConfig.from_loss_fn_cfg(NEMO_RL_DEFAULTS)
    assert c == CorrectionConfig() and c.mode == "none"
    cfg = OmegaConf.create(
        {
            **NEMO_RL_DEFAULTS,
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_type": "icepop",
            "truncated_importance_sampling_ratio": 5,
            "truncated_importance_sampling_ratio_min": 0.5,
        }
    )
    c = CorrectionConfig.from_loss_fn_cfg(cfg)
    assert c.mode == "icepop" and c.truncated_importance_sampling_ratio == 5.0
    assert CorrectionConfig.from_loss_fn_cfg(c.to_loss_fn_cfg()) == c


def test_validation_collects_all_errors_naming_keys():
    bad = {
        "truncated_importance_sampling_type": "icepop",  # use_... is false
        "truncated_importance_sampling_ratio": -1.0,  # not positive
        # ratio_min missing for icepop
    }
    with pytest.raises(CorrectionConfigError) as ei:
        CorrectionConfig.from_loss_fn_cfg(bad)
    errs = ei.value.errors
    assert len(errs) == 3
    assert any("loss_fn.use_importance_sampling_correction=true" in e for e in errs)
    assert any("loss_fn.truncated_importance_sampling_ratio must be a positive" in e for e in errs)
    assert any("loss_fn.truncated_importance_sampling_ratio_min must be set" in e for e in errs)


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "clip",
                "truncated_importance_sampling_ratio": 2,
            },
            "must be one of tis, icepop, seq-mask-tis",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 2,
                "truncated_importance_sampling_ratio_min": 3,
            },
            "ratio_min (3.0) must be <=",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 2,
                "truncated_importance_sampling_ratio_min": 0.5,
                "sequence_level_importance_ratios": True,
                "token_level_loss": False,
            },
            "incompatible with loss_fn.truncated_importance_sampling_type='seq-mask-tis'",
        ),
        ({"sequence_level_importance_ratios": True}, "needs loss_fn.token_level_loss=false"),
        (
            {"truncated_importance_sampling_ratio": 2.0},
            "truncated_importance_sampling_type is null",
        ),
        (
            {"truncated_importance_sampling_ratio": "two"},
            "truncated_importance_sampling_ratio got 'two'; expected a finite number",
        ),
        (
            {"use_importance_sampling_correction": "yes"},
            "use_importance_sampling_correction got 'yes'; expected true or false",
        ),
    ],
)
def test_each_nemo_rl_rule(cfg, needle):
    errs = validate_loss_fn_cfg(cfg)
    assert errs and any(needle in e for e in errs), errs
    with pytest.raises(CorrectionConfigError, match="invalid importance-sampling"):
        CorrectionConfig.from_loss_fn_cfg(cfg)


def test_dataclass_is_frozen_and_validates_on_construction():
    c = CorrectionConfig()
    with pytest.raises(AttributeError):
        c.use_importance_sampling_correction = True  # type: ignore[misc]
    with pytest.raises(CorrectionConfigError, match="needs use_importance_sampling_correction"):
        CorrectionConfig(
            truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0
        )


def test_rules_module_and_config_validation_do_not_import_torch():
    # config validation (`jetrl check`) runs the IS rules; they must not pull torch in (~1.6 s)
    import subprocess
    import sys

    code = (
        "import sys, nemo_jetrl.rl.correction, nemo_jetrl.config.validate; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_config_validation_reports_the_same_rules():
    # nemo_jetrl.config.validate calls rl.correction.loss_fn_issues: same keys, same messages
    from nemo_jetrl.rl.correction import loss_fn_issues

    bad = {"sequence_level_importance_ratios": True, "truncated_importance_sampling_ratio": 2.0}
    issues = loss_fn_issues(bad)
    assert [i.key for i in issues] == [
        "loss_fn.sequence_level_importance_ratios",
        "loss_fn.truncated_importance_sampling_ratio",
    ]
    assert validate_loss_fn_cfg(bad) == [str(i) for i in issues]
