"""``expert`` stage: the task list of every split and the expert trajectories ``D_bc``.

    python -m flows.expert [--params params.yaml] [--data data]

Writes ``<data>/tasks/<split>.parquet`` for every split, ``<data>/expert/d_bc.parquet`` (the
expert's successful training episodes) and ``<data>/expert/metrics.json``.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.caching import use_cache_dir
from tasks.cli import load_or_exit, stage_parser
from tasks.expert import check_env, expert_play, make_tasks
from tasks.tracking import log_metrics, stage_run


@flow(name="expert", log_prints=True)
def expert_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    params = load_or_exit(params_path, lambda p: check_env(p.env))
    use_cache_dir(data / "cache" / "prefect")
    cfg, env = params.expert, params.env
    with stage_run(params, "expert", {"env": env.model_dump(), "expert": cfg.model_dump()},
                   writes=[data / "tasks", data / "expert"]):
        metrics: dict = {"tasks": {}, "expert": {}}
        for split, n in cfg.split_sizes().items():
            path = data / "tasks" / f"{split}.parquet"
            metrics["tasks"][split] = make_tasks(env, split, n, cfg.seed, path)
            # D_bc comes from train only; the other splits measure the expert's ceiling.
            train = split == "train"
            out = data / "expert" / "d_bc.parquet" if train else None
            metrics["expert"][split] = expert_play(env, path, out, cfg.slip_rate if train else 0.0,
                                                     cfg.workers)
        log_metrics(metrics, data / "expert" / "metrics.json")
    train = metrics["expert"]["train"]
    print(f"D_bc: {train['n_won']} trajectories, mean {train['mean_turns']:.1f} turns; "
          f"expert success {[round(m['success_rate'], 3) for m in metrics['expert'].values()]}")
    return metrics


def main() -> None:
    args = stage_parser(__doc__.splitlines()[0]).parse_args()
    load_or_exit(args.params, lambda p: check_env(p.env))  # fail before Prefect starts
    expert_flow(params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
