"""Hindsight modulation and fused rewards, checked against hand derivations."""

from __future__ import annotations

import math

import pytest
import torch

from hisr_core.rewards.modulation import (
    fused_turn_rewards,
    log_ratio,
    modulate,
    position_mass,
    segment_importance,
    trajectory_rewards,
    turn_importance,
    variant_rewards,
)
from tests.hisr_core.rewards.helpers import spans, t


def test_log_ratio():
    # (1 / (beta L)) sum_j (hind_j - pol_j) = (1 / (0.5 * 2)) * ((-1 + 2) + (-2 + 2)) = 1.
    assert log_ratio(t(-1.0, -2.0), t(-2.0, -2.0), beta=0.5) == pytest.approx(1.0)
    assert log_ratio(t(), t(), beta=1.0) == 0.0
    with pytest.raises(ValueError):
        log_ratio(t(-1.0), t(-1.0, -2.0), 1.0)
    with pytest.raises(ValueError):
        log_ratio(t(-1.0), t(-1.0), 0.0)


def test_uniform_ratios_over_equal_segments_leave_r_hat_unchanged():
    # z_hat = 1/n each; m = r_hat / n; sum|m| = sum|r_hat| / n; r_him = m * n = r_hat.
    r_hat = t(0.2, -0.1, 0.7)
    z = segment_importance(torch.zeros(6), spans(2, 2, 2))
    assert torch.allclose(z, t(1 / 3, 1 / 3, 1 / 3))
    assert torch.allclose(modulate(r_hat, z), r_hat)


def test_uniform_ratios_over_unequal_segments_follow_the_sum_rule():
    # z_k = 1 per turn; z_hat(s_i) = |s_i| / m: lengths 1 and 3 give 1/4 and 3/4.
    z = segment_importance(torch.zeros(4), spans(1, 3))
    assert torch.allclose(z, t(0.25, 0.75))
    # r_hat = (0.4, 0.4): m = (0.1, 0.3), sum|m| = 0.4, sum|r_hat| = 0.8 -> r_him = (0.2, 0.6).
    assert torch.allclose(modulate(t(0.4, 0.4), z), t(0.2, 0.6))


def test_a_failed_trajectory_is_not_inflated():
    # r_hat ~ 0: sum|m| ~ 0, so r_him = r_hat (an L2 or plain normalisation would scale it to 1).
    z = t(0.9, 0.1)
    assert torch.equal(modulate(t(0.0, 0.0), z), t(0.0, 0.0))
    tiny = t(1e-12, -1e-12)
    assert torch.equal(modulate(tiny, z), tiny)
    # A small r_hat keeps its small L1 mass.
    assert modulate(t(0.01, 0.01), z).abs().sum() == pytest.approx(0.02)


def test_mixed_signs():
    # m = (0.5 * 0.2, -0.25 * 0.8) = (0.1, -0.2); sum|m| = 0.3; sum|r_hat| = 0.75;
    # r_him = m * 0.75 / 0.3 = (0.25, -0.5).
    assert torch.allclose(modulate(t(0.5, -0.25), t(0.2, 0.8)), t(0.25, -0.5))


def test_a_single_segment_keeps_its_reward():
    z = segment_importance(t(3.0, -1.0, 0.5), spans(3))
    assert torch.allclose(z, t(1.0))
    assert torch.allclose(modulate(t(0.8), z), t(0.8))


def test_huge_log_ratios_do_not_overflow():
    lr = t(1000.0, 0.0, -1000.0, 999.0)
    w = turn_importance(lr)
    assert torch.isfinite(w).all() and w.sum() == pytest.approx(1.0)
    z = segment_importance(lr, spans(1, 2, 1))
    # softmax(1000, 0, -1000, 999) = (e / (1 + e), ~0, ~0, 1 / (1 + e)).
    assert torch.allclose(z, t(math.e / (1 + math.e), 0.0, 1 / (1 + math.e)))
    assert torch.isfinite(modulate(t(0.3, 0.3, 0.4), z)).all()


