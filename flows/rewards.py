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

from tasks.stage import checks, run_name, run_stage, stage_main
from tasks.tracking import log_metrics


@flow(name="rewards", log_prints=True, flow_run_name=run_name("rewards"))
def rewards_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    from tasks.rewards import reward_metrics, score, write_cases, write_position_plot

    d_st, pi_ref = data / "segment" / "d_st.parquet", data / "sft" / "pi_ref"
    pi_hind, sprm = data / "hindsight" / "pi_hind", data / "sprm"
    out = data / "rewards"
    with run_stage("rewards", params_path, data,
                   ["env.name", "model", "hindsight.past", "hindsight.future", "rewards"],
                   check=checks(), writes=[out], needs={
                       d_st: "segment", pi_ref: "sft", pi_hind: "hindsight",
                       sprm / "model": "sprm"}) as stage:
        rows = score(stage.params, d_st, pi_ref, pi_hind, sprm, out / "rewards.parquet")
        metrics = reward_metrics(rows)
        write_position_plot(metrics["position_share"], out / "position_share.csv",
                            out / "position_share.png")
        write_cases(rows, stage.params.rewards.cases, out / "cases.md", out / "cases.html")
        stage.log_files(*(out / name for name in ("position_share.csv", "position_share.png",
                                                  "cases.md", "cases.html")))
        log_metrics({"rewards": metrics}, out / "metrics.json")
    share = metrics["position_share"]
    print(f"rewards: {metrics['trajectories']} trajectories; mean r_hat sum "
          f"{metrics['r_hat_sum']['success']:.3f} (success) / "
          f"{metrics['r_hat_sum']['failure']:.3f} (failure); reward share first/middle/last, "
          "successful trajectories: "
          + " -> ".join("/".join(f"{share[f'success/{k}'][p]:.2f}" for p in
                                 ("first", "middle", "last")) for k in ("r_hat", "r_him")))
    return metrics


main = stage_main(rewards_flow, __doc__, checks())


if __name__ == "__main__":
    main()
