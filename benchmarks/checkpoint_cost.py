"""Cost of the fit loop's resumable checkpoints on a ``builtin:small`` SFT run: the size and
write time of one checkpoint, and a short run's wall time without checkpoints, with the default
interval (none falls due in a short run: the per-step bookkeeping only) and with one after
every step. Prints one JSON object (and writes it with ``--out``).

    python benchmarks/checkpoint_cost.py --steps 20

Household-like synthetic episodes (``tests/hisr_core/train/sft_worker.py``), plain torch, one
process, float32. The three runs train the same steps; their final losses must agree exactly.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _emit import emit  # benchmarks/, on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the synthetic episodes live with the tests
    sys.path.insert(0, str(ROOT))


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from hisr_core.agent.models import build_builtin, load_model, load_tokenizer
    from hisr_core.agent.prompts import PromptBuilder
    from hisr_core.train.fit import Checkpoint
    from hisr_core.train.sft import encode_trajectories, train_sft
    from tests.hisr_core.train.sft_worker import GRAMMAR, corpus, make_rows, sft_params

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="checkpoint-cost-"))
    try:
        base = build_builtin("builtin:small", corpus(make_rows(200, seed=0)), 0, work / "base")
        tokenizer = load_tokenizer(base)
        seqs = encode_trajectories(make_rows(64, seed=1), PromptBuilder(tokenizer), GRAMMAR)
        n_params = sum(p.numel() for p in load_model(base).parameters())

        def run(every_s: float | None) -> tuple[float, dict, int]:
            folder = work / f"ckpt-{every_s}"
            params = sft_params("torch", args.micro, args.steps, grad_accum=1,
                                log_every=args.steps, checkpoint_every_s=every_s or 600.0)
            # A checkpoint that stays at the end is the one an interrupted run resumes from;
            # a run whose interval never falls due writes none.
            checkpoint = Checkpoint(folder, "benchmark") if every_s is not None else None
            start = time.perf_counter()
            stats = train_sft(load_model(base), tokenizer, seqs, params, "float32",
                              progress=False, checkpoint=checkpoint)
            seconds = time.perf_counter() - start
            size = _size(folder) if folder.exists() else 0
            shutil.rmtree(folder, ignore_errors=True)
            return seconds, stats, size

        plain_s, plain, _ = run(None)
        default_s, default, _ = run(600.0)
        every_s, every, size = run(1e-9)
        assert plain["loss"] == default["loss"] == every["loss"], "checkpoints changed the run"
        per_write = every["checkpoint_s"] / max(every["checkpoints"], 1)
        emit({
            "benchmark": "checkpoint_cost", "model": "builtin:small", "parameters": n_params,
            "steps": args.steps, "micro_batch_size": args.micro, "threads": args.threads,
            "checkpoint_mb": round(size / 2**20, 2),
            "write_s": round(per_write, 4),
            "run_s": {"no_checkpoint": round(plain_s, 2), "default_interval": round(default_s, 2),
                      "every_step": round(every_s, 2)},
            "checkpoints_written": {"default_interval": default["checkpoints"],
                                    "every_step": every["checkpoints"]},
            "overhead_at_default_interval": round(per_write / 600.0, 6),
            "cpu": platform.processor() or platform.machine(),
        }, args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
