"""The reward options (``rewards.importance``, ``rewards.rescale``, ``rewards.grounding``,
``rewards.ratio_reference``; docs/method.md, "Reward options"), checked against hand
derivations. ``RewardOptions()`` is the paper's reading, which
tests/hisr_core/rewards/test_modulation.py pins; the params default to it but for the grounding
penalty, chosen by the credit table."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hisr_core.config import PpoParams, RewardsParams
from hisr_core.rewards.modulation import (
    PAPER,
    RewardOptions,
    fused_turn_rewards,
    grounding,
    modulate,
    segment_importance,
    trajectory_rewards,
    variant_rewards,
)
from hisr_core.rl.loop import fuse, needs
from tests.hisr_core.rewards.helpers import spans, t


def test_defaults_are_the_papers_reading_but_the_grounding_penalty():
    # The grounding default was chosen by the credit table (docs/method.md, "Reward options").
    assert PAPER == RewardOptions("paper", "l1", "bonus")
    assert RewardOptions.of(RewardsParams()) == RewardOptions("paper", "l1", "penalty")
    assert RewardOptions.of(RewardsParams(importance="length_neutral", rescale="signed_total",
                                          grounding="penalty")) == \
        RewardOptions("length_neutral", "signed_total", "penalty")


# -- rewards.importance ----------------------------------------------------------------------------
@pytest.mark.parametrize("lengths", [(1, 3), (2, 1, 4), (5,), (1, 1, 1)])
@pytest.mark.parametrize("rescale", ["l1", "signed_total"])
def test_length_neutral_with_equal_log_ratios_leaves_r_hat(lengths, rescale):
    # Equal log-ratios: every turn weighs 1/m, z_hat(s_i) = |s_i| / m = the share, so
    # u_i = 1 and z_hat'(s_i) = 1/n. m = r_hat / n is rescaled back to r_hat (l1: scale n;
    # signed_total: each sign's part, scale n too).
    m, n = sum(lengths), len(lengths)
    r_hat = t(0.3, -0.2, 0.5, 0.1, -0.4)[:n]
    for value in (0.0, 1.7, -3.0):
        z = segment_importance(torch.full((m,), value), spans(*lengths), "length_neutral")
        assert torch.allclose(z, torch.full((n,), 1 / n, dtype=torch.float64))
        assert torch.allclose(modulate(r_hat, z, rescale), r_hat)
    # The paper's sum rule instead weighs by length (lengths 1 and 3: 1/4 and 3/4).
    if lengths == (1, 3):
        z = segment_importance(torch.zeros(4), spans(1, 3))
        assert not torch.allclose(modulate(r_hat, z), r_hat)


def test_length_neutral_differs_from_paper_by_hand():
    # Turns 0-1 in segment 0, turn 2 in segment 1; log-ratios (0, 0, ln 2): softmax weights
    # (1, 1, 2) / 4. paper: z_hat = (1/4 + 1/4, 1/2) = (0.5, 0.5).
    # length_neutral: shares (2/3, 1/3); u = (0.5 / (2/3), 0.5 / (1/3)) = (0.75, 1.5);
    # z_hat' = u / 2.25 = (1/3, 2/3).
    lr, segs = t(0.0, 0.0, math.log(2)), spans(2, 1)
    assert torch.allclose(segment_importance(lr, segs), t(0.5, 0.5))
    z = segment_importance(lr, segs, "length_neutral")
    assert torch.allclose(z, t(1 / 3, 2 / 3))
    # r_hat = (0.2, 0.6): m = (0.2/3, 0.4) = (1/15, 6/15), sum|m| = 7/15, sum|r_hat| = 0.8,
    # r_him = m * 0.8 * 15/7 = (0.8/7, 4.8/7); the paper's z gives r_him = r_hat = (0.2, 0.6).
    assert torch.allclose(modulate(t(0.2, 0.6), z), t(0.8 / 7, 4.8 / 7))
    assert torch.allclose(modulate(t(0.2, 0.6), segment_importance(lr, segs)), t(0.2, 0.6))


def test_length_neutral_does_not_overflow():
    # softmax(1000, 0, -1000, 999) = (e, ~0, ~0, 1) / (1 + e); segments (1, 2, 1), shares
    # (1/4, 1/2, 1/4): u = 4 e / (1 + e), ~0, 4 / (1 + e) → z_hat' = (e, 0, 1) / (1 + e).
    z = segment_importance(t(1000.0, 0.0, -1000.0, 999.0), spans(1, 2, 1), "length_neutral")
    assert torch.isfinite(z).all()
    assert torch.allclose(z, t(math.e / (1 + math.e), 0.0, 1 / (1 + math.e)))
    with pytest.raises(ValueError, match="importance"):
        segment_importance(t(0.0), spans(1), "other")  # type: ignore[arg-type]


# -- rewards.rescale -------------------------------------------------------------------------------
def test_signed_total_keeps_each_signs_total_on_a_mixed_case():
    # r_hat = (0.5, 0.5, -0.3, -0.3), z = (0.1, 0.3, 0.2, 0.4): m = (0.05, 0.15, -0.06, -0.12).
    # Positive part: sum r_hat = 1, sum m = 0.2, scale 5 → (0.25, 0.75).
    # Negative part: sum r_hat = -0.6, sum m = -0.18, scale 10/3 → (-0.2, -0.4).
    # sum r_him = 0.4 = sum r_hat, and sum|r_him| = 1.6 = sum|r_hat|.
    r_hat, z = t(0.5, 0.5, -0.3, -0.3), t(0.1, 0.3, 0.2, 0.4)
    signed = modulate(r_hat, z, "signed_total")
    assert torch.allclose(signed, t(0.25, 0.75, -0.2, -0.4))
    assert float(signed.sum()) == pytest.approx(0.4)
    assert float(signed.abs().sum()) == pytest.approx(1.6)
    # l1 unchanged: sum|m| = 0.38, scale 1.6 / 0.38; the signed total moves 0.4 → 0.08/0.95.
    l1 = modulate(r_hat, z, "l1")
    assert torch.allclose(l1, t(0.05, 0.15, -0.06, -0.12) * (1.6 / 0.38))
    assert float(l1.sum()) == pytest.approx(0.032 / 0.38)


def test_signed_total_is_stable_when_the_modulated_signed_sum_is_zero():
    # r_hat = (0.3, 0.3, -0.4), z = (1, 3, 3) / 7: m = (0.3, 0.9, -1.2) / 7, sum m = 0, so
    # rescaling by sum r_hat / sum m would divide by zero. Parts: positive sum m = 1.2/7,
    # scale 0.6 * 7 / 1.2 = 3.5 → (0.15, 0.45); negative alone keeps -0.4.
    # sum r_him = 0.2 = sum r_hat. (l1: scale 1 / (2.4/7) → (0.125, 0.375, -0.5), total 0.)
    r_hat, z = t(0.3, 0.3, -0.4), t(1.0, 3.0, 3.0) / 7
    assert abs(float((r_hat * z).sum())) < 1e-15
    out = modulate(r_hat, z, "signed_total")
    assert torch.isfinite(out).all()
    assert torch.allclose(out, t(0.15, 0.45, -0.4))
    assert float(out.sum()) == pytest.approx(0.2)
    assert torch.allclose(modulate(r_hat, z, "l1"), t(0.125, 0.375, -0.5))
    # The signed modulated sum of the other sign than sum r_hat: z = (0.05, 0.05, 0.9),
    # m = (0.015, 0.015, -0.36), sum m = -0.33 < 0 < 0.2 = sum r_hat. Positive part: scale
    # 0.6 / 0.03 = 20 → (0.3, 0.3); negative part kept: r_him = r_hat, total 0.2.
    out = modulate(r_hat, t(0.05, 0.05, 0.9), "signed_total")
    assert torch.allclose(out, r_hat) and float(out.sum()) == pytest.approx(0.2)


def test_signed_total_edge_cases():
    # A part whose modulated mass is ~0 keeps its r_hat (z underflowed to 0 on the positives):
    # positives (0.4, 0.2) keep theirs; the negative alone keeps -0.1; zeros stay 0.
    assert torch.allclose(modulate(t(0.4, 0.2, -0.1, 0.0), t(0.0, 0.0, 0.7, 0.3),
                                   "signed_total"), t(0.4, 0.2, -0.1, 0.0))
    # All ~0 (a failed trajectory): not inflated, as with l1.
    tiny = t(1e-12, -1e-12)
    assert torch.equal(modulate(tiny, t(0.9, 0.1), "signed_total"), tiny)
    assert torch.equal(modulate(t(0.0, 0.0), t(0.9, 0.1), "signed_total"), t(0.0, 0.0))
    with pytest.raises(ValueError, match="rescale"):
        modulate(t(1.0), t(1.0), "l2")  # type: ignore[arg-type]


@pytest.mark.parametrize("importance", ["paper", "length_neutral"])
def test_one_signed_r_hat_rescales_the_same_both_ways(importance):
    # All positive (the paper's Table 2 case) or all negative: signed_total's one part is
    # the whole trajectory, sum r_hat = ±sum|r_hat|, so it is the l1 rule exactly.
    z = segment_importance(t(0.3, -1.2, 0.8, 0.0, 2.0), spans(2, 1, 2), importance)
    for r_hat in (t(0.1, 0.3, 0.6), t(-0.2, -0.05, -0.4)):
        assert torch.allclose(modulate(r_hat, z, "signed_total"), modulate(r_hat, z, "l1"))


def test_table_2_case_is_the_same_under_both_rescales():
    # The hand case of test_modulation.test_fused_rewards_and_variants (all positive):
    # z_hat = (0.8, 0.2), r_hat = (0.5, 0.5): m = (0.4, 0.1), sum|m| = 0.5 → r_him = (0.8, 0.2)
    # under both rescales (and the paper's z: importance paper).
    z = segment_importance(t(0.0, math.log(3.0), 0.0), spans(2, 1))
    assert torch.allclose(z, t(0.8, 0.2))
    for rescale in ("l1", "signed_total"):
        assert torch.allclose(modulate(t(0.5, 0.5), z, rescale), t(0.8, 0.2))


# -- rewards.grounding -----------------------------------------------------------------------------
def test_grounding_penalty_by_hand():
    # 3 turns, admissible (yes, no, yes); segments {0, 1} and {2}; segment rewards (0.6, 0.4);
    # alpha = 0.5. bonus: r_g = (1, 0, 1) → 0.5 r_g + 0.5 r on segment ends =
    # (0.5, 0 + 0.3, 0.5 + 0.2). penalty: r_g - 1 = (0, -1, 0) → (0, -0.5 + 0.3, 0 + 0.2).
    adm, segs = [True, False, True], spans(2, 1)
    assert torch.equal(grounding(adm), t(1.0, 0.0, 1.0))
    assert torch.equal(grounding(adm, "penalty"), t(0.0, -1.0, 0.0))
    assert torch.allclose(fused_turn_rewards(t(0.6, 0.4), segs, adm, 0.5), t(0.5, 0.3, 0.7))
    assert torch.allclose(fused_turn_rewards(t(0.6, 0.4), segs, adm, 0.5, "penalty"),
                          t(0.0, -0.2, 0.2))
    # Through variant_rewards: no_him (r_hat as is) gets the penalty; no_agr (alpha = 0) and
    # ppo (the outcome only) do not.
    pen = RewardOptions(grounding="penalty")
    lr = t(0.0, 0.0, 0.0)
    assert torch.allclose(variant_rewards("no_him", t(0.6, 0.4), lr, segs, adm, 0.5, 1.0, pen),
                          t(0.0, -0.2, 0.2))
    assert torch.allclose(variant_rewards("no_agr", t(0.6, 0.4), lr, segs, adm, 0.5, 1.0, pen),
                          variant_rewards("no_agr", t(0.6, 0.4), lr, segs, adm, 0.5, 1.0))
    assert torch.allclose(variant_rewards("ppo", t(0.6, 0.4), lr, segs, adm, 0.5, 1.0, pen),
                          t(0.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="grounding"):
        grounding(adm, "other")  # type: ignore[arg-type]


# -- wiring: the rewards stage's function and PPO's fuse -------------------------------------------
def _case():
    # 3 turns, segments {0, 1} and {2}, one response token per turn, beta = 1; hind - policy
    # = (0, 0, ln 2) as in test_length_neutral_differs_from_paper_by_hand; SPRM per-turn
    # rewards (9, 0.2, 0.6) → r_hat = (0.2, 0.6); admissible (yes, no, yes); alpha = 0.5.
    policy = [t(-1.0), t(-1.0), t(-1.0)]
    hind = [t(-1.0), t(-1.0), t(-1.0 + math.log(2))]
    return policy, hind, t(9.0, 0.2, 0.6), spans(2, 1), [True, False, True]


OPTIONS = RewardOptions("length_neutral", "signed_total", "penalty")
# hisr under OPTIONS: r_him = (0.8/7, 4.8/7) (all positive: signed_total = l1), grounding
# 0.5 * (0, -1, 0) → (0, -0.5 + 0.4/7, 2.4/7).
HISR = t(0.0, -0.5 + 0.4 / 7, 2.4 / 7)


def test_trajectory_rewards_honours_the_options():
    policy, hind, model_r, segs, adm = _case()
    res = trajectory_rewards(policy, hind, model_r, None, segs, adm, 1.0, beta=1.0, alpha=0.5,
                             variants=["hisr", "no_him"], options=OPTIONS)
    assert torch.allclose(res.segment_importance, t(1 / 3, 2 / 3))
    assert torch.allclose(res.r_him, t(0.8 / 7, 4.8 / 7))
    assert torch.allclose(res.variants["hisr"], HISR)
    assert torch.allclose(res.variants["no_him"], t(0.0, -0.5 + 0.1, 0.3))
    default = trajectory_rewards(policy, hind, model_r, None, segs, adm, 1.0, 1.0, 0.5, ["hisr"])
    assert torch.allclose(default.variants["hisr"], t(0.5, 0.1, 0.8))


def test_ppo_fuse_honours_the_options():
    # PPO's step 4 on the same trajectory (the current policy's log-probs as old_logp) gives
    # what the rewards stage gives.
    policy, hind, model_r, segs, adm = _case()
    row = {"turns": [{"admissible": a} for a in adm], "outcome": 1.0}

    def scored():
        return SimpleNamespace(row=row, segments=segs, old_logp=policy, hind_logp=hind,
                               model_r={"sprm": model_r}, turn_rewards=None,
                               per_turn=lambda flat: list(flat))

    sc = scored()
    fuse([sc], "hisr", 1.0, 0.5, OPTIONS)
    assert torch.allclose(sc.turn_rewards, HISR)
    sc = scored()
    fuse([sc], "hisr", 1.0, 0.5)
    assert torch.allclose(sc.turn_rewards, t(0.5, 0.1, 0.8))


# -- rewards.ratio_reference -----------------------------------------------------------------------
def test_ratio_against_pi_ref_reads_pi_refs_log_probs():
    """Online, the policy has moved: it now puts -0.5 on turn 3's token where pi_ref puts -1
    (as pi_hind's block does not know). Against the policy the log-ratios are (0, 0,
    ln 2 - 0.5); against pi_ref they are (0, 0, ln 2), the stage's case above."""
    policy_now, hind, model_r, segs, adm = _case()
    ref = list(policy_now)
    policy_now = [t(-1.0), t(-1.0), t(-0.5)]
    row = {"turns": [{"admissible": a} for a in adm], "outcome": 1.0}

    def scored(ref_logp):
        return SimpleNamespace(row=row, segments=segs, old_logp=policy_now, ref_logp=ref_logp,
                               hind_logp=hind, model_r={"sprm": model_r}, turn_rewards=None,
                               per_turn=lambda flat: list(flat))

    against_ref = scored(ref)
    fuse([against_ref], "hisr", 1.0, 0.5, OPTIONS, ratio_reference="pi_ref")
    assert torch.allclose(against_ref.turn_rewards, HISR)
    against_policy = scored(ref)
    fuse([against_policy], "hisr", 1.0, 0.5, OPTIONS)
    expected = variant_rewards("hisr", t(0.2, 0.6), t(0.0, 0.0, math.log(2) - 0.5), segs, adm,
                               0.5, 1.0, OPTIONS)
    assert torch.allclose(against_policy.turn_rewards, expected)
    assert not torch.allclose(expected, HISR)
    with pytest.raises(ValueError, match="pi_ref's log-probs"):
        fuse([scored(None)], "hisr", 1.0, 0.5, ratio_reference="pi_ref")


def test_ratio_against_pi_ref_scores_pi_ref_online_for_modulated_variants_only():
    cfg = PpoParams(kl_coef=0.0)
    assert needs("hisr", cfg, "pi_ref")["ref"] and needs("no_agr", cfg, "pi_ref")["ref"]
    assert not needs("hisr", cfg)["ref"] and not needs("no_him", cfg, "pi_ref")["ref"]
    assert not needs("hisr", PpoParams(kl_coef=0.0, mode="offline"), "pi_ref")["ref"]
    assert RewardsParams().ratio_reference == "policy"
