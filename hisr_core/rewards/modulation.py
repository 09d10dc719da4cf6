"""Hindsight-modulated segmental rewards and the fused per-turn rewards (docs/method.md, stages 6
and 7). Pure functions of tensors; no I/O.

Notation (one trajectory): m turns, n segments (:class:`~hisr_core.segment.segmenter.Segment`, in order,
covering the turns), ``r_hat`` (n,) the SPRM's segment rewards, ``log_ratio`` (m,) the
per-turn hindsight log-ratios.

Three options (``rewards.importance``, ``rewards.rescale``, ``rewards.grounding``; docs/method.md,
"Reward options") change how importance, rescale and grounding are computed; each default is the
paper's reading, as before the options existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from hisr_core.segment.segmenter import Segment, by_turn

if TYPE_CHECKING:
    from hisr_core.config import RewardsParams

Variant = Literal["hisr", "no_him", "no_spr", "no_both", "no_agr", "ppo"]
#: Variants that modulate the segment rewards by hindsight (the others use ``r_hat`` as is).
MODULATED: frozenset[str] = frozenset({"hisr", "no_spr", "no_agr"})

#: Variants whose segments are single turns, rewarded by the turn-level reward model.
TURN_LEVEL: frozenset[str] = frozenset({"no_spr", "no_both"})

#: ``sum |m|`` below this counts as zero: the trajectory's rewards are left unmodulated.
EPS = 1e-8

#: ``paper``: a segment's importance is the sum of its turns' normalised importances;
#: ``length_neutral``: relative to the segment's share of turns.
Importance = Literal["paper", "length_neutral"]
#: ``l1``: the modulated rewards keep ``sum |r_hat|``; ``signed_total``: the positive and the
#: negative segment rewards each keep their own total (so ``sum r_hat`` and ``sum |r_hat|``).
Rescale = Literal["l1", "signed_total"]
#: ``bonus``: ``r_g in {0, 1}``; ``penalty``: ``r_g - 1 in {-1, 0}``.
Grounding = Literal["bonus", "penalty"]


@dataclasses.dataclass(frozen=True)
class RewardOptions:
    """The reward options of docs/method.md ("Reward options"); the defaults are the paper's
    reading."""

    importance: Importance = "paper"
    rescale: Rescale = "l1"
    grounding: Grounding = "bonus"

    @classmethod
    def of(cls, cfg: RewardsParams) -> RewardOptions:
        """The options of the ``rewards`` params section."""
        return cls(cfg.importance, cfg.rescale, cfg.grounding)


#: The paper's reading: every option at its default.
PAPER = RewardOptions()


def log_ratio(hindsight_logp: torch.Tensor, policy_logp: torch.Tensor, beta: float) -> float:
    """``log_ratio_k = (1 / (beta * L)) * sum_j [log pi_hind(a_k^j | ...) - log pi(a_k^j | ...)]``.

    Shape: both (L,), the log-probabilities of turn k's L response tokens. An empty response
    has ratio 0 (importance as for an uninformative turn).
    """
    if hindsight_logp.shape != policy_logp.shape or hindsight_logp.dim() != 1:
        raise ValueError(f"log-probs must be two (L,) tensors, got {tuple(hindsight_logp.shape)}"
                         f" and {tuple(policy_logp.shape)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    n = hindsight_logp.numel()
    if n == 0:
        return 0.0
    return float((hindsight_logp.double() - policy_logp.double()).sum() / (beta * n))


def _segment_of_turn(segments: Sequence[Segment], n_turns: int) -> torch.Tensor:
    """Shape: (m,) long, the index of the segment each turn belongs to."""
    index = torch.empty(n_turns, dtype=torch.long)
    for i, s in enumerate(segments):
        index[s.first:s.last + 1] = i
    return index


def turn_importance(log_ratios: torch.Tensor) -> torch.Tensor:
    """Normalised turn importance ``z_k / sum_k z_k`` with ``z_k = exp(log_ratio_k)``, as a
    softmax (no overflow). Shape: (m,) → (m,), summing to 1."""
    return torch.softmax(log_ratios.double(), dim=0)


def segment_importance(log_ratios: torch.Tensor, segments: Sequence[Segment],
                       importance: Importance = "paper") -> torch.Tensor:
    """Segment importances summing to 1 over the trajectory. Shape: (m,) → (n,).

    ``paper``: ``z_hat(s_i) = sum_{k in s_i} z_k / sum_k z_k`` (the decision in docs/method.md).
    ``length_neutral``: ``u_i = z_hat(s_i) / (|s_i| / m)``, the mean turn importance of the
    segment relative to the trajectory's mean, then ``z_hat'(s_i) = u_i / sum_j u_j``. Equal
    log-ratios give ``1 / n`` for every segment whatever their lengths, so :func:`modulate`
    returns ``r_hat`` unchanged.
    """
    weights = turn_importance(log_ratios)
    index = _segment_of_turn(segments, weights.numel())
    z = torch.zeros(len(segments), dtype=weights.dtype).index_add_(0, index, weights)
    if importance == "paper":
        return z
    if importance != "length_neutral":
        raise ValueError(f"unknown importance {importance!r}")
    share = torch.bincount(index, minlength=len(segments)).to(weights.dtype) / weights.numel()
    u = z / share
    return u / u.sum()


def _rescaled(r: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``m * sum|r| / sum|m|``, or ``r`` when ``sum|m|`` is ~0. Shape: (n,), (n,) → (n,)."""
    mass = m.abs().sum()
    if float(mass) < EPS:
        return r.clone()
    return m * (r.abs().sum() / mass)


