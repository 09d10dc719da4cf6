"""The report's tables: mean ± std over seeds, Table 1's row order, mean curves."""

from __future__ import annotations

import math

import pytest

from hisr_core.report import cell, markdown_table, mean_curve, ordered, success_table


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
