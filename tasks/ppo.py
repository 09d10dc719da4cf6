"""Tasks of the ``ppo`` stage: one variant's multi-turn PPO from ``pi_ref`` (online or offline),
resumable from its checkpoint, or ``rft`` (fine-tuning ``pi_ref`` on its successful rollouts)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from hisr_core import contracts
from hisr_core.agent.models import load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import Params
from hisr_core.envs import Task, environment_class, make_environment
from hisr_core.rewards.gated_attention import load_gated
from hisr_core.rewards.hindsight import Window
from hisr_core.rewards.modulation import RewardOptions
from hisr_core.rewards.sprm import load_sprm
from hisr_core.rl.loop import (
    Frozen,
    Inputs,
    load_checkpoint,
    needs,
    read_checkpoint_meta,
    save_models,
    setup,
    train,
)
from hisr_core.train.checkpoint import fingerprint as checkpoint_fingerprint
from hisr_core.train.engine import resolve_dtype, save_model_folder
from hisr_core.train.sft import encode_trajectories, train_sft
from tasks import checkpoints
from tasks.caching import cached_task
from tasks.files import write_csv
from tasks.rollout import device
from tasks.tracking import LossCurve

#: Per-iteration metrics drawn in ``curve.csv`` (the DVC plot) and the report's curves.
CURVE = ("rollout/success", "rewards/fused_mean", "losses/policy", "losses/value", "policy/kl",
         "policy/entropy", "policy/clipfrac", "optim/grad_norm", "critic/explained_variance",
         "rollout/parse_failure_rate", "credit/spearman", "credit/return_margin")


def sections(params: Params, variant: str) -> dict[str, Any]:
    """The params a variant's run reads (logged to MLflow, hashed into its fingerprint)."""
    return {"variant": variant, "env": params.env.model_dump(), "model": params.model.model_dump(),
            "segment": {"segmenter": params.segment.segmenter,
                        "entropy_threshold": params.segment.entropy_threshold,
                        "entropy_min_turns": params.segment.entropy_min_turns},
            "hindsight": {"past": params.hindsight.past, "future": params.hindsight.future},
            "rewards": {"beta": params.rewards.beta, "alpha": params.rewards.alpha,
                        "importance": params.rewards.importance,
                        "rescale": params.rewards.rescale,
                        "grounding": params.rewards.grounding},
            "rollout": {"max_new_tokens": params.rollout.max_new_tokens,
                        "batch_size": params.rollout.batch_size,
                        "kv_dtype": params.rollout.kv_dtype},
            "sft": params.sft.model_dump() if variant == "rft" else {},
            "ppo": params.ppo.model_dump()}


def run_dirs(data: Path, variant: str, seed: int) -> tuple[Path, Path]:
    """A run's output folder (a DVC out) and its checkpoint folder (outside DVC's outs, so
    ``dvc repro`` does not delete it before resuming)."""
    return (data / "ppo" / variant / f"seed{seed}",
            data / "cache" / "ppo" / variant / f"seed{seed}")


def fingerprint(params: Params, variant: str, inputs: list[Path]) -> str:
    """What a checkpoint must match to be resumed: the params read and the input files'
    names, sizes and bytes."""
    return checkpoint_fingerprint(sections(params, variant), inputs)


def resumable(checkpoint: Path, fp: str) -> dict[str, Any] | None:
    """The checkpoint's meta when it belongs to this very run (same fingerprint); a checkpoint
    of other params or inputs is removed, so the run starts afresh."""
    meta = read_checkpoint_meta(checkpoint)
    if meta is not None and meta.get("fingerprint") == fp:
        return meta
    if checkpoint.exists():
        print(f"{checkpoint}: a checkpoint of other params or inputs; starting afresh")
        shutil.rmtree(checkpoint)
    return None


