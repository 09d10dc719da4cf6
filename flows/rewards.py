"""``rewards`` stage: hindsight-modulated segmental rewards of ``D_st``, with ``pi_ref`` as the
scored policy, and the paper's reward analyses.

    python -m flows.rewards [--params params.yaml] [--data data]

Reads ``<data>/segment/d_st.parquet``, ``<data>/sft/pi_ref``, ``<data>/hindsight/pi_hind`` and
``<data>/sprm``; writes ``<data>/rewards/rewards.parquet`` (per trajectory: each segment's
``r_hat``, importance ``z`` and ``r_him``, each turn's log-ratio and importance, each variant's
per-turn rewards), the share of reward by segment position before and after modulation
(``position_share.csv`` and ``.png``, the paper's Fig. 4), case tables (``cases.md`` and
``cases.html``, the paper's Table 2), the credit accuracy of every reward signal against the
environment's oracle (``credit.csv``; ``credit`` and ``credit_heldout`` in ``metrics.json``), the
same under every combination of the reward options (``credit_options.csv``) and
``metrics.json``; logs them to MLflow.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from tasks.stage import checks, run_name, run_stage, stage_main
from tasks.tracking import log_metrics


@flow(name="rewards", log_prints=True, flow_run_name=run_name("rewards"))
def rewards_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    from hisr_core.rewards.credit import N_BOOT
    from hisr_core.train.fit import split_by_task
    from tasks.rewards import (
        credit_metrics,
        option_credit,
        reward_metrics,
        score,
        write_cases,
        write_credit_csv,
        write_option_csv,
        write_position_plot,
    )

    d_st, pi_ref = data / "segment" / "d_st.parquet", data / "sft" / "pi_ref"
    d_ct = data / "collect" / "d_ct.parquet"
    pi_hind, sprm = data / "hindsight" / "pi_hind", data / "sprm"
    out = data / "rewards"
    with run_stage("rewards", params_path, data,
                   ["env.name", "model", "hindsight.past", "hindsight.future", "hindsight.holdout",
                    "hindsight.seed", "sprm.holdout",
                    "sprm.seed", "rewards"],
                   check=checks(), writes=[out], needs={
                       d_st: "segment", d_ct: "collect", pi_ref: "sft", pi_hind: "hindsight",
                       sprm / "model": "sprm"}) as stage:
        rows = score(stage.params, d_st, pi_ref, pi_hind, sprm, d_ct, out / "rewards.parquet",
                     out / "hindsight_told.json")
        metrics = reward_metrics(rows)
        write_position_plot(metrics["position_share"], out / "position_share.csv",
                            out / "position_share.png")
        write_cases(rows, stage.params.rewards.cases, out / "cases.md", out / "cases.html")
        # The tasks the SPRM held out, as the sprm stage split them.
        sprm_cfg = stage.params.sprm
        _, held = split_by_task([r["task_id"] for r in rows], sprm_cfg.holdout, sprm_cfg.seed)
        credit = credit_metrics(rows, held, N_BOOT, seed=0)
        write_credit_csv(credit, out / "credit.csv")
        write_option_csv(option_credit(rows, stage.params.rewards.alpha, held, N_BOOT, seed=0),
                         out / "credit_options.csv")
        stage.log_files(*(out / name for name in ("position_share.csv", "position_share.png",
                                                  "cases.md", "cases.html", "credit.csv",
                                                  "credit_options.csv")))
        told = json.loads((out / "hindsight_told.json").read_text())
        log_metrics({"rewards": metrics, **credit, "hindsight_told": told}, out / "metrics.json")
    share = metrics["position_share"]
    print(f"rewards: {metrics['trajectories']} trajectories; mean r_hat sum "
          f"{metrics['r_hat_sum']['success']:.3f} (success) / "
          f"{metrics['r_hat_sum']['failure']:.3f} (failure); reward share first/middle/last, "
          "successful trajectories: "
          + " -> ".join("/".join(f"{share[f'success/{k}'][p]:.2f}" for p in
                                 ("first", "middle", "last")) for k in ("r_hat", "r_him")))
    if "credit" in credit:
        table = credit["credit"]
        print("rewards: Spearman with true credit (D_st): " + ", ".join(
            f"{s} {table[f'{s}/spearman']:.3f} [{table[f'{s}/spearman_low']:.3f}, "
            f"{table[f'{s}/spearman_high']:.3f}]" for s in ("r_hat", "r_him", "turn_sprm")
            if f"{s}/spearman" in table))
    else:
        print("rewards: no credit accuracy: the environment reported no oracle distance")
    return metrics


main = stage_main(rewards_flow, __doc__, checks())


if __name__ == "__main__":
    main()
