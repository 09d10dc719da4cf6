"""``scripts/gpu_check.sh``: its CPU dry run end to end (every step's record, the summary, the
servers it started stopped), a broken step stopping the check with its name and log, and the
GPU configuration it generates validated as the stages will read it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from hisr_core.config import ParamsError, load_params
from tests.conftest import _clean_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["probe", "params", "prefect_server", "expert", "sft", "serve_vllm", "collect_vllm",
         "collect_hf", "segment", "sprm", "hindsight", "rewards", "ppo", "evaluate", "sft_lora"]
SKIPPED_IN_DRY_RUN = {"serve_vllm", "collect_vllm"}
#: Skipped where ``PREFECT_API_URL`` names a running server (the broken-step test below runs the
#: script's own server, and checks that it is stopped).
SKIPPED_WITH_A_SERVER = {"prefect_server"}
RECORD = {"step", "status", "returncode", "wall_s", "command", "log", "peak_gpu_memory_mib",
          "peak_rss_mib", "metrics_file", "rates", "model_dtype"}


def _helper():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(out: Path, *args: str, prefect: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    """The script as CI would run it: this interpreter's environment, and the Prefect server
    ``prefect`` names, or none (the script then starts and stops its own)."""
    env = {**_clean_env(), **(prefect or {}), "VENV": str(Path(sys.executable).parent.parent),
           "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--no-install", "--out", str(out),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def _prefect_url(out: Path) -> str:
    command = json.loads((out / "steps" / "prefect_server.json").read_text())["command"]
    return next(arg for arg in command if arg.startswith("http://"))


@pytest.mark.slow
def test_dry_run_runs_every_step_and_records_it(tmp_path, prefect_api):
    out = tmp_path / "check"
    proc = _run(out, prefect=prefect_api)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["failed_step"] is None and summary["mode"] == "dry"
    assert [s["step"] for s in summary["steps"]] == STEPS
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert summary["commit"] == head and summary["date"]
    assert summary["versions"]["torch"] and summary["versions"]["vllm"] is None
    assert summary["machine"]["auto_dtype"] == "float32"  # a CPU: auto is not bfloat16
    for name in STEPS:
        record = json.loads((out / "steps" / f"{name}.json").read_text())
        assert record in summary["steps"]
        if name in SKIPPED_IN_DRY_RUN | SKIPPED_WITH_A_SERVER:
            assert record["status"] == "skipped", name
            assert ("vLLM" if name in SKIPPED_IN_DRY_RUN else "PREFECT_API_URL") in \
                record["reason"], name
            continue
        assert record["status"] == "ok" and record["returncode"] == 0, name
        assert RECORD <= set(record) and record["wall_s"] > 0, name
        assert record["peak_gpu_memory_mib"] is None and record["peak_rss_mib"] > 0, name
        assert (out / record["log"]).is_file(), name
    by_name = {s["step"]: s for s in summary["steps"]}
    for name, key in (("sft", "sft.tokens_per_s"), ("collect_hf", "collect.speed.tokens_per_s"),
                      ("sprm", "sprm.model.fit.tokens_per_s"),
                      ("hindsight", "hindsight.fit.tokens_per_s"),
                      ("sft_lora", "sft.tokens_per_s")):
        assert by_name[name]["rates"][key] > 0, name
    assert summary["collect_tokens_per_s"]["hf"] == by_name["collect_hf"]["rates"][
        "collect.speed.tokens_per_s"]
    assert by_name["sft"]["model_dtype"] == by_name["ppo"]["model_dtype"] == "float32"
    ppo = json.loads((out / "work" / "data" / "ppo" / "hisr" / "seed0" / "metrics.json")
                     .read_text())
    assert ppo["ppo"]["iterations"] == 2
    eval_metrics = json.loads((out / "work" / "data" / "eval" / "hisr" / "seed0" /
                               "metrics.json").read_text())
    assert eval_metrics["eval"]["valid_seen"]["episodes"]["all"] == 4
    lora = load_params(out / "params_lora.yaml")
    assert lora.model.lora.enabled and lora.model.name_or_path == "builtin:tiny"


@pytest.mark.slow
def test_a_broken_step_stops_the_check_naming_it(tmp_path):
    """A model that does not exist passes the params step (any string may name a model) and
    the expert stage, and breaks SFT: the check stops there, says so with SFT's own error,
    records it, and stops its Prefect server."""
    out = tmp_path / "check"
    proc = _run(out, "--set", "model.name_or_path=builtin:huge")
    assert proc.returncode != 0
    assert "step 'sft' FAILED (exit status 2)" in proc.stderr
    assert "unknown builtin model 'builtin:huge'" in proc.stderr  # the end of sft's log
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["ok"] and summary["failed_step"] == "sft"
    assert [s["step"] for s in summary["steps"]] == STEPS[:STEPS.index("sft") + 1]
    assert [s["status"] for s in summary["steps"]][-2:] == ["ok", "failed"]
    assert not (out / "steps" / "collect_hf.json").exists()
    assert not _answers(_prefect_url(out) + "/health")


def test_an_unknown_override_fails_the_params_step(tmp_path):
    helper = _helper()
    with pytest.raises(ParamsError, match=r"unknown key 'sft\.max_step'; did you mean "
                                          r"'sft\.max_steps'"):
        helper.write_params("dry", tmp_path, 8000, ["sft.max_step=3"])
    with pytest.raises(SystemExit, match="SECTION.KEY=VALUE"):
        helper.write_params("dry", tmp_path, 8000, ["sft.=3"])


def test_gpu_params_are_the_gpu_paths(tmp_path):
    """What the check runs on a GPU, as the stages read it: builtin:base, dtype auto,
    DeepSpeed ZeRO-2 everywhere, ZeRO-3 with LoRA, vLLM on the given port; params.yaml's
    other values kept, a --set override merged into every file."""
    paths = _helper().write_params("gpu", tmp_path, 8123, ["collect.seed=7"])
    main = load_params(paths["params"])
    assert (main.model.name_or_path, main.model.dtype) == ("builtin:base", "auto")
    for fit in (main.sft, main.sprm, main.hindsight, main.ppo):
        assert (fit.backend, fit.zero_stage) == ("deepspeed", 2)
    assert main.sft.max_steps == 300 and main.ppo.iterations == 2
    assert main.rollout.backend == "hf" and main.rollout.kv_dtype == "bfloat16"
    project = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert main.sft.weight_decay == project["sft"]["weight_decay"]  # deep merge, not replace
    assert main.model.lora.target_modules == project["model"]["lora"]["target_modules"]
    assert str(tmp_path) in main.tracking.mlflow_uri
    openai = load_params(paths["params_openai"])
    assert openai.rollout.backend == "openai" and openai.rollout.openai.model is None
    assert openai.rollout.openai.base_url == "http://127.0.0.1:8123/v1"
    lora = load_params(paths["params_lora"])
    assert lora.model.lora.enabled and (lora.sft.backend, lora.sft.zero_stage) == ("deepspeed", 3)
    assert {p.collect.seed for p in (main, openai, lora)} == {7}


def test_probe_refuses_a_gpu_check_without_the_gpu_paths(monkeypatch):
    """On this CPU, ``auto`` resolves to float32 and plain torch: a GPU check must not go on
    measuring those while claiming the GPU paths."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="not the GPU paths.*auto_dtype.*float32"):
        _helper().probe("gpu", None)
    assert _helper().probe("dry", None)["auto_backend"] == "torch"
