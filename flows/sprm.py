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
from tasks.caching import use_cache_dir
from tasks.cli import load_or_exit, require, stage_parser
from tasks.expert import check_env
from tasks.tracking import log_metrics, stage_run


@flow(name="sprm", log_prints=True)
def sprm_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    import mlflow

    from tasks.sprm import fit_sprm

    params = load_or_exit(params_path, lambda p: check_env(p.env))
    use_cache_dir(data / "cache" / "prefect")
    d_st = require(data / "segment" / "d_st.parquet", "segment")
    pi_ref = require(data / "sft" / "pi_ref", "sft")
    out = data / "sprm"
    sections = {"env": {"name": params.env.name}, "model": params.model.model_dump(),
                "sprm": params.sprm.model_dump()}
    reports = {}
    with stage_run(params, "sprm", sections, reads=[d_st, pi_ref], writes=[out]) as run:
        for name, turn_level, curve in (("model", False, "loss.csv"),
                                        ("turn_model", True, "loss_turn_model.csv")):
            if turn_level and params.segment.segmenter == "turn":
                # The same fit as ``model``: copy it rather than train it twice.
                replace_folder(out / name, lambda tmp: shutil.copytree(out / "model", tmp))
                shutil.copyfile(out / "loss.csv", out / curve)
                reports[name] = reports["model"]
            else:
                reports[name] = fit_sprm(params, d_st, pi_ref, out / name, out / curve,
                                         run.info.run_id, turn_level)
            mlflow.log_artifacts(str(out / name), artifact_path=f"sprm/{name}")
            mlflow.log_artifact(str(out / curve))
        log_metrics({"sprm": reports}, out / "metrics.json")
    for name, report in reports.items():
        held = report.get("heldout")
        print(f"SPRM {name}: {report['fit']['steps']} steps, train MSE "
              f"{report['train']['mse']:.4f}, r {report['train']['pearson']:.3f}"
              + (f"; held-out MSE {held['mse']:.4f}, r {held['pearson']:.3f} "
                 f"({held['trajectories']} trajectories)" if held else "; no held-out tasks"))
    return reports


def main() -> None:
    args = stage_parser(__doc__.splitlines()[0]).parse_args()
    load_or_exit(args.params, lambda p: check_env(p.env))
    sprm_flow(params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
