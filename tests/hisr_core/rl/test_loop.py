"""The PPO loop (hisr_core/rl/loop.py) on a tiny builtin model and the real household
environment: every parameter trains, every variant runs, DeepSpeed and two processes agree with
one, a SIGKILLed run resumes to the same weights, and the pieces the loop is made of."""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hisr_core.agent.models import build_builtin
from hisr_core.config import PpoParams
from hisr_core.envs import UNKNOWN_DISTANCE
from hisr_core.rl.loop import (
    PPO_VARIANTS,
    ValueModel,
    iteration_credit,
    iteration_tasks,
    load_critic,
    minibatch_windows,
    read_checkpoint_meta,
    save_critic,
)
from hisr_core.train.engine import DistInfo
from hisr_core.train.fit import epoch_batches
from tests.hisr_core.rewards.helpers import spans
from tests.hisr_core.rl import ppo_worker
from tests.household_data import rollout_rows

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(ppo_worker.__file__)
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
METRICS = ("losses/policy", "losses/value", "policy/kl", "policy/clipfrac", "policy/entropy",
           "critic/value_mean", "rewards/fused_mean", "rollout/success", "time/generate_s",
           "time/score_s", "time/update_s", "perf/tokens_per_s", "rollout/parse_failure_rate")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    rows = rollout_rows(12, fail_every=2)
    texts = [t[k] for r in rows for t in r["turns"] for k in ("observation", "response")]
    texts += [r["instruction"] for r in rows]
    return build_builtin("builtin:tiny", texts, 0, tmp_path_factory.mktemp("tiny"))


def unchanged(result: dict, part: str) -> list[str]:
    return [k for k, v in result["initial"][part].items()
            if torch.equal(v, result["final"][part][k])]


def test_an_iteration_changes_every_trainable_parameter_of_policy_and_critic(tiny_dir):
    result = ppo_worker.run(tiny_dir, ppo_worker.ppo_params("torch", 1), "hisr")
    assert result["initial"]["policy"] and result["initial"]["critic"]
    assert unchanged(result, "policy") == []
    assert unchanged(result, "critic") == []
    (metrics,) = result["history"]
    for key in METRICS:
        assert math.isfinite(metrics[key]), key
    assert metrics["rollout/episodes"] == 6  # 3 tasks x 2 samples
    assert metrics["optim/steps"] == 4       # 2 epochs x 2 minibatches
    assert metrics["critic/explained_variance"] <= 1  # a fresh critic: far below 0
    # The household oracle reports distances: the iteration's credit accuracy is logged.
    assert {"credit/spearman", "credit/kendall", "credit/first_error_top1",
            "credit/return_margin", "credit/return_margin_ratio"} <= set(metrics)


@pytest.mark.parametrize("variant", [v for v in PPO_VARIANTS if v != "hisr"])
def test_every_variant_trains_with_the_same_metric_names(tiny_dir, variant):
    cfg = ppo_worker.ppo_params("torch", 1, ppo_epochs=1, minibatches=1, kl_coef=0.0)
    result = ppo_worker.run(tiny_dir, cfg, variant)
    (metrics,) = result["history"]
    expected = [k for k in METRICS if variant != "grpo" or k not in
                ("losses/value", "critic/value_mean")]
    assert all(math.isfinite(metrics[k]) for k in expected)
    assert unchanged(result, "policy") == []
    assert (result["initial"]["critic"] == {}) == (variant == "grpo")


def _scored(before: list[int], after: list[int], rewards: list[float], won: bool) -> object:
    turns = [{"distance_before": b, "distance_after": a} for b, a in zip(before, after)]
    return SimpleNamespace(row={"turns": turns, "won": won, "outcome": float(won)},
                           turn_rewards=torch.tensor(rewards, dtype=torch.float64))


def test_iteration_credit_by_hand():
    """Won: distances 3 2 1 0 (true credit 1 1 1) on segments {0, 1} {2}: segment credit 2, 1;
    fused rewards 0.1 0.1 1 sum per segment to 0.2, 1 (ranked the other way: Kendall -1).
    Failed: 2 3 3 (credit -1 0) on segments {0} {1}; rewards 0 0.2 (Kendall 1), and segment
    0, the lowest, holds the first harmful turn. Pooled (true, fused): (2, .2) (1, 1) (-1, 0)
    (0, .2): ranks true 4 3 1 2, fused 2.5 4 1 2.5; about 2.5 the products sum to 3 and the
    squares to 5 and 4.5: Spearman 3 / sqrt(22.5). Returns 1.2 and 0.2: margin 1.0, the
    outcome's. A trajectory of unknown distance is left out."""
    won = _scored([3, 2, 1], [2, 1, 0], [0.1, 0.1, 1.0], True)
    failed = _scored([2, 3], [3, 3], [0.0, 0.2], False)
    unknown = _scored([UNKNOWN_DISTANCE], [UNKNOWN_DISTANCE], [1.0], True)
    one = DistInfo(0, 1, 0)
    got = iteration_credit([won, failed, unknown], [spans(2, 1), spans(1, 1), spans(1)], one)
    assert got["credit/spearman"] == pytest.approx(3 / math.sqrt(22.5))
    assert got["credit/kendall"] == pytest.approx(0.0)
    assert got["credit/first_error_top1"] == 1.0
    assert got["credit/return_margin"] == pytest.approx(1.0)
    assert got["credit/return_margin_ratio"] == pytest.approx(1.0)
    assert iteration_credit([unknown], [spans(1)], one) == {}


