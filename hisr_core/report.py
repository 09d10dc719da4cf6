"""The report's tables: success rates per policy, split and task type, as mean ± std over seeds
(the paper's Table 1), and mean learning curves. Pure functions over already-read metrics.

Notation: a *policy* is ``sft`` or a variant of ``sweep.variants``; each has one evaluation
per seed (``sft``: one). An evaluation is the ``eval`` block of ``flows.evaluate``'s
``metrics.json``: ``{split: {"success": {TYPE: rate, ..., "all": rate}, ...}}``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Row order of Table 1: the baselines first, then the ablations, HISR last.
ROW_ORDER: tuple[str, ...] = ("sft", "rft", "ppo", "grpo", "no_both", "no_spr", "no_him",
                              "no_agr", "hisr")


@dataclass(frozen=True)
class Cell:
    """Success rate of one policy, split and task type over ``n`` seeds (rates in [0, 1]);
    ``std`` is the sample standard deviation, ``None`` for a single seed."""

    mean: float
    std: float | None
    n: int

    def percent(self) -> str:
        """``"42.0"`` or ``"42.0 ± 3.1"`` (percentage points)."""
        text = f"{100 * self.mean:.1f}"
        return text if self.std is None else f"{text} ± {100 * self.std:.1f}"


def cell(values: Sequence[float]) -> Cell:
    """Mean and sample std (``ddof = 1``) of one rate over seeds."""
    if not values:
        raise ValueError("a cell needs at least one evaluation")
    std = statistics.stdev(values) if len(values) > 1 else None
    return Cell(statistics.fmean(values), std, len(values))


def ordered(policies: Sequence[str]) -> list[str]:
    """``policies`` in Table 1's row order; unknown names keep their order after the known."""
    known = [p for p in ROW_ORDER if p in policies]
    return known + [p for p in policies if p not in ROW_ORDER]


def success_table(evaluations: Mapping[str, Sequence[Mapping[str, Any]]], split: str,
                  task_types: Sequence[str]) -> dict[str, dict[str, Cell]]:
    """``{policy: {TYPE: Cell, ..., "Avg": Cell}}`` for ``split``, rows in Table 1's order.

    ``evaluations[policy]`` holds one evaluation per seed; a policy none of whose
    evaluations covers ``split`` is left out. ``Avg`` is the rate over all the split's
    episodes (each seed's ``all``), as the paper's Avg column.
    """
    table: dict[str, dict[str, Cell]] = {}
    for policy in ordered(list(evaluations)):
        runs = [e[split]["success"] for e in evaluations[policy] if split in e]
        if not runs:
            continue
        row = {t: cell([r[t] for r in runs if t in r]) for t in task_types
               if any(t in r for r in runs)}
        row["Avg"] = cell([r["all"] for r in runs])
        table[policy] = row
    return table


def markdown_table(table: Mapping[str, Mapping[str, Cell]], columns: Sequence[str]) -> str:
    """A Markdown table: one row per policy, success % per column (``-`` where missing)."""
    lines = ["| policy | " + " | ".join(columns) + " | seeds |",
             "|---" * (len(columns) + 2) + "|"]
    for policy, row in table.items():
        cells = [row[c].percent() if c in row else "-" for c in columns]
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {row['Avg'].n} |")
    return "\n".join(lines)


def mean_curve(curves: Sequence[Sequence[Mapping[str, float]]], key: str
               ) -> list[tuple[int, float]]:
    """``(iteration, mean of key over the seeds that logged it)`` per iteration.

    Shape: ``curves[seed][row]`` with ``row["iteration"]``; rows lacking ``key`` (or NaN) are
    skipped, so seeds that ran fewer iterations still count where they have values.
    """
    by_iteration: dict[int, list[float]] = {}
    for curve in curves:
        for row in curve:
            value = row.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            by_iteration.setdefault(int(row["iteration"]), []).append(float(value))
    return [(i, statistics.fmean(v)) for i, v in sorted(by_iteration.items())]
