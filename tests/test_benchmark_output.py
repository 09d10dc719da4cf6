"""Benchmark output carries its provenance (benchmarks/_emit.py)."""

import datetime
import importlib.util
import json
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _emit_module():
    spec = importlib.util.spec_from_file_location("bench_emit", ROOT / "benchmarks" / "_emit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_benchmark_json_names_its_commit_date_machine_and_versions(tmp_path, capsys):
    out = tmp_path / "results" / "x.json"
    _emit_module().emit({"benchmark": "x", "speedup": 2.5}, out)
    written = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == written
    assert written["benchmark"] == "x" and written["speedup"] == 2.5
    p = written["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}", p["commit"]) and isinstance(p["dirty"], bool)
    when = datetime.datetime.fromisoformat(p["date"])
    assert abs((datetime.datetime.now(datetime.UTC) - when).total_seconds()) < 600
    assert p["cpu"] and p["cores"] >= 1 and p["torch"] == torch.__version__
    assert not list(out.parent.glob("*.tmp"))
