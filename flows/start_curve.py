"""``start_curve`` stage: ``pi_ref`` playing the draws of every PPO iteration of one seed.

    python -m flows.start_curve [--seed 0] [--params params.yaml] [--data data]

Reads ``<data>/sft/pi_ref`` and ``<data>/tasks/train.parquet``; writes
``<data>/ppo/sft/seed<seed>/curve.csv`` (per iteration: success, episodes, mean turns and
parse failures of the tasks and sampler seeds that the PPO runs of ``ppo.seed`` play in that
iteration) and ``metrics.json``. Every variant of a seed draws the same tasks, so one curve
serves them all: a run's success minus this curve is its learning curve with the tasks' varying
difficulty taken out (the report's "learning against the start"). ``--seed`` sets ``ppo.seed``
(default: the file's). A stopped run goes on from its last finished iteration
(``<data>/cache/start_curve/seed<seed>``).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.cli import load_or_exit, stage_parser
from tasks.stage import checks, run_name, run_stage
from tasks.tracking import log_metrics


@flow(name="start_curve", log_prints=True, flow_run_name=run_name("start_curve/seed{seed}"))
def start_curve_flow(seed: int = 0, params_path: Path = Path("params.yaml"),
                     data: Path = Path("data")) -> dict:
    from tasks.start_curve import sections, start_curve

    params = load_or_exit(params_path, checks())
    params = params.model_copy(update={"ppo": params.ppo.model_copy(update={"seed": seed})})
    pi_ref, tasks_path = data / "sft" / "pi_ref", data / "tasks" / "train.parquet"
    out = data / "ppo" / "sft" / f"seed{seed}"
    with run_stage(f"start_curve/seed{seed}", params, data, sections(params),
                   tags={"seed": str(seed)}, needs={pi_ref: "sft", tasks_path: "expert"},
                   writes=[out]) as stage:
        report = start_curve(params, pi_ref, tasks_path, out / "curve.csv",
                             data / "cache" / "start_curve" / f"seed{seed}", stage.run_id)
        log_metrics({"start_curve": report}, out / "metrics.json")
        stage.log_files(out / "curve.csv")
    if report["episodes"]:
        print(f"start curve, seed {seed}: {report['episodes']} episodes over "
              f"{report['iterations']} iterations, success {report['success']:.3f}")
    return report


def main() -> None:
    parser = stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None,
                        help="ppo.seed of the PPO runs whose draws to play (default: the file's)")
    args = parser.parse_args()
    if args.seed is not None and args.seed < 0:
        parser.error("--seed must be >= 0")
    params = load_or_exit(args.params, checks())  # fail before Prefect starts
    start_curve_flow(seed=params.ppo.seed if args.seed is None else args.seed,
                     params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
