"""The rewards stage's credit-accuracy table: rewards rows (true credit and turn-SPRM reward per
turn, signals per segment, each variant's fused rewards) to metrics, ``credit.csv`` and the
report's table, on hand-made trajectories."""

from __future__ import annotations

import math

import pytest

from tasks.report import credit_table_rows
from tasks.rewards import credit_metrics, credit_records, write_credit_csv


def _row(credits: list[float], cuts: list[tuple[int, int]], r_hat: list[float], won: bool,
         fused: list[float]) -> dict:
    return {
        "won": won, "outcome": float(won),
        "segments": [{"first_turn": a, "last_turn": b, "subgoal": "", "r_hat": r,
                      "importance": 1.0 / len(cuts), "r_him": r}
                     for (a, b), r in zip(cuts, r_hat, strict=True)],
        "turns": [{"action": "go", "admissible": True, "log_ratio": 0.0, "importance": 0.0,
                   "true_credit": c, "r_turn": c} for c in credits],
        "variants": [{"variant": "hisr", "turn_rewards": fused}],
    }


ROWS = [
    # Won: the two segments' true credit is 2 and 1, r_hat ranks them the same way.
    _row([1, 1, 1], [(0, 1), (2, 2)], [0.9, 0.4], True, [0.0, 0.0, 1.0]),
    # Failed: true credit 1 then -1 (a move undone); r_hat puts the lowest on segment 2.
    _row([1, -1, 0], [(0, 0), (1, 2)], [0.5, -0.2], False, [0.0, 0.0, 0.2]),
    # Won: 3 and 0.
    _row([1, 1, 1, 0], [(0, 2), (3, 3)], [1.0, 0.0], True, [0.0, 0.0, 0.0, 1.0]),
]


def test_records_sum_signals_and_returns_per_segment():
    records = credit_records(ROWS)
    assert None not in records
    assert records[0].segment_credit.tolist() == [2.0, 1.0]
    assert records[0].signals["turn_sprm"].tolist() == [2.0, 1.0]  # r_turn summed
    assert records[1].signals["hisr"].tolist() == [0.0, 0.2]
    assert records[2].returns == {"hisr": 1.0}


def test_metrics_by_hand_and_the_report_table(tmp_path):
    metrics = credit_metrics(ROWS, held_out=[1], n_boot=50, seed=0)
    table = metrics["credit"]
    # r_hat orders every trajectory's segments as the true credit does: Kendall 1 each. Pooled
    # (true, r_hat): (2, .9) (1, .4) (1, .5) (-1, -.2) (3, 1) (0, 0). Ranks: true 5, 3.5, 3.5,
    # 1, 6, 2 and r_hat 5, 3, 4, 1, 6, 2; about the mean 3.5 the products sum to 17 and the
    # squares to 17 and 17.5: Spearman = 17 / sqrt(17 * 17.5).
    assert table["r_hat/kendall"] == 1.0
    assert table["r_hat/spearman"] == pytest.approx(17 / math.sqrt(17 * 17.5))
    assert table["r_hat/first_error_top1"] == 1.0  # the failed one: segment 2 holds turn 2
    # hisr's returns 1, 0.2, 1: margin 1 - 0.2 = 0.8 against the outcome's 1.
    assert table["hisr/return_margin"] == pytest.approx(0.8)
    assert table["hisr/return_margin_ratio"] == pytest.approx(0.8)
    held = metrics["credit_heldout"]  # the failed trajectory alone: no margin
    assert math.isnan(held["hisr/return_margin"])

    path = tmp_path / "credit.csv"
    write_credit_csv(metrics, path)
    header, rows = credit_table_rows(path)
    by = {(r[0], r[1]): r for r in rows}
    assert by[("credit", "r_hat")][header.index("Kendall τ")].startswith("1.000 [")
    assert by[("credit", "hisr")][header.index("margin / outcome's")] == "0.80"
    assert by[("credit_heldout", "hisr")][header.index("return margin")] == "–"


def test_trajectories_of_unknown_credit_are_left_out():
    """ALFWorld without its planner reports no distance: no true credit, no table."""
    unknown = _row([1, math.nan], [(0, 1)], [0.5], False, [0.0, 0.0])
    assert credit_records([unknown]) == [None]
    assert credit_metrics([unknown], held_out=[0], n_boot=10, seed=0) == {}
    metrics = credit_metrics([*ROWS, unknown], held_out=[3], n_boot=10, seed=0)
    assert set(metrics) == {"credit"}
    assert metrics["credit"]["r_hat/kendall"] == 1.0
