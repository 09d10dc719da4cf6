"""The rewards stage's credit-accuracy table: rewards rows (true credit and turn-SPRM reward per
turn, signals per segment, each variant's fused rewards) to metrics, ``credit.csv`` and the
report's table, on hand-made trajectories."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hisr_core.rewards.modulation import PAPER, trajectory_rewards
from hisr_core.segment.segmenter import Segment
from tasks.report import credit_table_rows, credit_verdict, option_table_rows
from tasks.rewards import (
    OPTION_GRID,
    credit_metrics,
    credit_records,
    option_credit,
    refused,
    shortcut_probe,
    write_credit_csv,
    write_option_csv,
)


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


@pytest.mark.parametrize("options", OPTION_GRID)
def test_refused_rows_are_what_the_stage_computes_under_those_options(options):
    """A row recorded under the paper's options, fused again under others from its log-ratios
    and model rewards, equals the stage's own computation under those options."""
    gen = torch.Generator().manual_seed(3)
    policy = [torch.randn(n, generator=gen) for n in (3, 1, 4, 2, 2)]
    hind = [p + 0.3 * torch.randn(p.shape, generator=gen) for p in policy]
    seg_r, turn_r = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    segments = [Segment(0, 1, ""), Segment(2, 2, ""), Segment(3, 4, "")]
    admissible = [True, False, True, True, False]
    variants = ["hisr", "no_him", "no_spr", "no_both", "no_agr", "ppo"]

    def computed(opts):
        return trajectory_rewards(policy, hind, seg_r, turn_r, segments, admissible, 0.0,
                                  beta=1.0, alpha=0.2, variants=variants, options=opts)

    recorded = computed(PAPER)
    row = {"outcome": 0.0,
           "segments": [{**s.to_row(), "r_hat": float(recorded.r_hat[j]),
                         "importance": float(recorded.segment_importance[j]),
                         "r_him": float(recorded.r_him[j])} for j, s in enumerate(segments)],
           "turns": [{"admissible": a, "log_ratio": float(recorded.log_ratios[k]),
                      "r_turn": float(turn_r[k])} for k, a in enumerate(admissible)],
           "variants": [{"variant": v, "turn_rewards": recorded.variants[v].tolist()}
                        for v in variants]}
    again, expected = refused(row, 0.2, options), computed(options)
    assert [s["r_him"] for s in again["segments"]] == pytest.approx(expected.r_him.tolist())
    assert [s["importance"] for s in again["segments"]] == \
        pytest.approx(expected.segment_importance.tolist())
    for v in again["variants"]:
        assert v["turn_rewards"] == pytest.approx(expected.variants[v["variant"]].tolist())


def test_option_credit_by_hand_and_the_report_table(tmp_path):
    """Rows 0 (won) and 1 (failed) select, row 2 is held out. Log-ratios 0: every turn weighs
    1/3. Row 1, r_hat (0.5, -0.2) on segments of 1 and 2 turns: m = (1/6, -2/15); ``l1``
    keeps sum |r_hat| = 0.7, so r_him = m * 0.7 / 0.3 sums to 7/90, and its ``hisr`` return
    is 3 * 0.1 + 0.9 * 7/90 = 0.37; ``signed_total`` keeps each part: 0.3 + 0.9 * 0.3 = 0.57.
    Row 0 (all positive, sum 1.3) returns 0.3 + 0.9 * 1.3 = 1.47 under both; ``penalty``
    takes the 0.3 off both (all actions admissible). ``length_neutral``: r_him = r_hat."""
    records = option_credit(ROWS, alpha=0.1, held_out=[2], n_boot=20, seed=0)
    assert len(records) == len(OPTION_GRID) * 2 * 3  # z, r_him, hisr in each scope
    by = {(r["importance"], r["rescale"], r["grounding"], r["scope"], r["signal"]): r
          for r in records}
    assert by[("paper", "l1", "bonus", "select", "hisr")]["return_margin"] == \
        pytest.approx(1.47 - 0.37)
    assert by[("paper", "signed_total", "bonus", "select", "hisr")]["return_margin"] == \
        pytest.approx(1.47 - 0.57)
    assert by[("paper", "l1", "penalty", "select", "hisr")]["return_margin"] == \
        pytest.approx(1.17 - 0.07)
    r_hat = credit_metrics(ROWS[:2], held_out=[], n_boot=20, seed=0)["credit"]
    neutral = by[("length_neutral", "l1", "bonus", "select", "r_him")]
    assert (neutral["spearman"], neutral["kendall"]) == \
        (pytest.approx(r_hat["r_hat/spearman"]), r_hat["r_hat/kendall"])
    assert math.isnan(by[("paper", "l1", "bonus", "heldout", "hisr")]["return_margin"])

    path = tmp_path / "credit_options.csv"
    write_option_csv(records, path)
    header, rows = option_table_rows(path)
    assert len(rows) == len(OPTION_GRID) * 2
    row = next(r for r in rows if r[:4] == ["paper", "l1", "bonus", "select"])
    assert row[header.index("hisr margin / outcome's")] == "1.10"
    assert row[header.index("lowest margin / outcome's")] == "1.10 (hisr)"


