"""Scenarios of :mod:`tasks.caching` in one process against a real Prefect server (run by
``test_caching.py`` with ``python -m tests.tasks.cache_flow WORKDIR``); prints one JSON
object with what each step observed."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from tasks.runtime import configure_offline

configure_offline()

from prefect import flow

from hisr_core.config import Params, parse_params
from hisr_core.retry import BackendError
from tasks.caching import cache_dir, cached_task, use_cache_dir

WORK = Path(sys.argv[1])
CALLS = WORK / "calls.txt"


def _count() -> int:
    return len(CALLS.read_text().splitlines()) if CALLS.is_file() else 0


@cached_task("double", inputs=["src"], outputs=["out"], sections=["sft"], ignore=["run_id"])
def double(params: Params, src: Path, out: Path, run_id: str) -> dict:
    """Writes src's text twice to out; logs each execution."""
    with CALLS.open("a") as f:
        f.write(run_id + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(src.read_text() * 2)
    return {"lr": params.sft.lr}


@cached_task("flaky", outputs=[], retries=2)
def flaky(kind: str, tries: Path) -> str:
    with tries.open("a") as f:
        f.write("x\n")
    if len(tries.read_text().splitlines()) == 1:
        if kind == "server":
            import httpx
            import openai

            lost = openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1"))
            raise BackendError("no answer after 5 retries") from lost
        raise ValueError("a bug")
    return "ok"


flaky.task = flaky.task.with_options(retry_delay_seconds=0)


@flow(name="cache-scenario")
def run(params: dict, src: Path, out: Path, tag: str) -> dict:
    use_cache_dir(WORK / "cache")
    return double(parse_params(params), src, out, run_id=tag)


@flow(name="retry-scenario")
def retry(kind: str) -> str:
    use_cache_dir(WORK / "cache")
    return flaky(kind, WORK / f"tries-{kind}.txt")


def main() -> None:
    src, out = WORK / "src.txt", WORK / "out" / "result.txt"
    base = {"sft": {"lr": 0.001}, "ppo": {"lr": 0.0001}}
    seen: dict = {}

    def step(name: str, params: dict = base) -> None:
        result = run(params, src, out, tag=name)
        seen[name] = {"calls": _count(), "out": out.read_text() if out.exists() else None,
                      "result": result}

    src.write_text("a")
    step("first")
    step("again")
    out.unlink()
    step("output_deleted")
    out.write_text("zz")
    step("output_overwritten")
    step("unread_section", {**base, "ppo": {"lr": 0.5}})
    step("read_section", {**base, "sft": {"lr": 0.002}})
    src.write_text("b")
    step("input_changed")
    src.write_text("a")
    step("back_to_first")
    os.environ["WORLD_SIZE"] = "2"  # under torchrun every rank runs: the cache is not read
    step("several_ranks")
    del os.environ["WORLD_SIZE"]
    step("one_rank_again")
    shutil.rmtree(next((cache_dir() / "files").glob("double-*")).parent)
    step("snapshots_gone")
    seen["retry_server"] = retry("server")
    seen["tries_server"] = len((WORK / "tries-server.txt").read_text().splitlines())
    try:
        retry("bug")
        seen["retry_bug"] = "no error"
    except ValueError as err:
        seen["retry_bug"] = str(err)
    seen["tries_bug"] = len((WORK / "tries-bug.txt").read_text().splitlines())
    print("RESULT " + json.dumps(seen))


if __name__ == "__main__":
    main()
