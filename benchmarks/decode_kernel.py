"""Env-steps/s of the episode engine (``hf`` backend, B episodes at once) with each build of the
CPU decode kernel this machine runs (its best, the 8-lane AVX2 one) and with the SDPA fallback
(``HISR_DECODE_KERNEL=0``), on the same household tasks and sampling seed, in one run.
Prints one JSON object (and writes it with ``--out``).

    python benchmarks/decode_kernel.py --model data/sft/pi_ref --batch 32 --episodes 64

Sampling as in collection (temperature 1.0). The settings compute the same logits to float
rounding, so they play nearly the same episodes (over thousands of sampled tokens a draw can
fall the other way where the last bits differ: ``env_steps`` and ``success`` show how close),
and the figure compared is the wall time (``env_steps_per_s`` is there too). With
``--repeats R`` the settings are measured R times in turn, so a slow spell of a shared machine
falls on all of them; each setting keeps its median time (the lower middle one for an even R).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from pathlib import Path

from _emit import emit  # benchmarks/, on the path when a benchmark runs as a script
from rollout_speed import _model_dir, measure

from hisr_core.rollout.cpu import decode_attention

#: Setting name → HISR_DECODE_KERNEL value.
SETTINGS = {"kernel": "1", "kernel_avx2": "avx2", "sdpa": "0"}


def available() -> dict[str, str]:
    """The settings this machine runs: the kernel's best build, its AVX2 build where that is
    another one, and SDPA."""
    isas = decode_attention.vector_isas(decode_attention._cpu_flags())
    keep = {"sdpa", *(["kernel"] if isas else []), *(["kernel_avx2"] if isas[1:] else [])}
    return {name: value for name, value in SETTINGS.items() if name in keep}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float32", "model"])
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the settings")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    settings = available()
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    before = os.environ.get(decode_attention.SWITCH)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, model_name = _model_dir(args.model, Path(tmp))
        try:
            for _ in range(args.repeats):
                for name, value in settings.items():
                    os.environ[decode_attention.SWITCH] = value
                    runs[name].append(measure(model_dir, args.batch, args.episodes, args.seed,
                                              args.threads, kv_dtype=args.kv_dtype))
        finally:
            if before is None:
                os.environ.pop(decode_attention.SWITCH, None)
            else:
                os.environ[decode_attention.SWITCH] = before
    result: dict = {"benchmark": "decode_kernel", "env": "household", "backend": "hf",
                    "model": model_name, "batch": args.batch, "episodes": args.episodes}
    for name, measured in runs.items():
        median = statistics.median_low(r["seconds"] for r in measured)
        result[name] = {**next(r for r in measured if r["seconds"] == median),
                        "seconds_each": [r["seconds"] for r in measured]}
    result["speedup_over_sdpa"] = {
        name: round(result["sdpa"]["seconds"] / result[name]["seconds"], 2)
        for name in runs if name != "sdpa"}
    result.update(python=platform.python_version(), threads=args.threads,
                  kv_dtype=args.kv_dtype,
                  isas=decode_attention.vector_isas(decode_attention._cpu_flags()))
    emit(result, args.out)


if __name__ == "__main__":
    main()
