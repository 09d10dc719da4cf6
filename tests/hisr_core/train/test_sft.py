"""Behaviour cloning: labels, batching, loss, and training on every backend and process count.

The multi-process tests launch ``tests/hisr_core/train/sft_worker.py`` under ``torchrun`` (2 CPU
processes, gloo) and compare its logged per-step losses with one process taking micro-batches
twice as large: the loss is normalised by the global token count, so they must agree.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hisr_core.agent.models import build_builtin, load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.train import sft
from hisr_core.train.engine import DistInfo
from hisr_core.train.fit import count_steps, epoch_batches, rank_slice, step_windows
from hisr_core.train.sft import IGNORE, ResponseNLL, collate, encode_trajectories, train_sft
from tests.hf_fixtures import save_tiny_qwen
from tests.hisr_core.train.sft_worker import GRAMMAR, corpus, make_rows, sft_params, train

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("sft_worker.py")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
N_ROWS, STEPS, MICRO = 12, 4, 2  # 12 sequences, global micro-batch 4, 2 per window: a short
# last window every epoch, and an epoch boundary inside the 4 steps.


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_builtin("builtin:tiny", corpus(make_rows(40, seed=0)), 0,
                         tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory) -> tuple[dict, Path]:
    """One process, plain torch, micro-batch 2 x MICRO: the curve every other run must match."""
    out = tmp_path_factory.mktemp("reference") / "model"
    return train(tiny_dir, sft_params("torch", 2 * MICRO, STEPS), N_ROWS, save=out), out


def changed_parameters(before_dir: Path, after_dir: Path) -> tuple[list[str], list[str]]:
    before = dict(load_model(before_dir).named_parameters())
    after = dict(load_model(after_dir).named_parameters())
    assert before.keys() == after.keys()
    moved = sorted(n for n in before if not torch.equal(before[n], after[n]))
    return moved, sorted(before)


# -- data ------------------------------------------------------------------------------------------
def test_encode_trajectories_masks_exactly_the_responses(tokenizer):
    rows = make_rows(3, seed=1)
    seqs = encode_trajectories(rows, PromptBuilder(tokenizer), GRAMMAR)
    assert len(seqs) == 3  # no history limit: one sequence per episode
    for row, seq in zip(rows, seqs):
        learned = [t for t, m in zip(seq.input_ids, seq.response_mask) if m]
        assert tokenizer.decode(learned, skip_special_tokens=True) == \
            "".join(t["response"] for t in row["turns"])
    # A history limit gives one extra sequence per turn beyond the first window.
    seqs = encode_trajectories(rows, PromptBuilder(tokenizer, history=1), GRAMMAR)
    assert len(seqs) == sum(len(r["turns"]) - 1 for r in rows)


def test_every_response_trains_the_context_turns_of_each_sequence(tokenizer):
    rows = make_rows(3, seed=1)
    rows[0]["turns"][1] = {**rows[0]["turns"][1], "admissible": False}  # a slip: never trained
    builder = PromptBuilder(tokenizer, history=1)
    plain = encode_trajectories(rows, builder, GRAMMAR)
    every = encode_trajectories(rows, builder, GRAMMAR, every_response=True)
    # Same sequences, token for token; only the loss mask grows.
    assert [s.input_ids for s in every] == [s.input_ids for s in plain]
    assert all(p <= e for a, b in zip(plain, every) for p, e in zip(a.response_mask, b.response_mask))
    seqs = iter(every)
    for i, row in enumerate(rows):
        turns = row["turns"]
        for last in range(1, len(turns)):  # history 1: sequences (0, 1), (1, 2), ...
            seq = next(seqs)
            assert seq.turns == (last - 1, last)
            learned = [t for t, m in zip(seq.input_ids, seq.response_mask) if m]
            want = "".join(turns[k]["response"] for k in seq.turns
                           if turns[k].get("admissible", True))
            assert tokenizer.decode(learned, skip_special_tokens=True) == want
            if i == 0 and last == 2:  # the slip is context, not target
                assert turns[1]["response"] not in tokenizer.decode(learned)
    assert next(seqs, None) is None


def test_labels_are_response_tokens_and_end_markers_never_padding(tokenizer):
    seqs = encode_trajectories(make_rows(6, seed=3), PromptBuilder(tokenizer), GRAMMAR)
    seqs = sorted(seqs, key=lambda s: len(s.input_ids))
    seqs = [seqs[0], seqs[-1]]
    short, long = seqs
    assert len(short.input_ids) < len(long.input_ids)
    batch = collate([short, long], pad_id=tokenizer.pad_token_id)
    assert batch.input_ids.shape == (2, len(long.input_ids))
    for b, seq in enumerate([short, long]):
        n = len(seq.input_ids)
        labels = batch.labels[b]
        assert batch.attention_mask[b].tolist() == [1] * n + [0] * (batch.input_ids.shape[1] - n)
        assert (labels[n:] == IGNORE).all()  # padding never carries loss
        mask = torch.tensor(seq.response_mask, dtype=torch.bool)
        assert torch.equal(labels[:n] != IGNORE, mask)
        learned = labels[:n][mask]
        assert torch.equal(learned, torch.tensor(seq.input_ids)[mask])
        # Response tokens, each response closed by its (learned) end-of-turn marker.
        end_id = tokenizer.convert_tokens_to_ids("<|end|>")
        assert learned.tolist().count(end_id) == len(seq.turns)
        assert learned[-1] == end_id
    assert batch.n_units == sum(sum(s.response_mask) for s in seqs)
    assert batch.n_tokens == len(short.input_ids) + len(long.input_ids)


def test_batches_are_the_same_for_any_process_count_and_cover_the_data():
    lengths = [((i * 37) % 11) + 5 for i in range(23)]
    batches = epoch_batches(lengths, global_batch=4, seed=7, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(23))
    assert sorted(len(b) for b in batches) == [3] + [4] * 5  # only one short batch
    assert epoch_batches(lengths, 4, seed=7, epoch=1) != batches  # new order each epoch
    # Each rank gets a disjoint, equal share of every global micro-batch.
    for b in batches:
        shares = [rank_slice(b, DistInfo(r, 2, r)) for r in range(2)]
        assert sorted(shares[0] + shares[1]) == sorted(b)
    # One process with micro-batch 4 and two with 2 see the same windows, split differently.
    one = list(step_windows(lengths, 4, 2, 7, DistInfo(0, 1, 0), total_steps=5))
    two = [list(step_windows(lengths, 2, 2, 7, DistInfo(r, 2, r), total_steps=5))
           for r in range(2)]
    for step in range(5):
        assert len(two[0][step]) == len(two[1][step])  # same number of micro-batches
        for mb, mb0, mb1 in zip(one[step], two[0][step], two[1][step]):
            assert sorted(mb) == sorted(mb0 + mb1)
    # 23 sequences, global micro-batch 4 → 6 micro-batches, 3 windows of 2 per epoch.
    assert count_steps(23, 4, 1, 2, epochs=2.0, max_steps=None) == 6
    assert count_steps(23, 4, 1, 2, epochs=0.5, max_steps=None) == 2
    assert count_steps(23, 4, 1, 2, epochs=2.0, max_steps=4) == 4
    with pytest.raises(ValueError, match="cannot fill"):
        count_steps(1, 2, 2, 1, 1.0, None)


# -- loss ------------------------------------------------------------------------------------------
def test_loss_is_response_nll_and_padding_changes_nothing(tiny_dir, tokenizer, monkeypatch):
    model = load_model(tiny_dir).eval()
    seqs = encode_trajectories(make_rows(6, seed=3), PromptBuilder(tokenizer), GRAMMAR)
    seqs = sorted(seqs, key=lambda s: len(s.input_ids))
    seqs = [seqs[0], seqs[-1]]  # different lengths: one of them padded
    loss_fn = ResponseNLL(model)
    alone = [collate([s], tokenizer.pad_token_id) for s in seqs]
    both = collate(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        nll_alone = [loss_fn(input_ids=b.input_ids, labels=b.labels) for b in alone]
        nll_both = loss_fn(input_ids=both.input_ids, labels=both.labels)
        # The model's own loss is the mean over the same labelled tokens.
        hf = model(input_ids=both.input_ids, attention_mask=both.attention_mask,
                   labels=both.labels).loss
        monkeypatch.setattr(sft, "lm_parts", lambda m: None)  # the full-logits path
        nll_full = loss_fn(input_ids=both.input_ids, labels=both.labels)
    torch.testing.assert_close(nll_both, sum(nll_alone), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(nll_both / both.n_units, hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nll_full, nll_both, rtol=1e-5, atol=1e-4)


# -- training --------------------------------------------------------------------------------------
def test_sft_torch_smoke(reference, tiny_dir):
    result, out = reference
    assert result["steps"] == list(range(1, STEPS + 1))  # log_every=1: every step logged
    assert all(math.isfinite(x) for x in result["losses"] + result["grad_norms"])
    assert result["losses"][-1] < result["losses"][0]
    assert result["summary"]["steps"] == STEPS and result["summary"]["tokens_per_s"] > 0
    moved, names = changed_parameters(tiny_dir, out)
    assert moved == names  # every trainable parameter changed
    assert (out / "tokenizer.json").exists()


def test_on_log_every_n_steps_and_at_the_end(tiny_dir, tokenizer):
    seqs = encode_trajectories(make_rows(8, seed=1), PromptBuilder(tokenizer), GRAMMAR)
    logs: list[tuple[int, dict]] = []
    stats = train_sft(load_model(tiny_dir), tokenizer, seqs,
                      sft_params("torch", 2, 4, log_every=3, grad_accum=1), "float32",
                      on_log=lambda step, m: logs.append((step, m)), progress=True)
    assert [s for s, _ in logs] == [3, 4]
    assert set(logs[0][1]) == {"losses/sft", "perf/tokens_per_s", "optim/lr", "optim/grad_norm"}
    assert stats["loss"] == logs[-1][1]["losses/sft"] and stats["backend"] == "torch"


def chat_model_dir(tmp_path: Path) -> Path:
    """A tiny Qwen2 with a chat-template tokenizer (the Hugging Face model path)."""
    return save_tiny_qwen(tmp_path, corpus(make_rows(20, seed=0)), vocab_size=300)


def test_sft_on_a_chat_template_model(tmp_path):
    src = chat_model_dir(tmp_path / "src")
    tokenizer = load_tokenizer(src)
    seqs = encode_trajectories(make_rows(4, seed=1), PromptBuilder(tokenizer), GRAMMAR)
    stats = train_sft(load_model(src), tokenizer, seqs, sft_params("torch", 2, 2), "float32",
                      progress=False, out_dir=tmp_path / "out")
    assert math.isfinite(stats["loss"])
    moved, names = changed_parameters(src, tmp_path / "out")
    assert moved == names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(tmp_path: Path, model: Path, backend: str, micro: int, nproc: int,
               save: Path | None = None, extra: tuple[str, ...] = (),
               status: int = 0) -> dict | None:
    """Run ``sft_worker.py``; its result, or ``None`` when it is to exit with ``status``."""
    out = tmp_path / f"{backend}-{nproc}.json"
    args = [str(WORKER), "--model", str(model), "--backend", backend, "--micro", str(micro),
            "--steps", str(STEPS), "--rows", str(N_ROWS), "--out", str(out), *extra]
    if save is not None:
        args += ["--save", str(save)]
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                     "--master_port", str(_free_port())]
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    # cwd: the project root, so DeepSpeed's compiled CPU op is cached in its .cache folder.
    proc = subprocess.run([*launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()) if status == 0 else None


def assert_same_curve(result: dict, reference: dict) -> None:
    assert result["steps"] == reference["steps"]
    for key in ("losses", "grad_norms", "lrs"):
        assert result[key] == pytest.approx(reference[key], rel=1e-4), key
    assert result["summary"]["tokens"] == reference["summary"]["tokens"]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (extra gpu)")
def test_sft_deepspeed_smoke_matches_torch(reference, tiny_dir, tmp_path):
    """One CPU process, gloo, ZeRO-2: finite loss, every parameter moves, same curve as torch.
    (The first run compiles DeepSpeed's CPU communication op, ~1.5 min, cached afterwards.)"""
    result = run_worker(tmp_path, tiny_dir, "deepspeed", 2 * MICRO, 1, save=tmp_path / "model")
    assert result["summary"]["backend"] == "deepspeed"
    assert all(math.isfinite(x) for x in result["losses"])
    moved, names = changed_parameters(tiny_dir, tmp_path / "model")
    assert moved == names
    assert_same_curve(result, reference[0])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (extra gpu)")
def test_zero3_with_lora_matches_torch_and_saves_the_merged_model(tiny_dir, tmp_path):
    """ZeRO-3 (parameters partitioned, gathered to save) with LoRA adapters, the GPU check's
    sft_lora step on one CPU process: the curve of plain torch with the same adapters, and a
    saved plain model in which exactly the adapted projections moved, as torch's did."""
    lora = ("--lora",)
    reference = run_worker(tmp_path, tiny_dir, "torch", 2 * MICRO, 1, save=tmp_path / "torch",
                           extra=lora)
    result = run_worker(tmp_path, tiny_dir, "deepspeed", 2 * MICRO, 1, save=tmp_path / "zero3",
                        extra=(*lora, "--zero-stage", "3"))
    assert result["summary"]["backend"] == "deepspeed"
    assert_same_curve(result, reference)
    moved, _ = changed_parameters(tiny_dir, tmp_path / "zero3")
    assert moved == changed_parameters(tiny_dir, tmp_path / "torch")[0]
    assert moved and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in moved)
    ours = dict(load_model(tmp_path / "zero3").named_parameters())
    for name, p in load_model(tmp_path / "torch").named_parameters():
        torch.testing.assert_close(ours[name], p, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    "torch",
    pytest.param("deepspeed", marks=pytest.mark.skipif(not HAS_DEEPSPEED,
                                                       reason="DeepSpeed is not installed")),
])
def test_two_processes_match_one_with_twice_the_micro_batch(reference, tiny_dir, tmp_path,
                                                            backend):
    result = run_worker(tmp_path, tiny_dir, backend, MICRO, 2)
    assert result["summary"]["world_size"] == 2
    assert_same_curve(result, reference[0])


def test_inadmissible_turns_are_context_without_loss(tokenizer):
    rows = make_rows(3, seed=5)
    rows[0]["turns"][1] = {**rows[0]["turns"][1], "admissible": False}
    seqs = encode_trajectories(rows, PromptBuilder(tokenizer), GRAMMAR)
    learned = tokenizer.decode([t for t, m in zip(seqs[0].input_ids, seqs[0].response_mask) if m],
                               skip_special_tokens=True)
    expected = "".join(t["response"] for k, t in enumerate(rows[0]["turns"]) if k != 1)
    assert learned == expected
