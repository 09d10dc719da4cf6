"""What every stage flow does around its work: validated params, its inputs present, the
Prefect task cache in the data area, one MLflow run with the params it reads, and the names its
runs show under in the Prefect and MLflow UIs."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hisr_core.config import Params
from tasks.caching import use_cache_dir
from tasks.cli import load_or_exit, require_all, stage_parser
from tasks.tracking import LossCurve, stage_run

#: The stage flows' own arguments' defaults: a flow run names them only when they differ.
_DEFAULTS = {"params_path": "params.yaml", "data": "data"}


def checks(*models: Path) -> Callable[[Params], None]:
    """A stage's checks before any work: the environment and its options exist and each of
    ``models`` is a saved Hugging Face model folder."""
    from tasks.expert import check_env
    from tasks.models import check_model_dir

    def check(params: Params) -> None:
        check_env(params.env)
        for model in models:
            check_model_dir(Path(model))
    return check


def pick(params: Params, keys: Sequence[str]) -> dict[str, Any]:
    """The params sections named in ``keys`` (``"model"``: the whole section; ``"env.name"``:
    one field of it), nested as in params.yaml: what a stage reads, as dvc.yaml lists it."""
    dumped = params.model_dump()
    out: dict[str, Any] = {}
    for key in keys:
        section, _, field = key.partition(".")
        if field:
            out.setdefault(section, {})[field] = dumped[section][field]
        else:
            out[section] = dumped[section]
    return out


def run_name(template: str) -> Callable[[], str]:
    """A Prefect ``flow_run_name``: ``template`` filled with the run's arguments (``"ppo/
    {variant}/seed{seed}"``), then the params file and data folder where they are not the
    defaults, so that runs of one stage on other inputs tell apart in the UI."""
    def name() -> str:
        from prefect.runtime import flow_run

        values = {k: str(v) for k, v in flow_run.parameters.items()}
        other = [f"{k.removesuffix('_path')}={values[k]}" for k, default in _DEFAULTS.items()
                 if values.get(k, default) != default]
        return template.format(**values) + (f" [{', '.join(other)}]" if other else "")
    return name


@dataclasses.dataclass
class Stage:
    """A stage's name, params and MLflow run (the active one inside :func:`run_stage`)."""

    name: str
    params: Params
    run: Any

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    def log_files(self, *paths: Path) -> None:
        """Small result files (CSV, PNG, Markdown) as run artifacts."""
        import mlflow

        for path in paths:
            mlflow.log_artifact(str(path))

    def log_curve(self, name: str, path: Path) -> None:
        """A fit's ``step,loss`` CSV as an artifact, and as the run's ``losses/<name>`` history
        when the fit came from Prefect's cache (it logged its steps in an earlier run)."""
        LossCurve(name, self.run_id).replay(path)
        self.log_files(path)

    def log_model(self, folder: Path, name: str, kind: str, **tags: str) -> str:
        """``folder`` as an MLflow logged model of this run (see
        :func:`tasks.logged_models.log_model_folder`); returns its ``models:/`` URI."""
        from tasks.logged_models import log_model_folder

        return log_model_folder(folder, name, kind, {"hisr.stage": self.name, **tags})


@contextlib.contextmanager
def run_stage(name: str, params: Params | Path, data: Path,
              sections: Sequence[str] | Mapping[str, Any], *,
              check: Callable[[Params], None] | None = None,
              needs: Mapping[Path, str] | None = None, reads: Sequence[Path] = (),
              writes: Sequence[Path] = (), tags: Mapping[str, str] | None = None,
              resume: str | None = None) -> Iterator[Stage]:
    """The frame of a stage flow's work, the MLflow run ``name``.

    ``params``: the params file (loaded and validated with ``check``, exiting with a message
    when it fails) or params already loaded. ``sections``: the params the stage reads, logged
    to MLflow (names for :func:`pick`, or the dict itself). ``needs``: input → the stage that
    makes it; the stage exits naming that stage when one is missing. ``reads`` (besides
    ``needs``) and ``writes`` go into the stage's closing line; ``tags`` onto the run;
    ``resume`` continues an earlier run (a stage restarted from its checkpoint)."""
    if not isinstance(params, Params):
        params = load_or_exit(params, check)
    use_cache_dir(data / "cache" / "prefect")
    needs = needs or {}
    require_all(needs)
    logged = sections if isinstance(sections, Mapping) else pick(params, sections)
    with stage_run(params, name, logged, tags=tags, resume=resume, reads=[*needs, *reads],
                   writes=writes) as run:
        yield Stage(name, params, run)


def stage_main(flow: Any, doc: str, check: Callable[[Params], None] | None = None
               ) -> Callable[[], None]:
    """The ``main()`` of a stage whose only arguments are ``--params`` and ``--data``."""
    def main() -> None:
        args = stage_parser(doc.splitlines()[0]).parse_args()
        load_or_exit(args.params, check)  # fail before Prefect starts
        flow(params_path=args.params, data=args.data)
    return main
