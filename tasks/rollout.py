"""The episode engine as the stages use it: a generation backend from params, and
continuously batched play with a progress bar (evaluation, collection, later PPO)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hisr_core.agent.models import load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import Params
from hisr_core.envs import Environment, Task
from hisr_core.rollout.engine import Generator, Sampling, play
from hisr_core.rollout.hf import HFGenerator, resolve_kv_dtype
from hisr_core.train.engine import resolve_dtype


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def open_generator(params: Params, model_dir: Path,
                   seed: int = 0) -> Iterator[tuple[Generator, PromptBuilder]]:
    """The configured backend for the policy in ``model_dir``, and its prompt builder.

    ``hf`` loads the model in this process; ``openai`` sends the same token-id prompts to the
    server in ``rollout.openai`` (which must serve this model: ``vllm serve <model_dir>``).
    """
    tokenizer = load_tokenizer(model_dir)
    builder = PromptBuilder.of(tokenizer, params.model)
    if params.rollout.backend == "openai":
        from hisr_core.rollout.openai_backend import OpenAIGenerator

        o = params.rollout.openai
        with OpenAIGenerator(o.base_url, o.model or str(model_dir), tokenizer, builder.stop_ids,
                             api_key_env=o.api_key_env, concurrency=o.concurrency,
                             timeout_s=o.timeout_s, max_retries=o.max_retries,
                             seed=seed) as generator:
            yield generator, builder
        return
    model = load_model(model_dir, dtype=resolve_dtype(params.model.dtype)).to(device())
    yield HFGenerator(model, tokenizer, builder.stop_ids, seed=seed,
                      max_rows=params.rollout.batch_size,
                      kv_dtype=resolve_kv_dtype(params.rollout.kv_dtype, model)), builder


def play_with_progress(params: Params, env: Environment, tasks: Sequence[Task],
                       generator: Generator, builder: PromptBuilder, sampling: Sampling,
                       samples_per_task: int, policy: str, desc: str) -> list[dict[str, Any]]:
    """:func:`hisr_core.rollout.engine.play` with a progress bar showing the running success rate,
    stepping in ``rollout.env_workers`` worker processes when that is above 0."""
    total = len(tasks) * samples_per_task
    with contextlib.ExitStack() as stack:
        workers = None
        if params.rollout.env_workers > 0:
            from hisr_core.envs.workers import EnvWorkers

            workers = stack.enter_context(EnvWorkers(
                params.env.name, params.env.max_turns, params.env.options,
                params.rollout.env_workers))
        bar = stack.enter_context(tqdm(total=total, desc=desc, unit="ep", mininterval=2))
        wins = 0

        def tick(row: dict[str, Any]) -> None:
            nonlocal wins
            wins += row["won"]
            bar.update()
            bar.set_postfix(success=f"{wins / bar.n:.3f}")

        return play(env, tasks, generator, builder, sampling, params.rollout.batch_size,
                    samples_per_task=samples_per_task, policy=policy, on_episode=tick,
                    workers=workers, actions=params.rollout.action_choice)
