"""``report`` stage: the pipeline's results in one Markdown and one HTML report.

    python -m flows.report [--params params.yaml] [--data data]

Reads ``<data>/eval/sft/metrics.json``, ``<data>/eval/<variant>/seed<k>/metrics.json`` and
``<data>/ppo/<variant>/seed<k>/curve.csv`` for every variant and seed of ``sweep``, and the
segment and reward analyses. Writes ``<data>/report/report.md``, ``report.html``,
``table.csv`` (Table 1: success % per policy, split and task type, mean ± std over seeds),
``curves.png`` (learning curves) and the analyses' figures; logs them to MLflow and then
finishes the pipeline's parent run (the last stage of a pipeline run).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.cli import load_or_exit, stage_parser
from tasks.tracking import finish_pipeline_run, log_metrics, stage_run


@flow(name="report", log_prints=True)
def report_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    import mlflow

    from tasks.report import write_report

    params = load_or_exit(params_path)
    out = data / "report"
    sections = {"env": {"name": params.env.name}, "evaluate": params.evaluate.model_dump(),
                "sweep": params.sweep.model_dump()}
    with stage_run(params, "report", sections, writes=[out],
                   reads=[data / "eval", data / "ppo", data / "segment", data / "rewards"]):
        summary = write_report(params, data, out)
        log_metrics({"report": summary}, out / "metrics.json")
        mlflow.log_artifacts(str(out), artifact_path="report")
    finish_pipeline_run(params)
    print(f"report: {out / 'report.md'} and {out / 'report.html'}"
          + (f" ({summary['missing']} runs missing)" if summary["missing"] else ""))
    return summary


def main() -> None:
    args = stage_parser(__doc__.splitlines()[0]).parse_args()
    load_or_exit(args.params)  # fail before Prefect starts
    report_flow(params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
