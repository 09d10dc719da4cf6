"""Env-steps/s of the episode engine (``hf`` backend) with B episodes at once against one
episode at a time, on household tasks, measured in one run. Prints one JSON object (and writes
it with ``--out``).

    python benchmarks/rollout_speed.py --model data/sft/pi_ref --batch 32 --episodes 64

Sampling as in collection (temperature 1.0). ``--model`` defaults to ``data/sft/pi_ref`` when it
exists, else a freshly built (untrained) ``builtin:small``. Each setting plays its own episode
count (B=1 fewer, it is slower); the figure compared is env steps per second. With
``--repeats R`` the pair (B=1, then B) is measured R times in turn, the same episodes each time,
so a slow spell of a shared machine falls on both settings; the result is the pair with the
median ratio (the lower middle one for an even R), and every pair's figures are kept.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from _emit import emit  # benchmarks/, on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]


def _model_dir(arg: str | None, tmp: Path) -> tuple[Path, str]:
    """The policy measured and its name in the result: ``--model``, else ``data/sft/pi_ref``,
    else a new untrained one in ``tmp``."""
    if arg:
        return Path(arg), arg
    default = ROOT / "data" / "sft" / "pi_ref"
    if (default / "config.json").is_file():
        return default, "data/sft/pi_ref"
    from hisr_core.agent.models import build_builtin
    from hisr_core.envs import make_environment

    env = make_environment("household", 40)
    texts = []
    for t in env.make_tasks("train", 200, 0):
        texts += [x.observation + "\n" + x.response for x in env.expert_play(t).turns]
    return build_builtin("builtin:small", texts, 0, tmp / "small"), "builtin:small (untrained)"


def measure(model_dir: Path, batch: int, episodes: int, seed: int, threads: int,
            dtype: str = "float32", kv_dtype: str = "bfloat16") -> dict:
    import torch

    from hisr_core.agent.models import load_model, load_tokenizer
    from hisr_core.agent.prompts import PromptBuilder
    from hisr_core.envs import make_environment
    from hisr_core.rollout.engine import Sampling, play
    from hisr_core.rollout.hf import HFGenerator, resolve_kv_dtype
    from hisr_core.train.engine import resolve_dtype

    torch.set_num_threads(threads)
    env = make_environment("household", 40)
    tasks = env.make_tasks("valid_seen", episodes, seed)
    tokenizer = load_tokenizer(model_dir)
    builder = PromptBuilder(tokenizer, None, 2048)
    model = load_model(model_dir, dtype=resolve_dtype(dtype))
    gen = HFGenerator(model, tokenizer, builder.stop_ids, seed=seed, max_rows=batch,
                      kv_dtype=resolve_kv_dtype(kv_dtype, model))
    start = time.perf_counter()
    rows = play(env, tasks, gen, builder, Sampling(temperature=1.0), batch_size=batch)
    seconds = time.perf_counter() - start
    steps = sum(r["n_turns"] for r in rows)
    tokens = sum(t["response_tokens"] for r in rows for t in r["turns"])
    return {"batch": batch, "episodes": len(rows), "env_steps": steps,
            "seconds": round(seconds, 2), "env_steps_per_s": round(steps / seconds, 2),
            "generated_tokens_per_s": round(tokens / seconds, 1),
            "success": round(sum(r["won"] for r in rows) / len(rows), 3),
            "decode_kernel": gen._kernel,
            "kv_cache": str(gen._cache.dtype or model.dtype).removeprefix("torch."),
            **gen.stats}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--episodes", type=int, default=64, help="episodes at --batch")
    parser.add_argument("--single-episodes", type=int, default=6, help="episodes at B=1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and compute dtype of both settings (model.dtype)")
    parser.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float32", "model"],
                        help="KV cache dtype of both settings (rollout.kv_dtype)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="pairs (B=1, then B) measured in turn; the median ratio's is kept")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, model_name = _model_dir(args.model, Path(tmp))
        for _ in range(args.repeats):
            single = measure(model_dir, 1, args.single_episodes, args.seed, args.threads,
                             args.dtype, args.kv_dtype)
            batched = measure(model_dir, args.batch, args.episodes, args.seed, args.threads,
                              args.dtype, args.kv_dtype)
            pairs.append((round(batched["env_steps_per_s"] / single["env_steps_per_s"], 2),
                          single, batched))
    speedup, single, batched = sorted(pairs, key=lambda p: p[0])[(len(pairs) - 1) // 2]
    result = {
        "benchmark": "rollout_speed", "env": "household", "backend": "hf",
        "model": model_name,
        "single": single, "batched": batched, "speedup": speedup,
        "repeats": [{"single_env_steps_per_s": s["env_steps_per_s"],
                     "batched_env_steps_per_s": b["env_steps_per_s"], "speedup": r}
                    for r, s, b in pairs],
        "python": platform.python_version(), "threads": args.threads, "dtype": args.dtype,
        "kv_dtype": args.kv_dtype,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
