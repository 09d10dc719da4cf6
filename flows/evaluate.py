"""``evaluate`` flow: a policy's episodes on held-out splits (greedy unless
``evaluate.temperature``).

    python -m flows.evaluate --model data/sft/pi_ref --name sft [--params params.yaml] [--data data]

Writes ``<data>/eval/<name>/episodes/<split>.parquet`` (the episodes, for inspection),
``<data>/eval/<name>/outcomes.csv`` (each task's outcome, for the report's paired comparisons) and
``<data>/eval/<name>/metrics.json``; logs ``eval/<split>/success/<TYPE>`` to MLflow; prints a
Table-1-style row per split.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.cli import load_or_exit, stage_parser
from tasks.stage import checks, pick, run_name, run_stage
from tasks.tracking import log_metrics


@flow(name="evaluate", log_prints=True, flow_run_name=run_name("evaluate/{name}"))
def evaluate_flow(model: Path, name: str, params_path: Path = Path("params.yaml"),
                  data: Path = Path("data"), tags: dict[str, str] | None = None) -> dict:
    from tasks.evaluate import OUTCOMES_FILE, evaluate_split, table_row, task_types, write_outcomes

    params = load_or_exit(params_path, checks(model))
    types = task_types(params.env.name)
    metrics: dict = {}
    sections = {**pick(params, ["env", "model", "evaluate", "rollout"]), "policy": name}
    with run_stage(f"evaluate/{name}", params, data, sections,
                   tags={"policy": name, **(tags or {})}, needs={data / "tasks": "expert"},
                   reads=[model], writes=[data / "eval" / name]):
        for split in params.evaluate.splits:
            table = evaluate_split(params, model, split, data / "tasks" / f"{split}.parquet",
                                   data / "eval" / name / "episodes" / f"{split}.parquet", name)
            metrics[split] = table
            print(table_row(name, split, table, types))
        folder = data / "eval" / name
        write_outcomes([folder / "episodes" / f"{s}.parquet" for s in params.evaluate.splits],
                       folder / OUTCOMES_FILE)
        log_metrics({"eval": metrics}, data / "eval" / name / "metrics.json")
    header = "| policy | split | " + " | ".join([*types, "Avg"]) + " |"
    print("\n".join([header, "|---" * (len(types) + 3) + "|",
                     *(table_row(name, s, metrics[s], types) for s in metrics)]))
    return metrics


def main() -> None:
    parser = stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="policy model folder")
    parser.add_argument("--name", required=True,
                        help="policy name, also its folder under <data>/eval (sft, hisr/seed0, ...)")
    parser.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                        help="MLflow tag of the run (repeatable), e.g. --tag variant=hisr")
    args = parser.parse_args()
    bad = [t for t in args.tag if "=" not in t or not t.split("=", 1)[0]]
    if bad:
        parser.error(f"--tag takes KEY=VALUE, got {bad[0]!r}")
    load_or_exit(args.params, checks(args.model))
    evaluate_flow(model=args.model, name=args.name, params_path=args.params, data=args.data,
                  tags=dict(t.split("=", 1) for t in args.tag))


if __name__ == "__main__":
    main()
