"""``evaluate`` flow: greedy episodes of a policy on held-out splits.

    python -m flows.evaluate --model data/sft/pi_ref --name sft [--params params.yaml] [--data data]

Writes ``<data>/eval/<name>/episodes/<split>.parquet`` (the episodes, for inspection) and
``<data>/eval/<name>/metrics.json``; logs ``eval/<split>/success/<TYPE>`` to MLflow; prints a
Table-1-style row per split.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.cli import load_or_exit, stage_parser
from tasks.expert import check_env
from tasks.models import check_model_dir
from tasks.tracking import log_metrics, stage_run


@flow(name="evaluate", log_prints=True)
def evaluate_flow(model: Path, name: str, params_path: Path = Path("params.yaml"),
                  data: Path = Path("data")) -> dict:
    from tasks.evaluate import evaluate_split, table_row, task_types

    params = load_or_exit(params_path, lambda p: (check_env(p.env), check_model_dir(model)))
    types = task_types(params.env.name)
    metrics: dict = {}
    sections = {"env": params.env.model_dump(), "model": params.model.model_dump(),
                "evaluate": params.evaluate.model_dump(),
                "rollout": params.rollout.model_dump(), "policy": name}
    with stage_run(params, f"evaluate/{name}", sections):
        for split in params.evaluate.splits:
            table = evaluate_split(params, model, split, data / "tasks" / f"{split}.parquet",
                                   data / "eval" / name / "episodes" / f"{split}.parquet", name)
            metrics[split] = table
            print(table_row(name, split, table, types))
        log_metrics({"eval": metrics}, data / "eval" / name / "metrics.json")
    header = "| policy | split | " + " | ".join([*types, "Avg"]) + " |"
    print("\n".join([header, "|---" * (len(types) + 3) + "|",
                     *(table_row(name, s, metrics[s], types) for s in metrics)]))
    return metrics


def main() -> None:
    parser = stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="policy model folder")
    parser.add_argument("--name", required=True, help="policy name (sft, ppo-hisr, ...)")
    args = parser.parse_args()
    load_or_exit(args.params, lambda p: (check_env(p.env), check_model_dir(args.model)))
    evaluate_flow(model=args.model, name=args.name, params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
