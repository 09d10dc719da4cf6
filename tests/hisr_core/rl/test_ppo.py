"""The PPO math (hisr_core/rl/ppo.py): hand-derived cases, masked positions, loop vs vectorised."""

from __future__ import annotations

import math

import pytest
import torch

from hisr_core.rl.ppo import (
    entropy_from_logits,
    explained_variance,
    gae,
    gae_reference,
    group_advantages,
    kl_penalty,
    masked_moments,
    place_turn_rewards,
    policy_loss,
    value_loss,
    whiten,
)


def test_gae_by_hand_with_observation_tokens_interleaved():
    # Positions: 0 obs, 1 resp (turn 1), 2 resp (turn 1, last), 3 obs, 4 obs, 5 resp (turn 2).
    # gamma = 0.9, lam = 0.5 (gamma * lam = 0.45); V1 = 0.5, V2 = 0.2, V5 = 0.4; r2 = 1, r5 = 2.
    # t5: delta = 2 + 0 - 0.4 = 1.6;            A5 = 1.6;                        G5 = 2.0
    # t2: delta = 1 + 0.9*0.4 - 0.2 = 1.16;     A2 = 1.16 + 0.45*1.6 = 1.88;     G2 = 2.08
    # t1: delta = 0 + 0.9*0.2 - 0.5 = -0.32;    A1 = -0.32 + 0.45*1.88 = 0.526;  G1 = 1.026
    # (the recursion steps from t2 straight to t5: the observation tokens 3, 4 are skipped)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1]], dtype=torch.bool)
    values = torch.tensor([[9.0, 0.5, 0.2, 9.0, 9.0, 0.4]])
    rewards = torch.tensor([[5.0, 0.0, 1.0, 5.0, 5.0, 2.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    expected_adv = torch.tensor([[0.0, 0.526, 1.88, 0.0, 0.0, 1.6]], dtype=torch.float64)
    expected_ret = torch.tensor([[0.0, 1.026, 2.08, 0.0, 0.0, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)


def test_gae_with_gamma_and_lambda_one_is_return_to_go_minus_value():
    # gamma = lam = 1: A_t = sum of rewards from t on - V_t (the value terms telescope).
    mask = torch.tensor([[1, 0, 1, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[0.3, 0.0, -0.2, 0.7, 0.0]])
    rewards = torch.tensor([[1.0, 0.0, 0.5, 2.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv[0, [0, 2, 3]], torch.tensor([3.5 - 0.3, 2.5 + 0.2, 2.0 - 0.7],
                                                               dtype=torch.float64))
    torch.testing.assert_close(ret[0, [0, 2, 3]], torch.tensor([3.5, 2.5, 2.0], dtype=torch.float64))


@pytest.mark.parametrize("seed", range(5))
def test_masked_positions_never_change_advantages_or_returns(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 17
    mask = torch.rand(B, T, generator=g) < 0.6
    values = torch.randn(B, T, generator=g)
    rewards = torch.randn(B, T, generator=g)
    adv, ret = gae(rewards, values, mask, 0.97, 0.9)
    noisy_v = torch.where(mask, values, torch.randn(B, T, generator=g) * 100)
    noisy_r = torch.where(mask, rewards, torch.randn(B, T, generator=g) * 100)
    noisy_v[~mask] = float("nan") if seed % 2 else noisy_v[~mask]
    adv2, ret2 = gae(noisy_r, noisy_v, mask, 0.97, 0.9)
    torch.testing.assert_close(adv, adv2)
    torch.testing.assert_close(ret, ret2)
    assert bool((adv[~mask] == 0).all()) and bool((ret[~mask] == 0).all())


@pytest.mark.parametrize("seed", range(8))
def test_loop_and_vectorised_gae_agree(seed):
    g = torch.Generator().manual_seed(100 + seed)
    B, T = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    mask = torch.rand(B, T, generator=g) < 0.5
    values, rewards = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    gamma, lam = float(torch.rand(1, generator=g)), float(torch.rand(1, generator=g))
    for a, b in zip(gae(rewards, values, mask, gamma, lam),
                    gae_reference(rewards, values, mask, gamma, lam), strict=True):
        torch.testing.assert_close(a, b)


def test_whiten_uses_only_masked_entries_and_global_moments():
    x = torch.tensor([[1.0, 100.0, 3.0], [5.0, -7.0, 7.0]])
    mask = torch.tensor([[1, 0, 1], [1, 0, 1]], dtype=torch.bool)
    # masked-in: 1, 3, 5, 7 → mean 4, unbiased var = (9 + 1 + 1 + 9) / 3 = 20/3
    w = whiten(x, mask)
    sd = math.sqrt(20 / 3)
    torch.testing.assert_close(w, torch.tensor([[-3 / sd, 0.0, -1 / sd], [1 / sd, 0.0, 3 / sd]],
                                               dtype=torch.float64))
    # Two halves' moments summed (as processes do) give the same whitening as one batch.
    top, bottom = masked_moments(x[:1], mask[:1]), masked_moments(x[1:], mask[1:])
    torch.testing.assert_close(whiten(x[:1], mask[:1], top + bottom), w[:1])
    with pytest.raises(ValueError, match=">= 2"):
        whiten(x, torch.zeros_like(mask))


def test_policy_loss_clips_only_in_the_direction_the_advantage_pushes():
    # eps = 0.2. Token 0: A = +1, rho = 1.5 → the clipped term -1.2 is larger than -1.5: taken.
    # Token 1: A = +1, rho = 0.5 → -0.5 vs clip -0.8: the unclipped -0.5 is larger (no clip).
    # Token 2: A = -1, rho = 0.5 → 0.5 vs clip 0.8: clipped taken. Token 3: A = -1, rho = 1.5 →
    # 1.5 vs 1.2: unclipped.
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5])
    old = torch.zeros(4)
    loss, clipped = policy_loss(torch.log(ratio), old, adv, clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, 0.8, 1.5]))
    assert clipped.tolist() == [True, False, True, False]
    # At rho = 1 the gradient is -A (d/dlogp of -A * exp(logp - old)).
    logp = torch.zeros(4, requires_grad=True)
    policy_loss(logp, old, adv, 0.2)[0].sum().backward()
    torch.testing.assert_close(logp.grad, -adv)


def test_value_loss_by_hand():
    # V_old = 0, V = 1, G = 2, c = 0.2: plain (1-2)^2 = 1; V_clip = 0.2, (0.2-2)^2 = 3.24 → 1.62.
    # V = 1.9: plain 0.01, V_clip 0.2 → 3.24 taken. V = 0.1: inside the clip, both 3.61.
    v = torch.tensor([1.0, 1.9, 0.1])
    loss, clipped = value_loss(v, torch.zeros(3), torch.full((3,), 2.0), clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([1.62, 1.62, 1.805]))
    assert clipped.tolist() == [True, True, False]
    plain, _ = value_loss(v, torch.zeros(3), torch.full((3,), 2.0), clip=None)
    torch.testing.assert_close(plain, 0.5 * (v - 2.0) ** 2)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = ref - logp  # [-0.5, 1.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.125, 0.5]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.exp(d) - 1 - d)
    assert float(kl_penalty(torch.tensor([-50.0]), torch.tensor([0.0]), "k3")) == 10.0
    assert bool((kl_penalty(logp, logp, "k3") == 0).all())
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_entropy_from_logits():
    uniform = entropy_from_logits(torch.zeros(2, 8))
    torch.testing.assert_close(uniform, torch.full((2,), math.log(8)))
    peaked = entropy_from_logits(torch.tensor([[1000.0, 0.0, 0.0]]))
    assert float(peaked) == pytest.approx(0.0, abs=1e-6)


def test_group_advantages_by_hand():
    # Group 0: R = 1, 0, 0, 1 → mean 0.5, unbiased std = sqrt(1/3); group 1 has one member.
    out = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0, 1]))
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(out, torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0],
                                                 dtype=torch.float64), atol=1e-5, rtol=1e-5)
    same = group_advantages(torch.tensor([1.0, 1.0]), torch.tensor([3, 3]))
    assert same.tolist() == [0.0, 0.0]


