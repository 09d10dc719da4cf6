"""Stage 5: the hindsight model's examples (METHOD.md, stage 5).

``pi_hind`` sees the task, the whole trajectory except response ``a_k`` (past *and* future
turns) and the outcome, and must write ``a_k``. One example per turn. **Decision:** the
trajectory is laid out as the policy saw it up to ``o_k``, the hindsight information (the turns
after k, the outcome and the final observation) is appended to turn k's user message, and the
empty assistant turn after it is the placeholder where ``a_k`` was. Everything before the block
is byte-identical to the policy's prompt for turn k, so ``pi_hind`` starts from ``pi_ref``
exactly where ``pi_ref`` writes ``a_k`` and only has to learn to read the block, which sits
right before the target. The example is an ordinary chat episode, so the policy's prompt builder
encodes it and the SFT loss trains it:

    system:    the task's system text
    turns:     o_f, a_f, ..., o_k-1, a_k-1                  (the past, as the policy saw it)
    user:      o_k
               + "Hindsight ... Later turns: [Observation] o_k+1 [Response] a_k+1 ...
                  Outcome: success (R = 1.00). Final observation: ..."
    assistant: a_k                                           (the only tokens with loss)

Scoring reads ``log pi_hind(a_k^j | hindsight context)`` off the same sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from hisr_core.prompts import Encoded, PromptBuilder
from hisr_core.scoring import episode_of, masked_logprobs


@dataclasses.dataclass(frozen=True)
class Window:
    """Turns kept around the masked turn k: ``past`` before it and ``future`` after it
    (``None``: all, as far as ``max_tokens`` allows)."""

    past: int | None = None
    future: int | None = None

    def bounds(self, k: int, m: int) -> tuple[int, int]:
        """First and last turn kept (inclusive) for turn k of m."""
        return (0 if self.past is None else max(0, k - self.past),
                m - 1 if self.future is None else min(m - 1, k + self.future))


def hindsight_block(later: Sequence[tuple[str, str]], outcome: float, won: bool,
                    final_observation: str) -> str:
    """The text appended to ``o_k``: the turns after k, the outcome and the final observation."""
    lines = ["Hindsight: how this episode went after the turn you are writing."]
    if later:
        lines.append("Later turns:")
        for obs, resp in later:
            lines += [f"[Observation] {obs}", f"[Response] {resp}"]
    lines.append(f"Outcome: {'success' if won else 'failure'} (R = {outcome:.2f}). "
                 f"Final observation: {final_observation}")
    return "\n".join(lines)


def hindsight_example(builder: PromptBuilder, system: str, turns: Sequence[tuple[str, str]], k: int,
                      outcome: float, won: bool, final_observation: str,
                      window: Window = Window()) -> Encoded:
    """The example for turn ``k``: the system text, the turns ``window`` keeps before k,
    ``o_k`` with the hindsight block (the turns it keeps after k), and ``a_k`` (masked in).
    While the sequence is over ``builder.max_tokens`` the kept turn farthest from ``k`` is
    dropped (the later one on a tie)."""
    m = len(turns)
    if not 0 <= k < m:
        raise ValueError(f"turn {k} is outside a trajectory of {m} turns")
    first, last = window.bounds(k, m)
    while True:
        block = hindsight_block(turns[k + 1:last + 1], outcome, won, final_observation)
        obs_k, resp_k = turns[k]
        enc = builder.encode(system, [*turns[:k], (f"{obs_k}\n\n{block}", resp_k)], first,
                             train_from=k)
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
                        window: Window = Window()) -> list[Encoded]:
    """One example per turn of a ``D_ct`` / ``D_st`` row, in turn order."""
    system, turns = episode_of(row, grammar)
    return [hindsight_example(builder, system, turns, k, float(row["outcome"]), bool(row["won"]),
                              row["final_observation"], window) for k in range(len(turns))]


def hindsight_logprobs(model: PreTrainedModel, builder: PromptBuilder,
                       rows: Sequence[Mapping[str, Any]], grammar: Sequence[str],
                       window: Window = Window(), max_batch_tokens: int = 8192,
                       progress: str | None = None) -> list[list[torch.Tensor]]:
    """Per row, per turn k, ``log pi_hind(a_k^j | hindsight context)`` of response k's tokens
    (end-of-turn marker included, as :func:`hisr_core.scoring.turn_logprobs` scores them).
    Shape: row → m tensors of shape (L_k,)."""
    examples = [trajectory_examples(builder, row, grammar, window) for row in rows]
    flat = [e for ex in examples for e in ex]
    pad = builder.tokenizer.pad_token_id if builder.tokenizer.pad_token_id is not None else 0
    scores = iter(masked_logprobs(model, flat, pad, max_batch_tokens, progress))
    return [[next(scores) for _ in ex] for ex in examples]