def modulate(r_hat: torch.Tensor, z_hat: torch.Tensor, rescale: Rescale = "l1") -> torch.Tensor:
    """Modulated segment rewards from ``m = r_hat * z_hat``. Shape: (n,), (n,) → (n,).

    ``l1``: ``r_him = m * sum|r_hat| / sum|m|``: the L1 mass of ``r_hat`` is kept (a failed
    trajectory with ``r_hat ~ 0`` is not inflated); ``r_him = r_hat`` when ``sum|m|`` is ~0.

    ``signed_total``: the segments with ``r_hat > 0`` (P) and those with ``r_hat < 0`` (N) are
    rescaled separately, ``r_him_i = m_i * sum_{j in P} r_hat_j / sum_{j in P} m_j`` for i in P
    and likewise for N; ``r_hat_i = 0`` stays 0. Each part keeps its own total, so both
    ``sum r_hat`` and ``sum |r_hat|`` are kept. Stable: every denominator sums terms of one sign
    (``z_hat >= 0``), never the signed ``sum m``, which can be ~0 or of the other sign; a part
    whose ``sum |m|`` is ~0 keeps its ``r_hat``. Credit moves only among segments of the same
    sign. With ``r_hat`` of one sign (all positive, as in the paper's Table 2) it equals ``l1``.
    """
    if r_hat.shape != z_hat.shape:
        raise ValueError(f"r_hat {tuple(r_hat.shape)} and z_hat {tuple(z_hat.shape)} differ")
    r = r_hat.double()
    m = r * z_hat.double()
    if rescale == "l1":
        return _rescaled(r, m)
    if rescale != "signed_total":
        raise ValueError(f"unknown rescale {rescale!r}")
    out = r.clone()
    for part in (r > 0, r < 0):
        if bool(part.any()):
            out[part] = _rescaled(r[part], m[part])
    return out


def grounding(admissible: Sequence[bool], kind: Grounding = "bonus") -> torch.Tensor:
    """``bonus``: ``r_g_k = 1`` if turn k's action was executable, else 0; ``penalty``:
    ``r_g_k - 1``, 0 if executable, else -1 (a longer episode earns nothing more). Shape: (m,)."""
    if kind not in ("bonus", "penalty"):
        raise ValueError(f"unknown grounding {kind!r}")
    low = 0.0 if kind == "bonus" else -1.0
    return torch.tensor([low + 1.0 if a else low for a in admissible], dtype=torch.float64)


