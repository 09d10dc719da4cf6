"""Tasks of the ``evaluate`` flow: greedy episodes of a policy on held-out splits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from tqdm.auto import tqdm

from hisr_core import contracts
from hisr_core.config import Params
from hisr_core.envs import Task, environment_class, make_environment
from hisr_core.models import load_model, load_tokenizer
from hisr_core.prompts import PromptBuilder
from hisr_core.rollout import HFGenerator, Sampling, play, success_table
from hisr_core.training import resolve_dtype


def task_types(env_name: str) -> list[str]:
    return list(environment_class(env_name).task_types)


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@task(name="evaluate-split")
def evaluate_split(params: Params, model_dir: Path, split: str, tasks_path: Path, out: Path,
                   policy: str) -> dict[str, Any]:
    """Play the split's tasks greedily; write the episodes; return success/score tables."""
    env = make_environment(params.env.name, params.env.max_turns, **params.env.options)
    tasks = [Task.from_row(r) for r in contracts.read_rows(tasks_path, "tasks")]
    if params.evaluate.n_tasks is not None:
        tasks = tasks[: params.evaluate.n_tasks]
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype=resolve_dtype(params.model.dtype)).to(device())
    builder = PromptBuilder(tokenizer, params.model.history, params.model.max_tokens)
    generator = HFGenerator(model, tokenizer, builder.stop_ids)
    sampling = Sampling(temperature=0.0, max_new_tokens=params.evaluate.max_new_tokens)
    with tqdm(total=len(tasks), desc=f"evaluate {policy} {split}", unit="ep", mininterval=2) as bar:
        wins = 0

        def tick(row: dict[str, Any]) -> None:
            nonlocal wins
            wins += row["won"]
            bar.update()
            bar.set_postfix(success=f"{wins / bar.n:.3f}")

        rows = play(env, tasks, generator, builder, sampling, params.evaluate.batch_size,
                    policy=policy, on_episode=tick)
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
