"""``ppo`` stage: one variant of multi-turn PPO (or a baseline) trained from ``pi_ref``.

    python -m flows.ppo --variant hisr [--params params.yaml] [--data data]

Variants (``ppo.variants``): ``hisr``, ``no_him``, ``no_spr``, ``no_both``, ``no_agr``, ``ppo``
(outcome reward only), ``grpo`` (group-normalised outcome, no critic) and ``rft`` (fine-tuning
on ``pi_ref``'s successful rollouts in ``D_ct``). Reads ``<data>/sft/pi_ref``,
``<data>/hindsight/pi_hind``, ``<data>/sprm`` and ``<data>/tasks/train.parquet`` (online), or
``<data>/segment/d_st.parquet`` and ``<data>/rewards/rewards.parquet`` (``ppo.mode: offline``).
Writes ``<data>/ppo/<variant>/models/policy`` (and ``critic``), ``curve.csv`` (per-iteration
success, reward, losses, KL) and ``metrics.json``; one MLflow run per variant (tag
``variant``). A checkpoint every ``ppo.checkpoint_every`` iterations goes to
``<data>/cache/ppo/<variant>``; the same command after a crash or a kill resumes from it and
continues the same MLflow run. Under ``torchrun`` / the ``deepspeed`` launcher rank 0 runs the
Prefect flow and logs; the other ranks run the same training steps directly.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow

from tasks.cli import load_or_exit, require, stage_parser
from tasks.expert import check_env
from tasks.tracking import log_metrics, stage_run


def _check_variant(variant: str):
    def check(params) -> None:
        check_env(params.env)
        if variant not in params.ppo.variants:
            raise ValueError(f"variant {variant!r} is not in ppo.variants {params.ppo.variants}")
        if (params.ppo.mode == "online" and params.segment.segmenter == "llm"
                and variant not in ("no_spr", "no_both", "ppo", "grpo", "rft")):
            raise ValueError("online PPO segments every iteration's rollouts: set "
                             "segment.segmenter to rule, entropy or turn (llm is offline only)")
    return check


@flow(name="ppo", log_prints=True)
def ppo_flow(variant: str, params_path: Path = Path("params.yaml"),
             data: Path = Path("data")) -> dict:
    import mlflow

    from tasks.ppo import fingerprint, resumable, sections, train_ppo, train_rft, write_curve

    params = load_or_exit(params_path, _check_variant(variant))
    pi_ref = require(data / "sft" / "pi_ref", "sft")
    out = data / "ppo" / variant
    if variant == "rft":
        d_ct = require(data / "collect" / "d_ct.parquet", "collect")
        with stage_run(params, f"ppo/{variant}", sections(params, variant),
                       tags={"variant": variant}) as run:
            report = train_rft(params, pi_ref, d_ct, out / "models", out / "curve.csv",
                               run.info.run_id)
            log_metrics({"ppo": report}, out / "metrics.json")
            mlflow.log_artifact(str(out / "curve.csv"))
        print(f"rft: {report['steps']} steps on {report['trajectories']} successful rollouts")
        return report
    inputs = {"pi_hind": require(data / "hindsight" / "pi_hind", "hindsight"),
              "sprm": require(data / "sprm", "sprm"),
              "tasks": require(data / "tasks" / "train.parquet", "expert"),
              "d_st": require(data / "segment" / "d_st.parquet", "segment"),
              "rewards": require(data / "rewards" / "rewards.parquet", "rewards")}
    checkpoint = data / "cache" / "ppo" / variant
    fp = fingerprint(params, variant, [pi_ref, *inputs.values()])
    meta = resumable(checkpoint, fp)
    with stage_run(params, f"ppo/{variant}", sections(params, variant),
                   tags={"variant": variant},
                   resume=meta["run_id"] if meta else None) as run:
        report = train_ppo(params, variant, pi_ref, inputs["pi_hind"], inputs["sprm"],
                           inputs["tasks"], inputs["d_st"], inputs["rewards"], out / "models",
                           checkpoint, {"fingerprint": fp, "run_id": run.info.run_id},
                           run.info.run_id)
        curve = write_curve(run.info.run_id, out / "curve.csv")
        final = curve[-1] if curve else {}
        log_metrics({"ppo": {"iterations": report["iterations"],
                             "resumed_from": report["resumed_from"],
                             "final": {k.replace("/", "_"): v for k, v in final.items()
                                       if k != "iteration"}}}, out / "metrics.json")
        mlflow.log_artifact(str(out / "curve.csv"))
    print(f"ppo {variant}: {report['iterations']} iterations"
          + (f" (resumed after {report['resumed_from']})" if report["resumed_from"] else "")
          + (f"; last rollout success {final['rollout/success']:.3f}" if final else ""))
    return report


def _worker(variant: str, params_path: Path, data: Path) -> None:
    """A non-zero rank: the same steps without Prefect or MLflow (training is collective).
    Rank 0 has already removed a stale checkpoint: the ranks meet first in the process group
    that ``train_ppo`` creates, which rank 0 joins only after that."""
    from tasks.ppo import train_ppo, train_rft

    params = load_or_exit(params_path, _check_variant(variant))
    out = data / "ppo" / variant
    if variant == "rft":
        train_rft.fn(params, data / "sft" / "pi_ref", data / "collect" / "d_ct.parquet",
                     out / "models", out / "curve.csv", None)
        return
    train_ppo.fn(params, variant, data / "sft" / "pi_ref", data / "hindsight" / "pi_hind",
                 data / "sprm", data / "tasks" / "train.parquet",
                 data / "segment" / "d_st.parquet", data / "rewards" / "rewards.parquet",
                 out / "models", data / "cache" / "ppo" / variant, {}, None)


def main() -> None:
    parser = stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, help="one of ppo.variants")
    args = parser.parse_args()
    load_or_exit(args.params, _check_variant(args.variant))  # fail before Prefect starts
    if int(os.environ.get("RANK", "0")) > 0:
        _worker(args.variant, args.params, args.data)
    else:
        ppo_flow(variant=args.variant, params_path=args.params, data=args.data)


if __name__ == "__main__":
    main()
