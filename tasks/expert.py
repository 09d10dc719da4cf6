"""Tasks of the ``expert`` stage: task lists per split, expert trajectories ``D_bc``."""

from __future__ import annotations

import collections
import statistics
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hisr_core import contracts
from hisr_core.config import EnvParams
from hisr_core.envs import Task, make_environment
from hisr_core.envs.workers import expert_episodes
from tasks.caching import cached_task


def check_env(env: EnvParams) -> None:
    """Fail before any work if the environment or its options are unknown."""
    make_environment(env.name, env.max_turns, **env.options)


@cached_task("make-tasks", outputs=["out"])
def make_tasks(env: EnvParams, split: str, n: int, seed: int, out: Path) -> dict[str, Any]:
    """Generate ``n`` tasks of ``split`` and write them as a ``tasks`` table."""
    environment = make_environment(env.name, env.max_turns, **env.options)
    tasks = environment.make_tasks(split, n, seed)
    contracts.write_rows((t.to_row() for t in tasks), out, "tasks")
    return {"split": split, "n_tasks": len(tasks), "task_types": dict(
        sorted(collections.Counter(t.task_type for t in tasks).items()))}


@cached_task("expert-play", inputs=["tasks_path"], outputs=["out"], ignore=["workers"])
def expert_play(env: EnvParams, tasks_path: Path, out: Path | None,
                slip_rate: float = 0.0, workers: int = 0) -> dict[str, Any]:
    """Play every task of ``tasks_path`` with the expert (in ``workers`` processes, or in this
    one when 0); write the wins to ``out`` (``D_bc``).

    Returns the split's metrics: success rate, episode and mean-turn counts per task type, and
    the number of slips (recovery demonstrations, see ``ExpertParams.slip_rate``).
    """
    tasks = [Task.from_row(r) for r in contracts.read_rows(tasks_path, "tasks")]
    if workers:
        episodes = expert_episodes(env.name, env.max_turns, env.options, tasks, slip_rate,
                                   workers)
    else:
        environment = make_environment(env.name, env.max_turns, **env.options)
        episodes = (environment.expert_play(t, slip_rate) for t in tasks)
    rows, turns_by_type, failed, slips = [], collections.defaultdict(list), 0, 0
    for task_, ep in tqdm(zip(tasks, episodes, strict=True), total=len(tasks),
                          desc=f"expert {tasks_path.stem}", unit="task", mininterval=2):
        slips += sum(not t.admissible for t in ep.turns)
        if not ep.won:
            failed += 1
            continue
        turns_by_type[task_.task_type].append(len(ep.turns))
        rows.append({
            "task_id": task_.task_id, "env": task_.env, "split": task_.split,
            "task_type": task_.task_type, "instruction": task_.instruction,
            "turns": [{"observation": t.observation, "response": t.response,
                       "action": t.action, "admissible": t.admissible} for t in ep.turns],
            "n_turns": len(ep.turns), "won": ep.won, "score": ep.score,
            "final_observation": ep.final_observation,
        })
    if out is not None:
        contracts.write_rows(rows, out, "expert_trajectories")
    all_turns = [n for v in turns_by_type.values() for n in v]
    return {
        "n_tasks": len(tasks),
        "n_won": len(rows),
        "success_rate": len(rows) / len(tasks) if tasks else 0.0,
        "mean_turns": statistics.fmean(all_turns) if all_turns else 0.0,
        "episodes": {k: len(v) for k, v in sorted(turns_by_type.items())},
        "mean_turns_by_type": {k: statistics.fmean(v) for k, v in sorted(turns_by_type.items())},
        "n_failed": failed,
        "n_slips": slips,
    }
