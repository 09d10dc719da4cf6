"""The ``sprm``, ``hindsight``, ``rewards`` and ``ppo`` stages through their command lines, on a small
household ``D_ct`` and a builtin:tiny ``pi_ref``, against the session's Prefect server and
MLflow store."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hisr_core import contracts
from hisr_core.agent.models import build_builtin
from hisr_core.envs import make_environment
from hisr_core.rewards.modulation import POSITIONS
from hisr_core.rl.loop import read_checkpoint_meta
from tasks.logged_models import run_models
from tests.household_data import rollout_rows

VARIANTS = ["hisr", "no_him", "no_spr", "no_both", "no_agr", "ppo"]


def _overrides() -> dict:
    fit = {"backend": "torch", "log_every": 1, "holdout": 0.25}
    return {"segment": {"segmenter": "rule"},
            "sprm": {**fit, "max_steps": 3, "micro_batch_size": 3},
            # One micro-batch a step (params.yaml: 4, four times the work of each step).
            "hindsight": {**fit, "max_steps": 30, "epochs": 100.0, "micro_batch_size": 8,
                          "grad_accum": 1, "future": 1},
            "rewards": {"variants": VARIANTS, "cases": 2}}


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    """A data folder with D_ct (12 rollouts, half failed) and a builtin:tiny pi_ref."""
    data = tmp_path_factory.mktemp("stages") / "data"
    rows = rollout_rows(12, fail_every=2)
    contracts.write_rows(rows, data / "collect" / "d_ct.parquet", "rollouts")
    texts = [t[k] for r in rows for t in r["turns"] for k in ("observation", "response")]
    build_builtin("builtin:tiny", texts + [r["instruction"] for r in rows], 0,
                  data / "sft" / "pi_ref")
    return data


def _run(run_module, stage, params, data):
    proc = run_module(f"flows.{stage}", "--params", str(params), "--data", str(data))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_sprm_hindsight_and_rewards_stages(staged, run_module, write_params, mlflow_uri,
                                           experiment):
    data = staged
    params = write_params(_overrides())
    early = run_module("flows.rewards", "--params", str(params), "--data", str(data))
    assert early.returncode != 0 and "run the segment stage first" in early.stderr
    _run(run_module, "segment", params, data)
    out = _run(run_module, "sprm", params, data)
    assert "SPRM model: 3 steps" in out and "SPRM turn_model: 3 steps" in out
    sprm = json.loads((data / "sprm" / "metrics.json").read_text())["sprm"]
    for name in ("model", "turn_model"):
        assert sprm[name]["fit"]["steps"] == 3 and sprm[name]["fit"]["trajectories"] == 9
        assert sprm[name]["heldout"]["trajectories"] == 3
        assert sprm[name]["heldout"]["mse"] >= 0
        assert (data / "sprm" / name / "sprm_head.safetensors").is_file()
    assert (data / "sprm" / "loss.csv").read_text().startswith("step,loss\n1,")
    assert (data / "sprm" / "loss_turn_model.csv").is_file()

    out = _run(run_module, "hindsight", params, data)
    hind = json.loads((data / "hindsight" / "metrics.json").read_text())["hindsight"]
    d_ct = contracts.read_rows(data / "collect" / "d_ct.parquet", "rollouts")
    assert hind["heldout"]["trajectories"] == 3
    assert 0 < hind["fit"]["examples"] < sum(r["n_turns"] for r in d_ct)  # one per train turn
    # The future and the outcome help: pi_hind predicts held-out responses better than
    # pi_ref does from the prefix.
    assert hind["heldout"]["nll_hind"] < hind["heldout"]["nll_ref"], hind
    assert "held-out NLL" in out

    out = _run(run_module, "rewards", params, data)
    d_st = contracts.read_rows(data / "segment" / "d_st.parquet", "segmented")
    rewards = contracts.read_rows(data / "rewards" / "rewards.parquet", "rewards")
    assert [(r["task_id"], r["sample"]) for r in rewards] == \
        [(r["task_id"], r["sample"]) for r in d_st]
    for r, s in zip(rewards, d_st, strict=True):
        assert len(r["segments"]) == len(s["segments"]) and len(r["turns"]) == s["n_turns"]
        assert sum(seg["importance"] for seg in r["segments"]) == pytest.approx(1.0)
        assert sum(abs(seg["r_him"]) for seg in r["segments"]) == \
            pytest.approx(sum(abs(seg["r_hat"]) for seg in r["segments"]))
        assert [v["variant"] for v in r["variants"]] == VARIANTS
        assert all(len(v["turn_rewards"]) == s["n_turns"] for v in r["variants"])
        # True credit: the drop of the household oracle's distance over each turn.
        assert [t["true_credit"] for t in r["turns"]] == \
            [t["distance_before"] - t["distance_after"] for t in s["turns"]]
    credit = json.loads((data / "rewards" / "metrics.json").read_text())["credit"]
    for signal in ("r_hat", "r_him", "z", "turn_sprm", *VARIANTS):
        assert -1 <= credit[f"{signal}/spearman"] <= 1, signal
        assert credit[f"{signal}/spearman_low"] <= credit[f"{signal}/spearman_high"], signal
    assert all(f"{v}/return_margin_ratio" in credit for v in VARIANTS)
    header = (data / "rewards" / "credit.csv").read_text().splitlines()[0]
    assert header.startswith("scope,signal,spearman,spearman_low,spearman_high,kendall")
    told = json.loads((data / "rewards" / "metrics.json").read_text())["hindsight_told"]
    n_turns = sum(r["n_turns"] for r in d_st)
    assert told["all"]["told/turns"] + told["all"]["untold/turns"] == n_turns
    assert told["all"]["told/turns"] > 0 and 0 < told["heldout_trajectories"] < 12
    assert told["all"]["told/delta"] == pytest.approx(
        told["all"]["told/nll_hind"] - told["all"]["told/nll_ref"])
    metrics = json.loads((data / "rewards" / "metrics.json").read_text())["rewards"]
    assert metrics["trajectories"] == 12
    share = metrics["position_share"]["all/r_him"]
    assert sum(share[p] for p in POSITIONS) == pytest.approx(1.0)
    csv = (data / "rewards" / "position_share.csv").read_text().splitlines()
    assert csv[0] == "position,r_hat_all,r_him_all,r_hat_success,r_him_success"
    assert [line.split(",")[0] for line in csv[1:]] == list(POSITIONS)
    assert (data / "rewards" / "position_share.png").read_bytes()[:4] == b"\x89PNG"
    cases = (data / "rewards" / "cases.md").read_text()
    assert cases.count("| segment | turns | actions | sub-goal | r_hat | z | r_him |") == 4
    assert "<table>" in (data / "rewards" / "cases.html").read_text()

    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    runs = {r.info.run_name: r for r in
            mlflow.search_runs(experiment_names=[experiment], output_format="list")}
    client = mlflow.MlflowClient()
    assert len(client.get_metric_history(runs["sprm"].info.run_id, "losses/sprm")) == 3
    assert len(client.get_metric_history(runs["sprm"].info.run_id, "losses/sprm_turn")) == 3
    assert client.get_metric_history(runs["hindsight"].info.run_id, "losses/hindsight")
    assert "rewards/trajectories" in runs["rewards"].data.metrics
    assert "credit/r_him/spearman" in runs["rewards"].data.metrics
    # The SPRMs and pi_hind are the runs' logged models, and they load and score.
    models = {**run_models(runs["sprm"].info.run_id), **run_models(runs["hindsight"].info.run_id)}
    assert {name: m.tags["hisr.kind"] for name, m in models.items()} == {
        "sprm": "sprm", "sprm_turn": "sprm", "pi_hind": "pi_hind"}
    for model in models.values():
        [score] = mlflow.pyfunc.load_model(f"models:/{model.model_id}").predict(
            ["Your task is to: put a clean apple in the fridge."])
        assert math.isfinite(score)


def _ppo_overrides() -> dict:
    return {**_overrides(),
            "env": {"name": "household", "max_turns": 6},
            "rollout": {"max_new_tokens": 24, "batch_size": 8},
            "ppo": {"iterations": 2, "tasks_per_iter": 2,
                    "samples_per_task": 2, "ppo_epochs": 1, "minibatches": 1,
                    "micro_batch_size": 2, "backend": "torch", "checkpoint_every": 1,
                    "rft_epochs": 1.0},
            "sft": {"backend": "torch", "micro_batch_size": 4, "max_steps": 2}}


@pytest.mark.slow
def test_ppo_stage_trains_resumes_and_logs(staged, run_module, write_params, mlflow_uri,
                                           experiment):
    """After the reward stages above (same data folder): ``hisr`` online for 2 iterations;
    the same command again finds its finished checkpoint and continues the same MLflow run;
    ``rft`` fine-tunes on the successful rollouts; an unknown variant is refused early."""
    data = staged
    assert (data / "rewards" / "rewards.parquet").is_file(), "run with the test above"
    env = make_environment("household", max_turns=6)
    contracts.write_rows([t.to_row() for t in env.make_tasks("train", 4, 0)],
                         data / "tasks" / "train.parquet", "tasks")
    params = write_params(_ppo_overrides())

    def ppo(variant: str, **extra_env: str):
        return run_module("flows.ppo", "--variant", variant, "--params", str(params),
                          "--data", str(data), extra_env=extra_env)

    bad = ppo("hisr_v2")
    assert bad.returncode == 2 and "invalid choice: 'hisr_v2'" in bad.stderr
    first = ppo("hisr")
    assert first.returncode == 0, first.stderr[-3000:]
    out = data / "ppo" / "hisr" / "seed0"
    assert (out / "models" / "policy" / "config.json").is_file()
    assert (out / "models" / "critic" / "value_head.safetensors").is_file()
    curve = (out / "curve.csv").read_text().splitlines()
    assert curve[0].startswith("iteration,rollout_success,rewards_fused_mean,losses_policy")
    assert [line.split(",")[0] for line in curve[1:]] == ["1", "2"]
    metrics = json.loads((out / "metrics.json").read_text())["ppo"]
    assert metrics["iterations"] == 2 and metrics["resumed_from"] == 0
    assert read_checkpoint_meta(data / "cache" / "ppo" / "hisr" / "seed0")["iteration"] == 2

    # The same command again: its finished task comes from Prefect's cache (nothing runs);
    # with that cache bypassed, training resumes from the finished checkpoint instead.
    cached = ppo("hisr")
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert "Finished in state Cached" in cached.stdout + cached.stderr
    assert json.loads((out / "metrics.json").read_text())["ppo"]["resumed_from"] == 0
    again = ppo("hisr", PREFECT_TASKS_REFRESH_CACHE="true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed after 2" in again.stdout + again.stderr
    assert json.loads((out / "metrics.json").read_text())["ppo"]["resumed_from"] == 2

    rft = ppo("rft")
    assert rft.returncode == 0, rft.stderr[-3000:]
    assert (data / "ppo" / "rft" / "seed0" / "models" / "policy" / "config.json").is_file()

    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    runs = mlflow.search_runs(experiment_names=[experiment], output_format="list")
    hisr = [r for r in runs if r.info.run_name == "ppo/hisr/seed0"]
    assert len(hisr) == 1 and hisr[0].data.tags["variant"] == "hisr"
    assert hisr[0].data.tags["seed"] == "0"
    history = mlflow.MlflowClient().get_metric_history(hisr[0].info.run_id, "rollout/success")
    assert sorted(m.step for m in history) == [1, 2]
    policy = run_models(hisr[0].info.run_id)["policy-hisr-seed0"]
    assert policy.tags["variant"] == "hisr" and policy.tags["hisr.kind"] == "policy"
    assert any(r.info.run_name == "ppo/rft/seed0" for r in runs)


def test_start_curve_replays_ppos_draws_and_resumes(staged, write_params, tmp_path,
                                                    monkeypatch):
    """``pi_ref`` playing the draws of the PPO run above: its first two iterations are that
    run's own episodes (the critic's warm-up iteration leaves the policy as it was), so
    success and parse failures agree exactly. A run stopped after one iteration goes on from
    there to the same curve."""
    import tasks.start_curve as sc
    from hisr_core.config import load_params

    data = staged
    ppo_curve = data / "ppo" / "hisr" / "seed0" / "curve.csv"
    assert ppo_curve.is_file(), "run with the test above"
    params = load_params(write_params(_ppo_overrides()))
    assert params.ppo.critic_warmup == 1 and params.ppo.iterations == 2

    def run(name: str) -> list[dict[str, float]]:
        report = sc.start_curve.fn(params, data / "sft" / "pi_ref",
                                   data / "tasks" / "train.parquet", tmp_path / f"{name}.csv",
                                   tmp_path / f"{name}-checkpoint", None)
        assert report["iterations"] == 2 and report["episodes"] == 8
        assert not (tmp_path / f"{name}-checkpoint").exists()
        return _csv(tmp_path / f"{name}.csv")

    straight = run("straight")
    ppo = _csv(ppo_curve)
    for key in ("rollout_success", "rollout_parse_failure_rate"):
        assert [r[key] for r in straight] == [r[key] for r in ppo], key
    assert [r["iteration"] for r in straight] == [1, 2]

    real, played = sc.collect, []

    def stopped_at_the_second(*args, **kwargs):  # args[7]: the iteration (from 0)
        played.append(args[7])
        if len(played) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sc, "collect", stopped_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        run("stopped")
    assert json.loads((tmp_path / "stopped-checkpoint" / "rows.json").read_text()) == \
        [[straight[0][k] for k in sc.COLUMNS]]
    played.clear()
    monkeypatch.setattr(sc, "collect", lambda *a, **k: played.append(a[7]) or real(*a, **k))
    assert run("stopped") == straight
    assert played == [1], "the resumed run plays only the iteration left"


def _csv(path: Path) -> list[dict[str, float]]:
    import csv

    with path.open(newline="") as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
