"""Run the powered study (profiles/study.yaml) in pieces, or write its report.

    scripts/python scripts/study.py --hours 2.5   # the next pieces that fit in 2.5 hours
    scripts/python scripts/study.py --list        # every piece, done or not, and the plan
    scripts/python scripts/study.py --report      # data/study/report from the committed files

First the default pipeline's stages up to `rewards` and `evaluate_sft` (`dvc repro`; nothing to
do when they are current), whose folders are linked into data/study; when data/ already holds
the models a started seed was pinned to, only that upstream's seeds run, without `dvc repro`.
Then, in the protocol's order (docs/results.md), the pieces still missing: for each seed, its
copy of `sft`'s evaluation, each variant's PPO run and evaluation, and the start curve. A piece
is started only if its estimate fits in what is left of `--hours`. A stopped PPO run resumes
from its checkpoint when the same command runs again on the same machine; so when the next
piece is a PPO run too long for what is left (on a slow machine a run can be longer than a
session), it runs until the budget is spent and stops at a checkpoint, and a later call on
this machine finishes it. Commit the files it lists at the end (`git add` them): they are all
the study keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hisr_core.config import load_params
from hisr_core.hardware import cpu_name, matmul_flops
from hisr_core.rollout.cpu.decode_attention import route
from hisr_core.train.checkpoint import read_meta
from tasks.ppo import run_dirs
from tasks.study import (
    LEAST_PARTIAL,
    NO_KERNEL_SLOWER,
    REFERENCE_GFLOPS,
    UPSTREAM,
    UPSTREAM_MODELS,
    Piece,
    fit,
    own_pieces,
    pieces,
    record_seed,
    runnable,
    to_split,
    upstream_fingerprint,
)

PROFILE = Path("profiles/study.yaml")
DATA, STUDY = Path("data"), Path("data/study")


def run(cmd: list[str], until: float | None = None) -> bool:
    """Run ``cmd``; at ``until`` (``time.monotonic()``) send it SIGTERM, on which a PPO run
    finishes its iteration, writes a checkpoint and exits. True when it ended by itself."""
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        proc.wait(None if until is None else max(0.0, until - time.monotonic()))
    except subprocess.TimeoutExpired:
        print("time is up: stopping it at its next checkpoint", flush=True)
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return False
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return True


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
    # Best of ~3 s of products: a shorter window can fall on a busy moment of a shared host
    # (on the AMD EPYC one call measured 5.3x, one an hour earlier 2.8x).
    return (REFERENCE_GFLOPS * 1e9 / matmul_flops(2, repeats=80)
            * (1.0 if route() != "sdpa" else NO_KERNEL_SLOWER))


def ppo_done(todo: list[Piece], iterations: int) -> dict[str, float]:
    """The share of its iterations each started PPO run has behind it (its checkpoint's)."""
    out = {}
    for p in todo:
        meta = read_meta(run_dirs(STUDY, p.variant, p.seed)[1]) if p.kind == "ppo" else None
        if meta:
            out[p.name] = min(1.0, meta["iteration"] / iterations)
    return out


def run_piece(piece: Piece, until: float | None = None) -> bool:
    """Run one piece (a PPO run: stopped at ``until``); True when it finished."""
    seed, v = str(piece.seed), piece.variant
    if piece.kind == "sft":
        # The same model, tasks and evaluation keys as evaluate_sft (the profile changes none).
        dst = ROOT / STUDY / "eval" / "sft" / f"seed{seed}"
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.json", "outcomes.csv"):
            shutil.copyfile(ROOT / DATA / "eval" / "sft" / name, dst / name)
    elif piece.kind == "ppo":
        return run(python("flows.ppo", "--variant", v, "--seed", seed), until)
    elif piece.kind == "evaluate":
        run(python("flows.evaluate", "--model", f"{STUDY}/ppo/{v}/seed{seed}/models/policy",
                   "--name", f"{v}/seed{seed}", "--tag", f"variant={v}", "--tag", f"seed={seed}"))
    else:
        run(python("flows.start_curve", "--seed", seed))
    return True


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
    done = ppo_done(todo, params.ppo.iterations)
    if args.list:
        factor = slower()
        for p in todo:
            state = "done" if p.done(STUDY) else (f"{done[p.name]:4.0%}" if p.name in done
                                                   else "todo")
            print(f"{state}  {p.name:<22} ~{p.minutes(factor, done.get(p.name, 0.0)):.0f} min")
        return
    start = time.monotonic()
    here = (upstream_fingerprint(DATA)
            if all((ROOT / DATA / name).is_dir() for name in (*UPSTREAM, *UPSTREAM_MODELS))
            else None)
    own = own_pieces(todo, STUDY, here) if here else []
    if own:
        print(f"{DATA} holds upstream {here}, on which seed(s) "
              f"{', '.join(sorted({str(p.seed) for p in own}))} started: their pieces run "
              "without dvc repro, and no new seed starts in this call", flush=True)
        todo = own
    else:
        run([".venv/bin/dvc" if Path(".venv/bin/dvc").exists() else "dvc", "repro",
             "rewards", "evaluate_sft"])
    link_upstream()
    upstream = here if own else upstream_fingerprint(DATA)
    factor = slower()
    ready, skipped = runnable(todo, STUDY, upstream)
    for why in skipped:
        print(f"skipped: {why}")
    end = start + args.hours * 3600
    left = (end - time.monotonic()) / 60
    plan = fit(ready, left, factor, done)
    split = to_split(ready, plan, left, factor, done)
    print(f"upstream {upstream}; this machine ~{factor:.2f}x the estimates' time; "
          f"{len(ready)} pieces to run, {len(plan)} fit in {left:.0f} min: "
          + (", ".join(p.name for p in plan) or "none")
          + (f"; then {split.name} until the time is up" if split else ""), flush=True)
    if split is not None:
        # Its evaluation runs when it finishes within the budget; else a later call resumes it.
        plan += ready[len(plan):len(plan) + 2]
    finished: list[Piece] = []
    try:
        for piece in plan:
            estimate = piece.minutes(factor, done.get(piece.name, 0.0))
            left = (end - time.monotonic()) / 60
            until = None
            if piece is split:  # it stops in time for its last iteration and its evaluation
                until = end - 60 * (plan[-1].minutes(factor)
                                    + piece.minutes(factor) / params.ppo.iterations)
                left = (until - time.monotonic()) / 60
            # A run's evaluation always follows it: a run without one compares nothing.
            if piece.kind != "evaluate" and (left < LEAST_PARTIAL if until else estimate > left):
                print(f"stopping before {piece.name}: ~{estimate:.0f} min, {left:.0f} left")
                break
            record_seed(STUDY, piece.seed, {
                "upstream": upstream, "cpu": cpu_name(), "decode": route(), "commit": commit(),
                "started": datetime.now(UTC).isoformat("T", "seconds")})
            t0 = time.monotonic()
            if not run_piece(piece, until):
                print(f"stopped: {piece.name} after {(time.monotonic() - t0) / 60:.1f} min; "
                      "the same command on this machine resumes it", flush=True)
                break
            print(f"done: {piece.name} in {(time.monotonic() - t0) / 60:.1f} min", flush=True)
            finished.append(piece)
    finally:  # also when a piece fails or is stopped: what finished is worth committing
        started = {p.seed for p in plan if (STUDY / f"seed{p.seed}.json").is_file()}
        files = sorted({f"{STUDY}/seed{k}.json" for k in started}
                       | {f"{STUDY}/{f}" for p in finished for f in p.files})
        print(json.dumps({"finished": [p.name for p in finished], "commit": files}, indent=1))


if __name__ == "__main__":
    main()
