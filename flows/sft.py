"""``sft`` stage: behaviour cloning of the expert trajectories ``D_bc`` into ``pi_ref``.

    python -m flows.sft [--params params.yaml] [--data data]

Reads ``<data>/expert/d_bc.parquet``; writes the reference policy ``<data>/sft/pi_ref`` (a plain
Hugging Face model folder), ``<data>/sft/metrics.json`` and the loss curve
``<data>/sft/loss.csv``; logs params, per-step loss, tokens/s and the model to MLflow.

Several processes (``torchrun --nproc_per_node N -m flows.sft`` or the ``deepspeed`` launcher):
rank 0 runs the Prefect flow and logs; the other ranks run the same training steps directly.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from prefect import flow

from tasks.caching import use_cache_dir
from tasks.cli import load_or_exit, stage_parser
from tasks.models import check_model_source
from tasks.stage import checks, run_name, run_stage
from tasks.tracking import log_metrics


def _check(params) -> None:
    checks()(params)
    check_model_source(params.model.name_or_path)


@flow(name="sft", log_prints=True, flow_run_name=run_name("sft"))
def sft_flow(params_path: Path = Path("params.yaml"), data: Path = Path("data")) -> dict:
    from tasks.sft import prepare_base, train

    d_bc, out = data / "expert" / "d_bc.parquet", data / "sft"
    with run_stage("sft", params_path, data, ["env", "model", "sft"], check=_check,
                   needs={d_bc: "expert"}, writes=[out]) as stage:
        params = stage.params
        base = prepare_base(params, d_bc, data / "cache" / "sft" / "base")
        stats = train(params, base, d_bc, out / "pi_ref", out / "loss.csv", stage.run_id)
        log_metrics({"sft": stats}, out / "metrics.json")
        stage.log_model(out / "pi_ref", "pi_ref", "policy")
        stage.log_curve("sft", out / "loss.csv")
    print(f"pi_ref: {stats['steps']} steps, final loss {stats['loss']:.4f}, "
          f"{stats['tokens_per_s']:,.0f} tokens/s, {stats['seconds'] / 60:.1f} min")
    return stats


def _worker(params_path: Path, data: Path) -> None:
    """A non-zero rank: the same steps without Prefect or MLflow (training is collective)."""
    from tasks.sft import prepare_base, train

    params = load_or_exit(params_path, _check)
    use_cache_dir(data / "cache" / "prefect")  # the checkpoint folder rank 0 uses
    with tempfile.TemporaryDirectory() as work:
        base = prepare_base.fn(params, data / "expert" / "d_bc.parquet", Path(work) / "base")
        train.fn(params, base, data / "expert" / "d_bc.parquet", data / "sft" / "pi_ref", None, None)


def main() -> None:
    args = stage_parser(__doc__.splitlines()[0]).parse_args()
    load_or_exit(args.params, _check)  # fail before Prefect starts
    if int(os.environ.get("RANK", "0")) > 0:
        _worker(args.params, args.data)
    else:
        sft_flow(params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
