"""Where a PPO iteration's time goes (generate / score / update) and the update's achieved
FLOP/s against the machine's measured matmul FLOP/s (MFU), for one variant with the default
params and the pipeline's models. Prints one JSON object (and writes it with ``--out``).

    python benchmarks/ppo_iteration.py --variant hisr --iterations 2 [--data data]

Reads ``<data>/sft/pi_ref``, ``<data>/hindsight/pi_hind``, ``<data>/sprm`` (run the pipeline up
to ``rewards`` first). Work done once per iteration: generation; the policy's, ``pi_ref``'s,
the critic's, ``pi_hind``'s and the SPRM's scoring passes (the policy's log-probs serve both
PPO's ratio and the hindsight log-ratio). Per pass over the data, the update recomputes only
what changes with the weights: the policy's log-probs and the critic's values.

Update FLOPs (forward + backward = 3 x forward): per token and model (policy, critic)
``6 * P_layers`` for the decoder layers' matrices plus ``6 * layers * hidden * T`` for causal
attention over a sequence of T tokens (the mean length of the trained sequences); plus the
policy's LM head, ``6 * vocab * hidden`` per response token (only response positions reach it).
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

from _emit import emit  # benchmarks/, on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="hisr")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from hisr_core.agent.models import count_parameters, load_model, load_tokenizer
    from hisr_core.config import load_params
    from hisr_core.hardware import matmul_flops
    from hisr_core.rl.loop import Learner, needs, run_iteration, setup
    from hisr_core.rollout.cpu.decode_attention import route
    from hisr_core.train.engine import unwrap_hf
    from tasks.ppo import _frozen, _inputs

    torch.set_num_threads(args.threads)
    params = load_params(args.params)
    cfg = params.ppo.model_copy(update={"iterations": args.iterations})
    params = params.model_copy(update={"ppo": cfg})
    pi_ref = args.data / "sft" / "pi_ref"
    if not (pi_ref / "config.json").is_file():
        raise SystemExit(f"no model folder at {pi_ref} (run the pipeline up to rewards first)")
    peak = matmul_flops(args.threads)
    need = needs(args.variant, cfg)
    learner: Learner = setup(load_model(pi_ref), load_model(pi_ref) if need["critic"] else None,
                             cfg, args.variant, torch.float32)
    frozen = _frozen(params, args.variant, pi_ref, args.data / "hindsight" / "pi_hind",
                     args.data / "sprm")
    inputs = _inputs(params, args.variant, load_tokenizer(pi_ref),
                     args.data / "tasks" / "train.parquet", args.data / "segment" / "d_st.parquet",
                     args.data / "rewards" / "rewards.parquet")
    config = unwrap_hf(learner.policy_model).config.get_text_config()
    p_layers = sum(p.numel() for p in unwrap_hf(learner.policy_model).base_model.layers
                   .parameters())
    models = 2 if need["critic"] else 1
    phases: dict[str, float] = {"generate": 0.0, "score": 0.0, "update": 0.0}
    flops, tokens, episodes = 0.0, 0, 0
    for iteration in range(args.iterations):
        m = run_iteration(learner, frozen, inputs, iteration)
        for phase in phases:
            phases[phase] += m[f"time/{phase}_s"]
        # update/tokens counts every trained token of every pass; their mean sequence length
        # sets the attention term.
        attn = 6 * config.num_hidden_layers * config.hidden_size * m["update/mean_length"]
        flops += models * m["update/tokens"] * (6 * p_layers + attn)
        flops += 6 * config.vocab_size * config.hidden_size * m["update/response_tokens"]
        tokens += int(m["update/tokens"])
        episodes += int(m["rollout/episodes"])
    total = sum(phases.values())
    achieved = flops / phases["update"]
    emit({"benchmark": "ppo_iteration", "variant": args.variant, "mode": cfg.mode,
          "iterations": args.iterations, "episodes": episodes,
          "seconds": {k: round(v, 1) for k, v in phases.items()},
          "share": {k: round(v / total, 3) for k, v in phases.items()},
          "update": {"tokens": tokens, "flop_per_s": round(achieved / 1e9, 2),
                     "matmul_peak_flop_per_s": round(peak / 1e9, 2),
                     "mfu": round(achieved / peak, 3), "unit": "GFLOP/s"},
          "passes_per_iteration": {
              "policy_logprobs": 1 + cfg.ppo_epochs, "critic_values": 1 + cfg.ppo_epochs,
              "pi_ref": int(need["ref"]), "pi_hind": int(need["hind"]),
              "sprm": int(need["sprm"]) + int(need["turn_sprm"])},
          "params": {"policy": count_parameters(learner.policy_model), "decoder_layers": p_layers},
          "decode": route(), "python": platform.python_version(), "threads": args.threads},
         args.out)


if __name__ == "__main__":
    main()
