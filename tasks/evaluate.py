"""Tasks of the ``evaluate`` flow: a policy's episodes on held-out splits."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hisr_core import contracts
from hisr_core.config import Params
from hisr_core.envs import Task, environment_class, make_environment
from hisr_core.rollout.engine import Sampling, success_table
from tasks.caching import cached_task
from tasks.files import write_csv
from tasks.rollout import open_generator, play_with_progress

#: Per-task outcomes of an evaluation, beside its metrics: small enough for git, so a report's
#: paired comparisons need no DVC cache (a study's runs span machines and sessions).
OUTCOMES_FILE = "outcomes.csv"
OUTCOME_COLUMNS = ["split", "task_id", "won", "score", "n_turns"]


def task_types(env_name: str) -> list[str]:
    return list(environment_class(env_name).task_types)


@cached_task("evaluate-split", inputs=["model_dir", "tasks_path"], outputs=["out"],
             sections=["env", "model", "rollout", "evaluate"], retries=2)
def evaluate_split(params: Params, model_dir: Path, split: str, tasks_path: Path, out: Path,
                   policy: str) -> dict[str, Any]:
    """Play the split's tasks (greedily unless ``evaluate.temperature``); write the episodes;
    return success/score tables."""
    env = make_environment(params.env.name, params.env.max_turns, **params.env.options)
    tasks = [Task.from_row(r) for r in contracts.read_rows(tasks_path, "tasks")]
    cfg = params.evaluate
    if cfg.n_tasks is not None:
        tasks = tasks[: cfg.n_tasks]
    sampling = Sampling(cfg.temperature, cfg.top_p, params.rollout.max_new_tokens)
    with open_generator(params, model_dir, seed=cfg.seed) as (generator, builder):
        rows = play_with_progress(params, env, tasks, generator, builder, sampling, 1, policy,
                                  f"evaluate {policy} {split}")
    contracts.write_rows(rows, out, "episodes")
    table = success_table(rows, env.task_types)
    table["mean_turns"] = sum(r["n_turns"] for r in rows) / max(len(rows), 1)
    table["parse_failures"] = sum(not t["parsed"] for r in rows for t in r["turns"])
    table["inadmissible"] = sum(not t["admissible"] for r in rows for t in r["turns"])
    return table


def table_row(policy: str, split: str, table: dict[str, Any], task_types: list[str]) -> str:
    """A Table-1-style markdown row: success % per task type and the average."""
    cells = [f"{100 * table['success'][t]:.1f}" for t in [*task_types, "all"]]
    return f"| {policy} | {split} | " + " | ".join(cells) + " |"


def write_outcomes(episodes: Sequence[Path], out: Path) -> None:
    """One row per episode of each split's episodes file (``<split>.parquet``): the columns
    of ``OUTCOME_COLUMNS``, in file then task order."""
    rows: list[list[Any]] = [OUTCOME_COLUMNS]
    for path in episodes:
        rows += [[path.stem, r["task_id"], int(bool(r["won"])), f"{float(r['score']):.6g}",
                  int(r["n_turns"])] for r in contracts.read_rows(path, "episodes")]
    write_csv(out, rows)


def read_outcomes(path: Path) -> dict[str, dict[str, float]]:
    """split → task id → 1.0 (won) / 0.0, from a file :func:`write_outcomes` wrote."""
    out: dict[str, dict[str, float]] = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = set(OUTCOME_COLUMNS) - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: no column {min(missing)!r}; expected "
                             f"{OUTCOME_COLUMNS}")
        for r in reader:
            out.setdefault(r["split"], {})[r["task_id"]] = float(r["won"])
    return out
