"""Cached Prefect tasks (``tasks.caching``): what reruns, what is served from the cache, and
outputs restored from the cache's snapshots; retries only for failures outside the project.
The scenarios run against the session's real Prefect server (``cache_flow.py``)."""

from __future__ import annotations

import json

from tasks.caching import cache_key, content_hash


def test_content_hash_of_files_and_folders(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("1")
    (tmp_path / "d" / "sub" / "b.txt").write_text("2")
    before = content_hash(tmp_path / "d")
    (tmp_path / "d" / "sub" / "b.txt").write_text("3")
    assert content_hash(tmp_path / "d") != before
    (tmp_path / "d" / "sub" / "b.txt").write_text("2")
    assert content_hash(tmp_path / "d") == before
    assert content_hash(tmp_path / "nothing") == "missing"


def test_cache_key_ignores_what_it_is_told_to(tmp_path):
    src = tmp_path / "x"
    src.write_text("1")
    args = {"src": src, "run_id": "r1", "n": 3}
    key = cache_key("t", args, ["src"], [], ["run_id"])
    assert key == cache_key("t", {**args, "run_id": "r2"}, ["src"], [], ["run_id"])
    assert key != cache_key("t", {**args, "n": 4}, ["src"], [], ["run_id"])
    assert key != cache_key("u", args, ["src"], [], ["run_id"])


def test_cached_task_scenarios(run_module, tmp_path):
    proc = run_module("tests.tasks.cache_flow", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    seen = json.loads(line.removeprefix("RESULT "))
    calls = {k: v["calls"] for k, v in seen.items() if isinstance(v, dict)}
    assert calls == {"first": 1, "again": 1, "output_deleted": 1, "output_overwritten": 1,
                     "unread_section": 1, "read_section": 2, "input_changed": 3,
                     "back_to_first": 3, "several_ranks": 4, "one_rank_again": 4,
                     "snapshots_gone": 5}
    # Served from the cache, the outputs are what the cached call wrote.
    assert seen["output_deleted"]["out"] == "aa" and seen["output_overwritten"]["out"] == "aa"
    assert seen["input_changed"]["out"] == "bb" and seen["back_to_first"]["out"] == "aa"
    assert seen["read_section"]["result"] == {"lr": 0.002}
    assert seen["retry_server"] == "ok" and seen["tries_server"] == 2
    assert seen["retry_bug"] == "a bug" and seen["tries_bug"] == 1
    assert any((tmp_path / "cache" / "results").iterdir()), "results persist in the cache"
