"""Does a policy read its task? Teacher-forced, after its first observation, the policy is
asked to write ``Thought: The task is to <goal>.`` (the opening of the expert's first thought);
reported are the share of goal tokens it predicts right (argmax), the share of episodes with
every goal token right, and the mean NLL per goal token, for each rows file given (an expert
``D_bc`` file for games it was trained on, an evaluation episodes file for held-out games).
Prints one JSON object (and writes it with ``--out``).

    python benchmarks/goal_copy.py --params profiles/alfworld.yaml \
        --model data/alfworld/sft/pi_ref --rows data/alfworld/expert/d_bc.parquet \
        --rows data/alfworld/eval/sft/episodes/valid_seen.parquet

A policy that copies the task line scores near 1 on both files; one that guesses the goal from
the room scores low on both; one that memorised its training goals scores high on the first
only.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

from _emit import emit  # benchmarks/, on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rows", type=Path, action="append", required=True,
                        help="a Parquet file of episodes (instruction, turns); repeatable")
    parser.add_argument("--n", type=int, default=140, help="episodes sampled from each file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import pandas as pd
    import torch

    from hisr_core.agent.models import load_model, load_tokenizer
    from hisr_core.agent.prompts import PromptBuilder
    from hisr_core.config import load_params
    from hisr_core.envs import environment_class

    for path in [args.model / "config.json", *args.rows]:
        if not path.is_file():
            raise SystemExit(f"not found: {path}")
    torch.set_num_threads(args.threads)
    params = load_params(args.params)
    grammar = environment_class(params.env.name).command_grammar
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model).eval()
    builder = PromptBuilder.of(tokenizer, params.model)
    head = builder._ids("Thought: The task is to")
    result = {"benchmark": "goal_copy", "model": str(args.model), "params": str(args.params),
              "machine": platform.processor() or platform.machine(), "files": {}}
    for path in args.rows:
        frame = pd.read_parquet(path, columns=["instruction", "turns"])
        frame = frame.sample(min(args.n, len(frame)), random_state=args.seed)
        right = total = whole = 0
        nll = 0.0
        for instruction, turns in zip(frame["instruction"], frame["turns"], strict=True):
            prompt = builder.prompt(builder.system(instruction, grammar), [],
                                    turns[0]["observation"]).input_ids
            goal = builder._ids(" " + instruction + ".")
            ids = torch.tensor([prompt + head + goal])
            with torch.no_grad():
                logp = model(ids).logits[0].float().log_softmax(-1)
            start = len(prompt) + len(head)
            pred = logp[start - 1:-1]  # position t predicts token t + 1
            target = ids[0, start:]
            hits = pred.argmax(-1) == target
            right += int(hits.sum())
            total += len(goal)
            whole += bool(hits.all())
            nll -= float(pred.gather(1, target[:, None]).sum())
        result["files"][str(path)] = {"episodes": len(frame), "token_accuracy": right / total,
                                      "all_tokens_right": whole / len(frame),
                                      "nll_per_token": nll / total}
    emit(result, args.out)


if __name__ == "__main__":
    main()
