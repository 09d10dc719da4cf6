"""The math of multi-turn PPO (docs/method.md, stage 7): GAE over response tokens, whitening, the
clipped policy and value losses, KL to ``pi_ref``, entropy, GRPO's group advantages. Pure
functions of tensors; no I/O, no models.

Notation: B rows of T token positions; ``mask`` [B, T] marks response tokens (the policy's
own). Observation, prompt and padding positions carry no reward, value or TD error: the GAE
recursion steps from one response token straight to the next one (verl's ``response_mask``
handling), so a turn's last token bootstraps from the value of the next turn's first token.
"""

from __future__ import annotations

from typing import Literal

import torch

KlEstimator = Literal["k1", "k2", "k3"]


def _check(mask: torch.Tensor, *xs: torch.Tensor) -> None:
    for x in xs:
        if x.shape != mask.shape:
            raise ValueError(f"shape {tuple(x.shape)} differs from the mask's {tuple(mask.shape)}")


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the masked-in tokens of each row.

    For consecutive response tokens t < t' of a row (t' the next one, none at the end)::

        delta_t = r_t + gamma * V_t' - V_t        (V_t' = 0 after the last response token)
        A_t     = delta_t + gamma * lam * A_t'
        G_t     = A_t + V_t                       (the critic's target)

    Values and rewards at masked-out positions are never read. Shape: rewards, values, mask
    [B, T] → (advantages, returns) [B, T], 0 at masked-out positions.
    """
    _check(mask, rewards, values)
    mask = mask.bool()
    rewards, values = rewards.double(), values.double()
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=torch.float64, device=mask.device)
    next_v = torch.zeros(B, dtype=torch.float64, device=mask.device)
    next_a = torch.zeros(B, dtype=torch.float64, device=mask.device)
    for t in range(T - 1, -1, -1):
        m = mask[:, t]
        a = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * next_a
        # ``where`` (not multiplication) so a NaN at a masked-out position cannot leak in.
        adv[:, t] = torch.where(m, a, 0.0)
        next_v = torch.where(m, values[:, t], next_v)
        next_a = torch.where(m, a, next_a)
    returns = torch.where(mask, adv + values, 0.0)
    return adv, returns


def gae_reference(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                  lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gae` written as a plain loop over each row's response tokens (the reference the
    tests hold the vectorised version to). Same shapes."""
    _check(mask, rewards, values)
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        positions = [t for t in range(mask.shape[1]) if mask[b, t]]
        next_v, next_a = 0.0, 0.0
        for t in reversed(positions):
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            next_a = delta + gamma * lam * next_a
            next_v = float(values[b, t])
            adv[b, t] = next_a
            returns[b, t] = next_a + next_v
    return adv, returns


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum, sum of squares]`` of the masked-in entries, float64 (sum them over
    processes before :func:`whiten`). Shape: [B, T] → [3]."""
    _check(mask, x)
    sel = x.double()[mask.bool()]
    return torch.stack([torch.tensor(float(sel.numel()), dtype=torch.float64), sel.sum(),
                        (sel * sel).sum()])


def whiten(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor | None = None,
           eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over masked-in entries (the unbiased variance), 0
    elsewhere. ``moments``: :func:`masked_moments` summed over every process's batch (default:
    this batch's). Shape: [B, T] → [B, T]."""
    _check(mask, x)
    count, total, squares = (masked_moments(x, mask) if moments is None else moments).tolist()
    if count < 2:
        raise ValueError(f"whitening needs >= 2 masked-in values, got {int(count)}")
    mean = total / count
    var = max(squares / count - mean * mean, 0.0) * count / (count - 1)
    return torch.where(mask.bool(), (x.double() - mean) / (var + eps) ** 0.5, 0.0)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: ``max(-A * rho, -A * clip(rho, 1 - eps, 1 + eps))``
    with ``rho = exp(logp - old_logp)``, and whether the clipped term was the one taken.
    Shape: (N,) each → ((N,), (N,) bool)."""
    if not logp.shape == old_logp.shape == advantages.shape:
        raise ValueError("logp, old_logp and advantages must have one shape")
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``0.5 * max((V - G)^2, (V_clip - G)^2)`` with ``V_clip = V_old + clip(V - V_old, ±c)``
    (plain ``0.5 * (V - G)^2`` when ``clip`` is None), and whether the clipped term was taken.
    Shape: (N,) each → ((N,), (N,) bool)."""
    if not values.shape == old_values.shape == returns.shape:
        raise ValueError("values, old_values and returns must have one shape")
    plain = (values - returns) ** 2
    if clip is None:
        return 0.5 * plain, torch.zeros_like(plain, dtype=torch.bool)
    v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped), clipped > plain


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from samples of pi (Schulman's estimators,
    ``d = ref_logp - logp``): ``k1 = -d``; ``k2 = d^2 / 2``; ``k3 = exp(d) - 1 - d`` (unbiased
    and >= 0). Shape: (N,) → (N,)."""
    if logp.shape != ref_logp.shape:
        raise ValueError("logp and ref_logp must have one shape")
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        # Clamped as verl does: a huge d (a token pi_ref finds far likelier) cannot overflow.
        return torch.clamp(torch.exp(d) - 1.0 - d, max=10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each softmax distribution. Shape: (N, V) → (N,)."""
    logz = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return logz - (probs * logits).sum(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)``: 1 when the critic predicts the returns, 0
    when it does no better than their mean, negative when worse; nan when the returns are
    constant. Shape: (N,), (N,) over response tokens."""
    if values.shape != returns.shape or values.dim() != 1:
        raise ValueError(f"values {tuple(values.shape)} and returns {tuple(returns.shape)} "
                         "must be two (N,) tensors")
    var = float(returns.double().var(unbiased=False)) if returns.numel() else 0.0
    if var == 0.0:
        return float("nan")
    return 1.0 - float((returns.double() - values.double()).var(unbiased=False)) / var


def group_advantages(outcomes: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6
                     ) -> torch.Tensor:
    """GRPO: ``(R - mean_g R) / (std_g R + eps)`` within each group g (the rollouts of one
    task; unbiased std), 0 for a group of one. Shape: outcomes, groups (G,) → (G,)."""
    if outcomes.shape != groups.shape or outcomes.dim() != 1:
        raise ValueError("outcomes and groups must be two (G,) tensors")
    out = torch.zeros_like(outcomes, dtype=torch.float64)
    for g in torch.unique(groups):
        sel = groups == g
        r = outcomes[sel].double()
        if r.numel() > 1:
            out[sel] = (r - r.mean()) / (r.std() + eps)
    return out


def place_turn_rewards(turn_rewards: torch.Tensor, turn_of_token: torch.Tensor) -> torch.Tensor:
    """Each turn's reward on its last response token (docs/method.md stage 7), 0 on the others.
    ``turn_of_token``: the turn each response token belongs to, in order (non-decreasing).
    Shape: (m,), (N,) → (N,)."""
    n = turn_of_token.numel()
    out = torch.zeros(n, dtype=torch.float64)
    if n == 0:
        return out
    if bool((turn_of_token[1:] < turn_of_token[:-1]).any()):
        raise ValueError("response tokens must be in turn order")
    last = torch.ones(n, dtype=torch.bool)
    last[:-1] = turn_of_token[1:] != turn_of_token[:-1]
    turns = turn_of_token[last]
    if turns.numel() != turn_rewards.numel() or not torch.equal(
            turns, torch.arange(turn_rewards.numel())):
        raise ValueError(f"{turn_rewards.numel()} turn rewards for response tokens of turns "
                         f"{sorted(set(turn_of_token.tolist()))}")
    out[last] = turn_rewards.double()
    return out