def test_turn_rewards_go_on_each_turns_last_token():
    owners = torch.tensor([0, 0, 0, 1, 2, 2])
    out = place_turn_rewards(torch.tensor([0.1, 0.2, 0.3]), owners)
    torch.testing.assert_close(out, torch.tensor([0, 0, 0.1, 0.2, 0, 0.3], dtype=torch.float64))
    with pytest.raises(ValueError, match="turn order"):
        place_turn_rewards(torch.tensor([0.1, 0.2]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="2 turn rewards"):
        place_turn_rewards(torch.tensor([0.1, 0.2]), torch.tensor([0, 2]))


def test_explained_variance_by_hand():
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0])  # variance 1.25
    assert explained_variance(returns.clone(), returns) == 1.0
    assert explained_variance(torch.full((4,), 2.5), returns) == pytest.approx(0.0)
    # Residuals 1 0 0 -1: variance 0.5, so 1 - 0.5 / 1.25 = 0.6.
    assert explained_variance(torch.tensor([0.0, 2.0, 3.0, 5.0]), returns) == pytest.approx(0.6)
    assert math.isnan(explained_variance(torch.zeros(3), torch.ones(3)))
    with pytest.raises(ValueError, match="two"):
        explained_variance(torch.zeros(3), torch.zeros(4))
