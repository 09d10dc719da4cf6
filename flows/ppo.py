"""``ppo`` stage: one variant of multi-turn PPO (or a baseline) trained from ``pi_ref``.

    python -m flows.ppo --variant hisr [--seed 0] [--params params.yaml] [--data data]

Variants (the pipeline runs each of ``sweep.variants`` with each of ``sweep.seeds``): ``hisr``,
``no_him``, ``no_spr``, ``no_both``, ``no_agr``, ``ppo`` (outcome reward only), ``grpo``
(group-normalised outcome, no critic) and ``rft`` (fine-tuning on ``pi_ref``'s successful
rollouts in ``D_ct``). Reads ``<data>/sft/pi_ref``, ``<data>/hindsight/pi_hind``,
``<data>/sprm`` and ``<data>/tasks/train.parquet`` (online), or ``<data>/segment/d_st.parquet``
and ``<data>/rewards/rewards.parquet`` (``ppo.mode: offline``). Writes
``<data>/ppo/<variant>/seed<seed>/models/policy`` (and ``critic``), ``curve.csv``
(per-iteration success, reward, losses, KL) and ``metrics.json``; one MLflow run per variant
and seed (tags ``variant``, ``seed``). ``--seed`` sets ``ppo.seed`` (default: the file's). A
checkpoint every ``ppo.checkpoint_every`` iterations goes to
``<data>/cache/ppo/<variant>/seed<seed>``; the same command after a crash or a kill resumes
from it and continues the same MLflow run. Under ``torchrun`` / the ``deepspeed`` launcher
rank 0 runs the Prefect flow and logs; the other ranks run the same training steps directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import get_args

from prefect import flow

from hisr_core.config import Params, Variant
from tasks.caching import use_cache_dir
from tasks.cli import load_or_exit, require_all, stage_parser
from tasks.stage import checks, run_name, run_stage
from tasks.tracking import log_metrics


def _check_variant(variant: str):
    def check(params) -> None:
        checks()(params)
        if variant == "grpo" and params.ppo.samples_per_task < 2:
            raise ValueError("grpo needs ppo.samples_per_task >= 2 (its advantage is relative "
                             "to the other rollouts of the same task)")
        if (params.ppo.mode == "online" and params.segment.segmenter == "llm"
                and variant not in ("no_spr", "no_both", "ppo", "grpo", "rft")):
            raise ValueError("online PPO segments every iteration's rollouts: set "
                             "segment.segmenter to rule, entropy or turn (llm is offline only)")
    return check


def _load(params_path: Path, variant: str, seed: int | None) -> Params:
    """Validated params with ``ppo.seed`` set from ``--seed`` (when given)."""
    params = load_or_exit(params_path, _check_variant(variant))
    if seed is None:
        return params
    return params.model_copy(update={"ppo": params.ppo.model_copy(update={"seed": seed})})


@flow(name="ppo", log_prints=True, flow_run_name=run_name("ppo/{variant}/seed{seed}"))
def ppo_flow(variant: str, seed: int = 0, params_path: Path = Path("params.yaml"),
             data: Path = Path("data")) -> dict:
    from tasks.ppo import (
        fingerprint,
        resumable,
        run_dirs,
        sections,
        train_ppo,
        train_rft,
        write_curve,
    )

    params = _load(params_path, variant, seed)
    pi_ref = data / "sft" / "pi_ref"
    out, checkpoint = run_dirs(data, variant, seed)
    name, tags = f"ppo/{variant}/seed{seed}", {"variant": variant, "seed": str(seed)}
    # The trained policy as a logged model, named so that the experiment's Models tab tells
    # the variants and seeds apart.
    model_name = f"policy-{variant}-seed{seed}"
    if variant == "rft":
        d_ct = data / "collect" / "d_ct.parquet"
        with run_stage(name, params, data, sections(params, variant), tags=tags,
                       needs={pi_ref: "sft", d_ct: "collect"}, writes=[out]) as stage:
            report = train_rft(params, pi_ref, d_ct, out / "models", out / "curve.csv",
                               stage.run_id)
            log_metrics({"ppo": report}, out / "metrics.json")
            stage.log_model(out / "models" / "policy", model_name, "policy", **tags)
            stage.log_curve("sft", out / "curve.csv")
        print(f"rft: {report['steps']} steps on {report['trajectories']} successful rollouts")
        return report
    inputs = {"pi_hind": data / "hindsight" / "pi_hind", "sprm": data / "sprm",
              "tasks": data / "tasks" / "train.parquet", "d_st": data / "segment" / "d_st.parquet",
              "rewards": data / "rewards" / "rewards.parquet"}
    makers = {"pi_hind": "hindsight", "sprm": "sprm", "tasks": "expert", "d_st": "segment",
              "rewards": "rewards"}
    needs = {pi_ref: "sft", **{path: makers[key] for key, path in inputs.items()}}
    # Before the fingerprint: a missing input would change it and discard the checkpoint.
    require_all(needs)
    fp = fingerprint(params, variant, [pi_ref, *inputs.values()])
    meta = resumable(checkpoint, fp)
    with run_stage(name, params, data, sections(params, variant), tags=tags, needs=needs,
                   resume=meta["run_id"] if meta else None, writes=[out]) as stage:
        report = train_ppo(params, variant, pi_ref, inputs["pi_hind"], inputs["sprm"],
                           inputs["tasks"], inputs["d_st"], inputs["rewards"], out / "models",
                           checkpoint, {"fingerprint": fp, "run_id": stage.run_id},
                           stage.run_id)
        curve = write_curve(stage.run_id, out / "curve.csv")
        final = curve[-1] if curve else {}
        log_metrics({"ppo": {"iterations": report["iterations"],
                             "resumed_from": report["resumed_from"],
                             "final": {k.replace("/", "_"): v for k, v in final.items()
                                       if k != "iteration"}}}, out / "metrics.json")
        stage.log_model(out / "models" / "policy", model_name, "policy", **tags)
        stage.log_files(out / "curve.csv")
    print(f"ppo {variant} seed {seed}: {report['iterations']} iterations"
          + (f" (resumed after {report['resumed_from']})" if report["resumed_from"] else "")
          + (f"; last rollout success {final['rollout/success']:.3f}" if final else ""))
    return report


def _worker(variant: str, seed: int | None, params_path: Path, data: Path) -> None:
    """A non-zero rank: the same steps without Prefect or MLflow (training is collective).
    Rank 0 has already removed a stale checkpoint: the ranks meet first in the process group
    that ``train_ppo`` creates, which rank 0 joins only after that."""
    from tasks.ppo import run_dirs, train_ppo, train_rft

    params = _load(params_path, variant, seed)
    use_cache_dir(data / "cache" / "prefect")  # rft's fit checkpoint folder, as rank 0's
    out, checkpoint = run_dirs(data, variant, params.ppo.seed)
    if variant == "rft":
        train_rft.fn(params, data / "sft" / "pi_ref", data / "collect" / "d_ct.parquet",
                     out / "models", out / "curve.csv", None)
        return
    train_ppo.fn(params, variant, data / "sft" / "pi_ref", data / "hindsight" / "pi_hind",
                 data / "sprm", data / "tasks" / "train.parquet",
                 data / "segment" / "d_st.parquet", data / "rewards" / "rewards.parquet",
                 out / "models", checkpoint, {}, None)


def main() -> None:
    parser = stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, choices=get_args(Variant),
                        help="the reward variant or baseline")
    parser.add_argument("--seed", type=int, default=None,
                        help="ppo.seed of this run (default: the params file's)")
    args = parser.parse_args()
    if args.seed is not None and args.seed < 0:
        parser.error("--seed must be >= 0")
    params = _load(args.params, args.variant, args.seed)  # fail before Prefect starts
    if int(os.environ.get("RANK", "0")) > 0:
        _worker(args.variant, args.seed, args.params, args.data)
    else:
        ppo_flow(variant=args.variant, seed=params.ppo.seed, params_path=args.params,
                 data=args.data)


if __name__ == "__main__":
    main()
