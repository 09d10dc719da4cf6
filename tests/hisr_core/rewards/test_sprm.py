"""The segment-level process reward model: where it reads each segment, its loss, batching,
training (full and LoRA), saving, and the held-out metrics' helpers."""

from __future__ import annotations

import math

import pytest
import torch

from hisr_core.agent.models import build_builtin, load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import LoraParams, SprmParams
from hisr_core.rewards.sprm import (
    SegmentRewardModel,
    collate,
    evaluate,
    load_sprm,
    pearson,
    sprm_loss,
    train_sprm,
    turn_rewards,
)
from hisr_core.train.fit import split_by_task
from tasks.sprm import encode_rows
from tests.household_data import rollout_rows, segmented_rows


@pytest.fixture(scope="module")
def rows():
    return segmented_rows(rollout_rows(12, fail_every=2))


@pytest.fixture(scope="module")
def tiny_dir(rows, tmp_path_factory):
    texts = [t[k] for r in rows for t in r["turns"] for k in ("observation", "response")]
    texts += [r["instruction"] for r in rows]
    return build_builtin("builtin:tiny", texts, 0, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


def _params(**kw) -> SprmParams:
    return SprmParams(**{"backend": "torch", "micro_batch_size": 3, "log_every": 1,
                         "lr": 3e-3, **kw})


@pytest.mark.parametrize("max_tokens", [4096, 400], ids=["one-sequence", "truncated"])
def test_each_turn_is_read_at_its_end_of_turn_token(rows, tokenizer, max_tokens):
    builder = PromptBuilder(tokenizer, None, max_tokens)
    trajs = encode_rows(rows, builder, "household")
    if max_tokens == 400:
        assert any(len(t.sequences) > 1 for t in trajs), "long trajectories span sequences"
    end_marker = builder._asst_end[-1]
    for t, row in zip(trajs, rows, strict=True):
        assert len(t.turn_ends) == row["n_turns"]
        assert t.seg_ends == [s["last_turn"] for s in row["segments"]]
        for s, pos in t.turn_ends:
            assert t.sequences[s][pos] == end_marker
        # The response read at turn k's end is turn k's: its text ends just before.
        for k, (s, pos) in enumerate(t.turn_ends):
            text = tokenizer.decode(t.sequences[s][:pos])
            assert text.endswith(row["turns"][k]["response"])


def test_loss_is_the_squared_error_of_the_segment_sum(rows, tiny_dir, tokenizer):
    torch.manual_seed(0)
    model = SegmentRewardModel(load_model(tiny_dir)).eval()
    trajs = encode_rows(rows[:4], PromptBuilder(tokenizer, None, 400), "household")
    batch = collate(trajs, tokenizer.pad_token_id)
    with torch.no_grad():
        loss = float(model(**batch.inputs()))
    per_turn = turn_rewards(model, trajs, tokenizer.pad_token_id, max_batch_tokens=700)
    want = sum((t.outcome - float(r[t.seg_ends].sum())) ** 2
               for t, r in zip(trajs, per_turn, strict=True))
    assert loss == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert batch.n_units == 4
    model.target = "prefix_sums"
    with torch.no_grad():
        prefix_loss = float(model(**batch.inputs()))
    want = sum(float(((t.outcome - torch.cumsum(r[t.seg_ends], 0)) ** 2).mean())
               for t, r in zip(trajs, per_turn, strict=True))
    assert prefix_loss == pytest.approx(want, rel=1e-5, abs=1e-6)
    # Batching does not change a reward: one trajectory per pass gives the same numbers.
    alone = [turn_rewards(model, [t], tokenizer.pad_token_id)[0] for t in trajs]
    for a, b in zip(alone, per_turn, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_prefix_target_regresses_every_prefix_sum_on_the_outcome():
    # Trajectory 0: rewards 0.5, 0.2 and R = 1; trajectory 1: 1.0, -0.3, 0.1 and R = 0.
    r = torch.tensor([0.5, 0.2, 1.0, -0.3, 0.1])
    owner, targets = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1.0, 0.0])
    # sum: (1 - 0.7)^2 + (0 - 0.8)^2.
    assert float(sprm_loss(r, owner, targets, "sum")) == pytest.approx(0.09 + 0.64)
    # Prefix sums 0.5, 0.7 and 1.0, 0.7, 0.8: (0.25 + 0.09) / 2 + (1 + 0.49 + 0.64) / 3.
    assert float(sprm_loss(r, owner, targets, "prefix_sums")) == \
        pytest.approx(0.34 / 2 + 2.13 / 3)
    # One segment: the two targets agree.
    one = torch.tensor([0.4]), torch.tensor([0]), torch.tensor([1.0])
    assert float(sprm_loss(*one, "sum")) == float(sprm_loss(*one, "prefix_sums"))


