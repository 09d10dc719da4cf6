"""``expert`` stage: the task list of every split and the expert trajectories ``D_bc``.

    python -m flows.expert [--params params.yaml] [--data data]

Writes ``<data>/tasks/<split>.parquet`` for every split, ``<data>/expert/d_bc.parquet`` (the
expert's successful training episodes) and ``<data>/expert/metrics.json``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.expert import expert_play, make_tasks
from tasks.stage import checks, run_name, run_stage, stage_main
from tasks.tracking import log_metrics


@flow(name="expert", log_prints=True, flow_run_name=run_name("expert"))
def expert_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    with run_stage("expert", params_path, data, ["env", "expert"], check=checks(),
                   writes=[data / "tasks", data / "expert"]) as stage:
        cfg, env = stage.params.expert, stage.params.env
        metrics: dict = {"tasks": {}, "expert": {}}
        for split, n in cfg.split_sizes().items():
            path = data / "tasks" / f"{split}.parquet"
            metrics["tasks"][split] = make_tasks(env, split, n, cfg.seed, path)
            # D_bc comes from train only; the other splits measure the expert's ceiling.
            train = split == "train"
            out = data / "expert" / "d_bc.parquet" if train else None
            metrics["expert"][split] = expert_play(env, path, out,
                                                   cfg.slip_rate if train else 0.0, cfg.workers)
        log_metrics(metrics, data / "expert" / "metrics.json")
    train = metrics["expert"]["train"]
    print(f"D_bc: {train['n_won']} trajectories, mean {train['mean_turns']:.1f} turns; "
          f"expert success {[round(m['success_rate'], 3) for m in metrics['expert'].values()]}")
    return metrics


main = stage_main(expert_flow, __doc__, checks())


if __name__ == "__main__":
    main()
