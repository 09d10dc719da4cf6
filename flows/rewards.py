"""``rewards`` stage: hindsight-modulated segmental rewards of ``D_st``, with ``pi_ref`` as the
scored policy, and the paper's reward analyses.

    python -m flows.rewards [--params params.yaml] [--data data]

Reads ``<data>/segment/d_st.parquet``, ``<data>/sft/pi_ref``, ``<data>/hindsight/pi_hind`` and
``<data>/sprm``; writes ``<data>/rewards/rewards.parquet`` (per trajectory: each segment's
``r_hat``, importance ``z`` and ``r_him``, each turn's log-ratio and importance, each variant's
per-turn rewards), the share of reward by segment position before and after modulation
(``position_share.csv`` and ``.png``, the paper's Fig. 4), case tables (``cases.md`` and
``cases.html``, the paper's Table 2) and ``metrics.json``; logs them to MLflow.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.caching import use_cache_dir
from tasks.cli import load_or_exit, require, stage_parser
from tasks.expert import check_env
from tasks.tracking import log_metrics, stage_run


@flow(name="rewards", log_prints=True)
def rewards_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    import mlflow

    from tasks.rewards import reward_metrics, score, write_cases, write_position_plot

    params = load_or_exit(params_path, lambda p: check_env(p.env))
    use_cache_dir(data / "cache" / "prefect")
    d_st = require(data / "segment" / "d_st.parquet", "segment")
    pi_ref = require(data / "sft" / "pi_ref", "sft")
    pi_hind = require(data / "hindsight" / "pi_hind", "hindsight")
    sprm = require(data / "sprm" / "model", "sprm").parent
    out = data / "rewards"
    sections = {"env": {"name": params.env.name}, "model": params.model.model_dump(),
                "hindsight": {"past": params.hindsight.past,
                              "future": params.hindsight.future},
                "rewards": params.rewards.model_dump()}
    with stage_run(params, "rewards", sections, reads=[d_st, pi_ref, pi_hind, sprm],
                   writes=[out]):
        rows = score(params, d_st, pi_ref, pi_hind, sprm, out / "rewards.parquet")
        metrics = reward_metrics(rows)
        write_position_plot(metrics["position_share"], out / "position_share.csv",
                            out / "position_share.png")
        write_cases(rows, params.rewards.cases, out / "cases.md", out / "cases.html")
        for name in ("position_share.csv", "position_share.png", "cases.md", "cases.html"):
            mlflow.log_artifact(str(out / name))
        log_metrics({"rewards": metrics}, out / "metrics.json")
    share = metrics["position_share"]
    print(f"rewards: {metrics['trajectories']} trajectories; mean r_hat sum "
          f"{metrics['r_hat_sum']['success']:.3f} (success) / "
          f"{metrics['r_hat_sum']['failure']:.3f} (failure); reward share first/middle/last, "
          "successful trajectories: "
          + " -> ".join("/".join(f"{share[f'success/{k}'][p]:.2f}" for p in
                                 ("first", "middle", "last")) for k in ("r_hat", "r_him")))
    return metrics


def main() -> None:
    args = stage_parser(__doc__.splitlines()[0]).parse_args()
    load_or_exit(args.params, lambda p: check_env(p.env))
    rewards_flow(params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
