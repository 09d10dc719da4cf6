"""``hindsight`` stage: ``pi_hind``, ``pi_ref`` trained to recover masked responses of ``D_ct``.

    python -m flows.hindsight [--params params.yaml] [--data data]

Reads ``<data>/collect/d_ct.parquet`` and ``<data>/sft/pi_ref``; writes the model folder
``<data>/hindsight/pi_hind``, the loss curve ``<data>/hindsight/loss.csv`` and ``metrics.json``
(on held-out tasks: the mean token NLL of the responses under ``pi_hind``, which sees the
future turns and the outcome, and under ``pi_ref``, which sees the prefix only); logs them and
the model to MLflow. Independent of the ``segment`` and ``sprm`` stages.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.stage import checks, run_name, run_stage, stage_main
from tasks.tracking import log_metrics


@flow(name="hindsight", log_prints=True, flow_run_name=run_name("hindsight"))
def hindsight_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    from tasks.hindsight import fit_hindsight

    d_ct, pi_ref = data / "collect" / "d_ct.parquet", data / "sft" / "pi_ref"
    out = data / "hindsight"
    with run_stage("hindsight", params_path, data, ["env.name", "model", "hindsight"],
                   check=checks(), needs={d_ct: "collect", pi_ref: "sft"},
                   writes=[out]) as stage:
        report = fit_hindsight(stage.params, d_ct, pi_ref, out / "pi_hind", out / "loss.csv",
                               stage.run_id)
        log_metrics({"hindsight": report}, out / "metrics.json")
        stage.log_model(out / "pi_hind", "pi_hind", "pi_hind")
        stage.log_curve("hindsight", out / "loss.csv")
    held = report.get("heldout")
    print(f"pi_hind: {report['fit']['steps']} steps on {report['fit']['examples']} examples"
          + (f"; held-out NLL {held['nll_hind']:.4f} (pi_ref from the prefix: "
             f"{held['nll_ref']:.4f})" if held else "; no held-out tasks"))
    return report


main = stage_main(hindsight_flow, __doc__, checks())


if __name__ == "__main__":
    main()
