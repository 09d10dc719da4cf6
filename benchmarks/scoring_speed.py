"""Scored turns/s of the batched response scorer (``hisr_core.train.scoring.turn_logprobs``)
against a naive reference that runs one forward pass per turn (its generation prompt, then
its response), on household trajectories with the default model, measured in one run. Prints
one JSON object (and writes it with ``--out``).

    python benchmarks/scoring_speed.py --model data/sft/pi_ref --episodes 32
    python benchmarks/scoring_speed.py --d-st data/segment/d_st.parquet --episodes 32

The trajectories are the expert's on ``valid_seen`` tasks (with slips), or with ``--d-st`` the
first ones of a ``D_st`` file (``pi_ref``'s rollouts, what the rewards stage scores). Both sides
score the same turns with the same model; the largest difference between their log-probs is
reported.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from _emit import emit  # benchmarks/, on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "data" / "sft" / "pi_ref")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--d-st", type=Path, default=None,
                        help="score the first --episodes trajectories of this D_st file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from hisr_core import contracts
    from hisr_core.agent.models import load_model, load_tokenizer
    from hisr_core.agent.prompts import PromptBuilder
    from hisr_core.envs import make_environment
    from hisr_core.train.scoring import episode_of, turn_logprobs, turn_logprobs_naive

    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model folder at {args.model} (run `dvc repro sft` first)")
    torch.set_num_threads(args.threads)
    env = make_environment("household", 40)
    builder = PromptBuilder(load_tokenizer(args.model), None, 2048)
    if args.d_st is not None:
        rows = contracts.read_rows(args.d_st, "segmented")[:args.episodes]
        episodes = [episode_of(builder, r, env.command_grammar) for r in rows]
    else:
        episodes = []
        for task in env.make_tasks("valid_seen", args.episodes, 0):
            ep = env.expert_play(task, 0.1)
            episodes.append((builder.system(task.instruction, env.command_grammar),
                             [(t.observation, t.response) for t in ep.turns]))
    turns = sum(len(t) for _, t in episodes)
    model = load_model(args.model).eval()
    start = time.perf_counter()
    batched = turn_logprobs(model, builder, episodes)
    batched_s = time.perf_counter() - start
    start = time.perf_counter()
    reference = turn_logprobs_naive(model, builder, episodes)
    naive_s = time.perf_counter() - start
    diff = max(float((a - b).abs().max()) for x, y in zip(batched, reference, strict=True)
               for a, b in zip(x, y, strict=True))
    model_path = args.model.resolve()
    emit({"benchmark": "scoring_speed", "env": "household",
          "trajectories": "expert valid_seen" if args.d_st is None else "D_st",
          "model": (str(model_path.relative_to(ROOT)) if model_path.is_relative_to(ROOT)
                    else model_path.name),
          "episodes": len(episodes), "turns": turns,
          "batched": {"seconds": round(batched_s, 2), "turns_per_s": round(turns / batched_s, 1)},
          "naive": {"seconds": round(naive_s, 2), "turns_per_s": round(turns / naive_s, 1)},
          "speedup": round(naive_s / batched_s, 2), "max_abs_logprob_diff": diff,
          "python": platform.python_version(), "threads": args.threads}, args.out)


if __name__ == "__main__":
    main()
