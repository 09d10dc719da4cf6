"""Stage 5: the hindsight model's examples (METHOD.md, stage 5).

``pi_hind`` sees the task, the trajectory with response ``a_k`` replaced by a placeholder
(past *and* future turns), and the outcome; it must write ``a_k``. One example per turn. The
example is an ordinary chat episode, so the policy's prompt builder encodes it (chat template or
plain template alike) and the SFT loss trains it:

    system:    the task's system text (as the policy sees it)
    turns:     o_f, a_f, ..., o_k, MASK, ..., o_l, a_l      (a window f..l around k)
    user:      Outcome: success|failure (R = 0.00). Final observation: ...  + the request
    assistant: a_k                                            (the only tokens with loss)

Scoring reads ``log pi_hind(a_k^j | hindsight context)`` off the same sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from hisr_core.prompts import Encoded, PromptBuilder
from hisr_core.scoring import episode_of, masked_logprobs

#: Stands where the masked response was.
MASK = "[masked response]"


def query(outcome: float, won: bool, final_observation: str) -> str:
    """The last user message: the outcome and the request to recover the masked response."""
    return (f"Outcome: {'success' if won else 'failure'} (R = {outcome:.2f}). "
            f"Final observation: {final_observation}\nWrite the masked response.")


def _window(k: int, m: int, window: int | None) -> tuple[int, int]:
    if window is None:
        return 0, m - 1
    return max(0, k - window), min(m - 1, k + window)


def hindsight_example(builder: PromptBuilder, system: str, turns: Sequence[tuple[str, str]], k: int,
                      outcome: float, won: bool, final_observation: str,
                      window: int | None = None) -> Encoded:
    """The example for turn ``k``: turns ``k-window..k+window`` (all if ``None``) with ``a_k``
    masked, then the outcome query and ``a_k`` (masked in). While the sequence is over
    ``builder.max_tokens`` the turn farthest from ``k`` is dropped (the later one on a tie)."""
    m = len(turns)
    if not 0 <= k < m:
        raise ValueError(f"turn {k} is outside a trajectory of {m} turns")
    first, last = _window(k, m, window)
    ask = query(outcome, won, final_observation)
    while True:
        ctx = [(obs, MASK if j == k else resp) for j, (obs, resp) in
               enumerate(turns[first:last + 1], start=first)]
        enc = builder.encode(system, [*ctx, (ask, turns[k][1])], train_from=len(ctx))
        if len(enc.input_ids) <= builder.max_tokens:
            return enc
        if first == last == k:
            raise ValueError(f"the hindsight example of turn {k} alone needs "
                             f"{len(enc.input_ids)} tokens > max_tokens={builder.max_tokens}")
        if last - k >= k - first:
            last -= 1
        else:
            first += 1


def trajectory_examples(builder: PromptBuilder, row: Mapping[str, Any], grammar: Sequence[str],
                        window: int | None = None) -> list[Encoded]:
    """One example per turn of a ``D_ct`` / ``D_st`` row, in turn order."""
    system, turns = episode_of(row, grammar)
    return [hindsight_example(builder, system, turns, k, float(row["outcome"]), bool(row["won"]),
                              row["final_observation"], window) for k in range(len(turns))]


def hindsight_logprobs(model: PreTrainedModel, builder: PromptBuilder,
                       rows: Sequence[Mapping[str, Any]], grammar: Sequence[str],
                       window: int | None = None, max_batch_tokens: int = 8192
                       ) -> list[list[torch.Tensor]]:
    """Per row, per turn k, ``log pi_hind(a_k^j | hindsight context)`` of response k's tokens
    (end-of-turn marker included, as :func:`hisr_core.scoring.turn_logprobs` scores them).
    Shape: row → m tensors of shape (L_k,)."""
    examples = [trajectory_examples(builder, row, grammar, window) for row in rows]
    flat = [e for ex in examples for e in ex]
    pad = builder.tokenizer.pad_token_id if builder.tokenizer.pad_token_id is not None else 0
    scores = iter(masked_logprobs(model, flat, pad, max_batch_tokens))
    return [[next(scores) for _ in ex] for ex in examples]
