"""ALFWorld env-steps/s with W environment worker processes against W = 1, measured in one run.

B episodes are in play at once (as in the episode engine); every round sends one command per
episode to the workers (:class:`hisr_core.envs.workers.EnvWorkers`) and waits for all answers.
The commands come from a uniformly random policy over the admissible ones (read from the
observation, ``show_admissible`` on), so the figure is the environment's alone, without a model.
A finished episode is replaced by the next game, so resets (which load and plan a game in
TextWorld's PDDL engine) are counted as they occur in collection. Prints one JSON object (and
writes it with ``--out``).

    python benchmarks/alfworld_workers.py --data data/alfworld/games --workers 1 2 4 --steps 240
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from pathlib import Path

from _emit import emit  # benchmarks/, on the path when a benchmark runs as a script

from hisr_core.envs import make_environment
from hisr_core.envs.workers import EnvWorkers

ROOT = Path(__file__).resolve().parents[1]

ADMISSIBLE = "\nAdmissible actions: "


def _commands(observation: str) -> list[str]:
    _, sep, tail = observation.rpartition(ADMISSIBLE)
    if not sep:
        raise ValueError("the observation lists no admissible actions (show_admissible off?)")
    return tail.split(", ")


def measure(options: dict, tasks: list, workers: int, batch: int, steps: int, max_turns: int,
            seed: int) -> dict[str, float]:
    """Play ``steps`` env steps (at least) with ``batch`` episodes over ``workers`` processes."""
    rng = random.Random(seed)
    queue = iter(tasks * (steps // max(len(tasks), 1) + 2))
    with EnvWorkers("alfworld", max_turns, options, workers) as pool:
        start = time.perf_counter()
        live = {}
        keys = iter(range(10**9))
        fresh = [(next(keys), next(queue)) for _ in range(batch)]
        live.update(zip([k for k, _ in fresh], pool.start(fresh), strict=True))
        done_steps = resets = 0
        while done_steps < steps:
            ticket = pool.send_steps([(k, rng.choice(_commands(o))) for k, o in live.items()])
            results = pool.receive_steps(ticket)
            done_steps += len(results)
            ended = [k for k, r in results.items() if r.done]
            for k, r in results.items():
                if not r.done:
                    live[k] = r.observation
            for k in ended:
                del live[k]
            if ended:
                fresh = [(next(keys), next(queue)) for _ in ended]
                live.update(zip([k for k, _ in fresh], pool.start(fresh), strict=True))
                resets += len(fresh)
        seconds = time.perf_counter() - start
    return {"workers": workers, "steps": done_steps, "resets": resets,
            "seconds": round(seconds, 2), "steps_per_second": round(done_steps / seconds, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "alfworld" / "games",
                        help="folder holding json_2.1.1/ and logic/ (default: %(default)s)")
    parser.add_argument("--split", default="valid_seen")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--games", type=int, default=16,
                        help="games played in rotation")
    parser.add_argument("--batch", type=int, default=8, help="episodes in play at once")
    parser.add_argument("--steps", type=int, default=240, help="env steps per setting")
    parser.add_argument("--max-turns", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if 1 not in args.workers:
        parser.error("--workers must include 1 (the baseline)")
    options = {"data_dir": str(args.data), "show_admissible": True}
    env = make_environment("alfworld", args.max_turns, **options)
    tasks = env.make_tasks(args.split, args.games, args.seed)
    runs = [measure(options, tasks, w, args.batch, args.steps, args.max_turns, args.seed)
            for w in sorted(set(args.workers))]
    base = runs[0]["steps_per_second"]
    emit({
        "benchmark": "alfworld_workers",
        "split": args.split,
        "games": len(tasks),
        "batch": args.batch,
        "max_turns": args.max_turns,
        "runs": runs,
        "speedup": {str(r["workers"]): round(r["steps_per_second"] / base, 2) for r in runs},
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }, args.out)


if __name__ == "__main__":
    main()