def test_fused_rewards_and_variants():
    segs = spans(2, 1)
    admissible = [True, False, True]
    # alpha r_g on every turn; (1 - alpha) r_i on each segment's last turn (turns 1 and 2).
    fused = fused_turn_rewards(t(0.6, 0.4), segs, admissible, alpha=0.5)
    assert torch.allclose(fused, t(0.5, 0.0 + 0.3, 0.5 + 0.2))
    lr = t(0.0, math.log(3.0), 0.0)  # z = (1, 3, 1) / 5 -> z_hat = (0.8, 0.2)
    r_hat = t(0.5, 0.5)  # m = (0.4, 0.1), sum|m| = 0.5, sum|r_hat| = 1 -> r_him = (0.8, 0.2)
    hisr = variant_rewards("hisr", r_hat, lr, segs, admissible, 0.5, 1.0)
    assert torch.allclose(hisr, t(0.5, 0.4, 0.5 + 0.1))
    no_him = variant_rewards("no_him", r_hat, lr, segs, admissible, 0.5, 1.0)
    assert torch.allclose(no_him, t(0.5, 0.25, 0.75))
    no_agr = variant_rewards("no_agr", r_hat, lr, segs, admissible, 0.5, 1.0)
    assert torch.allclose(no_agr, t(0.0, 0.8, 0.2))
    assert torch.allclose(variant_rewards("ppo", r_hat, lr, segs, admissible, 0.5, 1.0),
                          t(0.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="2 log-ratios"):
        variant_rewards("hisr", r_hat, lr[:2], segs, admissible, 0.5, 1.0)


def test_trajectory_rewards_by_hand():
    """3 turns, segments {0, 1} and {2}; one response token per turn, beta = 1.

    Log-ratios: hind - policy = (0, 0, ln 2) → z = (1, 1, 2) / 4 → segment importance
    (0.5, 0.5). SPRM rewards read at each segment's last turn: r_hat = (r[1], r[2]) =
    (0.2, 0.6); m = r_hat * z = (0.1, 0.3), sum|m| = 0.4, sum|r_hat| = 0.8 → r_him = m * 2 =
    (0.2, 0.6). hisr with alpha = 0.5, grounding (1, 0, 1): 0.5 * r_g on every turn plus
    0.5 * r_him on segment ends → (0.5, 0.1, 0.5 + 0.3). no_spr: the turn model's
    r' = (0.1, 0.1, 0.8) times the turn importance (0.25, 0.25, 0.5) → m = (0.025, 0.025, 0.4),
    rescaled by sum|r'| / sum|m| = 1 / 0.45.
    """
    policy = [t(-1.0), t(-1.0), t(-1.0)]
    hind = [t(-1.0), t(-1.0), t(-1.0 + math.log(2))]
    segs = spans(2, 1)
    res = trajectory_rewards(policy, hind, t(9.0, 0.2, 0.6), t(0.1, 0.1, 0.8), segs,
                             [True, False, True], 1.0, beta=1.0, alpha=0.5,
                             variants=["hisr", "no_him", "no_spr", "no_both", "no_agr", "ppo"])
    assert torch.allclose(res.log_ratios, t(0, 0, math.log(2)))
    assert torch.allclose(res.turn_importance, t(0.25, 0.25, 0.5))
    assert torch.allclose(res.r_hat, t(0.2, 0.6))
    assert torch.allclose(res.segment_importance, t(0.5, 0.5))
    assert torch.allclose(res.r_him, t(0.2, 0.6))
    assert torch.allclose(res.variants["hisr"], t(0.5, 0.1, 0.8))
    assert torch.allclose(res.variants["no_him"], t(0.5, 0.1, 0.8))
    assert torch.allclose(res.variants["no_agr"], t(0.0, 0.2, 0.6))
    scale = 1.0 / 0.45
    assert torch.allclose(res.variants["no_spr"],
                          0.5 * t(1, 0, 1) + 0.5 * t(0.025, 0.025, 0.4) * scale)
    assert torch.allclose(res.variants["no_both"], 0.5 * t(1, 0, 1) + 0.5 * t(0.1, 0.1, 0.8))
    assert torch.allclose(res.variants["ppo"], t(0, 0, 1))
    with pytest.raises(ValueError, match="turn-level"):
        trajectory_rewards(policy, hind, t(0, 0.2, 0.6), None, segs, [True] * 3, 1.0, 1.0, 0.5,
                           ["no_spr"])
    with pytest.raises(ValueError, match="for 3 turns"):
        trajectory_rewards(policy[:2], hind, t(0, 0.2, 0.6), None, segs, [True] * 3, 1.0, 1.0,
                           0.5, ["hisr"])


def test_position_mass():
    # |(-1, 2, 3, 0.5)|: first 1, middle 2 + 3, last 0.5.
    assert torch.allclose(position_mass(t(-1, 2, 3, 0.5)), t(1, 5, 0.5))
    assert torch.allclose(position_mass(t(1, 0, 2)), t(1, 0, 2))
    with pytest.raises(ValueError):
        position_mass(t(1, 2))

