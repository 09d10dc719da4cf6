"""Run the powered study (profiles/study.yaml) in pieces, or write its report.

    scripts/python scripts/study.py --hours 2.5   # the next pieces that fit in 2.5 hours
    scripts/python scripts/study.py --list        # every piece, done or not, and the plan
    scripts/python scripts/study.py --report      # data/study/report from the committed files

First the default pipeline's stages up to `rewards` and `evaluate_sft` (`dvc repro`; nothing to
do when they are current), whose folders are linked into data/study. Then, in the protocol's
order (docs/results.md), the pieces still missing: for each seed, its copy of `sft`'s
evaluation, each variant's PPO run and evaluation, and the start curve. A piece is started only
if its estimate fits in what is left of `--hours`. A stopped PPO run resumes from its
checkpoint when the same command runs again on the same machine. Commit the files it lists at
the end (`git add` them): they are all the study keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hisr_core.config import load_params
from hisr_core.hardware import cpu_name, matmul_flops
from tasks.study import (
    NO_KERNEL_SLOWER,
    REFERENCE_GFLOPS,
    UPSTREAM,
    Piece,
    fit,
    pieces,
    record_seed,
    runnable,
    upstream_fingerprint,
)

PROFILE = Path("profiles/study.yaml")
DATA, STUDY = Path("data"), Path("data/study")


def run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def python(module: str, *args: str) -> list[str]:
    return ["scripts/python", "-m", module, *args, "--params", str(PROFILE), "--data", str(STUDY)]


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=False,
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def link_upstream() -> None:
    """data/study/<stage> → data/<stage> for every folder the study reads."""
    (ROOT / STUDY).mkdir(parents=True, exist_ok=True)
    for name in UPSTREAM:
        link = ROOT / STUDY / name
        if link.is_symlink() or not link.exists():
            if link.is_symlink():
                link.unlink()
            link.symlink_to(Path("..") / name, target_is_directory=True)


def slower() -> float:
    """This machine's minutes per minute of the estimates' (on an idle machine): the matmul
    rates' ratio, times ``NO_KERNEL_SLOWER`` where generation cannot use the CPU decode kernel
    (the estimates' machine did)."""
    from hisr_core.rollout.cpu.decode_attention import kernel

    return (REFERENCE_GFLOPS * 1e9 / matmul_flops(2)
            * (1.0 if kernel() is not None else NO_KERNEL_SLOWER))


def run_piece(piece: Piece) -> None:
    seed, v = str(piece.seed), piece.variant
    if piece.kind == "sft":
        # The same model, tasks and evaluation keys as evaluate_sft (the profile changes none).
        dst = ROOT / STUDY / "eval" / "sft" / f"seed{seed}"
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.json", "outcomes.csv"):
            shutil.copyfile(ROOT / DATA / "eval" / "sft" / name, dst / name)
    elif piece.kind == "ppo":
        run(python("flows.ppo", "--variant", v, "--seed", seed))
    elif piece.kind == "evaluate":
        run(python("flows.evaluate", "--model", f"{STUDY}/ppo/{v}/seed{seed}/models/policy",
                   "--name", f"{v}/seed{seed}", "--tag", f"variant={v}", "--tag", f"seed={seed}"))
    else:
        run(python("flows.start_curve", "--seed", seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--hours", type=float, help="run the next pieces that fit in this time")
    what.add_argument("--list", action="store_true", help="list the pieces and stop")
    what.add_argument("--report", action="store_true", help="write data/study/report")
    args = parser.parse_args()
    if args.hours is not None and args.hours <= 0:
        parser.error(f"--hours must be > 0, got {args.hours}")
    os.chdir(ROOT)
    params = load_params(PROFILE)
    todo = pieces(params)
    if args.report:
        link_upstream()
        run(python("flows.report"))
        return
    if args.list:
        factor = slower()
        for p in todo:
            print(f"{'done' if p.done(STUDY) else 'todo'}  {p.name:<22} "
                  f"~{p.minutes(factor):.0f} min")
        return
    start = time.monotonic()
    run([".venv/bin/dvc" if Path(".venv/bin/dvc").exists() else "dvc", "repro",
         "rewards", "evaluate_sft"])
    link_upstream()
    upstream = upstream_fingerprint(DATA)
    factor = slower()
    ready, skipped = runnable(todo, STUDY, upstream)
    for why in skipped:
        print(f"skipped: {why}")
    left = args.hours * 60 - (time.monotonic() - start) / 60
    plan = fit(ready, left, factor)
    print(f"upstream {upstream}; this machine ~{factor:.2f}x the estimates' time; "
          f"{len(ready)} pieces to run, {len(plan)} fit in {left:.0f} min: "
          + (", ".join(p.name for p in plan) or "none"), flush=True)
    finished: list[Piece] = []
    try:
        for piece in plan:
            left = args.hours * 60 - (time.monotonic() - start) / 60
            # A run's evaluation always follows it: a run without one compares nothing.
            if piece.kind != "evaluate" and piece.minutes(factor) > left:
                print(f"stopping before {piece.name}: ~{piece.minutes(factor):.0f} min, "
                      f"{left:.0f} left")
                break
            record_seed(STUDY, piece.seed, {
                "upstream": upstream, "cpu": cpu_name(), "commit": commit(),
                "started": datetime.now(UTC).isoformat("T", "seconds")})
            t0 = time.monotonic()
            run_piece(piece)
            print(f"done: {piece.name} in {(time.monotonic() - t0) / 60:.1f} min", flush=True)
            finished.append(piece)
    finally:  # also when a piece fails or is stopped: what finished is worth committing
        files = sorted({f"{STUDY}/seed{p.seed}.json" for p in finished}
                       | {f"{STUDY}/{f}" for p in finished for f in p.files})
        print(json.dumps({"finished": [p.name for p in finished], "commit": files}, indent=1))

if __name__ == "__main__":
    main()
