"""Batched response log-probs against a naive one-turn-at-a-time reference."""

from __future__ import annotations

import pytest
import torch

from hisr_core.agent.prompts import PromptBuilder, system_text
from hisr_core.envs import make_environment
from hisr_core.train.scoring import (
    scoring_sequences,
    token_logprobs,
    turn_logprobs,
    turn_logprobs_naive,
)
from tests.hisr_core.rollout.test_engine import household_tokenizer, peaky_model


@pytest.fixture(scope="module")
def episodes(tokenizer):
    env = make_environment("household", max_turns=25)
    out = []
    for t in env.make_tasks("valid_seen", 4, 0):
        ep = env.expert_play(t, 0.2)
        out.append((system_text(t.instruction, env.command_grammar),
                    [(x.observation, x.response) for x in ep.turns]))
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return household_tokenizer(make_environment("household", max_turns=25))


@pytest.mark.parametrize("history, max_tokens", [(None, 4096), (2, 4096), (None, 600)],
                         ids=["whole-episode", "history-2", "truncated"])
def test_batched_scores_equal_the_naive_reference(tokenizer, episodes, history, max_tokens):
    # float64: in float32 the round-off between batch layouts reaches ~1e-5
    model = peaky_model(tokenizer, seed=6).double()
    builder = PromptBuilder(tokenizer, history, max_tokens)
    batched = turn_logprobs(model, builder, episodes, max_batch_tokens=1500)
    reference = turn_logprobs_naive(model, builder, episodes)
    for (_, turns), got, want in zip(episodes, batched, reference, strict=True):
        assert len(got) == len(turns)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.numel() > 0
            assert torch.allclose(g, w, atol=1e-5, rtol=0)
    n_seqs = [len(scoring_sequences(builder, system, turns)) for system, turns in episodes]
    if history is None and max_tokens == 4096:
        assert n_seqs == [1] * len(episodes), "a whole episode is one sequence"
    else:
        assert all(1 < n <= len(turns) for n, (_, turns) in zip(n_seqs, episodes, strict=True))


@pytest.mark.parametrize("history", [None, 2])
def test_without_past_lists_batched_scores_equal_the_naive_reference(tokenizer, history):
    """``past_admissible=False``: every turn is scored with only its own observation listed,
    as its generation prompt showed it."""
    env = make_environment("household", max_turns=25, show_admissible=True)
    episodes = []
    for t in env.make_tasks("valid_seen", 3, 0):
        ep = env.expert_play(t, 0.2)
        episodes.append((system_text(t.instruction, env.command_grammar),
                         [(x.observation, x.response) for x in ep.turns]))
    # float64: in float32 the round-off between batch layouts reaches ~1e-5
    model = peaky_model(tokenizer, seed=6).double()
    builder = PromptBuilder(tokenizer, history, 4096, past_admissible=False)
    batched = turn_logprobs(model, builder, episodes, max_batch_tokens=3000)
    reference = turn_logprobs_naive(model, builder, episodes)
    for got, want in zip(batched, reference, strict=True):
        for g, w in zip(got, want, strict=True):
            assert g.numel() > 0 and torch.allclose(g, w, atol=1e-5, rtol=0)
    for system, turns in episodes:
        seqs = scoring_sequences(builder, system, turns)
        assert len(seqs) == len(turns)
        for s in seqs:
            shown = tokenizer.decode(s.input_ids, skip_special_tokens=True)
            assert shown.count("Admissible actions:") == 1


def test_token_logprobs_shapes_and_order(tokenizer):
    model = peaky_model(tokenizer)
    seqs = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    out = token_logprobs(model, seqs, pad_id=0, max_batch_tokens=6)  # forces several batches
    assert [o.shape[0] for o in out] == [2, 0, 4]
    with torch.inference_mode():
        alone = torch.log_softmax(model(torch.tensor([seqs[2]])).logits[0].float(), -1)
    assert torch.allclose(out[2], alone[:-1].gather(-1, torch.tensor(seqs[2][1:])[:, None])
                          .squeeze(-1), atol=1e-5)
    with pytest.raises(ValueError):
        token_logprobs(model, [[]], pad_id=0)


def test_scoring_only_masked_positions_gives_the_same_values(tokenizer):
    model = peaky_model(tokenizer, seed=2)
    seqs = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    score = [[0, 1, 0, 1], [0, 0], [1, 1, 1]]  # a set position 0 has no context: ignored
    full = token_logprobs(model, seqs, pad_id=0, max_batch_tokens=8)
    some = token_logprobs(model, seqs, pad_id=0, max_batch_tokens=8, score=score)
    for f, s, m in zip(full, some, score, strict=True):
        assert torch.allclose(s, f[torch.tensor(m[1:], dtype=torch.bool)], atol=1e-6)
    with pytest.raises(ValueError, match="lengths"):
        token_logprobs(model, seqs, pad_id=0, score=[[1], [1], [1]])
