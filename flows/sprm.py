"""``sprm`` stage: the segment-level process reward model, fitted on ``D_st`` from ``pi_ref``.

    python -m flows.sprm [--params params.yaml] [--data data]

Reads ``<data>/segment/d_st.parquet`` and ``<data>/sft/pi_ref``; writes the model folder
``<data>/sprm/model`` (the backbone as a Hugging Face folder plus the head), the loss curve
``<data>/sprm/loss.csv`` and ``metrics.json`` (MSE and Pearson r of the predicted trajectory sum
against R, on the training and the held-out tasks); logs them and the model to MLflow. It also
fits ``<data>/sprm/turn_model`` on turn segments (SPA-RL's per-turn progress model, which the
``no_spr`` / ``no_both`` variants use; ``loss_turn_model.csv``); a copy of ``model`` when the
segmenter is ``turn`` already.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from prefect import flow

from hisr_core.train.engine import replace_folder
from tasks.stage import checks, run_name, run_stage, stage_main
from tasks.tracking import log_metrics


@flow(name="sprm", log_prints=True, flow_run_name=run_name("sprm"))
def sprm_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    from tasks.sprm import fit_sprm

    d_st, pi_ref = data / "segment" / "d_st.parquet", data / "sft" / "pi_ref"
    out = data / "sprm"
    reports = {}
    with run_stage("sprm", params_path, data, ["env.name", "segment.segmenter", "model", "sprm"],
                   check=checks(), needs={d_st: "segment", pi_ref: "sft"},
                   writes=[out]) as stage:
        turn = stage.params.segment.segmenter == "turn"
        for name, turn_level, curve in (("model", False, "loss.csv"),
                                        ("turn_model", True, "loss_turn_model.csv")):
            if turn_level and turn:
                # The same fit as ``model``: copy it rather than train it twice (and log it to
                # MLflow once, as ``sprm``).
                replace_folder(out / name, lambda tmp: shutil.copytree(out / "model", tmp))
                shutil.copyfile(out / "loss.csv", out / curve)
                reports[name] = reports["model"]
            else:
                reports[name] = fit_sprm(stage.params, d_st, pi_ref, out / name, out / curve,
                                         stage.run_id, turn_level)
                stage.log_model(out / name, "sprm_turn" if turn_level else "sprm", "sprm",
                                **({"hisr.also": "turn_model"} if turn else {}))
            stage.log_curve("sprm_turn" if turn_level else "sprm", out / curve)
        log_metrics({"sprm": reports}, out / "metrics.json")
    for name, report in reports.items():
        held = report.get("heldout")
        print(f"SPRM {name}: {report['fit']['steps']} steps, train MSE "
              f"{report['train']['mse']:.4f}, r {report['train']['pearson']:.3f}"
              + (f"; held-out MSE {held['mse']:.4f}, r {held['pearson']:.3f} "
                 f"({held['trajectories']} trajectories)" if held else "; no held-out tasks"))
    return reports


main = stage_main(sprm_flow, __doc__, checks())


if __name__ == "__main__":
    main()
