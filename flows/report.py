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

from tasks.stage import run_name, run_stage, stage_main
from tasks.tracking import finish_pipeline_run, log_metrics


@flow(name="report", log_prints=True, flow_run_name=run_name("report"))
def report_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    import mlflow

    from tasks.report import write_report

    out = data / "report"
    with run_stage("report", params_path, data, ["env.name", "evaluate", "sweep"], writes=[out],
                   reads=[data / "eval", data / "ppo", data / "segment",
                          data / "rewards"]) as stage:
        summary = write_report(stage.params, data, out)
        log_metrics({"report": summary}, out / "metrics.json")
        mlflow.log_artifacts(str(out), artifact_path="report")
    finish_pipeline_run(stage.params)
    print(f"report: {out / 'report.md'} and {out / 'report.html'}"
          + (f" ({summary['missing']} runs missing)" if summary["missing"] else ""))
    return summary


main = stage_main(report_flow, __doc__)


if __name__ == "__main__":
    main()