def fused_turn_rewards(segment_rewards: torch.Tensor, segments: Sequence[Segment],
                       admissible: Sequence[bool], alpha: float,
                       grounding_kind: Grounding = "bonus") -> torch.Tensor:
    """Reward on the last response token of each turn: ``alpha * r_g_k`` (``r_g`` of
    ``grounding_kind``, see :func:`grounding`), plus ``(1 - alpha) * r_i`` on the last turn of
    segment i. Shape: (n,) → (m,)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if segment_rewards.numel() != len(segments):
        raise ValueError(f"{segment_rewards.numel()} rewards for {len(segments)} segments")
    out = alpha * grounding(admissible, grounding_kind)
    last = torch.tensor([s.last for s in segments], dtype=torch.long)
    return out.index_add_(0, last, (1 - alpha) * segment_rewards.double())


def outcome_turn_rewards(outcome: float, n_turns: int) -> torch.Tensor:
    """The ``ppo`` baseline: the outcome R on the last token of the last turn. Shape: (m,)."""
    out = torch.zeros(n_turns, dtype=torch.float64)
    out[-1] = outcome
    return out


def variant_rewards(variant: Variant, r_hat: torch.Tensor, log_ratios: torch.Tensor,
                    segments: Sequence[Segment], admissible: Sequence[bool], alpha: float,
                    outcome: float, options: RewardOptions = PAPER) -> torch.Tensor:
    """Per-turn rewards (on each turn's last response token) of one trajectory for a
    variant of the variants table of docs/method.md. ``segments`` are the variant's own (``turn`` for
    ``no_spr`` / ``no_both``); ``no_agr`` takes ``alpha = 0``; ``options`` pick the importance,
    rescale and grounding (``ppo`` reads none). Shape: (m,)."""
    m = len(admissible)
    if variant == "ppo":
        return outcome_turn_rewards(outcome, m)
    if log_ratios.numel() != m or (segments and segments[-1].last != m - 1):
        raise ValueError(f"{log_ratios.numel()} log-ratios and segments up to turn "
                         f"{segments[-1].last + 1 if segments else 0} for {m} turns")
    rewards = modulate(r_hat, segment_importance(log_ratios, segments, options.importance),
                       options.rescale) if variant in MODULATED else r_hat.double()
    return fused_turn_rewards(rewards, segments, admissible, 0.0 if variant == "no_agr" else alpha,
                              options.grounding)


@dataclasses.dataclass(frozen=True)
class TrajectoryRewards:
    """Everything the rewards stage records for one trajectory (m turns, n segments).

    Shapes: log_ratios, turn_importance (m,); r_hat, segment_importance, r_him (n,);
    variants: name → (m,) per-turn rewards (on each turn's last response token).
    """

    log_ratios: torch.Tensor
    turn_importance: torch.Tensor
    r_hat: torch.Tensor
    segment_importance: torch.Tensor
    r_him: torch.Tensor
    variants: dict[str, torch.Tensor]


def trajectory_rewards(policy_logp: Sequence[torch.Tensor], hindsight_logp: Sequence[torch.Tensor],
                       segment_model_r: torch.Tensor, turn_model_r: torch.Tensor | None,
                       segments: Sequence[Segment], admissible: Sequence[bool], outcome: float,
                       beta: float, alpha: float, variants: Sequence[Variant],
                       options: RewardOptions = PAPER) -> TrajectoryRewards:
    """Stage 6 for one trajectory, and the fused rewards of each variant, under ``options``.

    ``policy_logp`` / ``hindsight_logp``: m tensors (L_k,), turn k's response tokens under the
    scored policy and under ``pi_hind``. ``segment_model_r`` (m,): the SPRM's reward of a
    segment ending at each turn (``R_hat = r[last turn of each segment]``); ``turn_model_r``
    (m,): the turn-level model's, needed by ``no_spr`` / ``no_both``.
    """
    m = len(admissible)
    if len(policy_logp) != m or len(hindsight_logp) != m or segment_model_r.numel() != m:
        raise ValueError(f"{len(policy_logp)} policy and {len(hindsight_logp)} hindsight turns, "
                         f"{segment_model_r.numel()} SPRM rewards for {m} turns")
    ratios = torch.tensor([log_ratio(h, p, beta) for h, p in
                           zip(hindsight_logp, policy_logp, strict=True)], dtype=torch.float64)
    last = torch.tensor([s.last for s in segments], dtype=torch.long)
    r_hat = segment_model_r.double()[last]
    z_seg = segment_importance(ratios, segments, options.importance)
    return TrajectoryRewards(ratios, turn_importance(ratios), r_hat, z_seg,
                             modulate(r_hat, z_seg, options.rescale),
                             variants_from_ratios(ratios, r_hat, turn_model_r, segments,
                                                  admissible, outcome, alpha, variants, options))


def variants_from_ratios(log_ratios: torch.Tensor, r_hat: torch.Tensor,
                         turn_model_r: torch.Tensor | None, segments: Sequence[Segment],
                         admissible: Sequence[bool], outcome: float, alpha: float,
                         variants: Sequence[Variant], options: RewardOptions = PAPER
                         ) -> dict[str, torch.Tensor]:
    """Each variant's per-turn rewards from the per-turn log-ratios, the SPRM's segment rewards
    and the turn-level model's turn rewards (what the rewards stage records), so recorded
    trajectories can be fused again under other ``options``. Shape: log_ratios (m,), r_hat (n,),
    turn_model_r (m,) or None (needed by ``no_spr`` / ``no_both``) → name → (m,)."""
    m = len(admissible)
    turns = by_turn([""] * m)
    out: dict[str, torch.Tensor] = {}
    for v in variants:
        if v in TURN_LEVEL:
            if turn_model_r is None:
                raise ValueError(f"variant {v} needs the turn-level reward model")
            out[v] = variant_rewards(v, turn_model_r.double(), log_ratios, turns, admissible,
                                     alpha, outcome, options)
        else:
            out[v] = variant_rewards(v, r_hat.double(), log_ratios, segments, admissible, alpha,
                                     outcome, options)
    return out


POSITIONS = ("first", "middle", "last")


def position_mass(rewards: torch.Tensor) -> torch.Tensor:
    """Absolute reward mass of the first segment, the middle ones, and the last (the paper's
    Fig. 4 bins). Shape: (n,) with n >= 3 → (3,)."""
    if rewards.numel() < 3:
        raise ValueError(f"position bins need >= 3 segments, got {rewards.numel()}")
    a = rewards.double().abs()
    return torch.stack([a[0], a[1:-1].sum(), a[-1]])
