"""The report's tables: success rates per policy, split and task type, as mean ± std over seeds
(the paper's Table 1), paired bootstrap comparisons of policies over the same tasks and seeds,
and mean learning curves. Pure functions over already-read metrics and outcomes.

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

import numpy as np

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


# -- paired comparisons over tasks and seeds -------------------------------------------------------
#: Bootstrap resamples and the two-sided level of the report's intervals.
N_BOOT = 2000
ALPHA = 0.05


def outcome_matrix(runs: Sequence[Mapping[str, float]], tasks: Sequence[str]) -> np.ndarray:
    """One row per seed, one column per task of ``tasks``: each run's outcome (1/0 success)
    of that task. Every run must hold every task. Shape: S runs → (S, T)."""
    missing = sorted({t for run in runs for t in tasks if t not in run})
    if missing:
        raise ValueError(f"{len(missing)} tasks have no outcome in some run, e.g. {missing[0]}")
    return np.array([[float(run[t]) for t in tasks] for run in runs],
                    dtype=np.float64).reshape(len(runs), len(tasks))


def paired_runs(a: Mapping[int | None, Mapping[str, float]],
                b: Mapping[int | None, Mapping[str, float]], tasks: Sequence[str]
                ) -> tuple[np.ndarray, np.ndarray, list[int | None]]:
    """Two policies' outcomes over ``tasks``, row ``s`` of both from the same seed: the seeds
    both have, or every seed of one where the other has one evaluation shared by all seeds (key
    ``None``: the default pipeline's one ``sft``). Returns both matrices and the seeds paired
    (``[None]`` for two shared evaluations; empty where nothing pairs). Rows by position would
    pair seed 0 of one with seed 1 of the other as soon as either misses a seed.
    Shape: → (S, T), (S, T), S seeds."""
    if None in b and None not in a:
        mb, ma, seeds = paired_runs(b, a, tasks)
        return ma, mb, seeds
    if None in a:
        if None in b:
            return outcome_matrix([a[None]], tasks), outcome_matrix([b[None]], tasks), [None]
        seeds = sorted(s for s in b if s is not None)
        return (outcome_matrix([a[None]] * len(seeds), tasks),
                outcome_matrix([b[s] for s in seeds], tasks), seeds)
    seeds = sorted(set(a) & set(b))
    return (outcome_matrix([a[s] for s in seeds], tasks),
            outcome_matrix([b[s] for s in seeds], tasks), seeds)


#: The study's margin for "not worse than sft": 3 points of success (docs/results.md).
NOT_WORSE_MARGIN = 0.03


def versus_reference(low: float, high: float, margin: float = NOT_WORSE_MARGIN) -> str:
    """The protocol's verdict on a policy minus its reference from the paired interval
    ``[low, high]``: ``beats`` (above 0), ``not worse`` (above ``-margin``), ``worse`` (the whole
    interval below ``-margin``) or ``may be worse`` (the interval reaches below ``-margin``)."""
    if low > 0:
        return "beats"
    if low > -margin:
        return "not worse"
    return "worse" if high < -margin else "may be worse"


def order(low: float, high: float) -> str:
    """``>``, ``<`` or ``≈`` (cannot be told apart) for ``a - b`` from its paired interval."""
    return ">" if low > 0 else "<" if high < 0 else "≈"


def _resampled_means(a: np.ndarray, b: np.ndarray, n_boot: int, seed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Each matrix's mean over ``n_boot`` resamples of the same tasks (columns, with
    replacement) and of its seeds (rows): the same row draw for both where they have as many
    seeds (seed s of one pairs with seed s of the other), independent draws otherwise (a
    single ``sft`` run is always its one row). Shape: (S_a, T), (S_b, T) → (n_boot,), (n_boot,).
    """
    rng = np.random.default_rng(seed)
    n_tasks = a.shape[1]
    cols = rng.integers(0, n_tasks, size=(n_boot, n_tasks))
    rows_a = rng.integers(0, a.shape[0], size=(n_boot, a.shape[0]))
    rows_b = rows_a if b.shape[0] == a.shape[0] else \
        rng.integers(0, b.shape[0], size=(n_boot, b.shape[0]))

    def means(m: np.ndarray, rows: np.ndarray) -> np.ndarray:
        # mean over drawn rows and columns = mean over drawn rows of each row's drawn-column mean
        per_row = np.stack([m[:, c].mean(axis=1) for c in cols])   # (n_boot, S)
        return np.take_along_axis(per_row, rows, axis=1).mean(axis=1)

    return means(a, rows_a), means(b, rows_b)


def success_interval(a: np.ndarray, n_boot: int = N_BOOT, seed: int = 0,
                     alpha: float = ALPHA) -> tuple[float, float, float]:
    """(mean success, percentile-bootstrap interval) of one policy's runs, tasks and seeds
    resampled. Shape: (S, T)."""
    if a.size == 0:
        raise ValueError("no outcomes")
    boot, _ = _resampled_means(a, a, n_boot, seed)
    low, high = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    return float(a.mean()), float(low), float(high)


def paired_difference(a: np.ndarray, b: np.ndarray, n_boot: int = N_BOOT, seed: int = 0,
                      alpha: float = ALPHA) -> tuple[float, float, float]:
    """(mean success of ``a`` minus that of ``b``, paired percentile-bootstrap interval): both
    evaluated on the same tasks (columns), which are resampled together, with seeds paired as
    in :func:`_resampled_means`. An interval that excludes 0 tells the two apart. Shape:
    (S_a, T), (S_b, T)."""
    if a.shape[1] != b.shape[1] or a.size == 0 or b.size == 0:
        raise ValueError(f"outcomes of shapes {a.shape} and {b.shape} are not over the same "
                         "tasks")
    boot_a, boot_b = _resampled_means(a, b, n_boot, seed)
    low, high = np.quantile(boot_a - boot_b, [alpha / 2, 1 - alpha / 2])
    return float(a.mean() - b.mean()), float(low), float(high)


# -- learning against the start: PPO's training draws replayed by pi_ref ----------------------------
def curve_difference(runs: Mapping[int, Sequence[Mapping[str, float]]],
                     starts: Mapping[int, Sequence[Mapping[str, float]]],
                     key: str = "rollout_success") -> np.ndarray:
    """Per seed and iteration: a run's ``key`` minus that of its start curve (the same seed's
    draws played by ``pi_ref``); NaN where either lacks the iteration. Seeds without a start
    curve are left out. Shape: ``runs[seed][row]`` with ``row["iteration"]`` counted from 1 →
    (S, I), S the seeds with both, I the last iteration any run logged."""
    def by_iteration(rows: Sequence[Mapping[str, float]]) -> dict[int, float]:
        return {int(r["iteration"]): float(r[key]) for r in rows
                if key in r and not math.isnan(float(r[key]))}

    seeds = [s for s in sorted(runs) if s in starts]
    pairs = [(by_iteration(runs[s]), by_iteration(starts[s])) for s in seeds]
    width = max((i for run, _ in pairs for i in run), default=0)
    out = np.full((len(seeds), width), np.nan)
    for row, (run, start) in enumerate(pairs):
        for i, value in run.items():
            if i in start:
                out[row, i - 1] = value - start[i]
    return out


def block_differences(diff: np.ndarray, block: int, n_boot: int = N_BOOT, seed: int = 0,
                      alpha: float = ALPHA) -> list[tuple[int, int, float, float, float]]:
    """Per block of ``block`` consecutive iterations: (first, last iteration, mean difference,
    percentile-bootstrap interval), over the block's (seed, iteration) cells that have a value,
    resampled with replacement (an iteration's draws are independent of the others'). Blocks
    without a value are left out. Shape: (S, I) from :func:`curve_difference`."""
    if block < 1:
        raise ValueError(f"block must be >= 1, not {block}")
    rng = np.random.default_rng(seed)
    out = []
    for first in range(0, diff.shape[1], block):
        cells = diff[:, first:first + block]
        values = cells[~np.isnan(cells)]
        if values.size == 0:
            continue
        boot = rng.choice(values, size=(n_boot, values.size)).mean(axis=1)
        low, high = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
        out.append((first + 1, min(first + block, diff.shape[1]), float(values.mean()),
                    float(low), float(high)))
    return out
