"""Credit-accuracy metrics against an oracle, checked against hand derivations (and scipy)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from hisr_core.rewards.credit import (
    CreditRecord,
    bootstrap_ci,
    check_cover,
    credit_table,
    first_error_hits,
    first_error_top1,
    first_harmful_turn,
    kendall_tau_b,
    mean_kendall_tau,
    pooled_spearman,
    position_r2,
    relative_margin,
    return_margin,
    segment_credit,
    spearman_by_trajectory,
    turn_credit,
)
from hisr_core.segment.segmenter import Segment
from tests.hisr_core.rewards.helpers import spans


def a(*xs):
    return np.array(xs, dtype=np.float64)


# --- true credit -------------------------------------------------------------------------------


def test_turn_and_segment_credit_by_hand():
    # d_before - d_after = (3-2, 2-3, 3-2, 2-1, 1-0) = (1, -1, 1, 1, 1).
    credit = turn_credit([3, 2, 3, 2, 1], [2, 3, 2, 1, 0])
    np.testing.assert_array_equal(credit, a(1, -1, 1, 1, 1))
    # Segments {0, 1}, {2}, {3, 4}: (1 - 1, 1, 1 + 1) = (0, 1, 2).
    np.testing.assert_array_equal(segment_credit(credit, spans(2, 1, 2)), a(0, 1, 2))
    # One segment: the trajectory's total progress, d_before[0] - d_after[-1] = 3.
    np.testing.assert_array_equal(segment_credit(credit, spans(5)), a(3))


def test_turn_credit_rejects_bad_distances():
    with pytest.raises(ValueError, match="3 distances before and 2 after"):
        turn_credit([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        turn_credit([1, -1], [0, 0])
    with pytest.raises(ValueError, match="non-finite"):
        turn_credit([1, math.inf], [0, 0])


@pytest.mark.parametrize("segments, problem", [
    ([], "no segments"),
    ([Segment(1, 3, "g")], r"turns 1-1 are in no segment \(gap at the start\)"),
    ([Segment(0, 2, "g")], r"turns 4-4 are in no segment \(gap at the end\)"),
    ([Segment(0, 1, "g"), Segment(3, 3, "g")],
     r"turns 3-3 are in no segment \(gap between segments 1 and 2\)"),
    ([Segment(0, 2, "g"), Segment(2, 3, "g")], "segments 1 and 2 overlap at turns 3-3"),
    ([Segment(0, 3, "g"), Segment(4, 4, "g")], "segment 2 .* is out of range"),
    ([Segment(0, 1, "g"), Segment(3, 2, "g")], "segment 2 is empty"),
    ([Segment(2, 3, "g"), Segment(0, 1, "g")], r"segment 2 \(from turn 1\) is out of order"),
    ([Segment(0, 1, "g"), Segment(2, 3, "g"), Segment(0, 0, "g")], "segment 3 .* out of order"),
])
def test_bad_segment_coverage_is_named(segments, problem):
    credit = a(1, 0, -1, 1)
    with pytest.raises(ValueError, match=problem):
        segment_credit(credit, segments)
    with pytest.raises(ValueError, match=problem):
        CreditRecord(credit, tuple(segments), False, 0.0)


def test_coverage_ignores_subgoal_text():
    check_cover([Segment(0, 0, ""), Segment(1, 2, "")], 3)


# --- rank statistics ---------------------------------------------------------------------------


def test_perfect_and_reversed_signals():
    true = [a(0, 1, 2), a(3, -1)]
    perfect = [2 * t + 5 for t in true]  # increasing in the true credit, across trajectories
    reverse = [-t for t in true]
    assert pooled_spearman(true, perfect) == pytest.approx(1.0)
    assert pooled_spearman(true, reverse) == pytest.approx(-1.0)
    assert mean_kendall_tau(true, perfect) == (pytest.approx(1.0), 2)
    assert mean_kendall_tau(true, reverse) == (pytest.approx(-1.0), 2)


def test_spearman_with_ties_by_hand():
    # x = (1, 2, 2, 3) ranks (1, 2.5, 2.5, 4); y = (1, 2, 3, 4) ranks (1, 2, 3, 4); both mean 2.5.
    # dx = (-1.5, 0, 0, 1.5), dy = (-1.5, -0.5, 0.5, 1.5): sum dx dy = 4.5, sum dx^2 = 4.5,
    # sum dy^2 = 5 -> rho = 4.5 / sqrt(4.5 * 5) = sqrt(0.9).
    assert pooled_spearman([a(1, 2), a(2, 3)], [a(1, 2), a(3, 4)]) == \
        pytest.approx(math.sqrt(0.9))
    # Pooling: the split into trajectories does not matter.
    assert pooled_spearman([a(1, 2, 2, 3)], [a(1, 2, 3, 4)]) == pytest.approx(math.sqrt(0.9))


def test_kendall_with_ties_by_hand():
    # Pairs i<j of x = (1, 2, 2, 3): sign(x_i - x_j) = (-1, -1, -1, 0, -1, -1) (pair (1, 2) tied);
    # y = (1, 2, 3, 4): all -1. sum of products 5; untied pairs 5 in x, 6 in y:
    # tau_b = 5 / sqrt(5 * 6) = sqrt(5 / 6).
    assert kendall_tau_b(a(1, 2, 2, 3), a(1, 2, 3, 4)) == pytest.approx(math.sqrt(5 / 6))


def test_undefined_rank_statistics_are_nan():
    assert math.isnan(pooled_spearman([a(1, 2, 3)], [a(5, 5, 5)]))  # constant signal
    assert math.isnan(pooled_spearman([a(0, 0)], [a(1, 2)]))  # constant truth
    assert math.isnan(pooled_spearman([a(1)], [a(2)]))  # one point
    assert math.isnan(pooled_spearman([], []))
    assert math.isnan(kendall_tau_b(a(1), a(1)))
    assert math.isnan(kendall_tau_b(a(1, 2), a(3, 3)))


def test_mean_kendall_skips_trajectories_by_hand():
    # A: same order -> 1. B: true (2, 1, 0), signal (0, 2, 1): pairs (0,1) + vs - -> -1,
    # (0,2) + vs - -> -1, (1,2) + vs + -> +1: tau = -1/3. C: one segment, D: constant signal,
    # E: constant truth: skipped. Mean (1 - 1/3) / 2 = 1/3 over 2 trajectories.
    true = [a(0, 1, 2), a(2, 1, 0), a(4), a(1, 2), a(3, 3)]
    signal = [a(0, 1, 2), a(0, 2, 1), a(1), a(7, 7), a(1, 2)]
    mean, counted = mean_kendall_tau(true, signal)
    assert mean == pytest.approx(1 / 3) and counted == 2
    assert mean_kendall_tau([a(1)], [a(1)])[1] == 0
    assert math.isnan(mean_kendall_tau([a(1)], [a(1)])[0])


def test_rank_statistics_reject_mismatched_lengths():
    with pytest.raises(ValueError, match="trajectory 1: 2 true credits and 3 signal values"):
        pooled_spearman([a(1, 2), a(1, 2)], [a(1, 2), a(1, 2, 3)])
    with pytest.raises(ValueError, match="2 trajectories of true credit and 1 of signal"):
        mean_kendall_tau([a(1, 2), a(1, 2)], [a(1, 2)])


def test_against_scipy_on_random_data():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(7)
    true, signal = [], []
    for _ in range(60):
        n = int(rng.integers(1, 9))
        true.append(rng.integers(-2, 4, size=n).astype(float))  # many ties
        signal.append(np.round(rng.normal(size=n), 1))  # some ties
    expected = stats.spearmanr(np.concatenate(true), np.concatenate(signal)).statistic
    assert pooled_spearman(true, signal) == pytest.approx(expected, abs=1e-12)
    taus = []
    for x, y in zip(true, signal, strict=True):
        ours = kendall_tau_b(x, y)
        if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
            assert math.isnan(ours)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = stats.kendalltau(x, y, variant="b").statistic
        assert ours == pytest.approx(theirs, abs=1e-12)
        taus.append(theirs)
    mean, counted = mean_kendall_tau(true, signal)
    assert counted == len(taus) > 20
    assert mean == pytest.approx(np.mean(taus), abs=1e-12)


def test_weighted_spearman_equals_copied_trajectories():
    """A bootstrap resample draws trajectories with repeats; the weighted statistic equals
    pooled_spearman of the copies."""
    rng = np.random.default_rng(3)
    true = [rng.integers(-1, 3, size=int(rng.integers(1, 6))).astype(float) for _ in range(30)]
    signal = [np.round(rng.normal(size=t.size), 1) for t in true]
    statistic = spearman_by_trajectory(true, signal)
    for _ in range(5):
        idx = rng.integers(0, 30, size=30)
        copied = pooled_spearman([true[i] for i in idx], [signal[i] for i in idx])
        assert statistic(idx) == pytest.approx(copied, abs=1e-12)


# --- first error -------------------------------------------------------------------------------


def test_first_error_by_hand():
    # Turn credits (1, 0, -1, 1, -1): the first harmful turn is turn 2 (0-based), in segment 1
    # of {0, 1}, {2, 3}, {4}.
    credit, segs = a(1, 0, -1, 1, -1), spans(2, 2, 1)
    assert first_harmful_turn(credit) == 2
    assert first_harmful_turn(a(1, 0, 0)) is None

    def hit(signal, won=False, c=credit, s=segs):
        return first_error_hits([c], [s], [signal], [won])[0]

    assert hit(a(0.5, -0.2, 0.1)) == 1.0  # lowest is segment 1: the first error
    assert hit(a(0.5, 0.3, -0.4)) == 0.0  # lowest is segment 2: a later error
    assert hit(a(0.0, 0.0, 0.3)) == 0.0  # tie: the earliest lowest, segment 0
    assert hit(a(0.3, 0.0, 0.0)) == 1.0  # tie: the earliest lowest, segment 1
    assert math.isnan(hit(a(0.5, -0.2, 0.1), won=True))  # won: not counted
    assert math.isnan(hit(a(0.1, 0.2), c=a(1, 0, 0), s=spans(1, 2)))  # no harmful turn

    # Failed hit, failed miss, won (not counted), failed without a harmful turn (not counted):
    # 1 of 2.
    accuracy, counted = first_error_top1(
        [credit, credit, credit, a(1, 0, 0)], [segs, segs, segs, spans(1, 2)],
        [a(0.5, -0.2, 0.1), a(0.5, 0.3, -0.4), a(0.5, 0.3, -0.4), a(0.1, 0.2)],
        [False, False, True, False])
    assert accuracy == pytest.approx(0.5) and counted == 2
    assert first_error_top1([credit], [segs], [a(1, 2, 3)], [True])[1] == 0


def test_first_error_rejects_a_signal_of_the_wrong_length():
    with pytest.raises(ValueError, match="2 signal values for 3 segments"):
        first_error_top1([a(1, -1, 0)], [spans(1, 1, 1)], [a(1, 2)], [False])


# --- return margin -----------------------------------------------------------------------------


def test_return_margin_by_hand():
    # Won: (1.0 + 0.5) / 2 = 0.75; failed: (0.2 - 0.1 + 0.3) / 3 = 0.4 / 3; margin = 37 / 60.
    returns, won = [1.0, 0.5, 0.2, -0.1, 0.3], [True, True, False, False, False]
    assert return_margin(returns, won) == pytest.approx(37 / 60)
    # The 0/1 outcome as return separates the classes by exactly 1.
    assert return_margin([1, 1, 0, 0, 0], won) == 1.0
    # A score outcome: (1 + 0.9) / 2 - (0.4 + 0.2 + 0) / 3 = 0.95 - 0.2 = 0.75.
    assert return_margin([1, 0.9, 0.4, 0.2, 0.0], won) == pytest.approx(0.75)
    assert math.isnan(return_margin([1.0, 2.0], [True, True]))
    assert math.isnan(return_margin([1.0, 2.0], [False, False]))
    assert relative_margin(0.3, 0.6) == pytest.approx(0.5)
    assert math.isnan(relative_margin(0.3, 0.0))
    assert math.isnan(relative_margin(math.nan, 1.0))


# --- bootstrap ---------------------------------------------------------------------------------


def _spearman_data(n, seed):
    """n trajectories of 4 segments: signal = true credit + noise."""
    rng = np.random.default_rng(seed)
    true = [rng.integers(-1, 3, size=4).astype(float) for _ in range(n)]
    signal = [t + rng.normal(scale=1.5, size=4) for t in true]
    return true, signal


def test_bootstrap_ci_contains_the_point_is_reproducible_and_narrows():
    true, signal = _spearman_data(2000, seed=1)
    big = spearman_by_trajectory(true, signal)
    small = spearman_by_trajectory(true[:50], signal[:50])
    point, low, high = bootstrap_ci(big, np.arange(2000), n_boot=300, seed=5)
    assert point == pytest.approx(pooled_spearman(true, signal))
    assert low < point < high
    assert bootstrap_ci(big, np.arange(2000), n_boot=300, seed=5) == (point, low, high)
    assert bootstrap_ci(big, np.arange(2000), n_boot=300, seed=6) != (point, low, high)
    _, small_low, small_high = bootstrap_ci(small, np.arange(50), n_boot=300, seed=5)
    assert small_low < small_high
    assert high - low < (small_high - small_low) / 3  # ~ sqrt(50 / 2000) = 1/6.3 as wide


def test_bootstrap_list_and_array_items_draw_the_same_resamples():
    values = [0.0, 1.0, 5.0, 2.0, 2.5]
    from_list = bootstrap_ci(lambda xs: float(np.mean(xs)), values, n_boot=200, seed=0)
    from_array = bootstrap_ci(lambda xs: float(np.mean(xs)), np.array(values), n_boot=200,
                              seed=0)
    assert from_list == from_array
    assert from_list[0] == pytest.approx(2.1)


def test_bootstrap_drops_undefined_resamples():
    # The statistic is defined only when item 1 is drawn; then it is always 1.
    point, low, high = bootstrap_ci(lambda xs: 1.0 if 1 in list(xs) else math.nan, [0, 1],
                                    n_boot=100, seed=0)
    assert (point, low, high) == (1.0, 1.0, 1.0)
    assert all(math.isnan(v) for v in bootstrap_ci(lambda xs: math.nan, [0, 1], n_boot=10)[1:])
    assert bootstrap_ci(lambda xs: math.nan, [], n_boot=10)[1:] == pytest.approx(
        (math.nan, math.nan), nan_ok=True)


# --- the table ---------------------------------------------------------------------------------


def _records():
    """Three trajectories (see test_credit_table_by_hand)."""
    return [
        # Won; turn credits (1, 1, 1); segments {0}, {1, 2} -> true credit (1, 2).
        CreditRecord.from_distances([3, 2, 1], [2, 1, 0], spans(1, 2), True, 1.0,
                                    {"good": a(0.1, 0.2), "bad": a(-0.1, -0.2)}, {"hisr": 1.2}),
        # Failed; turn credits (1, -1, -1), one turn a segment -> (1, -1, -1); first harmful
        # turn 1, in segment 1.
        CreditRecord.from_distances([2, 1, 2], [1, 2, 3], spans(1, 1, 1), False, 0.0,
                                    {"good": a(0.1, -0.1, -0.1), "bad": a(-0.1, 0.1, 0.1)},
                                    {"hisr": 0.2}),
        # Failed, no progress and no harmful turn; one segment -> (0).
        CreditRecord.from_distances([1, 1], [1, 1], spans(2), False, 0.0,
                                    {"good": a(0.0), "bad": a(0.0)}, {"hisr": -0.4}),
    ]


def test_credit_table_by_hand():
    table = credit_table(_records(), n_boot=200, seed=0)
    expected_keys = {f"credit/{s}/{m}{end}" for s in ("good", "bad")
                     for m in ("spearman", "kendall", "first_error_top1")
                     for end in ("", "_low", "_high")}
    expected_keys |= {"credit/hisr/return_margin", "credit/hisr/return_margin_low",
                      "credit/hisr/return_margin_high", "credit/hisr/return_margin_ratio"}
    assert set(table) == expected_keys
    # good = true credit / 10 everywhere: pooled Spearman 1. bad = -good: -1.
    assert table["credit/good/spearman"] == pytest.approx(1.0)
    assert table["credit/bad/spearman"] == pytest.approx(-1.0)
    # Kendall: trajectory 1 (1, 2) vs (0.1, 0.2): 1; trajectory 2 (1, -1, -1) vs
    # (0.1, -0.1, -0.1): pairs (+,+), (+,+), (0,0) -> 2 / sqrt(2 * 2) = 1; trajectory 3 has
    # one segment and is skipped. Mean 1 (bad: -1).
    assert table["credit/good/kendall"] == pytest.approx(1.0)
    assert table["credit/bad/kendall"] == pytest.approx(-1.0)
    # First error: only trajectory 2 counts (1 is won, 3 has no harmful turn). good's lowest
    # is the earliest of the tied -0.1s, segment 1: a hit. bad's lowest is segment 0: a miss.
    assert table["credit/good/first_error_top1"] == 1.0
    assert table["credit/bad/first_error_top1"] == 0.0
    # Every resample that defines these metrics gives the same value.
    for key, value in [("good/spearman", 1.0), ("good/first_error_top1", 1.0),
                       ("bad/first_error_top1", 0.0), ("bad/kendall", -1.0)]:
        assert table[f"credit/{key}_low"] == pytest.approx(value)
        assert table[f"credit/{key}_high"] == pytest.approx(value)
    # Return margin: won 1.2, failed (0.2 - 0.4) / 2 = -0.1 -> 1.3; the outcome's margin is
    # 1 - 0 = 1, so the ratio is 1.3.
    assert table["credit/hisr/return_margin"] == pytest.approx(1.3)
    assert table["credit/hisr/return_margin_ratio"] == pytest.approx(1.3)
    low, high = table["credit/hisr/return_margin_low"], table["credit/hisr/return_margin_high"]
    assert low <= 1.3 <= high
    assert credit_table(_records(), n_boot=200, seed=0) == table
    # Choosing signals.
    assert set(credit_table(_records(), ["good"], n_boot=10)) == \
        {k for k in expected_keys if "/bad/" not in k}


def test_credit_table_undefined_metrics_are_nan():
    won_only = [r for r in _records() if r.won] * 3
    table = credit_table(won_only, n_boot=20)
    assert math.isnan(table["credit/good/first_error_top1"])
    assert math.isnan(table["credit/hisr/return_margin"])
    assert math.isnan(table["credit/hisr/return_margin_ratio"])


def test_records_are_checked():
    with pytest.raises(ValueError, match="signal s has 3 values for 2 segments"):
        CreditRecord(a(1, 1), tuple(spans(1, 1)), True, 1.0, {"s": a(1, 2, 3)})
    records = _records()
    odd = CreditRecord(a(1), tuple(spans(1)), True, 1.0, {"good": a(1)}, {"hisr": 1.0})
    with pytest.raises(ValueError, match="record 3 has signals"):
        credit_table([*records, odd], n_boot=10)
    with pytest.raises(ValueError, match=r"signals \['nope'\] are not in the records"):
        credit_table(records, ["nope"], n_boot=10)


def test_a_variants_fused_turn_rewards_summed_per_segment():
    # Fused per-turn rewards (0.5, 0.3, 0.7) over segments {0, 1}, {2}: (0.8, 0.7).
    np.testing.assert_allclose(segment_credit(a(0.5, 0.3, 0.7), spans(2, 1)), a(0.8, 0.7))


def test_position_r2_by_hand():
    # A function of position alone: R² 1. Position says nothing (means 0.5, 0.5): R² 0.
    assert position_r2([[1.0, 0.0], [1.0, 0.0, 0.5]]) == pytest.approx(1.0)
    assert position_r2([[1.0, 0.0], [0.0, 1.0]]) == pytest.approx(0.0)
    # cap 2: positions 0 1 1 1, means 0 and 2, residuals 0 -1 0 1 (mean square 0.5), variance
    # of 0 1 2 3 is 1.25: R² = 1 - 0.5 / 1.25 = 0.6.
    assert position_r2([[0.0, 1.0, 2.0, 3.0]], cap=2) == pytest.approx(0.6)
    assert math.isnan(position_r2([[1.0, 1.0]]))
