"""Tasks of the ``sft`` stage: the base model, then behaviour cloning of ``D_bc`` into ``pi_ref``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hisr_core import contracts
from hisr_core.agent.models import build_builtin, is_builtin, load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder, system_text
from hisr_core.config import Params
from hisr_core.envs import environment_class
from hisr_core.train.engine import resolve_dtype
from hisr_core.train.sft import encode_trajectories, train_sft
from tasks import checkpoints
from tasks.caching import cached_task
from tasks.tracking import LossCurve


def corpus(d_bc_path: Path, env_name: str) -> list[str]:
    """Texts a builtin tokenizer is trained on: every system message, observation and response."""
    grammar = environment_class(env_name).command_grammar
    texts = []
    for row in contracts.read_rows(d_bc_path, "expert_trajectories"):
        texts.append(system_text(row["instruction"], grammar))
        for turn in row["turns"]:
            texts += [turn["observation"], turn["response"]]
        texts.append(row["final_observation"])
    return texts


@cached_task("prepare-base-model", inputs=["d_bc_path"], outputs=["work_dir"],
             sections=["env", "model", "sft"])
def prepare_base(params: Params, d_bc_path: Path, work_dir: Path) -> str:
    """The model SFT starts from: a fresh builtin model (tokenizer trained on ``D_bc``), or the
    configured Hugging Face model as it is."""
    name = params.model.name_or_path
    if not is_builtin(name):
        return name
    out = build_builtin(name, corpus(d_bc_path, params.env.name), params.sft.seed, work_dir)
    return str(out)


@cached_task("train-sft", inputs=["base", "d_bc_path"], outputs=["out_dir", "loss_csv"],
             sections=["env", "model", "sft"], ignore=["run_id"])
def train(params: Params, base: str, d_bc_path: Path, out_dir: Path, loss_csv: Path | None,
          run_id: str | None) -> dict[str, Any]:
    """Behaviour cloning (NLL of response tokens only) of ``D_bc``; saves ``pi_ref``. Resumes
    from its checkpoint after a stop (:mod:`tasks.checkpoints`)."""
    tokenizer = load_tokenizer(base)
    model = load_model(base, dtype=resolve_dtype(params.model.dtype))
    builder = PromptBuilder.of(tokenizer, params.model)
    rows = contracts.read_rows(d_bc_path, "expert_trajectories")
    grammar = environment_class(params.env.name).command_grammar
    sequences = encode_trajectories(rows, builder, grammar, params.sft.every_response)
    curve = LossCurve("sft", run_id)
    checkpoint = checkpoints.for_output(out_dir, params, ["env", "model", "sft"],
                                        [base, d_bc_path], run_id)
    stats = train_sft(model, tokenizer, sequences, params.sft, params.model.dtype, curve,
                      lora=params.model.lora, out_dir=out_dir, checkpoint=checkpoint)
    if loss_csv is not None:
        curve.write_csv(loss_csv)
    checkpoints.finished(checkpoint)
    return {**stats, "sequences": len(sequences), "trajectories": len(rows)}
