"""Wall time of a ``dvc repro`` that has nothing to do, on the default stage graph (every
variant of ``sweep.variants``: 25 stages). Prints one JSON object (and writes it with
``--out``).

    python benchmarks/noop_repro.py [--repo DIR] [--repeats 3]

With ``--repo``, the repository there (reproduced already, e.g. after ``make repro``) is timed
as it is. Without, a copy of this repository with the default graph but tiny stages
(builtin:tiny, a few tasks: the shape, not the size, sets a no-op's time, since DVC re-hashes
only files whose size or modification time changed) is reproduced once first (several
minutes), then timed. Goal: <= 15 s.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _emit import emit  # benchmarks/, on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]
# The tiny copy comes from tests/pipeline_copy.py, and tests/ is not part of the installed
# package (hisr_core, tasks and flows are).
sys.path.insert(0, str(ROOT))


def _repro(repo: Path, env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(["dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True,
                          check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"dvc repro failed in {repo}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return seconds, proc.stdout + proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, help="a reproduced repository to time as it is")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from tasks.runtime import OFFLINE_ENV

    env = {**os.environ, **OFFLINE_ENV,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    setup_s = None
    with tempfile.TemporaryDirectory() as tmp:
        repo = args.repo
        if repo is None:
            import yaml

            from tests.pipeline_copy import copy_repo, tiny_params

            defaults = yaml.safe_load((ROOT / "params.yaml").read_text())["sweep"]["variants"]
            repo = Path(tmp) / "repo"
            params = tiny_params(f"sqlite:///{Path(tmp) / 'mlflow.db'}", defaults, "noop")
            env = copy_repo(repo, params, env)
            setup_s, _ = _repro(repo, env)
        stages = len(subprocess.run(["dvc", "stage", "list", "--name-only"], cwd=repo, env=env,
                                    capture_output=True, text=True, check=True).stdout.split())
        times = []
        for _ in range(args.repeats):
            seconds, out = _repro(repo, env)
            if "Running stage" in out:
                raise SystemExit(f"not a no-op: dvc repro ran stages in {repo}:\n{out[-3000:]}")
            times.append(seconds)
    emit({"benchmark": "noop_repro", "stages": stages,
          "repo": "tiny copy, default graph" if args.repo is None else str(args.repo),
          "setup_repro_s": setup_s, "noop_s": times, "median_noop_s": statistics.median(times),
          "goal_s": 15.0, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}},
         args.out)


if __name__ == "__main__":
    main()
