"""Where a stage's fits keep their checkpoints, and which MLflow run a restarted stage goes on.

A fit writing ``<data>/<stage>/<model>`` (a DVC out) keeps its checkpoint in
``<data>/cache/checkpoints/<stage>/<model>``: outside DVC's outs, so ``dvc repro`` does not
delete it before the stage resumes. The task removes it once the stage's files are written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hisr_core.config import Params
from tasks.caching import cache_dir

if TYPE_CHECKING:
    from hisr_core.train.fit import Checkpoint

# The training modules (torch, transformers) are imported where needed: every stage's
# ``stage_run`` asks :func:`run_to_resume`, most stages train nothing.


def folder_for(out_dir: Path) -> Path:
    """The checkpoint folder of the fit that writes ``out_dir`` (relative to the working
    directory when inside it: it is named in messages)."""
    data = cache_dir().parents[1]  # cache_dir() is <data>/cache/prefect
    root = cache_dir().parent / "checkpoints"
    try:
        folder = root / Path(out_dir).resolve().relative_to(data.resolve())
    except ValueError:  # an output outside the data folder: a stable name of its own
        folder = root / hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:16]
    try:
        return folder.relative_to(Path.cwd())
    except ValueError:
        return folder


def _without(value: Any, keys: set[str]) -> Any:
    if isinstance(value, Mapping):
        return {k: _without(v, keys) for k, v in value.items() if k not in keys}
    return value


def for_output(out_dir: Path, params: Params, sections: Sequence[str],
               inputs: Sequence[Path | str], run_id: str | None, **more: Any) -> Checkpoint:
    """The checkpoint of the fit writing ``out_dir``: its fingerprint covers the params
    ``sections`` (not ``checkpoint_every_s``), ``more`` and the input files or folders (a model
    name that is no local path counts by its name); it records the MLflow run ``run_id``."""
    from hisr_core.train import checkpoint as ckpt
    from hisr_core.train.fit import NOT_FINGERPRINTED, Checkpoint

    dump = params.model_dump(mode="json")
    config = {"sections": {s: _without(dump[s], NOT_FINGERPRINTED) for s in sections},
              "names": [str(p) for p in inputs], **more}
    paths = [Path(p) for p in inputs if Path(p).exists()]
    return Checkpoint(folder_for(out_dir), ckpt.fingerprint(config, paths),
                      {"run_id": run_id} if run_id else {})


def finished(checkpoint: Checkpoint) -> None:
    """The task's files are written: its checkpoint is no longer needed. Collective."""
    from hisr_core.train import checkpoint as ckpt
    from hisr_core.train.engine import init_distributed

    ckpt.remove(checkpoint.folder, init_distributed())


#: The run tag holding the stamp of the files a stage read (:func:`hisr_core.stamp.fingerprint`).
INPUTS_TAG = "hisr.inputs"


def run_to_resume(writes: Sequence[Path], logged: Mapping[str, str], inputs: str) -> str | None:
    """The MLflow run a restarted stage goes on with: one named by a checkpoint of a fit
    writing under ``writes``, not finished, with the same params ``logged`` and the same stamp
    of its inputs ``inputs`` (other inputs: the fit starts afresh, so the run would log its
    steps twice); else ``None``."""
    folders = [f for f in map(folder_for, writes) if f.is_dir()]
    if not folders:
        return None
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from hisr_core.train import checkpoint as ckpt

    client = MlflowClient()
    for folder in folders:
        for path in sorted(folder.rglob(ckpt.META)):
            run_id = (ckpt.read_meta(path.parent) or {}).get("run_id")
            if not run_id:
                continue
            try:
                run = client.get_run(run_id)
            except MlflowException:
                continue  # a run deleted since
            same = (run.data.tags.get(INPUTS_TAG) == inputs
                    and all(run.data.params.get(k) == v for k, v in logged.items()))
            if run.info.status != "FINISHED" and run.info.lifecycle_stage == "active" and same:
                return run_id
    return None
