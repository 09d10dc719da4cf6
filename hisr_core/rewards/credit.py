"""Credit accuracy: how well a reward signal assigns credit, measured against an oracle
(docs/method.md, "Credit accuracy"). Pure numpy functions; no I/O.

Notation (one trajectory): m turns, n segments (:class:`~hisr_core.segment.segmenter.Segment`,
in order, covering the turns). The environment's oracle gives, per turn, the length of the
optimal plan from the state before the turn (``d_before``) and after it (``d_after``). The
*true credit* of turn t is ``d_before[t] - d_after[t]`` (progress made; a move that undoes
progress is negative), and a segment's true credit is the sum over its turns. A *signal* gives
one value per segment (``r_hat``, ``r_him``, the importance ``z``, a turn-level SPRM or a
variant's fused per-turn rewards summed per segment with :func:`segment_credit`).

Metrics over N trajectories: :func:`pooled_spearman`, :func:`mean_kendall_tau`,
:func:`first_error_top1`, :func:`return_margin`. Each is a function of per-trajectory items
(per-trajectory values for Kendall, first error and margin; trajectory indices for Spearman,
:func:`spearman_by_trajectory`), so :func:`bootstrap_ci` can resample trajectories;
:func:`credit_table` computes them all with percentile CIs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from hisr_core.segment.segmenter import Segment, check_cover

T = TypeVar("T")

#: Default number of bootstrap resamples and the two-sided CI level ``1 - ALPHA``.
N_BOOT = 1000
ALPHA = 0.05


def _vector(values: object, name: str) -> np.ndarray:
    """``values`` as a finite float64 vector. Shape: (k,)."""
    out = np.asarray(values, dtype=np.float64)
    if out.ndim != 1:
        raise ValueError(f"{name} must be a vector, got shape {out.shape}")
    if not np.isfinite(out).all():
        raise ValueError(f"{name} has non-finite values")
    return out


# --- true credit -------------------------------------------------------------------------------


def turn_credit(distances_before: Sequence[float] | np.ndarray,
                distances_after: Sequence[float] | np.ndarray) -> np.ndarray:
    """True credit of each turn: ``d_before[t] - d_after[t]``, the drop in the oracle's distance
    to the goal (negative for a move that undoes progress).

    Distances must be finite and >= 0; ``d_after[t] == d_before[t + 1]`` is expected but not
    required. Shape: (m,), (m,) → (m,).
    """
    before = _vector(distances_before, "distances_before")
    after = _vector(distances_after, "distances_after")
    if before.shape != after.shape:
        raise ValueError(f"{before.size} distances before and {after.size} after the turns")
    if (before < 0).any() or (after < 0).any():
        raise ValueError("distances must be >= 0")
    return before - after


def segment_credit(turn_values: Sequence[float] | np.ndarray,
                   segments: Sequence[Segment]) -> np.ndarray:
    """Sum of per-turn values over each segment's turns: a segment's true credit from
    :func:`turn_credit`, or a per-turn signal (a turn-level SPRM, a variant's fused rewards)
    summed per segment. ``segments`` must cover the turns (:func:`check_cover`).

    Shape: (m,) → (n,).
    """
    values = _vector(turn_values, "turn values")
    check_cover(segments, values.size)
    starts = np.fromiter((s.first for s in segments), dtype=np.intp, count=len(segments))
    return np.add.reduceat(values, starts)


# --- rank statistics ---------------------------------------------------------------------------


def _pairs(true: Sequence[np.ndarray], signal: Sequence[np.ndarray]
           ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    if len(true) != len(signal):
        raise ValueError(f"{len(true)} trajectories of true credit and {len(signal)} of signal")
    xs = [_vector(a, "true credit") for a in true]
    ys = [_vector(b, "signal") for b in signal]
    for j, (a, b) in enumerate(zip(xs, ys, strict=True)):
        if a.size != b.size:
            raise ValueError(f"trajectory {j}: {a.size} true credits and {b.size} signal values")
    return xs, ys


def _group_ranks(groups: np.ndarray, weights: np.ndarray, n_groups: int) -> np.ndarray:
    """Average ranks of points whose values have sorted group ids ``groups`` (equal values,
    equal ids), each point standing for ``weights`` copies: a group holding W copies after C
    smaller ones has rank ``C + (W + 1) / 2``. Shape: (k,), (k,) → (k,)."""
    mass = np.bincount(groups, weights=weights, minlength=n_groups)
    return (np.cumsum(mass) - mass + (mass + 1) / 2)[groups]


def spearman_by_trajectory(true: Sequence[np.ndarray], signal: Sequence[np.ndarray]
                           ) -> Callable[[np.ndarray], float]:
    """``statistic(idx)``: :func:`pooled_spearman` of the trajectories ``idx`` (with repeats,
    as a bootstrap resample draws them), without copying or re-sorting points: a trajectory
    drawn c times weights its segments by c, and weighted average ranks with a weighted Pearson
    correlation equal those of the copied points. Shape: N × (n_j,); ``idx`` (k,) ints in
    ``0..N-1``.
    """
    xs, ys = _pairs(true, signal)
    n = len(xs)
    owner = np.repeat(np.arange(n), [a.size for a in xs])
    x = np.concatenate(xs) if xs else np.zeros(0)
    y = np.concatenate(ys) if ys else np.zeros(0)
    gx, gy = np.unique(x, return_inverse=True)[1], np.unique(y, return_inverse=True)[1]
    kx, ky = int(gx.max(initial=-1)) + 1, int(gy.max(initial=-1)) + 1

    def statistic(idx: np.ndarray) -> float:
        w = np.bincount(np.asarray(idx, dtype=np.intp), minlength=n)[owner].astype(np.float64)
        total = float(w.sum())
        if total < 2:
            return math.nan
        rx, ry = _group_ranks(gx, w, kx), _group_ranks(gy, w, ky)
        dx, dy = rx - (w @ rx) / total, ry - (w @ ry) / total
        sxx, syy = float(w @ (dx * dx)), float(w @ (dy * dy))
        if sxx <= 0 or syy <= 0:
            return math.nan
        return float(np.clip((w @ (dx * dy)) / math.sqrt(sxx * syy), -1.0, 1.0))

    return statistic


def pooled_spearman(true: Sequence[np.ndarray], signal: Sequence[np.ndarray]) -> float:
    """Spearman rank correlation over all (true segment credit, signal) pairs pooled across
    trajectories.

    Reading of "pooled over segments within trajectories": every segment of every trajectory
    is one point, and the *raw* values are ranked once over the pool (average ranks for ties),
    then correlated (Pearson of the ranks). Within-trajectory ranks are not used, so a signal
    is also rewarded for putting a big step of one trajectory above a small step of another
    (true credit is in plan steps, comparable across trajectories); the within-trajectory
    ordering alone is :func:`mean_kendall_tau`'s job. nan when there are fewer than 2 points or
    either side is constant.

    Shape: ``true[j]`` and ``signal[j]`` are (n_j,), trajectory j's segments.
    """
    return spearman_by_trajectory(true, signal)(np.arange(len(true)))


def kendall_tau_b(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b of one trajectory: ``sum_{i<j} sign(dx) sign(dy)`` over
    ``sqrt(#pairs untied in x * #pairs untied in y)``; nan with < 2 points or either side
    constant. Shape: (n,), (n,)."""
    x, y = _vector(x, "x"), _vector(y, "y")
    if x.size != y.size:
        raise ValueError(f"{x.size} and {y.size} values")
    if x.size < 2:
        return math.nan
    i, j = np.triu_indices(x.size, k=1)
    sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    untied_x, untied_y = float(np.abs(sx).sum()), float(np.abs(sy).sum())
    if untied_x == 0 or untied_y == 0:
        return math.nan
    return float(np.clip((sx @ sy) / math.sqrt(untied_x * untied_y), -1.0, 1.0))


def _nanmean(values: np.ndarray) -> tuple[float, int]:
    """(mean of the finite entries, how many); nan if none. Shape: (N,)."""
    values = np.asarray(values, dtype=np.float64)
    counted = values[np.isfinite(values)]
    return (float(counted.mean()) if counted.size else math.nan), int(counted.size)


def kendall_per_trajectory(true: Sequence[np.ndarray], signal: Sequence[np.ndarray]
                           ) -> np.ndarray:
    """Tau-b of each trajectory (nan where it does not count: < 2 segments, or either side
    constant). Shape: N × (n_j,) → (N,)."""
    xs, ys = _pairs(true, signal)
    return np.array([kendall_tau_b(a, b) for a, b in zip(xs, ys, strict=True)],
                    dtype=np.float64)


def mean_kendall_tau(true: Sequence[np.ndarray], signal: Sequence[np.ndarray]
                     ) -> tuple[float, int]:
    """(mean over trajectories of Kendall's tau-b between the segments' true credit and the
    signal, the number of trajectories that counted). A trajectory with < 2 segments or a
    constant side is skipped; the mean is nan if none counts.

    Shape: ``true[j]`` and ``signal[j]`` are (n_j,).
    """
    return _nanmean(kendall_per_trajectory(true, signal))


# --- first error -------------------------------------------------------------------------------


def first_harmful_turn(turn_credits: np.ndarray) -> int | None:
    """Index of the first turn with negative true credit (a move away from the goal), or
    ``None``. Shape: (m,)."""
    harmful = np.flatnonzero(_vector(turn_credits, "turn credit") < 0)
    return int(harmful[0]) if harmful.size else None


def first_error_hits(true_turn_credit: Sequence[np.ndarray],
                     segments: Sequence[Sequence[Segment]], signal: Sequence[np.ndarray],
                     won: Sequence[bool]) -> np.ndarray:
    """Per trajectory: 1.0 if the segment with the lowest signal (the earliest of tied lowest)
    contains the first harmful turn (:func:`first_harmful_turn`), 0.0 if not, nan where the
    trajectory does not count (it was won, or it has no harmful turn).

    Shape: ``true_turn_credit[j]`` (m_j,), ``segments[j]`` n_j segments, ``signal[j]``
    (n_j,), ``won`` (N,) → (N,).
    """
    if not len(true_turn_credit) == len(segments) == len(signal) == len(won):
        raise ValueError(f"{len(true_turn_credit)} turn credits, {len(segments)} segmentations,"
                         f" {len(signal)} signals and {len(won)} outcomes")
    out = np.full(len(won), math.nan)
    for j, (credit, segs, values, success) in enumerate(
            zip(true_turn_credit, segments, signal, won, strict=True)):
        credit = _vector(credit, "turn credit")
        values = _vector(values, "signal")
        check_cover(segs, credit.size)
        if values.size != len(segs):
            raise ValueError(f"trajectory {j}: {values.size} signal values for "
                             f"{len(segs)} segments")
        first = first_harmful_turn(credit)
        if success or first is None:
            continue
        lowest = segs[int(np.argmin(values))]
        out[j] = 1.0 if lowest.first <= first <= lowest.last else 0.0
    return out


def first_error_top1(true_turn_credit: Sequence[np.ndarray],
                     segments: Sequence[Sequence[Segment]], signal: Sequence[np.ndarray],
                     won: Sequence[bool]) -> tuple[float, int]:
    """(share of counted trajectories whose lowest-signal segment contains the first harmful
    turn, the number counted). Counted: failed trajectories with at least one turn of negative
    true credit; the lowest segment is the earliest among ties. nan if none counts.

    Shapes as :func:`first_error_hits`.
    """
    return _nanmean(first_error_hits(true_turn_credit, segments, signal, won))


# --- return margin -----------------------------------------------------------------------------


def return_margin(returns: Sequence[float] | np.ndarray, won: Sequence[bool] | np.ndarray
                  ) -> float:
    """Mean return of the won trajectories minus that of the failed ones; nan if either class
    is empty. Shape: (N,), (N,)."""
    r = _vector(returns, "returns")
    w = np.asarray(won, dtype=bool)
    if w.shape != r.shape:
        raise ValueError(f"{r.size} returns and {w.size} outcomes")
    if w.all() or not w.any():
        return math.nan
    return float(r[w].mean() - r[~w].mean())


def relative_margin(variant_margin: float, outcome_margin: float) -> float:
    """``variant_margin / outcome_margin``: how far a variant's returns separate won from failed
    trajectories, in units of the outcome's own separation; nan if either is nan or the
    outcome's margin is 0."""
    if not (math.isfinite(variant_margin) and math.isfinite(outcome_margin)) \
            or outcome_margin == 0:
        return math.nan
    return variant_margin / outcome_margin


# --- shortcut probe ------------------------------------------------------------------------------


def position_r2(signal: Sequence[np.ndarray], cap: int = 10) -> float:
    """Share of a segment signal's variance explained by the segment's position alone: R² of
    the least-squares fit of the values on a one-hot of their index in the trajectory (indices
    from ``cap - 1`` on share one column). Near 1: the signal is a function of position, not of
    what the segment did (the SPRM's length shortcut). nan for a constant signal.

    Shape: ``signal[j]`` (n_j,), trajectory j's segments in order.
    """
    ys = [_vector(v, "signal") for v in signal]
    y = np.concatenate(ys) if ys else np.zeros(0)
    if y.size < 2 or float(y.var()) == 0.0:
        return math.nan
    position = np.concatenate([np.minimum(np.arange(v.size), cap - 1) for v in ys])
    # The least-squares fit on a one-hot is each position's mean.
    means = np.bincount(position, weights=y) / np.maximum(np.bincount(position), 1)
    return float(1.0 - ((y - means[position]) ** 2).mean() / y.var())


# --- bootstrap ---------------------------------------------------------------------------------


def bootstrap_ci(statistic: Callable[[Sequence[T]], float], per_trajectory_items: Sequence[T],
                 n_boot: int = N_BOOT, seed: int = 0, alpha: float = ALPHA
                 ) -> tuple[float, float, float]:
    """(point, low, high): ``statistic`` of the items, and the ``alpha / 2`` and
    ``1 - alpha / 2`` percentiles (linear interpolation) of ``statistic`` over ``n_boot``
    resamples of the trajectories with replacement.

    ``per_trajectory_items`` holds one item per trajectory; a numpy array is resampled along
    its first axis (fast for per-trajectory scalars), anything else as a list. Resamples whose
    statistic is nan (e.g. no failed trajectory drawn) are dropped; low and high are nan if all
    are, or if there are no items. The resampled indices depend only on ``seed``, ``n_boot``
    and the number of items, so metrics over the same trajectories with the same seed are
    resampled together (paired). For the pooled Spearman, resample trajectory indices:
    ``bootstrap_ci(spearman_by_trajectory(true, signal), np.arange(N))``.
    """
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    point = float(statistic(per_trajectory_items))
    n = len(per_trajectory_items)
    if n == 0:
        return point, math.nan, math.nan
    index = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    if isinstance(per_trajectory_items, np.ndarray):
        stats = np.array([statistic(per_trajectory_items[row]) for row in index], dtype=float)
    else:
        items = list(per_trajectory_items)
        stats = np.array([statistic([items[i] for i in row]) for row in index.tolist()],
                         dtype=float)
    stats = stats[np.isfinite(stats)]
    if stats.size == 0:
        return point, math.nan, math.nan
    low, high = np.quantile(stats, [alpha / 2, 1 - alpha / 2])
    return point, float(low), float(high)


# --- the table ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class CreditRecord:
    """One trajectory as the credit metrics read it (m turns, n segments).

    - ``turn_credit`` (m,): true credit per turn (:func:`turn_credit`; or build the record with
      :meth:`from_distances`).
    - ``segments``: the n segments the signals are given over, in order, covering the turns.
    - ``won``: whether the episode succeeded.
    - ``outcome``: the outcome R (1/0 or the environment's score), the ``ppo`` return that the
      variants' margins are compared with.
    - ``signals``: name → (n,), one value per segment. A variant's fused per-turn rewards
      summed per segment (:func:`segment_credit`) are a signal under the variant's name.
    - ``returns``: variant name → its scalar return on this trajectory (its fused rewards
      summed, with ``ppo.gamma: 1``).

    Arrays are stored as float64; the constructor checks shapes and coverage.
    """

    turn_credit: np.ndarray
    segments: tuple[Segment, ...]
    won: bool
    outcome: float
    signals: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    returns: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        credit = _vector(self.turn_credit, "turn_credit")
        segments = tuple(self.segments)
        check_cover(segments, credit.size)
        signals = {}
        for name, values in self.signals.items():
            v = _vector(values, f"signal {name}")
            if v.size != len(segments):
                raise ValueError(f"signal {name} has {v.size} values for {len(segments)} "
                                 "segments")
            signals[name] = v
        returns = {name: float(r) for name, r in self.returns.items()}
        if not all(math.isfinite(r) for r in returns.values()) \
                or not math.isfinite(float(self.outcome)):
            raise ValueError("returns and outcome must be finite")
        object.__setattr__(self, "turn_credit", credit)
        object.__setattr__(self, "segments", segments)
        object.__setattr__(self, "won", bool(self.won))
        object.__setattr__(self, "outcome", float(self.outcome))
        object.__setattr__(self, "signals", signals)
        object.__setattr__(self, "returns", returns)

    @classmethod
    def from_distances(cls, distances_before: Sequence[float] | np.ndarray,
                       distances_after: Sequence[float] | np.ndarray,
                       segments: Sequence[Segment], won: bool, outcome: float,
                       signals: Mapping[str, np.ndarray] | None = None,
                       returns: Mapping[str, float] | None = None) -> CreditRecord:
        """A record from the oracle's distances (m,) before and after each turn."""
        return cls(turn_credit(distances_before, distances_after), tuple(segments), won,
                   outcome, dict(signals or {}), dict(returns or {}))

    @property
    def segment_credit(self) -> np.ndarray:
        """True credit per segment. Shape: (n,)."""
        return segment_credit(self.turn_credit, self.segments)


def _common_names(records: Sequence[CreditRecord], field: str) -> list[str]:
    names = list(getattr(records[0], field))
    for j, r in enumerate(records):
        if set(getattr(r, field)) != set(names):
            raise ValueError(f"record {j} has {field} {sorted(getattr(r, field))}, record 0 "
                             f"has {sorted(names)}")
    return names


def credit_table(records: Sequence[CreditRecord], signals: Sequence[str] | None = None,
                 n_boot: int = N_BOOT, seed: int = 0, alpha: float = ALPHA
                 ) -> dict[str, float]:
    """Every credit metric with its bootstrap percentile CI (trajectories resampled, the same
    resamples for every metric), as flat names:

    - for each signal s (``signals``, default: every signal of the records, which must all
      carry the same names): ``credit/s/spearman``, ``credit/s/kendall``,
      ``credit/s/first_error_top1``, each with ``_low`` and ``_high``;
    - for each variant v of the records' ``returns``: ``credit/v/return_margin`` (with ``_low``
      and ``_high``) and ``credit/v/return_margin_ratio``, the margin over that of the
      outcome as return (:func:`relative_margin`).

    A metric that is undefined (e.g. no failed trajectory) is nan.
    """
    if not records:
        raise ValueError("no records")
    available = _common_names(records, "signals")
    names = available if signals is None else list(signals)
    missing = sorted(set(names) - set(available))
    if missing:
        raise ValueError(f"signals {missing} are not in the records (they have {available})")
    variants = _common_names(records, "returns")
    true = [r.segment_credit for r in records]
    turns = [r.turn_credit for r in records]
    segments = [r.segments for r in records]
    won = np.array([r.won for r in records], dtype=bool)

    def ci(statistic: Callable[[Sequence[T]], float], items: Sequence[T]
           ) -> tuple[float, float, float]:
        return bootstrap_ci(statistic, items, n_boot=n_boot, seed=seed, alpha=alpha)

    def mean_of(values: np.ndarray) -> float:
        return _nanmean(values)[0]

    def margin_of(table: np.ndarray) -> float:
        return return_margin(table[:, 0], table[:, 1] > 0.5)

    out: dict[str, float] = {}

    def put(key: str, point_low_high: tuple[float, float, float]) -> None:
        out[key], out[f"{key}_low"], out[f"{key}_high"] = point_low_high

    for name in names:
        values = [r.signals[name] for r in records]
        put(f"credit/{name}/spearman",
            ci(spearman_by_trajectory(true, values), np.arange(len(records))))
        put(f"credit/{name}/kendall", ci(mean_of, kendall_per_trajectory(true, values)))
        put(f"credit/{name}/first_error_top1",
            ci(mean_of, first_error_hits(turns, segments, values, won)))
    outcome_margin = return_margin([r.outcome for r in records], won)
    for variant in variants:
        table = np.column_stack([[r.returns[variant] for r in records], won])
        put(f"credit/{variant}/return_margin", ci(margin_of, table))
        out[f"credit/{variant}/return_margin_ratio"] = relative_margin(
            out[f"credit/{variant}/return_margin"], outcome_margin)
    return out
