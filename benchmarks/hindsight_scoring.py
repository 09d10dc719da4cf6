"""The cost of scoring with ``pi_hind`` against scoring with ``pi_ref``, as the ``rewards`` stage
and every PPO iteration of the modulated variants score: the same ``D_st`` trajectories, each
turn's response log-probs under ``pi_ref`` (``turn_logprobs``) and under ``pi_hind``
(``hindsight_logprobs``) on the route the params choose (``hindsight.reads``) and on the other
one with the same copy head (``episode``: ``pi_ref``'s pass plus the copy head; ``block``: the
closed-gate route, a pass without blocks plus one per turn's block), each timed after one
warm-up trajectory. Prints one JSON object (and writes it with ``--out``); the goal of
docs/method.md is a ratio ≤ 2.

    python benchmarks/hindsight_scoring.py --episodes 64
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from _emit import emit  # benchmarks/, on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pi-ref", type=Path, default=ROOT / "data" / "sft" / "pi_ref")
    parser.add_argument("--pi-hind", type=Path, default=ROOT / "data" / "hindsight" / "pi_hind")
    parser.add_argument("--d-st", type=Path, default=ROOT / "data" / "segment" / "d_st.parquet")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for path, stage in ((args.pi_ref / "config.json", "sft"), (args.pi_hind, "hindsight"),
                        (args.d_st, "segment")):
        if not path.exists():
            raise SystemExit(f"{path} is missing (run `dvc repro {stage}` first)")

    import torch

    from hisr_core import contracts
    from hisr_core.agent.models import load_model, load_tokenizer
    from hisr_core.agent.prompts import PromptBuilder
    from hisr_core.config import load_params
    from hisr_core.envs import environment_class
    from hisr_core.rewards.gated_attention import READS, load_gated
    from hisr_core.rewards.hindsight import Window, hindsight_logprobs
    from hisr_core.train.scoring import episode_of, turn_logprobs

    torch.set_num_threads(args.threads)
    params = load_params(args.params)
    grammar = environment_class(params.env.name).command_grammar
    builder = PromptBuilder.of(load_tokenizer(args.pi_ref), params.model)
    rows = contracts.read_rows(args.d_st, "segmented")[:args.episodes + 1]
    warm, rows = rows[:1], rows[1:]
    ref = load_model(args.pi_ref).eval()
    hind = load_gated(args.pi_hind).eval()
    tokens = params.rewards.max_batch_tokens
    windows = {reads: dataclasses.replace(Window.of(params.hindsight), reads=reads)
               for reads in ("episode", "block")}

    def time_ref(sel: list[dict]) -> float:
        start = time.perf_counter()
        turn_logprobs(ref, builder, [episode_of(builder, r, grammar) for r in sel], tokens)
        return time.perf_counter() - start

    def time_hind(sel: list[dict], reads: str) -> float:
        # Timing only: the other route's scores would need a copy head trained for it.
        setattr(hind, READS, reads)
        start = time.perf_counter()
        hindsight_logprobs(hind, builder, sel, grammar, windows[reads], tokens)
        return time.perf_counter() - start

    time_ref(warm), time_hind(warm, "episode"), time_hind(warm, "block")
    ref_s = time_ref(rows)
    hind_s = {reads: time_hind(rows, reads) for reads in windows}
    chosen = params.hindsight.reads
    turns = sum(r["n_turns"] for r in rows)

    def timing(seconds: float) -> dict[str, float]:
        return {"seconds": round(seconds, 2), "turns_per_s": round(turns / seconds, 1),
                "ratio": round(seconds / ref_s, 2)}

    emit({"benchmark": "hindsight_scoring", "env": params.env.name,
          "trajectories": len(rows), "turns": turns,
          "hindsight_window": {"past": params.hindsight.past,
                               "future": params.hindsight.future},
          "pi_ref": {"seconds": round(ref_s, 2), "turns_per_s": round(turns / ref_s, 1)},
          "pi_hind": timing(hind_s[chosen]), "route": chosen,
          "routes": {reads: timing(seconds) for reads, seconds in hind_s.items()},
          "ratio": round(hind_s[chosen] / ref_s, 2), "threads": args.threads}, args.out)


if __name__ == "__main__":
    main()