def test_training_logs_finite_losses_changes_the_head_and_saves(rows, tiny_dir, tokenizer,
                                                                tmp_path):
    trajs = encode_rows(rows, PromptBuilder(tokenizer, None, 4096), "household")
    torch.manual_seed(0)
    before = SegmentRewardModel(load_model(tiny_dir))  # the head train_sprm draws (same seed)
    logs = []
    model, stats = train_sprm(load_model(tiny_dir), tokenizer, trajs, _params(max_steps=3),
                              "float32", lambda s, m: logs.append((s, m)), progress=False,
                              out_dir=tmp_path / "sprm")
    assert [s for s, _ in logs] == [1, 2, 3]
    assert all(math.isfinite(m["losses/sprm"]) for _, m in logs)
    assert stats["trajectories"] == 9 and stats["steps"] == 3
    for name in ("w1", "w2"):
        assert not torch.equal(getattr(model, name).weight, getattr(before, name).weight), name
    loaded, _ = load_sprm(tmp_path / "sprm")
    pad = tokenizer.pad_token_id
    for a, b in zip(turn_rewards(model, trajs, pad), turn_rewards(loaded, trajs, pad),
                    strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_lora_trains_adapters_and_head_only_and_saves_merged(rows, tiny_dir, tokenizer,
                                                             tmp_path):
    trajs = encode_rows(rows[:6], PromptBuilder(tokenizer, None, 4096), "household")
    base = load_model(tiny_dir)
    lora = LoraParams(enabled=True, r=4, alpha=8, dropout=0.0)
    model, _ = train_sprm(base, tokenizer, trajs, _params(max_steps=2, lora=lora), "float32",
                          progress=False, out_dir=tmp_path / "sprm")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"w1.weight", "w2.weight"} <= trainable
    assert all("lora_" in n for n in trainable - {"w1.weight", "w2.weight"})
    loaded, _ = load_sprm(tmp_path / "sprm")
    pad = tokenizer.pad_token_id
    for a, b in zip(turn_rewards(model, trajs, pad), turn_rewards(loaded, trajs, pad),
                    strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize(("target", "least_r"), [("sum", 0.8), ("prefix_sums", 0.6)])
def test_a_small_run_fits_its_trajectories(rows, tiny_dir, tokenizer, target, least_r):
    """The fit works end to end: on the trajectories it was trained on, the predicted sums
    follow R and the MSE falls below the variance of R (less closely with ``prefix_sums``,
    whose loss fits every prefix, not only the whole)."""
    trajs = encode_rows(rows, PromptBuilder(tokenizer, None, 4096), "household")
    pad = tokenizer.pad_token_id
    model = SegmentRewardModel(load_model(tiny_dir))
    start = evaluate(model, trajs, pad)
    model, _ = train_sprm(load_model(tiny_dir), tokenizer, trajs,
                          _params(epochs=1000, max_steps=60, micro_batch_size=4, target=target),
                          "float32", progress=False)
    end = evaluate(model, trajs, pad)
    outcomes = torch.tensor([t.outcome for t in trajs])
    assert end["pearson"] >= least_r, (start, end)
    assert end["mse"] < float(outcomes.var(unbiased=False)) < start["mse"] + 1


def test_pearson_by_hand():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # x = (0, 1, 0, 1), y = (0, 0, 1, 1): centred dot product 0 → r = 0.
    assert pearson([0, 1, 0, 1], [0, 0, 1, 1]) == pytest.approx(0.0)
    assert math.isnan(pearson([1, 1, 1], [0, 1, 2]))
    with pytest.raises(ValueError):
        pearson([1], [1])


def test_split_by_task_keeps_a_task_whole_and_is_seeded():
    ids = [f"t{i % 10}" for i in range(40)]
    train, held = split_by_task(ids, 0.2, seed=0)
    assert sorted(train + held) == list(range(40))
    assert {ids[i] for i in train}.isdisjoint({ids[i] for i in held})
    assert len({ids[i] for i in held}) == 2
    assert split_by_task(ids, 0.2, seed=0) == (train, held)
    assert split_by_task(ids, 0.2, seed=1) != (train, held)
    assert split_by_task(ids, 0.0, seed=0) == (list(range(40)), [])
    assert split_by_task(["a", "a"], 0.9, seed=0) == ([0, 1], [])  # one task: nothing held out
