"""Task of the ``sprm`` stage: fit the segment-level process reward model on ``D_st``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hisr_core import contracts
from hisr_core.agent.models import load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import Params
from hisr_core.envs import environment_class
from hisr_core.rewards.sprm import Trajectory, encode_trajectory, evaluate, train_sprm
from hisr_core.segment.segmenter import Segment, by_turn
from hisr_core.train.engine import resolve_dtype
from hisr_core.train.fit import split_by_task
from hisr_core.train.scoring import episode_of
from tasks import checkpoints
from tasks.caching import cached_task
from tasks.tracking import LossCurve


def segments_of(row: dict[str, Any], turn_level: bool) -> list[Segment]:
    """The row's own segments, or one per turn."""
    if turn_level:
        return by_turn([t["action"] for t in row["turns"]])
    return [Segment.from_row(s) for s in row["segments"]]


def encode_rows(rows: list[dict[str, Any]], builder: PromptBuilder, env_name: str,
                turn_level: bool = False) -> list[Trajectory]:
    """``D_st`` rows as the SPRM reads them (with their own segments, or turn segments)."""
    grammar = environment_class(env_name).command_grammar
    return [encode_trajectory(builder, *episode_of(builder, r, grammar), segments_of(r, turn_level),
                              r["outcome"]) for r in rows]


@cached_task("fit-sprm", inputs=["d_st", "pi_ref"], outputs=["out_dir", "loss_csv"],
             sections=["env", "segment", "model", "sprm"], ignore=["run_id"])
def fit_sprm(params: Params, d_st: Path, pi_ref: Path, out_dir: Path, loss_csv: Path,
             run_id: str | None, turn_level: bool = False) -> dict[str, Any]:
    """Train an SPRM from ``pi_ref`` on the training tasks of ``D_st`` (its segments, or turn
    segments); save it to ``out_dir``; report MSE and Pearson r of the predicted sum against
    R on both slices."""
    cfg = params.sprm
    tokenizer = load_tokenizer(pi_ref)
    lm = load_model(pi_ref, dtype=resolve_dtype(params.model.dtype))
    rows = contracts.read_rows(d_st, "segmented")
    builder = PromptBuilder.of(tokenizer, params.model)
    trajectories = encode_rows(rows, builder, params.env.name, turn_level)
    train_idx, held_idx = split_by_task([r["task_id"] for r in rows], cfg.holdout, cfg.seed)
    if not train_idx:
        raise ValueError(f"{d_st} has no training trajectories")
    name = "sprm_turn" if turn_level else "sprm"
    curve = LossCurve(name, run_id)
    checkpoint = checkpoints.for_output(out_dir, params, ["env", "segment", "model", "sprm"],
                                        [d_st, pi_ref], run_id, turn_level=turn_level)
    # The turn model is SPA-RL's progress model, with its loss: sprm.target is the segment
    # model's (docs/method.md, sprm).
    fit_cfg = cfg.model_copy(update={"target": "sum"}) if turn_level else cfg
    model, stats = train_sprm(lm, tokenizer, [trajectories[i] for i in train_idx], fit_cfg,
                              params.model.dtype, curve, out_dir=out_dir, name=name,
                              checkpoint=checkpoint)
    curve.write_csv(loss_csv)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    report = {"fit": stats, "train": evaluate(model, [trajectories[i] for i in train_idx], pad)}
    if len(held_idx) >= 2:
        report["heldout"] = evaluate(model, [trajectories[i] for i in held_idx], pad)
    # Kept through the evaluation: a stop there resumes from the last checkpoint, not step 0.
    checkpoints.finished(checkpoint)
    return report