def test_shortcut_probe_by_hand():
    """r_hat per position: (0.9, 0.4), (0.5, -0.2), (1.0, 0.0): position means 0.8 and 0.0667;
    residuals (0.1, 0.333), (-0.3, -0.267), (0.2, -0.067). True credit within the won rows:
    (2, 1), (3, 0) against r_hat (.9, .4), (1, 0): the same order, Spearman 1; within the
    failed one, (1, -1) against (.5, -.2): 1 too."""
    probe = shortcut_probe(ROWS)
    y = [0.9, 0.4, 0.5, -0.2, 1.0, 0.0]
    fitted = [0.8, 0.2 / 3, 0.8, 0.2 / 3, 0.8, 0.2 / 3]
    mean = sum(y) / 6
    r2 = 1 - sum((a - b) ** 2 for a, b in zip(y, fitted)) / sum((a - mean) ** 2 for a in y)
    assert probe["position_r2"] == pytest.approx(r2)
    assert probe["spearman_won"] == pytest.approx(1.0)
    assert probe["spearman_failed"] == pytest.approx(1.0)
    assert math.isnan(shortcut_probe(ROWS[:1])["spearman_failed"])  # no failed row


def _credit_csv(path, spans: dict[str, tuple[float, float, float]]) -> None:
    metrics = {"credit": {f"{s}/spearman{k}": v for s, (p, lo, hi) in spans.items()
                          for k, v in (("", p), ("_low", lo), ("_high", hi))}}
    write_credit_csv(metrics, path)


@pytest.mark.parametrize(("r_him", "told_high", "beats"), [
    ((0.70, 0.66, 0.74), -0.001, True),    # above both, and pi_hind reads the future
    ((0.62, 0.59, 0.64), -0.001, False),   # overlaps r_hat
    ((0.70, 0.66, 0.74), 0.0002, False),   # above both, but pi_hind reads nothing
])
def test_the_report_says_whether_modulation_beats_r_hat(tmp_path, r_him, told_high, beats):
    path, told = tmp_path / "credit.csv", tmp_path / "told.json"
    _credit_csv(path, {"r_hat": (0.585, 0.560, 0.608), "r_him": r_him,
                       "turn_sprm": (0.573, 0.545, 0.600)})
    told.write_text(json.dumps({"heldout": {"told/delta": told_high - 0.0005,
                                            "told/delta_low": told_high - 0.001,
                                            "told/delta_high": told_high,
                                            "told/nll_ref": 0.12}}))
    text = " ".join(credit_verdict(path, told))
    assert ("does not beat" not in text) == beats
    word = "is above" if r_him[1] > 0.608 else "cannot be told apart from"
    assert f"{word} `r_hat`'s" in text and "`turn_sprm`'s" in text
    assert ("reads the future there" in text) == (told_high < 0)
    # Without the told NLL (an older rewards stage) the Spearman intervals alone decide.
    alone = credit_verdict(path, tmp_path / "absent.json")
    assert not any("pi_hind" in line for line in alone)
    assert ("does not beat" in " ".join(alone)) == (r_him[1] <= 0.608)


def test_the_verdict_of_a_table_without_intervals_tells_nothing_apart(tmp_path):
    """A tiny run: too few trajectories for a bootstrap interval (empty cells)."""
    path = tmp_path / "credit.csv"
    _credit_csv(path, {"r_hat": (0.5, math.nan, math.nan), "r_him": (0.9, math.nan, math.nan)})
    text = " ".join(credit_verdict(path))
    assert "cannot be told apart from `r_hat`'s (0.900 [nan, nan] vs 0.500 [nan, nan])" in text
    assert "does not beat" in text
