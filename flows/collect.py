"""``collect`` stage: ``pi_ref`` plays each training task N times; filtered into ``D_ct``.

    python -m flows.collect --model data/sft/pi_ref [--params params.yaml] [--data data]

Writes ``<data>/collect/d_ct.parquet`` (kept episodes with their outcome R),
``<data>/collect/dropped.parquet`` (dropped episodes, each with its reason) and
``<data>/collect/metrics.json``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.cli import load_or_exit, stage_parser
from tasks.stage import checks, run_name, run_stage
from tasks.tracking import log_metrics


@flow(name="collect", log_prints=True, flow_run_name=run_name("collect/{model}"))
def collect_flow(model: Path, params_path: Path = Path("params.yaml"),
                 data: Path = Path("data")) -> dict:
    from tasks.collect import collect

    tasks, out = data / "tasks" / "train.parquet", data / "collect"
    with run_stage("collect", params_path, data, ["env", "model", "rollout", "collect"],
                   check=checks(model), needs={tasks: "expert"}, reads=[model],
                   writes=[out]) as stage:
        metrics = collect(stage.params, model, tasks, out / "d_ct.parquet",
                          out / "dropped.parquet", policy="pi_ref")
        log_metrics({"collect": metrics}, out / "metrics.json")
    print(f"D_ct: {metrics['kept']} of {metrics['episodes']} episodes kept "
          f"({metrics['dropped']['unparsable']} unparsable, {metrics['dropped']['loop']} loops); "
          f"success {metrics['success_rate']['all']:.3f}; "
          f"{metrics['speed']['env_steps_per_s']:.1f} env steps/s")
    return metrics


def main() -> None:
    parser = stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="policy model folder")
    args = parser.parse_args()
    load_or_exit(args.params, checks(args.model))
    collect_flow(model=args.model, params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
