"""Task of the ``start_curve`` stage: the starting policy (``pi_ref``) playing every PPO
iteration's draws, the same tasks with the same sampler seeds as each PPO run of that seed.

A PPO run's training success swings with which tasks an iteration drew; the same draws played
by the policy it started from take that out: the run's success minus this curve, iteration by
iteration, is its learning curve. The first iteration's draws are played by ``pi_ref`` in both
(no update has run yet), so the two agree there exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hisr_core import contracts
from hisr_core.agent.models import load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import Params
from hisr_core.envs import Task, make_environment
from hisr_core.rl.loop import collect, iteration_tasks
from hisr_core.train.checkpoint import fingerprint
from hisr_core.train.engine import resolve_dtype
from tasks.caching import cached_task
from tasks.files import write_csv, write_text
from tasks.rollout import device

#: The columns of ``curve.csv``, named as a PPO run's ``curve.csv`` names them.
COLUMNS = ("iteration", "rollout_success", "rollout_episodes", "rollout_mean_turns",
           "rollout_parse_failure_rate")


def sections(params: Params) -> dict[str, Any]:
    """The params the draws and their play depend on."""
    ppo = params.ppo
    return {"env": params.env.model_dump(), "model": params.model.model_dump(),
            "rollout": {"max_new_tokens": params.rollout.max_new_tokens,
                        "batch_size": params.rollout.batch_size,
                        "kv_dtype": params.rollout.kv_dtype},
            "ppo": {"mode": ppo.mode, "iterations": ppo.iterations, "seed": ppo.seed,
                    "tasks_per_iter": ppo.tasks_per_iter,
                    "samples_per_task": ppo.samples_per_task,
                    "temperature": ppo.temperature, "top_p": ppo.top_p}}


def iteration_row(iteration: int, rows: list[dict[str, Any]]) -> list[Any]:
    """One ``curve.csv`` row (``iteration`` counted from 1, as PPO's curve counts it) from an
    iteration's episodes, with PPO's definitions of each rate."""
    turns = sum(r["n_turns"] for r in rows)
    unparsed = sum(not t.get("parsed", True) for r in rows for t in r["turns"])
    return [iteration + 1, sum(r["won"] for r in rows) / max(len(rows), 1), len(rows),
            turns / max(len(rows), 1), unparsed / max(turns, 1)]


def _log(run_id: str | None, row: list[Any]) -> None:
    if run_id is not None:
        import mlflow

        mlflow.log_metrics({k.replace("_", "/", 1): v
                            for k, v in zip(COLUMNS[1:], row[1:], strict=True)},
                           step=row[0], run_id=run_id)


def _partial(checkpoint: Path, fp: str) -> list[list[Any]]:
    """The rows of an earlier, stopped run of the same params and inputs (none otherwise)."""
    meta, rows = checkpoint / "meta.json", checkpoint / "rows.json"
    if meta.is_file() and rows.is_file() and json.loads(meta.read_text()) == {"fingerprint": fp}:
        return json.loads(rows.read_text())
    if checkpoint.exists():
        shutil.rmtree(checkpoint)
    return []


@cached_task("start-curve", inputs=["pi_ref", "tasks_path"], outputs=["out_csv"],
             ignore=["checkpoint", "run_id"], sections=["env", "model", "rollout", "ppo"])
def start_curve(params: Params, pi_ref: Path, tasks_path: Path, out_csv: Path,
                checkpoint: Path, run_id: str | None) -> dict[str, Any]:
    """Play iteration ``i``'s tasks of ``ppo.seed`` with ``pi_ref`` for every ``i`` of
    ``ppo.iterations``; write ``out_csv``. Each finished iteration is kept in ``checkpoint``:
    a stopped run goes on from there (an iteration's play is seeded by the iteration alone)."""
    from tqdm.auto import tqdm

    cfg = params.ppo
    if cfg.mode != "online":
        # Offline iterations redraw D_st's own rollouts: no episodes to play, an empty curve.
        print("ppo.mode is offline: PPO plays no episodes, so the start curve is empty")
        write_csv(out_csv, [COLUMNS])
        return {"iterations": 0, "episodes": 0}
    fp = fingerprint(sections(params), [pi_ref, tasks_path])
    done = _partial(checkpoint, fp)
    policy = load_model(pi_ref, dtype=resolve_dtype(params.model.dtype)).to(device()).eval()
    builder = PromptBuilder.of(load_tokenizer(pi_ref), params.model)
    env = make_environment(params.env.name, params.env.max_turns, **params.env.options)
    tasks = [Task.from_row(r) for r in contracts.read_rows(tasks_path, "tasks")]
    for row in done:  # a resumed run's MLflow run holds every iteration
        _log(run_id, row)
    for iteration in tqdm(range(len(done), cfg.iterations), desc="start curve", unit="it",
                          initial=len(done), total=cfg.iterations):
        rows = collect(policy, builder, env,
                       [tasks[i] for i in iteration_tasks(tasks, cfg, iteration)], cfg,
                       params.rollout.max_new_tokens, params.rollout.batch_size, iteration,
                       kv_dtype=params.rollout.kv_dtype)
        done.append(iteration_row(iteration, rows))
        write_text(checkpoint / "rows.json", json.dumps(done))
        write_text(checkpoint / "meta.json", json.dumps({"fingerprint": fp}))
        _log(run_id, done[-1])
    write_csv(out_csv, [COLUMNS, *done])
    shutil.rmtree(checkpoint)
    episodes = sum(r[2] for r in done)
    return {"iterations": len(done), "episodes": episodes,
            "success": sum(r[1] * r[2] for r in done) / max(episodes, 1)}
