"""Checkpoints of the shared fit loop (SFT, both SPRMs, hindsight): a fit stopped by SIGTERM or
crashed between checkpoints, run again, ends with the weights, losses and summary of a fit
never stopped (bit for bit on a CPU); a checkpoint of another fit is discarded.

The stops here are real signals this process sends itself from inside the loop (the
``on_log`` callback of a step), so the handler, the step boundary and the checkpoint are the
ones a preempted job goes through. The 2-process case runs under ``torchrun`` (gloo).
"""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest
import torch

from hisr_core.agent.models import build_builtin, load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import HindsightParams, SprmParams
from hisr_core.envs import environment_class
from hisr_core.rewards.gated_attention import attach_gates
from hisr_core.rewards.hindsight import Window, trajectory_examples
from hisr_core.rewards.sprm import train_sprm
from hisr_core.train import checkpoint as ckpt
from hisr_core.train import preempt
from hisr_core.train.engine import freeze_weights, init_distributed
from hisr_core.train.fit import Checkpoint
from hisr_core.train.sft import encode_trajectories, train_sft
from tasks.sprm import encode_rows
from tests.hisr_core.train.sft_worker import GRAMMAR, corpus, make_rows, sft_params
from tests.household_data import rollout_rows, segmented_rows

STEPS = 6
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    rows = segmented_rows(rollout_rows(8, fail_every=2))
    texts = corpus(make_rows(40, seed=0))
    texts += [t[k] for r in rows for t in r["turns"] for k in ("observation", "response")]
    return build_builtin("builtin:tiny", texts, 0, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def _forget_signals():
    preempt.reset()
    yield
    preempt.reset()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, differ[:5]


class Logs:
    """An ``on_log`` that records every step and, at step ``stop_at``, sends this process
    ``SIGTERM`` (``crash_at``: raises, as a process killed before its next checkpoint)."""

    def __init__(self, name: str, stop_at: int | None = None, crash_at: int | None = None):
        self.name, self.stop_at, self.crash_at = name, stop_at, crash_at
        self.losses: dict[int, float] = {}

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if step == self.crash_at:
            raise RuntimeError(f"crash at step {step}")
        self.losses[step] = metrics[f"losses/{self.name}"]
        if step == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)