def _frozen(params: Params, variant: str, pi_ref: Path, pi_hind: Path, sprm: Path) -> Frozen:
    need = needs(variant, params.ppo, params.rewards.ratio_reference)
    dtype = resolve_dtype(params.model.dtype)
    dev = device()

    def lm(path: Path) -> torch.nn.Module:
        return load_model(path, dtype=dtype).to(dev).eval()

    return Frozen(
        # A LoRA policy scores pi_ref itself, with its adapters disabled.
        ref=lm(pi_ref) if need["ref"] and not params.ppo.lora.enabled else None,
        hind=load_gated(pi_hind, dtype=dtype).to(dev).eval() if need["hind"] else None,
        sprm=load_sprm(sprm / "model", dtype)[0].to(dev) if need["sprm"] else None,
        turn_sprm=load_sprm(sprm / "turn_model", dtype)[0].to(dev) if need["turn_sprm"] else None)


def offline_rows(params: Params, variant: str, d_st: Path, rewards: Path) -> list[dict[str, Any]]:
    """``D_st`` rows with the rewards stage's per-turn rewards of ``variant`` (``grpo``: the
    outcome only; its group advantage reads nothing else)."""
    rows = contracts.read_rows(d_st, "segmented")
    if variant == "grpo":
        return [{**r, "turn_rewards": [0.0] * (r["n_turns"] - 1) + [r["outcome"]]} for r in rows]
    if variant not in params.rewards.variants:
        raise ValueError(f"offline {variant} needs its rewards: add it to rewards.variants")
    table = {(r["task_id"], r["sample"]): r for r in contracts.read_rows(rewards, "rewards")}
    out = []
    for r in rows:
        scored = table.get((r["task_id"], r["sample"]))
        if scored is None:
            raise ValueError(f"{rewards} has no rewards for {r['task_id']} sample {r['sample']}")
        by_variant = {v["variant"]: v["turn_rewards"] for v in scored["variants"]}
        out.append({**r, "turn_rewards": by_variant[variant]})
    return out


def _inputs(params: Params, variant: str, tokenizer: Any, tasks_path: Path, d_st: Path,
            rewards: Path) -> Inputs:
    """Online: the environment and its training tasks; offline: ``D_st`` with its rewards."""
    env_cls = environment_class(params.env.name)
    builder = PromptBuilder.of(tokenizer, params.model)
    common = {"window": Window.of(params.hindsight),
              "beta": params.rewards.beta, "alpha": params.rewards.alpha,
              "options": RewardOptions.of(params.rewards),
              "ratio_reference": params.rewards.ratio_reference,
              "max_new_tokens": params.rollout.max_new_tokens,
              "batch_size": params.rollout.batch_size,
              "kv_dtype": params.rollout.kv_dtype, "progress": True}
    if params.ppo.mode == "offline":
        return Inputs(builder, env_cls.command_grammar,
                      rows=offline_rows(params, variant, d_st, rewards), **common)
    return Inputs(builder, env_cls.command_grammar,
                  tasks=[Task.from_row(r) for r in contracts.read_rows(tasks_path, "tasks")],
                  env=make_environment(params.env.name, params.env.max_turns,
                                       **params.env.options),
                  segmenter=params.segment.segmenter, verbs=env_cls.state_changing_verbs,
                  entropy_threshold=params.segment.entropy_threshold,
                  entropy_min_turns=params.segment.entropy_min_turns, **common)


@cached_task("ppo-train", inputs=["pi_ref", "pi_hind", "sprm", "tasks_path", "d_st", "rewards"],
             outputs=["out_dir"], ignore=["extra", "run_id"],
             sections=["env", "model", "segment", "hindsight", "rewards", "rollout", "sft", "ppo"])
