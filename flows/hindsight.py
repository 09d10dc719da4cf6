"""``hindsight`` stage: ``pi_hind``, ``pi_ref`` trained to recover masked responses of ``D_ct``.

    python -m flows.hindsight [--params params.yaml] [--data data]

Reads ``<data>/collect/d_ct.parquet`` and ``<data>/sft/pi_ref``; writes the model folder
``<data>/hindsight/pi_hind``, the loss curve ``<data>/hindsight/loss.csv`` and ``metrics.json``
(on held-out tasks: the mean token NLL of the responses under ``pi_hind``, which sees the
future turns and the outcome, and under ``pi_ref``, which sees the prefix only); logs them and
the model to MLflow. Independent of the ``segment`` and ``sprm`` stages.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.caching import use_cache_dir
from tasks.cli import load_or_exit, require, stage_parser
from tasks.expert import check_env
from tasks.tracking import log_metrics, stage_run


@flow(name="hindsight", log_prints=True)
def hindsight_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    import mlflow

    from tasks.hindsight import fit_hindsight

    params = load_or_exit(params_path, lambda p: check_env(p.env))
    use_cache_dir(data / "cache" / "prefect")
    d_ct = require(data / "collect" / "d_ct.parquet", "collect")
    pi_ref = require(data / "sft" / "pi_ref", "sft")
    out = data / "hindsight"
    sections = {"env": {"name": params.env.name}, "model": params.model.model_dump(),
                "hindsight": params.hindsight.model_dump()}
    with stage_run(params, "hindsight", sections, reads=[d_ct, pi_ref], writes=[out]) as run:
        report = fit_hindsight(params, d_ct, pi_ref, out / "pi_hind", out / "loss.csv",
                               run.info.run_id)
        log_metrics({"hindsight": report}, out / "metrics.json")
        mlflow.log_artifacts(str(out / "pi_hind"), artifact_path="pi_hind")
        mlflow.log_artifact(str(out / "loss.csv"))
    held = report.get("heldout")
    print(f"pi_hind: {report['fit']['steps']} steps on {report['fit']['examples']} examples"
          + (f"; held-out NLL {held['nll_hind']:.4f} (pi_ref from the prefix: "
             f"{held['nll_ref']:.4f})" if held else "; no held-out tasks"))
    return report


def main() -> None:
    args = stage_parser(__doc__.splitlines()[0]).parse_args()
    load_or_exit(args.params, lambda p: check_env(p.env))
    hindsight_flow(params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