def sft_run(tiny_dir: Path, logs: Logs, checkpoint: Checkpoint | None,
            **overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    tokenizer = load_tokenizer(tiny_dir)
    model = load_model(tiny_dir)
    seqs = encode_trajectories(make_rows(12, seed=1), PromptBuilder(tokenizer), GRAMMAR)
    params = sft_params("torch", 2, STEPS, **{"checkpoint_every_s": 3600.0, **overrides})
    stats = train_sft(model, tokenizer, seqs, params, "float32", logs, progress=False,
                      checkpoint=checkpoint)
    return stats, weights(model)


def test_sft_stopped_by_sigterm_resumes_to_the_same_weights(tiny_dir, tmp_path, capsys):
    ref_logs = Logs("sft")
    ref_stats, ref_weights = sft_run(tiny_dir, ref_logs, None)
    checkpoint = Checkpoint(tmp_path / "ckpt", "inputs-a", {"run_id": "r1"})

    stopped = Logs("sft", stop_at=2)
    with pytest.raises(preempt.Preempted) as err:
        sft_run(tiny_dir, stopped, checkpoint)
    assert err.value.code == 128 + signal.SIGTERM
    # The signal came while step 2 was logged: the loop ends step 3, then checkpoints.
    meta = ckpt.read_meta(checkpoint.folder)
    assert meta["step"] == 3 and meta["run_id"] == "r1" and meta["total_steps"] == STEPS
    assert "after step 3 of 6" in err.value.message
    assert sorted(stopped.losses) == [1, 2, 3]

    preempt.reset()
    resumed = Logs("sft")
    stats, final = sft_run(tiny_dir, resumed, checkpoint)
    assert stats["resumed_from"] == 3
    assert sorted(resumed.losses) == [4, 5, 6]
    assert {**stopped.losses, **resumed.losses} == ref_logs.losses  # bit-identical curve
    assert_same_weights(final, ref_weights)
    for key in ("steps", "loss", "tokens", "response_tokens"):
        assert stats[key] == ref_stats[key], key
    assert "resuming from its checkpoint after step 3 of 6" in capsys.readouterr().out


def test_a_checkpoint_of_other_inputs_or_params_is_discarded(tiny_dir, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    with pytest.raises(preempt.Preempted):
        sft_run(tiny_dir, Logs("sft", stop_at=1), Checkpoint(folder, "inputs-a"))
    assert ckpt.read_meta(folder)["step"] == 2
    preempt.reset()
    # Other params (a learning rate) but the same inputs: the fit starts afresh.
    stats, _ = sft_run(tiny_dir, Logs("sft"), Checkpoint(folder, "inputs-a"), lr=1e-3,
                       max_steps=3)
    assert stats["resumed_from"] == 0
    assert "a checkpoint of other params or inputs; starting afresh" in capsys.readouterr().out
    # checkpoint_every_s is no part of the fingerprint: a stopped run resumed with another
    # interval goes on.
    with pytest.raises(preempt.Preempted):
        sft_run(tiny_dir, Logs("sft", stop_at=1), Checkpoint(folder, "inputs-b"), max_steps=3)
    preempt.reset()
    stats, _ = sft_run(tiny_dir, Logs("sft"), Checkpoint(folder, "inputs-b"), max_steps=3,
                       checkpoint_every_s=1.0)
    assert stats["resumed_from"] == 2


def sprm_run(tiny_dir: Path, logs: Logs, checkpoint: Checkpoint | None,
             **overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    tokenizer = load_tokenizer(tiny_dir)
    trajs = encode_rows(segmented_rows(rollout_rows(8, fail_every=2)),
                        PromptBuilder(tokenizer, None, 4096), "household")
    params = SprmParams(**{"backend": "torch", "micro_batch_size": 2, "log_every": 1,
                           "lr": 3e-3, "max_steps": STEPS, "epochs": 10.0, **overrides})
    model, stats = train_sprm(load_model(tiny_dir), tokenizer, trajs, params, "float32", logs,
                              progress=False, checkpoint=checkpoint)
    return stats, weights(model)


def test_sprm_killed_between_checkpoints_resumes_to_the_same_weights(tiny_dir, tmp_path):
    """A checkpoint after every step (a tiny interval); the fit dies while logging step 4,
    before that step's checkpoint: the rerun redoes step 4 from step 3's."""
    ref_logs = Logs("sprm")
    _, ref_weights = sprm_run(tiny_dir, ref_logs, None)
    checkpoint = Checkpoint(tmp_path / "ckpt", "d_st")
    with pytest.raises(RuntimeError, match="crash at step 4"):
        sprm_run(tiny_dir, Logs("sprm", crash_at=4), checkpoint, checkpoint_every_s=1e-6)
    assert ckpt.read_meta(checkpoint.folder)["step"] == 3
    resumed = Logs("sprm")
    stats, final = sprm_run(tiny_dir, resumed, checkpoint, checkpoint_every_s=1e-6)
    assert stats["resumed_from"] == 3 and stats["checkpoints"] == 2  # after steps 4 and 5
    assert {k: v for k, v in ref_logs.losses.items() if k > 3} == resumed.losses
    assert_same_weights(final, ref_weights)  # the head and the backbone
    ckpt.remove(checkpoint.folder, init_distributed())
    assert not checkpoint.folder.exists()


def hindsight_run(tiny_dir: Path, logs: Logs, checkpoint: Checkpoint | None
                  ) -> tuple[dict, dict[str, torch.Tensor]]:
    """``pi_hind`` as the stage trains it with ``hindsight.lr: 0``: only the gates, readers and
    pointer train, so the checkpoint holds those, not the frozen weights."""
    tokenizer = load_tokenizer(tiny_dir)
    builder = PromptBuilder(tokenizer, None, 4096)
    grammar = environment_class("household").command_grammar
    examples = [e for r in rollout_rows(4) for e in trajectory_examples(builder, r, grammar,
                                                                        Window(2, 2))]
    params = HindsightParams(reads="block", backend="torch", max_steps=STEPS, epochs=10.0, log_every=1,
                             micro_batch_size=2, grad_accum=1, lr=0.0, reader_rank=4,
                             pointer_rank=4, checkpoint_every_s=3600.0)
    model = load_model(tiny_dir)
    attach_gates(model, params.gate_init, params.gate_lr, params.reader_rank, params.reader_lr,
                 params.seed, params.pointer_rank, params.pointer_lr)
    freeze_weights(model)
    stats = train_sft(model, tokenizer, examples, params, "float32", logs, progress=False,
                      name="hindsight", checkpoint=checkpoint)
    return stats, weights(model)


def test_hindsight_stopped_resumes_and_keeps_only_trainable_weights(tiny_dir, tmp_path):
    ref_logs = Logs("hindsight")
    _, ref_weights = hindsight_run(tiny_dir, ref_logs, None)
    checkpoint = Checkpoint(tmp_path / "ckpt", "d_ct")
    with pytest.raises(preempt.Preempted):
        hindsight_run(tiny_dir, Logs("hindsight", stop_at=3), checkpoint)
    saved = torch.load(checkpoint.folder / "engine.pt", weights_only=False)["model"]
    frozen = {n for n, p in load_model(tiny_dir).named_parameters()}
    assert saved and not set(saved) & frozen  # gates, readers, pointer only
    preempt.reset()
    resumed = Logs("hindsight")
    stats, final = hindsight_run(tiny_dir, resumed, checkpoint)
    assert stats["resumed_from"] == 4
    assert {k: v for k, v in ref_logs.losses.items() if k > 4} == resumed.losses
    assert_same_weights(final, ref_weights)


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "nproc"), [
    ("torch", 2),
    pytest.param("deepspeed", 1, marks=pytest.mark.skipif(not HAS_DEEPSPEED,
                                                          reason="DeepSpeed is not installed")),
])
def test_sft_worker_stopped_by_sigterm_resumes_to_the_same_weights(tiny_dir, tmp_path, backend,
                                                                   nproc):
    """``sft_worker.py`` in its own processes: 2 under torchrun (gloo; only rank 0 gets the
    signal, both stop after the same step and each writes its RNG state), or DeepSpeed (ZeRO-2,
    its own checkpoint format). The rerun ends with the weights of a run never stopped."""
    from tests.hisr_core.train.test_sft import run_worker

    runs = {name: tmp_path / name for name in ("ref", "stopped", "resumed")}
    for folder in runs.values():
        folder.mkdir()
    micro = 4 // nproc
    ref = run_worker(runs["ref"], tiny_dir, backend, micro, nproc, save=runs["ref"] / "model")
    folder = tmp_path / "ckpt"
    # torchrun reports a failed worker with status 1; one process exits as SIGTERM asks.
    run_worker(runs["stopped"], tiny_dir, backend, micro, nproc,
               extra=("--checkpoint", str(folder), "--stop-at", "2"),
               status=1 if nproc > 1 else 128 + signal.SIGTERM)
    meta = ckpt.read_meta(folder)
    assert meta["step"] == 3 and meta["world_size"] == nproc and meta["backend"] == backend
    assert all((folder / f"rng-{rank}.pt").is_file() for rank in range(nproc))
    resumed = run_worker(runs["resumed"], tiny_dir, backend, micro, nproc,
                         save=runs["resumed"] / "model", extra=("--checkpoint", str(folder)))
    assert resumed["summary"]["resumed_from"] == 3
    assert resumed["steps"] == ref["steps"][3:] and resumed["losses"] == ref["losses"][3:]
    assert_same_weights(weights(load_model(runs["resumed"] / "model")),
                        weights(load_model(runs["ref"] / "model")))
