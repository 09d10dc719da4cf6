"""Batched per-token log-probabilities of responses (docs/method.md stage 6 needs them under the
scored policy and under the hindsight model).

:func:`token_logprobs` scores many token sequences in few forward passes (sorted by length,
right-padded batches). :func:`turn_logprobs` scores every response of episodes under the
policy with exactly the context it had when generated (the prompt builder's window and
truncation): consecutive turns whose prompts start at the same turn share one sequence, so a
whole episode usually costs one sequence instead of one prompt per turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hisr_core.agent.prompts import Encoded, PromptBuilder
from hisr_core.rewards.gated_attention import forward_kwargs
from hisr_core.train.engine import lm_parts

Episode = tuple[str, list[tuple[str, str]]]


def episode_of(builder: PromptBuilder, row: Mapping[str, Any], grammar: Sequence[str]) -> Episode:
    """(system text, (observation, response) turns) of a trajectory row, as the policy saw it
    (the system message as ``builder`` writes it)."""
    return (builder.system(row["instruction"], grammar),
            [(t["observation"], t["response"]) for t in row["turns"]])


def length_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices of sequences, longest first, cut into batches whose padded size (rows × the
    longest row) stays within ``max_batch_tokens`` (a longer sequence gets a batch alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, start = [], 0
    while start < len(order):
        rows = max(1, max_batch_tokens // max(lengths[order[start]], 1))
        batches.append(order[start:start + rows])
        start += rows
    return batches


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, right-padded to the longest. Shape: [B, max_b T_b] each.

    Right padding keeps every real token at the position it has in a pass of its own."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[j, :len(s)] = 1
    return ids, mask


def scored_logits(model: nn.Module, ids: torch.Tensor, keep: torch.Tensor,
                  parts: tuple[nn.Module, nn.Linear] | None = None,
                  **extra: torch.Tensor) -> torch.Tensor:
    """Next-token logits at the kept positions only (the rest never reach the LM head).
    ``parts``: :func:`~hisr_core.train.engine.lm_parts` of ``model`` (``None``: its own forward).
    ``extra``: more forward arguments (a gated block's, :func:`forward_kwargs`).

    Shape: ids [B, T] right-padded, keep [B, T-1] bool (position t predicts token t+1) →
    [N, V] float32, N the kept positions in row-major order.
    """
    # No attention mask: with right padding and causal attention a real token never sees a
    # pad, so attention keeps its fast causal path (an explicit mask is materialised). A gated
    # block's all-ones mask is dropped the same way (see forward_kwargs).
    if parts is None:
        return model(input_ids=ids, use_cache=False, **extra).logits[:, :-1][keep].float()
    backbone, head = parts
    hidden = backbone(input_ids=ids, use_cache=False, **extra).last_hidden_state
    return head(hidden[:, :-1][keep]).float()


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` per row. Shape: [N, V], [N] → [N]."""
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@torch.inference_mode()
def token_logprobs(model: PreTrainedModel, seqs: Sequence[Sequence[int]], pad_id: int,
                   max_batch_tokens: int = 8192,
                   score: Sequence[Sequence[int]] | None = None,
                   progress: str | None = None,
                   blocks: Sequence[tuple[int, int, int] | None] | None = None
                   ) -> list[torch.Tensor]:
    """Per sequence, ``log p(x_t | x_<t)`` for t = 1..T-1, or only where ``score[i][t]`` is
    set (then only those positions go through the LM head and the softmax). ``progress``:
    the label of a progress bar over the sequences (none if ``None``). ``blocks``: per
    sequence, the span of a block read through gated attention (:attr:`Encoded.block`).

    Shape: sequence i of length T_i → (T_i - 1,) float32 on CPU, or (M_i,) with M_i the set
    positions t >= 1 of ``score[i]``. Batches hold at most ``max_batch_tokens`` padded tokens
    (rows × longest row).
    """
    if any(len(s) < 1 for s in seqs):
        raise ValueError("every sequence needs at least one token")
    if score is not None and [len(x) for x in score] != [len(s) for s in seqs]:
        raise ValueError("score masks must have the lengths of their sequences")
    device = next(model.parameters()).device
    parts = lm_parts(model)
    out: list[torch.Tensor | None] = [None] * len(seqs)
    bar = tqdm(total=len(seqs), desc=progress, unit="seq", disable=progress is None,
               mininterval=2)
    for batch in length_batches([len(s) for s in seqs], max_batch_tokens):
        ids, _ = right_pad([seqs[i] for i in batch], pad_id)
        keep = torch.zeros((len(batch), ids.shape[1] - 1), dtype=torch.bool)
        for j, i in enumerate(batch):
            keep[j, :len(seqs[i]) - 1] = (torch.tensor(list(score[i][1:]), dtype=torch.bool)
                                          if score is not None else True)
        ids, keep = ids.to(device), keep.to(device)
        extra = forward_kwargs([blocks[i] for i in batch], ids.shape[1], device) if blocks else {}
        logits = scored_logits(model, ids, keep, parts, **extra)
        logp = target_logprobs(logits, ids[:, 1:][keep]).cpu()
        counts = keep.sum(dim=1).tolist()
        for i, piece in zip(batch, torch.split(logp, counts), strict=True):
            out[i] = piece.clone()
        bar.update(len(batch))
    bar.close()
    return [x for x in out if x is not None]


def masked_logprobs(model: PreTrainedModel, encoded: Sequence[Encoded], pad_id: int,
                    max_batch_tokens: int = 8192, progress: str | None = None
                    ) -> list[torch.Tensor]:
    """Per sequence, the log-probs of its masked-in tokens (in order) given everything before
    them. Shape: sequence with M masked tokens (none at position 0) → (M,) float32."""
    if any(enc.response_mask and enc.response_mask[0] for enc in encoded):
        raise ValueError("a masked token at position 0 has no context to be scored from")
    return token_logprobs(model, [enc.input_ids for enc in encoded], pad_id, max_batch_tokens,
                          score=[enc.response_mask for enc in encoded], progress=progress,
                          blocks=[enc.block for enc in encoded])


def scoring_sequences(builder: PromptBuilder, system: str,
                      turns: Sequence[tuple[str, str]]) -> list[Encoded]:
    """Sequences holding every response once (masked in), each after exactly its generation
    prompt: a run of consecutive turns whose prompts begin at the same turn is one sequence
    (each turn its own without ``builder.past_admissible``)."""
    m = len(turns)
    if m == 0:
        return []
    last = builder.prompt(system, turns[:m - 1], turns[m - 1][0])
    if builder.history is None and last.turns[0] == 0:
        firsts = [0] * m  # the longest prompt keeps every turn, so all the shorter ones do
    else:
        firsts = [builder.prompt(system, turns[:k], turns[k][0]).turns[0] for k in range(m)]
    out, k = [], 0
    while k < m:
        j = k
        # Without past lists turn j's observation is shown in full only while it is newest.
        while builder.past_admissible and j + 1 < m and firsts[j + 1] == firsts[k]:
            j += 1
        # Turn k's prompt is this sequence up to its assistant header (the same pieces).
        out.append(builder.encode(system, turns[:j + 1], firsts[k], train_from=k))
        k = j + 1
    return out


def turn_logprobs(model: PreTrainedModel, builder: PromptBuilder,
                  episodes: Sequence[tuple[str, Sequence[tuple[str, str]]]],
                  max_batch_tokens: int = 8192, progress: str | None = None
                  ) -> list[list[torch.Tensor]]:
    """Per episode (system text, (observation, response) turns), per turn k, the log-probs of
    response k's tokens (its end-of-turn marker included) given the context the policy had
    when it generated them. Shape: episode → m tensors of shape (L_k,)."""
    encoded = [(e, enc) for e, (system, turns) in enumerate(episodes)
               for enc in scoring_sequences(builder, system, turns)]
    pad = builder.tokenizer.pad_token_id if builder.tokenizer.pad_token_id is not None else 0
    scores = masked_logprobs(model, [enc for _, enc in encoded], pad, max_batch_tokens,
                             progress)
    per_turn: list[list[list[float]]] = [[[] for _ in turns] for _, turns in episodes]
    for (e, enc), logp in zip(encoded, scores, strict=True):
        owners = [k for k, on in zip(enc.turn_ids, enc.response_mask, strict=True) if on]
        for k, value in zip(owners, logp.tolist(), strict=True):
            per_turn[e][k].append(value)
    return [[torch.tensor(x, dtype=torch.float32) for x in ep] for ep in per_turn]


@torch.inference_mode()
def turn_logprobs_naive(model: PreTrainedModel, builder: PromptBuilder,
                        episodes: Sequence[tuple[str, Sequence[tuple[str, str]]]]
                        ) -> list[list[torch.Tensor]]:
    """The reference for :func:`turn_logprobs`: one forward pass per turn (its generation
    prompt, then its response). Same output shapes."""
    device = next(model.parameters()).device
    out = []
    for system, turns in episodes:
        scores = []
        for k, (obs, resp) in enumerate(turns):
            prompt = builder.prompt(system, turns[:k], obs).input_ids
            target = builder._ids(resp) + builder._asst_end  # as generated: text, end marker
            logits = model(torch.tensor([prompt + target], device=device)).logits[0].float()
            logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1).cpu()
            scores.append(logp.gather(-1, torch.tensor(target)[:, None]).squeeze(-1))
        out.append(scores)
    return out
