"""PPO on a tiny builtin model and the household environment, for the tests; importable, and a
script (one process, or one rank under ``torchrun`` / the ``deepspeed`` launcher)::

    python tests/hisr_core/rl/ppo_worker.py --model DIR --backend torch --variant hisr \
        --iterations 2 --out result.pt [--mode offline] [--checkpoint DIR] [--micro 2]

Rank 0 writes ``--out`` (``torch.save``): the policy's and critic's initial and final weights
and every iteration's metrics.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

MAX_TURNS = 5


def ppo_params(backend: str, iterations: int, micro: int = 2, **overrides: Any):
    from hisr_core.config import PpoParams

    values: dict[str, Any] = {
        "seed": 0, "iterations": iterations, "tasks_per_iter": 3, "samples_per_task": 2,
        "ppo_epochs": 2, "minibatches": 2, "micro_batch_size": micro, "lr": 1e-3,
        "critic_lr": 1e-3, "backend": backend, "checkpoint_every": 1, "kl_coef": 0.05,
        "entropy_coef": 0.01, "max_batch_tokens": 4096,
        # Every iteration steps the policy (the default warms the critic up first).
        "critic_warmup": 0}
    values.update(overrides)
    return PpoParams(**values)


def offline_rows(n: int) -> list[dict[str, Any]]:
    """``D_st``-like rows carrying per-turn rewards (outcome on the last turn, and a grounding
    reward on each admissible turn), as the rewards stage gives them offline."""
    from tests.household_data import rollout_rows, segmented_rows

    rows = segmented_rows(rollout_rows(n, fail_every=2))
    for r in rows:
        m = len(r["turns"])
        r["turn_rewards"] = [0.1 * float(t["admissible"]) + (r["outcome"] if k == m - 1 else 0.0)
                             for k, t in enumerate(r["turns"])]
    return rows


def state(module) -> dict[str, Any]:
    return {k: v.detach().float().cpu().clone() for k, v in module.named_parameters()
            if v.requires_grad}


def run(model_dir: Path, cfg, variant: str, checkpoint: Path | None = None,
        offline: int = 0) -> dict[str, Any]:
    """Train; returns initial and final trainable weights, metrics and the iterations done."""
    import torch

    from hisr_core.agent.models import load_model, load_tokenizer
    from hisr_core.agent.prompts import PromptBuilder
    from hisr_core.envs import environment_class, make_environment
    from hisr_core.rewards.sprm import SegmentRewardModel
    from hisr_core.rl.loop import Frozen, Inputs, load_checkpoint, needs, setup, train

    tokenizer = load_tokenizer(model_dir)
    need = needs(variant, cfg)
    learner = setup(load_model(model_dir), load_model(model_dir) if need["critic"] else None,
                    cfg, variant, torch.float32)
    initial = {"policy": state(learner.policy_model),
               "critic": state(learner.value_model) if learner.value_model else {}}
    frozen = Frozen(
        ref=load_model(model_dir).eval() if need["ref"] else None,
        hind=load_model(model_dir).eval() if need["hind"] else None,
        sprm=SegmentRewardModel(load_model(model_dir)).eval() if need["sprm"] else None,
        turn_sprm=SegmentRewardModel(load_model(model_dir)).eval() if need["turn_sprm"] else None)
    env_cls = environment_class("household")
    builder = PromptBuilder(tokenizer, None, 1024)
    if offline:
        inputs = Inputs(builder, env_cls.command_grammar, rows=offline_rows(offline))
    else:
        env = make_environment("household", max_turns=MAX_TURNS)
        inputs = Inputs(builder, env_cls.command_grammar, tasks=env.make_tasks("train", 6, 0),
                        env=env, verbs=env_cls.state_changing_verbs, max_new_tokens=24,
                        batch_size=8)
    start = 0
    if checkpoint is not None:
        meta = load_checkpoint(learner, checkpoint)
        start = meta["iteration"] if meta else 0
    history = train(learner, frozen, inputs, start, checkpoint, progress=False)
    final = {"policy": state(learner.policy_model),
             "critic": state(learner.value_model) if learner.value_model else {}}
    return {"initial": initial, "final": final, "history": history, "start": start,
            "world_size": learner.info.world_size, "backend": learner.backend}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--variant", default="hisr")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--offline", type=int, default=0, help="offline on this many D_st rows")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, help="passed by the deepspeed launcher")
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--stop-during", type=int,
                        help="send this process SIGTERM as iteration N starts its rollouts")
    args = parser.parse_args(argv)
    import torch

    from hisr_core.train.engine import init_distributed

    cfg = ppo_params(args.backend, args.iterations, args.micro,
                     mode="offline" if args.offline else "online",
                     checkpoint_every=args.checkpoint_every)
    if args.stop_during is not None:
        import os
        import signal

        from hisr_core.rl import loop

        collect = loop.collect

        def stopping_collect(*a: Any, **kw: Any):
            if a[7] == args.stop_during - 1:  # the 0-based iteration argument
                os.kill(os.getpid(), signal.SIGTERM)
            return collect(*a, **kw)

        loop.collect = stopping_collect
    result = run(args.model, cfg, args.variant, args.checkpoint, args.offline)
    if init_distributed().is_main:
        torch.save(result, args.out)


if __name__ == "__main__":
    main()
