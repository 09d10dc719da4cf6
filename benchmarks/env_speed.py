"""Speed of the built-in household environment under a uniformly random admissible policy.

Each step lists the admissible commands (as an agent loop would) and plays one of them; the
episode is reset when done. Single process. Prints one JSON object.

    python benchmarks/env_speed.py --steps 200000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

from hisr_core.envs import make_environment


def run(steps: int, seed: int, n_tasks: int = 200, max_turns: int = 40) -> dict[str, object]:
    env = make_environment("household", max_turns=max_turns)
    tasks = env.make_tasks("train", n_tasks, seed)
    rng = random.Random(seed)
    episodes = 0
    ep = env.start(tasks[0])
    ep.reset()
    start = time.perf_counter()
    for _ in range(steps):
        if ep.done:
            episodes += 1
            ep = env.start(tasks[episodes % n_tasks])
            ep.reset()
        commands = ep.admissible_commands()
        ep.step(commands[rng.randrange(len(commands))])
    seconds = time.perf_counter() - start
    return {
        "benchmark": "env_speed",
        "env": "household",
        "steps": steps,
        "seconds": round(seconds, 3),
        "steps_per_second": round(steps / seconds, 1),
        "episodes": episodes + 1,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.steps, args.seed)))


if __name__ == "__main__":
    main()
