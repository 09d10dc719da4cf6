"""The report's tables: mean ± std over seeds, Table 1's row order, mean curves, and the
paired bootstrap comparisons over tasks and seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hisr_core.report import (
    block_differences,
    cell,
    curve_difference,
    markdown_table,
    mean_curve,
    order,
    ordered,
    outcome_matrix,
    paired_difference,
    paired_runs,
    success_interval,
    success_table,
    versus_reference,
)
from tasks.report import comparison_rows, verdict_lines


def _eval(split: str, pick: float, look: float, all_: float) -> dict:
    return {split: {"success": {"PICK": pick, "LOOK": look, "all": all_}}}


def test_cell_mean_and_sample_std():
    # values 0.2, 0.4, 0.6: mean 0.4; sample variance ((0.2)^2 + 0 + (0.2)^2) / 2 = 0.04.
    c = cell([0.2, 0.4, 0.6])
    assert c.mean == pytest.approx(0.4) and c.std == pytest.approx(0.2) and c.n == 3
    assert c.percent() == "40.0 ± 20.0"
    single = cell([0.125])
    assert single.std is None and single.percent() == "12.5"
    with pytest.raises(ValueError, match="at least one"):
        cell([])


def test_success_table_orders_rows_and_aggregates_seeds():
    evaluations = {
        "hisr": [_eval("valid_seen", 0.5, 0.0, 0.25), _eval("valid_seen", 1.0, 0.5, 0.75)],
        "custom": [_eval("valid_seen", 0.0, 0.0, 0.0)],
        "sft": [_eval("valid_seen", 0.25, 0.25, 0.25)],
        "ppo": [_eval("valid_unseen", 1.0, 1.0, 1.0)],  # no valid_seen: left out
    }
    table = success_table(evaluations, "valid_seen", ["PICK", "CLEAN", "LOOK"])
    assert list(table) == ["sft", "hisr", "custom"]
    assert table["hisr"]["PICK"].mean == pytest.approx(0.75)
    assert table["hisr"]["Avg"].mean == pytest.approx(0.5) and table["hisr"]["Avg"].n == 2
    assert "CLEAN" not in table["sft"]
    md = markdown_table(table, ["PICK", "CLEAN", "LOOK", "Avg"]).splitlines()
    assert md[0] == "| policy | PICK | CLEAN | LOOK | Avg | seeds |"
    assert md[2] == "| sft | 25.0 | - | 25.0 | 25.0 | 1 |"
    assert md[3].startswith("| hisr | 75.0 ± 35.4 | - | 25.0 ± 35.4 | 50.0 ± 35.4 | 2 |")


def test_ordered_keeps_unknown_names_last():
    assert ordered(["x", "hisr", "sft", "rft"]) == ["sft", "rft", "hisr", "x"]


def test_mean_curve_skips_missing_values():
    a = [{"iteration": 1, "s": 0.0}, {"iteration": 2, "s": 1.0}]
    b = [{"iteration": 1, "s": 0.5}, {"iteration": 2, "s": math.nan}, {"iteration": 3, "s": 1.0}]
    assert mean_curve([a, b], "s") == [(1, 0.25), (2, 1.0), (3, 1.0)]
    assert mean_curve([a], "other") == []


def test_paired_difference_by_hand():
    """Two tasks, one run each; the per-task differences are 1 and 0. Resampling the tasks
    draws (task 0, task 0) with probability 1/4 (difference 1), a mix with 1/2 (0.5) and
    (task 1, task 1) with 1/4 (0): the point is 0.5 and the 95% interval [0, 1]."""
    a, b = np.array([[1.0, 0.0]]), np.array([[0.0, 0.0]])
    assert paired_difference(a, b, n_boot=4000) == (0.5, 0.0, 1.0)
    assert success_interval(a, n_boot=4000) == (0.5, 0.0, 1.0)
    assert success_interval(np.ones((3, 5))) == (1.0, 1.0, 1.0)


def test_paired_seeds_and_unpaired_single_runs():
    # Seed s of one policy pairs with seed s of the other: identical runs differ by exactly 0
    # in every resample, though the seeds themselves differ a lot.
    runs = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert paired_difference(runs, runs.copy()) == (0.0, 0.0, 0.0)
    # Against one sft run, the two seeds are drawn on their own: the interval is wide.
    point, low, high = paired_difference(runs, np.array([[0.0, 1.0, 0.0]]))
    assert point == pytest.approx(0.5 - 1 / 3) and low < 0 < high
    with pytest.raises(ValueError, match="same tasks"):
        paired_difference(runs, np.ones((1, 2)))


def test_outcome_matrix_and_the_comparison_table():
    sft = {None: {"t1": 1.0, "t2": 0.0, "t3": 0.0, "extra": 1.0}}  # one, shared by every seed
    ppo = {0: {"t1": 1.0, "t2": 1.0, "t3": 0.0}, 1: {"t1": 1.0, "t2": 1.0, "t3": 1.0}}
    assert outcome_matrix(list(ppo.values()), ["t2", "t3"]).tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert outcome_matrix([], ["t2", "t3"]).shape == (0, 2)
    with pytest.raises(ValueError, match="no outcome"):
        outcome_matrix(list(ppo.values()), ["extra"])
    header, rows, diffs = comparison_rows({"ppo": {"valid_unseen": ppo},
                                           "sft": {"valid_unseen": sft}}, "valid_unseen")
    assert header[1] == "Avg [95% CI] (3 tasks)"  # the tasks every run played
    by = {r[0]: r for r in rows}
    assert list(by) == ["sft", "ppo"]
    assert header[2:] == ["vs sft", "vs no_both", "vs ppo", "seeds"]
    assert by["sft"][1].startswith("33.3 [") and by["sft"][2] == "–" and by["sft"][5] == "one run"
    assert by["sft"][4].startswith("-50.0 [")  # sft minus ppo
    assert by["ppo"][1].startswith("83.3 [") and by["ppo"][2].startswith("+50.0 [")
    assert by["ppo"][3] == "–" and by["ppo"][4] == "–"  # no no_both run; not against itself
    assert by["ppo"][5] == "0, 1" and diffs["ppo", "sft"][3] == [0, 1]
    assert comparison_rows({"ppo": {"valid_seen": ppo}}, "valid_unseen") == ([], [], {})


def test_runs_pair_by_seed_not_by_position():
    tasks = ["t1", "t2", "t3", "t4"]
    ppo = {0: dict.fromkeys(tasks, 0.0), 1: {"t1": 1.0, "t2": 0.0, "t3": 1.0, "t4": 0.0}}
    hisr = {1: dict(ppo[1]), 2: dict.fromkeys(tasks, 1.0)}
    a, b, seeds = paired_runs(hisr, ppo, tasks)
    assert seeds == [1] and (a == b).all()   # only seed 1 is in both
    # hisr's seed 1 is ppo's seed 1: no difference at all, whatever seeds 0 and 2 did. Pairing
    # rows by position (seed 1 with seed 0, seed 2 with seed 1) would say +75 points.
    _, _, diffs = comparison_rows({"ppo": {"s": ppo}, "hisr": {"s": hisr}}, "s")
    assert diffs["hisr", "ppo"] == (0.0, 0.0, 0.0, [1])
    _, rows, _ = comparison_rows({"ppo": {"s": ppo}, "hisr": {"s": hisr}}, "s")
    assert rows[1][0] == "hisr" and rows[1][4] == "+0.0 [+0.0, +0.0] (seed 1)"
    shared = {None: dict.fromkeys(tasks, 0.0)}
    a, b, seeds = paired_runs(shared, hisr, tasks)
    assert seeds == [1, 2] and a.shape == b.shape == (2, 4) and (a == 0).all()
    assert paired_runs(shared, shared, tasks)[2] == [None]
    a, b, seeds = paired_runs({0: ppo[0]}, {2: hisr[2]}, tasks)
    assert seeds == [] and a.shape == (0, 4)


def test_verdicts_against_sft_and_the_ordering():
    assert versus_reference(0.01, 0.09) == "beats"
    assert versus_reference(-0.02, 0.05) == "not worse"
    assert versus_reference(-0.05, 0.02) == "may be worse"
    assert versus_reference(-0.09, -0.04) == "worse"
    assert (order(0.001, 0.1), order(-0.1, -0.001), order(-0.01, 0.01)) == (">", "<", "≈")
    diffs = {("hisr", "sft"): (0.10, 0.05, 0.15, [0, 1, 2]),
             ("ppo", "sft"): (0.02, -0.01, 0.05, [0, 1, 2]),
             ("hisr", "no_both"): (0.04, -0.002, 0.09, [1]),
             ("hisr", "ppo"): (0.08, 0.03, 0.13, [0, 1, 2]),
             ("no_both", "hisr"): (-0.04, -0.09, 0.002, [1])}
    assert verdict_lines(diffs, [0, 1, 2]) == [
        ("- `ppo` not worse than `sft` (3-point margin), not shown better: +2.0 [-1.0, +5.0] "
        "(3 of 3 seeds)"),
        "- `hisr` beats `sft`: +10.0 [+5.0, +15.0] (3 of 3 seeds)",
        ("- `hisr` and `no_both` cannot be told apart: `hisr` − `no_both` +4.0 [-0.2, +9.0] "
        "(1 of 3 seeds; interim)"),
        "- `hisr` > `ppo`: `hisr` − `ppo` +8.0 [+3.0, +13.0] (3 of 3 seeds)"]


def test_curve_difference_pairs_iterations_by_seed():
    run = {0: [{"iteration": 1, "s": 0.5}, {"iteration": 2, "s": 0.75}, {"iteration": 3, "s": 1.0}],
           1: [{"iteration": 1, "s": 0.25}, {"iteration": 2, "s": math.nan}],
           2: [{"iteration": 1, "s": 0.0}]}   # no start curve for seed 2: left out
    start = {0: [{"iteration": 1, "s": 0.5}, {"iteration": 2, "s": 0.25}],
             1: [{"iteration": 1, "s": 0.5}, {"iteration": 2, "s": 0.5}]}
    diff = curve_difference(run, start, "s")
    assert diff.shape == (2, 3)
    np.testing.assert_array_equal(diff, [[0.0, 0.5, np.nan], [-0.25, np.nan, np.nan]])
    assert curve_difference(run, {}, "s").shape == (0, 0)


def test_block_differences_by_hand():
    diff = np.array([[0.0, 0.5, 0.25, np.nan, 0.1],
                     [0.5, np.nan, 0.25, 0.25, np.nan]])
    blocks = block_differences(diff, 2, n_boot=500)
    assert [(a, b) for a, b, *_ in blocks] == [(1, 2), (3, 4), (5, 5)]
    first, second, last = blocks
    assert first[2] == pytest.approx(1 / 3)           # 0, 0.5, 0.5
    assert 0.0 <= first[3] <= first[2] <= first[4] <= 0.5
    assert second[2:] == pytest.approx((0.25, 0.25, 0.25))   # every cell 0.25: no spread
    assert last[2:] == pytest.approx((0.1, 0.1, 0.1))
    assert block_differences(np.full((1, 3), np.nan), 2) == []
    with pytest.raises(ValueError, match="block must be >= 1"):
        block_differences(diff, 0)
