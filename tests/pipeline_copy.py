"""A copy of the repository (its code, not its data) as a fresh git + DVC repo with a tiny
params file, for the end-to-end pipeline test and the no-op ``dvc repro`` benchmark."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.params_files import ROOT, over_project


def tiny_params(mlflow_uri: str, variants: list[str], experiment: str) -> dict:
    """The project's params with every stage shrunk: builtin:tiny, 16 training tasks, 4
    evaluation tasks, a few optimizer steps, 3 PPO iterations (a checkpoint after each)."""
    fit = {"backend": "torch", "log_every": 1, "micro_batch_size": 4}
    # Complete (not an overlay): DVC tracks the copy's params.yaml key by key.
    return over_project({
        "env": {"max_turns": 6},
        "expert": {"n_train": 16, "n_valid_seen": 4, "n_valid_unseen": 4},
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": experiment},
        "model": {"name_or_path": "builtin:tiny", "max_tokens": 512},
        "sft": {**fit, "max_steps": 4},
        "rollout": {"batch_size": 8, "max_new_tokens": 24},
        "evaluate": {"splits": ["valid_seen"], "n_tasks": 4},
        "collect": {"n_tasks": 4, "samples_per_task": 2, "max_unparsed": 6, "loop_repeats": 6},
        "sprm": {**fit, "max_steps": 2},
        "hindsight": {**fit, "max_steps": 2},
        "rewards": {"cases": 1},
        "ppo": {"iterations": 3, "tasks_per_iter": 2, "samples_per_task": 2, "ppo_epochs": 1,
                "minibatches": 1, "micro_batch_size": 2, "backend": "torch",
                "checkpoint_every": 1},
        "sweep": {"variants": variants},
    })


def copy_repo(dest: Path, params: dict, base_env: dict[str, str]) -> dict[str, str]:
    """Copy the repository's tracked and new files (not ``data/``, not ``dvc.lock``) to
    ``dest``, write ``params``, commit it as a new git repo; returns the environment its
    commands run in (this interpreter's ``dvc`` and ``python`` first on PATH, and as
    ``HISR_PYTHON`` when it is not a venv's)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    for rel in listed:
        if rel.startswith("data/") or rel == "dvc.lock" or not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # The stages run scripts/python, which takes the checkout's .venv: here this interpreter's
    # (ignored by git, as a real checkout's is), or this interpreter itself outside a venv.
    if sys.prefix != sys.base_prefix:
        (dest / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    env = dict(base_env)
    # One thread: a tiny model gains nothing from more, and a busy machine's oversubscribed
    # OpenMP threads would slow it many times over.
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(dest), DVC_NO_ANALYTICS="1", OMP_NUM_THREADS="1")
    if sys.prefix == sys.base_prefix:
        env["HISR_PYTHON"] = sys.executable
    # A local identity: `dvc exp run` commits, and a fresh machine may have none.
    for cmd in (["git", "init", "-q"], ["git", "config", "user.name", "pipeline test"],
                ["git", "config", "user.email", "pipeline-test@localhost"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dest, env=env, check=True)
    return env