def test_critic_warmup_steps_only_the_critic_and_lowers_its_loss(tiny_dir):
    """Offline on the same 3 trajectories every iteration: the first 2 iterations step only the
    critic (no policy step, policy metrics nan) and its value loss falls; the third steps the
    policy too. A warm-up as long as the run is refused."""
    cfg = ppo_worker.ppo_params("torch", 3, mode="offline", critic_warmup=2, minibatches=1)
    result = ppo_worker.run(tiny_dir, cfg, "ppo", offline=3)
    first, second, third = result["history"]
    assert first["optim/policy_steps"] == second["optim/policy_steps"] == 0
    assert math.isnan(first["losses/policy"]) and third["optim/policy_steps"] == 2
    assert second["losses/value"] < first["losses/value"]
    assert unchanged(result, "critic") == [] and unchanged(result, "policy") == []
    with pytest.raises(ValueError, match="critic_warmup=3 leaves no iteration"):
        ppo_worker.ppo_params("torch", 3, critic_warmup=3)


def test_first_minibatch_ratio_is_one(tiny_dir):
    """The old log-probs are the current policy's: before any step the ratio is exactly ~1, so
    no token is clipped in a single minibatch pass."""
    cfg = ppo_worker.ppo_params("torch", 1, ppo_epochs=1, minibatches=1, kl_coef=0.0,
                                entropy_coef=0.0)
    (metrics,) = ppo_worker.run(tiny_dir, cfg, "ppo")["history"]
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["policy/clipfrac"] == 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(model: Path, out: Path, backend: str = "torch", nproc: int = 1, micro: int = 2,
             iterations: int = 2, offline: int = 0, checkpoint: Path | None = None) -> list[str]:
    launcher = [sys.executable]
    if nproc > 1 and backend == "deepspeed":  # the deepspeed launcher (CPU: gloo)
        launcher += ["-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
                     "--master_port", str(_free_port())]
    elif nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                     "--master_port", str(_free_port())]
    args = [str(WORKER), "--model", str(model), "--backend", backend, "--micro", str(micro),
            "--iterations", str(iterations), "--offline", str(offline), "--out", str(out)]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint)]
    return [*launcher, *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def run_worker(cmd: list[str], out: Path) -> dict:
    # cwd: the project root, so DeepSpeed's compiled CPU op is cached in its .cache folder.
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def assert_close_weights(a: dict, b: dict, atol: float) -> None:
    for part in ("policy", "critic"):
        assert a["final"][part].keys() == b["final"][part].keys()
        for k, v in a["final"][part].items():
            torch.testing.assert_close(v, b["final"][part][k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def offline_reference(tiny_dir, tmp_path_factory):
    """One process, micro-batch 4, offline on 10 ``D_st`` trajectories (3 an iteration): what
    two processes with micro-batch 2 must reproduce."""
    out = tmp_path_factory.mktemp("ref") / "one.pt"
    return run_worker(_command(tiny_dir, out, micro=4, offline=10), out)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    "torch",
    pytest.param("deepspeed", marks=pytest.mark.skipif(not HAS_DEEPSPEED,
                                                       reason="DeepSpeed is not installed")),
])
def test_two_processes_match_one(tiny_dir, tmp_path, offline_reference, backend):
    """Trajectories split across 2 CPU processes (gloo; torchrun, or the deepspeed launcher),
    samples gathered, each process its slice of the same global micro-batches: the weights
    match one process's."""
    out = tmp_path / "two.pt"
    result = run_worker(_command(tiny_dir, out, backend, nproc=2, micro=2, offline=10), out)
    assert result["world_size"] == 2 and result["backend"] == backend
    assert unchanged(result, "policy") == [] and unchanged(result, "critic") == []
    assert_close_weights(result, offline_reference, atol=2e-5)
    for got, want in zip(result["history"], offline_reference["history"], strict=True):
        assert got["losses/policy"] == pytest.approx(want["losses/policy"], rel=1e-3, abs=1e-6)
        # Credit over both processes' trajectories: what one process measures over them all.
        assert got["credit/spearman"] == pytest.approx(want["credit/spearman"], nan_ok=True)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (extra gpu)")
def test_deepspeed_online_iteration_changes_every_parameter(tiny_dir, tmp_path):
    out = tmp_path / "ds.pt"
    result = run_worker(_command(tiny_dir, out, "deepspeed", iterations=1), out)
    assert result["backend"] == "deepspeed"
    assert unchanged(result, "policy") == [] and unchanged(result, "critic") == []


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_weights(tiny_dir, tmp_path):
    """SIGKILL once the first checkpoint exists; the same command resumes from it and ends
    with the iteration count and the weights of an uninterrupted run."""
    iterations = 4
    straight_out = tmp_path / "straight.pt"
    straight = run_worker(_command(tiny_dir, straight_out, iterations=iterations,
                                   checkpoint=tmp_path / "ck-straight"), straight_out)
    ck, out = tmp_path / "ck", tmp_path / "resumed.pt"
    cmd = _command(tiny_dir, out, iterations=iterations, checkpoint=ck)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while (read_checkpoint_meta(ck) or {}).get("iteration", 0) < 1:
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = read_checkpoint_meta(ck)["iteration"]
    assert 1 <= killed_at < iterations
    resumed = run_worker(cmd, out)
    assert resumed["start"] == killed_at
    assert read_checkpoint_meta(ck)["iteration"] == iterations
    assert len(resumed["history"]) == iterations - killed_at
    assert_close_weights(resumed, straight, atol=0.0)
    last = straight["history"][-1]
    assert resumed["history"][-1]["losses/policy"] == pytest.approx(last["losses/policy"],
                                                                    abs=1e-12)


@pytest.mark.slow
def test_sigterm_during_rollouts_checkpoints_the_iteration_start_and_resumes_exactly(
        tiny_dir, tmp_path):
    """SIGTERM as iteration 2 collects (no checkpoint yet: one every 100 iterations): the run
    abandons the iteration, checkpoints the state it started from and exits 143; the rerun
    plays iteration 2 again and ends with the weights of a run never stopped."""
    straight_out, out, ck = tmp_path / "straight.pt", tmp_path / "resumed.pt", tmp_path / "ck"
    straight = run_worker(_command(tiny_dir, straight_out, iterations=3), straight_out)
    cmd = [*_command(tiny_dir, out, iterations=3, checkpoint=ck), "--checkpoint-every", "100"]
    proc = subprocess.run([*cmd, "--stop-during", "2"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert read_checkpoint_meta(ck)["iteration"] == 1
    resumed = run_worker(cmd, out)
    assert resumed["start"] == 1 and len(resumed["history"]) == 2
    assert_close_weights(resumed, straight, atol=0.0)


def test_a_checkpoint_from_another_setting_is_refused(tiny_dir, tmp_path):
    ck = tmp_path / "ck"
    ppo_worker.run(tiny_dir, ppo_worker.ppo_params("torch", 1), "ppo", checkpoint=ck)
    with pytest.raises(ValueError, match="variant='ppo'"):
        ppo_worker.run(tiny_dir, ppo_worker.ppo_params("torch", 2), "no_both", checkpoint=ck)


def test_minibatches_are_the_same_for_any_process_count():
    cfg = PpoParams(micro_batch_size=2, minibatches=3)
    lengths = [50 + (7 * i) % 31 for i in range(23)]
    one = minibatch_windows(lengths, cfg.model_copy(update={"micro_batch_size": 4}),
                            DistInfo(0, 1, 0), iteration=3, epoch=1)
    two = [minibatch_windows(lengths, cfg, DistInfo(r, 2, 0), iteration=3, epoch=1)
           for r in range(2)]
    assert len(one) == len(two[0]) == len(two[1]) == 3
    for step, window in enumerate(one):
        assert [sorted(mb) for mb in window] == [
            sorted(a + b) for a, b in zip(two[0][step], two[1][step], strict=True)]
    every = sorted(i for w in one for mb in w for i in mb)
    # seed * 1_000_003 + iteration = 3: the pass covers what epoch_batches gives, i.e. all.
    assert every == sorted(i for b in epoch_batches(lengths, 4, 3, 1) for i in b) \
        == list(range(23))


def test_iteration_tasks_cycle_through_shuffles_deterministically():
    cfg = PpoParams(tasks_per_iter=4, seed=1)
    tasks = list(range(10))
    first = [i for it in range(5) for i in iteration_tasks(tasks, cfg, it)]
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert first == [i for it in range(5) for i in iteration_tasks(tasks, cfg, it)]
    assert first[:10] != first[10:20]  # a new shuffle each pass


def test_critic_saves_and_loads(tiny_dir, tmp_path):
    from hisr_core.agent.models import load_model

    torch.manual_seed(3)
    critic = ValueModel(load_model(tiny_dir)).eval()
    save_critic(critic, tmp_path / "critic")
    loaded = load_critic(tmp_path / "critic")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    keep = torch.tensor([[False, True, True, False]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.values(ids, keep), critic.values(ids, keep))
    with pytest.raises(FileNotFoundError, match="not a critic"):
        load_critic(tiny_dir)