def train_ppo(params: Params, variant: str, pi_ref: Path, pi_hind: Path, sprm: Path,
              tasks_path: Path, d_st: Path, rewards: Path, out_dir: Path, checkpoint: Path,
              extra: dict[str, Any], run_id: str | None) -> dict[str, Any]:
    """PPO of one variant from ``pi_ref``, resumed from ``checkpoint`` when it holds an earlier
    part of this run; saves ``out_dir/policy`` (and ``out_dir/critic``)."""
    cfg = params.ppo
    tokenizer = load_tokenizer(pi_ref)
    dtype = resolve_dtype(params.model.dtype)
    need = needs(variant, cfg)
    learner = setup(load_model(pi_ref, dtype=dtype),
                    load_model(pi_ref, dtype=dtype) if need["critic"] else None, cfg, variant,
                    dtype)
    frozen = _frozen(params, variant, pi_ref, pi_hind, sprm)
    inputs = _inputs(params, variant, tokenizer, tasks_path, d_st, rewards)
    meta = load_checkpoint(learner, checkpoint)
    start = meta["iteration"] if meta else 0
    if start:
        print(f"resuming {variant} from its checkpoint after iteration {start}")
    log = LossCurve("policy", run_id)
    history = train(learner, frozen, inputs, start, checkpoint, extra, on_log=log)
    save_models(learner, out_dir / "policy", out_dir / "critic" if need["critic"] else None,
                tokenizer)
    last = history[-1] if history else {}
    return {"iterations": cfg.iterations, "resumed_from": start, "last": last}


def write_curve(run_id: str, path: Path) -> list[dict[str, float]]:
    """Per-iteration ``CURVE`` metrics of the MLflow run (after a resume, the values logged
    last for an iteration win) as CSV; returns the rows."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    points: dict[int, dict[str, float]] = {}
    for key in CURVE:
        for m in client.get_metric_history(run_id, key):
            points.setdefault(m.step, {})[key] = m.value
    rows = [{"iteration": step, **points[step]} for step in sorted(points)]
    header = ["iteration", *(k.replace("/", "_") for k in CURVE)]
    write_csv(path, [header, *([r["iteration"], *(r.get(k, "") for k in CURVE)] for r in rows)])
    return rows


@cached_task("rft-train", inputs=["pi_ref", "d_ct"], outputs=["out_dir", "loss_csv"],
             sections=["env", "model", "sft", "ppo"], ignore=["run_id"])
def train_rft(params: Params, pi_ref: Path, d_ct: Path, out_dir: Path, loss_csv: Path,
              run_id: str | None) -> dict[str, Any]:
    """``rft``: behaviour cloning from ``pi_ref`` on its own successful rollouts of ``D_ct``
    (``sft`` settings, ``ppo.rft_epochs`` passes at ``ppo.rft_lr``, ``ppo.seed``); saves
    ``out_dir/policy``."""
    rows = [r for r in contracts.read_rows(d_ct, "rollouts") if r["won"]]
    tokenizer = load_tokenizer(pi_ref)
    if not rows:
        # Nothing to fine-tune on: RFT leaves pi_ref as it is (and says so).
        print(f"warning: {d_ct} has no successful rollouts; rft's policy is pi_ref unchanged")
        save_model_folder(load_model(pi_ref), out_dir / "policy", tokenizer)
        write_csv(loss_csv, [("step", "loss")])
        return {"steps": 0, "trajectories": 0, "sequences": 0}
    builder = PromptBuilder.of(tokenizer, params.model)
    sequences = encode_trajectories(rows, builder, environment_class(params.env.name)
                                    .command_grammar)
    sft = params.sft.model_copy(update={"epochs": params.ppo.rft_epochs, "lr": params.ppo.rft_lr,
                                        "seed": params.ppo.seed})
    curve = LossCurve("sft", run_id)
    checkpoint = checkpoints.for_output(out_dir / "policy", params, ["env", "model", "sft", "ppo"],
                                        [pi_ref, d_ct], run_id)
    stats = train_sft(load_model(pi_ref, dtype=resolve_dtype(params.model.dtype)), tokenizer,
                      sequences, sft, params.model.dtype, curve, lora=params.ppo.lora,
                      out_dir=out_dir / "policy", checkpoint=checkpoint)
    curve.write_csv(loss_csv)
    checkpoints.finished(checkpoint)
    return {**stats, "trajectories": len(rows), "sequences": len(sequences)}
