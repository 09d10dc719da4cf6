"""Task of the ``hindsight`` stage: fit ``pi_hind`` on masked-response examples of ``D_ct``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hisr_core import contracts
from hisr_core.agent.models import load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import HindsightParams, Params
from hisr_core.envs import environment_class
from hisr_core.rewards.gated_attention import (
    POINTER,
    attach_gates,
    gate_values,
    load_gated,
    save_gates,
)
from hisr_core.rewards.hindsight import (
    Window,
    episode_features,
    fit_pointer,
    hindsight_logprobs,
    trajectory_examples,
)
from hisr_core.train.engine import (
    freeze_weights,
    lm_parts,
    resolve_dtype,
    save_model_folder,
    unwrap_hf,
)
from hisr_core.train.fit import split_by_task
from hisr_core.train.scoring import episode_of, turn_logprobs
from hisr_core.train.sft import train_sft
from tasks import checkpoints
from tasks.caching import cached_task
from tasks.tracking import LossCurve


def _nll(logps: list[list[torch.Tensor]]) -> float:
    """Mean token NLL over every response token."""
    flat = torch.cat([x for ep in logps for x in ep])
    return float(-flat.double().mean())


@cached_task("fit-hindsight", inputs=["d_ct", "pi_ref"], outputs=["out_dir", "loss_csv"],
             sections=["env", "model", "hindsight"], ignore=["run_id"])
def fit_hindsight(params: Params, d_ct: Path, pi_ref: Path, out_dir: Path, loss_csv: Path,
                  run_id: str | None) -> dict[str, Any]:
    """Train ``pi_hind`` from ``pi_ref`` on the training tasks of ``D_ct`` (one example per
    turn: with ``hindsight.reads: episode`` the copy head alone, on ``pi_ref``'s features;
    with ``block``, the block route's SFT); save it to ``out_dir``. On held-out tasks, report the mean token NLL of the
    responses under ``pi_hind`` (hindsight context) and under ``pi_ref`` (prefix context)."""
    cfg = params.hindsight
    dtype = resolve_dtype(params.model.dtype)
    tokenizer = load_tokenizer(pi_ref)
    builder = PromptBuilder.of(tokenizer, params.model)
    grammar = environment_class(params.env.name).command_grammar
    rows = contracts.read_rows(d_ct, "rollouts")
    window = Window.of(cfg)
    train_idx, held_idx = split_by_task([r["task_id"] for r in rows], cfg.holdout, cfg.seed)
    if not train_idx:
        raise ValueError(f"{d_ct} has no training trajectories")
    curve = LossCurve("hindsight", run_id)
    model = load_model(pi_ref, dtype=dtype)
    attach_gates(model, cfg.gate_init, cfg.gate_lr, cfg.reader_rank, cfg.reader_lr, cfg.seed,
                 cfg.pointer_rank, cfg.pointer_lr)
    if cfg.lr == 0:
        freeze_weights(model)
    checkpoint = None
    if cfg.reads == "episode":
        stats = _fit_copy_head(model, builder, [rows[i] for i in train_idx], grammar, cfg, curve)
        save_model_folder(model, out_dir, tokenizer,
                          extra=lambda folder: save_gates(model, folder, cfg.reads))
    else:
        examples = [e for i in train_idx
                    for e in trajectory_examples(builder, rows[i], grammar, window)]
        checkpoint = checkpoints.for_output(out_dir, params, ["env", "model", "hindsight"],
                                            [d_ct, pi_ref], run_id)
        stats = train_sft(model, tokenizer, examples, cfg, params.model.dtype, curve,
                          lora=cfg.lora, out_dir=out_dir, name="hindsight",
                          extra=lambda folder: save_gates(model, folder, cfg.reads),
                          checkpoint=checkpoint)
        stats["examples"] = len(examples)
    curve.write_csv(loss_csv)
    gates = gate_values(model)
    report: dict[str, Any] = {"fit": stats,
                              "gates": {"mean": float(gates.mean()), "max": float(gates.max()),
                                        "min": float(gates.min())}}
    if held_idx:
        held = [rows[i] for i in held_idx]
        hind = hindsight_logprobs(load_gated(out_dir, dtype=dtype).eval(), builder, held,
                                  grammar, window, progress="held-out pi_hind")
        ref = turn_logprobs(load_model(pi_ref, dtype=dtype).eval(), builder,
                            [episode_of(builder, r, grammar) for r in held], progress="held-out pi_ref")
        report["heldout"] = {"nll_hind": _nll(hind), "nll_ref": _nll(ref),
                             "trajectories": len(held),
                             "tokens": sum(len(x) for ep in hind for x in ep)}
    # Kept through the evaluation: a stop there resumes from the last checkpoint, not step 0.
    if checkpoint is not None:
        checkpoints.finished(checkpoint)
    return report


def _fit_copy_head(model: torch.nn.Module, builder: PromptBuilder, rows: list[dict[str, Any]],
                   grammar: Sequence[str], cfg: HindsightParams, curve: LossCurve
                   ) -> dict[str, Any]:
    """``hindsight.reads: episode``: ``pi_ref``'s features of the training rows, one pass
    (:func:`episode_features`), then the copy head trained on them (:func:`fit_pointer`).
    Short enough (minutes on 2 cores) to need no checkpoint."""
    start = time.perf_counter()
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    backbone, head = lm_parts(model, hooked=True)
    pad = builder.tokenizer.pad_token_id if builder.tokenizer.pad_token_id is not None else 0
    features = episode_features(backbone, builder, rows, grammar, pad)
    # float32 for the copy head's few thousand parameters: plain AdamW keeps no master copy.
    pointer = getattr(unwrap_hf(model), POINTER).float()
    stats = fit_pointer(pointer, head, features, cfg, curve)
    seconds = time.perf_counter() - start
    tokens = sum(len(f.token_ids) for f in features)
    return {**stats, "backend": "torch", "world_size": 1, "seconds": seconds,
            "tokens": tokens, "tokens_per_s": tokens / seconds}
