"""Tasks of the ``collect`` stage: N sampled rollouts per training task, filtered (``D_ct``)."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

from hisr_core import contracts
from hisr_core.config import Params
from hisr_core.envs import Task, make_environment
from hisr_core.rollout.engine import Sampling
from hisr_core.rollout.filters import drop_reason
from tasks.caching import cached_task
from tasks.rollout import open_generator, play_with_progress


@cached_task("collect-rollouts", inputs=["model_dir", "tasks_path"],
             outputs=["out", "dropped_out"], sections=["env", "model", "rollout", "collect"],
             retries=2)
def collect(params: Params, model_dir: Path, tasks_path: Path, out: Path, dropped_out: Path,
            policy: str) -> dict[str, Any]:
    """Play the first ``collect.n_tasks`` training tasks ``samples_per_task`` times each;
    write the kept episodes to ``out`` (D_ct) and the dropped ones, with reasons, beside it.
    Both files are written only once every episode is played (nothing half-written)."""
    cfg = params.collect
    env = make_environment(params.env.name, params.env.max_turns, **params.env.options)
    tasks = [Task.from_row(r) for r in contracts.read_rows(tasks_path, "tasks")]
    if cfg.n_tasks is not None:
        tasks = tasks[: cfg.n_tasks]
    sampling = Sampling(cfg.temperature, cfg.top_p, params.rollout.max_new_tokens)
    start = time.perf_counter()
    with open_generator(params, model_dir, seed=cfg.seed) as (generator, builder):
        rows = play_with_progress(params, env, tasks, generator, builder, sampling,
                                  cfg.samples_per_task, policy, f"collect {policy}")
        backend_stats = dict(generator.stats)
    seconds = time.perf_counter() - start
    for row in rows:
        row["outcome"] = row["score"]
        row["drop_reason"] = drop_reason(row["turns"], cfg.max_unparsed, cfg.loop_repeats,
                                         cfg.loop_max_period)
    kept = [r for r in rows if not r["drop_reason"]]
    dropped = [r for r in rows if r["drop_reason"]]
    contracts.write_rows(dropped, dropped_out, "rollouts")
    contracts.write_rows(kept, out, "rollouts")
    reasons = collections.Counter(r["drop_reason"].split(":")[0] for r in dropped)
    steps = sum(r["n_turns"] for r in rows)
    generated = sum(t["response_tokens"] for r in rows for t in r["turns"])
    return {
        "episodes": len(rows),
        "kept": len(kept),
        "dropped": {"total": len(dropped), "unparsable": reasons.get("unparsable", 0),
                    "loop": reasons.get("loop", 0)},
        "success_rate": {"all": _rate(rows), "kept": _rate(kept)},
        "truncated": sum(r["truncated"] for r in rows),
        "mean_turns": steps / max(len(rows), 1),
        "speed": {"seconds": seconds, "env_steps_per_s": steps / seconds,
                  "tokens_per_s": generated / seconds},
        "backend": backend_stats,
    }


def _rate(rows: list[dict[str, Any]]) -> float:
    return sum(r["won"] for r in rows) / len(rows) if rows else 0.0
