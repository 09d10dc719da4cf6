"""``pipeline`` flow: every stage in graph order, in one process, without DVC.

    python -m flows.pipeline [--params params.yaml] [--data data] [--from STAGE]

expert → sft → evaluate (sft) → collect → segment → sprm → hindsight → rewards → for each
seed of ``sweep``: start_curve → for each variant and seed: ppo → evaluate → report. Each
stage is a sub-flow run (the Prefect UI shows them nested) and a child of one MLflow parent
run. ``--from`` starts at a
stage, reusing what the earlier ones wrote to ``--data``. After a failure, the same command
continues the same MLflow parent run, and PPO resumes from its checkpoint. ``dvc repro`` runs
the same stages but only those whose inputs changed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from prefect import flow

from flows.collect import collect_flow
from flows.evaluate import evaluate_flow
from flows.expert import expert_flow
from flows.hindsight import hindsight_flow
from flows.ppo import ppo_flow
from flows.report import report_flow
from flows.rewards import rewards_flow
from flows.segment import segment_flow
from flows.sft import sft_flow
from flows.sprm import sprm_flow
from flows.start_curve import start_curve_flow
from tasks.cli import load_or_exit, stage_parser
from tasks.stage import run_name
from tasks.tracking import pipeline_run_id

#: Stage names in graph order (``start_curve`` runs once per seed, ``ppo`` and ``evaluate``
#: once per variant and seed).
STAGES = ("expert", "sft", "evaluate_sft", "collect", "segment", "sprm", "hindsight", "rewards",
          "start_curve", "ppo", "report")


@flow(name="pipeline", log_prints=True, flow_run_name=run_name("pipeline/from-{start}"))
def pipeline_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data"),
                  start: str = "expert") -> dict:
    if start not in STAGES:
        raise ValueError(f"unknown stage {start!r}; one of {', '.join(STAGES)}")
    params = load_or_exit(params_path)
    # Every stage run below nests under this parent (the report stage finishes it).
    os.environ["HISR_PARENT_RUN_ID"] = pipeline_run_id(params)
    pi_ref = data / "sft" / "pi_ref"
    runs: list[tuple[str, str, object, dict]] = [  # (stage, run label, flow, arguments)
        ("expert", "expert", expert_flow, {}), ("sft", "sft", sft_flow, {}),
        ("evaluate_sft", "evaluate_sft", evaluate_flow, {"model": pi_ref, "name": "sft"}),
        ("collect", "collect", collect_flow, {"model": pi_ref}),
        ("segment", "segment", segment_flow, {}), ("sprm", "sprm", sprm_flow, {}),
        ("hindsight", "hindsight", hindsight_flow, {}), ("rewards", "rewards", rewards_flow, {})]
    runs += [("start_curve", f"start_curve@{seed}", start_curve_flow, {"seed": seed})
             for seed in params.sweep.seeds]
    for variant in params.sweep.variants:
        for seed in params.sweep.seeds:
            runs += [("ppo", f"ppo@{variant}-{seed}", ppo_flow,
                      {"variant": variant, "seed": seed}),
                     ("ppo", f"evaluate@{variant}-{seed}", evaluate_flow,
                      {"model": data / "ppo" / variant / f"seed{seed}" / "models" / "policy",
                       "name": f"{variant}/seed{seed}",
                       "tags": {"variant": variant, "seed": str(seed)}})]
    runs.append(("report", "report", report_flow, {}))
    todo = STAGES[STAGES.index(start):]
    timings: dict[str, float] = {}
    try:
        for stage, label, fn, kwargs in runs:
            if stage not in todo:
                continue
            begin = time.perf_counter()
            fn(params_path=params_path, data=data, **kwargs)
            timings[label] = time.perf_counter() - begin
            print(f"pipeline: {label} done in {timings[label]:.1f} s")
    finally:
        os.environ.pop("HISR_PARENT_RUN_ID", None)
    print(f"pipeline: {len(timings)} stage runs in {sum(timings.values()) / 60:.1f} min")
    return timings


def main() -> None:
    parser = stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--from", dest="start", default="expert", choices=STAGES,
                        help="first stage to run (default: expert)")
    args = parser.parse_args()
    load_or_exit(args.params)  # fail before Prefect starts
    pipeline_flow(params_path=args.params, data=args.data, start=args.start)


if __name__ == "__main__":
    main()
